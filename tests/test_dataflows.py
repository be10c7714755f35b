"""Every CUDA dataflow (torchsp/plan.py) against independent references.

Mask splits, weight-stationary and Spira's hybrid run as segmented passes of
the tensor-core kernels; gather-GEMM-scatter takes the weight-stationary plan
into cuBLAS batches (csrc/shim_ggs.cpp).  Each is checked against the dense float64 reference
(every regime of tests/cases.py, forward and backward), the fp64 gather
reference on a real scan crop, and the worst cases (all offsets present, one
row, channel counts 3 / 5 / 96 / 384).  The plans themselves are checked on
the CPU: their segments must cover every (row, offset) pair of the map exactly
once.  Workspace memory is poisoned with NaN before each GPU run, so a partial
sum that is read before it is written cannot pass.
"""

import pytest
import torch

import reference as ref
import torchsp
from cases import CASES, build, reference_grads
from conftest import (CUDA, crop_voxels, dense_cube, lidar_crop, load_lidar, plane_coords, poison_cuda_cache,
                      random_coords, randn, real_scan_layer, rel_err)
from torchsp.plan import PLAIN, _build, pass_plan, segmented

F = torchsp.functional
ops = torch.ops.torchsp
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")

# [dataflow, tile, split, threshold]; tile 9 is wgmma on sm_90a builds (else mma.sync).
DATAFLOWS = {
    "split2": [0, 0, 2, 0],
    "split3": [0, 1, 3, 0],
    "ws": [1, 0, 0, 0],
    "ws_t9": [1, 9, 0, 0],
    "hybrid1": [2, 0, 0, 1],
    "hybrid2": [2, 0, 0, 2],
    "hybrid3_t9": [2, 9, 0, 3],
    "hybrid0": [2, 0, 0, 0],  # every offset weight-stationary
    "hybrid_all_os": [2, 0, 0, 99],  # no offset weight-stationary: one plain segment
    # gather-GEMM-scatter (csrc/shim_ggs.cpp): groups of equal pair counts, up to 50% padding,
    # every offset in one bmm (padded to the centre's count)
    "ggs": [4, 0, 0, 0],
    "ggs50": [4, 0, 0, 50],
    "ggs_one_bmm": [4, 0, 0, 6400],
    # density split: offsets >= d% of rows over all rows (stored), the rest over the rows that
    # have any (added into the output); tile 3 mma.sync, 9 wgmma, 15 warp-specialized (its
    # producers read each segment's map rows from the plan)
    "density20": [5, 0, 0, 20],
    "density50_t3": [5, 3, 0, 50],
    "density35_t9": [5, 9, 0, 35],
    "density10_t15": [5, 15, 0, 10],
    "density100": [5, 0, 0, 100],  # common: the offsets every row has (a submanifold's centre)
}
# Split-K (dataflow 3): no segments; each tile's used offsets cut into S runs summed by separate
# blocks into fp32 slabs (S = 5 leaves uneven and, on rows with few offsets, empty runs).
SPLIT_K = {
    "splitk2": [3, 0, 2, 0],
    "splitk5_t9": [3, 9, 5, 0],
    "splitk3_t15": [3, 15, 3, 0],
    "splitk16_t3_unsorted": [3, 3, 16, -1],
}
EVERY = {**DATAFLOWS, **SPLIT_K}
TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


_poison_cache = poison_cuda_cache


def _covered(nbmap, seq, segs):
    """Count per (row, offset) of how often the plan's segments sum it (dense [N, V] int); also
    checks each segment's flags (all_rows | 2 * add_out | 4 * plan, csrc/torchsp.h): all_rows
    segments list every row, add_out segments come last, a plan segment's map rows follow its rows."""
    n, v = nbmap.shape
    cover = torch.zeros(n, v, dtype=torch.long)
    adding = False
    for i in range(0, len(segs), 4):
        start, count, bits, flags = segs[i:i + 4]
        rows = seq[start:start + count].long()
        ks = [k for k in range(v) if (bits >> k) & 1]
        if flags & 1:
            assert sorted(rows.tolist()) == list(range(n))
        assert not adding or flags & 2, "a segment that produces the output after one that adds into it"
        adding = bool(flags & 2)
        if flags & 4:
            assert torch.equal(seq[start + count:start + count * (1 + v)].view(count, v), nbmap[rows])
        assert rows.unique().numel() == rows.numel(), "a row twice in one segment"
        for k in ks:
            present = nbmap[rows, k] >= 0
            cover[rows[present], k] += 1
    return cover


@pytest.mark.parametrize("name", list(DATAFLOWS))
@pytest.mark.parametrize("kernel", [3, 2, 5])
def test_plan_covers_every_pair_once(name, kernel):
    """CPU: the segments of every dataflow sum each present (row, offset) exactly once."""
    c = torch.unique(torch.cat([torch.randint(0, 2, (900, 1)), torch.randint(-6, 6, (900, 3))], 1), dim=0).int()
    x = torchsp.SparseTensor(torch.zeros(c.shape[0], 1, dtype=torch.float64), c)
    geom = torchsp.kmap.ConvGeometry(kernel, 2 if kernel == 2 else 1)
    kmap = torchsp.kmap.get_kernel_map(x, geom)[0]
    algo = DATAFLOWS[name]
    for which, nb in (("fwd", kmap.nbmap), ("dgrad", kmap.nbmap_t)):
        if nb.shape[1] > 63:
            continue
        got = _build(kmap, which, algo, geom.kernel_size, geom.dilation, geom.padding)
        if got is PLAIN:  # no segment would run: the plain pass
            if algo[0] == 5:  # every offset common, or none
                common, rare = torchsp.plan.density_offsets(nb, algo[3])
                assert not common or not rare, (name, which)
            else:  # no pairs at all
                assert not bool((nb >= 0).any()), (name, which)
            continue
        seq, segs = got
        assert len(segs) % 4 == 0 and len(segs) > 0
        assert torch.equal(_covered(nb, seq, segs), (nb >= 0).long()), (name, which)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_split_k_few_tiles(dtype):
    """Split-K on a pass with fewer tiles than runs x SMs: 300 output rows of a real crop (three
    128-row tiles), every S from 2 to 16 and tiles 0 (wgmma or mma.sync), 3 (mma.sync), 13, 15, 16
    and 17 (swizzled / warp-specialized / ping-pong wgmma, the last two in 128- and 64-column
    tiles; mma.sync without sm_90a); float32 with tf32 tiles
    (tile 11).  Forward and dgrad against the fp64 gather reference, with NaN-poisoned
    workspace (a run that leaves a slab row unwritten fails), and bitwise equal run to run."""
    c = lidar_crop()[:300].cuda()
    x = torchsp.SparseTensor(randn(c.shape[0], 64, dtype=dtype, device="cuda", seed=1), c)
    geom = torchsp.kmap.ConvGeometry(3)
    km = torchsp.kmap.get_kernel_map(x, geom)[0]
    w = randn(27, 64, 136, dtype=dtype, device="cuda", seed=2, scale=0.1)
    dy = randn(c.shape[0], 136, dtype=dtype, device="cuda", seed=3)
    want_y = ref.gather_conv(x.feats, km.nbmap, w)
    want_dx = ref.gather_conv(dy, km.nbmap_t, w.transpose(1, 2))
    tiles = (0, 3, 13, 15, 16, 17) if dtype == torch.float16 else (11,)
    tol = 5e-3  # fp16 and tf32 operands, fp32 sums
    for tile in tiles:
        for s in (2, 3, 5, 8, 16):
            a = [3, tile, s, 0]
            assert pass_plan(km, "fwd", a, geom, dtype)[1] == [] and pass_plan(km, "dgrad", a, geom, dtype)[1] == []
            _check_pass(x, w, dy, km, geom, a, want_y, want_dx, a, tol)


def test_plan_cpu_and_plain_passes_have_no_segments():
    c = torch.unique(torch.randint(-5, 5, (300, 4)).clamp_min(0), dim=0).int()
    x = torchsp.SparseTensor(torch.zeros(c.shape[0], 1), c)
    geom = torchsp.kmap.ConvGeometry(3)
    kmap = torchsp.kmap.get_kernel_map(x, geom)[0]
    assert pass_plan(kmap, "fwd", [1, 0, 0, 0], geom)[1] == []  # CPU: its own dataflows
    assert pass_plan(kmap, "dgrad", [0, 0, 0, 0], geom)[1] == []
    assert not any(segmented(a) for a in SPLIT_K.values())  # split-K is one plain pass


def _pairless_layer(device, dtype):
    """A strided layer whose map has no pair in either direction: floor rule, kernel (3, 1, 3)
    dilated by 2, stride 2, on sites with odd x and z (each output sits at an even site, and its
    offsets -2, 0, 2 along x and z reach only even ones).  Its output is the bias alone and its
    dx and dw are zero.  Returns (x SparseTensor [N, 8], geometry kwargs)."""
    c = torch.tensor([[0, 1, 0, 1], [0, 1, 3, 1], [0, 3, 0, 5], [1, -1, 2, 7], [1, 5, 5, -3]], dtype=torch.int32)
    x = torchsp.SparseTensor(randn(c.shape[0], 8, dtype=dtype, device=device, seed=1), c.to(device))
    return x, dict(kernel_size=(3, 1, 3), stride=2, dilation=2, rule="floor")


def test_plans_of_a_map_without_pairs():
    """CPU: every segmented dataflow of a map without pairs is PLAIN (no segment would run, and
    the plain pass writes the zeros) or, for mask splits and hybrids with output-stationary
    offsets, segments over all rows; never an empty row list beside no segments (which the ops
    refused: tools/fuzz_conv.py seed 205)."""
    x, kw = _pairless_layer("cpu", torch.float64)
    geom = torchsp.kmap.ConvGeometry(kw["kernel_size"], kw["stride"], kw["dilation"], rule=kw["rule"])
    kmap = torchsp.kmap.get_kernel_map(x, geom)[0]
    assert kmap.nbmap.shape[0] > 0 and not bool((kmap.nbmap >= 0).any())
    for name, algo in DATAFLOWS.items():
        for which in ("fwd", "dgrad"):
            got = _build(kmap, which, algo, geom.kernel_size, geom.dilation, geom.padding)
            if algo[0] in (1, 4, 5) or (algo[0] == 2 and algo[3] == 0):
                assert got is PLAIN, (name, which)
            else:
                seq, segs = got
                assert segs and seq.shape[0] >= int(segs[1]), (name, which)


@needs_cuda
@pytest.mark.parametrize("name", list(EVERY))
def test_every_dataflow_on_a_map_without_pairs(name):
    """Each dataflow on a layer whose map has no pair (_pairless_layer), forward with a bias and
    backward, outputs into NaN-poisoned memory: y equals the bias, dx and dw are zero.  Before
    PLAIN the weight-stationary ones raised (order must be [N] ..., got shape [0])."""
    x, kw = _pairless_layer("cuda", torch.float16)
    feats = x.feats.detach().clone().requires_grad_()
    w = randn(9, 8, 16, dtype=torch.float16, device="cuda", seed=2).requires_grad_()
    b = randn(16, dtype=torch.float16, device="cuda", seed=3)
    a = EVERY[name]
    _poison_cache()
    y = F.sparse_conv3d(x.replace(feats), w, bias=b, algo=(a, a, [0, 0, 0, 0]), **kw)
    assert y.feats.shape[0] > 0
    assert torch.equal(y.feats, b.expand_as(y.feats))
    _poison_cache()
    y.feats.backward(randn(*y.feats.shape, dtype=torch.float16, device="cuda", seed=4))
    assert torch.equal(feats.grad, torch.zeros_like(feats))
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_segments_bad_input(device):
    """The shim names segs / segs_t and what is wrong with them."""
    c = torch.unique(torch.randint(0, 6, (200, 4)), dim=0).int().to(device)
    dt = torch.float64 if device == "cpu" else torch.float16
    x = torchsp.SparseTensor(randn(c.shape[0], 8, dtype=dt, device=device), c)
    km = torchsp.kmap.get_kernel_map(x, 3)[0]
    w = randn(27, 8, 8, dtype=dt, device=device)
    a = [0, 0, 0, 0]
    seq = torch.arange(c.shape[0], dtype=torch.int32, device=device)
    n = c.shape[0]
    with pytest.raises(RuntimeError, match="segs must hold"):
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, seq, None, [0, n, 1])
    with pytest.raises(RuntimeError, match="segs needs the row list order"):
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, None, None, [0, n, 1, 1])
    with pytest.raises(RuntimeError, match="segs segment 0.*outside order"):
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, seq, None, [1, n, 1, 0])
    with pytest.raises(RuntimeError, match="segs segment 0: all_rows"):
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, seq, None, [0, n - 1, 1, 1])
    with pytest.raises(RuntimeError, match="names offsets past V"):
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, seq, None, [0, n, 1 << 27, 1])
    with pytest.raises(RuntimeError, match="segs_t segment 0.*outside order_t"):
        ops.conv_dgrad(randn(n, 8, dtype=dt, device=device), w, km.nbmap_t, a, seq, [-1, 2, 1, 0])
    with pytest.raises(RuntimeError, match="segs segment 0: flags must be"):
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, seq, None, [0, n, 1, 8])
    with pytest.raises(RuntimeError, match="segs segment 1: segments that add into the output"):
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, seq, None, [0, 2, 1, 2, 0, n, 2, 1])
    with pytest.raises(RuntimeError, match="segs segment 0.*with its map rows.*outside order"):
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, seq, None, [0, n, 1, 5])
    with pytest.raises(RuntimeError, match=r"algo\[3\] \(threshold\) of the density split"):
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, [5, 0, 0, 0], a, a, seq, None, [])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(EVERY))
@pytest.mark.parametrize("case", [c for c in CASES if c.name in (
    "sub_k3", "sub_k2", "sub_k5", "str_k2_s2", "str_k3_s2", "gen_k3", "tr_k2_s2", "trgen_k3_s2", "sub_k3_d2",
    "floor_k3_s2")], ids=lambda c: c.name)
def test_dataflow_vs_dense(case, name, dtype):
    """Forward, dgrad and wgrad of each dataflow against the dense float64 reference's autograd."""
    cin, cout = 24, 40
    x, fine = build(case, cin=cin, device="cuda", dtype=dtype, seed=3)
    w = randn(case.volume(), cin, cout, seed=4, dtype=dtype, device="cuda", scale=(case.volume() * cin) ** -0.5)
    feats = x.feats.detach().clone().requires_grad_()
    wp = w.clone().requires_grad_()
    a = EVERY[name]
    _poison_cache()
    y = F.sparse_conv3d(x.replace(feats), wp, algo=(a, a, [0, 0, 0, 0]), **case.conv_kwargs())
    g = randn(*y.feats.shape, seed=5, dtype=dtype, device="cuda")
    _poison_cache()
    y.feats.backward(g)
    want, want_dx, want_dw = reference_grads(case, x.feats, x.coords, w, y.coords, g)
    tol = TOL[dtype]
    assert rel_err(y.feats, want) <= tol, ("fwd", rel_err(y.feats, want))
    assert rel_err(feats.grad, want_dx) <= 2 * tol, ("dgrad", rel_err(feats.grad, want_dx))
    assert rel_err(wp.grad, want_dw) <= 2 * tol


def _check_pass(x, w, dy, km, geom, a, want_y, want_dx, label, tol=None):
    """Forward and dgrad of algo `a` (its own plans, outputs into NaN-poisoned memory) against
    the fp64 references want_y / want_dx (relative error at most `tol`, default TOL of the
    features' dtype), and the forward bitwise equal run to run; `label` names the case in a
    failure."""
    dtype = x.feats.dtype
    tol = TOL[dtype] if tol is None else tol
    order, segs = pass_plan(km, "fwd", a, geom, dtype)
    order_t, segs_t = pass_plan(km, "dgrad", a, geom, dtype)
    _poison_cache()
    y = ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, order, order_t, segs, segs_t)
    _poison_cache()
    dx = ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t, segs_t)
    assert rel_err(y, want_y) <= tol, (label, rel_err(y, want_y))
    assert rel_err(dx, want_dx) <= tol, (label, rel_err(dx, want_dx))
    y2 = ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, order, order_t, segs, segs_t)
    assert torch.equal(y, y2), (label, "not deterministic")


@needs_cuda
@pytest.mark.parametrize("cin,cout", [(16, 32), (64, 64), (96, 136), (128, 384), (256, 128), (64, 32), (40, 128),
                                      (128, 48), (48, 48)])
def test_dataflow_real_scan(cin, cout):
    """A real LiDAR crop (submanifold 3x3x3 and stride-2 K=2): fwd and dgrad of every dataflow
    against the fp64 gather reference on the reference kernel map, and bitwise stable run to run.
    (64, 32), (40, 128), (128, 48) and (48, 48): tile 0 is a wgmma tile (18, 13's ring, where
    32 < n <= 64; 13 at n = 32) where a pass reduces over red > 32 channels and produces n >= 32
    (conv.cu resolve_tile), and mma.sync at red <= 32."""
    c = lidar_crop().cuda()
    dtype = torch.float16
    for geom in (torchsp.kmap.ConvGeometry(3), torchsp.kmap.ConvGeometry(2, 2)):
        x, km, out, w, dy, ref_map, want_y, want_dx = real_scan_layer(c, geom, cin, cout, dtype)
        for name, a in EVERY.items():
            _check_pass(x, w, dy, km, geom, a, want_y, want_dx, (name, geom.kernel_size))


@needs_cuda
@pytest.mark.parametrize("geom", [((1, 1, 1), 2), ((3, 1, 1), 1), ((1, 3, 1), 2), (2, 2), (3, 1)],
                         ids=["k1_s2", "k311", "k131_s2", "k2_s2", "k3"])
def test_step_plan_records_few_offsets(geom):
    """A tile copies its step-plan record with the first two columns requested beside the head,
    before it knows how many it uses (conv_tile.cuh tsp_tile_from_steps_by): kernels of 1, 3, 8
    and 27 offsets, so records of fewer columns than that (V = 1; one-offset tiles at stride 2,
    empty ones in dgrad) and more.  Forward and dgrad of tiles 0, 3 (mma.sync), 13 (all-warps
    wgmma), 15 (warp-specialized: its producers copy the record) and 16 (ping-pong: a consumer
    warpgroup copies it) on a real crop at 96 channels, against the fp64 gather reference into
    NaN-poisoned memory, and bitwise equal run to run."""
    geom = torchsp.kmap.ConvGeometry(*geom)
    x, km, out, w, dy, ref_map, want_y, want_dx = real_scan_layer(lidar_crop().cuda(), geom, 96, 96,
                                                                  torch.float16)
    assert km.order.shape[0] > km.nbmap.shape[0]  # a step plan
    for tile in (0, 3, 13, 15, 16):
        _check_pass(x, w, dy, km, geom, [0, tile, 0, 0], want_y, want_dx, tile)


@needs_cuda
@pytest.mark.parametrize("k", [3, 4])
@pytest.mark.parametrize("c", [32, 64, 128])
def test_staged_epilogue_real_scan(k, c):
    """Plain passes of the tensor-core kernels store their tiles through shared memory, in whole
    16-byte chunks (csrc/cuda/conv_tile.cuh tsp_stage_*: rows of 4, 8 and 16 chunks at C = 32, 64
    and 128, each with its own swizzle); a 4x4x4 kernel (64 offsets) at C = 128 leaves the ping-pong
    tile 16 no room for its staging buffers, so it stores directly.  Forward and dgrad of tiles 0,
    3 (mma.sync), 13 (all-warps wgmma), 16 and 17 (ping-pong, 17 in 64-column tiles) and 18 (13
    with the step plan's entries in a ring at C <= 64) on a real crop against the fp64 gather
    reference, into NaN-poisoned memory, and bitwise equal run to run."""
    geom = torchsp.kmap.ConvGeometry(k)
    x, km, out, w, dy, ref_map, want_y, want_dx = real_scan_layer(lidar_crop().cuda(), geom, c, c, torch.float16)
    for tile in (0, 3, 13, 16, 17, 18):
        _check_pass(x, w, dy, km, geom, [0, tile, 0, 0], want_y, want_dx, tile)


@needs_cuda
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("cin", [64, 128])
def test_ring_refills_dense_cube(stride, cin):
    """Tile 18 (tile 13 at <= 64 produced channels with the step plan's entries in a ring of 12
    column slots, csrc/cuda/conv_tile.cuh TSP_STEPS_RING) on a dense 12^3 cube, 3x3x3, where
    most submanifold tiles use all 27 offsets, more than the ring has slots: each column past
    the twelfth is copied into the slot of the one gathered before it as the loader walks (maps
    of more than 63 offsets have no step plan, so no ring).  Forward and dgrad at 64 produced
    channels (128 input channels: two K chunks per offset), submanifold and stride 2, fp16,
    against the fp64 gather reference into NaN-poisoned memory; bitwise equal to tile 13, which
    holds every column (the same products in the same order), and run to run."""
    c = dense_cube(0, 12).cuda()
    geom = torchsp.kmap.ConvGeometry(3, stride)
    x, km, out, w, dy, ref_map, want_y, want_dx = real_scan_layer(c, geom, cin, 64, torch.float16)
    if stride == 1:  # the step plan's offset counts: most tiles refill the ring
        plan, (n, v) = km.order, km.nbmap.shape
        head, tiles = (2 * v + 4 + 128 + 3) // 4 * 4, (n + 127) // 128
        counts = plan[(n + 3) // 4 * 4:][:tiles * (head + 128 * v)].view(tiles, -1)[:, 2 * v]
        assert int((counts > 12).sum()) > tiles // 2, counts
    _check_pass(x, w, dy, km, geom, [0, 18, 0, 0], want_y, want_dx, ("ring", stride, cin))
    for which in ("fwd", "dgrad"):
        got = [_pass_call(which, [0, t, 0, 0], x, w, dy, km, geom) for t in (13, 18)]
        assert torch.equal(got[0], got[1]), (which, stride, cin, "tile 18 differs from tile 13")


def _pass_call(which, a, x, w, dy, km, geom):
    """One forward or dgrad op call under algo `a` with the map's own plan."""
    if which == "fwd":
        order, segs = pass_plan(km, "fwd", a, geom, x.feats.dtype)
        return ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, order, None, segs, [])
    order_t, segs_t = pass_plan(km, "dgrad", a, geom, x.feats.dtype)
    return ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t, segs_t)


@needs_cuda
@pytest.mark.parametrize("cin,cout", [(8, 64), (16, 8), (24, 32), (32, 16), (32, 40), (40, 24)])
@pytest.mark.parametrize("k,stride", [(3, 1), (2, 2), (4, 1)])
def test_packed_offsets_real_scan(cin, cout, k, stride):
    """At red <= 32 channels (the forward's Cin, dgrad's Cout) the wgmma tile 13 packs 2, 4 or 8
    offsets into one 64-deep K step (csrc/cuda/conv_wgmma.cu PACK): K rows of offset list
    entries j, j + 1, ... side by side, weights likewise, a tail step with fewer entries.
    Forward and dgrad on a real crop, plain (step plan), mask-split (entries listed per launch)
    and split-K, against the fp64 gather reference into NaN-poisoned memory; 40 channels is the
    unpacked neighbour.  A tile whose offset count is no multiple of P ends on a step with fewer
    entries; a 4x4x4 kernel lists up to 64 offsets."""
    geom = torchsp.kmap.ConvGeometry(k, stride)
    x, km, out, w, dy, ref_map, want_y, want_dx = real_scan_layer(lidar_crop().cuda(), geom, cin, cout,
                                                                  torch.float16)
    for a in ([0, 13, 0, 0], [0, 13, 2, 0], [3, 13, 3, 0]):
        _check_pass(x, w, dy, km, geom, a, want_y, want_dx, (a, cin, cout))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cin,cout", [(64, 32), (32, 64), (96, 24), (16, 16), (32, 32), (8, 40)])
def test_narrow_columns_real_scan(cin, cout, dtype):
    """At n <= 32 produced channels (the forward's Cout, dgrad's Cin) tile 13 runs 32-column tiles
    on m64n32 wgmma (csrc/cuda/conv_wgmma.cu BN = 32): the forward's weights in the 64-byte
    swizzle (wg_desc_sw64_of_lo), dgrad's K-major, packed steps at red <= 32 and one or two
    64-deep chunks a step above (96); 24, 16 and 8 columns leave part of the tile past n.  Tile 0
    takes it where the pass has more than 8 offsets (conv.cu resolve_tile).  Forward and dgrad,
    fp16 and bf16, submanifold 3x3x3 and stride-2 K=2, plain (step plan), mask splits (their
    epilogues add partial sums) and split-K, against the fp64 gather reference into
    NaN-poisoned memory."""
    c = lidar_crop().cuda()
    for geom in (torchsp.kmap.ConvGeometry(3), torchsp.kmap.ConvGeometry(2, 2)):
        x, km, out, w, dy, ref_map, want_y, want_dx = real_scan_layer(c, geom, cin, cout, dtype)
        for a in ([0, 0, 0, 0], [0, 13, 0, 0], [0, 13, 2, 0], [3, 13, 3, 0]):
            _check_pass(x, w, dy, km, geom, a, want_y, want_dx, (a, cin, cout, geom.kernel_size))


@needs_cuda
@pytest.mark.parametrize("cin,cout", [(64, 64), (72, 136), (128, 256)])
def test_ws_tiles_whole_scan(cin, cout):
    """The warp-specialized tiles 14, 15, 16 and 17 (conv_wgmma_ws.cu: producer warps read each
    offset's map entries once, tile buffers and barriers handed between producers and consumers, a
    tile counter that hands a persistent grid its tiles, every consumer warp arriving on each stage
    it leaves; the ping-pong tiles' consumer warpgroups taking turns, each on its own tiles, tile 16
    above 128 produced channels and tile 17 above 64 in column tiles of 128 and 64, partial at
    Cout = 136, whose weight boxes (tensor-map copies of w) reach past Cin = 72 and Cout = 136 and
    arrive zero-filled) on the whole sweep at 0.2 m (67k voxels, 525 row tiles, more than the 132
    SMs: the blocks take tiles from the counter).
    Forward and dgrad, as a plain pass, as segmented passes (mask splits S = 2 add partial
    sums; hybrid t = 1) and split-K (S = 3: three runs per tile in the counter's order), against
    the fp64 gather reference, and bitwise equal run to run.
    (Builds without sm_90a run the mma.sync fallback here: the same assertions hold.)"""
    c = crop_voxels(load_lidar(), lo=(-1e4,) * 3, hi=(1e4,) * 3, voxel=0.2).cuda()
    assert c.shape[0] > 60000
    dtype = torch.float16
    geom = torchsp.kmap.ConvGeometry(3)
    x = torchsp.SparseTensor(randn(c.shape[0], cin, dtype=dtype, device="cuda", seed=1), c)
    km = torchsp.kmap.get_kernel_map(x, geom)[0]
    w = randn(27, cin, cout, dtype=dtype, device="cuda", seed=2, scale=0.1)
    dy = randn(c.shape[0], cout, dtype=dtype, device="cuda", seed=3)
    want_y = ref.gather_conv(x.feats, km.nbmap, w)  # fp64 on the GPU
    want_dx = ref.gather_conv(dy, km.nbmap_t, w.transpose(1, 2))
    for tile in (14, 15, 16, 17):
        for a in ([0, tile, 0, 0], [0, tile, 2, 0], [2, tile, 0, 1], [3, tile, 3, 0]):
            _check_pass(x, w, dy, km, geom, a, want_y, want_dx, a)


def _scan_pass_case(voxel, c, device="cuda", dtype=torch.float16):
    """The whole lidar sweep at `voxel` m, a c -> c submanifold 3x3x3 layer on it (features, weight
    and dy from fixed seeds) and its fp64 gather references: (x, km, w, dy, want_y, want_dx)."""
    coords = crop_voxels(load_lidar(), lo=(-1e4,) * 3, hi=(1e4,) * 3, voxel=voxel).to(device)
    x = torchsp.SparseTensor(randn(coords.shape[0], c, dtype=dtype, device=device, seed=1), coords)
    km = torchsp.kmap.get_kernel_map(x, torchsp.kmap.ConvGeometry(3))[0]
    w = randn(27, c, c, dtype=dtype, device=device, seed=2, scale=0.05)
    dy = randn(coords.shape[0], c, dtype=dtype, device=device, seed=3)
    want_y = ref.gather_conv(x.feats, km.nbmap, w)  # fp64, on `device`
    want_dx = ref.gather_conv(dy, km.nbmap_t, w.transpose(1, 2))
    return x, km, w, dy, want_y, want_dx


@needs_cuda
@pytest.mark.parametrize("voxel,c,tile", [(0.4, 128, 16), (0.8, 128, 17), (0.8, 256, 16), (0.8, 128, 15),
                                          (0.8, 256, 14)])
def test_pingpong_refined_plan_few_tiles(voxel, c, tile):
    """The ping-pong tiles on a refined step plan (a schedule, longest tiles first) of a pass with
    more tiles than the persistent grid's G blocks but fewer than 2 G (on a 132-SM H100: the whole
    sweep at 0.4 m, 218 row tiles; at 0.8 m, 83 row tiles in two 64- or 128-column tiles), where
    each block takes schedule positions b and 2 G - 1 - b first (csrc/cuda/conv_wgmma_ws.cu,
    `snake`), and tiles 14 and 15 with one tile per block (83 row tiles): such passes never read
    the tile counter, and nothing zeroes it (`counted`).  Forward and dgrad against the fp64
    gather reference into NaN-poisoned memory, and bitwise equal to the plain plan and the bare
    mask order (the same products per row, in the same order)."""
    dtype = torch.float16
    x, km, w, dy, want_y, want_dx = _scan_pass_case(voxel, c)
    n = x.coords.shape[0]
    plain, plain_t = km.order, km.order_t
    fine, fine_t = torchsp.kmap.refined_plan(km.nbmap, plain), torchsp.kmap.refined_plan(km.nbmap_t, plain_t)
    assert not torch.equal(fine, plain)
    a = [0, tile, 0, 0]
    outs = []
    for o, ot in ((fine, fine_t), (plain, plain_t), (plain[:n].clone(), plain_t[:n].clone())):
        _poison_cache()
        y = ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, o, ot)
        _poison_cache()
        dx = ops.conv_dgrad(dy, w, km.nbmap_t, a, ot)
        outs.append((y, dx))
    y, dx = outs[0]
    assert rel_err(y, want_y) <= TOL[dtype], rel_err(y, want_y)
    assert rel_err(dx, want_dx) <= TOL[dtype], rel_err(dx, want_dx)
    for y2, dx2 in outs[1:]:
        assert torch.equal(y, y2) and torch.equal(dx, dx2)


@needs_cuda
def test_ws_tiles_many_launches():
    """Tiles 14-17 take their tiles from a counter: the stream's own (csrc/shim_cuda.cpp
    stream_counter), zero at each launch because the launch before put it back to zero when its
    last taker left (csrc/cuda/conv_wgmma_ws.cu ws_leave), with no memset.  81 segments
    (each offset alone, over each third of the mask-ordered rows: every (row, offset) pair summed
    once), so ~80 launches per pass, each of ~175 row tiles, more than the persistent grid's
    blocks, so the counter hands out tiles.  Whole sweep at 0.2 m (67k voxels), forward and dgrad
    against the fp64 gather reference: a counter left at a previous launch's count would skip
    that launch's tiles (poisoned rows), a shared one race."""
    c = crop_voxels(load_lidar(), lo=(-1e4,) * 3, hi=(1e4,) * 3, voxel=0.2).cuda()
    geom = torchsp.kmap.ConvGeometry(3)
    x = torchsp.SparseTensor(randn(c.shape[0], 64, dtype=torch.float16, device="cuda", seed=1), c)
    km = torchsp.kmap.get_kernel_map(x, geom)[0]
    w = randn(27, 64, 64, dtype=torch.float16, device="cuda", seed=2, scale=0.1)
    dy = randn(c.shape[0], 64, dtype=torch.float16, device="cuda", seed=3)
    want_y = ref.gather_conv(x.feats, km.nbmap, w)  # fp64 on the GPU
    want_dx = ref.gather_conv(dy, km.nbmap_t, w.transpose(1, 2))
    n = c.shape[0]
    assert n // 3 > 132 * 128, n  # each segment has more row tiles than an H100 has SMs
    segs = [v for k in range(27) for j in range(3) for v in (j * n // 3, (j + 1) * n // 3 - j * n // 3, 1 << k, 0)]
    order, order_t = torchsp.kmap.mask_order(km.nbmap), torchsp.kmap.mask_order(km.nbmap_t)
    for tile in (14, 15, 16, 17):
        a = [0, tile, 0, 0]
        _poison_cache()
        y = ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, order, order_t, segs, segs)
        _poison_cache()
        dx = ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t, segs)
        assert rel_err(y, want_y) <= TOL[torch.float16], (tile, rel_err(y, want_y))
        assert rel_err(dx, want_dx) <= TOL[torch.float16], (tile, rel_err(dx, want_dx))


@needs_cuda
@pytest.mark.parametrize("tile,c", [(15, 64), (16, 128)])
def test_ws_tiles_stream_counters(tile, c):
    """The tile counter of tiles 14-17 is kept per device and stream and left zero by each launch
    (csrc/shim_cuda.cpp stream_counter): passes on the default stream back to back, on two side
    streams at once (no synchronisation between them: each stream's passes take tiles from its own
    counter while the other's run), and captured into a CUDA graph (captured passes keep a counter
    in their workspace: a graph may replay on another stream) replayed between eager passes.
    Whole sweep at 0.2 m (67k voxels, ~525 row tiles: the blocks take tiles from the counter),
    forward and dgrad against the fp64 gather reference into NaN-poisoned memory, and bitwise
    equal to each other: a counter shared between streams would hand one pass's tiles to the
    other, one not put back to zero would skip the next launch's tiles."""
    dtype = torch.float16
    x, km, w, dy, want_y, want_dx = _scan_pass_case(0.2, c)
    assert x.coords.shape[0] > 60000
    a = [0, tile, 0, 0]
    order, order_t = km.order, km.order_t

    def run():
        return (ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, order, order_t),
                ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t))

    outs = []
    for _ in range(3):  # the default stream, back to back
        _poison_cache()
        outs.append(run())
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # NaN in the blocks the stream's outputs will take
            torch.full((6 * x.feats.numel() // 2 + (1 << 20),), float("nan"), device="cuda")
    torch.cuda.synchronize()
    side = [[], []]
    for _ in range(3):  # both side streams at once, their launches interleaved
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                side[i].append(run())
    torch.cuda.synchronize()
    outs += side[0] + side[1]
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm-up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            captured = run()
    torch.cuda.synchronize()
    for _ in range(2):
        _poison_cache()
        for t in captured:
            t.fill_(float("nan"))
        eager = run()  # the default stream's counter, between replays
        g.replay()
        torch.cuda.synchronize()
        outs += [eager, tuple(t.clone() for t in captured)]
    y, dx = outs[0]
    assert rel_err(y, want_y) <= TOL[dtype], rel_err(y, want_y)
    assert rel_err(dx, want_dx) <= TOL[dtype], rel_err(dx, want_dx)
    for i, (y2, dx2) in enumerate(outs[1:]):
        assert torch.equal(y, y2) and torch.equal(dx, dx2), i


@needs_cuda
def test_stream_counter_only_for_counted_passes():
    """The shim looks up its stream's tile counter (a cudaStreamIsCapturing query and a lock) only
    for a pass whose blocks take tiles from it (tsp_conv_cuda_counts): never for tile 13 at 64
    channels, once per pass for tile 15's counted sweep, which launches no memset (the stream's
    counter is zero already).  Read from torch.profiler's CUDA runtime events (skipped where it
    records none); both passes against the fp64 gather reference into NaN-poisoned memory."""
    from torch.profiler import ProfilerActivity, profile
    x, km, w, dy, want_y, want_dx = _scan_pass_case(0.2, 64)
    order, order_t = km.order, km.order_t

    def passes(a):
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, order, order_t)  # warm: lazy setup
        ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t)
        torch.cuda.synchronize()
        _poison_cache()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            y = ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, a, a, a, order, order_t)
            dx = ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t)
            torch.cuda.synchronize()
        assert rel_err(y, want_y) <= TOL[torch.float16], (a, rel_err(y, want_y))
        assert rel_err(dx, want_dx) <= TOL[torch.float16], (a, rel_err(dx, want_dx))
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]

    names = passes([0, 13, 0, 0])
    if not any(n.startswith("cudaLaunchKernel") for n in names):
        pytest.skip("torch.profiler records no CUDA runtime calls here")
    assert names.count("cudaStreamIsCapturing") == 0, names
    names = passes([0, 15, 0, 0])  # ~525 row tiles: the blocks take tiles from the counter
    assert names.count("cudaStreamIsCapturing") == 2, names
    assert not any(n.startswith("cudaMemset") for n in names), names


@needs_cuda
@pytest.mark.parametrize("tile,wtile", [(15, 15), (16, 12)])
def test_wgmma_sources_past_32_bit_offsets(tile, wtile):
    """Tiles 14-17 and the wgmma wgrad tiles address the rows they gather in 32-bit element
    offsets (csrc/cuda/conv_wgmma_util.cuh wg_elem_addr16), so tsp_conv_wgmma_ws_check and
    wgmma_wgrad_takes hand a pass whose source holds 2^32 - 64 elements or more to the mma.sync
    kernels.  One source of 2^22 + 256 rows x 1024 channels (2^32 + 2^18 elements, 8.6 GB of
    fp16), NaN except the rows a one-offset map gathers: its last 128 rows, whose offsets pass
    2^32 (wrapped they would land on NaN rows 128-255), and its first 64; 64 map rows absent.
    The forward (x = the source, 1024 -> 64 channels), dgrad (dy = the source, 64 <- 1024) and
    wgrad (x = the source; row chunks and pair slots) against fp64 products of the gathered
    rows."""
    need = (2**22 + 256) * 1024 * 2 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need >> 30} GiB of free GPU memory")
    rows, c = 2**22 + 256, 1024
    src = torch.full((rows, c), float("nan"), dtype=torch.float16, device="cuda")
    src[-128:] = randn(128, c, dtype=torch.float16, device="cuda", seed=1)
    src[:64] = randn(64, c, dtype=torch.float16, device="cuda", seed=2)
    q = torch.cat([torch.arange(rows - 128, rows), torch.arange(64), torch.full((64,), -1)]).to(torch.int32)
    nbmap = q.view(-1, 1).cuda()  # [256, 1]: output row r gathers source row q[r]
    w = randn(1, c, 64, dtype=torch.float16, device="cuda", seed=3, scale=0.05)
    got = src[q.clamp(min=0).long().cuda()].double() * (nbmap >= 0).double()
    want_y = got @ w[0].double()
    a = [0, tile, 0, 0]
    order = torchsp.kmap.mask_order(nbmap)
    # the forward's transposed map (source row -> output row) is all -1 but for the gathered rows
    nbmap_t = torch.full((rows, 1), -1, dtype=torch.int32, device="cuda")
    nbmap_t[q[q >= 0].long().cuda(), 0] = torch.nonzero(q >= 0).view(-1).to(torch.int32).cuda()
    _poison_cache()
    y = ops.conv_fwd(src, w, nbmap, nbmap_t, a, a, a, order, None)
    assert y.shape == (256, 64) and rel_err(y, want_y) <= TOL[torch.float16], rel_err(y, want_y)
    # dgrad: dx [256, 64] = sum over the map of dy[q] @ w^T, with dy = src (1024 output channels)
    w_t = randn(1, 64, c, dtype=torch.float16, device="cuda", seed=4, scale=0.05)  # [V, c_in, c_out]
    want_dx = got @ w_t[0].double().T
    _poison_cache()
    dx = ops.conv_dgrad(src, w_t, nbmap, a, order)
    assert dx.shape == (256, 64) and rel_err(dx, want_dx) <= TOL[torch.float16], rel_err(dx, want_dx)
    # wgrad: dw [1, 1024, 64] = sum over the map's pairs of x[q]^T dy[r]
    dy = randn(256, 64, dtype=torch.float16, device="cuda", seed=5)
    want_dw = got.T @ dy.double()
    for aw in ([0, wtile, 0, 0], [1, wtile, 0, 0]):
        _poison_cache()
        dw = ops.conv_wgrad(src, dy, nbmap, aw)
        assert dw.shape == (1, c, 64) and rel_err(dw[0], want_dw) <= TOL[torch.float16], (aw, rel_err(dw[0], want_dw))


@needs_cuda
@pytest.mark.parametrize("tile", [15, 16])
def test_ws_tiles_first_cuda_call_of_a_thread(tile):
    """A host thread whose first CUDA work is a warp-specialized pass: autograd's device thread
    in a backward is one.  Their weight tensor maps are made by a driver call, which needs a
    current context, and torch's device guard skips cudaSetDevice when the device already is the
    thread's, so the thread has none yet (H100, 2026-11-26: a bench whose first layer was
    C = 128 failed in conv_dgrad with the encoder's error; csrc/cuda/conv_wgmma_ws.cu
    ws_weight_map now makes the primary context current and encodes again).  The ops run first
    on this thread, so the new thread's outputs come from the caching allocator's pool without
    a cudaMalloc (which would make the context current); dgrad first, then the forward, against
    the fp64 gather reference."""
    import threading

    c = lidar_crop().cuda()
    x = randn(c.shape[0], 128, dtype=torch.float16, device="cuda", seed=1)
    w = randn(27, 128, 128, dtype=torch.float16, device="cuda", seed=2, scale=0.05)
    dy = randn(c.shape[0], 128, dtype=torch.float16, device="cuda", seed=3)
    km = torchsp.kmap.get_kernel_map(torchsp.SparseTensor(x, c), torchsp.kmap.ConvGeometry(3))[0]
    a = [0, tile, 0, 0]
    ops = torch.ops.torchsp
    want_dx = ref.gather_conv(dy, km.nbmap_t, w.transpose(1, 2))
    want_y = ref.gather_conv(x, km.nbmap, w)
    ops.conv_dgrad(dy, w, km.nbmap_t, a, km.order_t)  # the pool holds blocks of these sizes now
    ops.conv_fwd(x, w, km.nbmap, km.nbmap_t, a, a, a, km.order, km.order_t)
    torch.cuda.synchronize()
    got = {}

    def work():
        try:
            got["dx"] = ops.conv_dgrad(dy, w, km.nbmap_t, a, km.order_t)
            got["y"] = ops.conv_fwd(x, w, km.nbmap, km.nbmap_t, a, a, a, km.order, km.order_t)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below, on the test's thread
            got["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in got, got.get("error")
    assert rel_err(got["dx"], want_dx) <= TOL[torch.float16], rel_err(got["dx"], want_dx)
    assert rel_err(got["y"], want_y) <= TOL[torch.float16], rel_err(got["y"], want_y)


@needs_cuda
@pytest.mark.parametrize("tile", [15, 16, 17])
def test_ws_tiles_weight_map_memo(tile):
    """The warp-specialized passes remember the tensor maps of w they encoded (per host thread,
    8 of them, keyed by w's address, dims and box: csrc/cuda/conv_wgmma_ws.cu ws_map_lookup).  A
    key that missed a field would hand a pass another weight's map.  So, each pass against the
    fp64 gather reference: ten weights of one shape, twice round (more keys than the 8 slots, so
    entries are evicted and encoded again); dgrad on a weight whose forward map is remembered
    (one address and dims, another box except at tile 17's 64 columns, where the two encodings
    are the same); and two views at one address with different dims (w [27, 128, 128] and its
    first 27 x 128 x 64 elements as [27, 128, 64]), alternating, so both are found there."""
    c = lidar_crop().cuda()
    x = randn(c.shape[0], 128, dtype=torch.float16, device="cuda", seed=1)
    dy = randn(c.shape[0], 128, dtype=torch.float16, device="cuda", seed=3)
    km = torchsp.kmap.get_kernel_map(torchsp.SparseTensor(x, c), torchsp.kmap.ConvGeometry(3))[0]
    a = [0, tile, 0, 0]
    ops = torch.ops.torchsp
    ws = [randn(27, 128, 128, dtype=torch.float16, device="cuda", seed=10 + i, scale=0.05) for i in range(10)]
    want = [ref.gather_conv(x, km.nbmap, w) for w in ws]
    for _ in range(2):
        for i, w in enumerate(ws):
            y = ops.conv_fwd(x, w, km.nbmap, km.nbmap_t, a, a, a, km.order, km.order_t)
            assert rel_err(y, want[i]) <= TOL[torch.float16], (i, rel_err(y, want[i]))
    w = ws[3]
    dx = ops.conv_dgrad(dy, w, km.nbmap_t, a, km.order_t)
    want_dx = ref.gather_conv(dy, km.nbmap_t, w.transpose(1, 2))
    assert rel_err(dx, want_dx) <= TOL[torch.float16], rel_err(dx, want_dx)
    narrow = w.reshape(-1)[: 27 * 128 * 64].view(27, 128, 64)
    assert narrow.data_ptr() == w.data_ptr()
    want_narrow = ref.gather_conv(x, km.nbmap, narrow)
    for _ in range(2):
        y = ops.conv_fwd(x, narrow, km.nbmap, km.nbmap_t, a, a, a, km.order, km.order_t)
        assert y.shape == (c.shape[0], 64) and rel_err(y, want_narrow) <= TOL[torch.float16], rel_err(y, want_narrow)
        y = ops.conv_fwd(x, w, km.nbmap, km.nbmap_t, a, a, a, km.order, km.order_t)
        assert rel_err(y, want[3]) <= TOL[torch.float16], rel_err(y, want[3])


@needs_cuda
@pytest.mark.parametrize("cin,cout,tile", [(64, 64, 13), (128, 128, 12), (256, 256, 15), (72, 136, 12)])
def test_wgrad_offset_groups_whole_scan(cin, cout, tile):
    """wgrad over pair slots (dataflow 1) on the whole sweep at 0.2 m (67k voxels, 3x3x3), where
    every offset gets a group of blocks of its own (csrc/cuda/conv_wgrad_pairs.cuh: offset k's
    64-pair slabs dealt round-robin to B_k blocks, one partial slot per block, summed in slot
    order): 27 offsets against 132-264 slots per tile, from a few hundred to ~1000 slabs per
    group, so each block streams hundreds of slabs B_k apart through its ring (the first 3 AHEAD
    filled before its loop, the rest copied in it: conv_wgmma_wgrad.cu product_stream) and
    offsets' last slabs are partial.  split 1 and 2 (twice the slots), the pair list built in the
    call and passed in (cached; without and with its input rows), against the fp64 gather
    reference, in NaN-poisoned memory, and bitwise equal run to run."""
    c = crop_voxels(load_lidar(), lo=(-1e4,) * 3, hi=(1e4,) * 3, voxel=0.2).cuda()
    assert c.shape[0] > 60000
    dtype = torch.float16
    x = torchsp.SparseTensor(randn(c.shape[0], cin, dtype=dtype, device="cuda", seed=1), c)
    km = torchsp.kmap.get_kernel_map(x, torchsp.kmap.ConvGeometry(3))[0]
    dy = randn(c.shape[0], cout, dtype=dtype, device="cuda", seed=3)
    want = ref.gather_wgrad(x.feats, km.nbmap, dy)  # fp64 on the GPU
    pairs, starts = torchsp.kmap.map_pairs(km.nbmap)
    with_rows = torchsp.kmap.map_pairs(km.nbmap, bounded=True, rows=True)
    for a in ([1, tile, 0, 0], [1, tile, 2, 0], [0, 0, 0, 0]):
        _poison_cache()
        dw = ops.conv_wgrad(x.feats, dy, km.nbmap, a)
        assert rel_err(dw, want) <= TOL[dtype], (a, rel_err(dw, want))
        _poison_cache()
        assert torch.equal(dw, ops.conv_wgrad(x.feats, dy, km.nbmap, a, pairs, starts)), a
        _poison_cache()
        assert torch.equal(dw, ops.conv_wgrad(x.feats, dy, km.nbmap, a, *with_rows)), (a, "rows")
        assert torch.equal(dw, ops.conv_wgrad(x.feats, dy, km.nbmap, a)), (a, "not deterministic")


@needs_cuda
@pytest.mark.parametrize("case", ["plane", "k5_pieces", "scan_groups"])
def test_wgrad_pair_slots_edges(case):
    """wgrad over pair slots (csrc/cuda/conv_wgmma_wgrad.cu): partial slots per offset, added in
    slot order by a second kernel that also writes the zero dw[k] of offsets without pairs.
    Cases: one z-plane (18 of 27 offsets have no pair), a 5x5x5 kernel on ~280 voxels (more
    offsets with pairs than slots: equal pieces spanning offsets), the whole sweep at 0.2 m
    (offset groups); tiles 13, 12 and 15.  Against the fp64 gather reference into NaN-poisoned
    memory (the empty offsets exactly zero), bitwise stable over repeated calls and with the
    cached pair list (without and with its input rows), and bitwise equal to the same call
    replayed from a CUDA graph."""
    if case == "plane":
        c = plane_coords(-20, 20, 3)
        geom, shapes = torchsp.kmap.ConvGeometry(3), [(64, 64, 13), (128, 128, 12)]
    elif case == "k5_pieces":
        c = random_coords(300, span=6, batches=1, seed=5)
        geom, shapes = torchsp.kmap.ConvGeometry(5), [(64, 64, 13), (256, 256, 15)]
    else:
        c = crop_voxels(load_lidar(), lo=(-1e4,) * 3, hi=(1e4,) * 3, voxel=0.2)
        geom, shapes = torchsp.kmap.ConvGeometry(3), [(64, 64, 13), (256, 256, 15)]
    c = c.cuda()
    dtype = torch.float16
    for cin, cout, tile in shapes:
        x = torchsp.SparseTensor(randn(c.shape[0], cin, dtype=dtype, device="cuda", seed=1), c)
        km = torchsp.kmap.get_kernel_map(x, geom)[0]
        dy = randn(km.nbmap.shape[0], cout, dtype=dtype, device="cuda", seed=3)
        want = ref.gather_wgrad(x.feats, km.nbmap, dy)
        if case == "plane":
            assert int((want.abs().sum((1, 2)) == 0).sum()) == 18
        if case == "k5_pieces":  # slots: ceil(rows x V / 1024) (WW_MIN_PIECE); offsets with pairs exceed them
            assert int((km.nbmap >= 0).any(0).sum()) > -(-km.nbmap.shape[0] * 125 // 1024)
        a = [1, tile, 0, 0]
        _poison_cache()
        dw = ops.conv_wgrad(x.feats, dy, km.nbmap, a)
        assert rel_err(dw, want) <= TOL[dtype], (case, tile, rel_err(dw, want))
        if case == "plane":  # exactly the empty offsets are zero
            assert torch.equal(dw == 0, want == 0), (case, tile)
        for _ in range(3):
            _poison_cache()
            assert torch.equal(dw, ops.conv_wgrad(x.feats, dy, km.nbmap, a)), (case, tile, "not deterministic")
        pairs, starts = torchsp.kmap.map_pairs(km.nbmap)
        assert torch.equal(dw, ops.conv_wgrad(x.feats, dy, km.nbmap, a, pairs, starts)), (case, tile)
        pairs, starts = torchsp.kmap.map_pairs(km.nbmap, rows=True)
        eager = ops.conv_wgrad(x.feats, dy, km.nbmap, a, pairs, starts)
        assert torch.equal(dw, eager), (case, tile, "rows")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ops.conv_wgrad(x.feats, dy, km.nbmap, a, pairs, starts)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops.conv_wgrad(x.feats, dy, km.nbmap, a, pairs, starts)
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), (case, tile, "graph replay differs from the eager call")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cin,cout", [(32, 32), (64, 32), (40, 24), (32, 16), (96, 8)])
def test_wgrad_narrow_columns_real_scan(cin, cout, dtype):
    """wgrad's 64 x 64 wgmma tile (13) where c_out fills half a column tile or less (its
    channels past c_out copied as zeros, csrc/cuda/conv_wgmma_wgrad.cu ww_load): over pair slots
    (dataflow 1, tile 0 where both channel counts are >= 32, and tile 13 asked for) and in row
    chunks (dataflow 0, tile 13), on a real crop (submanifold 3x3x3 and stride-2 K=2), c_in a whole
    or partial 64-row tile, against the fp64 gather reference into NaN-poisoned memory, the cached
    pair list (without and with its input rows) bitwise equal to the list built in the call, and
    bitwise stable run to run."""
    c = lidar_crop().cuda()
    for geom in (torchsp.kmap.ConvGeometry(3), torchsp.kmap.ConvGeometry(2, 2)):
        x = torchsp.SparseTensor(randn(c.shape[0], cin, dtype=dtype, device="cuda", seed=1), c)
        km = torchsp.kmap.get_kernel_map(x, geom)[0]
        dy = randn(km.nbmap.shape[0], cout, dtype=dtype, device="cuda", seed=3)
        want = ref.gather_wgrad(x.feats, km.nbmap, dy)  # fp64 on the GPU
        pairs, starts = torchsp.kmap.map_pairs(km.nbmap)
        with_rows = torchsp.kmap.map_pairs(km.nbmap, rows=True)
        for a in ([0, 0, 0, 0], [1, 13, 0, 0], [1, 13, 2, 0], [0, 13, 0, 0]):
            _poison_cache()
            dw = ops.conv_wgrad(x.feats, dy, km.nbmap, a)
            assert dw.shape == (geom.volume, cin, cout)
            assert rel_err(dw, want) <= TOL[dtype], (geom.kernel_size, a, rel_err(dw, want))
            _poison_cache()
            if a[0] == 1:
                assert torch.equal(dw, ops.conv_wgrad(x.feats, dy, km.nbmap, a, pairs, starts)), a
                _poison_cache()
                assert torch.equal(dw, ops.conv_wgrad(x.feats, dy, km.nbmap, a, *with_rows)), (a, "rows")
            assert torch.equal(dw, ops.conv_wgrad(x.feats, dy, km.nbmap, a)), (a, "not deterministic")


@needs_cuda
@pytest.mark.parametrize("tile", [13, 12, 15])
def test_wgrad_pair_rows_read_defensively(tile):
    """A pair list with rows (tsp_conv_problem.pair_rows) is read as the kernel reads a list
    without: an input row outside [0, N_in) or negative counts as absent, never as an address.
    Rows of the whole sweep's list at 0.2 m (submanifold 3x3x3; ~40 slabs a slot, so most pass
    through the ring's copies in the slab loop, not only its first fill) replaced by N_in,
    N_in + 1000, INT32_MAX and -7 for every 5th pair must give the fp64 reference of the map with
    those entries absent, and the untouched list the reference of the map itself; NaN-poisoned
    memory."""
    c = crop_voxels(load_lidar(), lo=(-1e4,) * 3, hi=(1e4,) * 3, voxel=0.2).cuda()
    cin, cout = {13: (64, 64), 12: (128, 128), 15: (128, 256)}[tile]
    dtype = torch.float16
    x = torchsp.SparseTensor(randn(c.shape[0], cin, dtype=dtype, device="cuda", seed=1), c)
    km = torchsp.kmap.get_kernel_map(x, torchsp.kmap.ConvGeometry(3))[0]
    dy = randn(km.nbmap.shape[0], cout, dtype=dtype, device="cuda", seed=3)
    pairs, starts = torchsp.kmap.map_pairs(km.nbmap, rows=True)
    a = [1, tile, 0, 0]
    _poison_cache()
    dw = ops.conv_wgrad(x.feats, dy, km.nbmap, a, pairs, starts)
    assert rel_err(dw, ref.gather_wgrad(x.feats, km.nbmap, dy)) <= TOL[dtype]
    n_in, p = c.shape[0], pairs.shape[1]
    bad = pairs.clone()
    hit = torch.arange(0, p, 5, device="cuda")
    junk = torch.tensor([n_in, n_in + 1000, 2 ** 31 - 1, -7], dtype=torch.int32, device="cuda")
    bad[1, hit] = junk[torch.arange(hit.numel(), device="cuda") % 4]
    # the same entries absent in the reference's map: pair i is (q = pairs[0, i], offset k(i))
    k_of = torch.repeat_interleave(torch.arange(27, device="cuda"), (starts[1:] - starts[:-1]))
    nb = km.nbmap.clone()
    nb[pairs[0, hit].long(), k_of[hit]] = -1
    _poison_cache()
    got = ops.conv_wgrad(x.feats, dy, km.nbmap, a, bad, starts)
    assert rel_err(got, ref.gather_wgrad(x.feats, nb, dy)) <= TOL[dtype], rel_err(got, ref.gather_wgrad(x.feats, nb, dy))


@pytest.mark.parametrize("device,tile", [("cpu", 0)] + [pytest.param("cuda", t, marks=needs_cuda)
                                                          for t in (0, 3, 12, 13, 15)])
def test_misaligned_operands(device, tile):
    """feats and weight as contiguous views 2 bytes past a 16-byte boundary: the tensor-core
    kernels that need 16-byte aligned operands (wgmma's weight copy, tile 15's tensor map of w) must
    hand the call to a kernel that takes it, with the same result as the fp64 reference (the CPU
    case: the same views through the CPU kernels)."""
    c = lidar_crop().to(device)
    cin, cout, dtype = 64, 136, torch.float16
    geom = torchsp.kmap.ConvGeometry(3)
    fbuf = randn(c.shape[0] * cin + 1, dtype=dtype, device=device, seed=1)
    wbuf = randn(27 * cin * cout + 1, dtype=dtype, device=device, seed=2, scale=0.1)
    feats, w = fbuf[1:].view(c.shape[0], cin), wbuf[1:].view(27, cin, cout)
    assert feats.data_ptr() % 16 and w.data_ptr() % 16
    x = torchsp.SparseTensor(feats, c)
    km = torchsp.kmap.get_kernel_map(x, geom)[0]
    dy = randn(c.shape[0], cout, dtype=dtype, device=device, seed=3)
    a = [0, tile, 0, 0]
    if device == "cuda":
        _poison_cache()
    y = ops.conv_fwd(feats, w, km.nbmap, km.nbmap_t, a, a, a, km.order, km.order_t, [], [])
    dx = ops.conv_dgrad(dy, w, km.nbmap_t, a, km.order_t, [])
    dw = ops.conv_wgrad(feats, dy, km.nbmap, a)
    assert rel_err(y, ref.gather_conv(feats, km.nbmap, w)) <= TOL[dtype]
    assert rel_err(dx, ref.gather_conv(dy, km.nbmap_t, w.transpose(1, 2))) <= TOL[dtype]
    assert rel_err(dw, ref.gather_wgrad(feats, km.nbmap, dy)) <= TOL[dtype]


@needs_cuda
@pytest.mark.parametrize("name", list(EVERY))
@pytest.mark.parametrize("shape", ["dense_cube", "one_row", "odd_c3", "odd_c5", "c96", "c384"])
def test_dataflow_worst_cases(name, shape):
    """All 27 offsets present in most rows, one row, odd and wide channel counts."""
    if shape == "dense_cube":
        c = dense_cube(-4, 5)
    elif shape == "one_row":
        c = torch.tensor([[0, 3, -2, 7]], dtype=torch.int32)
    else:
        c = torch.unique(torch.cat([torch.zeros(700, 1, dtype=torch.long), torch.randint(-7, 7, (700, 3))], 1),
                         dim=0).int()
    cin, cout = {"odd_c3": (3, 5), "odd_c5": (5, 3), "c96": (96, 96), "c384": (384, 384)}.get(shape, (32, 48))
    dtype = torch.bfloat16
    x = torchsp.SparseTensor(randn(c.shape[0], cin, dtype=dtype, device="cuda", seed=1), c.cuda())
    w = randn(27, cin, cout, dtype=dtype, device="cuda", seed=2, scale=(27 * cin) ** -0.5)
    a = EVERY[name]
    _poison_cache()
    y = F.sparse_conv3d(x, w, 3, algo=(a, a, [0, 0, 0, 0]))
    km = torchsp.kmap.get_kernel_map(x, 3)[0]
    want = ref.gather_conv(x.feats.cpu(), km.nbmap.cpu().long(), w.cpu())
    assert torch.isfinite(y.feats).all()
    assert rel_err(y.feats, want) <= TOL[dtype]
    dy = randn(*y.feats.shape, dtype=dtype, device="cuda", seed=3)
    order_t, segs_t = pass_plan(km, "dgrad", a, torchsp.kmap.ConvGeometry(3))
    _poison_cache()
    dx = ops.conv_dgrad(dy, w, km.nbmap_t, a, order_t, segs_t)
    want_dx = ref.gather_conv(dy.cpu(), km.nbmap_t.cpu().long(), w.cpu().transpose(1, 2))
    assert rel_err(dx, want_dx) <= TOL[dtype]


@needs_cuda
def test_dataflow_nan_propagates():
    """A NaN input feature reaches exactly the outputs that read it, in every dataflow."""
    c = lidar_crop()[:3000].cuda()
    x = randn(c.shape[0], 32, dtype=torch.float16, device="cuda", seed=1)
    x[17, 5] = float("nan")
    st = torchsp.SparseTensor(x, c)
    w = randn(27, 32, 32, dtype=torch.float16, device="cuda", seed=2, scale=0.05)
    km = torchsp.kmap.get_kernel_map(st, 3)[0]
    readers = (km.nbmap == 17).any(1).cpu()
    for name, a in EVERY.items():
        y = F.sparse_conv3d(st, w, 3, algo=(a, a, [0, 0, 0, 0])).feats.cpu()
        assert torch.equal(torch.isnan(y).any(1), readers), name
