"""One question many modules ask: is a tracer or compiler running right now?

While torch.compile, torch.jit.trace or TorchScript runs, torchsp reads no data
(no host syncs, no value checks, no measuring) and builds no memos; the kernel
map, plan and tuner modules, SparseTensor and the layers all ask here.
"""

import torch

# Looked up once: every layer call asks, and the attribute walks cost more than the answers
# (~0.4 us of 0.6 on a 2-core x86 host).  torch.compile recognises these functions by identity.
_is_tracing = torch.jit.is_tracing
_is_scripting = torch.jit.is_scripting
_compiler = getattr(torch, "compiler", None)
_is_compiling = (_compiler.is_compiling if _compiler is not None and hasattr(_compiler, "is_compiling")
                 else torch._dynamo.is_compiling)


def tracing():
    """True under torch.jit.trace / torch.jit.script or torch.compile (dynamo, export)."""
    return _is_tracing() or _is_scripting() or bool(_is_compiling())


def compiling():
    """True under torch.compile or torch.export (dynamo), not under the TorchScript tracers."""
    return bool(_is_compiling())


_is_capturing = torch.cuda.is_current_stream_capturing


def capturing(t):
    """True while the current CUDA stream is being captured into a CUDA graph and `t` (a tensor
    the call works on) is on CUDA, outside tracers (dynamo cannot trace the question, and traced
    code caches nothing).  Asked only where something would be built and cached (a kernel map, a
    row plan, a tuner measurement), never on a cached call's path."""
    return t.is_cuda and not tracing() and _is_capturing()


def refuse_under_capture(t, what):
    """Raise RuntimeError naming `what` when capturing(t): whatever torchsp builds lazily and
    caches would, under capture, be recorded into the graph without running (eager calls would
    then read it unfilled), or would synchronise with the host, which breaks the capture."""
    if capturing(t):
        raise RuntimeError(
            f"torchsp: {what} would be built while a CUDA graph is being captured: its kernels only run "
            "at replay and some need a host synchronisation. Run the same calls once eagerly on these "
            "coordinates before capturing (a forward, and a backward for a training step), so the kernel "
            "maps, row plans and pair lists exist.")
