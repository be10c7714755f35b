"""torchsp: spatially sparse 3D convolution for PyTorch, on CPU and NVIDIA GPUs.

    import torchsp
    x = torchsp.SparseTensor(feats, coords)              # feats [N, C], coords int32 [N, 4]
    conv = torchsp.nn.SparseConv3d(C, 32, kernel_size=3)  # submanifold
    y = conv(x)

Ops live in torch.ops.torchsp (see torchsp.ops), with fake kernels and autograd
registered, so models trace under torch.compile(fullgraph=True) and torch.jit.trace.
"""

from ._loader import load_library as _load_library

_build_info = _load_library()

from . import _autograd, _fake  # noqa: E402,F401  (registrations)
from . import functional, kmap, nn, ops, plan  # noqa: E402,F401
from .tensor import SparseCache, SparseTensor  # noqa: E402
from .voxelize import sparse_collate, voxelize  # noqa: E402

__version__ = _build_info.VERSION

__all__ = ["SparseTensor", "SparseCache", "voxelize", "sparse_collate", "functional", "nn", "ops", "kmap"]
