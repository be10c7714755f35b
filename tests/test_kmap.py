"""Kernel maps and output coordinates against the slow pure-PyTorch references.

The ops (torch.ops.torchsp.out_coords / kernel_map with both search methods /
kernel_map_transpose) are called directly with the offsets of DESIGN.md section 2,
and through torchsp.kmap.get_kernel_map, whose cache must build each map once.
"""

import pytest
import torch

import reference as ref
import torchsp
from cases import CASE_IDS, CASES, build, case_coords, expected_coords, kmap_args, padding_of
from conftest import random_coords, randn

ops = torch.ops.torchsp
METHODS = [0, 1]  # 0: z-delta search over sorted keys, 1: hash


def _lists(case):
    k = list(ref.triple(case.kernel))
    d = list(ref.triple(case.dilation))
    p = list(padding_of(case))
    return k, d, p


GENERATING = [c for c in CASES if c.regime in ("strided", "floor", "generative", "transposed_generative")]


@pytest.mark.parametrize("case", GENERATING, ids=lambda c: c.name)
def test_out_coords_op(case, device):
    """out_coords: sorted unique sites of the active-site, floor, generative and transposed-generative rules."""
    c = case_coords(case, seed=2).to(device)
    k, d, p = _lists(case)
    t = list(ref.triple(case.in_stride))
    if case.transposed:
        step = list(case.out_stride())
        got = ops.out_coords(c, k, d, p, step, -1, step, False)
    else:
        got = ops.out_coords(c, k, d, p, t, 1, list(case.out_stride()), case.rule == "floor")
    assert got.dtype == torch.int32 and got.device.type == device
    assert torch.equal(got.cpu(), expected_coords(case, c))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_map_op(case, method, device):
    """kernel_map(method) == the unique()-based reference map, for every regime's offsets."""
    x, fine = build(case, cin=1, device=device, seed=4)
    out = expected_coords(case, x.coords, fine).to(device)
    k, d, p = _lists(case)
    step, sign = kmap_args(case)
    nbmap = ops.kernel_map(x.coords, out, k, d, p, list(step), sign, method)
    want = ref.kernel_map(x.coords, out, k, d, p, step, sign)
    assert nbmap.dtype == torch.int32 and nbmap.shape == (out.shape[0], case.volume())
    assert torch.equal(nbmap.cpu().long(), want), f"{int((nbmap.cpu().long() != want).sum())} entries differ"
    assert (want >= 0).any()
    nbmap_t = ops.kernel_map_transpose(nbmap, x.coords)
    assert nbmap_t.dtype == torch.int32 and nbmap_t.shape == (x.coords.shape[0], case.volume())
    assert torch.equal(nbmap_t.cpu().long(), ref.transpose_map(want, x.coords.shape[0]))


@pytest.mark.parametrize("method", METHODS)
def test_kernel_map_disjoint_sets(method, device):
    """Input and output coordinate sets that differ (partly overlapping), both signs, stride 2 steps."""
    a = random_coords(300, span=6, stride=2, seed=5, batch_ids=(0, 1, 3)).to(device)
    b = random_coords(200, span=7, stride=2, seed=6, batch_ids=(0, 1, 2, 3)).to(device)
    for kernel, dil, sign in [((3, 3, 3), (1, 1, 1), 1), ((2, 3, 4), (1, 2, 1), -1), ((5, 5, 5), (1, 1, 1), 1)]:
        p = list(ref.default_padding(kernel, dil))
        got = ops.kernel_map(a, b, list(kernel), list(dil), p, [2, 2, 2], sign, method)
        want = ref.kernel_map(a, b, kernel, dil, p, 2, sign)
        assert torch.equal(got.cpu().long(), want), (kernel, dil, sign)


@pytest.mark.parametrize("method", METHODS)
def test_kernel_map_no_wraparound_at_range_edges(method, device):
    """A neighbour one past +/-131071 (or past a batch) is absent, never a wrapped-around input."""
    m = 131071
    coords = torch.tensor([
        [0, m, 0, 0], [0, -m - 1, 1, 0],          # x edge; packed-key overflow would reach the other
        [0, 5, 0, m], [0, 5, 1, -m - 1],          # z edge overflowing into y
        [0, 7, m, 3], [0, 8, -m - 1, 3],          # y edge overflowing into x
        [1, -m - 1, -m - 1, -m - 1], [0, m, m, m],  # batch boundary
        [3, 0, 0, 0], [3, 0, 0, 1],               # an ordinary pair that must be found
    ], dtype=torch.int32, device=device)
    for p in ([1, 1, 1],):
        got = ops.kernel_map(coords, coords, [3, 3, 3], [1, 1, 1], p, [1, 1, 1], 1, method)
        want = ref.kernel_map(coords, coords, 3, 1, p, 1, 1)
        assert torch.equal(got.cpu().long(), want)
        assert int((want >= 0).sum()) == coords.shape[0] + 2


@pytest.mark.parametrize("method", METHODS)
def test_kernel_map_empty(method, device):
    e = torch.empty(0, 4, dtype=torch.int32, device=device)
    c = random_coords(20, seed=1).to(device)
    assert ops.kernel_map(e, c, [3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, method).shape == (c.shape[0], 27)
    assert bool((ops.kernel_map(e, c, [3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, method) == -1).all())
    assert ops.kernel_map(c, e, [3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, method).shape == (0, 27)
    nb = ops.kernel_map(c, e, [3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, method)
    t = ops.kernel_map_transpose(nb, c)
    assert t.shape == (c.shape[0], 27) and bool((t == -1).all())
    assert ops.out_coords(e, [3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, [2, 2, 2], False).shape == (0, 4)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_get_kernel_map(case, device):
    """get_kernel_map: output coordinates, stride, nbmap and nbmap_t, and one build per key."""
    x, fine = build(case, cin=1, device=device, seed=8)
    kw = case.conv_kwargs()
    kmap, out, out_stride, key = torchsp.kmap.get_kernel_map(x, **kw)
    want_out = expected_coords(case, x.coords, fine)
    assert torch.equal(out.cpu(), want_out)
    assert tuple(out_stride) == case.out_stride()
    hash(key)
    k, d, p = _lists(case)
    step, sign = kmap_args(case)
    want = ref.kernel_map(x.coords, want_out, k, d, p, step, sign)
    assert torch.equal(kmap.nbmap.cpu().long(), want)
    assert torch.equal(kmap.nbmap_t.cpu().long(), ref.transpose_map(want, x.coords.shape[0]))
    # mirrored (the dgrad plan reuses the forward's rows): submanifold, odd sizes, centred padding
    centred = all(a % 2 == 1 and b == (a - 1) // 2 * c for a, b, c in zip(k, p, d))
    assert kmap.mirrored == (case.regime == "submanifold" and centred)
    if kmap.mirrored:
        assert torch.equal(kmap.nbmap_t, kmap.nbmap.flip(1))
    again = torchsp.kmap.get_kernel_map(x, **kw)
    assert again[0] is kmap and again[3] == key


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts torchsp ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("torchsp::"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_maps_built_once_per_network(device):
    """Submanifold x2, down, submanifold, up (same kernel as down), with backward: each map built once.

    The transposed conv reuses the downsampling map swapped (docs/internals.md), so a U-Net of
    this shape builds 3 maps (stride-1 submanifold, down, stride-2 submanifold) and 1
    output-coordinate set (DESIGN.md section 1: building a map twice for the same key is a bug)."""
    dt = torch.float64 if device == "cpu" else torch.float32
    coords = random_coords(300, span=6, seed=3).to(device)
    x = torchsp.SparseTensor(randn(coords.shape[0], 4, dtype=dt, device=device).requires_grad_(), coords)
    w = [randn(27, 4, 4, seed=i, dtype=dt, device=device).requires_grad_() for i in range(3)]
    w2 = [randn(8, 4, 4, seed=i + 5, dtype=dt, device=device).requires_grad_() for i in range(2)]
    f = torchsp.functional.sparse_conv3d
    with OpCounter() as counter:
        a = f(x, w[0], 3)
        a = f(a, w[1], 3)
        b = f(a, w2[0], 2, stride=2)
        b = f(b, w[2], 3)
        c = f(b, w2[1], 2, stride=2, transposed=True)
        c.feats.sum().backward()
    counts = counter.counts
    assert counts.get("torchsp::conv_fwd", 0) >= 5, counts  # the CUDA autotuner may measure more
    assert counts.get("torchsp::out_coords", 0) == 1, counts
    assert counts.get("torchsp::kernel_map", 0) == 3, counts  # stride-1 sub, down, stride-2 sub
    assert torch.equal(c.coords, coords)
