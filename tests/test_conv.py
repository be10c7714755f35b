"""Every convolution regime against the dense float64 reference (DESIGN.md section 3).

For each case of tests/cases.py: the output coordinates (set and order), the output
stride, the features (F.conv3d / F.conv_transpose3d on the scattered grid, read at
the output sites), per-dtype accuracy, gradients (gradcheck in float64 on the CPU;
against the dense reference's autograd on every device) and empty inputs.
"""

import copy
import io
import pickle

import pytest
import torch

import torchsp
from cases import BY_NAME, CASE_IDS, CASES, build, expected_coords, reference
from reference import dense_conv as ref_dense
from conftest import CUDA, TORCH_VERSION, randn, rel_err

F = torchsp.functional

# Relative (to max |reference|) tolerances per device and dtype; the reference is computed
# in float64 from the same rounded inputs.  CUDA float32 may use TF32 tensor cores.
TOL = {
    ("cpu", torch.float64): 1e-12,
    ("cpu", torch.float32): 1e-5,
    ("cpu", torch.float16): 1e-2,
    ("cpu", torch.bfloat16): 1e-2,
    ("cuda", torch.float32): 5e-3,
    ("cuda", torch.float16): 5e-3,
    ("cuda", torch.bfloat16): 2e-2,
}


def native_dtype(device):
    return torch.float64 if device == "cpu" else torch.float32


def run_case(case, device, dtype, cin=3, cout=4, bias=True, seed=0, **build_kw):
    x, fine = build(case, cin=cin, device=device, dtype=dtype, seed=seed, **build_kw)
    w = randn(case.volume(), cin, cout, seed=seed + 10, dtype=dtype, device=device,
              scale=(case.volume() * cin) ** -0.5)
    b = randn(cout, seed=seed + 11, dtype=dtype, device=device) if bias else None
    y = F.sparse_conv3d(x, w, bias=b, **case.conv_kwargs())
    return x, fine, w, b, y


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_regime(case, device):
    dtype = native_dtype(device)
    x, fine, w, b, y = run_case(case, device, dtype)
    want_coords = expected_coords(case, x.coords, fine)
    assert isinstance(y, torchsp.SparseTensor)
    assert y.coords.dtype == torch.int32 and y.coords.shape[1] == 4
    assert y.coords.device.type == device
    assert torch.equal(y.coords.cpu(), want_coords), f"{case.regime}: output coordinates differ (set or order)"
    assert tuple(y.stride) == case.out_stride()
    assert y.feats.dtype == dtype and y.feats.shape == (want_coords.shape[0], 4)
    assert y.cache is x.cache
    want = reference(case, x.feats, x.coords, w, want_coords, b)
    assert rel_err(y.feats, want) <= TOL[(device, dtype)], f"rel err {rel_err(y.feats, want):.3g}"
    # something non-trivial was computed: features differ from the bias alone
    assert (want - b.double().cpu()).abs().max() > 1e-3


@pytest.mark.parametrize("case", [BY_NAME[n] for n in ("sub_k3", "str_k3_s2", "gen_k3", "tr_k2_s2", "trgen_k3_s2")],
                         ids=lambda c: c.name)
def test_deterministic_and_cached(case, device):
    """Two calls on one input give equal results (bitwise on the CPU) and reuse the cached kernel map."""
    x, fine, w, b, y1 = run_case(case, device, native_dtype(device))
    n_maps = len(x.cache.kmaps)
    y2 = F.sparse_conv3d(x, w, bias=b, **case.conv_kwargs())
    assert len(x.cache.kmaps) == n_maps, "second call built another kernel map"
    assert torch.equal(y1.coords, y2.coords)
    if device == "cpu":
        assert torch.equal(y1.feats, y2.feats)
    else:  # the autotuner may pick another dataflow after the first call
        assert rel_err(y1.feats, y2.feats) <= 1e-5
    assert y1.coord_key == y2.coord_key
    hash(y1.coord_key)


DTYPE_CASES = [BY_NAME[n] for n in ("sub_k3", "sub_k2", "str_k3_s2", "floor_k3_s2", "gen_k3", "tr_k3_s2",
                                    "trgen_k2_s2")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DTYPE_CASES, ids=lambda c: c.name)
def test_dtypes(case, dtype, device):
    """fp32/fp16/bf16 against float64 on the same rounded inputs.  On the CPU, fp16/bf16
    may instead raise a clear error that names the dtype (issue 2)."""
    cin, cout = 16, 8
    try:
        x, fine, w, b, y = run_case(case, device, dtype, cin=cin, cout=cout)
    except (RuntimeError, TypeError, NotImplementedError, ValueError) as e:
        if device == "cpu" and dtype in (torch.float16, torch.bfloat16):
            msg = str(e).lower()
            assert any(s in msg for s in ("half", "float16", "bfloat16", "dtype")), f"unclear error: {e}"
            return
        raise
    assert y.feats.dtype == dtype
    want_coords = expected_coords(case, x.coords, fine)
    assert torch.equal(y.coords.cpu(), want_coords)
    want = reference(case, x.feats, x.coords, w, want_coords, b)
    err = rel_err(y.feats, want)
    assert err <= TOL[(device, dtype)], f"{dtype} rel err {err:.3g}"


def test_fp64_cuda_clear_error_or_correct():
    """float64 on CUDA is not in the design (CPU only); it must work or fail clearly."""
    if not CUDA:
        pytest.skip("needs CUDA")
    case = BY_NAME["sub_k3"]
    try:
        x, fine, w, b, y = run_case(case, "cuda", torch.float64)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        assert any(s in str(e).lower() for s in ("double", "float64", "dtype")), f"unclear error: {e}"
        return
    want = reference(case, x.feats, x.coords, w, x.coords, b)
    assert rel_err(y.feats, want) < 1e-10


# ------------------------------------------------------------------ gradients ---

@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradcheck(case):
    """gradcheck in float64 (CPU) for feats, weight (and bias on every other case)."""
    x, fine = build(case, cin=2, seed=7, n=45, span=3)
    w = randn(case.volume(), 2, 3, seed=8).requires_grad_()
    with_bias = CASES.index(case) % 2 == 0
    b = randn(3, seed=9).requires_grad_() if with_bias else None
    feats = x.feats.detach().clone().requires_grad_()
    kw = case.conv_kwargs()

    def fn(feats, w, *bias):
        return F.sparse_conv3d(x.replace(feats), w, bias=bias[0] if bias else None, **kw).feats

    args = (feats, w) + ((b,) if with_bias else ())
    assert fn(*args).shape[0] > 0
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-5)


BACKWARD_CASES = [BY_NAME[n] for n in ("sub_k3", "sub_k1", "sub_k2", "str_k3_s2", "str_k2_s2_t2", "gen_k3", "tr_k3_s2",
                                       "trgen_k3_s2")]


_CUDA_ONLY = pytest.mark.skipif(not CUDA, reason="needs CUDA")
BACKWARD_DTYPES = [pytest.param("cpu", torch.float64, id="cpu-fp64"),
                   pytest.param("cuda", torch.float32, id="cuda-fp32", marks=_CUDA_ONLY),
                   pytest.param("cuda", torch.float16, id="cuda-fp16", marks=_CUDA_ONLY),
                   pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=_CUDA_ONLY)]


@pytest.mark.parametrize("device,dtype", BACKWARD_DTYPES)
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: c.name)
def test_backward_vs_dense(case, device, dtype):
    """dgrad and wgrad against the dense reference's autograd (CPU fp64; CUDA fp32/fp16/bf16)."""
    cin, cout = 8, 8
    x, fine = build(case, cin=cin, device=device, dtype=dtype, seed=3)
    w = randn(case.volume(), cin, cout, seed=4, dtype=dtype, device=device, scale=(case.volume() * cin) ** -0.5)
    feats = x.feats.detach().clone().requires_grad_()
    wp = w.clone().requires_grad_()
    y = F.sparse_conv3d(x.replace(feats), wp, **case.conv_kwargs())
    g = randn(*y.feats.shape, seed=5, dtype=dtype, device=device)
    y.feats.backward(g)

    out_coords = y.coords.cpu()
    rf = x.feats.detach().cpu().double().requires_grad_()
    rw = w.detach().cpu().double().requires_grad_()
    want = reference(case, rf, x.coords, rw, out_coords)
    want.backward(g.cpu().double())
    tol = 1e-10 if dtype == torch.float64 else TOL[(device, dtype)] * 2
    assert feats.grad is not None and feats.grad.dtype == dtype and wp.grad.dtype == dtype
    assert rel_err(feats.grad, rf.grad) <= tol, f"dgrad rel err {rel_err(feats.grad, rf.grad):.3g}"
    assert rel_err(wp.grad, rw.grad) <= tol, f"wgrad rel err {rel_err(wp.grad, rw.grad):.3g}"


# ------------------------------------------------------------------ empty ---

@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_empty_input(case, device):
    """N = 0 gives [0, Cout] features on [0, 4] int32 coordinates, and zero-sized gradients."""
    dtype = native_dtype(device)
    empty = torch.empty(0, 4, dtype=torch.int32)
    x, fine = build(case, cin=3, device=device, dtype=dtype, coords=empty)
    w = randn(case.volume(), 3, 5, seed=1, dtype=dtype, device=device).requires_grad_()
    feats = x.feats.detach().clone().requires_grad_()
    y = F.sparse_conv3d(x.replace(feats), w, **case.conv_kwargs())
    assert y.feats.shape == (0, 5) and y.feats.dtype == dtype
    assert y.coords.shape == (0, 4) and y.coords.dtype == torch.int32
    assert tuple(y.stride) == case.out_stride()
    y.feats.sum().backward()
    assert feats.grad.shape == (0, 3)
    assert w.grad.shape == w.shape and not bool(w.grad.any())


# ------------------------------------------------------------------ pointwise ---

@pytest.mark.parametrize("device,dtype", BACKWARD_DTYPES[:3])
def test_pointwise_conv_is_one_gemm_without_a_map(device, dtype):
    """A 1x1x1 conv at stride 1 without padding (plain or transposed) builds no kernel map and
    runs as one GEMM; output, bias and gradients match the dense float64 reference.  With
    padding 1 the same kernel shifts its input and takes the map; on CUDA under
    torch.use_deterministic_algorithms(True) the pointwise conv takes the map too (cuBLAS wants
    CUBLAS_WORKSPACE_CONFIG there) and agrees."""
    cin, cout = 5, 7
    x, _ = build(BY_NAME["sub_k3_t2"], cin=cin, device=device, dtype=dtype, seed=21)
    w = randn(1, cin, cout, seed=22, dtype=dtype, device=device, scale=cin ** -0.5)
    b = randn(cout, seed=23, dtype=dtype, device=device)
    g = randn(x.coords.shape[0], cout, seed=24, dtype=dtype, device=device)
    tol = 1e-10 if dtype == torch.float64 else TOL[(device, dtype)] * 2
    rf = x.feats.detach().cpu().double().requires_grad_()
    rw, rb = (t.detach().cpu().double().requires_grad_() for t in (w, b))

    def dense(padding):
        for t in (rf, rw, rb):
            t.grad = None
        want = ref_dense(rf, x.coords.cpu(), 2, rw, (1, 1, 1), x.coords.cpu(), padding=padding, bias=rb)
        want.backward(g.cpu().double())
        return want.detach(), rf.grad, rw.grad, rb.grad

    def check(kw, want, maps):
        x.cache.kmaps.clear()
        x.cache.calls.clear()
        feats, wp, bp = (t.detach().clone().requires_grad_() for t in (x.feats, w, b))
        y = F.sparse_conv3d(x.replace(feats), wp, 1, bias=bp, **kw)
        assert len(x.cache.kmaps) == maps, f"{kw}: {len(x.cache.kmaps)} kernel maps built"
        assert y.coords is x.coords and y.stride == x.stride and y.coord_key == x.coord_key
        y.feats.backward(g)
        for got, exp, name in zip((y.feats, feats.grad, wp.grad, bp.grad), want, ("y", "dx", "dw", "dbias")):
            assert got.dtype == dtype and rel_err(got, exp) <= tol, f"{kw}: {name} rel err {rel_err(got, exp):.3g}"

    plain = dense((0, 0, 0))
    check({}, plain, 0)
    check({"transposed": True}, plain, 0)
    check({"algo": [1, 0, 0, 0]}, plain, 0)
    check({"padding": 1}, dense((1, 1, 1)), 1)
    if device == "cuda":
        was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            check({}, plain, 1)
        finally:
            torch.use_deterministic_algorithms(was)


# ------------------------------------------------------------------ transposed errors ---

def test_transposed_without_finer_coords_errors(device):
    """A transposed conv on a tensor that was never downsampled says to use generative=True."""
    x, _ = build(BY_NAME["trgen_k2_s2"], cin=2, device=device, dtype=native_dtype(device))
    w = randn(8, 2, 2, dtype=native_dtype(device), device=device)
    with pytest.raises((ValueError, RuntimeError), match="generative=True"):
        F.sparse_conv3d(x, w, 2, stride=2, transposed=True)


def test_transposed_round_trip_order(device):
    """Down (K=2, s=2) then up returns exactly the fine coordinates in their (unsorted) order."""
    case = BY_NAME["tr_k2_s2"]
    x, fine = build(case, cin=2, device=device, dtype=native_dtype(device), seed=11)
    assert not torch.equal(fine, torch.unique(fine.cpu(), dim=0).to(fine.device)), "input should be unsorted"
    w = randn(8, 2, 2, dtype=native_dtype(device), device=device)
    y = F.sparse_conv3d(x, w, 2, stride=2, transposed=True)
    assert torch.equal(y.coords, fine)
    assert tuple(y.stride) == (1, 1, 1)


def test_stride_tuple_and_int_agree(device):
    """stride=2 and stride=(2, 2, 2), kernel 3 and (3, 3, 3) are the same conv."""
    x, _ = build(BY_NAME["str_k3_s2"], cin=2, device=device, dtype=native_dtype(device))
    w = randn(27, 2, 3, dtype=native_dtype(device), device=device)
    a = F.sparse_conv3d(x, w, 3, stride=2)
    b = F.sparse_conv3d(x, w, (3, 3, 3), stride=(2, 2, 2), padding=(1, 1, 1), dilation=(1, 1, 1))
    assert torch.equal(a.coords, b.coords) and torch.equal(a.feats, b.feats)


# ------------------------------------------------------------------ eager shortcuts ---

@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
def test_no_grad_call_skips_autograd_only(mode, device):
    """Without gradients functional runs conv_fwd below its autograd wrapper: the result must be
    the reference's and bitwise the graph-recording call's, with no graph attached."""
    case = BY_NAME["sub_k3"]
    dtype = native_dtype(device)
    x, _ = build(case, cin=5, device=device, dtype=dtype, seed=21)
    w = randn(27, 5, 6, seed=22, dtype=dtype, device=device, scale=27 ** -0.5)
    want = reference(case, x.feats.cpu().double(), x.coords, w.cpu().double(), x.coords.cpu())
    recorded = F.sparse_conv3d(x, w.clone().requires_grad_(), 3)
    assert recorded.feats.grad_fn is not None
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
           "frozen": torch.enable_grad}[mode]
    with ctx():
        got = F.sparse_conv3d(x, w if mode == "frozen" else w.clone().requires_grad_(), 3)
    assert got.feats.grad_fn is None and not got.feats.requires_grad
    assert torch.equal(got.feats, recorded.feats.detach())
    assert rel_err(got.feats, want) <= TOL[(device, dtype)]


@pytest.mark.parametrize("overlap", [False, True], ids=["one_stream", "two_streams"])
@pytest.mark.parametrize("needs", ["both", "feats", "weight"])
def test_eager_and_op_autograd_routes_agree(needs, overlap, device, monkeypatch):
    """Eager training calls run torchsp._C.conv_train (dgrad plan and wgrad pair list read
    from the KernelMap); traced graphs and direct op callers run conv_fwd's registered autograd.
    Both must give y, dx and dw bitwise alike, and the fp64 dense reference's.  On CUDA, fp16
    at 64 channels: the wgrad over pair pieces with the map's cached pair list (sm_90a builds).
    two_streams: the eager backward's wgrad on a side stream (torchsp._autograd.OVERLAP_ENTRIES
    lowered to 0), the same sums."""
    from torchsp.plan import pass_plan
    monkeypatch.setattr(torchsp._autograd, "OVERLAP_ENTRIES", 0 if overlap else 1 << 62)
    case = BY_NAME["sub_k3"]
    dtype, c = (torch.float16, 64) if device == "cuda" else (torch.float64, 5)
    x, _ = build(case, cin=c, device=device, dtype=dtype, seed=41)
    w = randn(27, c, c, seed=42, dtype=dtype, device=device, scale=(27 * c) ** -0.5)
    g = randn(x.coords.shape[0], c, seed=43, dtype=dtype, device=device)
    a = [0, 0, 0, 0]
    grads = []
    for route in ("eager", "op"):
        f = x.feats.detach().clone().requires_grad_(needs in ("both", "feats"))
        ww = w.detach().clone().requires_grad_(needs in ("both", "weight"))
        if route == "eager":
            y = F.sparse_conv3d(x.replace(f), ww, 3, algo=a).feats
            assert "SparseConvFunction" in y.grad_fn.name()
        else:
            (km,) = x.cache.kmaps.values()
            geom = torchsp.kmap.ConvGeometry(3)
            order, segs = pass_plan(km, "fwd", a, geom, dtype)
            order_t, segs_t = pass_plan(km, "dgrad", a, geom, dtype)
            y = torch.ops.torchsp.conv_fwd(f, ww, km.nbmap, km.nbmap_t, a, a, a, order, order_t, segs, segs_t)
            assert "GeneratedBackwardFor_torchsp_conv_fwd" in type(y.grad_fn).__name__
        y.backward(g)
        grads.append((y.detach(), f.grad, ww.grad))
    for u, v in zip(*grads):
        assert (u is None) == (v is None) and (u is None or torch.equal(u, v))
    rf = x.feats.detach().cpu().double().requires_grad_()
    rw = w.detach().cpu().double().requires_grad_()
    want = reference(case, rf, x.coords, rw, x.coords.cpu())
    want.backward(g.cpu().double())
    tol = TOL[(device, dtype)] * (1 if device == "cpu" else 2)
    y, dx, dw = grads[0]
    assert rel_err(y, want.detach()) <= tol
    assert dx is None or rel_err(dx, rf.grad) <= tol
    assert dw is None or rel_err(dw, rw.grad) <= tol
    assert (dx is None) == (needs == "weight") and (dw is None) == (needs == "feats")


@pytest.mark.skipif(not CUDA, reason="streams: CUDA only")
def test_eager_backward_on_two_streams_real_scan(monkeypatch):
    """The eager backward with wgrad on a side stream (torchsp._autograd.OVERLAP_ENTRIES lowered to
    0), on a real-scan crop at 64 channels in NaN-poisoned memory: dx and dw against the float64
    gather references, and bitwise equal to the one-stream backward.  dy is written late on the
    current stream (after a ~1 ms spin, over a NaN-filled buffer), so a side stream that did not
    wait for the current one would read NaN; the gradients are read only on the current stream,
    so one that was not joined back would leave them unfinished.  A first backward builds the
    map's wgrad pair list and fills the allocator's cache, so the checked backward makes no fresh
    cudaMalloc (which can wait for the device and hide a missing fork)."""
    import reference as ref
    from conftest import lidar_crop, poison_cuda_cache, real_scan_layer
    geom = torchsp.kmap.conv_geometry(3)
    x, km, _, w, dy, ref_map, _, want_dx = real_scan_layer(lidar_crop().cuda(), geom, 64, 64, torch.float16)
    want_dw = ref.gather_wgrad(x.feats.cpu(), ref_map, dy.cpu())
    got = {}
    for overlap in (True, False):
        monkeypatch.setattr(torchsp._autograd, "OVERLAP_ENTRIES", 0 if overlap else 1 << 62)
        f = x.feats.detach().clone().requires_grad_()
        ww = w.detach().clone().requires_grad_()
        F.sparse_conv3d(x.replace(f), ww, 3, algo=[0, 0, 0, 0]).feats.backward(dy)
        f.grad = ww.grad = None
        poison_cuda_cache()
        y = F.sparse_conv3d(x.replace(f), ww, 3, algo=[0, 0, 0, 0]).feats
        late = torch.full_like(dy, float("nan"))
        torch.cuda._sleep(2_000_000)
        late.copy_(dy)
        y.backward(late)
        got[overlap] = (f.grad.clone(), ww.grad.clone())
    torch.cuda.synchronize()
    dx, dw = got[True]
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    tol = 2 * TOL[("cuda", torch.float16)]
    assert rel_err(dx, want_dx) <= tol and rel_err(dw, want_dw) <= tol
    assert torch.equal(dx, got[False][0]) and torch.equal(dw, got[False][1])


def test_eager_train_node_semantics(device):
    """The eager training call is a C++ autograd node (torchsp._C.conv_train): retain_graph and a
    second backward accumulate the same gradients again, an in-place change of feats after the
    forward is caught by autograd's version check, and a call whose operands need no grad records
    no node.  Gradients against the fp64 dense reference."""
    case = BY_NAME["sub_k3"]
    dtype = torch.float16 if device == "cuda" else torch.float64
    x, _ = build(case, cin=16, device=device, dtype=dtype, seed=51)
    w = randn(27, 16, 8, seed=52, dtype=dtype, device=device, scale=(27 * 16) ** -0.5).requires_grad_()
    f = x.feats.detach().clone().requires_grad_()
    g = randn(x.coords.shape[0], 8, seed=53, dtype=dtype, device=device)
    y = F.sparse_conv3d(x.replace(f), w, 3, algo=[0, 0, 0, 0]).feats
    assert "SparseConvFunction" in y.grad_fn.name()
    y.backward(g, retain_graph=True)
    dx1, dw1 = f.grad.clone(), w.grad.clone()
    y.backward(g)
    assert torch.equal(f.grad, dx1 + dx1) and torch.equal(w.grad, dw1 + dw1)
    rf = x.feats.detach().cpu().double().requires_grad_()
    rw = w.detach().cpu().double().requires_grad_()
    reference(case, rf, x.coords, rw, x.coords.cpu()).backward(g.cpu().double())
    tol = TOL[(device, dtype)] * (1 if device == "cpu" else 2)
    assert rel_err(dx1, rf.grad) <= tol and rel_err(dw1, rw.grad) <= tol
    y = F.sparse_conv3d(x.replace(f), w, 3, algo=[0, 0, 0, 0]).feats
    with torch.no_grad():
        f.add_(1)
    with pytest.raises(RuntimeError, match="inplace"):
        y.backward(g)
    y = F.sparse_conv3d(x.replace(f.detach()), w.detach(), 3, algo=[0, 0, 0, 0]).feats
    assert y.grad_fn is None and not y.requires_grad


def test_eager_train_pair_list_built_in_backward(device):
    """The wgrad pair list of an eager training call (torchsp.plan.pair_list, a torchsp._C.PairList)
    is built by the first backward that reads it, not at forward: a forward in grad mode leaves it
    unbuilt, the backward builds it (against a pure-torch reference of the map's pairs), a second
    layer on the same map reuses it, and the weight gradients match the fp64 dense reference.  On
    a device whose wgrad takes no pair list, the PairList itself against the reference."""
    from test_pairs import check_pairs
    from torchsp.kmap import conv_geometry, get_kernel_map
    from torchsp.plan import pair_list, wgrad_pair_list
    case = BY_NAME["sub_k3"]
    dtype = torch.float16 if device == "cuda" else torch.float64
    x, _ = build(case, cin=32, device=device, dtype=dtype, seed=61)
    km = get_kernel_map(x, conv_geometry(3), traced=False)[0]
    holder = wgrad_pair_list(km, [0, 0, 0, 0], dtype, 32, 32)
    if holder is None:  # CPU, or a CUDA build / device without the pair-piece wgrad
        holder = torchsp._C.PairList(km.nbmap)
        assert not holder.built and torch.equal(holder.nbmap, km.nbmap)
        pairs, starts = holder.get()
        assert holder.built and holder.get()[0] is not None
        check_pairs(km.nbmap, pairs, starts)
        return
    assert holder is pair_list(km, "fwd") and not holder.built
    ws = [randn(27, 32, 32, seed=62 + i, dtype=dtype, device=device, scale=(27 * 32) ** -0.5).requires_grad_()
          for i in range(2)]
    g = randn(x.coords.shape[0], 32, seed=64, dtype=dtype, device=device)
    y = F.sparse_conv3d(x, ws[0], 3, algo=[0, 0, 0, 0]).feats
    assert not holder.built, "a forward in grad mode built the wgrad pair list"
    y.backward(g)
    assert holder.built
    check_pairs(km.nbmap, *holder.get(), bounded=km.nbmap.is_cuda)
    pairs = holder.get()[0]
    y = F.sparse_conv3d(x, ws[1], 3, algo=[0, 0, 0, 0]).feats
    y.backward(g)
    assert pair_list(km, "fwd") is holder and holder.get()[0] is pairs
    for w in ws:
        rw = w.detach().cpu().double().requires_grad_()
        reference(case, x.feats.cpu().double(), x.coords, rw, x.coords.cpu()).backward(g.cpu().double())
        assert rel_err(w.grad, rw.grad) <= 2 * TOL[(device, dtype)]


@pytest.mark.skipif(not CUDA, reason="CUDA only: the host synchronisations of a GPU training call")
def test_eager_training_call_does_not_synchronise():
    """A CUDA training call on a fresh map (built beforehand without a synchronisation: a
    submanifold map) runs its forward (dgrad plan included) and its backward (which builds the
    map's wgrad pair list, bounded: csrc/pair_list.h) without a host synchronisation that torch's
    sync debug mode raises on (a prototype that catches .item(), .cpu() and the like, not every
    kind).  Gradients against the fp64 dense reference; the list against the pure-torch
    reference of the map's pairs."""
    from test_pairs import check_pairs
    from torchsp.kmap import conv_geometry, get_kernel_map
    from torchsp.plan import wgrad_pair_list
    case = BY_NAME["sub_k3"]
    x, _ = build(case, cin=32, device="cuda", dtype=torch.float16, seed=65)
    km = get_kernel_map(x, conv_geometry(3), traced=False)[0]
    holder = wgrad_pair_list(km, [0, 0, 0, 0], torch.float16, 32, 32)
    if holder is None:
        pytest.skip("this build or device runs no pair-list wgrad")
    f = x.feats.detach().clone().requires_grad_()
    w = randn(27, 32, 32, seed=66, dtype=torch.float16, device="cuda", scale=(27 * 32) ** -0.5).requires_grad_()
    g = randn(x.coords.shape[0], 32, seed=67, dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        F.sparse_conv3d(x.replace(f), w, 3, algo=[0, 0, 0, 0]).feats.backward(g)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert holder.built
    check_pairs(km.nbmap, *holder.get(), bounded=True)
    rf = x.feats.detach().cpu().double().requires_grad_()
    rw = w.detach().cpu().double().requires_grad_()
    reference(case, rf, x.coords, rw, x.coords.cpu()).backward(g.cpu().double())
    tol = 2 * TOL[("cuda", torch.float16)]
    assert rel_err(f.grad, rf.grad) <= tol and rel_err(w.grad, rw.grad) <= tol


@pytest.mark.parametrize("backward", ["eager", "compiled_autograd"])
def test_eager_train_node_holds_its_pair_list(backward, device):
    """torchsp._C.conv_train keeps the PairList it is given (csrc/pair_list.h: a tensor in the
    node's saved data owns a reference) until the node goes; the backward builds the list and
    runs the pair-list wgrad, also under compiled autograd (which hashes the saved data), and a
    node whose list nothing else holds still has it.  Gradients against the fp64 dense reference;
    the list against the pure-torch reference of the map's pairs."""
    import gc
    from test_pairs import check_pairs
    from torchsp.kmap import conv_geometry, get_kernel_map
    case = BY_NAME["sub_k3"]
    dtype = torch.float16 if device == "cuda" else torch.float64
    x, _ = build(case, cin=32, device=device, dtype=dtype, seed=71)
    km = get_kernel_map(x, conv_geometry(3), traced=False)[0]
    f = x.feats.detach().clone().requires_grad_()
    w = randn(27, 32, 16, seed=72, dtype=dtype, device=device, scale=(27 * 32) ** -0.5).requires_grad_()
    g = randn(x.coords.shape[0], 16, seed=73, dtype=dtype, device=device)
    a = [0, 0, 0, 0]
    holder = torchsp._C.PairList(km.nbmap)
    assert holder.refs == 1
    train = lambda pair_list: torchsp._C.conv_train(f, w, km.nbmap, km.nbmap_t, a, a, a, km.order, [],  # noqa: E731
                                                   km.order_t, [], pair_list, False)
    y = train(holder)
    assert holder.refs == 2 and not holder.built
    if backward == "eager":
        y.backward(g)
    else:
        import torch._dynamo.compiled_autograd as ca
        enable = getattr(ca, "_enable", None) or ca.enable  # torch >= 2.6 / 2.4-2.5
        with enable(torch.compile(backend="eager")):
            y.backward(g)
    # torch < 2.7 traces the backward (csrc/eager.cpp, is_traceable) on stand-ins, which leave
    # the list alone (a cached graph may run it on real tensors); newer torch runs it as one
    # opaque op on the real tensors.  Whatever ran, the list kept is the real one.
    assert holder.built or (backward != "eager" and TORCH_VERSION < (2, 7))
    check_pairs(km.nbmap, *holder.get(), bounded=km.nbmap.is_cuda)
    rf = x.feats.detach().cpu().double().requires_grad_()
    rw = w.detach().cpu().double().requires_grad_()
    reference(case, rf, x.coords, rw, x.coords.cpu()).backward(g.cpu().double())
    tol = TOL[(device, dtype)] * (1 if device == "cpu" else 2)
    assert rel_err(f.grad, rf.grad) <= tol and rel_err(w.grad, rw.grad) <= tol
    del y
    gc.collect()
    # Compiled autograd keeps the inputs of the backwards it compiled (seen: the first two's,
    # with torch 2.13), as it does any saved tensor: only an eager node's reference is counted.
    assert backward != "eager" or holder.refs == 1, "the node kept its pair list after it went"
    dx, dw = f.grad, w.grad
    f.grad = w.grad = None
    train(torchsp._C.PairList(km.nbmap)).backward(g)  # the node's reference is the list's only one
    assert torch.equal(f.grad, dx) and torch.equal(w.grad, dw)


def test_pair_list_keeps_no_stand_in():
    """A PairList read under a tracer (here FakeTensorMode over a fake map) returns the tracer's
    pair list without keeping it; read later on the real map it builds the real one."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from test_pairs import check_pairs, random_map
    nb = random_map(300, 27, seed=81)
    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True) as mode:
        fake = torchsp._C.PairList(mode.from_tensor(nb))
        pairs, starts = fake.get()
        assert starts.shape == (28,) and not fake.built
        real = torchsp._C.PairList(nb)
        real.get()  # a real map's list, built while the mode runs: not kept either
        assert not real.built
    check_pairs(nb, *real.get())
    assert real.built


def _torch_save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("rows", [None, False, True])
@pytest.mark.parametrize("built", [False, True])
def test_pair_list_copies_with_its_map(built, rows, device):
    """A SparseTensor whose map holds a PairList (a CUDA training call leaves one) deepcopies,
    pickles and torch.saves: the copy's list is its own, built where the original's was, with
    the input rows where the original has them (rows None: torchsp.plan.pair_list's own choice,
    rows on CUDA; else a list made with that flag), and equal to the pure-torch reference of the
    map's pairs."""
    from test_pairs import check_pairs
    from torchsp.kmap import conv_geometry, get_kernel_map
    from torchsp.plan import pair_list
    x, _ = build(BY_NAME["sub_k3"], cin=4, device=device, dtype=torch.float32, seed=91)
    km = get_kernel_map(x, conv_geometry(3), traced=False)[0]
    if rows is not None:
        km.plans[("pairs", "fwd")] = torchsp._C.PairList(km.nbmap, rows=rows)
    holder = pair_list(km, "fwd")
    assert holder.rows == (km.nbmap.is_cuda if rows is None else rows)
    if built:
        holder.get()
    for copy_fn in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o)), _torch_save_load):
        x2 = copy_fn(x)
        km2 = get_kernel_map(x2, conv_geometry(3), traced=False)[0]
        assert km2 is not km and torch.equal(km2.nbmap, km.nbmap)
        h2 = km2.plans[("pairs", "fwd")]
        assert h2 is not holder and h2.built == built and h2.nbmap.device == km.nbmap.device
        assert h2.rows == holder.rows
        pairs, starts = h2.get()
        assert pairs.dim() == (2 if holder.rows else 1)
        check_pairs(km2.nbmap, pairs, starts, bounded=km2.nbmap.is_cuda)


def test_geometry_memo_keeps_argument_checks():
    """conv_geometry memoises on (type, value): kernel_size=True is still an error after 1 was
    seen, and a list argument still works."""
    from torchsp.kmap import conv_geometry
    assert conv_geometry(1).kernel_size == (1, 1, 1)
    assert conv_geometry(1) is conv_geometry(1)
    with pytest.raises(TypeError, match="kernel_size"):
        conv_geometry(True)
    assert conv_geometry([3, 3, 1], stride=[1, 1, 1]).kernel_size == (3, 3, 1)
    with pytest.raises(ValueError, match="stride"):
        conv_geometry(3, stride=0)


MEMO_CASES = ["sub_k3", "sub_k1", "sub_k2", "sub_k3_d2", "sub_k3_p0", "sub_k311", "str_k3_s2", "str_k3_s212",
              "floor_k3_s2", "gen_k3", "gen_k311"]


def test_call_memo_many_geometries_on_one_input(device):
    """sparse_conv3d's call memo (SparseCache.calls) keys geometry, map and output coordinates by
    the call's arguments: one input convolved with eleven geometries, in two rounds, each result
    against the dense reference (a memo keyed too coarsely returns another geometry's map)."""
    dtype = native_dtype(device)
    x, _ = build(BY_NAME["sub_k3"], cin=3, device=device, dtype=dtype, seed=31)
    for rnd in range(2):
        for name in MEMO_CASES:
            case = BY_NAME[name]
            w = randn(case.volume(), 3, 2, seed=32 + rnd, dtype=dtype, device=device, scale=(case.volume() * 3) ** -0.5)
            y = F.sparse_conv3d(x, w, **case.conv_kwargs())
            want_coords = expected_coords(case, x.coords)
            assert torch.equal(y.coords.cpu(), want_coords), f"round {rnd}, {name}: output coordinates"
            want = reference(case, x.feats, x.coords, w, want_coords)
            assert rel_err(y.feats, want) <= TOL[(device, dtype)], f"round {rnd}, {name}"
    assert len(x.cache.calls) == len(MEMO_CASES) - 1  # sub_k1 is pointwise: one GEMM, no map


def test_call_memo_keeps_argument_checks(device):
    """After a kernel_size=1 geometry is memoised (conv_geometry), kernel_size=True (== 1 in
    Python) is still an error, and a changed weight shape still gets its message."""
    dtype = native_dtype(device)
    x, _ = build(BY_NAME["sub_k3"], cin=3, device=device, dtype=dtype, seed=33)
    w1 = randn(1, 3, 2, seed=34, dtype=dtype, device=device)
    F.sparse_conv3d(x, w1, 1)
    F.sparse_conv3d(x, w1, [1, 1, 1])  # unhashable arguments: no memo, same conv
    with pytest.raises(TypeError, match="kernel_size"):
        F.sparse_conv3d(x, w1, True)
    with pytest.raises(ValueError, match="offsets"):
        F.sparse_conv3d(x, randn(27, 3, 2, seed=35, dtype=dtype, device=device), 1)
    with pytest.raises(ValueError, match="channels"):
        F.sparse_conv3d(x, randn(1, 4, 2, seed=36, dtype=dtype, device=device), 1)


@pytest.mark.skipif(not CUDA, reason="row orders are built on CUDA only")
@pytest.mark.parametrize("name", ["sub_k3", "sub_k3_d2", "sub_k3_p0", "str_k3_s2"])
def test_mirrored_map_sorts_once(name, monkeypatch):
    """A training call on a mirrored map (submanifold, odd kernel, centred padding) sorts its rows
    once: the dgrad plan is nbmap_t's step plan on the forward's row order, whose tiles use as
    many offsets as the forward's (offsets mirrored), and the gradients match the dense
    reference.  Other maps (padding 0, strided) sort each direction."""
    import torchsp.kmap as K
    case = BY_NAME[name]
    sorts = []
    real = K.mask_order
    monkeypatch.setattr(K, "mask_order", lambda nbmap, *a, **kw: sorts.append(nbmap) or real(nbmap, *a, **kw))
    x, _ = build(case, cin=8, device="cuda", dtype=torch.float16, seed=41, n=400)
    w = randn(27, 8, 8, seed=42, dtype=torch.float16, device="cuda", scale=(27 * 8) ** -0.5)
    feats = x.feats.detach().clone().requires_grad_()
    y = F.sparse_conv3d(x.replace(feats), w, algo=[0, 0, 0, 0], **case.conv_kwargs())
    g = randn(*y.feats.shape, seed=43, dtype=torch.float16, device="cuda")
    y.feats.backward(g)
    (km,) = x.cache.kmaps.values()
    mirrored = name in ("sub_k3", "sub_k3_d2")
    assert km.mirrored == mirrored and len(sorts) == (1 if mirrored else 2)
    n, v = km.nbmap_t.shape
    if mirrored:
        assert torch.equal(km.nbmap_t, km.nbmap.flip(1))
        assert torch.equal(km.order_t[:n], km.order[:n])

    def offsets_per_tile(nbmap, plan):  # each 128-row tile's offset union, from the plain map
        rows = nbmap[plan[:nbmap.shape[0]].long()] >= 0
        pad = -rows.shape[0] % 128
        return torch.cat([rows, rows.new_zeros(pad, v)]).view(-1, 128, v).any(1).sum(1)

    if mirrored:
        assert torch.equal(offsets_per_tile(km.nbmap_t, km.order_t), offsets_per_tile(km.nbmap, km.order))
    rf = x.feats.detach().cpu().double().requires_grad_()
    reference(case, rf, x.coords, w.cpu().double(), y.coords.cpu()).backward(g.cpu().double())
    assert rel_err(feats.grad, rf.grad) <= TOL[("cuda", torch.float16)] * 2


@pytest.mark.skipif(not CUDA, reason="row orders are built on CUDA only")
def test_gradless_forward_sorts_no_dgrad_order():
    """A forward without gradients sorts the map's forward rows only; the first training call
    then sorts the dgrad rows (mask_order of nbmap_t) and its gradients match the reference."""
    from torchsp.kmap import _UNSORTED, mask_order
    case = BY_NAME["str_k3_s2"]
    x, _ = build(case, cin=8, device="cuda", dtype=torch.float16, seed=31)
    w = randn(27, 8, 8, seed=32, dtype=torch.float16, device="cuda", scale=(27 * 8) ** -0.5)
    a = [0, 0, 0, 0]  # a fixed dataflow: the autotuner's measuring would run dgrad (and sort)
    with torch.no_grad():
        y = F.sparse_conv3d(x, w, algo=a, **case.conv_kwargs())
    (km,) = x.cache.kmaps.values()
    assert km._order is not _UNSORTED and km._order_t is _UNSORTED
    feats = x.feats.detach().clone().requires_grad_()
    y2 = F.sparse_conv3d(x.replace(feats), w, algo=a, **case.conv_kwargs())
    assert torch.equal(y2.feats.detach(), y.feats)
    g = randn(*y2.feats.shape, seed=33, dtype=torch.float16, device="cuda")
    y2.feats.backward(g)
    assert km._order_t is not _UNSORTED
    # a step plan on the plain mask order (refined only after REFINE_AFTER reads)
    assert torch.equal(km.order_t, torch.ops.torchsp.tile_steps(km.nbmap_t, mask_order(km.nbmap_t), False))
    rf = x.feats.detach().cpu().double().requires_grad_()
    reference(case, rf, x.coords, w.cpu().double(), y.coords.cpu()).backward(g.cpu().double())
    assert rel_err(feats.grad, rf.grad) <= TOL[("cuda", torch.float16)] * 2
