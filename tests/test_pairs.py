"""kernel_map_pairs (torchsp.kmap.map_pairs), the weight-stationary form of a kernel map, against
an independent pure-torch reference: random maps (with -1 and other negative entries), real
kernel maps of a LiDAR crop, empty maps, V = 1, 125 and 4096, sizes that cross the CPU chunks
(4096 rows) and the CUDA tiles (128 rows x 32 offsets), with and without the pairs' input rows
(rows=True); opcheck; bad input.

The op allocates its outputs, so there is nothing to poison: P and every entry are checked.
"""

import pytest
import torch

import torchsp
from conftest import crop_voxels, load_lidar, random_coords

ops = torch.ops.torchsp


def ref_pairs(nbmap):
    """(pairs int64 [P], starts int64 [V + 1]) from nonzero() over the transposed presence mask:
    row-major order of [V, N] is offset-major, rows increasing."""
    nb = nbmap.cpu().long()
    v = nb.shape[1]
    kq = (nb.t() >= 0).nonzero()
    starts = torch.zeros(v + 1, dtype=torch.int64)
    starts[1:] = torch.bincount(kq[:, 0], minlength=v).cumsum(0)
    return kq[:, 1], starts


def check_pairs(nbmap, pairs, starts, bounded=False):
    """pairs and starts against ref_pairs; bounded: pairs is [N * V], its first P entries the
    pairs and the rest -1 (kernel_map_pairs(nbmap, bounded=True)).  A 2-D pairs [2, .] is a list
    with rows (kernel_map_pairs(nbmap, rows=True)): its first row as above, its second each pair's
    input row nbmap[q, k] from the reference's (k, q), then -1 likewise."""
    want_pairs, want_starts = ref_pairs(nbmap)
    assert pairs.dtype == torch.int32 and starts.dtype == torch.int64
    assert pairs.device == nbmap.device and starts.device == nbmap.device
    assert (pairs.dim() == 1 or (pairs.dim() == 2 and pairs.shape[0] == 2)) and starts.shape == (nbmap.shape[1] + 1,)
    length = nbmap.shape[0] * nbmap.shape[1] if bounded else want_pairs.shape[0]
    assert pairs.shape[-1] == length, f"pairs has {pairs.shape[-1]} entries, want {length}"
    assert torch.equal(starts.cpu(), want_starts)
    p = want_pairs.shape[0]
    q = pairs[0] if pairs.dim() == 2 else pairs
    assert torch.equal(q[:p].cpu().long(), want_pairs)
    assert bool((q[p:] == -1).all())
    if pairs.dim() == 2:
        k_of = torch.repeat_interleave(torch.arange(nbmap.shape[1]), want_starts[1:] - want_starts[:-1])
        want_rows = nbmap.cpu().long()[want_pairs, k_of]
        assert bool((want_rows >= 0).all())
        assert torch.equal(pairs[1, :p].cpu().long(), want_rows)
        assert bool((pairs[1, p:] == -1).all())


def random_map(n, v, seed, present=0.3, n_in=1000):
    """int32 [n, v]: about `present` of the entries are rows in [0, n_in); the others are -1 or,
    one in four, another negative value (down to INT32_MIN), all of which mean absent."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(0, n_in, (n, v), generator=g, dtype=torch.int64)
    absent = torch.rand(n, v, generator=g) >= present
    other = torch.randint(-(2 ** 31), -1, (n, v), generator=g, dtype=torch.int64)
    neg = torch.where(torch.rand(n, v, generator=g) < 0.25, other, torch.full_like(other, -1))
    return torch.where(absent, neg, m).int()


@pytest.mark.parametrize("n,v", [(1, 1), (300, 1), (257, 27), (5000, 27), (20000, 27), (129, 33),
                                 (700, 64), (1000, 125), (300, 4096)])
def test_pairs_random_maps(n, v, device):
    nbmap = random_map(n, v, seed=n * 7 + v).to(device)
    pairs, starts = torchsp.kmap.map_pairs(nbmap)
    check_pairs(nbmap, pairs, starts)
    # the pair's input row is nbmap[q, k]: present for every pair
    k_of = torch.repeat_interleave(torch.arange(v), (starts[1:] - starts[:-1]).cpu())
    assert bool((nbmap.cpu().long()[pairs.cpu().long(), k_of] >= 0).all())


@pytest.mark.parametrize("fill", [-1, -5, 0])
def test_pairs_all_absent_or_present(fill, device):
    """Every entry absent (-1, or another negative) gives P = 0; every entry present gives V * N."""
    nbmap = torch.full((333, 27), fill, dtype=torch.int32, device=device)
    pairs, starts = ops.kernel_map_pairs(nbmap)
    check_pairs(nbmap, pairs, starts)
    assert pairs.shape[0] == (333 * 27 if fill == 0 else 0)


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("shape", [(0, 27), (0, 1), (0, 125), (5, 0)])
def test_pairs_empty(shape, rows, device):
    nbmap = torch.empty(shape, dtype=torch.int32, device=device)
    pairs, starts = ops.kernel_map_pairs(nbmap, False, rows)
    assert pairs.shape == ((2, 0) if rows else (0,)) and pairs.dtype == torch.int32 and pairs.device == nbmap.device
    assert starts.shape == (shape[1] + 1,) and starts.dtype == torch.int64
    assert not bool(starts.cpu().any())


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("n,v,present", [(1, 1, 0.3), (257, 27, 0.3), (5000, 27, 0.5), (129, 33, 0.3),
                                         (333, 27, 1.0), (333, 27, 0.0), (1000, 125, 0.3), (300, 4096, 0.3)])
def test_pairs_rows(n, v, present, bounded, device):
    """rows=True: pairs is [2, P] (bounded: [2, N * V]), its first row the list without rows, bitwise,
    its second each pair's input row (checked against the reference in check_pairs), -1 past P in
    both; deterministic.  Random maps whose absent entries include other negatives than -1."""
    nbmap = random_map(n, v, seed=5 * n + v, present=present).to(device)
    pairs, starts = ops.kernel_map_pairs(nbmap, bounded, True)
    check_pairs(nbmap, pairs, starts, bounded=bounded)
    plain = ops.kernel_map_pairs(nbmap, bounded)
    assert torch.equal(pairs[0], plain[0]) and torch.equal(starts, plain[1])
    again = torchsp.kmap.map_pairs(nbmap, bounded=bounded, rows=True)
    assert torch.equal(again[0], pairs) and torch.equal(again[1], starts)


@pytest.mark.parametrize("n,v,present", [(1, 1, 0.3), (0, 27, 0.3), (5, 0, 0.3), (257, 27, 0.3),
                                         (20000, 27, 0.5), (333, 27, 1.0), (333, 27, 0.0), (1000, 125, 0.3)])
def test_pairs_bounded(n, v, present, device):
    """bounded=True: pairs is [N * V] (the most a map holds, so nothing is read back): the
    reference's pairs, then -1; run twice, equal (deterministic)."""
    nbmap = random_map(n, v, seed=n + 3 * v, present=present).to(device)
    pairs, starts = ops.kernel_map_pairs(nbmap, True)
    check_pairs(nbmap, pairs, starts, bounded=True)
    again = torchsp.kmap.map_pairs(nbmap, bounded=True)
    assert torch.equal(again[0], pairs) and torch.equal(again[1], starts)


def test_pairs_bounded_does_not_synchronise():
    """On CUDA the exact op reads P back (torch's sync debug mode raises on it), the bounded op
    does not."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    nbmap = random_map(5000, 27, seed=5).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pairs, starts = ops.kernel_map_pairs(nbmap, True)
        with pytest.raises(RuntimeError, match="synchroniz"):
            ops.kernel_map_pairs(nbmap)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    check_pairs(nbmap, pairs, starts, bounded=True)


def test_pairs_noncontiguous(device):
    """A strided view of a map (a column slice) is made contiguous first."""
    base = random_map(600, 54, seed=3).to(device)
    nbmap = base[:, ::2]
    assert not nbmap.is_contiguous()
    check_pairs(nbmap, *ops.kernel_map_pairs(nbmap))


def test_pairs_deterministic(device):
    nbmap = random_map(20000, 27, seed=11, present=0.5).to(device)
    a = ops.kernel_map_pairs(nbmap)
    b = ops.kernel_map_pairs(nbmap)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _lidar():
    return crop_voxels(load_lidar(), lo=(-4.0, -4.0, -2.0), hi=(4.0, 4.0, 3.0), voxel=0.1)


@pytest.mark.parametrize("kernel,stride", [(3, 1), (5, 1), (2, 2), (3, 2)])
def test_pairs_real_scan(kernel, stride, device):
    """Real kernel maps of a LiDAR crop (submanifold k3 / k5 = 125 offsets, strided k2 / k3),
    built by get_kernel_map: both layouts (nbmap for forward, nbmap_t for dgrad)."""
    c = _lidar().to(device)
    x = torchsp.SparseTensor(torch.zeros(c.shape[0], 1, device=device), c)
    kmap, out, _, _ = torchsp.kmap.get_kernel_map(x, kernel, stride=stride)
    assert kmap.nbmap.shape[1] == kernel ** 3
    for m in (kmap.nbmap, kmap.nbmap_t):
        pairs, starts = torchsp.kmap.map_pairs(m)
        check_pairs(m, pairs, starts)
        assert pairs.shape[0] == int((m >= 0).sum()) >= m.shape[0] > 0  # every row has a neighbour
        for bounded in (False, True):
            check_pairs(m, *torchsp.kmap.map_pairs(m, bounded=bounded, rows=True), bounded=bounded)


def test_pairs_opcheck(device):
    c = random_coords(150, span=4, seed=0).to(device)
    nbmap = ops.kernel_map(c, c, [3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, 0)
    torch.library.opcheck(ops.kernel_map_pairs.default, (nbmap,))
    torch.library.opcheck(ops.kernel_map_pairs.default, (nbmap[:0],))
    torch.library.opcheck(ops.kernel_map_pairs.default, (random_map(200, 1, seed=1).to(device),))
    torch.library.opcheck(ops.kernel_map_pairs.default, (nbmap, True))
    torch.library.opcheck(ops.kernel_map_pairs.default, (nbmap[:0], True))
    torch.library.opcheck(ops.kernel_map_pairs.default, (nbmap, False, True))
    torch.library.opcheck(ops.kernel_map_pairs.default, (nbmap, True, True))
    torch.library.opcheck(ops.kernel_map_pairs.default, (nbmap[:0], True, True))


def test_pairs_bad_input(device):
    """Wrong dtype or rank is an error naming the op and the argument."""
    with pytest.raises(RuntimeError, match="kernel_map_pairs: nbmap must be int32"):
        ops.kernel_map_pairs(torch.zeros(4, 27, dtype=torch.int64, device=device))
    with pytest.raises(RuntimeError, match=r"kernel_map_pairs: nbmap must be \[N, V\]"):
        ops.kernel_map_pairs(torch.zeros(27, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="kernel_map_pairs: nbmap must be"):
        ops.kernel_map_pairs(torch.zeros(2, 3, 4, dtype=torch.int32, device=device))


def test_ref_pairs_is_independent():
    """The reference itself on a hand-written map (rows per offset, increasing)."""
    m = torch.tensor([[0, -1, 3], [-1, -1, 2], [5, -7, -1], [1, 2, 3]], dtype=torch.int32)
    pairs, starts = ref_pairs(m)
    assert pairs.tolist() == [0, 2, 3, 3, 0, 1, 3] and starts.tolist() == [0, 3, 4, 7]
    got = ops.kernel_map_pairs(m)
    assert got[0].tolist() == [0, 2, 3, 3, 0, 1, 3] and got[1].tolist() == [0, 3, 4, 7]
