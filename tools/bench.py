#!/usr/bin/env python3
"""Per-layer convolution benchmark on a real LiDAR scan: torchsp dataflows beside the peers.

Layers (voxels of /work/shared/data/lidar_198k.npz, batch 1):
  subm3 C=32, C=64 at 0.05 m; subm3 C=128, C=256 at 0.1 m (submanifold 3x3x3, Cin = Cout)
  stem3_c4: a LiDAR net's stem, subm 3x3x3 from 4 input channels to 32 at 0.05 m
  down2 / down3: stride-2 K=2 / K=3 (padding 1) downsampling, C=64 at 0.05 m and C=128 at 0.1 m
  up2: transposed K=2 stride 2 back to the stride-1 coordinates, same channels
  subm3_c128_small / subm3_c256_small: subm 3x3x3 at 0.4 m / 0.8 m (27.9k / 10.6k voxels,
      a U-Net's deep levels), where tiles are fewer than SMs: split-K's layers
Phases (map cached: built once before timing, as a model reuses it, and read until its step
plans are refined, torchsp.kmap.REFINE_AFTER, as a reused map's are), CUDA events around the
Python call a user makes, median of --iters after --warmup; every implementation of a layer
(torchsp's algos, the peers) is set up and checked first, then timed in --rounds interleaved
rounds (grouped by phase, the implementations' order rotated each round: round_order; with
--settle-ms each timed loop preceded by that long of the same call: settle), and each number is
the median of its rounds (the JSON keeps each round's):
  fwd      torchsp.functional.sparse_conv3d(x, w, K, stride=..., transposed=..., algo=...) under no_grad
  fwd op   torchsp._C.conv_fwd(...) alone: the op through the eager entry the no-grad call takes,
           without the Python layer (close to the forward's GPU time where Python is the bound;
           until session 49 torch.ops.torchsp.conv_fwd, which adds the op's Python autograd)
  dgrad    torch.ops.torchsp.conv_dgrad(dy, w, nbmap_t, algo)
  wgrad    torch.ops.torchsp.conv_wgrad(x, dy, nbmap, algo, pairs, starts) (the map's cached pair list)
  fwd+bwd  y = sparse_conv3d(...); y.feats.backward(dy)   (feats and weight require grad; their
           .grad accumulates call to call, or with --zero-grad is set to None before each call,
           as a training step's optimizer.zero_grad() does: every implementation alike; with
           --autograd-single-thread backward runs on the calling thread, not torch's CUDA worker
           thread, whose hand-offs the fwd+bwd time of a small layer can carry)
  fwd pipe, fb pipe: the forward / fwd+bwd calls above issued --iters at a time back to back
           between one pair of events (timeit_pipelined): a model's layers overlap the host's
           work for one with the GPU's for the one before, so this is max(host, GPU) per call where
           the columns above add the host's time to the kernels' whenever it is the longer;
           fwd host / fb host beside them: the host's time per call in that loop
Floor of a phase: max(F / PEAK, B / 3.0 TB/s), F = 2 * pairs * Cin * Cout (x3 for fwd+bwd),
B = e * (N_in*Cin + N_out*Cout + V*Cin*Cout) + 4 * pairs (x3 for fwd+bwd), e = element size,
pairs = nbmap entries >= 0, PEAK = 790 TFLOP/s (fp16/bf16) or 438 (fp32, tf32).  The map's
compulsory bytes are one int32 row index per pair (compulsory_bytes), not the [N_out, V] map's
4 * N_out * V: a pass must learn which rows meet, not read every empty slot (the step-plan
kernels read only the columns their tiles use).  This gives DESIGN.md section 7's 8-16 us for a
32- or 64-channel submanifold layer at 173k voxels; bench.py until session 68 counted the whole
map (lidar_198k at 0.05 m, subm C = 32 / 64: 13.6 / 21.1 us against 8.2 / 15.6 now).  The lent
H200 copies at ~4.2 TB/s (the header's copy rate), so memory-bound kernels can beat these floors.
The header and the last lines also print the host floors (host_floor), timed per call and pipelined
as the layers are, at the start and at the end of the run: torch.add of one element, the least any
call reads on that host then, and a one-element torch.nn.functional.linear's forward+backward into
two leaves, torch's own training call on that host, for scale beside the fwd+bwd rows.
torchsp is reported per dataflow in --algos ("0" output-stationary mask-sorted, "0u" unsorted,
"1" weight-stationary fetch-on-demand, "2:T" hybrid with L1 threshold T (default 2),
"a,b,c,d" any [dataflow, tile, split, threshold] (e.g. 0,0,2,0 mask splits, 0,9,0,0 wgmma,
3,0,4,0 split-K in 4 runs),
"auto" the tuner's choice; torchsp/plan.py explains the dataflows).
Peers (tools/peers.py: spconv, spconv-triton, flexgemm, torchsparse, warpconvnet) are built on the
same voxels with the same weights, their output is compared with torchsp's (relative error
printed), then fwd and fwd+bwd are timed the same way.

    python tools/bench.py --json bench.json --plot bench.png          # H100, fp16
    python tools/bench.py --device cpu --dtype fp32 --voxel-scale 10 --iters 3 --warmup 1 --peers none
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

BANDWIDTH = 3.0e12
PEAK = {torch.float16: 790e12, torch.bfloat16: 790e12, torch.float32: 438e12, torch.float64: 438e12}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
DATA_CANDIDATES = [
    os.path.join(ROOT, "..", "shared", "data", "lidar_198k.npz"),
    "/work/shared/data/lidar_198k.npz",
    os.path.join(ROOT, "shared", "data", "lidar_198k.npz"),
    os.path.join(ROOT, "torchsp", "data", "lidar_198k.npz"),
]

# name, kind, K, Cin, Cout, voxel size
LAYERS = [
    ("subm3_c32", "subm", 3, 32, 32, 0.05),
    # a LiDAR net's stem: 4 input channels (x, y, z, intensity) to 32, on zero-padded copies of
    # the tensor-core passes since session 71 (csrc/cuda/conv.cu channel padding)
    ("stem3_c4", "subm", 3, 4, 32, 0.05),
    ("subm3_c64", "subm", 3, 64, 64, 0.05),
    ("subm3_c128", "subm", 3, 128, 128, 0.1),
    ("subm3_c256", "subm", 3, 256, 256, 0.1),
    ("down2_c64", "down", 2, 64, 64, 0.05),
    ("down3_c64", "down", 3, 64, 64, 0.05),
    ("up2_c64", "up", 2, 64, 64, 0.05),
    ("down2_c128", "down", 2, 128, 128, 0.1),
    ("down3_c128", "down", 3, 128, 128, 0.1),
    ("up2_c128", "up", 2, 128, 128, 0.1),
    # few rows, as in a U-Net's deep levels (0.4 m ~ stride 8 and 0.8 m ~ stride 16 of a 0.05 m
    # net): 218 and 83 row tiles of 128 rows against the H100's 132 SMs, where split-K (dataflow
    # 3) may fill the GPU
    ("subm3_c128_small", "subm", 3, 128, 128, 0.4),
    ("subm3_c256_small", "subm", 3, 256, 256, 0.8),
]


def select_layers(names):
    """The LAYERS entries named in `names` (all of them for None), in the order given, so a run
    with --budget reaches the layers that matter first; SystemExit listing the known names when
    one is unknown."""
    if names is None:
        return list(LAYERS)
    by_name = {l[0]: l for l in LAYERS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown --layers {unknown}; known: {list(by_name)}")
    return [by_name[n] for n in dict.fromkeys(names)]


def find_data(path):
    if path:
        return path
    for p in DATA_CANDIDATES:
        if os.path.exists(p):
            return p
    raise FileNotFoundError("lidar_198k.npz not found; pass --data PATH")


_coords_cache = {}


def load_coords(path, voxel_size, device):
    key = (path, voxel_size, str(device))
    if key not in _coords_cache:
        pc = np.load(path)["pc"][:, :3]
        c = np.unique(np.floor(pc / voxel_size).astype(np.int32), axis=0)
        c = np.concatenate([np.zeros((c.shape[0], 1), np.int32), c], axis=1)
        _coords_cache[key] = torch.from_numpy(c).to(device).contiguous()
    return _coords_cache[key]


def timeit(fn, iters, warmup, device):
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) * 1e3 for s, e in ev]
    else:
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def is_torchsp(row):
    """torchsp's rows are "torchsp <algo>"; a peer's name may start with the same letters
    (torchsparse)."""
    return row["impl"].startswith("torchsp ")


def is_peer(row):
    return row["impl"] != "floor" and not is_torchsp(row)


def layers_of(rows):
    """(layer name, its rows, its floor row) per layer, in the order run: the compact tables' walk."""
    for name in dict.fromkeys(r["layer"] for r in rows):
        rs = [r for r in rows if r["layer"] == name]
        yield name, rs, [r for r in rs if r["impl"] == "floor"][0]


def num(v, w=9):
    """v in a column of width w, one decimal, or '-' when there is none."""
    return f"{v:{w}.1f}" if v is not None else f"{'-':>{w}s}"


def ratio(v, w=7):
    """A ratio (speedup, x floor) in a column of width w, two decimals, or '-': at one decimal
    subm C = 256's fwd+bwd speedup of 1.96 read "2.0", a target it misses (session 79)."""
    return f"{v:{w}.2f}" if v is not None else f"{'-':>{w}s}"


def timeit_pipelined(fn, iters, warmup, device):
    """(us per call, host us per call) of `iters` calls issued back to back between one pair of
    CUDA events, after `warmup` calls and a synchronize.

    Why: timeit's events around each call measure, wherever the host's part of a call (its
    Python, launches, and the two event records: 25-30 us on the H100 machine's host in session 52)
    outlasts the GPU's, the host's time up to the last launch plus the kernels: the GPU idles at
    each start event.  A model's forward issues its layers back to back, so each layer costs
    max(host, GPU) there; this is that number, and the host time beside it says which bound it.
    CPU: wall time per call, twice."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        us = (time.perf_counter() - t) / iters * 1e6
        return us, us
    torch.cuda.synchronize(device)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    host = (time.perf_counter() - t) / iters * 1e6
    torch.cuda.synchronize(device)
    return s.elapsed_time(e) * 1e3 / iters, host


def copy_rate(device, nbytes=1 << 30, iters=20):
    """The device's copy rate, bytes/s: a device-to-device copy of `nbytes` (read and written,
    so 2 * nbytes a copy), median of `iters`; None off CUDA or when the memory is not there.

    Why: the floors keep DESIGN.md's H100 rate (3.0 TB/s), but the lent GPU has been an H200
    (HBM3e) since session 56, so a memory-bound kernel can run below its floor there; the header
    prints the rate measured so a reader can tell."""
    if device.type != "cuda":
        return None
    try:
        a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
    except torch.cuda.OutOfMemoryError:
        return None
    times = []
    for i in range(iters + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize(device)
        if i >= 3:
            times.append(s.elapsed_time(e) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / float(np.median(times))


def host_floor(device, iters=200, warmup=20, zero_grad=False):
    """Host floors on CUDA (None elsewhere), us, timed as the layers are (timeit,
    timeit_pipelined): (torch.add on one element per call, pipelined; a training call per call,
    pipelined).  The training call is torch.nn.functional.linear of a [1, 1] input by a [1, 1]
    weight, both requiring grad, and its backward: one forward launch, autograd's backward with
    two gradients and their accumulation into .grad, as the fwd+bwd rows (with zero_grad, .grad
    set to None before each call, as --zero-grad does there).

    Why: where a call's host part (Python, launches, the event records) outlasts its kernels, the
    per-call columns read the host.  torch.add is the least any call reads on this host in this
    run; the linear is torch's own training call on a graph of the same shape (no kernel time to
    speak of), a yardstick for the fwd+bwd rows rather than a bound (torchsp's C++ autograd node
    read 122-162 us pipelined against its 127-178 on the H200, session 75)."""
    if device.type != "cuda":
        return None
    a = torch.ones(1, device=device)
    add = lambda: torch.add(a, a)  # noqa: E731
    x = torch.ones(1, 1, device=device, requires_grad=True)
    w = torch.ones(1, 1, device=device, requires_grad=True)
    dy = torch.ones(1, 1, device=device)

    def train():
        if zero_grad:
            x.grad = w.grad = None
        torch.nn.functional.linear(x, w).backward(dy)
    return (timeit(add, iters, warmup, device), timeit_pipelined(add, iters, warmup, device)[0],
            timeit(train, iters, warmup, device), timeit_pipelined(train, iters, warmup, device)[0])


def print_host_floor(env, key, device, when, zero_grad=False):
    """Measure host_floor into env[key] and print it (nothing off CUDA)."""
    hf = env[key] = host_floor(device, zero_grad=zero_grad)
    if hf is not None:
        print(f"# host floor {when}: torch.add of one element {hf[0]:.1f} us a call, {hf[1]:.1f} pipelined "
              f"(the least any call reads here); a one-element linear's fwd+bwd {hf[2]:.1f} us a call, "
              f"{hf[3]:.1f} pipelined (torch's own training call, for scale)")


def settle(fn, ms, device):
    """Run fn back to back for about `ms` milliseconds of wall time (at least once when ms > 0),
    synchronizing every few calls and at the end, so the GPU is busy with fn for that long.

    Why: at C = 256 the GPU runs at its power cap, and a loop's time depends on what ran before it:
    on the H200 (session 57, call 9) two torchsp rows on the same kernels took 789-819 us per
    fwd+bwd in the rounds that followed FlexGEMM's loops and 867-897 in the others.  With --settle-ms
    each timed loop follows the same implementation's own settle loop instead of another's (call
    11, 150 ms: the two rows 893.2 and 907.5, their rounds within 890-916)."""
    if ms <= 0:
        return
    end = time.perf_counter() + ms / 1e3
    n = 0
    while True:
        fn()
        n += 1
        if device.type == "cuda" and n % 4 == 0:
            torch.cuda.synchronize(device)
        if time.perf_counter() >= end:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def round_order(timers, rnd):
    """The timers of round `rnd`, grouped by what they time (every implementation's fwd, then
    every fwd op, ...) with the implementations rotated by the round: each timer follows a timer
    of the same kind, and no implementation always comes first or after another's fwd+bwd loops.
    Why: at C = 256 the GPU runs at its power cap, and a forward timed right after another
    implementation's fwd+bwd loops ran slower (H200, session 56 call 5: 293.9 against 264.0 us on
    the same algorithm, in implementation order).  timers: [(rec, key, fn, grad)]."""
    keys, impls = [], []
    for rec, key, _, _ in timers:
        if key not in keys:
            keys.append(key)
        if not any(rec is r for r in impls):
            impls.append(rec)
    turn = {id(r): (i - rnd) % len(impls) for i, r in enumerate(impls)}
    return sorted(timers, key=lambda t: (keys.index(t[1]), turn[id(t[0])]))


def parse_algo(spec):
    """'0' | '0u' | '1' | '2' | '2:T' | 'a,b,c,d' | 'auto' -> (label, algo list or None)."""
    if spec == "auto":
        return "auto", None
    if spec == "0u":  # output-stationary in map order (no mask sorting)
        return "os-unsorted", [0, 0, 0, -1]
    if spec == "0":
        return "os-sorted", [0, 0, 0, 0]
    if "," in spec:
        a = [int(v) for v in spec.split(",")]
        return "df" + spec.replace(",", "."), a
    if ":" in spec:
        df, t = spec.split(":")
        return f"df{df}t{t}", [int(df), 0, 0, int(t)]
    df = int(spec)
    return f"df{df}" + ("t2" if df == 2 else ""), [df, 0, 0, 2 if df == 2 else 0]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compulsory_bytes(e, n_in, n_out, cin, cout, volume, pairs):
    """Bytes a conv pass must move at least (the floor's B): the input features [n_in, cin],
    the output [n_out, cout] and the weights [volume, cin, cout] once each, `e` bytes an
    element, and one int32 input row index per pair.  Not the map's 4 * n_out * volume: its
    empty slots (-1) carry no pair, and a pass that skips them (the step plans do) need not
    read them.  All ints; returns an int."""
    return e * (n_in * cin + n_out * cout + volume * cin * cout) + 4 * pairs


def make_layer(name, kind, K, cin, cout, vs, args, device, dtype):
    """Input SparseTensor, conv kwargs, weight, cached KernelMap, sizes, peer description."""
    import torchsp
    from torchsp.kmap import get_kernel_map
    coords = load_coords(args.data, vs * args.voxel_scale, device)
    g = torch.Generator(device="cpu").manual_seed(0)
    V = K ** 3
    w = (torch.randn(V, cin, cout, generator=g) / (V * cin) ** 0.5).to(device, dtype)
    if kind == "up":
        fine = torchsp.SparseTensor(torch.zeros(coords.shape[0], cout, device=device, dtype=dtype), coords)
        _, out, ostride, okey = get_kernel_map(fine, K, stride=2)
        feats = torch.randn(out.shape[0], cin, generator=g).to(device, dtype)
        x = torchsp.SparseTensor(feats, out, ostride, cache=fine.cache, coord_key=okey, check=False)
        kw = dict(stride=2, transposed=True)
        t_in = 2
    else:
        feats = torch.randn(coords.shape[0], cin, generator=g).to(device, dtype)
        x = torchsp.SparseTensor(feats, coords)
        kw = dict(stride=1 if kind == "subm" else 2)
        t_in = 1
    km, out_coords, _, _ = get_kernel_map(x, K, **kw)
    # A cached map's steady state: after torchsp.kmap.REFINE_AFTER passes its step plans are on
    # the refined row order; read them that often here, so that every timer (the op-level ones
    # take the plan once, at setup) sees the plan a reused map runs with.
    for _ in range(torchsp.kmap.REFINE_AFTER or 0):
        km.order, km.order_t  # noqa: B018
    pairs = int((km.nbmap >= 0).sum())
    n_in, n_out = x.coords.shape[0], out_coords.shape[0]
    e = torch.empty((), dtype=dtype).element_size()
    F = 2 * pairs * cin * cout
    B = compulsory_bytes(e, n_in, n_out, cin, cout, V, pairs)
    peer_desc = dict(kind=kind, K=K, Cin=cin, Cout=cout, dtype=dtype, device=device, coords_in=x.coords,
                     coords_out=out_coords, t_in=t_in, weight=w)
    return x, kw, w, km, dict(n_in=n_in, n_out=n_out, V=V, pairs=pairs, F=F, B=B), peer_desc


def op_call(which, algo, x, w, dy, km, geom, dtype):
    """One op call of pass `which` ("fwd", "dgrad", "wgrad") under `algo` on make_layer's layer,
    as the op rows of this table and tools/kernel_times.py / bench_power.py make it: the map
    cached, its pass plan and wgrad pair list taken now (built on first use), the forward below
    the autograd key's registered op with no dgrad plan.  dy: [N_out, Cout]."""
    from torchsp.plan import pass_plan, wgrad_pairs
    if which == "fwd":
        order, segs = pass_plan(km, "fwd", algo, geom, dtype)
        return lambda: torch.ops.torchsp.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, algo, algo, algo, order, None,
                                                  segs, [])
    if which == "dgrad":
        order_t, segs_t = pass_plan(km, "dgrad", algo, geom, dtype)
        return lambda: torch.ops.torchsp.conv_dgrad(dy, w, km.nbmap_t, algo, order_t, segs_t)
    if which == "wgrad":
        pairs, starts = wgrad_pairs(km, algo, dtype, w.shape[1], w.shape[2])
        return lambda: torch.ops.torchsp.conv_wgrad(x.feats, dy, km.nbmap, algo, pairs, starts)
    raise ValueError(f"op_call: which must be fwd, dgrad or wgrad, got {which!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--algos", nargs="+", default=["0", "0u"],
                    help="torchsp dataflows: 0, 1, 2 (hybrid, threshold 2), 2:T, a,b,c,d, auto")
    ap.add_argument("--layers", nargs="+", default=None,
                    help=f"subset of {[l[0] for l in LAYERS]}, run in the order given")
    ap.add_argument("--peers", nargs="+", default=["all"],
                    help="spconv spconv-triton flexgemm torchsparse[:M] warpconvnet | all | none")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--settle-ms", type=float, default=0.0,
                    help="before each timed loop, run the same call back to back for this many ms (settle): "
                         "a power-capped layer's loop then follows its own implementation, not another's")
    ap.add_argument("--rounds", type=int, default=3,
                    help="time every implementation of a layer in this many interleaved rounds (median of "
                         "the rounds' medians), so host or clock drift falls on all alike")
    ap.add_argument("--voxel-scale", type=float, default=1.0, help="multiply voxel sizes (CPU smoke tests)")
    ap.add_argument("--zero-grad", action="store_true",
                    help="fwd+bwd: set feats' and weight's .grad to None before each call (torch's "
                         "zero_grad default), so backward stores the gradients instead of adding "
                         "them into .grad; torchsp and every peer alike")
    ap.add_argument("--autograd-single-thread", action="store_true",
                    help="fwd+bwd: run backward on the calling thread "
                         "(torch.autograd.set_multithreading_enabled(False)) instead of torch's "
                         "per-device worker thread; torchsp and every peer alike")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds: start no further layer once this much time has passed, so a run "
                         "under a time limit still ends with its JSON and compact table")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG bar plot (matplotlib, imported lazily)")
    args = ap.parse_args()
    layers = select_layers(args.layers)  # an unknown name stops the run before any setup
    if args.settle_ms < 0:
        ap.error(f"--settle-ms must be >= 0, got {args.settle_ms}")
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        ap.error(f"--rounds and --iters must be >= 1 and --warmup >= 0, got --rounds {args.rounds}, "
                 f"--iters {args.iters}, --warmup {args.warmup}")
    args.data = find_data(args.data)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench: CUDA is not available (use --device cpu for a smoke test)")
        if args.iters < 50:
            print(f"bench: raising --iters {args.iters} to 50 on CUDA")
            args.iters = 50
    import torchsp
    import peers as peerlib
    from torchsp.kmap import ConvGeometry
    from torchsp.plan import pass_plan, wgrad_pairs

    peer_names = list(peerlib.PEERS) if args.peers == ["all"] else ([] if args.peers == ["none"] else args.peers)
    probe = peerlib.probe() if peer_names else {}
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else "cpu", "dtype": args.dtype, "iters": args.iters, "data": os.path.basename(args.data),
           "rounds": args.rounds,
           "voxel_scale": args.voxel_scale, "zero_grad": args.zero_grad,
           "autograd_single_thread": args.autograd_single_thread, "peers": probe}
    if args.autograd_single_thread:
        torch.autograd.set_multithreading_enabled(False)
    rate = copy_rate(device)
    env["copy_rate_tb_s"] = rate and rate / 1e12
    print(f"# bench: {env['device']}, torch {env['torch']}, {args.dtype}, median of {args.iters}, "
          f"{args.rounds} interleaved rounds, "
          f"{env['data']} (voxel sizes x{args.voxel_scale}), fwd+bwd "
          f"{'with .grad set to None before each call' if args.zero_grad else 'accumulating into .grad'}"
          f"{', backward on the calling thread' if args.autograd_single_thread else ''}")
    if rate is not None:
        print(f"# device copy rate {rate / 1e12:.2f} TB/s (read + write of 1 GiB); the floors take "
              f"{BANDWIDTH / 1e12:.1f} TB/s and {PEAK[dtype] / 1e12:.0f} TFLOP/s (DESIGN.md section 7)")
    for p, v in probe.items():
        print(f"#   peer {p}: {v}")
    print_host_floor(env, "host_floor_us", device, "at the start", args.zero_grad)
    peak = PEAK[dtype]
    algos = [parse_algo(s) for s in args.algos]
    rows = []

    def floor_us(F, B, mult=1):
        return max(mult * F / peak, mult * B / BANDWIDTH) * 1e6

    def emit(rec):
        rows.append(rec)
        f = lambda k: f"{rec[k]:9.1f}" if rec.get(k) is not None else f"{'-':>9s}"  # noqa: E731
        print(f"{rec['layer']:11s} {rec['impl']:18s} {f('fwd_us')} {f('fwd_op_us')} {f('dgrad_us')} {f('wgrad_us')} "
              f"{f('fwdbwd_us')} {f('fwd_pipe_us')} {f('fwd_host_us')} {f('fwdbwd_pipe_us')} {f('fwdbwd_host_us')}  "
              f"{rec.get('err', ''):>9s} {rec.get('note', '')}", flush=True)

    started = time.perf_counter()
    for i, (name, kind, K, cin, cout, vs) in enumerate(layers):
        if i > 0 and args.budget is not None and time.perf_counter() - started > args.budget:
            print(f"\n# budget: {args.budget:g} s passed, layers not run: {' '.join(l[0] for l in layers[i:])}")
            break
        x, kw, w, km, sz, pdesc = make_layer(name, kind, K, cin, cout, vs, args, device, dtype)
        fl = {"fwd": floor_us(sz["F"], sz["B"]), "dgrad": floor_us(sz["F"], sz["B"]),
              "wgrad": floor_us(sz["F"], sz["B"]), "fwdbwd": floor_us(sz["F"], sz["B"], 3)}
        print(f"\n## {name}: {kind} K={K} {cin}->{cout} at {vs * args.voxel_scale:g} m, N_in {sz['n_in']}, "
              f"N_out {sz['n_out']}, pairs {sz['pairs']} ({sz['pairs'] / max(sz['n_out'], 1):.1f}/row)")
        print(f"{'layer':11s} {'impl':18s} {'fwd us':>9s} {'fwd op':>9s} {'dgrad us':>9s} {'wgrad us':>9s} "
              f"{'fwd+bwd':>9s} {'fwd pipe':>9s} {'fwd host':>9s} {'fb pipe':>9s} {'fb host':>9s}  {'rel err':>9s}")
        base = dict(layer=name, kind=kind, K=K, Cin=cin, Cout=cout, voxel=vs * args.voxel_scale, **sz)
        emit(dict(base, impl="floor", fwd_us=fl["fwd"], fwd_op_us=fl["fwd"], dgrad_us=fl["dgrad"],
                  wgrad_us=fl["wgrad"], fwdbwd_us=fl["fwdbwd"], fwd_pipe_us=fl["fwd"],
                  fwdbwd_pipe_us=fl["fwdbwd"]))
        g = torch.Generator(device="cpu").manual_seed(1)
        dy = torch.randn(sz["n_out"], cout, generator=g).to(device, dtype)
        y_ref = None
        # Set up and check every implementation first, then time them in interleaved rounds
        # (timers: [rec, key, fn, grad]; a key ending in _pipe_us is timed by timeit_pipelined and
        # also gives the _host_us key; round_order: grouped by key, implementations rotated) so
        # that a drift of the host or the clocks during the layer falls on all of them alike;
        # each number is the median of its rounds' medians.
        recs, timers = [], []
        for label, algo in algos:
            rec = dict(base, impl=f"torchsp {label}", algo=algo)
            recs.append(rec)
            try:
                conv = lambda feats, weight, a=algo: torchsp.functional.sparse_conv3d(  # noqa: E731
                    x.replace(feats) if hasattr(x, "replace") else x, weight, K, algo=a, **kw)
                with torch.no_grad():
                    y = conv(x.feats, w).feats
                    if y_ref is None:
                        y_ref = y.float()
                    else:
                        rec["err"] = f"{rel_err(y, y_ref):.1e}"
                    geom = ConvGeometry(K, **kw)
                    # "auto": the ops below run the tuner's choices for this layer, per pass
                    fa, da, wa = ((algo, algo, algo) if algo is not None else
                                  (torchsp.tune.choose_algo(x, km, geom, w) or [[0, 0, 0, 0]] * 3))
                    rec["algos"] = [fa, da, wa]
                    if algo is None:
                        rec["note"] = f"tuned fwd {fa} dgrad {da} wgrad {wa}"
                    order, segs = pass_plan(km, "fwd", fa, geom, dtype)
                    order_t, segs_t = pass_plan(km, "dgrad", da, geom, dtype)
                    # with the map's cached pair list, as a training call passes it (map cached)
                    pairs, starts = wgrad_pairs(km, wa, dtype, cin, cout)
                xf = x.feats.detach().clone().requires_grad_(True)
                wg = w.detach().clone().requires_grad_(True)

                def fb(conv=conv, xf=xf, wg=wg):
                    if args.zero_grad:
                        xf.grad = wg.grad = None
                    conv(xf, wg).feats.backward(dy)
                fwd = lambda conv=conv: conv(x.feats, w)  # noqa: E731
                timers += [
                    (rec, "fwd_us", fwd, False),
                    # the op alone (no Python layer), through the eager entry sparse_conv3d's
                    # no-grad call takes: torch.ops.torchsp.conv_fwd would add the op's registered
                    # Python autograd (~20 us of the H100 machine's host, session 49), more than
                    # the layer it stands for
                    (rec, "fwd_op_us", lambda o=order, sg=segs, a=(fa, da, wa):
                        torchsp._C.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, *a, o, None, sg, []), False),
                    (rec, "dgrad_us", lambda ot=order_t, st=segs_t, da=da:
                        torch.ops.torchsp.conv_dgrad(dy, w, km.nbmap_t, da, ot, st), False),
                    (rec, "wgrad_us", lambda pr=pairs, ps=starts, wa=wa:
                        torch.ops.torchsp.conv_wgrad(x.feats, dy, km.nbmap, wa, pr, ps), False),
                    (rec, "fwdbwd_us", fb, True),
                    (rec, "fwd_pipe_us", fwd, False),
                    (rec, "fwdbwd_pipe_us", fb, True)]
            except Exception as e:  # noqa: BLE001
                rec["note"] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        for p in peer_names:
            rec = dict(base, impl=p)
            recs.append(rec)
            try:
                pl, pw = peerlib.build(p, pdesc)
                with torch.no_grad():
                    yp = pl.forward(x.feats)
                    rec["err"] = f"{rel_err(yp, y_ref):.1e}" if y_ref is not None else "-"
                fp = pl.feats_peer(x.feats)
                xf = pl.feats_peer(x.feats).detach().clone().requires_grad_(True)
                pw.requires_grad_(True)
                dy_peer = pl.dy_peer(dy)

                def peer_fb(pl=pl, xf=xf, pw=pw, dy_peer=dy_peer):
                    if args.zero_grad:
                        xf.grad = pw.grad = None
                    pl.fwd_bwd(xf, pw, dy_peer)
                peer_fwd = lambda pl=pl, fp=fp: pl.call(fp)  # noqa: E731
                timers += [(rec, "fwd_us", peer_fwd, False),
                           (rec, "fwdbwd_us", peer_fb, True),
                           (rec, "fwd_pipe_us", peer_fwd, False),
                           (rec, "fwdbwd_pipe_us", peer_fb, True)]
                rec["note"] = pl.note
            except peerlib.PeerUnavailable as e:
                rec["note"] = f"n/a ({e})"
            except peerlib.PeerMismatch as e:
                rec["note"] = f"MISMATCH ({e})"
            except Exception as e:  # noqa: BLE001
                rec["note"] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        failed = set()
        for rnd in range(args.rounds):
            for rec, key, fn, grad in round_order(timers, rnd):
                if id(rec) in failed:
                    continue
                try:
                    rounds = rec.setdefault("rounds", {})
                    with torch.set_grad_enabled(grad):
                        settle(fn, args.settle_ms, device)
                        if key.endswith("_pipe_us"):
                            us, host = timeit_pipelined(fn, args.iters, args.warmup, device)
                            rounds.setdefault(key, []).append(us)
                            rounds.setdefault(key[:-len("_pipe_us")] + "_host_us", []).append(host)
                        else:
                            rounds.setdefault(key, []).append(timeit(fn, args.iters, args.warmup, device))
                except Exception as e:  # noqa: BLE001
                    failed.add(id(rec))
                    rec["note"] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        for rec in recs:
            if id(rec) in failed:
                rec.pop("rounds", None)
            for key, vals in rec.get("rounds", {}).items():
                rec[key] = statistics.median(vals)
            emit(rec)
        timers = recs = None  # their closures hold the layer's tensors
        del x, w, km, pdesc
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print_host_floor(env, "host_floor_end_us", device, "at the end", args.zero_grad)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1, default=str)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot, env)

    # compact table last: per layer, best torchsp vs floor vs best peer
    print("\n# compact (us; fwd = forward with map cached; x = time / floor; speedup = best peer / best torchsp)")
    print(f"{'layer':11s} {'floor':>7s} {'torchsp':>9s} {'algo':>8s} {'x':>5s} {'peer':>9s} {'which':>11s} "
          f"{'speedup':>7s} | {'fb floor':>8s} {'fb tsp':>8s} {'fb peer':>8s} {'speedup':>7s}")
    s = num
    for name, rs, fl in layers_of(rows):
        tsp = [r for r in rs if is_torchsp(r) and r.get("fwd_us")]
        prs = [r for r in rs if is_peer(r) and r.get("fwd_us")]
        bt = min(tsp, key=lambda r: r["fwd_us"]) if tsp else None
        bp = min(prs, key=lambda r: r["fwd_us"]) if prs else None
        btf = min((r["fwdbwd_us"] for r in tsp if r.get("fwdbwd_us")), default=None)
        bpf = min((r["fwdbwd_us"] for r in prs if r.get("fwdbwd_us")), default=None)
        print(f"{name:11s} {fl['fwd_us']:7.1f} {s(bt and bt['fwd_us'])} {(bt['impl'][8:] if bt else '-'):>8s} "
              f"{ratio(bt and bt['fwd_us'] / fl['fwd_us'], 5)} {s(bp and bp['fwd_us'])} "
              f"{(bp['impl'] if bp else '-'):>11s} {ratio(bp and bt and bp['fwd_us'] / bt['fwd_us'])} | "
              f"{fl['fwdbwd_us']:8.1f} {s(btf, 8)} {s(bpf, 8)} {ratio(bpf and btf and bpf / btf)}")
    compact_pipelined(rows)


def compact_pipelined(rows):
    """The compact table's pipelined twin: per layer, the best torchsp and best peer of
    timeit_pipelined (calls back to back, as a model issues its layers), each beside its host
    time per call; a host time close to its pipelined time marks a host-bound row."""
    print("\n# pipelined (us per call, --iters calls back to back between two events; host = the host's "
          "time per call; speedup = best peer / best torchsp)")
    print(f"{'layer':11s} {'floor':>7s} {'torchsp':>9s} {'host':>7s} {'peer':>9s} {'host':>7s} {'which':>11s} "
          f"{'speedup':>7s} | {'fb tsp':>8s} {'host':>7s} {'fb peer':>8s} {'host':>7s} {'speedup':>7s}")
    s = num
    for name, rs, fl in layers_of(rows):
        best = {}
        for side, pick in (("tsp", is_torchsp), ("peer", is_peer)):
            for key in ("fwd", "fwdbwd"):
                cand = [r for r in rs if pick(r) and r.get(key + "_pipe_us")]
                best[side, key] = min(cand, key=lambda r: r[key + "_pipe_us"]) if cand else None
        cols = []
        for key, w in (("fwd", 9), ("fwdbwd", 8)):
            t, p = best["tsp", key], best["peer", key]
            tv, pv = t and t[key + "_pipe_us"], p and p[key + "_pipe_us"]
            cols.append(f"{s(tv, w)} {s(t and t.get(key + '_host_us'), 7)} {s(pv, w)} "
                        f"{s(p and p.get(key + '_host_us'), 7)}"
                        + (f" {(p['impl'] if p else '-'):>11s}" if key == "fwd" else "")
                        + f" {ratio(tv and pv and pv / tv)}")
        print(f"{name:11s} {fl['fwd_us']:7.1f} {cols[0]} | {cols[1]}")


def plot(rows, path, env):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"bench: no plot ({e})")
        return
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows if r.get("fwd_us")))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.4 * len(layers)), 9))
    for ax, key, title in ((axes[0], "fwd_us", "forward (map cached)"), (axes[1], "fwdbwd_us", "forward+backward")):
        width = 0.8 / max(len(impls), 1)
        for i, impl in enumerate(impls):
            vals = []
            for lay in layers:
                r = [r for r in rows if r["layer"] == lay and r["impl"] == impl]
                vals.append(r[0].get(key) or 0 if r else 0)
            ax.bar([j + i * width for j in range(len(layers))], vals, width, label=impl,
                   color="black" if impl == "floor" else None)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(layers))])
        ax.set_xticklabels(layers, rotation=20)
        ax.set_yscale("log")
        ax.set_ylabel("us (log)")
        ax.set_title(f"{title}: {env['device']}, {env['dtype']}")
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
