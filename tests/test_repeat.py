"""sparse_conv3d's repeat memo (torchsp.functional._Repeat).

A default call, resolved once (geometry, map, tuner choice), serves its repeats: they skip the
geometry, argument checks, map and tuner lookups.  These tests make the memo serve calls (the full path's
map lookup is made to fail, so a call that passes went through a repeat) and check what it serves
against the float64 dense reference, the full path's argument errors and the tuner's choices.
REFINE_AFTER is lowered so that a map's row plan is refined after a few calls.
"""

import pytest
import torch

import torchsp
from cases import BY_NAME, build, expected_coords, reference, reference_grads
from conftest import randn, rel_err

F = torchsp.functional
tune = torchsp.tune
REFINE = 3
TOL = 1e-2  # 16-bit features against the float64 reference


def _dtype(device):
    return torch.float16 if device == "cuda" else torch.bfloat16


def _repeats(x):
    """The repeats of convs on x (its cache also holds those of the tensors it came from)."""
    return [v for k, v in x.cache.calls.items() if isinstance(v, F._Repeat) and k[-3] == x.coord_key]


@pytest.fixture
def settle_fast(monkeypatch):
    """Maps settle after REFINE reads; the tuner measures nothing (on CUDA its measuring would
    read a map's plan many times in a layer's first call)."""
    monkeypatch.setattr(torchsp.kmap, "REFINE_AFTER", REFINE)
    monkeypatch.setitem(tune._state, "verbose", False)
    monkeypatch.setitem(tune._state, "mode", "off")


def _no_full_path(monkeypatch):
    """From here on a call that takes the full path fails: the repeat must serve it."""
    def full_path(*args, **kwargs):
        raise AssertionError("the full path ran where a repeat should have served the call")
    monkeypatch.setattr(F, "get_kernel_map", full_path)


def _settle(x, w, case, bias=None, calls=REFINE):
    with torch.no_grad():
        for _ in range(calls):
            y = F.sparse_conv3d(x, w, bias=bias, **case.conv_kwargs())
    return y


@pytest.mark.parametrize("name", ["sub_k3", "str_k3_s2", "tr_k2_s2", "gen_k3"])
def test_repeat_serves_settled_calls(device, settle_fast, monkeypatch, name):
    """Repeats of a settled call (no gradients, then a training call) against the reference: the
    output, and dx, dw through the repeat's training route; the bias is added."""
    case = BY_NAME[name]
    dtype = _dtype(device)
    x, fine = build(case, cin=5, device=device, dtype=dtype, seed=41)
    v = case.volume()
    w = randn(v, 5, 6, seed=42, dtype=dtype, device=device, scale=(v * 5) ** -0.5)
    b = randn(6, seed=43, dtype=dtype, device=device)
    _settle(x, w, case, b)
    assert len(_repeats(x)) == 1
    _no_full_path(monkeypatch)
    want_coords = expected_coords(case, x.coords, fine)
    with torch.no_grad():
        y = F.sparse_conv3d(x, w, bias=b, **case.conv_kwargs())
    assert torch.equal(y.coords.cpu(), want_coords)
    want = reference(case, x.feats.double(), x.coords, w.double(), want_coords, bias=b.double())
    assert y.feats.dtype == dtype and rel_err(y.feats, want) <= TOL
    feats = x.feats.detach().clone().requires_grad_()
    wp = w.detach().clone().requires_grad_()
    g = randn(want_coords.shape[0], 6, seed=44, dtype=dtype, device=device)
    y = F.sparse_conv3d(x.replace(feats), wp, **case.conv_kwargs())
    y.feats.backward(g)
    ry, rdx, rdw = reference_grads(case, x.feats.double(), x.coords, w.double(), want_coords, g.double())
    for got, exp, what in ((y.feats, ry, "y"), (feats.grad, rdx, "dx"), (wp.grad, rdw, "dw")):
        assert rel_err(got, exp) <= TOL, f"{what} rel err {rel_err(got, exp):.3g}"


def test_repeat_reads_the_row_plan_each_call(device, settle_fast, monkeypatch):
    """A repeat reads the map's row plan as the full path does: each call counts a read, so the
    plan is refined after REFINE_AFTER reads (CUDA step plans: a new plan tensor), and the calls
    before and after the refinement match the reference."""
    case = BY_NAME["sub_k3"]
    dtype = _dtype(device)
    x, _ = build(case, cin=4, device=device, dtype=dtype, seed=45)
    w = randn(27, 4, 4, seed=46, dtype=dtype, device=device, scale=(27 * 4) ** -0.5)
    _settle(x, w, case, calls=1)
    (rep,) = _repeats(x)
    kmap = rep.kmap
    assert kmap._reads[0] == 1
    _no_full_path(monkeypatch)
    want = reference(case, x.feats.double(), x.coords, w.double(), x.coords)
    plans = []
    with torch.no_grad():
        for n in range(2, REFINE + 2):
            plans.append(kmap._order)
            y = F.sparse_conv3d(x, w, 3)
            assert kmap._reads[0] == min(n, REFINE) and rel_err(y.feats, want) <= TOL, n
    if device == "cuda":
        assert plans[0] is plans[REFINE - 2] and kmap._order is not plans[0]  # refined at the REFINE-th read


def test_layers_of_several_widths_on_one_tensor_keep_a_repeat_each(device, settle_fast, monkeypatch):
    """Convs of the same geometry but other weight shapes on one tensor (a U-Net level's 32 -> 64
    and 64 -> 64) each keep their repeat: called in alternation, every call after the first
    round is served by one (the full path is made to fail), each against the reference."""
    case = BY_NAME["sub_k3"]
    dtype = _dtype(device)
    x, _ = build(case, cin=4, device=device, dtype=dtype, seed=53)
    ws = [randn(27, 4, c, seed=54 + c, dtype=dtype, device=device, scale=(27 * 4) ** -0.5) for c in (3, 5, 7)]
    with torch.no_grad():
        for w in ws:
            F.sparse_conv3d(x, w, 3)
    assert len(_repeats(x)) == 3
    _no_full_path(monkeypatch)
    with torch.no_grad():
        for _ in range(2):
            for w in ws:
                y = F.sparse_conv3d(x, w, 3)
                want = reference(case, x.feats.double(), x.coords, w.double(), x.coords)
                assert y.feats.shape[1] == w.shape[2] and rel_err(y.feats, want) <= TOL


def test_repeat_keeps_the_full_paths_checks(device, settle_fast):
    """Once a repeat exists, operands it was not made for still get the full path: its errors
    for a wrong offset count, channel count, dtype, bias and device, and a correct conv for
    another output width."""
    case = BY_NAME["sub_k3"]
    dtype = _dtype(device)
    x, _ = build(case, cin=4, device=device, dtype=dtype, seed=47)
    w = randn(27, 4, 3, seed=48, dtype=dtype, device=device, scale=(27 * 4) ** -0.5)
    _settle(x, w, case)
    assert len(_repeats(x)) == 1
    with pytest.raises(ValueError, match="offsets"):
        F.sparse_conv3d(x, randn(8, 4, 3, dtype=dtype, device=device), 3)
    with pytest.raises(ValueError, match="channels"):
        F.sparse_conv3d(x, randn(27, 5, 3, dtype=dtype, device=device), 3)
    with pytest.raises(TypeError, match="dtype"):
        F.sparse_conv3d(x, w.float(), 3)
    with pytest.raises(ValueError, match="bias"):
        F.sparse_conv3d(x, w, 3, bias=randn(4, dtype=dtype, device=device))
    if device == "cuda":
        with pytest.raises(ValueError, match="weight is on"):
            F.sparse_conv3d(x, w.cpu(), 3)
    w5 = randn(27, 4, 5, seed=49, dtype=dtype, device=device, scale=(27 * 4) ** -0.5)
    with torch.no_grad():
        y = F.sparse_conv3d(x, w5, 3)
    want = reference(case, x.feats.double(), x.coords, w5.double(), x.coords)
    assert y.feats.shape == (x.coords.shape[0], 5) and rel_err(y.feats, want) <= TOL


def test_repeat_follows_the_tuner_and_autocast(device, settle_fast, monkeypatch):
    """A repeat runs the algorithm the full path would choose now: set_fixed, a tuner state set
    directly, and autocast (which casts the operands) each take effect on the next call."""
    case = BY_NAME["sub_k3"]
    dtype = torch.float16
    x, _ = build(case, cin=4, device=device, dtype=dtype, seed=50)
    w = randn(27, 4, 4, seed=51, dtype=dtype, device=device, scale=(27 * 4) ** -0.5)
    _settle(x, w, case)
    assert len(_repeats(x)) == 1
    seen = []
    real = torchsp._C.conv_fwd

    def spy(*args):
        seen.append(list(args[4]))
        return real(*args)
    monkeypatch.setattr(torchsp._C, "conv_fwd", spy)
    want = reference(case, x.feats.double(), x.coords, w.double(), x.coords)
    ws = [0, 0, 0, 0]
    with torch.no_grad():
        ys = [F.sparse_conv3d(x, w, 3)]
        tune.set_fixed([1, 0, 0, 0])
        try:
            ys.append(F.sparse_conv3d(x, w, 3))
        finally:
            tune.set_fixed(None)
        ys.append(F.sparse_conv3d(x, w, 3))
        monkeypatch.setitem(tune._state, "fixed", ([1, 0, 0, 0], ws, ws))
        ys.append(F.sparse_conv3d(x, w, 3))
        monkeypatch.setitem(tune._state, "fixed", None)
        ys.append(F.sparse_conv3d(x, w, 3))
    assert seen == [ws, [1, 0, 0, 0], ws, [1, 0, 0, 0], ws]
    for y in ys:
        assert y.feats.dtype == dtype and rel_err(y.feats, want) <= TOL
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        y = F.sparse_conv3d(x, w, 3)
    assert y.feats.dtype == torch.bfloat16 and rel_err(y.feats, want) <= 3 * TOL


def test_tune_lists_layers_that_repeats_served(device, settle_fast, tmp_path, monkeypatch):
    """tune() measures every layer of a model even when each has a repeat already: its listing
    (choose_algo) runs, so each layer gets a cached choice."""
    monkeypatch.setenv("TORCHSP_CACHE_DIR", str(tmp_path))
    tune.clear(memory_only=True)
    dtype = _dtype(device)
    case = BY_NAME["sub_k3"]
    x, _ = build(case, cin=8, device=device, dtype=dtype, seed=52)
    net = torch.nn.Sequential(torchsp.nn.SparseConv3d(8, 16, 3), torchsp.nn.SparseConv3d(16, 8, 2, stride=2))
    net = net.to(device=device, dtype=dtype)
    with torch.no_grad():
        for _ in range(REFINE):
            net(x)
    assert len(_repeats(x)) == 2
    monkeypatch.setitem(tune._state, "mode", None)
    try:
        tuned = tune.tune(net, (x,), verbose=False, search=False)
    finally:
        tune.clear(memory_only=True)
    assert len(tuned) == 2
