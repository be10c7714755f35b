"""float32 convolutions on tf32 tensor cores (algo tile 11) against float64 references.

Tile 11 (TSP_TILE_TF32, csrc/torchsp.h) on a float32 CUDA pass runs csrc/cuda/conv_tf32.cu
(forward and dgrad, every dataflow of torchsp/plan.py) or conv_wgrad.cu's kernel in tf32
(wgrad): operands rounded to tf32's 10-bit mantissa, fp32 accumulation, so results sit
~1e-4 - 1e-3 (relative norm) from float64, where exact float32 sits ~1e-7 - 1e-6.  Each GPU
check therefore asserts both sides: within TOL of float64, and farther than TF32_MIN, which
only tf32 rounding explains (a silent fallback to the exact kernel would fail it).  Checked:
- every dataflow, forward, dgrad and wgrad, against the dense float64 reference's autograd
  (tests/cases.py regimes) and against the float64 gather references on a real LiDAR crop,
  bitwise equal run to run;
- worst cases: C = 4, 12, 100, 384 and mixed, one row, all 27 offsets present, a row count
  one partial tile past a full one; channel counts that are not multiples of 4 (3, 5, 6) run
  tf32 too, on operands zero-padded to multiples of 4 (csrc/cuda/conv.cu, channel padding);
- the switch: with torch.backends.cuda.matmul.allow_tf32 off the default path is exact float32,
  with torch.set_float32_matmul_precision("high") it is bitwise the explicit tile-11 path in all
  three passes; the tuner keeps to tile 11 and caches those choices apart;
- a NaN input reaches exactly the outputs (and weight-gradient entries) that read it.
Workspace and outputs are poisoned with NaN before GPU runs.  The selection rules (default
algorithm, candidates, cache keys, which plans run) are checked without a GPU too.
"""

import types

import pytest
import torch

import reference as ref
import torchsp
from cases import BY_NAME, build, reference_grads
from conftest import CUDA, dense_cube, lidar_crop, poison_cuda_cache, randn, real_scan_layer
from torchsp import tune
from torchsp.plan import TF32_TILE, pass_plan, segmented, takes_segments

F = torchsp.functional
ops = torch.ops.torchsp
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")

TOL = 5e-3  # relative norm of tf32 results at C <= 384 (typically 2e-4 - 8e-4)
TF32_MIN = 2e-5  # ... and at least this: exact float32 is ~1e-6 or closer
EXACT = 1e-5  # relative norm of exact float32 results

T = TF32_TILE
# [dataflow, tile, split, threshold], all on the tf32 kernels.
DATAFLOWS = {
    "sorted": [0, T, 0, 0],
    "unsorted": [0, T, 0, -1],
    "split2": [0, T, 2, 0],
    "split3": [0, T, 3, 0],
    "ws": [1, T, 0, 0],
    "hybrid1": [2, T, 0, 1],
    "hybrid2": [2, T, 0, 2],
    "hybrid0": [2, T, 0, 0],  # every offset weight-stationary
    "hybrid_all_os": [2, T, 0, 99],  # no offset weight-stationary: one plain segment
}
WGRAD = [0, T, 0, 0]
EXACT_ALGO = [0, 0, 0, 0]


def rel_norm(actual, expected):
    """||actual - expected|| / ||expected||, in float64 on the CPU."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def _check(got, want, tf32, what):
    """tf32: within TOL of float64 but not closer than TF32_MIN; else exact float32."""
    err = rel_norm(got, want)
    if tf32:
        assert TF32_MIN < err <= TOL, f"{what}: relative error {err:.3g} is not tf32-sized ({TF32_MIN}, {TOL}]"
    else:
        assert err <= EXACT, f"{what}: relative error {err:.3g} above exact float32's {EXACT}"


@pytest.fixture
def matmul_precision():
    """torch.set_float32_matmul_precision, restored after the test (with allow_tf32)."""
    old = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(old)


@pytest.fixture
def untuned(monkeypatch):
    """The default algorithm, not a tuned choice: the tuner is off during the test."""
    monkeypatch.setitem(tune._state, "mode", "off")


def _train_step(x, w, g, algo, **conv_kwargs):
    """(y, dx, dw) of F.sparse_conv3d(x, w, algo=algo) and its backward with output gradient g."""
    feats = x.feats.detach().clone().requires_grad_()
    wp = w.detach().clone().requires_grad_()
    poison_cuda_cache()
    y = F.sparse_conv3d(x.replace(feats), wp, algo=algo, **conv_kwargs)
    poison_cuda_cache()
    y.feats.backward(g)
    return y.feats.detach(), feats.grad, wp.grad


# ------------------------------------------------------------- selection ---

def test_tf32_selection_rules(matmul_precision):
    """Without a GPU: the default algorithm, the tuner's candidates and keys, and which plans run
    follow torch.backends.cuda.matmul.allow_tf32 for float32 CUDA features only."""
    cuda32 = types.SimpleNamespace(is_cuda=True, dtype=torch.float32)
    cuda16 = types.SimpleNamespace(is_cuda=True, dtype=torch.float16)
    host32 = torch.zeros(1, 4)
    matmul_precision("highest")
    assert not torch.backends.cuda.matmul.allow_tf32
    assert tune.default_algo(cuda32) == EXACT_ALGO
    assert tune._dtype_key(cuda32) == "torch.float32"
    matmul_precision("high")
    assert torch.backends.cuda.matmul.allow_tf32
    assert tune.default_algo(cuda32) == [0, T, 0, 0]
    assert tune._dtype_key(cuda32) == "torch.float32+tf32"
    assert tune.default_algo(cuda16) == EXACT_ALGO and tune._dtype_key(cuda16) == "torch.float16"
    assert tune.default_algo(host32) == EXACT_ALGO and tune._dtype_key(host32) == "torch.float32"
    for p in tune.PASSES:
        cands = tune.candidates("cuda", p, (3, 3, 3), tf32=True)
        assert cands[0] == [0, T, 0, 0], "the default is the tuner's reference"
        assert all(a[1] == T for a in cands) and len(cands) == len({tuple(a) for a in cands})
        assert not any(a[1] == T for a in tune.candidates("cuda", p, (3, 3, 3)))
    assert any(segmented(a) for a in tune.candidates("cuda", "fwd", (3, 3, 3), tf32=True))
    assert takes_segments(torch.float32, [1, T, 0, 0]) and takes_segments(torch.float32, [0, T, 2, 0])
    assert not takes_segments(torch.float32, [1, 0, 0, 0]) and not takes_segments(torch.float64, [1, T, 0, 0])
    assert takes_segments(torch.float16, [1, 0, 0, 0]) and takes_segments(None, [2, 0, 0, 1])


# ------------------------------------------------------------- dataflows ---

@needs_cuda
@pytest.mark.parametrize("name", list(DATAFLOWS))
@pytest.mark.parametrize("case", [BY_NAME[n] for n in (
    "sub_k3", "sub_k2", "sub_k5", "str_k2_s2", "str_k3_s2", "gen_k3", "tr_k2_s2", "trgen_k3_s2", "sub_k3_d2",
    "floor_k3_s2")], ids=lambda c: c.name)
def test_tf32_dataflow_vs_dense(case, name):
    """Forward, dgrad and wgrad of each dataflow on tile 11 against the dense float64 reference's
    autograd; 20 -> 36 channels (multiples of 4, not of 8).  V = 125 (sub_k5) is past the
    output-stationary kernels' 64 offsets: forward and dgrad fall back to exact float32."""
    cin, cout = 20, 36
    x, _ = build(case, cin=cin, device="cuda", dtype=torch.float32, seed=3)
    w = randn(case.volume(), cin, cout, seed=4, dtype=torch.float32, device="cuda",
              scale=(case.volume() * cin) ** -0.5)
    a = DATAFLOWS[name]
    kw = case.conv_kwargs()
    y_coords = F.sparse_conv3d(x, w, algo=EXACT_ALGO, **kw).coords
    g = randn(y_coords.shape[0], cout, seed=5, dtype=torch.float32, device="cuda")
    y, dx, dw = _train_step(x, w, g, (a, a, WGRAD), **kw)
    want, want_dx, want_dw = reference_grads(case, x.feats, x.coords, w, y_coords, g)
    os_tf32 = case.volume() <= 64
    _check(y, want, os_tf32, "fwd")
    _check(dx, want_dx, os_tf32, "dgrad")
    _check(dw, want_dw, True, "wgrad")


@needs_cuda
@pytest.mark.parametrize("cin,cout", [(4, 16), (32, 32), (64, 64), (96, 136), (256, 128)])
def test_tf32_real_scan(cin, cout):
    """A real LiDAR crop (submanifold 3x3x3 and stride-2 K=2): fwd and dgrad of every dataflow and
    wgrad on tile 11 against the float64 gather references on the reference kernel map, segmented
    plans built for float32, and every result bitwise equal run to run."""
    c = lidar_crop().cuda()
    dt = torch.float32
    for geom in (torchsp.kmap.ConvGeometry(3), torchsp.kmap.ConvGeometry(2, 2)):
        x, km, out, w, dy, ref_map, want_y, want_dx = real_scan_layer(c, geom, cin, cout, dt)
        want_dw = ref.gather_wgrad(x.feats.cpu(), ref_map, dy.cpu())
        poison_cuda_cache()
        dw = ops.conv_wgrad(x.feats, dy, km.nbmap, WGRAD)
        _check(dw, want_dw, True, ("wgrad", geom.kernel_size))
        assert torch.equal(dw, ops.conv_wgrad(x.feats, dy, km.nbmap, WGRAD)), "wgrad not deterministic"
        for name, a in DATAFLOWS.items():
            order, segs = pass_plan(km, "fwd", a, geom, dt)
            order_t, segs_t = pass_plan(km, "dgrad", a, geom, dt)
            assert bool(segs) == segmented(a) and bool(segs_t) == segmented(a), (name, "plan for float32")
            poison_cuda_cache()
            y = ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, WGRAD, order, order_t, segs, segs_t)
            poison_cuda_cache()
            dx = ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t, segs_t)
            _check(y, want_y, True, (name, geom.kernel_size, "fwd"))
            _check(dx, want_dx, True, (name, geom.kernel_size, "dgrad"))
            y2 = ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, WGRAD, order, order_t, segs, segs_t)
            dx2 = ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t, segs_t)
            assert torch.equal(y, y2) and torch.equal(dx, dx2), (name, "not deterministic")


def _worst_coords(shape):
    if shape == "dense_cube":  # 9^3 sites: interior rows have all 27 offsets
        return dense_cube(-4, 5)
    if shape == "one_row":
        return torch.tensor([[0, 3, -2, 7]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(7)
    c = torch.unique(torch.cat([torch.zeros(700, 1, dtype=torch.long),
                                torch.randint(-7, 7, (700, 3), generator=gen)], 1), dim=0).int()
    if shape == "rows_131":  # one full 128-row tile and 3 rows of the next
        c = c[torch.randperm(c.shape[0], generator=gen)[:131]]
    return c


# shape: (cin, cout); channel counts not multiples of 4 run tf32 on zero-padded copies.
WORST = {"c4": (4, 4), "c12": (12, 12), "c100": (100, 100), "c384": (384, 384), "c12_to_100": (12, 100),
         "c100_to_4": (100, 4), "one_row": (32, 48), "dense_cube": (32, 48), "rows_131": (32, 48),
         "odd_c3": (3, 5), "odd_c5": (5, 3), "c6": (6, 10)}


@needs_cuda
@pytest.mark.parametrize("name", list(DATAFLOWS))
@pytest.mark.parametrize("shape", list(WORST))
def test_tf32_worst_cases(name, shape):
    """Narrow, wide and mixed channels, one row, every offset present, a partial tile; forward
    and dgrad of each dataflow and wgrad against the float64 gather references."""
    cin, cout = WORST[shape]
    c = _worst_coords(shape)
    dt = torch.float32
    x = torchsp.SparseTensor(randn(c.shape[0], cin, dtype=dt, device="cuda", seed=1), c.cuda())
    w = randn(27, cin, cout, dtype=dt, device="cuda", seed=2, scale=(27 * cin) ** -0.5)
    a = DATAFLOWS[name]
    tf32 = True  # odd channel counts too, padded (before session 71: the exact fallback)
    poison_cuda_cache()
    y = F.sparse_conv3d(x, w, 3, algo=(a, a, WGRAD)).feats
    geom = torchsp.kmap.ConvGeometry(3)
    km = torchsp.kmap.get_kernel_map(x, geom)[0]
    if shape == "dense_cube":
        assert int((km.nbmap >= 0).all(1).sum()) == 7 ** 3
    nbmap = km.nbmap.cpu().long()
    _check(y, ref.gather_conv(x.feats.cpu(), nbmap, w.cpu()), tf32, "fwd")
    dy = randn(*y.shape, dtype=dt, device="cuda", seed=3)
    order_t, segs_t = pass_plan(km, "dgrad", a, geom, dt)
    poison_cuda_cache()
    dx = ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t, segs_t)
    _check(dx, ref.gather_conv(dy.cpu(), km.nbmap_t.cpu().long(), w.cpu().transpose(1, 2)), tf32, "dgrad")
    poison_cuda_cache()
    dw = ops.conv_wgrad(x.feats, dy, km.nbmap, WGRAD)
    _check(dw, ref.gather_wgrad(x.feats.cpu(), nbmap, dy.cpu()), tf32, "wgrad")


# ------------------------------------------------------------------ switch ---

def _switch_case():
    """A 32 -> 48 submanifold conv on random coordinates (channels the tf32 kernels take)."""
    case = BY_NAME["sub_k3"]
    x, _ = build(case, cin=32, device="cuda", dtype=torch.float32, seed=6, n=600, span=6)
    w = randn(27, 32, 48, seed=7, dtype=torch.float32, device="cuda", scale=(27 * 32) ** -0.5)
    g = randn(x.feats.shape[0], 48, seed=8, dtype=torch.float32, device="cuda")
    km = torchsp.kmap.get_kernel_map(x, 3)[0]
    nbmap = km.nbmap.cpu().long()
    want = (ref.gather_conv(x.feats.cpu(), nbmap, w.cpu()),
            ref.gather_conv(g.cpu(), km.nbmap_t.cpu().long(), w.cpu().transpose(1, 2)),
            ref.gather_wgrad(x.feats.cpu(), nbmap, g.cpu()))
    return x, w, g, want


@needs_cuda
def test_tf32_flag_off_default_is_exact(untuned, matmul_precision):
    """allow_tf32 off (torch's default): the default float32 path is exact fp32 in all three
    passes, ~1e-5 of float64, and bitwise the explicit [0, 0, 0, 0] path."""
    matmul_precision("highest")
    assert not torch.backends.cuda.matmul.allow_tf32
    x, w, g, want = _switch_case()
    got = _train_step(x, w, g, None, kernel_size=3)
    exact = _train_step(x, w, g, [EXACT_ALGO] * 3, kernel_size=3)
    for what, a, b, e in zip(("fwd", "dgrad", "wgrad"), got, exact, want):
        _check(a, e, False, what)
        assert torch.equal(a, b), what


@needs_cuda
def test_tf32_flag_on_default_is_tile_11(untuned, matmul_precision):
    """torch.set_float32_matmul_precision("high") sets allow_tf32: the default float32 path is
    bitwise the explicit tile-11 path in forward, dgrad and wgrad, a tf32-sized distance from
    both float64 and the exact float32 path."""
    matmul_precision("high")
    assert torch.backends.cuda.matmul.allow_tf32
    x, w, g, want = _switch_case()
    got = _train_step(x, w, g, None, kernel_size=3)
    tf32 = _train_step(x, w, g, [[0, T, 0, 0]] * 3, kernel_size=3)
    exact = _train_step(x, w, g, [EXACT_ALGO] * 3, kernel_size=3)
    for what, a, b, e, w64 in zip(("fwd", "dgrad", "wgrad"), got, tf32, exact, want):
        assert torch.equal(a, b), (what, "default is not tile 11")
        _check(a, w64, True, what)
        _check(a, e, True, (what, "against exact float32"))
        _check(e, w64, False, (what, "explicit exact path"))


@needs_cuda
def test_tf32_tuner_keeps_to_tile_11(tmp_path, monkeypatch, matmul_precision):
    """With allow_tf32 on the tuner measures tile-11 candidates only, every pass; with it off none;
    the two choices are cached under different keys."""
    monkeypatch.setenv("TORCHSP_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(tune._state, "verbose", False)
    tune.clear(memory_only=True)
    try:
        c = lidar_crop()[:4000].cuda()
        x = torchsp.SparseTensor(randn(c.shape[0], 32, dtype=torch.float32, device="cuda", seed=1), c)
        w = randn(27, 32, 32, dtype=torch.float32, device="cuda", seed=2, scale=0.05)
        geom = torchsp.kmap.ConvGeometry(3)
        km = torchsp.kmap.get_kernel_map(x, geom)[0]
        matmul_precision("high")
        on = tune.choose_algo(x, km, geom, w, force=True)
        assert all(a[1] == T for a in on), on
        matmul_precision("highest")
        off = tune.choose_algo(x, km, geom, w, force=True)
        assert not any(a[1] == T for a in off), off
        keys = list(tune._choices())
        assert any("|float32+tf32|" in k for k in keys) and any("|float32|" in k for k in keys), keys
    finally:
        tune.clear(memory_only=True)


# --------------------------------------------------------------------- NaN ---

@needs_cuda
def test_tf32_nan_propagates():
    """A NaN input feature reaches exactly the outputs that read it (forward, every dataflow),
    a NaN output gradient exactly the input gradients that read it (dgrad), and a NaN x[p, c]
    exactly the weight-gradient entries dw[k, c, :] of the offsets k that pair p (wgrad)."""
    c = lidar_crop()[:3000].cuda()
    x = randn(c.shape[0], 32, dtype=torch.float32, device="cuda", seed=1)
    x[17, 5] = float("nan")
    st = torchsp.SparseTensor(x, c)
    w = randn(27, 32, 32, dtype=torch.float32, device="cuda", seed=2, scale=0.05)
    geom = torchsp.kmap.ConvGeometry(3)
    km = torchsp.kmap.get_kernel_map(st, geom)[0]
    readers = (km.nbmap == 17).any(1).cpu()
    readers_t = (km.nbmap_t == 17).any(1).cpu()
    assert readers.any() and readers_t.any()
    dy = randn(c.shape[0], 32, dtype=torch.float32, device="cuda", seed=3)
    dy[17, 5] = float("nan")
    for name, a in DATAFLOWS.items():
        y = F.sparse_conv3d(st, w, 3, algo=(a, a, WGRAD)).feats.cpu()
        assert torch.equal(torch.isnan(y).any(1), readers) and torch.isnan(y[readers]).all(), name
        order_t, segs_t = pass_plan(km, "dgrad", a, geom, torch.float32)
        dx = ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t, segs_t).cpu()
        assert torch.equal(torch.isnan(dx).any(1), readers_t) and torch.isnan(dx[readers_t]).all(), name
    dw = ops.conv_wgrad(x, dy.nan_to_num(), km.nbmap, WGRAD).cpu()
    want = torch.zeros(dw.shape, dtype=torch.bool)
    want[(km.nbmap == 17).any(0).cpu(), 5, :] = True
    assert torch.equal(torch.isnan(dw), want)
