#!/usr/bin/env python3
"""Batch norm + ReLU on a sparse tensor's features: torchsp's fused kernels against the same layer
through torch (nn.BatchNorm1d, then torch.relu: what torchsp.nn.BatchNorm and ReLU ran before),
per call, beside the floor.

Why: in a MinkUNet training step at batch 4 the batch norms took as long as the convolutions'
forward and dgrad together (docs/performance-log.md, session 69); this times the layer that replaced them, on the
real scan's row counts (examples/scan_data.py load_batch at --voxel-size, --batch items), for each
channel count of --channels.

Phases, microseconds per call (CUDA events around each call, median of --iters, after warm-up and
a --settle-ms loop; the median of --rounds rounds, which alternate the implementations' order):
  train fwd   training mode, no gradient wanted: statistics, running-statistics update, normalise;
  train fb    the same with feats requiring grad, then backward of a fixed gradient (every .grad
              set to None first, as zero_grad does: no accumulation);
  eval fwd    eval mode under no_grad (running statistics).
"pipe" gives the same calls issued back to back between one event pair (tools/bench.py
timeit_pipelined, as a network issues its layers) and "host" the host's time per call there.
Floor: compulsory bytes at 3.0 TB/s (DESIGN.md's H100 rate; the header prints this device's copy
rate): train fwd and eval 2 N C e (x in, y out), train fb 5 N C e (also dy and x in, dx out).
Each torchsp output is compared with torch's in the same run (max error relative to torch's
largest value), so what is timed is checked.

    python tools/bench_norm.py --batch 1 4 --channels 32 64 96 128 256
    python tools/bench_norm.py --device cpu --dtype float32 --voxel-size 1.0 --iters 3   # smoke test
"""

import argparse
import json
import os
import statistics
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torchsp  # noqa: E402
from bench import BANDWIDTH, copy_rate, settle, timeit, timeit_pipelined  # noqa: E402
from scan_data import load_batch  # noqa: E402
from torchsp import nn as spnn  # noqa: E402

PHASES = ("train fwd", "train fb", "eval fwd")
PASSES = {"train fwd": 2, "train fb": 5, "eval fwd": 2}


def torch_path(layer, x):
    """What torchsp.nn.BatchNorm + ReLU ran before the fused kernels: the bn child, then torch.relu."""
    return x.replace(torch.relu(layer.bn(x.feats)))


def phase_call(phase, impl, layer, x, dy):
    """A zero-argument call of `phase` through `impl` ("torchsp" or "torch"), returning its output."""
    run = layer.forward_relu if impl == "torchsp" else (lambda t: torch_path(layer, t))
    if phase == "eval fwd":
        def call():
            with torch.no_grad():
                return run(x).feats
    elif phase == "train fwd":
        def call():
            return run(x).feats
    else:
        leaf = x.feats.detach().requires_grad_()
        xg = x.replace(leaf)
        params = list(layer.parameters())

        def call():
            # gradients set to None, as a step's zero_grad does: no accumulation kernels timed
            leaf.grad = None
            for p in params:
                p.grad = None
            y = run(xg).feats
            y.backward(dy)
            return y
    return call


def measure(n_items, coords, c, dtype, param_dtype, device, iters, warmup, rounds, settle_ms):
    """Rows of (phase, torch us, torchsp us, their pipelined us and host us, floor us, error) for one
    channel count: per phase, `rounds` rounds alternating which implementation goes first, each
    timing after a settle loop of its own calls; medians of the rounds."""
    g = torch.Generator().manual_seed(c)
    n = coords.shape[0]
    f = (torch.randn(n, c, generator=g) * 2 + 1).to(device=device, dtype=dtype)
    dy = torch.randn(n, c, generator=g).to(device=device, dtype=dtype)
    x = torchsp.SparseTensor(f, coords)
    e = f.element_size()
    rows = []
    for phase in PHASES:
        calls, outs, times = {}, {}, {"torch": [], "torchsp": []}
        pipe = {"torch": [], "torchsp": []}
        for impl in ("torch", "torchsp"):
            layer = spnn.BatchNorm(c).to(device=device, dtype=param_dtype)
            layer.train(phase != "eval fwd")
            calls[impl] = phase_call(phase, impl, layer, x, dy)
            outs[impl] = calls[impl]().detach()
        for rnd in range(rounds):
            for impl in (("torch", "torchsp") if rnd % 2 == 0 else ("torchsp", "torch")):
                settle(calls[impl], settle_ms, device)
                times[impl].append(timeit(calls[impl], iters, warmup, device))
                pipe[impl].append(timeit_pipelined(calls[impl], iters, 0, device))
        ref = outs["torch"].double()
        err = ((outs["torchsp"].double() - ref).abs().max() / ref.abs().max().clamp(min=1)).item()
        floor = PASSES[phase] * n * c * e / BANDWIDTH * 1e6
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(dict(batch=n_items, n=n, c=c, phase=phase, torch_us=med["torch"], torchsp_us=med["torchsp"],
                         torch_pipe=statistics.median(p[0] for p in pipe["torch"]),
                         torchsp_pipe=statistics.median(p[0] for p in pipe["torchsp"]),
                         torch_host=statistics.median(p[1] for p in pipe["torch"]),
                         torchsp_host=statistics.median(p[1] for p in pipe["torchsp"]),
                         floor_us=floor, err=err, rounds=times))
    return rows


def main(argv=None):
    """Runs the tool on argv (sys.argv's by default); returns the table's rows."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--channels", type=int, nargs="+", default=[32, 64, 96, 128, 256])
    ap.add_argument("--voxel-size", type=float, default=0.05)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--param-dtype", default="same", choices=["same", "float32"],
                    help="the norm's parameters and running statistics: the features' dtype (a .half() model) "
                         "or float32 (autocast)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle-ms", type=float, default=50.0,
                    help="each timed loop follows this long a loop of its own calls (tools/bench.py settle)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    param_dtype = dtype if args.param_dtype == "same" else torch.float32
    rate = copy_rate(device)
    print(f"# {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{args.dtype} features, {param_dtype} parameters; floor at {BANDWIDTH / 1e12:.1f} TB/s"
          + (f"; device copy rate {rate / 1e12:.2f} TB/s" if rate else ""))
    rows = []
    for b in args.batch:
        _, coords = load_batch(args.voxel_size, b, device=device)
        for c in args.channels:
            rows += measure(b, coords, c, dtype, param_dtype, device, args.iters, args.warmup, args.rounds,
                            args.settle_ms)
    print(f"{'batch':>5} {'N':>7} {'C':>4} {'phase':>9} {'torch':>7} {'torchsp':>7} {'ratio':>6} {'floor':>6} "
          f"{'x flr':>5} | {'pipe: torch':>11} {'torchsp':>7} {'ratio':>6} | {'host: torch':>11} {'torchsp':>7} "
          f"{'err':>7}")
    for r in rows:
        print(f"{r['batch']:5d} {r['n']:7d} {r['c']:4d} {r['phase']:>9} {r['torch_us']:7.1f} {r['torchsp_us']:7.1f} "
              f"{r['torch_us'] / r['torchsp_us']:5.2f}x {r['floor_us']:6.1f} {r['torchsp_us'] / r['floor_us']:5.2f} | "
              f"{r['torch_pipe']:11.1f} {r['torchsp_pipe']:7.1f} {r['torch_pipe'] / r['torchsp_pipe']:5.2f}x | "
              f"{r['torch_host']:11.1f} {r['torchsp_host']:7.1f} {r['err']:7.1e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), copy_rate=rate, rows=rows), fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
