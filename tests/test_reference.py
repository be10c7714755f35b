"""Self-checks of tests/reference.py (no torchsp involved).

Two independent formulations must agree before either is trusted: the dense
F.conv3d / F.conv_transpose3d reference against a gather over the slow kernel
map, the row_ids-based map against a dict, and the occupancy-grid output sites
against brute-force enumeration of q = p - delta_k.
"""

import pytest
import torch

import torchsp

import reference as ref
from cases import CASES, CASE_IDS, case_coords, padding_of
from conftest import random_coords, randn


def brute_sites(coords, kernel, dilation, padding, step, sign, lattice):
    """sorted {q : q + sign*delta_k in coords for some k, q multiple of lattice}."""
    delta = ref.offsets(kernel, dilation, padding, step, sign).tolist()
    lat = ref.triple(lattice)
    out = set()
    for b, x, y, z in coords.long().tolist():
        for dx, dy, dz in delta:
            q = (x - dx, y - dy, z - dz)
            if all(v % L == 0 for v, L in zip(q, lat)):
                out.add((b,) + q)
    return torch.tensor(sorted(out), dtype=torch.int32).reshape(-1, 4)


@pytest.mark.parametrize("kernel,dilation,step,sign", [(3, 1, 1, 1), (2, 1, 2, 1), ((3, 1, 2), 2, 1, -1),
                                                       (5, 1, 2, -1)])
def test_kernel_map_unique_vs_dict(kernel, dilation, step, sign):
    inp = random_coords(120, span=4, stride=step, seed=1)
    out = random_coords(90, span=4, stride=step, seed=2)
    p = ref.default_padding(ref.triple(kernel), ref.triple(dilation))
    a = ref.kernel_map(inp, out, kernel, dilation, p, step, sign)
    b = ref.kernel_map_dict(inp, out, kernel, dilation, p, step, sign)
    assert torch.equal(a, b)
    assert (a >= 0).any() and (a < 0).any()


@pytest.mark.parametrize("span", [3, 1 << 40, 1 << 61])
def test_row_ids_partition_rows_as_unique_does(span):
    """row_ids (the reference map's row matching) groups rows exactly as torch.unique(dim=0)
    does, with dense ids: many repeats of 40 random rows, from tiny to 2^61-wide values (no
    packing range), rows that swap two columns' values (equal per column, not as rows), and all
    81 rows over {0, 1, 2} (a fold one too narrow would merge some)."""
    g = torch.Generator().manual_seed(span % 1009)
    base = torch.randint(-span, span, (40, 4), generator=g)
    base[20:, [1, 2]] = base[:20, [2, 1]]
    grid = torch.cartesian_prod(*[torch.arange(3)] * 4)  # every row over {0, 1, 2}: each fold's edge
    rows = torch.cat([base[torch.randint(0, 40, (600,), generator=g)], grid[torch.randperm(81, generator=g)]])
    ids = ref.row_ids(rows)
    want = torch.unique(rows, dim=0, return_inverse=True)[1]
    assert torch.equal(ids[:, None] == ids[None], want[:, None] == want[None])
    assert sorted(set(ids.tolist())) == list(range(int(want.max()) + 1))


@pytest.mark.parametrize("kernel,stride,dilation,t", [(3, 2, 1, 1), (2, 2, 1, 2), (3, 2, 2, 1), (5, 2, 1, 1),
                                                      ((3, 1, 2), (2, 1, 2), 1, 2)])
def test_active_sites_vs_brute_force(kernel, stride, dilation, t):
    c = random_coords(80, span=4, stride=t, seed=3)
    k, s, d = ref.triple(kernel), ref.triple(stride), ref.triple(dilation)
    p = ref.default_padding(k, d)
    got = ref.active_sites(c, t, k, s, d)
    want = brute_sites(c, k, d, p, t, 1, [a * t for a in s])
    assert torch.equal(got, want)
    gen = ref.generative_sites(c, t, k, d)
    assert torch.equal(gen, brute_sites(c, k, d, p, t, 1, t))


@pytest.mark.parametrize("kernel,stride,t", [(2, 2, 2), (3, 2, 2), (3, 2, 4)])
def test_transposed_generative_sites_vs_brute_force(kernel, stride, t):
    c = random_coords(60, span=3, stride=t, seed=4)
    k = ref.triple(kernel)
    p = ref.default_padding(k, (1, 1, 1))
    fine = t // stride
    got = ref.transposed_generative_sites(c, t, k, stride)
    assert torch.equal(got, brute_sites(c, k, 1, p, fine, -1, fine))


def test_floor_sites_negative():
    c = torch.tensor([[0, -1, -2, -3], [0, 0, 1, 2], [1, -4, 3, 5], [0, -2, -1, -4]], dtype=torch.int32)
    got = ref.floor_sites(c, 1, 2)
    want = torch.tensor([[0, -2, -2, -4], [0, 0, 0, 2], [1, -4, 2, 4]], dtype=torch.int32)
    assert torch.equal(got, want)


def _ref_input(case, seed=0):
    """(coords at the input stride, fine coords or None) built from the reference alone."""
    c = case_coords(case, seed=seed, n=70, span=3)
    if case.transposed and not case.generative:
        kd, rule = case.down
        t_fine = case.in_stride // ref.triple(case.stride)[0]
        if rule == "floor":
            coarse = ref.floor_sites(c, t_fine, case.stride)
        else:
            coarse = ref.active_sites(c, t_fine, kd, case.stride)
        return coarse[torch.randperm(coarse.shape[0], generator=torch.Generator().manual_seed(seed))], c
    return c, None


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_dense_equals_gather(case):
    """dense F.conv3d / conv_transpose3d == sum_k x[q + delta_k] @ W[k] with the slow map."""
    from cases import expected_coords

    c, fine = _ref_input(case)
    out = expected_coords(case, c, fine)
    x = randn(c.shape[0], 2, seed=5)
    w = randn(case.volume(), 2, 3, seed=6)
    step, sign = (case.out_stride(), -1) if case.transposed else (case.in_stride, 1)
    nbmap = ref.kernel_map(c, out, case.kernel, case.dilation, padding_of(case), step, sign)
    y_gather = ref.gather_conv(x, nbmap, w)
    y_dense = ref.dense_conv(x, c, case.in_stride, w, ref.triple(case.kernel), out, stride=case.stride,
                             padding=case.padding, dilation=case.dilation, transposed=case.transposed)
    assert out.shape[0] > 0
    torch.testing.assert_close(y_dense, y_gather, rtol=1e-12, atol=1e-12)
    if case.regime not in ("submanifold", "floor", "transposed"):
        # every active output reads at least one input (DESIGN.md's definition of the site set)
        assert bool((nbmap >= 0).any(1).all())


def test_reference_grads_memo_is_keyed_on_values():
    """The memoised dense reference (tests/cases.py) equals a fresh computation, and any changed
    input value gives a fresh one, not the cached result."""
    from cases import BY_NAME, build, reference, reference_grads
    case = BY_NAME["sub_k3"]
    x, _ = build(case, cin=4, seed=11)
    w = torch.randn(case.volume(), 4, 6, dtype=torch.float64)
    y = torchsp.functional.sparse_conv3d(x, w, **case.conv_kwargs())
    g = torch.randn_like(y.feats)
    got = reference_grads(case, x.feats, x.coords, w, y.coords, g)
    rf, rw = x.feats.clone().requires_grad_(), w.clone().requires_grad_()
    want = reference(case, rf, x.coords, rw, y.coords)
    want.backward(g)
    for a, b in zip(got, (want, rf.grad, rw.grad)):
        assert torch.equal(a, b)
    assert reference_grads(case, x.feats, x.coords, w, y.coords, g) is got
    g2 = g.clone()
    g2[0, 0] += 1.0
    other = reference_grads(case, x.feats, x.coords, w, y.coords, g2)
    assert not torch.equal(other[2], got[2])
