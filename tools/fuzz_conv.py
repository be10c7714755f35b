#!/usr/bin/env python3
"""Random sparse convolutions against the float64 gather reference: every regime, algo and dtype.

Why: the test suite checks each dataflow, tile and regime on chosen cases; users meet the
combinations (a tile forced through `algo` with 5 channels and split-K, a density split on a
transposed layer, a fresh map of one row).  Each trial draws one of them at random:
  - geometry: submanifold, strided (active-site or floor rule), generative, transposed back to
    the finer coordinates, transposed generative; kernel 1-5 per axis (sometimes 7: V up to
    343), stride 1-3, dilation 1-2, input stride 1-6 (tests/cases.py's Case);
  - coordinates: 0 to a few thousand random rows at a random density, several batches (up to
    the last batch index), sometimes near the edge of the coordinate range (tests/conftest.py
    random_coords), or a crop of the real scan (lidar_198k; on CUDA also the whole sweep, in one
    or two batches);
  - channels 1-384 on each side, bias or none, fp16 / bf16 / fp32 (exact, or tf32 by tile 11) /
    fp64 on the CPU;
  - three independent algos (fwd, dgrad, wgrad) from the whole space the ops accept
    (csrc/torchsp.h tsp_algo: every dataflow, tile, split and threshold; the wgrad tiles),
    or None (the tuner's default);
  - a training call, a call without gradients, or a call repeated (the memos' path, which must
    give the same values bitwise under a fixed algo); feats, weight or dy as non-contiguous
    views (a column slice, a transposed copy, one row expanded); float32 under torch.autocast
    to fp16 or bf16 on CUDA;
and runs it through torchsp.functional.sparse_conv3d (backward too when training).  The expected output
coordinates come from tests/reference.py's site rules, the kernel map from its slow pure-PyTorch
map, and y, dx and dw from its float64 gather sums (on the trial's device), never from torchsp.
CUDA workspace memory is filled with NaN before each trial (tests/conftest.py poison_cuda_cache).

A trial fails on an exception, a NaN, wrong coordinates, or a relative error (max |a - e| /
max |e|) above its dtype's bound; the seed of each failure is printed and `--seeds` replays it.

With --compile every trial runs its call through torch.compile(fullgraph=True) instead (a fresh
compile per trial, backward through the compiled graph's registered autograd): the fake kernels'
output shapes, the data-dependent sizes and the traced algo and plan arguments then meet the
same geometry, dtypes and views as the eager trials, against the same references.

With --export every trial exports its forward instead (torch.export.export(strict=False) of a
module from (feats, coords, weight) to (y feats, y coords), the row count a dynamic dimension
from 2 rows up) and runs the exported program on the trial's input and on a random half of its
rows, each against the references (run_export_trial).  A transposed layer back to a cached finer
tensor needs that tensor's history, which (feats, coords) inputs do not carry: those trials
export the transposed generative layer of the same geometry instead.

    python tools/fuzz_conv.py --trials 500                 # CUDA when present, else CPU
    python tools/fuzz_conv.py --device cpu --trials 50
    python tools/fuzz_conv.py --seeds 17 230 --verbose     # replay two trials
    python tools/fuzz_conv.py --compile --trials 100       # through torch.compile(fullgraph=True)
    python tools/fuzz_conv.py --export --trials 100        # torch.export, then the program on new rows
"""

import contextlib
import dataclasses
import os
import random
import sys
import traceback

import torch
import torch._dynamo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torchsp  # noqa: E402
import _fuzz  # noqa: E402
import reference as ref  # noqa: E402
from cases import Case, build, expected_coords, kmap_args  # noqa: E402
from conftest import crop_voxels, dynamic_output_shapes, load_lidar, poison_cuda_cache, randn, rel_err  # noqa: E402
from torchsp.geometry import BATCH_MAX  # noqa: E402

# max |a - e| / max |e| per dtype, over sums of up to 125 x 384 products that may cancel (float32:
# seed 5891's dx, 125 x 128 terms into one channel, read 1.4e-5 on the CPU); a wrong or missing
# pair reads ~1
TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4, "tf32": 1e-2, torch.float64: 1e-10}
CHANNELS = [1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 24, 31, 32, 33, 40, 48, 63, 64, 65, 96, 100, 128, 130, 160, 192,
            256, 264, 384]
FWD_TILES = [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 42]
WGRAD_TILES = [0, 3, 11, 12, 13, 15, 42]


def draw_algo(rng, wgrad=False):
    """One [dataflow, tile, split, threshold] from the space the ops accept (csrc/shim_common.h
    make_algo), each dataflow with the parameters it reads."""
    if wgrad:
        return [rng.choice([0, 1]), rng.choice(WGRAD_TILES), rng.choice([0, 1, 2, 3]), 0]
    df = rng.choice([0, 0, 1, 2, 3, 4, 5])
    tile = rng.choice(FWD_TILES)
    if df == 0:
        return [0, tile, rng.choice([0, 1, 2, 3, 4]), rng.choice([0, 0, -1])]
    if df == 1:
        return [1, tile, 0, 0]
    if df == 2:
        return [2, tile, 0, rng.choice([0, 1, 2, 3, 4, 99])]
    if df == 3:
        return [3, tile, rng.randint(2, 16), rng.choice([0, -1])]
    if df == 4:
        return [4, tile, 0, rng.choice([0, 25, 50, 6400])]
    return [5, tile, 0, rng.randint(1, 100)]


def draw_case(rng):
    """A random Case (tests/cases.py) with its coordinate count and span."""
    regime = rng.choice(["sub", "sub", "str", "floor", "gen", "tr", "trgen"])
    k = rng.choice([1, 2, 3, 3, 3, 4, 5, (3, 1, 3), (2, 3, 1), (1, 1, 3)])
    n = rng.choice([0, 1, 2, 7, 64, 127, 129, 300, 1000, 2500])
    span = rng.choice([2, 3, 4, 6, 10, 20])
    t = rng.choice([1, 1, 2, 4])
    d = rng.choice([1, 1, 1, 2])
    if rng.random() < 0.05:  # a long thin kernel: V = 7 or 343 (more offsets than a plan's 63)
        k = rng.choice([(7, 1, 1), (1, 7, 1), 7])
        span = min(span, 4)
    batch_ids = tuple(sorted(rng.sample(range(4), rng.randint(1, 3))))
    if rng.random() < 0.05:
        batch_ids = (0, BATCH_MAX)
    # Far from the origin: a multiple of every input stride drawn (1, 2, 3, 4, 6), as far out as
    # the coordinate range leaves room for span x stride and the kernel's reach.
    shift = tuple(rng.choice([0, 130776, -130776]) for _ in range(3)) if rng.random() < 0.1 else (0, 0, 0)
    kw = dict(kernel=k, n=n, span=span, batch_ids=batch_ids, shift=shift)
    if regime == "sub":
        return Case("fuzz_sub", dilation=d, in_stride=t, **kw)
    if regime == "gen":
        return Case("fuzz_gen", dilation=d, in_stride=t, generative=True, **kw)
    s = rng.choice([2, 2, 3, (2, 1, 2)])
    if regime in ("str", "floor"):
        return Case("fuzz_" + regime, stride=s, dilation=d, in_stride=t,
                    rule="floor" if regime == "floor" else "active", **kw)
    s = rng.choice([2, 2, 3])  # transposed: the input stride is a multiple of the stride
    kw["kernel"] = rng.choice([2, 3, 3, 4])
    if regime == "tr":
        return Case("fuzz_tr", stride=s, in_stride=s * rng.choice([1, 2]), transposed=True,
                    down=(rng.choice([2, 3, s]), rng.choice(["active", "floor"])), **kw)
    return Case("fuzz_trgen", stride=s, in_stride=s * rng.choice([1, 2]), transposed=True, generative=True,
                **kw)


def scan_coords(rng, whole=False):
    """A crop of the real scan (whole: all of it, in one or two batches): int32 [N, 4] on the
    CPU, 0.1 m or 0.2 m voxels."""
    pc = load_lidar()
    voxel = rng.choice([0.1, 0.2])
    if whole:
        c = crop_voxels(pc, lo=(-1e4,) * 3, hi=(1e4,) * 3, voxel=voxel)
        if rng.random() < 0.5:  # a second sample: the same sweep shifted by 3 m
            c = torch.cat([c, crop_voxels(pc + 3.0, lo=(-1e4,) * 3, hi=(1e4,) * 3, voxel=voxel, batch=1)])
        return c
    cx, cy = rng.uniform(-8, 8), rng.uniform(-8, 8)
    w = rng.choice([2.0, 4.0, 6.0])
    return crop_voxels(pc, lo=(cx - w, cy - w, -2.0), hi=(cx + w, cy + w, 3.0), voxel=voxel)


def draw(seed, device):
    """Everything trial `seed` runs, drawn from one random.Random(seed)."""
    rng = random.Random(seed)
    case = draw_case(rng)
    coords, whole = None, False
    if rng.random() < 0.15 and case.regime in ("submanifold", "strided", "floor"):
        # 125-251k rows (their tiles fill the GPU), up to 27 offsets: the reference map's unique
        # over N x V rows took longer than a trial should at V = 125 (call 3 of session 73)
        whole = device == "cuda" and rng.random() < 0.3 and case.volume() <= 27
        coords = scan_coords(rng, whole)
        case = Case(case.name + ("_whole_scan" if whole else "_scan"), kernel=case.kernel, stride=case.stride,
                    dilation=case.dilation, rule=case.rule)
    if device == "cuda":
        dtype = rng.choice([torch.float16, torch.float16, torch.bfloat16, torch.float32])
    else:
        dtype = rng.choice([torch.float32, torch.float64])
    cin, cout = rng.choice(CHANNELS), rng.choice(CHANNELS)
    if rng.random() < 0.5:  # channel counts of real networks more often
        cin, cout = rng.choice([16, 32, 64, 128]), rng.choice([16, 32, 64, 128])
    vol = ref.triple(case.kernel)[0] * ref.triple(case.kernel)[1] * ref.triple(case.kernel)[2]
    if cin * cout * vol > 384 * 384 * 27:  # keep one trial's work small
        cin = min(cin, 64)
    if whole or vol > 125:
        cin, cout = min(cin, 128), min(cout, 128)
    algo = None if rng.random() < 0.2 else (draw_algo(rng), draw_algo(rng), draw_algo(rng, wgrad=True))
    bias = rng.random() < 0.3
    mode = rng.choice(["train"] * 7 + ["nograd"] * 2 + ["repeat"])
    layout = rng.choice(["contiguous"] * 16 + ["feats_view", "weight_view", "dy_view", "dy_expand"])
    amp = None
    if device == "cuda" and dtype == torch.float32 and rng.random() < 0.3:
        amp = rng.choice([torch.float16, torch.bfloat16])
    return dict(case=case, coords=coords, dtype=dtype, cin=cin, cout=cout, algo=algo, bias=bias, mode=mode,
                layout=layout, amp=amp)


def tolerance(dtype, algo, which, amp=None):
    """The trial's bound for pass `which` (0 fwd, 1 dgrad, 2 wgrad): the autocast dtype's under
    autocast, tf32's where a float32 pass's algo asks for it."""
    if amp is not None:
        return TOL[amp]
    if dtype == torch.float32 and algo is not None and algo[which][1] == 11:
        return TOL["tf32"]
    return TOL[dtype]


def strided_copy(t, how):
    """t's values in a non-contiguous tensor: "cols" a column slice of a wider tensor, "t" the
    transpose of a transposed copy, "expand" (rows only) one row broadcast."""
    if how == "cols":
        wide = torch.full((t.shape[0], t.shape[1] + 3), float("nan"), dtype=t.dtype, device=t.device)
        wide[:, 1:1 + t.shape[1]] = t
        return wide[:, 1:1 + t.shape[1]]
    if how == "expand":
        return t[:1].expand(t.shape[0], -1) if t.shape[0] else t
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def operands(case, t, seed, device):
    """(x, fine, w, b) of trial `seed` (t: its draw): the input SparseTensor with fresh features
    and the fine coordinates or None (tests/cases.py build), the weight [V, Cin, Cout] and the
    bias [Cout] or None, in the trial's dtype.  CUDA workspace memory is poisoned first."""
    if device == "cuda":
        poison_cuda_cache()
    cin, cout, dtype = t["cin"], t["cout"], t["dtype"]
    x, fine = build(case, cin, device, dtype, seed=seed, coords=t["coords"])
    vol = case.volume()
    w = randn(vol, cin, cout, seed=seed + 11, dtype=dtype, device=device, scale=1.0 / max(1, cin * vol) ** 0.5)
    b = randn(cout, seed=seed + 12, dtype=dtype, device=device) if t["bias"] else None
    return x, fine, w, b


def raised(desc, e, verbose):
    """A trial's reason for the exception e it caught (its traceback printed when verbose)."""
    if verbose:
        traceback.print_exc()
    return f"{desc}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def no_compile_caches():
    """A context in which torch.compile reads no compiled forward and backward from AOTAutograd's
    cache: a trial must compile this tree's code.  That cache keys a graph by its forward and
    does not hash a custom op's registered backward (pytorch#144344), so an edit to
    torchsp/_autograd.py went unseen by trials compiled before it (here, 2026-11-29).  Inductor's
    own graph cache hashes the traced graphs and stays on.  The backward compiles at its first
    call, so the context spans it too."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "enable_autograd_cache"):  # torch < 2.5: no such cache
        return contextlib.nullcontext()
    return functorch_config.patch(enable_autograd_cache=False)


def run_trial(seed, device, verbose=False, compile=False, export=False):
    """None when trial `seed` passes, else a one-line reason.  compile: the call runs through
    torch.compile(fullgraph=True) (dynamo's caches reset first), forward and backward; export:
    run_export_trial instead."""
    if export:
        return run_export_trial(seed, device, verbose)
    t = draw(seed, device)
    case, dtype, cin, cout, algo = t["case"], t["dtype"], t["cin"], t["cout"], t["algo"]
    mode, layout, amp = t["mode"], t["layout"], t["amp"]
    desc = (f"seed {seed}: {case} cin {cin} cout {cout} {dtype} algo {algo} bias {t['bias']} {mode} {layout}"
            f"{f' autocast {amp}' if amp is not None else ''}{' real scan crop' if t['coords'] is not None else ''}"
            f"{' compiled' if compile else ''}")
    if verbose:
        print(desc)
    x, fine, w, b = operands(case, t, seed, device)
    train = mode != "nograd"
    xf = x.feats.detach().clone()
    wg = w.detach().clone()
    if layout == "feats_view":
        xf = strided_copy(xf, "cols")
    if layout == "weight_view":
        wg = strided_copy(wg, "t")
    xf.requires_grad_(train)
    wg.requires_grad_(train)
    dy = None

    def conv(x, feats, weight):
        return torchsp.functional.sparse_conv3d(x.replace(feats), weight, case.kernel, b, stride=case.stride,
                                                padding=case.padding, dilation=case.dilation,
                                                transposed=case.transposed, generative=case.generative,
                                                rule=case.rule, algo=algo)
    caches = contextlib.nullcontext()
    if compile:
        torch._dynamo.reset()
        conv = torch.compile(conv, fullgraph=True)
        caches = no_compile_caches()

    def call():
        with torch.autocast("cuda", dtype=amp, enabled=amp is not None), torch.set_grad_enabled(train), \
                dynamic_output_shapes():
            return conv(x, xf, wg)
    with caches:
        try:
            y = call()
            if mode == "repeat":  # the second call takes the memos (functional._Repeat, the tuner's)
                y1 = y.feats.detach().clone()
                y = call()
                if algo is not None and not torch.equal(y.feats, y1):
                    return f"{desc}: a repeated call gave other values"
            if train:
                dy = randn(y.feats.shape[0], cout, seed=seed + 13, dtype=y.feats.dtype, device=device)
                if layout in ("dy_view", "dy_expand"):
                    dy = strided_copy(dy, "t" if layout == "dy_view" else "expand")
                y.feats.backward(dy)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (every exception is a finding here)
            return raised(desc, e, verbose)
    if amp is not None and y.feats.dtype != amp:
        return f"{desc}: autocast {amp} gave {y.feats.dtype} features"
    why = coords_differ(y.coords, expected_coords(case, x.coords, fine))
    if why:
        return f"{desc}: {why}"
    nbmap = reference_map(case, x.coords, y.coords)
    rdev = x.feats.device
    checks = [("y", y.feats, ref.gather_conv(x.feats, nbmap.to(rdev), w, b), 0)]
    if train:
        checks += [("dx", xf.grad, ref.gather_conv(dy, ref.transpose_map(nbmap, x.feats.shape[0]).to(rdev),
                                                   w.transpose(1, 2)), 1),
                   ("dw", wg.grad, ref.gather_wgrad(x.feats, nbmap.to(rdev), dy), 2)]
    out = []
    for name, got, want, which in checks:
        if got is None:
            out.append(f"{name} missing")
            continue
        if got.shape != want.shape:
            out.append(f"{name} shape {tuple(got.shape)} against {tuple(want.shape)}")
            continue
        if not torch.isfinite(got).all():
            out.append(f"{name} has {int((~torch.isfinite(got)).sum())} non-finite values")
            continue
        err, tol = rel_err(got, want), tolerance(dtype, algo, which, amp)
        if verbose:
            print(f"  {name}: rel err {err:.2e} (bound {tol:.0e})")
        if err > tol:
            out.append(f"{name} rel err {err:.2e} > {tol:.0e}")
    return f"{desc}: {'; '.join(out)}" if out else None


def coords_differ(got, want):
    """None when the output coordinates `got` [M, 4] are the reference's `want` (its site rules)
    as a set and in number, else a reason.  The order is the library's.  torch.unique(dim=0)
    sorts rows lexicographically with no key packing (a packed int64 key overflowed at batch
    indices >= 8); equal row counts keep duplicates from hiding."""
    got_s, want_s = torch.unique(got.cpu().long(), dim=0), torch.unique(want.cpu().long(), dim=0)
    if got.shape[0] != want.shape[0] or not torch.equal(got_s, want_s):
        return f"output coordinates differ ({got.shape[0]} rows against {want.shape[0]})"
    return None


def reference_map(case, in_coords, out_coords):
    """int64 [M, V] on the CPU: the slow reference map of the trial's layer from in_coords to
    out_coords (tests/reference.py), whatever order out_coords come in."""
    step, sign = kmap_args(case)
    pad = case.padding if case.padding is not None else ref.default_padding(ref.triple(case.kernel),
                                                                             ref.triple(case.dilation))
    return ref.kernel_map(in_coords.cpu(), out_coords.cpu(), case.kernel, case.dilation, pad, step, sign)


def run_export_trial(seed, device, verbose=False):
    """None when trial `seed` passes through torch.export (module docstring), else a reason."""
    t = draw(seed, device)
    case, dtype, cin, cout, algo = t["case"], t["dtype"], t["cin"], t["cout"], t["algo"]
    if case.transposed and not case.generative:
        case = dataclasses.replace(case, name=case.name + "_as_trgen", generative=True, down=None)
    desc = (f"seed {seed}: {case} cin {cin} cout {cout} {dtype} algo {algo} bias {t['bias']} {t['layout']}"
            f"{' real scan crop' if t['coords'] is not None else ''} exported")
    if verbose:
        print(desc)
    x, fine, w, b = operands(case, t, seed, device)
    xf = strided_copy(x.feats, "cols") if t["layout"] == "feats_view" else x.feats
    wg = strided_copy(w, "t") if t["layout"] == "weight_view" else w
    in_stride = x.stride

    class Layer(torch.nn.Module):
        def forward(self, feats, coords, weight):
            y = torchsp.functional.sparse_conv3d(torchsp.SparseTensor(feats, coords, in_stride), weight,
                                                 case.kernel, b, stride=case.stride, padding=case.padding,
                                                 dilation=case.dilation, transposed=case.transposed,
                                                 generative=case.generative, rule=case.rule, algo=algo)
            return y.feats, y.coords

    n = x.coords.shape[0]
    half = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: n // 2].sort().values.to(device)
    try:
        rows = torch.export.Dim("rows", min=2) if n >= 2 else None  # 0 and 1 rows specialise
        shapes = ({0: rows}, {0: rows}, None) if rows is not None else None
        with torch.no_grad(), dynamic_output_shapes():
            prog = torch.export.export(Layer(), (xf, x.coords, wg), dynamic_shapes=shapes, strict=False).module()
            runs = [(x, prog(xf, x.coords, wg))]
            if rows is not None and half.numel() >= 2:
                xh = torchsp.SparseTensor(x.feats[half], x.coords[half], in_stride)
                runs.append((xh, prog(xh.feats, xh.coords, wg)))
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (every exception is a finding here)
        return raised(desc, e, verbose)
    out = []
    for (xi, (yf, yc)), which in zip(runs, ("all rows", "half the rows")):
        why = coords_differ(yc, expected_coords(case, xi.coords, fine))
        if why:
            out.append(f"{which}: {why}")
            continue
        want_y = ref.gather_conv(xi.feats, reference_map(case, xi.coords, yc).to(xi.feats.device), w, b)
        if yf.shape != want_y.shape or not torch.isfinite(yf).all():
            out.append(f"{which}: y shape {tuple(yf.shape)} or non-finite values")
            continue
        err, tol = rel_err(yf, want_y), tolerance(dtype, algo, 0)
        if verbose:
            print(f"  y ({which}): rel err {err:.2e} (bound {tol:.0e})")
        if err > tol:
            out.append(f"{which}: y rel err {err:.2e} > {tol:.0e}")
    return f"{desc}: {'; '.join(out)}" if out else None


def main():
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 exact unless a trial's tile asks for tf32
    _fuzz.main("fuzz_conv", __doc__, run_trial,
               options={"compile": "run each call through torch.compile(fullgraph=True)",
                        "export": "export each layer with torch.export and run the program (forward only)"})


if __name__ == "__main__":
    main()
