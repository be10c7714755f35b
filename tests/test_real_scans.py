"""Real scans (../shared/data, or the lidar sweep bundled with torchsp): crops of the
KITTI frame and the outdoor LiDAR sweep, submanifold and strided convs against the
reference kernel map (both search methods) and the dense float64 reference.

Crops keep the dense grid small (a few thousand voxels, <= ~100 x 100 x 40 cells).
"""

import pytest
import torch

import reference as ref
import torchsp
from conftest import crop_voxels, load_kitti, load_lidar, randn, rel_err

F = torchsp.functional
ops = torch.ops.torchsp


def _scan(name):
    if name == "kitti":
        return crop_voxels(load_kitti(), lo=(8.0, -4.0, -3.0), hi=(16.0, 4.0, 2.0), voxel=0.1)
    if name == "lidar":
        return crop_voxels(load_lidar(), lo=(-4.0, -4.0, -2.0), hi=(4.0, 4.0, 3.0), voxel=0.1, batch=1)
    # a batch of two real scans; the lidar crop is moved (lattice-aligned) over the KITTI box so the
    # dense reference grid stays small
    lidar = _scan("lidar") + torch.tensor([0, 120, 0, -20], dtype=torch.int32)
    both = torch.cat([_scan("kitti"), lidar], 0)
    return both[torch.randperm(both.shape[0], generator=torch.Generator().manual_seed(0))]


SCANS = ["kitti", "lidar", "batch"]
CONVS = {
    "sub_k3": dict(kernel_size=3),
    "sub_k5": dict(kernel_size=5),
    "str_k2_s2": dict(kernel_size=2, stride=2),
    "str_k3_s2": dict(kernel_size=3, stride=2),
}


@pytest.mark.parametrize("scan", SCANS)
def test_scan_is_real_and_sized(scan):
    c = _scan(scan)
    assert 1500 <= c.shape[0] <= 20000, c.shape
    assert bool((c[:, 1:] < 0).any()), "crops straddle the sensor: negative coordinates expected"
    x = ref.kernel_map(c, c, 3, 1, 1, 1)
    mean_nb = float((x >= 0).sum()) / c.shape[0] - 1
    assert mean_nb > 1.5, f"too sparse to exercise the maps ({mean_nb:.2f} neighbours)"


@pytest.mark.parametrize("method", [0, 1])
@pytest.mark.parametrize("conv", list(CONVS))
@pytest.mark.parametrize("scan", SCANS)
def test_scan_kernel_map(scan, conv, method, device):
    c = _scan(scan).to(device)
    kw = CONVS[conv]
    k = ref.triple(kw["kernel_size"])
    s = ref.triple(kw.get("stride", 1))
    p = list(ref.default_padding(k, (1, 1, 1)))
    if s == (1, 1, 1):
        out = c
    else:
        out = ops.out_coords(c, list(k), [1, 1, 1], p, [1, 1, 1], 1, list(s), False)
        assert torch.equal(out.cpu(), ref.active_sites(c, 1, k, s))
    nbmap = ops.kernel_map(c, out, list(k), [1, 1, 1], p, [1, 1, 1], 1, method)
    assert torch.equal(nbmap.cpu().long(), ref.kernel_map(c, out, k, 1, p, 1))


@pytest.mark.parametrize("conv", list(CONVS))
@pytest.mark.parametrize("scan", SCANS)
def test_scan_conv_vs_reference_map(scan, conv, device):
    """Features against a gather over the reference kernel map (all scans and kernels)."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    tol = 1e-12 if dtype == torch.float64 else 5e-3
    c = _scan(scan).to(device)
    kw = CONVS[conv]
    k = ref.triple(kw["kernel_size"])
    cin, cout = 8, 8
    x = torchsp.SparseTensor(randn(c.shape[0], cin, seed=1, dtype=dtype, device=device), c)
    w = randn(k[0] ** 3, cin, cout, seed=2, dtype=dtype, device=device, scale=(k[0] ** 3 * cin) ** -0.5)
    y = F.sparse_conv3d(x, w, **kw)
    s = kw.get("stride", 1)
    want_coords = c.cpu() if s == 1 else ref.active_sites(c, 1, k, s)
    assert torch.equal(y.coords.cpu(), want_coords)
    nbmap = ref.kernel_map(c.cpu(), want_coords, k, 1, ref.default_padding(k, (1, 1, 1)), 1)
    assert rel_err(y.feats, ref.gather_conv(x.feats.cpu(), nbmap, w.cpu())) <= tol


@pytest.mark.parametrize("conv", ["sub_k3", "str_k3_s2", "str_k2_s2"])
@pytest.mark.parametrize("scan", SCANS)
def test_scan_conv_vs_dense(scan, conv, device):
    dtype = torch.float64 if device == "cpu" else torch.float32
    tol = 1e-12 if dtype == torch.float64 else 5e-3
    c = _scan(scan).to(device)
    kw = CONVS[conv]
    cin, cout = 2, 3
    x = torchsp.SparseTensor(randn(c.shape[0], cin, seed=1, dtype=dtype, device=device), c)
    v = ref.triple(kw["kernel_size"])[0] ** 3
    w = randn(v, cin, cout, seed=2, dtype=dtype, device=device, scale=(v * cin) ** -0.5)
    y = F.sparse_conv3d(x, w, **kw)
    s = kw.get("stride", 1)
    want_coords = c.cpu() if s == 1 else ref.active_sites(c, 1, kw["kernel_size"], s)
    assert torch.equal(y.coords.cpu(), want_coords)
    want = ref.dense_conv(x.feats.cpu(), c.cpu(), 1, w.cpu(), ref.triple(kw["kernel_size"]), want_coords, stride=s)
    assert rel_err(y.feats, want) <= tol


def test_scan_unet_round_trip(device):
    """sub -> down (K3, s2) -> sub -> up (K3, s2) on the batched real scans, vs the dense reference chain."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    tol = 1e-10 if dtype == torch.float64 else 5e-3
    c = _scan("batch").to(device)
    x = torchsp.SparseTensor(randn(c.shape[0], 2, seed=3, dtype=dtype, device=device), c)
    ws = [randn(27, 2, 2, seed=10 + i, dtype=dtype, device=device, scale=0.3) for i in range(4)]
    a = F.sparse_conv3d(x, ws[0], 3)
    b = F.sparse_conv3d(a, ws[1], 3, stride=2)
    b2 = F.sparse_conv3d(b, ws[2], 3)
    u = F.sparse_conv3d(b2, ws[3], 3, stride=2, transposed=True)
    assert torch.equal(u.coords, c)
    cc = c.cpu()
    wd = [w.cpu() for w in ws]
    ra = ref.dense_conv(x.feats.cpu(), cc, 1, wd[0], (3, 3, 3), cc)
    down = ref.active_sites(cc, 1, 3, 2)
    rb = ref.dense_conv(ra, cc, 1, wd[1], (3, 3, 3), down, stride=2)
    rb2 = ref.dense_conv(rb, down, 2, wd[2], (3, 3, 3), down)
    ru = ref.dense_conv(rb2, down, 2, wd[3], (3, 3, 3), cc, stride=2, transposed=True)
    assert rel_err(u.feats, ru) <= tol


def test_bundled_lidar_is_the_shared_scan():
    """torchsp/data/lidar_198k.npz (bundled for the demo) is the real sweep of ../shared/data."""
    import os

    import numpy as np

    from conftest import BUNDLED_LIDAR, shared_path

    if not os.path.exists(BUNDLED_LIDAR):
        pytest.skip("bundled scan not present")
    pc = np.load(BUNDLED_LIDAR)["pc"]
    assert pc.shape == (198130, 3) and pc.dtype == np.float32
    if os.path.exists(shared_path("lidar_198k.npz")):
        assert np.array_equal(pc, np.load(shared_path("lidar_198k.npz"))["pc"])
