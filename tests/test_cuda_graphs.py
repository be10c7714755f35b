"""CUDA graphs over torchsp layers: a whole training step captured with torch.cuda.graph.

After eager warm-up calls on the same coordinates (kernel maps, row plans, pair lists and the
tuner's choices cached), a forward and backward record only launches: no host sync, current
stream, workspace from the caching allocator.  What torchsp would build lazily under capture
(a new map, a row plan, a tuner measurement) is refused with an error naming it, and a plan read
under capture is pinned (never refined and freed under the graph).  CUDA only.
"""

import re

import pytest
import torch

import reference as ref
import torchsp
from conftest import random_coords, randn, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class UNetStep(torch.nn.Module):
    """SparseTensor -> feats through submanifold, strided, submanifold and transposed layers.
    The input tensor is built outside (its value checks synchronise)."""

    def __init__(self, cin=16, c=32, mid=64):
        super().__init__()
        nn = torchsp.nn
        self.sub = nn.SparseConv3d(cin, c, 3, bias=True)
        self.down = nn.SparseConv3d(c, mid, 2, stride=2)
        self.mid = nn.SparseConv3d(mid, mid, 3)
        self.up = nn.SparseConv3d(mid, c, 2, stride=2, transposed=True, bias=True)

    def forward(self, x):
        x = self.sub(x)
        x = x.replace(torch.relu(x.feats))
        return self.up(self.mid(self.down(x))).feats


def unet_reference(model, feats, coords):
    """(output, {name: float64 leaf}) of UNetStep with the dense float64 reference; backward
    through the output fills the leaves' .grad."""
    ws = {n: p.detach().double().cpu().requires_grad_(True) for n, p in model.named_parameters()}
    y = torch.relu(ref.dense_conv(feats, coords, 1, ws["sub.weight"], (3, 3, 3), coords, bias=ws["sub.bias"]))
    down = ref.active_sites(coords, 1, (2, 2, 2), 2)
    y = ref.dense_conv(y, coords, 1, ws["down.weight"], (2, 2, 2), down, stride=2)
    y = ref.dense_conv(y, down, 2, ws["mid.weight"], (3, 3, 3), down)
    y = ref.dense_conv(y, down, 2, ws["up.weight"], (2, 2, 2), coords, stride=2, transposed=True,
                       bias=ws["up.bias"])
    return y, ws


def _warm(fn, calls=2):
    """Eager calls on a side stream, as torch's CUDA graph recipe warms up before capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(s)


def _new_values(x, model, seed):
    """New input features and weights written in place (an optimizer step writes weights so)."""
    x.feats.copy_(randn(*x.feats.shape, dtype=x.feats.dtype, device="cuda", seed=seed))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(randn(*p.shape, dtype=p.dtype, device="cuda", seed=seed + 1 + i, scale=0.1))


def _pair_lists(x):
    """The PairLists the maps of x's cache hold (torchsp.plan.pair_list)."""
    return [v for km in x.cache.kmaps.values() for k, v in km.plans.items() if k[0] == "pairs"]


def _unet_case(seed, algo=None, n=1500):
    coords = random_coords(n, span=12, batches=2, seed=seed).cuda()
    torch.manual_seed(seed)
    model = UNetStep().cuda().half()
    for m in model.modules():
        if isinstance(m, torchsp.nn.SparseConv3d):
            m.algo = algo
    x = torchsp.SparseTensor(randn(coords.shape[0], 16, dtype=torch.float16, device="cuda", seed=seed), coords)
    probe = randn(coords.shape[0], 32, dtype=torch.float32, device="cuda", seed=seed + 100)
    return model, x, probe


@pytest.mark.parametrize("overlap", [False, True], ids=["one_stream", "two_streams"])
@pytest.mark.parametrize("weights_warmed", [True, False])
def test_cuda_graph_training_step(weights_warmed, overlap, monkeypatch):
    """One CUDA graph holds a training step (forward, loss, backward) of a small U-Net; replayed
    on new input values and new weights it gives the eager step's output and weight gradients bit
    for bit, and the float64 dense reference's.  weights_warmed=False: the warm-up step trained
    the input only (weights frozen), so the weights' wgrad pair list is still unbuilt at capture;
    the captured wgrad then builds its pairs on the stream (a kept list built under capture would
    be recorded, not computed, and eager calls would read it).  The tuner picks the layers'
    dataflows in the first case (measured in the warm-up); the second fixes them, so no
    measurement builds a pair list.  two_streams: every layer's backward runs wgrad on a side
    stream (torchsp._autograd.OVERLAP_ENTRIES lowered to 0), forked and joined inside the graph."""
    monkeypatch.setattr(torchsp._autograd, "OVERLAP_ENTRIES", 0 if overlap else 1 << 62)
    model, x, probe = _unet_case(41, None) if weights_warmed else _unet_case(43, [0, 0, 0, 0])

    def step():
        out = model(x)
        (out.float() * probe).sum().backward()
        return out

    for p in model.parameters():
        p.requires_grad_(weights_warmed)
    x.feats.requires_grad_(not weights_warmed)  # a backward through every layer either way
    _warm(lambda: (model.zero_grad(set_to_none=True), step()))
    x.feats.requires_grad_(False)
    for p in model.parameters():
        p.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    assert not any(pl.built for pl in _pair_lists(x)) or weights_warmed
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    if not weights_warmed:  # the capture kept no list it could not build
        assert _pair_lists(x) and not any(pl.built for pl in _pair_lists(x))
    _new_values(x, model, seed=7)
    graph.replay()
    torch.cuda.synchronize()
    got = out.clone()
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    eager = step()
    assert torch.equal(got, eager), "replay != eager step"
    for n, p in model.named_parameters():
        assert torch.equal(got_grads[n], p.grad), f"replayed grad of {n} != eager"
    want, leaves = unet_reference(model, x.feats.detach().cpu(), x.coords.cpu())
    (want * probe.cpu().double()).sum().backward()
    assert rel_err(got, want) <= 5e-3
    for n, g in got_grads.items():
        assert rel_err(g, leaves[n].grad) <= 2e-2, n  # fp16 gradients through four layers


def test_cuda_graph_pins_its_row_plans():
    """A row plan read under capture stays the map's plan: REFINE_AFTER eager calls later the map
    still holds the very tensor the graph reads (refining it would hand that memory back to the
    allocator under the graph), and replays still match eager calls and the gather reference."""
    refine = torchsp.kmap.REFINE_AFTER
    if not refine or refine < 3:
        pytest.skip("plans are not refined after a count of passes")
    coords = random_coords(2500, span=14, batches=2, seed=51).cuda()
    layer = torchsp.nn.SparseConv3d(32, 32, 3).cuda().half()
    layer.algo = [0, 0, 0, 0]  # fixed: the tuner's measuring would read the plan past the count
    x = torchsp.SparseTensor(randn(coords.shape[0], 32, dtype=torch.float16, device="cuda", seed=52), coords)
    km = torchsp.kmap.get_kernel_map(x, 3)[0]

    def fwd():
        with torch.no_grad():
            return layer(x).feats

    _warm(fwd)
    assert km._reads[0] < refine - 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fwd()
    plan = km.order
    for _ in range(refine + 2):
        fwd()
    assert km.order is plan, "a plan the graph reads was replaced"
    _new_values(x, layer, seed=53)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fwd())
    want = ref.gather_conv(x.feats.cpu(), km.nbmap.cpu().long(), layer.weight.detach().cpu())
    assert rel_err(out, want) <= 5e-3


@pytest.mark.parametrize("case", ["submanifold", "strided", "backward_unwarmed"])
def test_cuda_graph_capture_refuses_lazy_builds(case):
    """Capturing a call whose kernel map (submanifold), output coordinates (strided) or dgrad row
    plan (a training step warmed up without gradients) does not exist yet raises a RuntimeError
    naming what would be built, before it is built: nothing unfilled is cached, so the same call
    then runs eagerly and matches the dense float64 reference on its own output coordinates."""
    coords = random_coords(1200, span=10, batches=2, seed=61).cuda()
    x = torchsp.SparseTensor(randn(coords.shape[0], 32, dtype=torch.float16, device="cuda", seed=62), coords)
    stride = 2 if case == "strided" else 1
    k = 2 if stride == 2 else 3
    layer = torchsp.nn.SparseConv3d(32, 32, k, stride=stride).cuda().half()
    layer.algo = [0, 0, 0, 0]
    what = {"submanifold": "a kernel map", "strided": "the output coordinates of a strided or generative conv",
            "backward_unwarmed": "the dgrad row plan of a kernel map"}[case]
    if case == "backward_unwarmed":
        with torch.no_grad():
            _warm(lambda: layer(x))
        x.feats.requires_grad_(True)

    def call():
        y = layer(x)
        if case == "backward_unwarmed":
            y.feats.float().sum().backward()
        return y

    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=re.escape(f"torchsp: {what} would be built while a CUDA graph is being captured")):
        with torch.cuda.graph(graph):
            call()
    y = call()
    torch.cuda.synchronize()
    c = coords.cpu()
    out_coords = ref.active_sites(c, 1, (2, 2, 2), 2) if stride == 2 else c
    got = y.coords.cpu()
    assert torch.equal(torch.sort(pack(got)).values, torch.sort(pack(out_coords)).values)
    want = ref.dense_conv(x.feats.detach().cpu(), c, 1, layer.weight.detach().cpu(), (k, k, k), got, stride=stride)
    assert rel_err(y.feats.detach(), want) <= 5e-3


def pack(c):
    """int64 key per (batch, x, y, z) row, for comparing coordinate sets."""
    c = c.long() + 4096
    return ((c[:, 0] * 8192 + c[:, 1]) * 8192 + c[:, 2]) * 8192 + c[:, 3]
