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
