"""Turning point clouds into voxel coordinates, and batching scans.

voxelize() floors points to voxel indices and keeps one row per occupied voxel,
sorted by packed key (deterministic), with the point-to-voxel index so features
can be pooled (e.g. with torch.Tensor.index_reduce_ or scatter_reduce).
"""

import torch

from .geometry import BATCH_MAX, COORD_MAX, COORD_MIN, pack_keys, unpack_keys


def voxelize(points, voxel_size, origin=None):
    """Unique voxel coordinates of a point cloud.

    Args:
        points: float [N, 3] (x, y, z) or [N, 4] (batch, x, y, z) tensor.
        voxel_size: float or 3 floats, in the units of the points.
        origin: optional 3 floats subtracted before flooring.
    Returns:
        coords: int32 [M, 4] (batch, x, y, z), unique, sorted by (batch, x, y, z).
        inverse: int64 [N], the row of coords each point falls in.
    """
    if not isinstance(points, torch.Tensor) or not points.is_floating_point():
        raise TypeError("voxelize: points must be a floating-point tensor")
    if points.dim() != 2 or points.shape[1] not in (3, 4):
        raise ValueError(f"voxelize: points must be [N, 3] or [N, 4] (batch, x, y, z), got {tuple(points.shape)}")
    if points.shape[1] == 4:
        batch = points[:, 0].long()
        xyz = points[:, 1:]
    else:
        batch = torch.zeros(points.shape[0], dtype=torch.long, device=points.device)
        xyz = points
    vs = torch.as_tensor(voxel_size, dtype=xyz.dtype, device=xyz.device).expand(3)
    if bool((vs <= 0).any()):
        raise ValueError(f"voxelize: voxel_size must be positive, got {voxel_size}")
    if origin is not None:
        xyz = xyz - torch.as_tensor(origin, dtype=xyz.dtype, device=xyz.device)
    idx = torch.floor(xyz / vs).long()
    if points.shape[0] > 0:
        if int(idx.min()) < COORD_MIN or int(idx.max()) > COORD_MAX:
            raise ValueError(f"voxelize: voxel indices must be in [{COORD_MIN}, {COORD_MAX}]; use a larger voxel_size")
        if int(batch.min()) < 0 or int(batch.max()) > BATCH_MAX:
            raise ValueError(f"voxelize: batch index must be in [0, {BATCH_MAX}]")
    keys = pack_keys(torch.cat([batch[:, None], idx], dim=1))
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    return unpack_keys(uniq), inverse


def sparse_collate(samples):
    """Batch scans: a list of (coords [Mi, 3] int, feats [Mi, C]) -> (coords [sum Mi, 4] int32, feats [sum Mi, C]).

    The batch index of sample i is i.
    """
    if len(samples) == 0:
        raise ValueError("sparse_collate: samples is empty")
    coords, feats = [], []
    for i, (c, f) in enumerate(samples):
        if c.dim() != 2 or c.shape[1] != 3:
            raise ValueError(f"sparse_collate: sample {i} coords must be [M, 3], got {tuple(c.shape)}")
        if f.shape[0] != c.shape[0]:
            raise ValueError(f"sparse_collate: sample {i} has {c.shape[0]} coords but {f.shape[0]} feats")
        b = torch.full((c.shape[0], 1), i, dtype=torch.int32, device=c.device)
        coords.append(torch.cat([b, c.int()], dim=1))
        feats.append(f)
    return torch.cat(coords, 0), torch.cat(feats, 0)
