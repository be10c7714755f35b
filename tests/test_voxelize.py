"""torchsp.voxelize and torchsp.sparse_collate against numpy (floor, unique, inverse)."""

import numpy as np
import pytest
import torch

import torchsp
from conftest import load_kitti


def _np_voxelize(points, voxel):
    """numpy: unique rows of (batch, floor(xyz / voxel)), sorted, and the inverse index."""
    if points.shape[1] == 3:
        points = np.concatenate([np.zeros((points.shape[0], 1), points.dtype), points], 1)
    idx = np.concatenate([points[:, :1].astype(np.int64), np.floor(points[:, 1:] / voxel).astype(np.int64)], 1)
    return np.unique(idx, axis=0, return_inverse=True)


@pytest.mark.parametrize("with_batch", [False, True])
def test_voxelize_matches_numpy(with_batch):
    g = torch.Generator().manual_seed(0)
    pts = (torch.rand(2000, 3, generator=g, dtype=torch.float64) - 0.5) * 4  # negative values included
    if with_batch:
        pts = torch.cat([torch.randint(0, 3, (2000, 1), generator=g).double(), pts], 1)
    coords, inverse = torchsp.voxelize(pts, 0.25)
    want, want_inv = _np_voxelize(pts.numpy(), 0.25)
    assert coords.dtype == torch.int32 and inverse.dtype == torch.int64
    assert np.array_equal(coords.numpy(), want)
    assert np.array_equal(inverse.numpy(), want_inv.reshape(-1))
    torchsp.SparseTensor(torch.zeros(coords.shape[0], 1), coords)  # valid, no duplicates


def test_voxelize_real_scan():
    pts = torch.from_numpy(load_kitti()[:, :3].copy())
    coords, inverse = torchsp.voxelize(pts, 0.1)
    idx = torch.floor(pts / 0.1).long()  # same float32 arithmetic
    assert torch.equal(coords[inverse, 1:].long(), idx)
    assert torch.equal(coords[:, 1:].long(), torch.unique(idx, dim=0))
    assert 9000 < coords.shape[0] < 11000  # ../shared/data/README.md: 9,882 voxels at 0.1 m


def test_voxelize_errors():
    with pytest.raises(TypeError, match="points"):
        torchsp.voxelize(torch.zeros(5, 3, dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="points"):
        torchsp.voxelize(torch.zeros(5, 2), 0.1)
    with pytest.raises(ValueError, match="voxel_size"):
        torchsp.voxelize(torch.zeros(5, 3), 0.0)


def test_voxelize_empty():
    coords, inverse = torchsp.voxelize(torch.zeros(0, 3), 0.1)
    assert coords.shape == (0, 4) and coords.dtype == torch.int32 and inverse.shape == (0,)


def test_sparse_collate():
    a = torch.tensor([[0, 1, 2], [-3, 4, 5]], dtype=torch.int32)
    b = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    fa, fb = torch.randn(2, 3), torch.randn(1, 3)
    coords, feats = torchsp.sparse_collate([(a, fa), (b, fb)])
    assert coords.dtype == torch.int32
    assert torch.equal(coords, torch.tensor([[0, 0, 1, 2], [0, -3, 4, 5], [1, 0, 1, 2]], dtype=torch.int32))
    assert torch.equal(feats, torch.cat([fa, fb]))
    torchsp.SparseTensor(feats, coords)
    with pytest.raises(ValueError, match="coords|sample"):
        torchsp.sparse_collate([(torch.zeros(2, 4, dtype=torch.int32), fa)])
    with pytest.raises(ValueError, match="feats|sample"):
        torchsp.sparse_collate([(a, fb)])
