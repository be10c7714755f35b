"""Segmented plans: how the CUDA output-stationary kernels serve every dataflow.

A CUDA forward or dgrad pass runs one tensor-core kernel over *segments*
(csrc/torchsp.h, tsp_segment): each segment walks a list of map rows and sums
only over a subset of the offsets; segments run in order and add up in fp32,
with no atomics (a row appears at most once per segment), so every plan is
deterministic.  This module turns a pass's algorithm choice into a plan:

    [0, tile, S, t]  S <= 1: one plain pass, rows in mask order (t = -1: map order);
                     S >= 2: TorchSparse++ mask splits: the offsets cut into S
                     runs of consecutive k, each run one segment over all rows
                     sorted by the masks of its own offsets (fewer distinct masks
                     per run, so a tile skips more);
    [1, tile, _, _]  weight-stationary (fetch-on-demand): one segment per offset
                     k over its pair list (kernel_map_pairs); every tile row uses
                     offset k, so no mma is wasted, and W_k stays in the tile;
    [2, tile, _, t]  Spira's hybrid: offsets with L1 norm >= t weight-stationary
                     (their pair lists), the rest one output-stationary segment
                     over all rows sorted by the masks of those offsets;
    [3, tile, S, t]  split-K: no segments; the plain pass (mask order, t = -1: map
                     order) with each tile's used offsets cut into S runs that
                     separate blocks of one launch sum into fp32 slabs, added in
                     a fixed order (csrc/cuda/conv.cu): S times the blocks for
                     layers with fewer tiles than SMs;
    [4, _, _, e]     TorchSparse's gather-GEMM-scatter: the weight-stationary plan
                     (one segment per offset over its pair list), which the CUDA
                     shim groups by pair count (a group may pad up to e percent
                     of its pairs), gathers into dense batches, multiplies with
                     one cuBLAS bmm per group and sums per output row in offset
                     order (csrc/shim_ggs.cpp, csrc/cuda/conv_ggs.cu);
    [5, tile, _, d]  density split: the offsets at least d percent of the rows have
                     ("common") in one segment over all rows sorted by their masks,
                     storing straight into the output; then the rest in one segment
                     over only the rows that have any of them, sorted by those masks,
                     adding into the output (add_out: read in the output's dtype, fp32
                     add, one more rounding).  Each segment carries its map rows (a
                     tile plan).  A 3x3x3 LiDAR map has ~15 common offsets and ~60% of
                     its rows with a rare one: the tiles compute ~1.23-1.27x the useful
                     row products instead of ~1.75-1.81x (tools/mask_waste.py), yet on the
                     H100 it is slower (C = 128 fwd 149.8 us at d = 20 against 117.6 plain):
                     the second segment's tiles each pay a fixed cost (docs/performance-log.md).

Plans are built once per KernelMap and pass (cached on it).  A segmented plan
reads its pair list's offset counts on the host (one synchronisation per map), so
while torch.compile or a tracer runs, a segmented choice runs as the plain
pass (same results, another speed).
The CPU kernels take no plans (they have their own dataflows), nor does exact
float32 on CUDA (conv_simple.cu); float32 with tile TF32_TILE runs the tf32
tensor-core kernels, which take every plan as fp16 and bf16 do.

    torchsp.functional.sparse_conv3d -> plan.pass_plan -> torch.ops.torchsp.conv_fwd(..., segs, segs_t)
"""

import torch

from . import _C, _build_info
from ._tracing import refuse_under_capture, tracing
from .geometry import offset_l1
from .kmap import mask_order

# Segments name their offsets in one int64 bit mask; mask_order takes 63.
MAX_VOLUME = 63

# algo.tile of the tf32 tensor-core kernels for float32 (TSP_TILE_TF32, csrc/torchsp.h).
TF32_TILE = 11
# algo.tile of tile 13 with four blocks per SM where a step plan's entries fit a ring (TSP_TILE_RING,
# csrc/cuda/conv_wgmma.cu); wgrad reads it as 13.
RING_TILE = 18
# Both channel counts from which wgrad's tile 0 runs the pair-piece kernel: Python's copy of
# csrc/cuda/conv.cu resolve_wgrad's limit (the two must agree, or a pair list is built for
# nothing or missed).
WGRAD_PIECES_MIN_C = 32


def _bits(ks):
    m = 0
    for k in ks:
        m |= 1 << k
    return m - (1 << 64) if m >= 1 << 63 else m  # an int64 value for the int[] argument


def segmented(algo):
    """True when `algo` ([dataflow, tile, split, threshold]) needs a segmented plan."""
    return algo[0] in (1, 2, 4, 5) or (algo[0] == 0 and algo[2] >= 2)


def takes_segments(dtype, algo):
    """True when the CUDA kernels that run `algo` on `dtype` features serve segments: the
    tensor-core kernels (fp16, bf16, and float32 with tile TF32_TILE); dtype None counts as 16-bit."""
    return dtype in (None, torch.float16, torch.bfloat16) or (dtype == torch.float32 and algo[1] == TF32_TILE)


def pair_list(kmap, which):
    """torchsp._C.PairList of nbmap (which = "fwd") or nbmap_t ("dgrad"): the map's pair list
    (torchsp.kmap.map_pairs; on CUDA bounded, with no synchronisation), built on its first get()
    and kept, one per map and direction (in kmap.plans, so a cleared cache rebuilds it).
    nbmap's list on CUDA also holds the pairs' input rows (pairs [2, N * V]), which the CUDA
    wgrad reads instead of looking them up in nbmap (csrc/cuda/conv_wgmma_wgrad.cu).
    The training node (torchsp._autograd.eager_conv) takes it unbuilt: its first backward builds it."""
    hit = kmap.plans.get(("pairs", which))
    if hit is None:
        nb = kmap.nbmap if which == "fwd" else kmap.nbmap_t
        hit = kmap.plans[("pairs", which)] = _C.PairList(nb, rows=which == "fwd" and nb.is_cuda)
    return hit


def _pairs(kmap, which):
    """(pairs int32 [P] on the map's device, starts list of V + 1 ints) of nbmap or nbmap_t:
    the pair list's output rows cut to their length, read here (one synchronisation per map
    and direction)."""
    hit = kmap.plans.get(("starts", which))
    if hit is None:
        pairs, starts = pair_list(kmap, which).get()
        starts = [int(v) for v in starts.tolist()]
        hit = kmap.plans[("starts", which)] = ((pairs[0] if pairs.dim() == 2 else pairs)[:starts[-1]], starts)
    return hit


_WGMMA = {}  # CUDA device index -> its compute capability is (9, 0)


def wgmma_available(device):
    """True when this build has the sm_90a wgmma kernels and `device` (a CUDA torch.device) is
    an sm_90 part; the capability is looked up once per device."""
    if not _build_info.WITH_WGMMA:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _WGMMA:
        _WGMMA[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return _WGMMA[index]


def wgrad_pair_list(kmap, algo, dtype, c_in, c_out):
    """The map's PairList (pair_list, unbuilt until read) for conv_wgrad, or None.

    The CUDA wgrad over pair pieces (csrc/cuda/conv_wgmma_wgrad.cu; what algo tile 0 runs for
    fp16/bf16 with both channel counts (padded to multiples of 8) >= 32 on an sm_90a build and an sm_90 device, or
    dataflow 1 with tile 12, 13 (or RING_TILE, 13 for wgrad) or 15) walks nbmap's pair list.
    Passed in, it is built once per map (kernel_map_pairs, kept with kmap) instead of on every
    call (two passes over the map and a scan: ~27-38 us on an H100 at 126-173k rows).  None
    wherever that kernel does not run, and while tracing (the list's length is data-dependent;
    the op builds it).
    """
    nb = kmap.nbmap
    if (not nb.is_cuda or dtype not in (torch.float16, torch.bfloat16) or tracing() or nb.shape[0] == 0
            or not wgmma_available(nb.device)):  # tracing first: the row count may be data-dependent
        return None
    # Channel counts that are not multiples of 8 run zero-padded to them (csrc/cuda/conv.cu).
    c_in, c_out = -(-c_in // 8) * 8, -(-c_out // 8) * 8
    pieces = ((algo[1] == 0 and min(c_in, c_out) >= WGRAD_PIECES_MIN_C)
              or (algo[0] == 1 and algo[1] in (12, 13, 15, RING_TILE)))
    return pair_list(kmap, "fwd") if pieces else None


def wgrad_pairs(kmap, algo, dtype, c_in, c_out):
    """(pairs, starts) for torch.ops.torchsp.conv_wgrad: wgrad_pair_list's list, built now, or
    (None, None) where it is None."""
    holder = wgrad_pair_list(kmap, algo, dtype, c_in, c_out)
    return holder.get() if holder is not None else (None, None)


# Segment flags (csrc/torchsp.h, tsp_segment): all_rows | 2 * add_out | 4 * plan.
ALL_ROWS, ADD_OUT, WITH_MAP = 1, 2, 4

# What _build answers where a dataflow's plan has no segment: the pass runs plain, on the map's
# own row plan, which pass_plan reads when the call comes (so it is still refined after
# torchsp.kmap.REFINE_AFTER reads, as a plain choice's is).
PLAIN = (None, [])


def density_offsets(nb, pct):
    """(common, rare): the offsets k that at least `pct` percent of the rows of `nb` [N, V]
    have, and the others that some row has; one synchronisation (the counts)."""
    rows = int(nb.shape[0])
    counts = (nb >= 0).sum(0).tolist()
    common = [k for k, c in enumerate(counts) if c * 100 >= pct * rows]
    rare = [k for k, c in enumerate(counts) if 0 < c and c * 100 < pct * rows]
    return common, rare


def _density_split(kmap, which, nb, pct):
    """Dataflow 5's (row list, segments); PLAIN when either offset set is empty."""
    rows, v = int(nb.shape[0]), int(nb.shape[1])
    common, rare = density_offsets(nb, pct)
    if not common or not rare:
        return PLAIN
    first = mask_order(nb, _bits(common), with_map=True)
    plan = mask_order(nb, _bits(rare), with_map=True)
    # Rows without a rare offset have mask 0 and sort first; the second segment skips them.
    idle = rows - int((nb[:, rare] >= 0).any(1).sum())
    second = torch.cat([plan[idle:rows], plan[rows + idle * v:]])
    segs = [0, rows, _bits(common), ALL_ROWS | WITH_MAP,
            int(first.shape[0]), rows - idle, _bits(rare), ADD_OUT | WITH_MAP]
    return torch.cat([first, second]), segs


def _build(kmap, which, algo, kernel_size, dilation, padding):
    """(row list int32 tensor, segments list of ints) of the pass `which` ("fwd" / "dgrad") of a
    segmented `algo` on kmap (any device), or PLAIN where no segment would run."""
    nb = kmap.nbmap if which == "fwd" else kmap.nbmap_t
    rows, v = int(nb.shape[0]), int(nb.shape[1])
    dataflow, split, t = algo[0], algo[2], algo[3]
    if dataflow == 5:
        return _density_split(kmap, which, nb, t)
    if dataflow == 0:  # mask splits: runs of consecutive offsets
        s = min(split, v)
        runs = [list(range(i * v // s, (i + 1) * v // s)) for i in range(s)]
        orders = [mask_order(nb, _bits(r)) for r in runs]
        segs = []
        for i, r in enumerate(runs):
            segs += [i * rows, rows, _bits(r), ALL_ROWS]
        return torch.cat(orders), segs
    l1 = offset_l1(kernel_size, dilation, padding)
    ws = list(range(v)) if dataflow in (1, 4) else [k for k in range(v) if l1[k] >= t]
    os_ = [] if dataflow in (1, 4) else [k for k in range(v) if l1[k] < t]
    pairs, starts = _pairs(kmap, which)
    segs, full = [], []
    for k in ws:
        count = starts[k + 1] - starts[k]
        if count == 0:
            continue
        seg = [starts[k], count, _bits([k]), ALL_ROWS if count == rows else 0]
        # A segment over all rows (the centre of a submanifold map) goes last, where it
        # can round the sums into the output (no separate pass).
        (full if count == rows and not os_ else segs).extend(seg)
    seq = pairs
    if os_:
        seq = torch.cat([pairs, mask_order(nb, _bits(os_))])
        full = [int(pairs.shape[0]), rows, _bits(os_), ALL_ROWS]
    if not segs and not full:
        # No pairs at all: a floor-rule output whose offsets miss every input, or inputs no
        # output reads (dgrad).  No segment would run, and the ops read [] as the plain pass,
        # which writes the zeros (an empty row list beside [] was refused: tools/fuzz_conv.py).
        return PLAIN
    return seq, segs + full


def pass_plan(kmap, which, algo, geom, dtype=None, traced=None):
    """(row list, segments) for the CUDA pass `which` ("fwd" or "dgrad") of `algo`.

    Args:
        kmap: torchsp.kmap.KernelMap on a CUDA device.
        algo: [dataflow, tile, split, threshold].
        geom: torchsp.kmap.ConvGeometry (kernel_size, dilation, padding for the L1 norms).
        dtype: the features' dtype, or None (taken as 16-bit); exact float32 and float64 run
            the plain pass (the segments steer tensor-core tiles only), float32 with tile
            TF32_TILE (tf32 tensor cores) runs the plan.
        traced: torchsp._tracing.tracing() where the caller asked already (a layer call asks
            once: each question costs ~0.5 us of the host); None asks here.
    Returns:
        (int32 tensor or None, list of ints): the `order` / `order_t` and `segs` / `segs_t`
        arguments of torch.ops.torchsp.conv_fwd; segs is [] for a plain pass, whose row list is
        the map's mask order (None when algo's threshold is -1: map order).
    """
    order = kmap.order if which == "fwd" else kmap.order_t
    nb = kmap.nbmap if which == "fwd" else kmap.nbmap_t
    # Traced code takes the plain pass before any size is read: a strided or generative layer's
    # row count is data-dependent there, and `== 0` on it stopped torch.compile (fullgraph) on CUDA
    # with "Could not guard on data-dependent expression" (tools/fuzz_conv.py --compile).
    if (not segmented(algo) or not nb.is_cuda or (tracing() if traced is None else traced)
            or nb.shape[1] > MAX_VOLUME or nb.shape[0] == 0 or not takes_segments(dtype, algo)):
        return order, []
    # Dataflow 4 runs dataflow 1's plan (its grouping happens in the shim): one cache entry.
    key = (which, 1 if algo[0] == 4 else algo[0], algo[2] if algo[0] == 0 else 0,
           algo[3] if algo[0] in (2, 5) else 0)
    hit = kmap.plans.get(key)
    if hit is None:
        refuse_under_capture(nb, f"the {which} plan of dataflow {algo[0]}")
        hit = kmap.plans[key] = _build(kmap, which, algo, geom.kernel_size, geom.dilation, geom.padding)
    return hit if hit is not PLAIN else (order, [])
