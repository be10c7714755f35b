#!/usr/bin/env python3
"""Whole models in one CUDA graph against eager calls, kernel maps cached.

Why: on the H100 machine a MinkUNet step at 0.05 m (173k voxels) is host-bound. Python and
PyTorch issue its ~260 forward and ~870 training-step launches more slowly than the GPU runs
them (2026-11-26, torch.profiler: forward 6.4 ms wall for 4.0 ms of GPU work, training step
27.2 ms wall for 14.3 ms). Where a voxel set recurs, torchsp has everything per coordinate
set cached after the first call. Examples: a fixed-voxel decoder's denoising steps, a static
scene, benchmarks. A forward or training step then issues only launches, and torch.cuda.graph
records them: one replay per call (tests/test_cuda_graphs.py; README "CUDA graphs").

For each model (MinkUNet, SparseResNet21D; torchsp.models) on the real scan
(examples/scan_data.py), the forward (eval, no_grad) and the training step (forward, mean-square
loss, backward, grads set to None) run:
  - eager, and as replays of one graph captured after warm-up calls (torch's recipe: a side
    stream, then torch.cuda.graph);
  - in interleaved rounds, median wall ms per call with CUDA synchronisation;
  - beside the GPU time of an eager call (torch.profiler, kernels and copies summed), which is
    the floor a replay approaches;
  - with the replay's result against the eager call's on the same inputs (output, or one
    weight's gradient): a graph replays the same kernels on the same plans, so it is 0.

    python tools/bench_graphs.py --device cuda --voxel-size 0.05
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import torchsp  # noqa: E402
from kernel_times import device_us  # noqa: E402
from scan_data import load_scan  # noqa: E402
from torchsp.models import MinkUNet, SparseResNet21D  # noqa: E402


def gpu_ms(fn, calls=3):
    """GPU time per call of fn: its kernels, copies and memsets summed (kernel_times.device_us), ms."""
    return sum(device_us(fn, calls).values()) / 1e3


def wall_ms(fn, calls):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e3


def capture(fn, warmup):
    """(graph, fn's result inside it) after `warmup` eager calls on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


MODELS = {"minkunet": lambda: MinkUNet(4, 19, cr=1.0), "resnet21d": lambda: SparseResNet21D(4)}


def model_coords(name, coords):
    """coords [N, 4] as model `name` takes them: SparseResNet21D wants voxel indices >= 0 (spconv's
    grid), so x, y, z are shifted to start at 0; MinkUNet takes them as they are."""
    if name != "resnet21d":
        return coords
    c = coords.clone()
    c[:, 1:] -= c[:, 1:].amin(0)
    return c


def write_json(path, args, rows):
    """rows (dicts) with the GPU's name, torch's version and the arguments, as JSON at path (None:
    nothing written)."""
    if path:
        import json
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, args=vars(args), rows=rows),
                      f, indent=1)


def run(name, model, x, train, args):
    model.train(train)
    probe = next(p for p in model.parameters() if p.dim() == 3)  # a conv weight: its grad is compared

    def call():
        if not train:
            with torch.no_grad():
                out = model(x)
            return out if isinstance(out, torch.Tensor) else out.feats
        model.zero_grad(set_to_none=True)
        out = model(x)
        out = out if isinstance(out, torch.Tensor) else out.feats
        out.float().square().mean().backward()
        return probe.grad

    graph, out = capture(call, args.warmup)
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    eager_out = call().clone()
    err = rel(replayed, eager_out)
    eager, replay = [], []
    for _ in range(args.rounds):
        eager.append(wall_ms(call, args.calls))
        replay.append(wall_ms(graph.replay, args.calls))
    gpu = gpu_ms(call)
    e, r = statistics.median(eager), statistics.median(replay)
    kind = "train step" if train else "forward"
    print(f"{name:10s} {kind:10s} {e:9.2f} {r:9.2f} {e / r:7.2f}x {gpu:9.2f} {err:9.1e}", flush=True)
    return dict(model=name, mode=kind, eager_ms=e, graph_ms=r, speedup=e / r, gpu_ms=gpu, rel_err=err)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda"])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--voxel-size", type=float, default=0.05)
    p.add_argument("--models", default="minkunet,resnet21d")
    p.add_argument("--algo", default="0,0,0,0",
                   help="fixed dataflow for every layer (README), or 'auto' for the tuner (measured in the warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.algo != "auto":
        torchsp.tune.set_fixed([int(v) for v in args.algo.split(",")])
    dtype = getattr(torch, args.dtype)
    feats, coords, _ = load_scan(args.voxel_size, None, device="cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {coords.shape[0]} voxels at "
          f"{args.voxel_size} m, {args.dtype}, algo {args.algo}; median of {args.rounds} rounds x {args.calls} calls")
    print(f"{'model':10s} {'mode':10s} {'eager ms':>9s} {'graph ms':>9s} {'speedup':>8s} {'GPU ms':>9s} {'rel err':>9s}")
    rows = []
    for name in args.models.split(","):
        model, c = MODELS[name]().cuda().to(dtype), model_coords(name, coords)
        x = torchsp.SparseTensor(feats.to(dtype), c)  # one tensor: maps and plans cached on it
        for train in (False, True):
            rows.append(run(name, model, x, train, args))
    write_json(args.json, args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
