"""Shared by the examples: the bundled real LiDAR scan as a voxelised SparseTensor input.

load_scan() voxelises torchsp/data/lidar_198k.npz (float32 [198130, 3], metres),
optionally cropped to a square around the sensor, and makes synthetic per-voxel
labels (height bins of the voxel's mean z), so a segmentation network has
something learnable without a labelled dataset.  load_batch() stacks several shifted
voxelisations of it into one batch (tools/bench_models.py, tools/bench_whole.py).
"""

import torch

import torchsp
from torchsp.data import load_lidar


def load_scan(voxel_size=0.2, half_width=None, num_classes=5, device="cpu", batch_index=0, shift=0.0):
    """Voxelised scan.

    Args:
        voxel_size: metres per voxel.
        half_width: keep points with |x|, |y| < half_width metres (after `shift` in x); None keeps all.
        num_classes: number of height bins (quantiles of the voxel heights).
        device: where the returned tensors live.
        batch_index: value of coords[:, 0].
        shift: metres added to x before cropping (gives different crops of the one scan).
    Returns:
        feats float32 [N, 4] (mean x, y, z of the voxel's points, point count / 10),
        coords int32 [N, 4] (batch, x, y, z voxel indices), labels int64 [N].
    """
    pc = torch.from_numpy(load_lidar())
    pc = pc + torch.tensor([shift, 0.0, 0.0])
    if half_width is not None:
        pc = pc[(pc[:, 0].abs() < half_width) & (pc[:, 1].abs() < half_width)]
    coords, inverse = torchsp.voxelize(pc, voxel_size)
    n = coords.shape[0]
    count = torch.zeros(n).index_add_(0, inverse, torch.ones(pc.shape[0]))
    mean = torch.zeros(n, 3).index_add_(0, inverse, pc) / count[:, None]
    feats = torch.cat([mean, count[:, None] / 10], 1)
    edges = torch.quantile(mean[:, 2], torch.linspace(0, 1, num_classes + 1)[1:-1])
    labels = torch.bucketize(mean[:, 2].contiguous(), edges)
    coords[:, 0] = batch_index
    return feats.to(device), coords.to(device), labels.to(device)


def load_batch(voxel_size, batch, device="cpu", dtype=torch.float32):
    """A batch of `batch` voxelisations of the scan, as the benchmarks stack them: item i has
    batch index i and its points shifted by 0.37 i metres in x, so each item's voxels differ.

    Returns feats [N, 4] in `dtype` and coords int32 [N, 4] (batch, x, y, z), items in order."""
    items = [load_scan(voxel_size, None, device=device, batch_index=i, shift=0.37 * i) for i in range(batch)]
    return torch.cat([f for f, _, _ in items]).to(dtype), torch.cat([c for _, c, _ in items])
