"""Shared fixtures for the torchsp tests.

- ``device``: "cpu" always, "cuda" when torch.cuda.is_available() (skipped otherwise),
  so every device-parametrised test runs on the GPU machine and skips cleanly on CPU CI.
- ``random_coords``: unique random (batch, x, y, z) rows, shuffled (not sorted), centred on 0
  so negative coordinates are always present.
- Real scans: ``load_kitti()`` / ``load_lidar()`` read ``<repo>/../shared/data`` (skip if absent;
  the lidar sweep falls back to the copy bundled as torchsp/data/lidar_198k.npz), ``crop_voxels``
  voxelises a small box so the dense float64 reference stays fast on 2 CPU cores.
- ``poison_cuda_cache()``: fills freed blocks of PyTorch's CUDA caching allocator with NaN, so a
  kernel that reads workspace (or output) memory before writing it cannot pass.
"""

import contextlib
import os
import tempfile

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ../shared/data beside the checkout; <repo>/shared/data where only the checkout travels (GPU runs).
SHARED_DATA = next((d for d in (os.path.join(os.path.dirname(REPO), "shared", "data"),
                                os.path.join(REPO, "shared", "data")) if os.path.isdir(d)),
                   os.path.join(os.path.dirname(REPO), "shared", "data"))
BUNDLED_LIDAR = os.path.join(REPO, "torchsp", "data", "lidar_198k.npz")

# Keep the autotuner's on-disk cache out of the user's home during the suite.
os.environ.setdefault("TORCHSP_CACHE_DIR", tempfile.mkdtemp(prefix="torchsp-test-cache-"))

CUDA = torch.cuda.is_available()

# Under pytest-xdist each worker would start torch's whole CPU thread pool for the dense float64
# references: 14 workers x 16 threads on the 16-core GPU host (2026-11-25: 38 of the 695 CUDA
# cases of four files in 570 s).  Each worker takes its share of the cores instead (all 695 in
# 41 s on another machine of the same kind, later that day).
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))
# torch.compile's AOTAutograd cache keys a compiled forward and backward by the forward graph and
# does not hash a custom op's registered backward (pytorch#144344): with it on, the compile tests
# passed against a deliberately broken torchsp/_autograd.py by loading what an earlier run had
# compiled (2026-11-29).  The suite compiles the tree's code; Inductor's graph cache, which hashes
# the traced graphs, stays on.
try:
    import torch._functorch.config as _functorch_config
    if hasattr(_functorch_config, "enable_autograd_cache"):  # torch >= 2.5
        _functorch_config.enable_autograd_cache = False
except ImportError:
    pass

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))]
TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def dynamic_output_shapes():
    """Context for torch.compile(fullgraph=True) over torchsp's ops with data-dependent output
    sizes (out_coords, kernel_map_pairs): torch < 2.10 needs
    torch._dynamo.config.capture_dynamic_output_shape_ops set (newer torch sets it under fullgraph,
    pytorch#163123), as the README tells users; on newer torch nothing, so the suite runs what
    users run."""
    if TORCH_VERSION >= (2, 10):
        return contextlib.nullcontext()
    import torch._dynamo
    return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def random_coords(n, span=5, batches=2, stride=1, seed=0, shift=(0, 0, 0), batch_ids=None):
    """Unique int32 [M, 4] coordinates, M <= n: batch in range(batches) (or batch_ids),
    x, y, z uniform in [-span, span] * stride (+ shift, a multiple of stride), shuffled."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(batches) if batch_ids is None else torch.tensor(batch_ids)
    b = ids[torch.randint(0, len(ids), (n,), generator=g)]
    xyz = torch.randint(-span, span + 1, (n, 3), generator=g)
    st = torch.tensor(stride if isinstance(stride, (tuple, list)) else (stride,) * 3)
    xyz = xyz * st + torch.tensor(shift)
    c = torch.unique(torch.cat([b[:, None], xyz], 1), dim=0)
    perm = torch.randperm(c.shape[0], generator=g)
    return c[perm].int().contiguous()


def plane_coords(lo, hi, z):
    """int32 [(hi - lo)^2, 4] coordinates of every site of the square [lo, hi)^2 at height z in batch 0,
    x slowest: a 3x3x3 map on it has pairs at the 9 offsets of dz = 0 only (18 empty offsets)."""
    r = torch.arange(lo, hi)
    xy = torch.stack(torch.meshgrid(r, r, indexing="ij"), -1).reshape(-1, 2)
    return torch.cat([torch.zeros_like(xy[:, :1]), xy, torch.full_like(xy[:, :1], z)], 1).int()


def dense_cube(lo, hi):
    """int32 [(hi - lo)^3, 4] coordinates of every site of the cube [lo, hi)^3 in batch 0, x slowest:
    interior rows have all 27 offsets of a 3x3x3 kernel (the dense worst case)."""
    r = torch.arange(lo, hi)
    g = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), -1).reshape(-1, 3)
    return torch.cat([torch.zeros(g.shape[0], 1, dtype=torch.long), g], 1).int()


def randn(*shape, seed=0, dtype=torch.float64, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def shared_path(name):
    return os.path.join(SHARED_DATA, name)


def load_kitti():
    """KITTI frame 000008: float32 [N, 4] x, y, z, reflectance (skips if absent)."""
    path = shared_path("kitti_000008.bin")
    if not os.path.exists(path):
        pytest.skip(f"real scan not found: {path}")
    return np.fromfile(path, dtype=np.float32).reshape(-1, 4)


def load_lidar():
    """The outdoor LiDAR sweep: float32 [198130, 3] (shared data, else the bundled copy)."""
    for path in (shared_path("lidar_198k.npz"), BUNDLED_LIDAR):
        if os.path.exists(path):
            return np.load(path)["pc"]
    pytest.skip("lidar_198k.npz not found in ../shared/data nor torchsp/data")


def crop_voxels(points, lo, hi, voxel, batch=0):
    """Unique int32 [M, 4] voxel coordinates (batch, x, y, z) of points with lo <= xyz < hi."""
    xyz = np.asarray(points)[:, :3]
    keep = np.all((xyz >= np.asarray(lo)) & (xyz < np.asarray(hi)), axis=1)
    vox = np.unique(np.floor(xyz[keep] / voxel).astype(np.int64), axis=0)
    c = torch.from_numpy(vox)
    return torch.cat([torch.full((c.shape[0], 1), batch, dtype=torch.int64), c], 1).int()


def lidar_crop():
    """The real-scan crop of the dataflow sweeps: 12 x 12 x 5 m of lidar_198k at 0.1 m, batch 0."""
    return crop_voxels(load_lidar(), lo=(-6.0, -6.0, -2.0), hi=(6.0, 6.0, 3.0), voxel=0.1, batch=0)


def real_scan_layer(coords, geom, cin, cout, dtype, device="cuda"):
    """One layer on real coordinates with its independent float64 references.

    Returns (x SparseTensor [N, cin], KernelMap, out coords [M, 4], w [V, cin, cout], dy [M, cout],
    ref_map [M, V] (the slow reference kernel map, asserted equal to torchsp's), want_y [M, cout],
    want_dx [N, cin]): the gather references of forward and dgrad on ref_map.
    """
    import reference as ref
    import torchsp
    x = torchsp.SparseTensor(randn(coords.shape[0], cin, dtype=dtype, device=device, seed=1), coords)
    km, out, _, _ = torchsp.kmap.get_kernel_map(x, geom)
    ref_map = ref.kernel_map(coords.cpu(), out.cpu(), geom.kernel_size, geom.dilation, geom.padding, (1, 1, 1))
    assert torch.equal(km.nbmap.cpu().long(), ref_map)
    w = randn(km.nbmap.shape[1], cin, cout, dtype=dtype, device=device, seed=2, scale=0.1)
    dy = randn(out.shape[0], cout, dtype=dtype, device=device, seed=3)
    want_y = ref.gather_conv(x.feats.cpu(), ref_map, w.cpu())
    want_dx = ref.gather_conv(dy.cpu(), ref.transpose_map(ref_map, coords.shape[0]), w.cpu().transpose(1, 2))
    return x, km, out, w, dy, ref_map, want_y, want_dx


def poison_cuda_cache():
    """Fill freed blocks of the caching allocator with NaN: workspaces and outputs reuse them."""
    for kb in (65536, 8192, 1024, 256, 64, 16):
        torch.empty(kb << 8, device="cuda").fill_(float("nan"))
    torch.cuda.synchronize()


def rel_err(actual, expected):
    """max |a - e| / max |e| (0 for empty tensors)."""
    actual = actual.detach().double().cpu()
    expected = expected.detach().double().cpu()
    if expected.numel() == 0:
        return 0.0
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
