"""Inference timing of MinkUNet and SparseResNet21D on the bundled real scan.

    python examples/infer.py                                    # CPU, 0.5 m voxels
    python examples/infer.py --device cuda --voxel-size 0.05 --dtype float16 --cr 1.0

For each model: the first forward (builds and caches the kernel maps, tunes),
then the median of --repeats forwards on a fresh SparseTensor (maps rebuilt)
and of a training step (forward + backward), in milliseconds.
"""

import argparse
import statistics
import time

import torch

import torchsp
from torchsp.models import MinkUNet, SparseResNet21D

from scan_data import load_scan


def timed(fn, device, repeats):
    """Median wall time in ms of fn() over `repeats` calls (synchronising CUDA)."""
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--voxel-size", type=float, default=0.5)
    p.add_argument("--half-width", type=float, default=None)
    p.add_argument("--cr", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--models", default="minkunet,resnet21d")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    feats, coords, _ = load_scan(args.voxel_size, args.half_width, device=args.device)
    feats = feats.to(dtype)
    print(f"scan: {coords.shape[0]} voxels at {args.voxel_size} m on {args.device}, {args.dtype}")
    index_coords = coords.clone()
    index_coords[:, 1:] -= index_coords[:, 1:].amin(0)  # SparseResNet21D expects voxel indices >= 0
    models = {"minkunet": (MinkUNet(4, 19, cr=args.cr), coords),
              "resnet21d": (SparseResNet21D(4), index_coords)}
    for name in args.models.split(","):
        model, c = models[name]
        model = model.to(args.device, dtype)

        def forward():
            out = model(torchsp.SparseTensor(feats, c))
            return out if isinstance(out, torch.Tensor) else out.feats

        def train_step():
            forward().float().square().mean().backward()

        model.eval()
        with torch.no_grad():
            first = timed(forward, args.device, 1)
            fwd = timed(forward, args.device, args.repeats)
        model.train()
        step = timed(train_step, args.device, args.repeats)
        print(f"{name:10s} first forward {first:9.1f} ms   forward {fwd:9.1f} ms   training step {step:9.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
