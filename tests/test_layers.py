"""Layers on SparseTensors (torchsp.nn, issue 6) against dense or pure-PyTorch references.

Dense references scatter the sparse features into a grid (fill -inf for max pooling,
0 otherwise), run the torch.nn.functional op, and read the result at the sparse
output coordinates. Coordinates are kept inside the grid with a margin so no
output is clipped by the dense op's borders.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchsp
import torchsp.nn as spnn
from conftest import dynamic_output_shapes, random_coords, randn, rel_err

SPAN = 7       # coordinates in [MARGIN, MARGIN + SPAN)
MARGIN = 4
GRID = SPAN + 2 * MARGIN


def make_input(n=150, channels=5, batches=2, seed=0, dtype=torch.float64):
    """Unique random coords int32 [M, 4] (batch, x, y, z) in the grid and feats [M, C], shuffled."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, batches, (n, 1), generator=g)
    xyz = torch.randint(MARGIN, MARGIN + SPAN, (n, 3), generator=g)
    coords = torch.unique(torch.cat([b, xyz], 1), dim=0)
    coords = coords[torch.randperm(coords.shape[0], generator=g)].int()
    feats = torch.randn(coords.shape[0], channels, generator=g, dtype=dtype)
    return torchsp.SparseTensor(feats, coords)


def dense_grid(x, fill=0.0, batches=2):
    """[B, C, G, G, G] grid of x (stride 1, origin 0) with `fill` at empty sites, and the occupancy [B, 1, G, G, G]."""
    c = x.coords.long()
    grid = x.feats.new_full((batches, x.feats.shape[1], GRID, GRID, GRID), fill)
    grid[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]] = x.feats
    occ = x.feats.new_zeros((batches, 1, GRID, GRID, GRID))
    occ[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]] = 1
    return grid, occ


def read_at(dense, coords, lattice):
    """Rows of dense [B, C, ...] at coords (full resolution) on a lattice of spacing `lattice`."""
    c = coords.long()
    return dense[c[:, 0], :, c[:, 1] // lattice, c[:, 2] // lattice, c[:, 3] // lattice]


# ---------------------------------------------------------------- normalisation

def test_batchnorm_matches_batchnorm1d():
    x = make_input(dtype=torch.float32)
    layer = spnn.BatchNorm(5, eps=1e-3, momentum=0.01)
    ref = nn.BatchNorm1d(5, eps=1e-3, momentum=0.01)
    ref.load_state_dict(layer.bn.state_dict())
    for train in (True, False):
        layer.train(train), ref.train(train)
        y = layer(x)
        torch.testing.assert_close(y.feats, ref(x.feats))
        assert y.coord_key == x.coord_key and y.coords is x.coords
    torch.testing.assert_close(layer.bn.running_mean, ref.running_mean)


def test_sync_batchnorm_conversion_keeps_sparse_inputs():
    x = make_input(dtype=torch.float32)
    model = spnn.Sequential(spnn.BatchNorm(5), nn.BatchNorm1d(5), spnn.ReLU())
    expected = model(x).feats
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[0].bn, nn.SyncBatchNorm)
    assert isinstance(converted[1], nn.SyncBatchNorm)
    torch.testing.assert_close(converted(x).feats, expected)  # not distributed: plain batch norm


BN_CONFIGS = {"default": {}, "momentum_none": {"momentum": None}, "no_affine": {"affine": False},
              "no_running_stats": {"track_running_stats": False}}


@pytest.mark.parametrize("config", sorted(BN_CONFIGS))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batch_norm_traced_matches_batchnorm1d(device, config, train):
    """torchsp.nn._batch_norm.batch_norm_traced (the path of BatchNorm under torch.compile / export),
    called eagerly, against nn.BatchNorm1d on copies: outputs, input / weight / bias gradients,
    running statistics and batch counts over three steps of fresh data (mean 1.5, scale 3), in
    float64 (CPU) or float16 (CUDA, the statistics and torchsp::batch_norm_train's saved mean in
    float32); then an empty input, which keeps the statistics and gives zero weight gradients."""
    from torchsp.nn._batch_norm import batch_norm_traced

    dtype = torch.float64 if device == "cpu" else torch.float16
    tol = 1e-12 if device == "cpu" else 2e-3
    torch.manual_seed(7)
    bn = nn.BatchNorm1d(6, **BN_CONFIGS[config]).to(device)
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 2.0), bn.bias.normal_()
    bn = bn.to(dtype).train(train)
    twin = copy.deepcopy(bn)
    for step in range(3):
        x = (randn(300, 6, seed=step, dtype=dtype, device=device) * 3 + 1.5).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        y, y2 = bn(x), batch_norm_traced(twin, x2)
        g = randn(300, 6, seed=10 + step, dtype=dtype, device=device)
        y.backward(g), y2.backward(g)
        assert y2.dtype == dtype and rel_err(y2, y) <= tol, "output"
        assert rel_err(x2.grad, x.grad) <= tol, "input gradient"
        for a, b in zip(twin.parameters(), bn.parameters()):
            assert rel_err(a.grad, b.grad) <= tol, "weight / bias gradient"
        for (name, a), b in zip(twin.named_buffers(), bn.buffers()):
            assert (a == b).all() if not a.is_floating_point() else rel_err(a, b) <= tol, name
    if train:
        before = [b.clone() for b in twin.buffers()]
        twin.zero_grad()
        e = torch.empty(0, 6, dtype=dtype, device=device, requires_grad=True)
        y = batch_norm_traced(twin, e)
        y.sum().backward()
        assert y.shape == (0, 6) and e.grad.shape == (0, 6)
        for a, b in zip(twin.buffers(), before):
            assert torch.equal(a, b + 1) if not a.is_floating_point() else torch.equal(a, b)
        for p in twin.parameters():
            assert torch.equal(p.grad, torch.zeros_like(p))
        with pytest.raises(RuntimeError, match="more than 1 value per channel"):
            batch_norm_traced(twin, randn(1, 6, dtype=dtype, device=device))


def test_batch_norm_train_opcheck(device):
    """torch.library.opcheck on torchsp::batch_norm_train (with and without running statistics and
    affine parameters, with gradients) and torchsp::batch_norm_train_backward (csrc/batch_norm.cpp,
    fake kernels in torchsp/_fake.py)."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    x = randn(40, 5, seed=1, dtype=dtype, device=device) + 0.5
    w, b = torch.rand(5, dtype=dtype, device=device) + 0.5, randn(5, seed=2, dtype=dtype, device=device)
    rm, rv = torch.zeros(5, dtype=dtype, device=device), torch.ones(5, dtype=dtype, device=device)
    ops = torch.ops.torchsp
    torch.library.opcheck(ops.batch_norm_train.default, (x, w, b, rm, rv, 0.1, 1e-5))
    torch.library.opcheck(ops.batch_norm_train.default, (x, None, None, None, None, 0.1, 1e-5))
    grad_args = (x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_(), rm, rv, 0.1, 1e-5)
    torch.library.opcheck(ops.batch_norm_train.default, grad_args)
    _, mean, invstd, _, _ = ops.batch_norm_train(x, w, b, rm, rv, 0.1, 1e-5)
    g = randn(40, 5, seed=3, dtype=dtype, device=device)
    torch.library.opcheck(ops.batch_norm_train_backward.default, (g, x, w, mean, invstd, 1e-5, [True, True, True]))
    torch.library.opcheck(ops.batch_norm_train_backward.default, (g, x, None, mean, invstd, 1e-5, [True, False, False]))


def test_groupnorm_per_batch_item():
    x = make_input(channels=8, batches=3)
    layer = spnn.GroupNorm(4, 8).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5), layer.bias.uniform_(-0.5, 0.5)
    y = layer(x).feats
    for b in range(3):
        rows = x.coords[:, 0] == b
        sample = x.feats[rows].t().unsqueeze(0)  # [1, C, n_b], the dense GroupNorm's view
        ref = F.group_norm(sample, 4, layer.weight, layer.bias, layer.eps)[0].t()
        torch.testing.assert_close(y[rows], ref)


def test_groupnorm_half_precision_stats_in_float32():
    x = make_input(channels=8, dtype=torch.float32)
    y32 = spnn.group_norm(x, 2).feats
    y16 = spnn.group_norm(x.replace(x.feats.bfloat16()), 2).feats
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------- pointwise

@pytest.mark.parametrize("layer, ref", [
    (spnn.ReLU(), F.relu),
    (spnn.LeakyReLU(0.2), lambda t: F.leaky_relu(t, 0.2)),
    (spnn.SiLU(), F.silu),
])
def test_activations(layer, ref):
    x = make_input()
    y = layer(x)
    torch.testing.assert_close(y.feats, ref(x.feats))
    assert y.coord_key == x.coord_key and y.cache is x.cache


def test_dropout():
    x = make_input(n=300, dtype=torch.float32)
    layer = spnn.Dropout(0.5)
    layer.eval()
    torch.testing.assert_close(layer(x).feats, x.feats)
    layer.train()
    y = layer(x).feats
    kept = y != 0
    torch.testing.assert_close(y[kept], 2 * x.feats[kept])
    assert 0.3 < kept.float().mean().item() < 0.7


def test_linear_on_feats():
    x = make_input(dtype=torch.float32)
    layer = spnn.Linear(5, 3)
    torch.testing.assert_close(layer(x).feats, F.linear(x.feats, layer.weight, layer.bias))


# ---------------------------------------------------------------- pooling

POOL_CASES = [  # kernel, stride, padding (None: default)
    (3, 1, None),
    (2, 2, None),
    (3, 2, 1),
    ((3, 1, 3), (2, 1, 2), (1, 0, 1)),
]


@pytest.mark.parametrize("kernel, stride, padding", POOL_CASES)
def test_max_pool_matches_dense(kernel, stride, padding):
    x = make_input()
    y = spnn.max_pool3d(x, kernel, stride, padding)
    ks = torchsp.geometry.triple(kernel, "k")
    pad = padding if padding is not None else tuple((k - 1) // 2 if k % 2 else 0 for k in ks)
    grid, _ = dense_grid(x, float("-inf"))
    dense = F.max_pool3d(grid, ks, stride, pad)
    st = torchsp.geometry.triple(stride, "s")
    assert y.stride == st
    c = y.coords.long()
    ref = dense[c[:, 0], :, c[:, 1] // st[0], c[:, 2] // st[1], c[:, 3] // st[2]]
    torch.testing.assert_close(y.feats, ref)
    # strided: the active output set is exactly the dense outputs that saw an input
    if st != (1, 1, 1):
        assert int(torch.isfinite(dense[:, 0]).sum()) == y.coords.shape[0]


def test_pooling_of_windows_with_no_site(device):
    """Floor rule, kernel (3, 1, 3) dilated by 2, stride 2, on sites with odd x and z: every
    output window misses the inputs floored to it.  Max pooling gives 0 there (it gave -inf),
    average pooling 0 with each count rule, and the gradients are 0."""
    c = torch.tensor([[0, 1, 0, 1], [0, 1, 3, 1], [0, 3, 0, 5], [1, -1, 2, 7]], dtype=torch.int32, device=device)
    feats = torch.randn(4, 3, dtype=torch.float64, device=device, requires_grad=True)
    x = torchsp.SparseTensor(feats, c)
    kw = dict(kernel_size=(3, 1, 3), stride=2, dilation=2, rule="floor")
    outs = [spnn.max_pool3d(x, **kw)] + [spnn.avg_pool3d(x, count=n, **kw) for n in ("present", "all", "none")]
    for y in outs:
        assert y.feats.shape[0] > 0 and torch.equal(y.feats, torch.zeros_like(y.feats))
    sum(y.feats.sum() for y in outs).backward()
    assert torch.equal(feats.grad, torch.zeros_like(feats))


@pytest.mark.parametrize("kernel, stride, padding", POOL_CASES[:3])
@pytest.mark.parametrize("count", ["all", "present", "none"])
def test_avg_pool_matches_dense(kernel, stride, padding, count):
    x = make_input()
    y = spnn.avg_pool3d(x, kernel, stride, padding, count=count)
    pad = padding if padding is not None else ((kernel - 1) // 2 if kernel % 2 else 0)
    grid, occ = dense_grid(x)
    v = kernel ** 3
    sums = F.avg_pool3d(grid, kernel, stride, pad, count_include_pad=True) * v
    present = F.avg_pool3d(occ, kernel, stride, pad, count_include_pad=True) * v
    ref = {"all": sums / v, "present": sums / present.clamp(min=1), "none": sums}[count]
    torch.testing.assert_close(y.feats, read_at(ref, y.coords, stride))


def test_pooling_shares_conv_coordinates_and_unpools():
    x = make_input(dtype=torch.float32)
    pooled = spnn.MaxPool3d(2, 2)(x)
    conv = spnn.SparseConv3d(5, 4, 2, stride=2)(x)
    assert pooled.coord_key == conv.coord_key
    assert torch.equal(pooled.coords, conv.coords)
    up = spnn.SparseConv3d(5, 5, 2, stride=2, transposed=True)(pooled)
    assert torch.equal(up.coords, x.coords)
    spnn.cat([up, x])  # same coordinate set: no error


def test_max_pool_gradient():
    x = make_input(n=60, channels=2)
    feats = x.feats.clone().requires_grad_(True)
    torch.autograd.gradcheck(lambda f: spnn.max_pool3d(x.replace(f), 3, 2, 1).feats, (feats,))
    torch.autograd.gradcheck(lambda f: spnn.avg_pool3d(x.replace(f), 2, 2).feats, (feats,))


def test_global_pooling():
    x = make_input(batches=3)
    avg = spnn.global_avg_pool(x)
    mx = spnn.GlobalMaxPool()(x)
    assert avg.shape == (3, 5)
    for b in range(3):
        rows = x.feats[x.coords[:, 0] == b]
        torch.testing.assert_close(avg[b], rows.mean(0))
        torch.testing.assert_close(mx[b], rows.amax(0))
    # an explicit batch size with an empty trailing item gives zeros there
    padded = spnn.global_avg_pool(x, batch_size=5)
    torch.testing.assert_close(padded[:3], avg)
    assert torch.all(padded[3:] == 0) and torch.all(spnn.global_max_pool(x, 5)[3:] == 0)


# ---------------------------------------------------------------- combining, dense conversion

def test_cat_and_add_check_coordinates():
    x = make_input(dtype=torch.float32)
    y = spnn.SparseConv3d(5, 3, 3)(x)
    torch.testing.assert_close(spnn.cat([x, y]).feats, torch.cat([x.feats, y.feats], 1))
    z = spnn.SparseConv3d(5, 5, 1)(x)
    torch.testing.assert_close(spnn.add(x, z).feats, x.feats + z.feats)
    # same coordinates built separately: compared element-wise, accepted
    twin = torchsp.SparseTensor(x.feats.clone(), x.coords.clone())
    spnn.add(x, twin)
    other = make_input(seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="different coordinates"):
        spnn.cat([x, other])
    down = spnn.SparseConv3d(5, 5, 2, stride=2)(x)
    with pytest.raises(ValueError, match="strides differ"):
        spnn.add(x, down)
    with pytest.raises(TypeError, match="SparseTensor"):
        spnn.add(x, x.feats)


def test_to_dense_and_from_dense_roundtrip():
    x = make_input(channels=3, dtype=torch.float32)
    grid, _ = dense_grid(x)
    dense = spnn.to_dense(x, spatial_shape=(GRID,) * 3, origin=(0, 0, 0), batch_size=2)
    torch.testing.assert_close(dense, grid)
    back = spnn.from_dense(dense)
    order = torch.argsort(torchsp.geometry.pack_keys(x.coords))
    assert torch.equal(back.coords, x.coords[order])
    torch.testing.assert_close(back.feats, x.feats[order])
    # a strided tensor maps grid index i to origin + i * stride
    s2 = spnn.from_dense(dense[:, :, ::2, ::2, ::2].contiguous(), stride=2)
    assert s2.stride == (2, 2, 2) and bool((s2.coords[:, 1:] % 2 == 0).all())
    torch.testing.assert_close(spnn.to_dense(s2, (GRID + 1) // 2, (0, 0, 0), 2),
                               dense[:, :, ::2, ::2, ::2])


def test_crop_keeps_rows_in_order():
    x = make_input()
    lo, hi = (MARGIN + 1,) * 3, (MARGIN + 5,) * 3
    y = spnn.crop(x, lo, hi)
    keep = ((x.coords[:, 1:] >= lo[0]) & (x.coords[:, 1:] < hi[0])).all(1)
    assert torch.equal(y.coords, x.coords[keep]) and torch.equal(y.feats, x.feats[keep])


def test_sequential_mixes_plain_and_sparse_layers():
    x = make_input(dtype=torch.float32)
    seq = spnn.Sequential(spnn.SparseConv3d(5, 8, 3), nn.BatchNorm1d(8), nn.ReLU(), spnn.GroupNorm(2, 8),
                          nn.Dropout(0.0), spnn.MaxPool3d(2, 2), nn.Linear(8, 4))
    y = seq(x)
    conv, bn, _, gn, _, _, lin = seq
    h = gn(conv(x).replace(F.relu(bn(conv(x).feats))))
    ref = F.linear(spnn.max_pool3d(h, 2, 2).feats, lin.weight, lin.bias)
    torch.testing.assert_close(y.feats, ref)
    assert y.stride == (2, 2, 2)


# ---------------------------------------------------------------- compile and trace

class SmallNet(nn.Module):
    """Uses every layer kind: conv, BN, GN, activations, pooling, cat, add, global pooling."""

    def __init__(self, batch_size=None):
        super().__init__()
        self.batch_size = batch_size
        self.conv = spnn.SparseConv3d(5, 8, 3)
        self.bn = spnn.BatchNorm(8)
        self.gn = spnn.GroupNorm(2, 8)
        self.act = spnn.LeakyReLU(0.1)
        self.down = spnn.SparseConv3d(8, 8, 2, stride=2)
        self.up = spnn.SparseConv3d(8, 8, 2, stride=2, transposed=True)
        self.head = spnn.Linear(16, 3)

    def forward(self, x):
        h = self.act(self.bn(self.conv(x)))
        d = spnn.SiLU()(self.gn(spnn.max_pool3d(h, 3, 1)))
        u = self.up(spnn.add(self.down(h), spnn.avg_pool3d(d, 2, 2)))
        y = self.head(spnn.cat([u, h]))
        return y.feats, spnn.global_avg_pool(y, self.batch_size) + spnn.global_max_pool(y, self.batch_size)


def test_compile_fullgraph_matches_eager():
    net = SmallNet(batch_size=2).eval()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    for seed in (0, 1):
        x = make_input(seed=seed, dtype=torch.float32)
        ref = net(x)
        with dynamic_output_shapes():
            out = compiled(torchsp.SparseTensor(x.feats, x.coords))
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b)


class FeatsCoords(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, feats, coords):
        return self.net(torchsp.SparseTensor(feats, coords))


def test_jit_trace_runs_on_other_sizes():
    net = FeatsCoords(SmallNet()).eval()
    x = make_input(seed=0, dtype=torch.float32)
    traced = torch.jit.trace(net, (x.feats, x.coords), check_trace=False)
    for seed, batches in ((1, 2), (2, 3)):
        y = make_input(seed=seed, n=200, batches=batches, dtype=torch.float32)
        for a, b in zip(traced(y.feats, y.coords), net(y.feats, y.coords)):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_conv_under_autocast(amp, device):
    """Under torch.autocast a SparseConv3d computes in the autocast dtype (like nn.Conv3d), and its
    gradients reach the fp32 parameters; values match the fp32 layer within the dtype's precision."""
    import torchsp
    c = random_coords(300, span=4, seed=11).to(device)
    x = torchsp.SparseTensor(randn(c.shape[0], 8, dtype=torch.float32, device=device, seed=1), c)
    conv = torchsp.nn.SparseConv3d(8, 16, 3).to(device)
    want = conv(x).feats
    with torch.autocast(device, dtype=amp):
        y = conv(x)
    assert y.feats.dtype == amp
    assert rel_err(y.feats.float(), want) < 3e-2
    y.feats.float().sum().backward()
    assert conv.weight.grad is not None and conv.weight.grad.dtype == torch.float32


class _DoubledWeight(spnn.SparseConv3d):
    """A subclass whose `weight` property doubles the registered parameter (a data descriptor:
    nn.Module.__setattr__ still registers the parameter, but reads go through the property)."""

    @property
    def weight(self):
        w = self._parameters.get("weight")
        if w is None:  # nn.Module.register_parameter asks hasattr before registering
            raise AttributeError("weight")
        return w * 2


class _Halve(nn.Module):
    def forward(self, w):
        return w * 0.5


def _conv_ways():
    """(name, module maker, weight and bias the call must use) for each way a SparseConv3d's
    parameters can be held."""
    w2, b2 = randn(27, 4, 6, seed=5), randn(6, seed=6)

    def plain():
        m = spnn.SparseConv3d(4, 6, 3, bias=True).double()
        return m, m.weight, m.bias

    def no_bias():
        m = spnn.SparseConv3d(4, 6, 3).double()
        return m, m.weight, None

    def bias_set_none():  # registered, then set to None: _parameters["bias"] is None
        m = spnn.SparseConv3d(4, 6, 3, bias=True).double()
        m.bias = None
        return m, m.weight, None

    def weight_plain_tensor():  # no longer a registered parameter (as FSDP's views)
        m = spnn.SparseConv3d(4, 6, 3).double()
        del m.weight
        m.weight = w2
        return m, w2, None

    def bias_plain_tensor():  # bias=False leaves a plain None attribute; a tensor set there stays plain
        m = spnn.SparseConv3d(4, 6, 3).double()
        m.bias = b2
        return m, m.weight, b2

    def parametrized():
        m = spnn.SparseConv3d(4, 6, 3).double()
        w = m.weight.detach().clone()
        torch.nn.utils.parametrize.register_parametrization(m, "weight", _Halve())
        return m, w * 0.5, None

    def subclass_property():
        m = _DoubledWeight(4, 6, 3).double()
        with torch.no_grad():  # reset_parameters initialised the property's copy, not the parameter
            m._parameters["weight"].copy_(randn(27, 4, 6, seed=9))
        return m, m._parameters["weight"] * 2, None

    return [("plain", plain), ("no_bias", no_bias), ("bias_set_none", bias_set_none),
            ("weight_plain_tensor", weight_plain_tensor), ("bias_plain_tensor", bias_plain_tensor),
            ("parametrized", parametrized),
            ("subclass_property", subclass_property)]


@pytest.mark.parametrize("way", [w[0] for w in _conv_ways()])
def test_conv_reads_the_parameters_attribute_access_gives(way):
    """SparseConv3d.forward reads weight and bias from _parameters when it may (a shortcut past
    nn.Module.__getattr__); whichever way they are held, the layer computes with the tensors that
    attribute access gives: a parametrization's, a subclass property's, a plain tensor's, a bias
    set to None.  Checked against the float64 dense reference (tests/reference.py) on those tensors,
    and torch.func.functional_call's substitutes too."""
    from reference import dense_conv

    make = dict(_conv_ways())[way]
    torch.manual_seed(3)
    m, w, b = make()
    x = make_input(n=120, channels=4, seed=4)
    for _ in range(2):  # twice: a repeated call reads the parameters again
        with torch.no_grad():
            y = m(x).feats
        want = dense_conv(x.feats, x.coords, 1, w.detach(), 3, x.coords, bias=b)
        assert rel_err(y, want) < 1e-12, way
    if way in ("plain", "no_bias"):
        w3, b3 = randn(27, 4, 6, seed=7), randn(6, seed=8)
        subs = {"weight": w3} if way == "no_bias" else {"weight": w3, "bias": b3}
        with torch.no_grad():
            y = torch.func.functional_call(m, subs, (x,)).feats
        want = dense_conv(x.feats, x.coords, 1, w3, 3, x.coords, bias=subs.get("bias"))
        assert rel_err(y, want) < 1e-12
