"""The fused batch norm (+ ReLU) of torchsp.nn.BatchNorm's eager calls: torchsp._C.batch_norm_train /
batch_norm_eval -> torch.ops.torchsp.batch_norm_stats / batch_norm_act / batch_norm_act_backward ->
csrc/shim_norm_*.cpp -> tsp_bn_* (csrc/cpu/batch_norm_act.c, csrc/cuda/batch_norm_act.cu).

Every result is checked against torch's BatchNorm1d (and ReLU) run in float64 on the CPU on the
same values: outputs, x / weight / bias gradients, running statistics, num_batches_tracked.  The
data have a mean far from zero (7, std 3) so that statistics summed without a shift would lose
digits; CUDA outputs and workspaces come from a NaN-filled allocator cache.
"""

import pytest
import torch
from torch import nn

import torchsp
from torchsp import nn as spnn
from conftest import DEVICES, lidar_crop, poison_cuda_cache

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = [pytest.param("cuda", marks=NEEDS_CUDA)]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}
CASES = ([("cpu", t) for t in (torch.float32, torch.float64, torch.float16)]
         + [pytest.param("cuda", t, marks=NEEDS_CUDA) for t in (torch.float32, torch.float16, torch.bfloat16)])


def _data(n, c, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64) * 3 + 7
    # channels of their own scale, and one near zero, so the ReLU cuts about half of it
    x = x * torch.linspace(0.5, 2.0, c, dtype=torch.float64) - torch.where(torch.arange(c) == 0, 7.0, 0.0)
    dy = torch.randn(n, c, generator=g, dtype=torch.float64)
    return x.to(dtype).to(device), dy.to(dtype).to(device)


def _pair(c, dtype, param_dtype, device, seed, **kw):
    """(bn, ref): an nn.BatchNorm1d in param_dtype on device with random affine and running statistics, and its
    float64 CPU twin."""
    bn = nn.BatchNorm1d(c, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if bn.weight is not None:
            bn.weight.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)
            bn.bias.copy_(torch.rand(c, generator=g) - 0.5)
        if bn.running_mean is not None:
            bn.running_mean.copy_(torch.randn(c, generator=g))
            bn.running_var.copy_(torch.rand(c, generator=g) + 0.5)
    ref = nn.BatchNorm1d(c, **kw).double()
    bn = bn.to(device=device, dtype=param_dtype)
    ref.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in bn.state_dict().items()})
    return bn, ref


def _reference(ref, x, dy, relu):
    xr = x.detach().double().cpu().requires_grad_()
    y = ref(xr)
    y = torch.relu(y) if relu else y
    y.backward(dy.double().cpu())
    return y.detach(), xr.grad


def _check(actual, expected, dtype, what):
    a = actual.detach().double().cpu()
    scale = max(expected.abs().max().item(), 1.0)
    err = (a - expected).abs().max().item() / scale if a.numel() else 0.0
    assert not torch.isnan(a).any(), f"{what}: NaN"
    assert err <= TOL[dtype], f"{what}: max error {err:.3g} (relative to {scale:.3g}) > {TOL[dtype]}"


def _param_dtypes(device, dtype):
    return [dtype, torch.float32] if device == "cuda" and dtype != torch.float32 else [dtype]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("c", [3, 32, 96, 384])
@pytest.mark.parametrize("relu", [False, True])
def test_fused_batch_norm_matches_float64_reference(device, dtype, c, relu):
    """Training forward + backward of BatchNorm(+ReLU) against torch in float64: N not a multiple of any block's
    rows, odd channel counts (scalar loads) and multiples of 8 (16-byte loads), both parameter dtypes on CUDA."""
    for param_dtype in _param_dtypes(device, dtype):
        n = 4099 if device == "cuda" else 1037
        x, dy = _data(n, c, dtype, device, seed=c)
        bn, ref = _pair(c, dtype, param_dtype, device, seed=c + 1)
        if device == "cuda":
            poison_cuda_cache()
        xg = x.clone().requires_grad_()
        y = torchsp.nn.norm._fused_batch_norm(bn, xg, relu)
        assert y.dtype == dtype and y.shape == x.shape
        y.backward(dy)
        want_y, want_dx = _reference(ref, x, dy, relu)
        pt = TOL[param_dtype] if param_dtype != torch.float64 else TOL[dtype]
        _check(y, want_y, dtype, "y")
        _check(xg.grad, want_dx, dtype, "dx")
        _check(bn.weight.grad, ref.weight.grad, dtype, "dweight")
        _check(bn.bias.grad, ref.bias.grad, dtype, "dbias")
        assert bn.weight.grad.dtype == param_dtype
        _check(bn.running_mean, ref.running_mean, param_dtype if pt > TOL[dtype] else dtype, "running_mean")
        _check(bn.running_var, ref.running_var, param_dtype if pt > TOL[dtype] else dtype, "running_var")
        assert bn.num_batches_tracked.item() == ref.num_batches_tracked.item() == 1
        if relu:  # the ReLU cut a good part of channel 0, so its mask was tested
            assert 0.2 < (want_y[:, 0] == 0).double().mean().item() < 0.8


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_batch_norm_many_rows(device, dtype):
    """Enough rows for every block of the reduction to loop several times (unrolled steps and their tail)."""
    x, dy = _data(300_007, 64, dtype, device, seed=5)
    bn, ref = _pair(64, dtype, torch.float32, device, seed=6)
    poison_cuda_cache()
    xg = x.clone().requires_grad_()
    y = torchsp.nn.norm._fused_batch_norm(bn, xg, True)
    y.backward(dy)
    want_y, want_dx = _reference(ref, x, dy, True)
    _check(y, want_y, dtype, "y")
    _check(xg.grad, want_dx, dtype, "dx")
    _check(bn.weight.grad, ref.weight.grad, torch.float32, "dweight")
    _check(bn.running_var, ref.running_var, torch.float32, "running_var")


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("c", [5, 64])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("want", ["all", "residual only", "not residual"])
def test_fused_batch_norm_with_residual(device, dtype, c, relu, want):
    """relu?(bn(x) + r) in one call (a residual block's tail) against torch in float64: output and the gradients
    of x, weight, bias and r, with and without the ReLU, and with only some inputs requiring grad."""
    n = 2053
    x, dy = _data(n, c, dtype, device, seed=c)
    r, _ = _data(n, c, dtype, device, seed=c + 7)
    r = r - 7  # about half of the sums below zero
    bn, ref = _pair(c, dtype, dtype, device, seed=c + 1)
    if want == "residual only":
        for p in bn.parameters():
            p.requires_grad_(False)
    if device == "cuda":
        poison_cuda_cache()
    xg = x.clone().requires_grad_(want != "residual only")
    rg = r.clone().requires_grad_(want != "not residual")
    y = torchsp.nn.norm._fused_batch_norm(bn, xg, relu, rg)
    y.backward(dy)
    xr, rr = x.double().cpu().requires_grad_(), r.double().cpu().requires_grad_()
    want_y = ref(xr) + rr
    want_y = torch.relu(want_y) if relu else want_y
    want_y.backward(dy.double().cpu())
    _check(y, want_y.detach(), dtype, "y")
    if want != "residual only":
        _check(xg.grad, xr.grad, dtype, "dx")
        _check(bn.weight.grad, ref.weight.grad, dtype, "dweight")
        _check(bn.bias.grad, ref.bias.grad, dtype, "dbias")
    else:
        assert xg.grad is None and bn.weight.grad is None
    if want != "not residual":
        _check(rg.grad, rr.grad, dtype, "dresidual")
    else:
        assert rg.grad is None
    if relu:
        assert 0.2 < (want_y == 0).double().mean().item() < 0.8


@pytest.mark.parametrize("device", DEVICES)
def test_residual_blocks_fuse_their_tails(device, monkeypatch):
    """torchsp.models' ResidualBlock and SparseBasicBlock run their last BatchNorm, the add and the ReLU as one
    forward_add_relu, and give the result of the unfused modules (the same block with a hook on its ReLU, which
    turns the fusion off): forward, the gradient of the input and of every parameter."""
    from torchsp.models import ResidualBlock, SparseBasicBlock
    dtype = torch.float16 if device == "cuda" else torch.float32
    coords = lidar_crop().to(device)
    calls = []
    real = spnn.BatchNorm.forward_add_relu
    monkeypatch.setattr(spnn.BatchNorm, "forward_add_relu", lambda *a: calls.append(1) or real(*a))
    for make in (lambda: ResidualBlock(8, 16), lambda: ResidualBlock(16, 16), lambda: SparseBasicBlock(16, 16)):
        torch.manual_seed(0)
        block = make().to(device=device, dtype=dtype)
        twin = make().to(device=device, dtype=dtype)
        twin.load_state_dict(block.state_dict())
        twin.relu.register_forward_hook(lambda *a: None)
        cin = block.net[0].in_channels if isinstance(block, ResidualBlock) else 16
        g = torch.Generator().manual_seed(1)
        f = torch.randn(coords.shape[0], cin, generator=g).to(device=device, dtype=dtype)
        outs = []
        for m in (block, twin):
            fg = f.clone().requires_grad_()
            y = m(torchsp.SparseTensor(fg, coords)).feats
            y.float().square().mean().backward()
            outs.append([y.detach(), fg.grad] + [p.grad for p in m.parameters()])
        assert len(calls) == 1
        calls.clear()
        if isinstance(block, ResidualBlock):  # a hook on net: net's __call__ runs (unfused), the hook with it
            seen = []
            handle = block.net.register_forward_hook(lambda *a: seen.append(1))
            block(torchsp.SparseTensor(f, coords))
            handle.remove()
            assert seen == [1] and calls == []
        tol = 2e-2 if dtype == torch.float16 else 1e-5
        for a, b in zip(*outs):
            assert (a.double() - b.double()).abs().max() <= tol * max(b.double().abs().max().item(), 1e-3)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("kw", [dict(), dict(affine=False), dict(track_running_stats=False), dict(momentum=None),
                                dict(eps=1e-3, momentum=0.01)])
def test_fused_batch_norm_module_flags(device, dtype, kw):
    """spnn.BatchNorm's eager path against nn.BatchNorm1d in float64 over two training calls and an eval call:
    the momentum rules (None: cumulative average), no affine, no running statistics (batch statistics in eval)."""
    c = 16
    layer = spnn.BatchNorm(c, **kw).to(device=device, dtype=dtype)
    _, ref = _pair(c, dtype, dtype, device, seed=2, **kw)
    layer.bn.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in ref.state_dict().items()})
    coords = torch.zeros(600, 4, dtype=torch.int32)
    coords[:, 1] = torch.arange(600)
    for step, train in enumerate((True, True, False)):
        layer.train(train), ref.train(train)
        x, dy = _data(600, c, dtype, device, seed=10 + step)
        want = ref(x.double().cpu())
        with torch.no_grad():
            got = layer(torchsp.SparseTensor(x, coords.to(device))).feats
        _check(got, want.detach(), dtype, f"y (call {step})")
        if ref.running_mean is not None:
            _check(layer.bn.running_mean, ref.running_mean, dtype, f"running_mean (call {step})")
            _check(layer.bn.running_var, ref.running_var, dtype, f"running_var (call {step})")
            assert layer.bn.num_batches_tracked.item() == ref.num_batches_tracked.item()


@pytest.mark.parametrize("device", DEVICES)
def test_sequential_fuses_batch_norm_and_relu_on_a_real_scan(device, monkeypatch):
    """torchsp.nn.Sequential runs conv -> BatchNorm -> ReLU's last two as BatchNorm.forward_relu, on the real
    scan's voxels, with the result of the unfused pair computed in float64; a hook on the ReLU turns the fusion
    off (the hook runs)."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    coords = lidar_crop().to(device)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(coords.shape[0], 4, generator=g).to(device=device, dtype=dtype)
    net = spnn.Sequential(spnn.SparseConv3d(4, 32, 3), spnn.BatchNorm(32), spnn.ReLU(True)).to(device=device,
                                                                                                dtype=dtype)
    calls = []
    real = spnn.BatchNorm.forward_relu
    monkeypatch.setattr(spnn.BatchNorm, "forward_relu", lambda self, x: calls.append(1) or real(self, x))
    x = torchsp.SparseTensor(feats, coords)
    conv_out = net[0](x).feats.detach()
    ref = nn.BatchNorm1d(32).double()
    y = net(x).feats
    assert calls == [1]
    want = torch.relu(ref(conv_out.double().cpu()))
    _check(y, want.detach(), dtype, "y")
    _check(net[1].bn.running_var, ref.running_var, dtype, "running_var")
    seen = []
    net[2].register_forward_hook(lambda *a: seen.append(1))
    net(x)
    assert calls == [1] and seen == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_fused_batch_norm_empty_and_one_row(device):
    """No rows: an empty output, the running statistics kept, zero weight and bias gradients (as nn.BatchNorm1d).
    One row in training: the ValueError of nn.BatchNorm1d."""
    bn, _ = _pair(8, torch.float32, torch.float32, device, seed=3)
    rm = bn.running_mean.clone()
    x = torch.empty(0, 8, device=device, requires_grad=True)
    y = torchsp.nn.norm._fused_batch_norm(bn, x, True)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert torch.equal(bn.running_mean, rm) and bn.num_batches_tracked.item() == 1
    assert torch.equal(bn.weight.grad, torch.zeros_like(bn.weight)) and x.grad.shape == (0, 8)
    r = torch.empty(0, 8, device=device, requires_grad=True)  # a residual block's tail on no rows
    torchsp.nn.norm._fused_batch_norm(bn, x, True, r).sum().backward()
    assert r.grad.shape == (0, 8) and torch.equal(bn.bias.grad, torch.zeros_like(bn.bias))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        torchsp.nn.norm._fused_batch_norm(bn, torch.randn(1, 8, device=device), False)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_batch_norm_propagates_nan(device):
    """A NaN in a channel makes that channel's outputs NaN, with or without the ReLU (torch.relu keeps NaN); the
    other channels are untouched."""
    bn, ref = _pair(8, torch.float32, torch.float32, device, seed=4)
    x, _ = _data(200, 8, torch.float32, device, seed=4)
    x[17, 3] = float("nan")
    for relu in (False, True):
        y = torchsp.nn.norm._fused_batch_norm(bn, x, relu)
        assert torch.isnan(y[:, 3]).all()
        assert not torch.isnan(y[:, [0, 1, 2, 4, 5, 6, 7]]).any()


@pytest.mark.parametrize("device", CUDA)
def test_fused_batch_norm_is_deterministic(device):
    """Two training calls on the same data give bitwise equal outputs and gradients (no atomics)."""
    x, dy = _data(200_003, 96, torch.float16, device, seed=7)
    outs = []
    for _ in range(2):
        bn, _ = _pair(96, torch.float16, torch.float32, device, seed=8)
        xg = x.clone().requires_grad_()
        y = torchsp.nn.norm._fused_batch_norm(bn, xg, True)
        y.backward(dy)
        outs.append((y, xg.grad, bn.weight.grad, bn.bias.grad, bn.running_var))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_batch_norm_opcheck(device):
    """torch.library.opcheck on the three ops: schema (running statistics mutated, declared), fake kernels."""
    ops = torch.ops.torchsp
    x, dy = _data(64, 16, torch.float32, device, seed=9)
    bn, _ = _pair(16, torch.float32, torch.float32, device, seed=9)
    nbt = torch.zeros((), dtype=torch.long, device=device)
    torch.library.opcheck(ops.batch_norm_stats.default, (x, bn.running_mean, bn.running_var, nbt, 0.1, 1e-5),
                          test_utils=("test_schema", "test_faketensor"))
    mean, invstd = ops.batch_norm_stats(x, None, None, None, 0.1, 1e-5)
    torch.library.opcheck(ops.batch_norm_act.default, (x, mean, invstd, bn.weight.detach(), bn.bias.detach(), dy,
                                                       1e-5, False, True), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.batch_norm_act_backward.default,
                          (dy, x, mean, invstd, bn.weight.detach(), None, None, True, [True, True, False, False]),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.batch_norm_act_backward.default,
                          (dy, x, mean, invstd, None, bn.bias.detach(), x * 0.5, True, [False, False, True, True]),
                          test_utils=("test_schema", "test_faketensor"))


def _bad_cases(device):
    f = dict(device=device)
    x = torch.randn(10, 4, **f)
    v = torch.ones(4, **f)
    s = torch.ops.torchsp
    cases = [
        (lambda: s.batch_norm_stats(x[0], None, None, None, 0.1, 1e-5), "x must be \\[N, C\\]"),
        (lambda: s.batch_norm_stats(x.int(), None, None, None, 0.1, 1e-5), "x must be floating point"),
        (lambda: s.batch_norm_stats(x, v, None, None, 0.1, 1e-5), "both be given or both be None"),
        (lambda: s.batch_norm_stats(x, torch.ones(5, **f), torch.ones(5, **f), None, 0.1, 1e-5),
         "running_mean must be \\[4\\]"),
        (lambda: s.batch_norm_stats(x, None, None, torch.zeros(2, dtype=torch.long, **f), 0.1, 1e-5),
         "num_batches_tracked must hold one int64"),
        (lambda: s.batch_norm_stats(x[:1], v.clone(), v.clone(), None, 0.1, 1e-5), "more than 1 value per channel"),
        (lambda: s.batch_norm_act(x, v, v, torch.ones(3, **f), None, None, 1e-5, False, True),
         "weight must be \\[4\\]"),
        (lambda: s.batch_norm_act(x, v, v, None, None, x[:, :3], 1e-5, False, True), "residual must have x's shape"),
        (lambda: s.batch_norm_act_backward(x[:5], x, v, v, None, None, None, True, [True, True, True, False]),
         "grad must have x's shape"),
        (lambda: s.batch_norm_act_backward(x, x, v, v, None, None, None, True, [True, False, False, True]),
         "residual gradient was asked for without a residual"),
    ]
    if device == "cuda":
        cases += [
            (lambda: s.batch_norm_stats(x.double(), None, None, None, 0.1, 1e-5), "float32, float16 or bfloat16"),
            (lambda: s.batch_norm_act(x.half(), v.half(), v.half(), v, v.half(), None, 1e-5, True, False),
             "must share one dtype"),
            (lambda: s.batch_norm_act(x, v, v, v.cpu(), None, None, 1e-5, False, False), "weight is on cpu"),
            (lambda: s.batch_norm_act(x, v.half(), v, None, None, None, 1e-5, False, False),
             "mean must be a contiguous float32"),
            (lambda: s.batch_norm_act(x, v, v, None, None, x.half(), 1e-5, False, True), "residual dtype"),
        ]
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_fused_batch_norm_train_checks_before_updating(device):
    """torchsp._C.batch_norm_train with a weight, bias or residual of the wrong shape raises before the
    statistics pass: the running statistics and num_batches_tracked stay as they were."""
    bn, _ = _pair(4, torch.float32, torch.float32, device, seed=11)
    x, _ = _data(50, 4, torch.float32, device, seed=11)
    rm, rv, nbt = bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()
    w, b = bn.weight.detach(), bn.bias.detach()
    for args, match in (((w[:3], b, None), "weight must be \\[4\\]"), ((w, b[:2], None), "bias must be \\[4\\]"),
                        ((w, b, x[:, :2]), "residual must have x's shape")):
        with pytest.raises(RuntimeError, match=match):
            torchsp._C.batch_norm_train(x, *args, bn.running_mean, bn.running_var, bn.num_batches_tracked, 0.1,
                                        1e-5, True)
    assert torch.equal(bn.running_mean, rm) and torch.equal(bn.running_var, rv)
    assert torch.equal(bn.num_batches_tracked, nbt)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_batch_norm_rejects_bad_arguments(device):
    """Each op names the bad argument (shape, dtype, device, pairing of the running statistics, one row)."""
    for call, match in _bad_cases(device):
        with pytest.raises(RuntimeError, match=match):
            call()
