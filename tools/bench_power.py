#!/usr/bin/env python3
"""Energy per call of one bench.py layer's passes in the power-capped steady state (CUDA only).

Why: at C = 256 an H100 / H200 runs at its board power limit within a second of sustained
work (docs/performance-log.md, session 38: 690-694 W of 700, the SM clock down from 1980 MHz to ~1500), so a
training loop's time per call is its energy per call over the limit, not its time on a rested
GPU.  A change that moves or multiplies fewer values pays there even where a short timing loop
shows nothing, and one that is faster rested can lose (docs/performance-log.md, session 59: ~45% of subm C =
256's forward energy depends on the operands' values, most of it on the weights').  This tool
runs each case back to back for --seconds (the settle), then times --loops loops of --calls
calls between one event pair, while `nvidia-smi` samples the SM clock and board power every
100 ms; it prints each case's settled time per call, the median clock and power over the
settle's last half second and the loops, and their product, the energy per call.

A case is PASS:ALGO: PASS one of fwd, dgrad, wgrad (the ops bench.py times, map cached, the
wgrad pair list cached), ALGO dataflow,tile,split,threshold (bench.py --algos' 4-list form).
Cases run in the order given, rounds times (rounds interleave, so a drift of the host or the
board falls on every case alike).

    python tools/bench_power.py --layers subm3_c256 --cases fwd:0,15,0,0 fwd:0,16,0,0 wgrad:1,15,0,0
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

PASSES = ("fwd", "dgrad", "wgrad")


def parse_case(text):
    """'PASS:a,b,c,d' -> (pass, [a, b, c, d]); ValueError naming the case otherwise."""
    name, _, algo = text.partition(":")
    try:
        values = [int(v) for v in algo.split(",")]
    except ValueError:
        values = []
    if name not in PASSES or len(values) != 4:
        raise ValueError(f"bench_power: a case is PASS:dataflow,tile,split,threshold with PASS one of "
                         f"{', '.join(PASSES)}, got {text!r}")
    return name, values


def parse_samples(lines):
    """[(unix seconds, SM clock MHz, power W)] of nvidia-smi's 'timestamp, clocks.sm, power.draw'
    lines (csv, noheader, nounits); lines that do not parse are skipped."""
    rows = []
    for line in lines:
        f = [v.strip() for v in line.split(",")]
        if len(f) != 3:
            continue
        stamp, _, frac = f[0].partition(".")
        try:
            t = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + (frac or "0"))
            rows.append((t, float(f[1]), float(f[2])))
        except ValueError:
            continue
    return rows


def window_medians(rows, t0, t1):
    """(median clock, median power, samples) of the rows in [t0, t1]; NaN where none."""
    sel = [r for r in rows if t0 <= r[0] <= t1]
    if not sel:
        return float("nan"), float("nan"), 0
    return statistics.median(r[1] for r in sel), statistics.median(r[2] for r in sel), len(sel)


def case_fn(p, algo, x, w, dy, km, geom, dtype):
    """bench.op_call of pass p under algo, run once here so its plan and pair list exist before timing."""
    fn = bench.op_call(p, algo, x, w, dy, km, geom, dtype)
    fn()
    return fn


def settled_us(fn, seconds, loops, calls):
    """Run fn back to back for `seconds`, then the median us per call of `loops` loops of `calls`."""
    t_end = time.time() + seconds
    while time.time() < t_end:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="+", default=["subm3_c256"])
    ap.add_argument("--cases", nargs="+", default=["fwd:0,0,0,0", "dgrad:0,0,0,0", "wgrad:0,0,0,0"],
                    help="PASS:dataflow,tile,split,threshold")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--seconds", type=float, default=3.0, help="settle: back-to-back calls before timing")
    ap.add_argument("--loops", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data", default=None)
    args = ap.parse_args()
    try:
        cases = [parse_case(c) for c in args.cases]
    except ValueError as e:
        sys.exit(str(e))
    if args.seconds < 0.5 or args.loops < 1 or args.calls < 1 or args.rounds < 1:
        sys.exit("bench_power: --seconds must be >= 0.5 and --loops, --calls, --rounds >= 1")
    if not torch.cuda.is_available():
        sys.exit("bench_power: needs a CUDA device")
    args.data = bench.find_data(args.data)
    args.voxel_scale = 1.0
    from torchsp.kmap import ConvGeometry
    device, dtype = torch.device("cuda"), bench.DTYPES[args.dtype]
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    try:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                                "--format=csv,noheader,nounits", "-lms", "100",
                                "-i", str(torch.cuda.current_device())], stdout=log)
    except OSError as e:
        sys.exit(f"bench_power: cannot run nvidia-smi ({e})")
    results = []
    try:
        for spec in bench.select_layers(args.layers):
            name, K = spec[0], spec[2]
            x, kw, w, km, sz, _ = bench.make_layer(*spec, args, device, dtype)
            geom = ConvGeometry(K, **kw)
            dy = torch.randn(sz["n_out"], spec[4], device=device, dtype=dtype)
            fns = []
            for p, algo in cases:
                try:
                    fns.append((p, algo, case_fn(p, algo, x, w, dy, km, geom, dtype)))
                except Exception as e:  # noqa: BLE001  (an algo the layer cannot run: reported, not timed)
                    print(f"{name} {p}:{','.join(map(str, algo))}: FAILED {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
            torch.cuda.synchronize()
            for rnd in range(args.rounds):
                for p, algo, fn in fns:
                    us = settled_us(fn, args.seconds, args.loops, args.calls)
                    t1 = time.time()
                    # the samples of the loops and of the settle's last half second: the state timed
                    results.append((name, f"{p}:{','.join(map(str, algo))}", rnd, us, t1 - us * 1e-6 *
                                    args.loops * args.calls - 0.5, t1))
        time.sleep(0.3)
    finally:
        smi.terminate()
        smi.wait()
    log.seek(0)
    rows = parse_samples(log.readlines())
    log.close()
    os.unlink(log.name)
    print(f"# {torch.cuda.get_device_name()}; settle {args.seconds:g} s, {args.loops} x {args.calls} calls; "
          f"clock and power: medians of nvidia-smi's 100 ms samples")
    print(f"{'layer':14s} {'case':18s} {'round':>5s} {'us/call':>8s} {'SM MHz':>7s} {'W':>7s} "
          f"{'mJ/call':>8s} {'samples':>7s}")
    for name, case, rnd, us, t0, t1 in results:
        clk, pw, n = window_medians(rows, t0, t1)
        print(f"{name:14s} {case:18s} {rnd:5d} {us:8.1f} {clk:7.0f} {pw:7.1f} {pw * us * 1e-3:8.1f} {n:7d}")


if __name__ == "__main__":
    main()
