"""Demo: a small sparse U-Net on the bundled real LiDAR scan, checked against the reference.

    python examples/demo.py [--device cpu|cuda] [--voxel-size 0.2] [--dtype float32]

Voxelises torchsp/data/lidar_198k.npz, runs a 2-level U-Net (submanifold 3x3x3 convs,
K=2 stride-2 downsampling, transposed upsampling, skip concatenation), compares the
output with torchsp.reference (pure PyTorch, float64, no torchsp ops), and prints
timings of the forward pass with and without kernel-map building.
"""

import argparse
import time

import torch
from torch import nn

import torchsp
from torchsp.data import load_lidar
from torchsp.nn import SparseConv3d
from torchsp.reference import reference_conv3d


def relu(x):
    return x.replace(torch.relu(x.feats))


class TinyUNet(nn.Module):
    """stem 16 -> down 32 -> down 64 -> up 32 (+skip) -> up 16 (+skip) -> head."""

    def __init__(self, cin, classes=4):
        super().__init__()
        self.stem = SparseConv3d(cin, 16, 3)
        self.down1 = SparseConv3d(16, 32, 2, stride=2)
        self.enc1 = SparseConv3d(32, 32, 3)
        self.down2 = SparseConv3d(32, 64, 2, stride=2)
        self.enc2 = SparseConv3d(64, 64, 3)
        self.up2 = SparseConv3d(64, 32, 2, stride=2, transposed=True)
        self.dec2 = SparseConv3d(64, 32, 3)
        self.up1 = SparseConv3d(32, 16, 2, stride=2, transposed=True)
        self.dec1 = SparseConv3d(32, 16, 3)
        self.head = SparseConv3d(16, classes, 1, bias=True)

    def forward(self, x):
        s0 = relu(self.stem(x))
        s1 = relu(self.enc1(relu(self.down1(s0))))
        s2 = relu(self.enc2(relu(self.down2(s1))))
        u1 = relu(self.up2(s2))
        u1 = relu(self.dec2(u1.replace(torch.cat([u1.feats, s1.feats], 1))))
        u0 = relu(self.up1(u1))
        u0 = relu(self.dec1(u0.replace(torch.cat([u0.feats, s0.feats], 1))))
        return self.head(u0)


def reference_forward(net, feats, coords):
    """The same network through torchsp.reference (float64, pure PyTorch)."""

    def conv(layer, f, c, t, finer=None):
        y, oc, ot = reference_conv3d(f, c, t, layer.weight, layer.kernel_size, layer.stride, layer.padding,
                                     layer.dilation, layer.transposed, finer_coords=finer)
        if layer.bias is not None:
            y = y + layer.bias.double()
        return y, oc, ot

    r = torch.relu
    f0, c0, t0 = conv(net.stem, feats, coords, (1, 1, 1))
    f0 = r(f0)
    f1, c1, t1 = conv(net.down1, f0, c0, t0)
    f1 = r(conv(net.enc1, r(f1), c1, t1)[0])
    f2, c2, t2 = conv(net.down2, f1, c1, t1)
    f2 = r(conv(net.enc2, r(f2), c2, t2)[0])
    u1 = r(conv(net.up2, f2, c2, t2, finer=c1)[0])
    u1 = r(conv(net.dec2, torch.cat([u1, f1], 1), c1, t1)[0])
    u0 = r(conv(net.up1, u1, c1, t1, finer=c0)[0])
    u0 = r(conv(net.dec1, torch.cat([u0, f0], 1), c0, t0)[0])
    return conv(net.head, u0, c0, t0)[0]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device, repeat):
    times = []
    for _ in range(repeat):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--voxel-size", type=float, default=0.2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    points = torch.from_numpy(load_lidar())
    coords, inverse = torchsp.voxelize(points, args.voxel_size)
    # Features per voxel: mean point offset inside the voxel, and the point count (log).
    rel = points / args.voxel_size - torch.floor(points / args.voxel_size)
    mean = torch.zeros(coords.shape[0], 3).index_reduce_(0, inverse, rel, "mean", include_self=False)
    count = torch.zeros(coords.shape[0]).index_add_(0, inverse, torch.ones(points.shape[0]))
    feats = torch.cat([mean, torch.log1p(count)[:, None]], 1)
    print(f"scan: {points.shape[0]} points -> {coords.shape[0]} voxels at {args.voxel_size} m; "
          f"device {device}, {args.dtype}")

    net = TinyUNet(feats.shape[1]).to(device=device, dtype=dtype).eval()
    coords_d, feats_d = coords.to(device), feats.to(device=device, dtype=dtype)
    with torch.no_grad():
        out = net(torchsp.SparseTensor(feats_d, coords_d))
        ref = reference_forward(net, feats_d.double(), coords_d)
    err = (out.feats.double() - ref).norm() / ref.norm()
    tol = 1e-5 if dtype == torch.float32 and device.type == "cpu" else (5e-3 if dtype == torch.float32 else 3e-2)
    status = "OK" if err < tol and torch.isfinite(out.feats).all() else "MISMATCH"
    print(f"check vs pure-PyTorch float64 reference: relative L2 error {err:.2e} (tolerance {tol:.0e}) {status}")

    with torch.no_grad():
        x0 = torchsp.SparseTensor(feats_d, coords_d)
        net(x0)  # builds and caches every kernel map of x0

        def full():
            net(torchsp.SparseTensor(feats_d, coords_d, check=False))

        def cached():
            net(x0)

        t_full = median_time(full, device, args.repeat)
        t_cached = median_time(cached, device, args.repeat)
    print(f"forward with map building: {t_full * 1e3:.2f} ms; with maps cached: {t_cached * 1e3:.2f} ms "
          f"(median of {args.repeat})")
    if status != "OK":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
