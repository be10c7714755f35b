"""Small helpers shared by the layers: tracing checks and same-coordinates checks."""

import torch

from .._tracing import tracing
from ..geometry import BATCH_MAX
from ..tensor import SparseTensor

# Upper bound on batch items (csrc/tsp_key.h packs 9 bits of batch). Per-batch
# statistics are accumulated into tensors of this many rows, so their shapes
# never depend on data and torch.compile / torch.jit.trace see static shapes.
NUM_BATCH_SLOTS = BATCH_MAX + 1


def check_sparse(x, where):
    """Raise TypeError unless x is a SparseTensor."""
    if not isinstance(x, SparseTensor):
        raise TypeError(f"{where}: expected a torchsp.SparseTensor, got {type(x).__name__}")


def check_same_coords(a, b, where):
    """Raise ValueError unless SparseTensors a and b live on the same coordinates, in the same order.

    Tensors derived from one input share a cache and name their coordinate set by
    `coord_key`; equal keys in one cache mean equal coordinates, checked for free.
    Otherwise the coordinates are compared in eager mode (one host sync); under
    tracing or compiling only the stride and row count can be checked.
    """
    if a.stride != b.stride:
        raise ValueError(f"{where}: strides differ ({a.stride} vs {b.stride})")
    if a.cache is b.cache and a.coord_key == b.coord_key:
        return
    if a.coords is b.coords:
        return
    if tracing():
        return
    if a.coords.shape != b.coords.shape or not torch.equal(a.coords, b.coords):
        raise ValueError(f"{where}: the tensors are on different coordinates (or in a different order); "
                         "features can only be combined on the same coordinate set")
