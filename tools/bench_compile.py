#!/usr/bin/env python3
"""Whole models under torch.compile against eager calls, on new voxels every call.

Why: a training loop or a stream of scans gives new coordinates every call, so every kernel map,
output coordinate set and row plan is built again, and the eager call is host-bound (docs/performance-log.md,
2026-11-27: a MinkUNet training step on the H100 machine took ~40 ms of wall time for ~17 ms of
GPU time). torch.compile(fullgraph=True) traces the whole model, map building included, into one
graph with fewer launches and fused pointwise work; mode="reduce-overhead" also replays CUDA
graphs between the data-dependent ops (strided convs' output coordinates), per set of sizes.

For each model (MinkUNet, SparseResNet21D; torchsp.models) and each step (forward in eval under
no_grad; training step: forward, mean-square loss, backward, grads set to None), a fresh
SparseTensor every call (nothing cached), on four voxelisations of the real scan taken in turn
(examples/scan_data.py, x shifted by 0.37 m each: 4 sizes):
  - eager, torch.compile(fullgraph=True, dynamic=True) and, with --modes, mode="reduce-overhead";
  - the compile time (first call) and the first call on each of the other 3 sizes ("first
    sight": a recompile or, for reduce-overhead, a new graph recording);
  - then median wall ms per call over rounds through the 4 inputs, with CUDA synchronisation;
  - the GPU time of an eager call (torch.profiler, kernels and copies summed);
  - the compiled output against eager on the same input (relative error; the compiled norms and
    fused pointwise kernels round differently).
A real stream never repeats a size, so a reduce-overhead row pays "first sight" on every call.

    python tools/bench_compile.py --models minkunet,resnet21d --modes default,reduce-overhead
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
from bench_graphs import MODELS, gpu_ms, model_coords, rel, write_json  # noqa: E402
from scan_data import load_scan  # noqa: E402


class OnFeats(torch.nn.Module):
    """(feats, coords) -> output feats of a model taking a SparseTensor built in the call."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, feats, coords):
        y = self.model(torchsp.SparseTensor(feats, coords, check=False))
        return y.feats if isinstance(y, torchsp.SparseTensor) else y


def stepper(fn, model, train, graphs):
    """call(feats, coords) -> output (a clone when CUDA graphs own it) of one forward or training step."""
    def call(feats, coords):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if not train:
            with torch.no_grad():
                out = fn(feats, coords)
            return out.clone() if graphs else out
        model.zero_grad(set_to_none=True)
        out = fn(feats, coords)
        out.float().square().mean().backward()
        return out.detach().clone() if graphs else out.detach()
    return call


def timed(call, inp):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = call(*inp)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3, out


def run(name, make, inputs, train, modes, args):
    import torch._dynamo

    kind = "train step" if train else "forward"
    model = OnFeats(make()).cuda().to(getattr(torch, args.dtype)).train(train)
    eager = stepper(model, model, train, False)
    for inp in inputs:
        eager(*inp)
    gpu = gpu_ms(lambda: eager(*inputs[0]))
    rows = []
    for mode in ["eager"] + modes:
        if mode == "eager":
            call, t_compile, first = eager, 0.0, 0.0
        else:
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, dynamic=True, mode=mode)
            call = stepper(compiled, model, train, mode == "reduce-overhead")
            t_compile, _ = timed(call, inputs[0])
            first = statistics.mean(timed(call, inp)[0] for inp in inputs[1:])
            for _ in range(2):
                call(*inputs[0])
        want = eager(*inputs[0]).clone()
        err = rel(call(*inputs[0]), want)
        rounds = []
        for _ in range(args.rounds):
            rounds.append(statistics.median(timed(call, inp)[0] for inp in inputs for _ in range(args.calls)))
        ms = statistics.median(rounds)
        rows.append(dict(model=name, step=kind, mode=mode, ms=ms, compile_s=t_compile / 1e3, first_sight_ms=first,
                         gpu_ms=gpu, rel_err=err))
        print(f"{name:10s} {kind:10s} {mode:16s} {ms:9.2f} {rows[0]['ms'] / ms:7.2f}x {gpu:8.2f} "
              f"{t_compile / 1e3:9.1f} {first:11.1f} {err:9.1e}", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--voxel-size", type=float, default=0.05)
    p.add_argument("--models", default="minkunet,resnet21d")
    p.add_argument("--modes", default="default", help="torch.compile modes, comma-separated")
    p.add_argument("--steps", default="forward,train")
    p.add_argument("--algo", default="0,0,0,0", help="fixed dataflow for every layer (README)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=2, help="calls per input per round")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torchsp.tune.set_fixed([int(v) for v in args.algo.split(",")])
    dtype = getattr(torch, args.dtype)
    scans = [load_scan(args.voxel_size, None, device="cuda", shift=0.37 * i)[:2] for i in range(4)]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, voxels "
          f"{[c.shape[0] for _, c in scans]} at {args.voxel_size} m, algo {args.algo}, fresh maps every call; "
          f"ms: median of {args.rounds} rounds (median of {args.calls} calls on each input)")
    print(f"{'model':10s} {'step':10s} {'mode':16s} {'wall ms':>9s} {'vs eager':>8s} {'GPU ms':>8s} "
          f"{'compile s':>9s} {'first ms':>11s} {'rel err':>9s}")
    rows = []
    for name in args.models.split(","):
        inputs = [(f.to(dtype), model_coords(name, c)) for f, c in scans]
        for step in args.steps.split(","):
            rows += run(name, MODELS[name], inputs, step == "train", [m for m in args.modes.split(",") if m], args)
    write_json(args.json, args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
