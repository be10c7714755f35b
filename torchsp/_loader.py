"""Load the compiled torchsp library, refusing a build made for another torch.

A C++ extension is tied to the torch it was compiled against; loading it into
another one fails with an undefined symbol at best.  setup.py records the
versions in torchsp/_build_info.py, and this module compares them before the
shared object is loaded, so the error says what to rebuild.
"""

import importlib

import torch


def _base(version):
    return version.split("+")[0]


def load_library():
    """Import torchsp._C (which registers the torch.ops.torchsp.* kernels)."""
    try:
        info = importlib.import_module("torchsp._build_info")
    except ImportError as e:
        raise ImportError(
            "torchsp: the compiled library is missing; build it with "
            "`pip install --no-build-isolation .` in the torchsp source tree"
        ) from e
    running_cuda = torch.version.cuda
    if _base(info.TORCH_VERSION) != _base(torch.__version__) or (
        info.WITH_CUDA and info.CUDA_VERSION != running_cuda
    ):
        raise ImportError(
            f"torchsp was built for torch {info.TORCH_VERSION} (CUDA {info.CUDA_VERSION}) but "
            f"torch {torch.__version__} (CUDA {running_cuda}) is running; rebuild torchsp with "
            "`pip install --no-build-isolation --force-reinstall --no-deps .`"
        )
    try:
        importlib.import_module("torchsp._C")
    except ImportError as e:
        raise ImportError(
            f"torchsp: could not load the compiled library built for torch {info.TORCH_VERSION}: {e}"
        ) from e
    return info
