"""Layers on SparseTensors."""

from .conv import SparseConv3d

from .activation import Dropout, LeakyReLU, Linear, ReLU, SiLU, relu
from .combine import add, cat
from .crop import crop
from .dense import from_dense, to_dense
from .norm import BatchNorm, GroupNorm, SparseBatchNorm, group_norm
from .pooling import (AvgPool3d, GlobalAvgPool, GlobalMaxPool, MaxPool3d, avg_pool3d, global_avg_pool,
                      global_max_pool, max_pool3d)
from .sequential import Sequential

__all__ = [
    "SparseConv3d",
    "BatchNorm", "SparseBatchNorm", "GroupNorm", "group_norm",
    "ReLU", "LeakyReLU", "SiLU", "Dropout", "Linear", "relu",
    "MaxPool3d", "AvgPool3d", "GlobalAvgPool", "GlobalMaxPool",
    "max_pool3d", "avg_pool3d", "global_avg_pool", "global_max_pool",
    "cat", "add", "crop", "to_dense", "from_dense", "Sequential",
]
