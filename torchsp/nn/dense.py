"""Conversions between SparseTensors and dense [B, C, X, Y, Z] grids.

Grid index i of axis a holds the voxel at full-resolution coordinate
origin[a] + i * stride[a]; axes are (x, y, z) in that order (torchsp's
coordinate order; OpenPCDet/spconv grids are (z, y, x): permute(0, 1, 4, 3, 2)).
"""

import torch

from .._tracing import tracing
from ..geometry import triple
from ..tensor import SparseTensor
from ._util import check_sparse


def to_dense(input, spatial_shape=None, origin=None, batch_size=None):
    """Scatter feats into a zero-filled dense grid.

    Args:
        input: SparseTensor, feats [N, C], stride t.
        spatial_shape: (X, Y, Z) grid size (or one int); default: the extent of the coordinates.
        origin: 3 ints, the full-resolution coordinate of grid index 0 (a multiple of t);
            default: the per-axis minimum coordinate.
        batch_size: B; default max batch index + 1.
        (Pass all three under torch.compile; the defaults read the data.)
    Returns:
        dense [B, C, X, Y, Z] tensor, input's dtype and device; differentiable w.r.t. feats.
    """
    check_sparse(input, "to_dense")
    c = input.coords.long()
    st = torch.tensor(input.stride, device=c.device)
    org = c[:, 1:].amin(0) if origin is None else torch.tensor(triple(origin, "origin", minimum=-(1 << 31)),
                                                                  device=c.device)
    idx = torch.div(c[:, 1:] - org, st, rounding_mode="floor")
    if spatial_shape is None:
        spatial_shape = [int(v) for v in (idx.amax(0) + 1)] if c.shape[0] else [0, 0, 0]
    spatial_shape = list(triple(spatial_shape, "spatial_shape", minimum=0))
    if batch_size is None:
        batch_size = int(c[:, 0].max()) + 1 if c.shape[0] else 0
    if not tracing() and c.shape[0]:
        hi = torch.tensor(spatial_shape, device=c.device)
        if bool(((idx < 0) | (idx >= hi)).any()):
            raise ValueError(f"to_dense: coordinates fall outside spatial_shape {tuple(spatial_shape)} "
                             f"from origin {org.tolist()}")
    out = input.feats.new_zeros((batch_size, *spatial_shape, input.feats.shape[1]))
    out = out.index_put((c[:, 0], idx[:, 0], idx[:, 1], idx[:, 2]), input.feats)
    return out.permute(0, 4, 1, 2, 3).contiguous()


def from_dense(dense, stride=1, origin=(0, 0, 0), mask=None):
    """Keep the active sites of a dense grid as a SparseTensor.

    Args:
        dense: [B, C, X, Y, Z] float tensor.
        stride: int or 3-tuple, the grid spacing in full-resolution units.
        origin: 3 ints, full-resolution coordinate of grid index 0 (multiples of stride).
        mask: optional bool [B, X, Y, Z] of the sites to keep; default: sites where
            any channel is non-zero.
    Returns:
        SparseTensor with coords int32 [N, 4] = (b, origin + i * stride) in sorted
        (b, x, y, z) order and feats [N, C] (dense's dtype).
    """
    if dense.dim() != 5:
        raise ValueError(f"from_dense: dense must be [B, C, X, Y, Z], got shape {tuple(dense.shape)}")
    stride = triple(stride, "stride")
    if mask is None:
        mask = (dense != 0).any(1)
    if mask.shape != (dense.shape[0], *dense.shape[2:]):
        raise ValueError(f"from_dense: mask must be [B, X, Y, Z] = {(dense.shape[0], *dense.shape[2:])}, "
                         f"got {tuple(mask.shape)}")
    sites = mask.nonzero()
    feats = dense.permute(0, 2, 3, 4, 1)[mask]
    scale = torch.tensor((1, *stride), device=sites.device)
    shift = torch.tensor((0, *triple(origin, "origin", minimum=-(1 << 31))), device=sites.device)
    coords = (sites * scale + shift).int()
    return SparseTensor(feats, coords, stride)
