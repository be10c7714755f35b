"""Kernel maps: which input row each output row reads through each offset.

get_kernel_map() resolves a convolution's output coordinates (DESIGN.md
section 3) and its map, building each at most once per SparseCache.  Maps are
keyed by (input coord_key, output coord_key, kernel, dilation, padding, step,
sign).  A transposed convolution whose downsampling map is cached reuses it
with nbmap and nbmap_t swapped: the pair (q_coarse, p_fine = q_coarse + delta_k)
of the downsampling is the pair (p_fine, q_coarse = p_fine - delta_k) of the
transposed conv with the same kernel.
"""

import os

import torch

from ._tracing import capturing, refuse_under_capture, tracing
from .geometry import default_padding, triple, volume

# Map search: 0 = z-delta (sorted keys), 1 = open-addressing hash; None = per device:
# hash on CUDA (65 us vs 110 us for 3x3x3 at 125k voxels, H100), z-delta on CPU (3x faster there).
_env_method = os.environ.get("TORCHSP_KMAP_METHOD")
DEFAULT_METHOD = int(_env_method) if _env_method else None

# Offsets whose presence bits fit one int64 sort key; larger kernels keep map order.
_MASK_BITS = 63
_UNSORTED = object()  # KernelMap: a row order not built yet

# Passes of one direction a CUDA KernelMap serves before its step plan is rebuilt on the packed
# row order (tile_steps(refine=True): csrc/cpu/tile_pack.c); None: never.  Why not at once: on an
# H100 the packing costs 77-561 us of GPU per plan at 125-300k rows (lidar_198k) and saves 1-25
# us of kernel time per pass against the plain mask order (docs/performance-log.md, sessions 30 and 32),
# so a map that lives for one training step is better served by the plain mask order (session
# 30, with a 45-70 us refinement: MinkUNet, batch 4, maps rebuilt per call, GPU time per step
# 58.0 -> 58.8 ms with every plan refined).  A map reused across calls (a cached map, the fixed
# voxels of a generative decoder's denoising steps, benchmarks) pays for it after some 50-150
# passes; 64 (32 while the refinement cost a tenth of this) waits until a map has shown it
# lives that long.  Same sums either way, bitwise (each row adds the same products in the same
# order).
REFINE_AFTER = 64


class KernelMap:
    """A kernel map in the two layouts the convolution passes read.

    Attributes:
        nbmap: int32 [N_out, V], input row of out_coords[q] + delta_k, or -1 (forward, wgrad).
        nbmap_t: int32 [N_in, V], output row that reads input p through offset k, or -1 (dgrad).
        order, order_t: int32 [N_out] / [N_in] row permutations sorted by neighbour mask
            (see mask_order), or None; CUDA tensor-core tiles walk rows in this order.
            Built here for a CUDA map, each is the step plan (tile_order: the permutation,
            then each 128-row tile's offsets and map entries), rebuilt on the packed row order
            once its direction has been read REFINE_AFTER times (refined_plan).
            With sort_rows=True each is built on first read: order_t serves dgrad only, and
            a forward without gradients never reads it (sorting costs ~50-70 us of host time and
            ~25-40 us of GPU per map on the H100; a MinkUNet training step on new voxels sorts
            13 times, 28 before pointwise convs lost their maps and mirrored maps their second sort).
        mirrored: nbmap_t[p, k] == nbmap[p, V - 1 - k] (a submanifold map of a kernel with odd
            sizes and centred padding: offset V - 1 - k is -delta_k).  Then order_t is the step
            plan of nbmap_t on order's rows (mirror_plan): each tile's offsets are the mirror
            images of its forward offsets, as many, and the dgrad pass sorts nothing.
        plans: dict filled by torchsp.plan (pair lists, segmented plans of each dataflow).
        stats, rows_bucket: set by torchsp.tune on first use (the map's part of a cache key).
    """

    mirrored = False  # a map pickled before the attribute existed

    def __init__(self, nbmap, nbmap_t, order=None, order_t=None, sort_rows=False, mirrored=False):
        self.nbmap = nbmap
        self.nbmap_t = nbmap_t
        self.mirrored = mirrored
        self._order = _UNSORTED if sort_rows else order
        self._order_t = _UNSORTED if sort_rows else order_t
        self._reads = [0, 0]  # reads of order / order_t: REFINE_AFTER
        self.plans = {}  # torchsp.plan: pair lists and segmented plans, built on first use

    @property
    def order(self):
        if self._order is _UNSORTED:
            refuse_under_capture(self.nbmap, "the row plan of a kernel map")
            self._order = tile_order(self.nbmap)
        self._order = self._counted(0, self._order, self.nbmap)
        return self._order

    @property
    def order_t(self):
        if self._order_t is _UNSORTED:
            refuse_under_capture(self.nbmap_t, "the dgrad row plan of a kernel map")
            self._order_t = self._dgrad_plan()
        self._order_t = self._counted(1, self._order_t, self.nbmap_t)
        return self._order_t

    def _dgrad_plan(self):
        """order_t built (not read: it counts no pass): tile_order(nbmap_t), or on a mirrored map
        mirror_plan on the forward's plan, which is built first if it is not yet."""
        if not self.mirrored:
            return tile_order(self.nbmap_t)
        if self._order is _UNSORTED:
            self._order = tile_order(self.nbmap)
        return mirror_plan(self.nbmap_t, self._order)

    def _counted(self, i, plan, nbmap):
        """Count a read of order (i = 0) or order_t (1); on the REFINE_AFTER-th, a step plan is
        rebuilt on its refined row order (refined_plan).  Traced reads are not counted, nor
        reads past the REFINE_AFTER-th (every conv call reads: they return at the first test).
        A read while a CUDA graph is captured pins the plan: the graph reads it at every replay,
        and a refined plan would leave it to the allocator."""
        if REFINE_AFTER is None or self._reads[i] >= REFINE_AFTER or tracing():
            return plan
        if capturing(nbmap):
            self._reads[i] = REFINE_AFTER
            return plan
        self._reads[i] += 1
        return refined_plan(nbmap, plan) if self._reads[i] == REFINE_AFTER else plan

    def swapped(self):
        out = KernelMap(self.nbmap_t, self.nbmap, mirrored=self.mirrored)
        out._order, out._order_t = self._order_t, self._order
        out._reads = self._reads[::-1]
        return out


def mask_order(nbmap, offsets=-1, with_map=False):
    """Rows of `nbmap` [N, V] int32 stably sorted by neighbour mask (with_map: a tile plan).

    TorchSparse++'s mask sorting: consecutive rows in this order share their offsets, so an
    output-stationary tile skips the offsets none of its rows has.  The mask has one bit per
    offset k (set when nbmap[r, k] >= 0) at the offset's rank by row count, most common first
    (ties by k): rare offsets are the most significant bits, so rows sharing them are adjacent.
    Rows are sorted by the mask's rank in the Gray code (FlexGEMM's order): neighbouring groups
    of rows differ by one offset, so a tile that spans two groups takes one extra offset.
    Ties keep map order (rows sorted by coordinate), which keeps gathers local.

    `offsets` is a bit mask of the offsets that take part (bit k set: offset k does; -1, the
    default, is all of them): the others are treated as absent everywhere (no bit, count 0 in
    the ranking), e.g. offsets served weight-stationary.  Python ints up to 2**64 - 1 are
    accepted and passed on as their two's-complement int64.  Returns int32 [N], or None when
    V > 63.

    with_map=True returns the tile plan instead, int32 [N * (1 + V)]: the order [N], then the
    map rows in that order (plan[N:].view(N, V)[i] = nbmap[order[i]]).  The conv ops take it
    wherever they take an unsegmented order (its first N entries are the order); the CUDA
    warp-specialized tiles (above 64 produced channels) then read each row's map entries in
    the same request as its order entry rather than after it (H100, C = 128: fwd and dgrad
    kernels ~10% faster), for one more map-sized tensor.
    torch.ops.torchsp.mask_order: C (CPU) or a bit-packing kernel plus CUB's radix sort (CUDA).
    """
    if nbmap.shape[1] > _MASK_BITS:
        return None
    offsets = int(offsets)
    if offsets >= 1 << 63:
        offsets -= 1 << 64
    if with_map:
        return torch.ops.torchsp.mask_order(nbmap, offsets, True)
    return torch.ops.torchsp.mask_order(nbmap, offsets)


def tile_order(nbmap):
    """The row order a pass over `nbmap` [N, V] int32 walks: mask_order's, and on CUDA its step
    plan (tile_steps), or None when V > 63.

    The step plan, int32 [R + T * W + T] (T = ceil(N / 128) tiles, R = N rounded up to a
    multiple of 4, W = 4 * ceil((2 V + 132) / 4) + 128 V words, csrc/torchsp.h), is the mask
    order [N] (packed within windows of 4096 rows when REFINE_AFTER is 0; KernelMap refines
    it after REFINE_AFTER passes, refined_plan) padded with -1 to R entries, then for each
    128-row tile of it the offsets its rows use, a mask of the 16-row groups using each, its
    output rows and, per used offset, the rows' map entries, then the tiles by decreasing offset
    count (the order the ping-pong kernel takes them in).  The packing builds each window's
    tiles greedily: seeded with the mask most rows left have, filled with rows whose masks lie
    inside the tile's offsets, widened by the run or the one or two offsets that let in most rows
    per offset added (csrc/cpu/tile_pack.c), so tiles use fewer offsets: on lidar_198k the
    products computed per useful one fall from 1.89 to 1.59 (subm 3x3x3 at 0.05 m), 1.94 to
    1.64 (0.1 m) and 2.66 to 1.84 (stride-2 K = 3).
    The conv ops take it, with this map, wherever they take an unsegmented order (the CUDA
    kernels read the map entries from the plan, not from nbmap); the CUDA kernels with 128-row
    tiles then copy each tile's record instead of reading and sorting V map entries per row on
    every call (H100/H200, lidar_198k: main kernels 10-29% faster at C = 32-64).  It is about as
    large as the tile plan (mask_order's with_map) that CUDA maps carried before, and is built
    once per map and pass.
    torch.ops.torchsp.tile_steps: C (CPU) or, on CUDA, a block per tile (refine=False: one
    launch); refine=True adds a block per 4096-row packing window before and one block for
    the schedule after.
    """
    order = mask_order(nbmap)
    if order is None or not nbmap.is_cuda:
        return order
    return torch.ops.torchsp.tile_steps(nbmap, order, REFINE_AFTER == 0)


def mirror_plan(nbmap_t, plan):
    """The step plan of a mirrored map's nbmap_t [N, V] (KernelMap.mirrored) on the rows of
    `plan`, the forward's plan (its first N entries are its row order), without a sort: a row's
    dgrad offsets are its forward offsets mirrored (k -> V - 1 - k), so every tile of the
    forward's order uses as many offsets in dgrad.  None (V > 63) and CPU orders pass through."""
    if plan is None or not nbmap_t.is_cuda:
        return plan
    return torch.ops.torchsp.tile_steps(nbmap_t, plan[:nbmap_t.shape[0]], REFINE_AFTER == 0)


def is_mirrored(in_coords, out_coords, kernel_size, dilation, padding):
    """Whether the map of a conv from in_coords to out_coords is mirrored (KernelMap.mirrored): the
    same coordinates (one tensor), odd kernel sizes, padding (K - 1) / 2 * dilation per axis."""
    return in_coords is out_coords and all(k % 2 == 1 and p == (k - 1) // 2 * d
                                           for k, d, p in zip(kernel_size, dilation, padding))


def refined_plan(nbmap, plan):
    """The step plan of `nbmap` [N, V] on the refined row order, from `plan`: a step plan of it
    (its first N entries are its row order), rebuilt by tile_steps(refine=True); any other
    order (None, a bare order [N], a tile plan) is returned as it is.  KernelMap calls this once
    a plan has served REFINE_AFTER passes."""
    n = nbmap.shape[0]
    if plan is None or not nbmap.is_cuda or plan.numel() != step_plan_len(n, nbmap.shape[1]):
        return plan
    return torch.ops.torchsp.tile_steps(nbmap, plan[:n], True)


STEPS_ROWS = 128  # rows of a step plan's tile (csrc/torchsp.h, TSP_STEPS_ROWS)


def step_plan_len(n, v):
    """Length of the step plan of an [n, v] map (csrc/torchsp.h, tsp_tile_steps_len): the order
    padded to a multiple of 4, a record per 128-row tile, a schedule word per tile.  Plain
    integer arithmetic, so fake kernels may pass symbolic sizes.  The padding is written
    n + 3 - (n + 3) % 4 rather than (n + 3) // 4 * 4 (the same value) so that torch's symbolic
    shapes can prove the plan at least n long: mirror_plan's plan[:n] otherwise added the guard
    n <= 4 * ((n + 3) // 4) + ..., and torch.export with a dynamic row count failed on CUDA
    ("Constraints violated", tools/fuzz_conv.py --export, 2026-11-29).  Not n + (-n) % 4 either:
    torch 2.4 could not bound a modulo of a negative size, and tracing the plan of a strided
    layer's unbacked row count stopped at "Could not guard on data-dependent expression"."""
    tiles = (n + STEPS_ROWS - 1) // STEPS_ROWS
    head = (2 * v + 4 + STEPS_ROWS + 3) // 4 * 4
    return n + 3 - (n + 3) % 4 + tiles * (head + STEPS_ROWS * v) + tiles


def map_pairs(nbmap, bounded=False, rows=False):
    """Weight-stationary form of a kernel map: (pairs, starts).

    nbmap: int32 [N, V] (any negative entry is absent).  Returns pairs int32 [P] and starts
    int64 [V + 1], on nbmap's device: for each offset k in increasing k, the rows q with
    nbmap[q, k] >= 0 in increasing q, concatenated; offset k owns pairs[starts[k]:starts[k + 1]],
    starts[0] = 0 and starts[V] = P.  Only the output row q is stored, unless `rows`: then
    pairs is [2, P], row 0 the output rows and row 1 their input rows nbmap[q, k] (what the
    CUDA wgrad reads instead of looking them up).  P is data-dependent: on CUDA the op
    synchronises once to read it, unless `bounded`: then P is N * V, the most a map holds, the
    pairs first and -1 after them, and nothing is read back.
    torch.ops.torchsp.kernel_map_pairs: C (CPU) or per-tile counts, CUB's scan and a ballot
    fill (CUDA); deterministic on both.
    """
    return torch.ops.torchsp.kernel_map_pairs(nbmap, bounded, rows)


class ConvGeometry:
    """Normalised arguments of one sparse convolution (all 3-tuples of ints; volume: V)."""

    def __init__(self, kernel_size, stride=1, dilation=1, padding=None, transposed=False,
                 generative=False, rule="active"):
        self.kernel_size = triple(kernel_size, "kernel_size")
        self.stride = triple(stride, "stride")
        self.dilation = triple(dilation, "dilation")
        self.padding = (default_padding(self.kernel_size, self.dilation) if padding is None
                        else triple(padding, "padding", minimum=0))
        if rule not in ("active", "floor"):
            raise ValueError(f"rule must be 'active' or 'floor', got {rule!r}")
        self.transposed = bool(transposed)
        self.generative = bool(generative)
        self.rule = rule
        self.volume = volume(self.kernel_size)  # V, the weight's first dimension
        # 1x1x1 at stride 1 without padding: every output row reads its own input row alone (the
        # kernel map is the identity), so the conv is a dense GEMM (torchsp.functional).
        self.pointwise = (self.volume == 1 and self.stride == (1, 1, 1) and self.padding == (0, 0, 0)
                          and not self.generative)
        self._key = (self.kernel_size, self.stride, self.dilation, self.padding, self.transposed,
                     self.generative, self.rule)

    @property
    def submanifold(self):
        return self.stride == (1, 1, 1) and not self.generative

    def key(self):
        return self._key  # built once: map and memo keys ask on every layer call


_GEOMETRIES = {}  # conv_geometry's memo: argument tuple -> ConvGeometry (never mutated)


def conv_geometry(kernel_size, stride=1, dilation=1, padding=None, transposed=False, generative=False,
                  rule="active"):
    """ConvGeometry(...) memoised on its arguments: normalising them costs ~4 us of Python per
    layer call.  Each value is keyed with its type (True == 1 but kernel_size=True is an error);
    unhashable arguments (lists) build a new one.  Not for traced code (a global memo):
    torchsp.functional calls ConvGeometry itself then."""
    # Spelled out (a generator costs ~0.5 us a call); bool() is applied to transposed and
    # generative and rule is a string, so their types change nothing.
    key = (kernel_size, type(kernel_size), stride, type(stride), dilation, type(dilation), padding,
           type(padding), transposed, generative, rule)
    try:
        hit = _GEOMETRIES.get(key)
    except TypeError:
        return ConvGeometry(kernel_size, stride, dilation, padding, transposed, generative, rule)
    if hit is None:
        hit = ConvGeometry(kernel_size, stride, dilation, padding, transposed, generative, rule)
        if len(_GEOMETRIES) < 4096:
            _GEOMETRIES[key] = hit
    return hit


def _cached_out_coords(cache, key, coords, geom, step, sign, lattice, floor_rule):
    """torch.ops.torchsp.out_coords, once per coordinate key: every layer of a model that
    downsamples (or generates from) the same tensor the same way reuses one set."""
    out = cache.out_coords.get(key)
    if out is None:
        refuse_under_capture(coords, "the output coordinates of a strided or generative conv")
        out = torch.ops.torchsp.out_coords(coords, geom.kernel_size, geom.dilation, geom.padding, step, sign,
                                           lattice, floor_rule)
        cache.out_coords[key] = out
    return out


def output_coords(input, geom):
    """(out_coords, out_stride, out_coord_key, step, sign) of a conv on `input`."""
    t = input.stride
    cache = input.cache
    if geom.transposed:
        for a in range(3):
            if t[a] % geom.stride[a] != 0:
                raise ValueError(f"transposed conv: input stride {t} is not divisible by stride {geom.stride}")
        out_stride = tuple(t[a] // geom.stride[a] for a in range(3))
        step, sign = out_stride, -1
        if geom.submanifold:
            return input.coords, t, input.coord_key, step, sign
        if geom.generative:
            key = ("transposed_generative", input.coord_key, geom.key())
            out = _cached_out_coords(cache, key, input.coords, geom, step, -1, out_stride, False)
            return out, out_stride, key, step, sign
        if out_stride not in cache.coords_by_stride:
            raise ValueError(
                f"transposed conv: no coordinates at stride {out_stride} are known for this tensor (it was not "
                "downsampled from one); use generative=True to generate output coordinates")
        out, key = cache.coords_by_stride[out_stride]
        return out, out_stride, key, step, sign
    out_stride = tuple(t[a] * geom.stride[a] for a in range(3))
    step, sign = t, 1
    if geom.submanifold:
        return input.coords, t, input.coord_key, step, sign
    kind = "generative" if geom.stride == (1, 1, 1) else "strided"
    key = (kind, input.coord_key, geom.key())
    out = _cached_out_coords(cache, key, input.coords, geom, step, 1, out_stride, geom.rule == "floor")
    # First registration wins.  Spelled out: torch 2.4's dynamo cannot trace dict.setdefault.
    if t not in cache.coords_by_stride:
        cache.coords_by_stride[t] = (input.coords, input.coord_key)
    if out_stride not in cache.coords_by_stride:
        cache.coords_by_stride[out_stride] = (out, key)
    return out, out_stride, key, step, sign


def build_kernel_map(in_coords, out_coords, kernel_size, dilation, padding, step, sign, method=None):
    """Build a KernelMap (nbmap [N_out, V] and nbmap_t [N_in, V], int32) with torch.ops.torchsp."""
    if method is None:
        method = DEFAULT_METHOD if DEFAULT_METHOD is not None else int(in_coords.is_cuda)
    nbmap = torch.ops.torchsp.kernel_map(in_coords, out_coords, list(kernel_size), list(dilation),
                                         list(padding), list(step), sign, method)
    nbmap_t = torch.ops.torchsp.kernel_map_transpose(nbmap, in_coords)
    mirrored = is_mirrored(in_coords, out_coords, kernel_size, dilation, padding)
    if not nbmap.is_cuda:  # the CPU kernels walk rows in any order
        return KernelMap(nbmap, nbmap_t, mirrored=mirrored)
    kmap = KernelMap(nbmap, nbmap_t, sort_rows=True, mirrored=mirrored)
    if tracing():  # traced code builds what it may read (no lazy state in a graph)
        kmap._order = tile_order(nbmap)
        kmap._order_t = kmap._dgrad_plan()
    return kmap


def get_kernel_map(input, kernel_size, stride=1, dilation=1, padding=None, transposed=False,
                   generative=False, rule="active", traced=None):
    """Output coordinates and kernel map of a sparse convolution on `input`, cached.

    kernel_size may be a ConvGeometry (the other geometry arguments are then ignored).
    traced: torchsp._tracing.tracing() where the caller asked already; None asks here.
    Returns (KernelMap, out_coords [N_out, 4] int32, out_stride 3-tuple, out_coord_key).
    """
    geom = kernel_size if isinstance(kernel_size, ConvGeometry) else ConvGeometry(
        kernel_size, stride, dilation, padding, transposed, generative, rule)
    cache = input.cache
    # Eager repeats of a call: one lookup in SparseCache.calls instead of resolving the output
    # coordinates and building the map key (~1 us of Python a layer call on a 2-core x86 host).
    memo = None if (traced if traced is not None else tracing()) else (input.coord_key, input.stride, geom.key())
    if memo is not None:
        hit = cache.calls.get(memo)
        if hit is not None:
            return hit
    out, out_stride, out_key, step, sign = output_coords(input, geom)
    key = (input.coord_key, out_key, geom.kernel_size, geom.dilation, geom.padding, step, sign)
    kmap = cache.kmaps.get(key)
    if kmap is None:
        reverse = cache.kmaps.get((out_key, input.coord_key, geom.kernel_size, geom.dilation, geom.padding,
                                   step, -sign))
        if reverse is not None:
            kmap = reverse.swapped()
        else:
            refuse_under_capture(input.coords, "a kernel map")
            kmap = build_kernel_map(input.coords, out, geom.kernel_size, geom.dilation, geom.padding, step, sign)
        cache.kmaps[key] = kmap
    if memo is not None:
        cache.calls[memo] = (kmap, out, out_stride, out_key)
    return kmap, out, out_stride, out_key
