"""GPU kernels on small real and random inputs, for compute-sanitizer runs.

tools/gpu_session.sh runs this file under `compute-sanitizer --tool memcheck`
and `--tool racecheck`.  Each case also checks the GPU result against the CPU
kernels (float64 there), so a run is a correctness check as well; sizes are
small because the sanitizers slow kernels down by orders of magnitude.
"""

import pytest
import torch

import torchsp
from conftest import dense_cube, plane_coords

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _coords(n, seed, span=12, batches=2):
    g = torch.Generator().manual_seed(seed)
    c = torch.cat([torch.randint(0, batches, (n, 1), generator=g),
                   torch.randint(-span, span, (n, 3), generator=g)], 1)
    return torch.unique(c, dim=0).int()


@pytest.mark.parametrize("method", [0, 1])
@pytest.mark.parametrize("kernel,stride", [(3, 1), (2, 2), (3, 2), (5, 1)])
def test_maps_and_conv(method, kernel, stride):
    coords = _coords(700, seed=kernel * 10 + stride)
    feats = torch.randn(coords.shape[0], 24, dtype=torch.float64)
    w = torch.randn(kernel ** 3, 24, 40, dtype=torch.float64)
    saved = torchsp.kmap.DEFAULT_METHOD
    torchsp.kmap.DEFAULT_METHOD = method
    try:
        ref = torchsp.functional.sparse_conv3d(torchsp.SparseTensor(feats, coords), w, kernel, stride=stride,
                                               algo=[0, 0, 0, 0])
        for dtype, tol in ((torch.float32, 5e-3), (torch.float16, 2e-2), (torch.bfloat16, 3e-2)):
            x = torchsp.SparseTensor(feats.to("cuda", dtype), coords.cuda())
            y = torchsp.functional.sparse_conv3d(x, w.to("cuda", dtype), kernel, stride=stride, algo=[0, 0, 0, 0])
            torch.cuda.synchronize()
            assert torch.equal(y.coords.cpu(), ref.coords)
            err = (y.feats.double().cpu() - ref.feats).norm() / ref.feats.norm()
            assert err < tol, (dtype, float(err))
    finally:
        torchsp.kmap.DEFAULT_METHOD = saved


def test_backward_passes():
    coords = _coords(600, seed=3)
    feats = torch.randn(coords.shape[0], 16, dtype=torch.float64)
    w = torch.randn(27, 16, 32, dtype=torch.float64)
    outs = []
    for dev in ("cpu", "cuda"):
        # detach: .to() returns feats itself on cpu/float64, which must stay a plain tensor
        f = feats.to(dev, torch.float32 if dev == "cuda" else torch.float64).detach().clone().requires_grad_()
        ww = w.to(dev, f.dtype).detach().clone().requires_grad_()
        y = torchsp.functional.sparse_conv3d(torchsp.SparseTensor(f, coords.to(dev)), ww, 3, algo=[0, 0, 0, 0])
        g = torch.linspace(-1, 1, y.feats.numel(), dtype=torch.float64).reshape(y.feats.shape)
        y.feats.backward(g.to(dev, f.dtype))
        outs.append((f.grad.double().cpu(), ww.grad.double().cpu()))
    for a, b in zip(outs[0], outs[1]):
        assert (a - b).norm() / a.norm() < 5e-3


def _tensor_core_case(seed, dtype=torch.float16):
    """A random 3x3x3 submanifold case, 40 -> 144 channels: the CUDA input, weight and output
    gradient in `dtype`, and the CPU float64 forward, dgrad and wgrad they must match."""
    coords = _coords(900, seed=seed)
    feats = torch.randn(coords.shape[0], 40, dtype=torch.float64)
    w = torch.randn(27, 40, 144, dtype=torch.float64) / 20
    x_cpu = torchsp.SparseTensor(feats, coords)
    ref = torchsp.functional.sparse_conv3d(x_cpu, w, 3, algo=[0, 0, 0, 0])
    g = torch.linspace(-1, 1, ref.feats.numel(), dtype=torch.float64).reshape(ref.feats.shape)
    km = torchsp.kmap.get_kernel_map(x_cpu, 3)[0]
    ref_dx = torch.ops.torchsp.conv_dgrad(g, w, km.nbmap_t, [0, 0, 0, 0], None)
    ref_dw = torch.ops.torchsp.conv_wgrad(feats, g, km.nbmap, [0, 0, 0, 0])
    x = torchsp.SparseTensor(feats.to("cuda", dtype), coords.cuda())
    return x, w.to("cuda", dtype), g.to("cuda", dtype), ref.feats, ref_dx, ref_dw


def _assert_close(y, dx, ref_y, ref_dx):
    torch.cuda.synchronize()
    assert (y.double().cpu() - ref_y).norm() / ref_y.norm() < 1e-2
    assert (dx.double().cpu() - ref_dx).norm() / ref_dx.norm() < 1e-2


@pytest.mark.parametrize("case", ["plane", "k5_pieces"])
def test_wgrad_pair_slots_edges(case):
    """wgrad over pair slots and their reduction kernel (which also zeroes the offsets without
    pairs): one z-plane (18 of 27 offsets empty, offset groups) and a 5x5x5 kernel on ~280 voxels
    (equal pieces across offsets), tiles 13 and 15, against the CPU float64 wgrad."""
    if case == "plane":
        coords = plane_coords(-8, 8, 2)
        kernel = 3
    else:
        coords = _coords(300, seed=5, span=6, batches=1)
        kernel = 5
    for c, tile in ((64, 13), (256, 15)):
        feats = torch.randn(coords.shape[0], c, dtype=torch.float64)
        g = torch.randn(coords.shape[0], c, dtype=torch.float64)
        km_cpu = torchsp.kmap.get_kernel_map(torchsp.SparseTensor(feats, coords), kernel)[0]
        ref_dw = torch.ops.torchsp.conv_wgrad(feats, g, km_cpu.nbmap, [0, 0, 0, 0])
        x = torchsp.SparseTensor(feats.to("cuda", torch.float16), coords.cuda())
        km = torchsp.kmap.get_kernel_map(x, kernel)[0]
        dw = torch.ops.torchsp.conv_wgrad(x.feats, g.to("cuda", torch.float16), km.nbmap, [1, tile, 0, 0])
        torch.cuda.synchronize()
        assert (dw.double().cpu() - ref_dw).norm() / ref_dw.norm() < 1e-2, (case, tile)
        if case == "plane":  # exactly the empty offsets are zero
            assert torch.equal(dw.cpu() == 0, ref_dw == 0), (case, tile)


@pytest.mark.parametrize("cout", [32, 24])
def test_wgrad_narrow_columns(cout):
    """wgrad's tile 13 (64 x 64) with half or three-eighths of its columns (c_out 32, 24) over a
    partial 40-of-64 row tile, in pair pieces and in row chunks, against the CPU float64 wgrad."""
    coords = _coords(900, seed=17)
    feats = torch.randn(coords.shape[0], 40, dtype=torch.float64)
    g = torch.randn(coords.shape[0], cout, dtype=torch.float64)
    km_cpu = torchsp.kmap.get_kernel_map(torchsp.SparseTensor(feats, coords), 3)[0]
    ref_dw = torch.ops.torchsp.conv_wgrad(feats, g, km_cpu.nbmap, [0, 0, 0, 0])
    x = torchsp.SparseTensor(feats.to("cuda", torch.float16), coords.cuda())
    km = torchsp.kmap.get_kernel_map(x, 3)[0]
    g16 = g.to("cuda", torch.float16)
    for a in ([1, 13, 0, 0], [0, 13, 0, 0]):
        dw = torch.ops.torchsp.conv_wgrad(x.feats, g16, km.nbmap, a)
        torch.cuda.synchronize()
        assert (dw.double().cpu() - ref_dw).norm() / ref_dw.norm() < 1e-2, a


@pytest.mark.parametrize("tile", [0, 2, 3, 7, 9, 12, 13, 14, 15, 16, 17, 18])
def test_tensor_core_tiles(tile):
    """Every tensor-core tile family (mma.sync 2/3, wgmma 7/9, swizzled 12/13/18 (18's dgrad, 40
    produced channels, reads the step plan through its ring) and warp-specialized 14/15, ping-pong
    16 (here two 128-column tiles) and 17 (64 columns) on sm_90a builds, else mma.sync; 0
    resolves to one of them)
    under the sanitizers: mask-sorted rows, a partial last tile, Cout > 128, fwd and dgrad; and
    wgrad on the same tile (12, 13, 15: conv_wgmma_wgrad.cu with partial 40-of-64 / 40-of-128
    row and 144-of-256 column tiles, in row chunks and in pair pieces, the pair list passed without
    and with its input rows, wild starts, and rows out of range; others mma.sync)."""
    x, w16, g16, ref_y, ref_dx, ref_dw = _tensor_core_case(seed=11)
    km = torchsp.kmap.get_kernel_map(x, 3)[0]
    a = [0, tile, 0, 0]
    y = torch.ops.torchsp.conv_fwd(x.feats, w16, km.nbmap, km.nbmap_t, a, a, a, km.order, km.order_t)
    dx = torch.ops.torchsp.conv_dgrad(g16, w16, km.nbmap_t, a, km.order_t)
    dw = torch.ops.torchsp.conv_wgrad(x.feats, g16, km.nbmap, a)
    dw_pieces = torch.ops.torchsp.conv_wgrad(x.feats, g16, km.nbmap, [1, tile, 0, 0])
    pairs, starts = torchsp.kmap.map_pairs(km.nbmap)  # cached pair list, then wild starts
    dw_cached = torch.ops.torchsp.conv_wgrad(x.feats, g16, km.nbmap, [1, tile, 0, 0], pairs, starts)
    wild = torch.arange(starts.shape[0], device="cuda", dtype=torch.int64).flip(0) * 97 - 500
    torch.ops.torchsp.conv_wgrad(x.feats, g16, km.nbmap, [1, tile, 0, 0], pairs, wild)
    with_rows, starts = torchsp.kmap.map_pairs(km.nbmap, bounded=True, rows=True)
    dw_rows = torch.ops.torchsp.conv_wgrad(x.feats, g16, km.nbmap, [1, tile, 0, 0], with_rows, starts)
    torch.ops.torchsp.conv_wgrad(x.feats, g16, km.nbmap, [1, tile, 0, 0], with_rows, wild)
    junk = with_rows.clone()  # input rows out of range (every 3rd) and the list's -1 tail as rows
    bad = torch.tensor([x.feats.shape[0], 2 ** 31 - 1, -9], dtype=torch.int32, device="cuda")
    n_bad = junk[1, ::3].numel()
    junk[1, ::3] = bad[torch.arange(n_bad, device="cuda") % 3]
    torch.ops.torchsp.conv_wgrad(x.feats, g16, km.nbmap, [1, tile, 0, 0], junk, starts)
    _assert_close(y, dx, ref_y, ref_dx)
    assert (dw.double().cpu() - ref_dw).norm() / ref_dw.norm() < 1e-2
    assert (dw_pieces.double().cpu() - ref_dw).norm() / ref_dw.norm() < 1e-2
    assert torch.equal(dw_cached, dw_pieces) and torch.equal(dw_rows, dw_pieces)


@pytest.mark.parametrize("tile", [14, 15, 16, 17])
def test_ws_tiles_many(tile):
    """The warp-specialized tiles (conv_wgmma_ws.cu) under the sanitizers with more tiles than
    SMs: 40 -> 64 channels on ~19k rows (~150 row tiles); the tile counter, tile buffers and
    their barriers; plain and split passes."""
    coords = _coords(20000, seed=17, span=24)
    feats = torch.randn(coords.shape[0], 40, dtype=torch.float64)
    w = torch.randn(27, 40, 64, dtype=torch.float64) / 20
    x_cpu = torchsp.SparseTensor(feats, coords)
    ref = torchsp.functional.sparse_conv3d(x_cpu, w, 3, algo=[0, 0, 0, 0])
    km_cpu = torchsp.kmap.get_kernel_map(x_cpu, 3)[0]
    g = torch.linspace(-1, 1, ref.feats.numel(), dtype=torch.float64).reshape(ref.feats.shape)
    ref_dx = torch.ops.torchsp.conv_dgrad(g, w, km_cpu.nbmap_t, [0, 0, 0, 0], None)
    x = torchsp.SparseTensor(feats.to("cuda", torch.float16), coords.cuda())
    w16, g16 = w.to("cuda", torch.float16), g.to("cuda", torch.float16)
    geom = torchsp.kmap.ConvGeometry(3)
    km = torchsp.kmap.get_kernel_map(x, geom)[0]
    assert (km.nbmap.shape[0] + 127) // 128 > 132
    for a in ([0, tile, 0, 0], [0, tile, 2, 0]):
        order, segs = torchsp.plan.pass_plan(km, "fwd", a, geom)
        order_t, segs_t = torchsp.plan.pass_plan(km, "dgrad", a, geom)
        y = torch.ops.torchsp.conv_fwd(x.feats, w16, km.nbmap, km.nbmap_t, a, a, a, order, order_t, segs,
                                       segs_t)
        dx = torch.ops.torchsp.conv_dgrad(g16, w16, km.nbmap_t, a, order_t, segs_t)
        _assert_close(y, dx, ref.feats, ref_dx)


def _run_wild_plans(x, w16, g16, km, a, seed):
    """Forward and dgrad of algo `a` with km's step plans overwritten by wild words (offset lists,
    counts, rows and map entries out of range) after each order's row part: the kernels must
    check every word they read (no access out of bounds; the sums are not checked)."""
    n, n_t = km.nbmap.shape[0], km.nbmap_t.shape[0]
    g = torch.Generator().manual_seed(seed)
    wild, wild_t = km.order.clone(), km.order_t.clone()
    for p, rows in ((wild, n), (wild_t, n_t)):
        p[rows:] = torch.randint(-3000, 3 * n, (p.shape[0] - rows,), generator=g, dtype=torch.int32).cuda()
    torch.ops.torchsp.conv_fwd(x.feats, w16, km.nbmap, km.nbmap_t, a, a, a, wild, wild_t)
    torch.ops.torchsp.conv_dgrad(g16, w16, km.nbmap_t, a, wild_t)
    torch.cuda.synchronize()


@pytest.mark.parametrize("tile,cout", [(3, 128), (13, 128), (13, 64), (15, 128), (16, 128), (17, 128), (18, 64)])
def test_step_plans(tile, cout):
    """Step plans (torchsp.kmap.tile_order: the order a CUDA map carries; refined_plan: a reused
    map's) under the sanitizers: the same sums, bitwise, as the bare mask order [N] (the tiles
    walk the same rows and offsets, in another grouping; tile 17 in two 64-column tiles per row
    tile, each finding its row tile through the refined plan's schedule; tile 18 at 64 produced
    channels reads the plan's entries through a ring of 12 columns, conv_wgmma.cu RING),
    and a plan whose records are overwritten with wild words (offset lists, counts, rows and map
    entries out of range) runs without an access out of bounds."""
    x, w16, g16, ref_y, ref_dx, _ = _tensor_core_case(seed=21)
    w16, g16 = w16[:, :, :cout].contiguous(), g16[:, :cout].contiguous()  # 128: tile 16 fits; 64: 18's ring
    ref_y = ref_y[:, :cout]
    km = torchsp.kmap.get_kernel_map(x, 3)[0]
    n, n_t = km.nbmap.shape[0], km.nbmap_t.shape[0]
    assert km.order.shape[0] > n and km.order_t.shape[0] > n_t  # step plans
    a = [0, tile, 0, 0]
    y = torch.ops.torchsp.conv_fwd(x.feats, w16, km.nbmap, km.nbmap_t, a, a, a, km.order, km.order_t)
    dx = torch.ops.torchsp.conv_dgrad(g16, w16, km.nbmap_t, a, km.order_t)
    bare, bare_t = km.order[:n].clone(), km.order_t[:n_t].clone()
    assert torch.equal(y, torch.ops.torchsp.conv_fwd(x.feats, w16, km.nbmap, km.nbmap_t, a, a, a, bare, bare_t))
    assert torch.equal(dx, torch.ops.torchsp.conv_dgrad(g16, w16, km.nbmap_t, a, bare_t))
    # the plans on the refined row order (a reused map's, torchsp.kmap.REFINE_AFTER): same sums
    fine, fine_t = (torchsp.kmap.refined_plan(km.nbmap, km.order), torchsp.kmap.refined_plan(km.nbmap_t, km.order_t))
    assert not torch.equal(fine, km.order)
    assert torch.equal(y, torch.ops.torchsp.conv_fwd(x.feats, w16, km.nbmap, km.nbmap_t, a, a, a, fine, fine_t))
    assert torch.equal(dx, torch.ops.torchsp.conv_dgrad(g16, w16, km.nbmap_t, a, fine_t))
    ref_dx = torch.ops.torchsp.conv_dgrad(g16.double().cpu(), w16.double().cpu(), km.nbmap_t.cpu(), [0, 0, 0, 0])
    _assert_close(y, dx, ref_y, ref_dx)
    _run_wild_plans(x, w16, g16, km, a, seed=tile)


def test_ring_refills():
    """Tile 18's ring of 12 columns refilled as the loader walks (conv_wgmma.cu RING) under the
    sanitizers: a dense 10^3 cube, 3x3x3, whose tiles mostly use all 27 offsets, 72 -> 64
    channels (two K chunks per offset), fwd and dgrad against the CPU float64 kernels and
    bitwise equal to tile 13."""
    coords = dense_cube(0, 10)
    feats = torch.randn(coords.shape[0], 72, dtype=torch.float64)
    w = torch.randn(27, 72, 64, dtype=torch.float64) / 40
    km_cpu = torchsp.kmap.get_kernel_map(torchsp.SparseTensor(feats, coords), 3)[0]
    gy = torch.linspace(-1, 1, coords.shape[0] * 64, dtype=torch.float64).reshape(-1, 64)
    ref_y = torch.ops.torchsp.conv_fwd(feats, w, km_cpu.nbmap, km_cpu.nbmap_t, [0, 0, 0, 0], [0, 0, 0, 0],
                                       [0, 0, 0, 0], None, None)
    ref_dx = torch.ops.torchsp.conv_dgrad(gy, w, km_cpu.nbmap_t, [0, 0, 0, 0], None)
    x = torchsp.SparseTensor(feats.to("cuda", torch.float16), coords.cuda())
    w16, g16 = w.to("cuda", torch.float16), gy.to("cuda", torch.float16)
    km = torchsp.kmap.get_kernel_map(x, 3)[0]
    out = {}
    for tile in (13, 18):
        a = [0, tile, 0, 0]
        out[tile] = (torch.ops.torchsp.conv_fwd(x.feats, w16, km.nbmap, km.nbmap_t, a, a, a, km.order, km.order_t),
                     torch.ops.torchsp.conv_dgrad(g16, w16, km.nbmap_t, a, km.order_t))
    _assert_close(*out[18], ref_y, ref_dx)
    assert torch.equal(out[13][0], out[18][0]) and torch.equal(out[13][1], out[18][1])


@pytest.mark.parametrize("cin,cout", [(8, 24), (16, 8), (24, 16), (32, 32), (48, 24), (24, 48)])
def test_packed_offsets(cin, cout):
    """Tile 13 at red <= 32 channels packs 8, 4 or 2 offsets into one K step (conv_wgmma.cu PACK;
    red is the forward's Cin and dgrad's Cout), and at n <= 32 produced channels runs 32-column
    tiles (BN = 32, packed or, at 48, not), under the sanitizers: with the step plan, the bare
    mask order (entries listed per launch) and a plan of wild words, fwd and dgrad against the
    CPU float64 kernels."""
    coords = _coords(900, seed=31)
    feats = torch.randn(coords.shape[0], cin, dtype=torch.float64)
    w = torch.randn(27, cin, cout, dtype=torch.float64) / 10
    x_cpu = torchsp.SparseTensor(feats, coords)
    km_cpu = torchsp.kmap.get_kernel_map(x_cpu, 3)[0]
    ref_y = torch.ops.torchsp.conv_fwd(feats, w, km_cpu.nbmap, km_cpu.nbmap_t, [0, 0, 0, 0], [0, 0, 0, 0],
                                       [0, 0, 0, 0], None, None)
    g = torch.linspace(-1, 1, ref_y.numel(), dtype=torch.float64).reshape(ref_y.shape)
    ref_dx = torch.ops.torchsp.conv_dgrad(g, w, km_cpu.nbmap_t, [0, 0, 0, 0], None)
    x = torchsp.SparseTensor(feats.to("cuda", torch.float16), coords.cuda())
    w16, g16 = w.to("cuda", torch.float16), g.to("cuda", torch.float16)
    km = torchsp.kmap.get_kernel_map(x, 3)[0]
    n, n_t = km.nbmap.shape[0], km.nbmap_t.shape[0]
    a = [0, 13, 0, 0]
    for order, order_t in ((km.order, km.order_t), (km.order[:n].clone(), km.order_t[:n_t].clone())):
        y = torch.ops.torchsp.conv_fwd(x.feats, w16, km.nbmap, km.nbmap_t, a, a, a, order, order_t)
        dx = torch.ops.torchsp.conv_dgrad(g16, w16, km.nbmap_t, a, order_t)
        _assert_close(y, dx, ref_y, ref_dx)
    _run_wild_plans(x, w16, g16, km, a, seed=cin + cout)


def test_tile_pack_windows():
    """The packing of refined step plans (tile_pack.cu) under the sanitizers: five and three
    4096-entry windows, the last short, V = 27 and V = 64, an order with entries outside [0, N): the same
    plan as the CPU twin, bitwise."""
    g = torch.Generator().manual_seed(5)
    for n, v in ((20000, 27), (9000, 64)):
        p = torch.rand(v, generator=g) * 0.5
        nbmap = torch.where(torch.rand(n, v, generator=g) < p, torch.randint(0, n, (n, v), generator=g), -1).int()
        order = torch.ops.torchsp.mask_order(nbmap) if v < 64 else torch.randperm(n, generator=g).int()
        order[::97] = -4
        want = torch.ops.torchsp.tile_steps(nbmap, order)
        assert torch.equal(torch.ops.torchsp.tile_steps(nbmap.cuda(), order.cuda()).cpu(), want)


@pytest.mark.parametrize("tile", [0, 3, 13, 15])
def test_split_k(tile):
    """Split-K (dataflow 3) under the sanitizers: 40 -> 144 channels, 3 and 7 runs per tile (runs
    with no offset among them), fp32 slabs in the workspace and their fixed-order sum."""
    x, w16, g16, ref_y, ref_dx, _ = _tensor_core_case(seed=14)
    geom = torchsp.kmap.ConvGeometry(3)
    km = torchsp.kmap.get_kernel_map(x, geom)[0]
    for s in (3, 7):
        a = [3, tile, s, 0]
        y = torch.ops.torchsp.conv_fwd(x.feats, w16, km.nbmap, km.nbmap_t, a, a, a, km.order, km.order_t)
        dx = torch.ops.torchsp.conv_dgrad(g16, w16, km.nbmap_t, a, km.order_t)
        _assert_close(y, dx, ref_y, ref_dx)


def test_wide_tiles():
    """128 -> 136 channels: tile 0 resolves to the warp-specialized wgmma tile 15 in forward (136
    produced channels in one 256-column tile) and to the ping-pong tile 16 in dgrad (128) on
    sm_90a builds (else mma.sync), and wgrad takes its 8-warp 128 x 128 tiles."""
    coords = _coords(700, seed=5)
    feats = torch.randn(coords.shape[0], 128, dtype=torch.float64)
    w = torch.randn(27, 128, 136, dtype=torch.float64) / 30
    km = torchsp.kmap.get_kernel_map(torchsp.SparseTensor(feats, coords), 3)[0]
    g = torch.linspace(-1, 1, coords.shape[0] * 136, dtype=torch.float64).reshape(-1, 136)
    a = [0, 0, 0, 0]
    want = (torch.ops.torchsp.conv_fwd(feats, w, km.nbmap, km.nbmap_t, a, a, a, None, None),
            torch.ops.torchsp.conv_dgrad(g, w, km.nbmap_t, a, None),
            torch.ops.torchsp.conv_wgrad(feats, g, km.nbmap, a))
    x16 = torchsp.SparseTensor(feats.to("cuda", torch.float16), coords.cuda())
    kc = torchsp.kmap.get_kernel_map(x16, 3)[0]
    w16, g16 = w.to("cuda", torch.float16), g.to("cuda", torch.float16)
    got = (torch.ops.torchsp.conv_fwd(x16.feats, w16, kc.nbmap, kc.nbmap_t, a, a, a, kc.order, kc.order_t),
           torch.ops.torchsp.conv_dgrad(g16, w16, kc.nbmap_t, a, kc.order_t),
           torch.ops.torchsp.conv_wgrad(x16.feats, g16, kc.nbmap, a))
    torch.cuda.synchronize()
    for name, u, v in zip(("fwd", "dgrad", "wgrad"), want, got):
        assert (v.double().cpu() - u).norm() / u.norm() < 1e-2, name


@pytest.mark.parametrize("algo", [[0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 2], [1, 9, 0, 0], [2, 9, 0, 1],
                                  [1, 14, 0, 0], [2, 14, 0, 1], [4, 0, 0, 0], [4, 0, 0, 6400], [5, 0, 0, 50],
                                  [5, 3, 0, 50], [5, 15, 0, 50]],
                         ids=["split2", "ws", "hybrid2", "ws_t9", "hybrid1_t9", "ws_t14", "hybrid1_t14", "ggs",
                              "ggs_one_bmm", "density50", "density50_t3", "density50_t15"])
def test_segmented_dataflows(algo):
    """Segmented plans (torchsp/plan.py: mask splits, weight-stationary, hybrid, gather-GEMM-scatter,
    density split) under the sanitizers: fp32 partial sums in the workspace, pair-list rows,
    gathered batches padded to their group's largest offset, segments with their map rows that add
    into the output, fwd and dgrad."""
    x, w16, g16, ref_y, ref_dx, _ = _tensor_core_case(seed=12)
    geom = torchsp.kmap.ConvGeometry(3)
    km = torchsp.kmap.get_kernel_map(x, geom)[0]
    order, segs = torchsp.plan.pass_plan(km, "fwd", algo, geom)
    order_t, segs_t = torchsp.plan.pass_plan(km, "dgrad", algo, geom)
    assert segs and segs_t
    y = torch.ops.torchsp.conv_fwd(x.feats, w16, km.nbmap, km.nbmap_t, algo, algo, algo, order, order_t, segs,
                                   segs_t)
    dx = torch.ops.torchsp.conv_dgrad(g16, w16, km.nbmap_t, algo, order_t, segs_t)
    _assert_close(y, dx, ref_y, ref_dx)


@pytest.mark.parametrize("algo", [[0, 11, 0, 0], [0, 11, 0, -1], [0, 11, 2, 0], [1, 11, 0, 0], [2, 11, 0, 2],
                                  [4, 11, 0, 50], [5, 11, 0, 50]],
                         ids=["sorted", "unsorted", "split2", "ws", "hybrid2", "ggs50", "density50"])
def test_tf32_kernels(algo):
    """The tf32 kernels (tile 11 on float32: conv_tf32.cu forward and dgrad in each dataflow,
    conv_wgrad.cu's tf32 wgrad) under the sanitizers: 40 -> 144 channels, so the forward's
    second 128-column tile and the 16-float channel chunks are partial."""
    x, w, g, ref_y, ref_dx, ref_dw = _tensor_core_case(seed=13, dtype=torch.float32)
    geom = torchsp.kmap.ConvGeometry(3)
    km = torchsp.kmap.get_kernel_map(x, geom)[0]
    order, segs = torchsp.plan.pass_plan(km, "fwd", algo, geom, torch.float32)
    order_t, segs_t = torchsp.plan.pass_plan(km, "dgrad", algo, geom, torch.float32)
    y = torch.ops.torchsp.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, algo, algo, algo, order, order_t, segs,
                                   segs_t)
    dx = torch.ops.torchsp.conv_dgrad(g, w, km.nbmap_t, algo, order_t, segs_t)
    dw = torch.ops.torchsp.conv_wgrad(x.feats, g, km.nbmap, algo)
    _assert_close(y, dx, ref_y, ref_dx)
    assert (dw.double().cpu() - ref_dw).norm() / ref_dw.norm() < 1e-2


@pytest.mark.parametrize("kernel,stride", [(3, 1), (5, 1), (2, 2)])
def test_map_pairs(kernel, stride):
    """kernel_map_pairs (the weight-stationary form) and mask_order with an offset subset under
    the sanitizers, against the same lists computed with torch.nonzero / a stable sort."""
    coords = _coords(800, seed=kernel + 20)
    x = torchsp.SparseTensor(torch.zeros(coords.shape[0], 1, device="cuda"), coords.cuda())
    km = torchsp.kmap.get_kernel_map(x, kernel, stride=stride)[0]
    for nb in (km.nbmap, km.nbmap_t):
        pairs, starts = torchsp.kmap.map_pairs(nb)
        kq = (nb.t() >= 0).nonzero()
        assert torch.equal(pairs.long().cpu(), kq[:, 1].cpu())
        counts = torch.bincount(kq[:, 0], minlength=nb.shape[1]).cpu()
        assert torch.equal(starts.cpu(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
        if nb.shape[1] <= 63:
            order = torchsp.kmap.mask_order(nb, 0b1010101)
            assert torch.equal(order.sort().values.cpu(), torch.arange(nb.shape[0], dtype=torch.int32))


@pytest.mark.parametrize("dtype,c", [(torch.float16, 24), (torch.bfloat16, 5), (torch.float32, 40)])
def test_fused_batch_norm(dtype, c):
    """csrc/cuda/batch_norm_act.cu: statistics, normalisation + ReLU and backward (vector and scalar lanes,
    float32 vectors beside half data) against the CPU kernels in float64."""
    from torch import nn
    g = torch.Generator().manual_seed(c)
    x = torch.randn(333, c, generator=g, dtype=torch.float64) * 2 + 1
    dy = torch.randn(333, c, generator=g, dtype=torch.float64)
    outs = []
    # the reference takes the values the GPU gets (rounded to dtype), in float64
    x, dy = x.to(dtype).double(), dy.to(dtype).double()
    for dev, dt in (("cpu", torch.float64), ("cuda", dtype)):
        bn = nn.BatchNorm1d(c).to(dev)
        if dev == "cpu":
            bn = bn.double()
        xg = x.to(dev, dt).detach().clone().requires_grad_()  # .to() is x itself for cpu/float64
        y = torchsp.nn.norm._fused_batch_norm(bn, xg, True)
        y.backward(dy.to(dev, dt))
        torch.cuda.synchronize()
        outs.append([t.detach().double().cpu() for t in (y, xg.grad, bn.weight.grad, bn.bias.grad, bn.running_var)])
    for a, b in zip(*outs):
        assert (a - b).abs().max() <= 0.05 * max(b.abs().max().item(), 1.0)


@pytest.mark.parametrize("dtype,cin,cout,tile", [(torch.float16, 4, 32, 0), (torch.bfloat16, 5, 3, 0),
                                                 (torch.float16, 4, 32, 13), (torch.float32, 3, 6, 11)])
def test_padded_channels(dtype, cin, cout, tile):
    """csrc/cuda/conv.cu's channel padding (conv_pad.cu's copies, then the tensor-core passes on
    the images): forward, dgrad and wgrad of odd channel counts against the CPU kernels in float64;
    tile 13 asks for the wgmma wgrad over pair pieces, 11 for tf32 (padded to multiples of 4)."""
    coords = _coords(500, seed=cin * 7 + cout)
    feats = torch.randn(coords.shape[0], cin, dtype=torch.float64)
    w = torch.randn(27, cin, cout, dtype=torch.float64) / 6
    km = torchsp.kmap.get_kernel_map(torchsp.SparseTensor(feats, coords), 3)[0]
    g = torch.linspace(-1, 1, km.nbmap.shape[0] * cout, dtype=torch.float64).reshape(-1, cout)
    z = [0, 0, 0, 0]
    want = (torch.ops.torchsp.conv_fwd(feats, w, km.nbmap, km.nbmap_t, z, z, z, None, None, [], []),
            torch.ops.torchsp.conv_dgrad(g, w, km.nbmap_t, z, None), torch.ops.torchsp.conv_wgrad(feats, g, km.nbmap, z))
    x = torchsp.SparseTensor(feats.to("cuda", dtype), coords.cuda())
    kg = torchsp.kmap.get_kernel_map(x, 3)[0]
    a = [1 if tile == 13 else 0, tile, 0, 0]
    pairs, starts = torchsp.plan.wgrad_pairs(kg, a, dtype, cin, cout)
    wc, gc = w.to("cuda", dtype), g.to("cuda", dtype)
    got = (torch.ops.torchsp.conv_fwd(x.feats, wc, kg.nbmap, kg.nbmap_t, a, a, a, kg.order, kg.order_t, [], []),
           torch.ops.torchsp.conv_dgrad(gc, wc, kg.nbmap_t, a, kg.order_t, []),
           torch.ops.torchsp.conv_wgrad(x.feats, gc, kg.nbmap, a, pairs, starts))
    torch.cuda.synchronize()
    for name, y, r in zip(("fwd", "dgrad", "wgrad"), got, want):
        assert y.shape == r.shape, name
        assert (y.double().cpu() - r).norm() / r.norm() < 2e-2, name
