#!/usr/bin/env python3
"""Per-kernel device time of one bench.py layer's forward, dgrad and wgrad ops (torch.profiler).

Why: bench.py times each op call with CUDA events, which on a slow host measures the host's
launch time as much as the GPU's.  This lists what the GPU itself runs per call: each kernel's
mean duration and the call's sum, beside the event time, so a number of the benchmark table
splits into main kernel, weight preparation, reductions and host time.  "host" is the host's
time per call (calls issued back to back, timed before the synchronize); --fb adds bench.py's
forward+backward training call.

    python tools/kernel_times.py --layers subm3_c64 subm3_c256 --algo 0,0,0,0 [--fb]
"""

import argparse
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def host_us(fn, calls):
    """Host time per call: `calls` calls back to back, timed before the closing synchronize.
    Launches return before their kernels run, so unless the call synchronizes this is the time
    the host spends per call; an event time close to it means the call is host-bound."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / calls * 1e6


def device_us(fn, calls):
    """{kernel (or copy, memset) name: mean device us per call} of `calls` calls of fn
    (torch.profiler, CUDA activity only)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {k: v / calls for k, v in per.items()}


def profile_call(fn, calls):
    """(device_us(fn, calls), event us per call median, host us per call) over `calls` calls.
    The events are timed first: after a profiler session every launch may carry its tracing."""
    event_us = bench.timeit(fn, 50, 5, torch.device("cuda"))
    host = min(host_us(fn, calls) for _ in range(3))
    return device_us(fn, calls), event_us, host


def short(name, width=70):
    name = name.split("(")[0]
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="+", default=["subm3_c32", "subm3_c64", "subm3_c128", "subm3_c256"])
    ap.add_argument("--algo", default="0,0,0,0", help="dataflow,tile,split,threshold for every pass")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--data", default=None)
    ap.add_argument("--fb", action="store_true",
                    help="also a forward+backward training call as bench.py times it (its kernels: "
                         "the three ops, gradient accumulation, anything else the call launches)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_times: needs a CUDA device")
    args.data = bench.find_data(args.data)
    args.voxel_scale = 1.0
    import torchsp
    from torchsp.kmap import ConvGeometry
    device, dtype = torch.device("cuda"), bench.DTYPES[args.dtype]
    algo = [int(v) for v in args.algo.split(",")]
    summary = []
    for spec in bench.select_layers(args.layers):
        name, kind, K = spec[0], spec[1], spec[2]
        x, kw, w, km, sz, _ = bench.make_layer(*spec, args, device, dtype)
        geom = ConvGeometry(K, **kw)
        dy = torch.randn(sz["n_out"], spec[4], device=device, dtype=dtype)
        calls = {p: bench.op_call(p, algo, x, w, dy, km, geom, dtype) for p in ("fwd", "dgrad", "wgrad")}
        if args.fb:  # bench.py's fwd+bwd: y = sparse_conv3d(...); y.feats.backward(dy), grads accumulate
            xf = x.feats.detach().clone().requires_grad_(True)
            wg = w.detach().clone().requires_grad_(True)
            calls["fb"] = lambda: torchsp.functional.sparse_conv3d(
                x.replace(xf), wg, K, algo=algo, **kw).feats.backward(dy)
        print(f"\n## {name}: N_out {sz['n_out']}, pairs {sz['pairs']}, algo {algo}")
        for pass_name, fn in calls.items():
            with torch.set_grad_enabled(pass_name == "fb"):
                per, event_us, host = profile_call(fn, args.calls)
                total = sum(per.values())
                print(f"{pass_name:6s} event {event_us:8.1f} us, kernels {total:8.1f} us, host {host:8.1f} us")
                for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
                    print(f"    {v:8.1f}  {short(k)}")
                summary.append((name, pass_name, event_us, total, max(per.values()) if per else 0.0, host))
    print("\n# layer       pass   event us  kernels us  largest kernel us   host us")
    for name, p, ev, tot, big, host in summary:
        print(f"{name:12s} {p:6s} {ev:9.1f} {tot:11.1f} {big:18.1f} {host:9.1f}")


if __name__ == "__main__":
    main()
