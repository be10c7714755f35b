"""One question many modules ask: is a tracer or compiler running right now?

While torch.compile, torch.jit.trace or TorchScript runs, torchsp reads no data
(no host syncs, no value checks, no measuring) and builds no memos; the kernel
map, plan and tuner modules, SparseTensor and the layers all ask here.
"""

import torch


def tracing():
    """True under torch.jit.trace / torch.jit.script or torch.compile (dynamo, export)."""
    if torch.jit.is_tracing() or torch.jit.is_scripting():
        return True
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return bool(compiler.is_compiling())
    return bool(torch._dynamo.is_compiling())
