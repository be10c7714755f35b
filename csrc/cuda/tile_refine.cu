/*
** tile_refine.cu: the window refinement of a row order (torchsp.h,
** tsp_tile_refine_launch), the same result as cpu/tile_refine.c, whose header
** says why it exists and what the tree is.  tile_steps.cu runs it first.
**
** One block of 1024 threads per window, a thread per entry, in shared
** memory (each entry's offset bits as one 64-bit mask, read a row per warp
** request, and its value).  The tree is built level by level (at most
** TSP_REFINE_DEPTH), every segment still to split at once (at most 7 of more
** than 128 rows), five barriers a level:
**   - choose: warp i takes segment i's minimum of (count << 7 | k) over the
**     offsets some but not all of its rows have (lowest k on ties);
**   - partition: each row's place from the warps' "first part" ballots,
**     scanned; the rows of a split move through a scratch buffer, and a
**     warp with none rests;
**   - count: only each split's smaller part (a warp inside it takes one
**     ballot per offset, lane k adds offset k's); the larger part's counts
**     are the segment's less the smaller's (a decision tree's histogram
**     subtraction).
** H100, lidar_198k's maps (123-170 windows): 44-68 us, bound by the latency
** of the deepest windows' levels (~3 us a level; two blocks an SM, or
** counting only the smaller parts, changed it by 1-2 us).  A warp walking
** its window's tree alone took 400-570 us, a block counting every segment at
** every level 55-84 us.  Hence KernelMap refines a plan only once it has
** served a few passes (torchsp.kmap.REFINE_AFTER).
*/
#include "conv_internal.cuh"

enum {
  REFINE_W = TSP_REFINE_WINDOW, /* one thread per entry of the window */
  REFINE_SEGS = 8,              /* segments of more than TSP_REFINE_LEAF rows in a window: <= 7 */
  REFINE_WARPS = REFINE_W / 32
};
static_assert(REFINE_SEGS * (TSP_REFINE_LEAF + 1) > REFINE_W, "a window holds fewer big segments than slots");

/* Offset counts of the rows at positions [a, b) of `masks` into cnt[64] (smem atomics): a
** warp whose 32 rows all lie inside takes one ballot per offset and lane k adds offset k's
** (and k + 32's) count; a warp across an end adds per set bit.  in: p in [a, b). */
static __device__ __forceinline__ void refine_count(uint64_t m, bool in, int volume, int lane, int32_t *cnt) {
  if (__all_sync(0xffffffffu, in)) {
    int c0 = 0, c1 = 0;
    for (int k = 0; k < volume; ++k) {
      const int c = __popc(__ballot_sync(0xffffffffu, (m >> k) & 1u));
      c0 = k == lane ? c : c0;
      c1 = k == lane + 32 ? c : c1;
    }
    if (c0) atomicAdd(&cnt[lane], c0);
    if (c1) atomicAdd(&cnt[lane + 32], c1);
  } else if (in) {
    for (uint64_t b = m; b; b &= b - 1) atomicAdd(&cnt[__ffsll((long long)b) - 1], 1);
  }
}

/* out entries outside [0, n_rows) become -1, and -1 fills out[n_rows ..
** pad_to); depth: the levels to build (TSP_REFINE_DEPTH). */
__global__ void __launch_bounds__(REFINE_W)
    tile_refine_kernel(const int32_t *__restrict__ map, int64_t n_rows, int volume,
                       const int32_t *__restrict__ order, int32_t *__restrict__ out, int depth, int64_t pad_to) {
  __shared__ uint64_t masks[2][REFINE_W]; /* [0]: the rows; [1]: where a level's split rows move first */
  __shared__ int32_t vals[2][REFINE_W];
  __shared__ int32_t counts[2][REFINE_SEGS][64]; /* offset counts of each segment to split */
  __shared__ int32_t part[REFINE_SEGS][64];      /* offset counts of each split's smaller part */
  __shared__ int4 segs[2][REFINE_SEGS];          /* (lo, hi, flip, -) of the segments to split */
  __shared__ int4 counted[REFINE_SEGS]; /* per split: the smaller part [x, y), the parts' next slots z, w */
  __shared__ int n_segs[2];
  __shared__ uint32_t best[REFINE_SEGS];     /* count << 7 | offset, or ~0: a leaf */
  __shared__ uint32_t ballots[REFINE_WARPS]; /* each warp's "first part" ballot */
  const int p = threadIdx.x, lane = p & 31, warp = p >> 5;
  const uint32_t below = (1u << lane) - 1u, none = 0xffffffffu;
  const int64_t base = (int64_t)blockIdx.x * REFINE_W;
  if (blockIdx.x == 0)
    for (int64_t i = n_rows + p; i < pad_to; i += REFINE_W) out[i] = -1;
  const int len = (int)(n_rows - base < REFINE_W ? n_rows - base : REFINE_W);
  { /* masks: each row's entries read by the warp in one request (lane k: offset k) */
    const int32_t r = p < len ? order[base + p] : -1;
    const bool ok = r >= 0 && r < n_rows;
    uint64_t m = 0;
#pragma unroll 8
    for (int i = 0; i < 32; ++i) {
      const int32_t ri = __shfl_sync(0xffffffffu, r, i);
      const bool oki = __shfl_sync(0xffffffffu, ok, i);
      const int32_t *row = map + (int64_t)(oki ? ri : 0) * volume;
      const uint32_t b0 = __ballot_sync(0xffffffffu, oki && lane < volume && row[lane] >= 0);
      const uint32_t b1 = __ballot_sync(0xffffffffu, oki && lane + 32 < volume && row[lane + 32] >= 0);
      if (lane == i) m = (uint64_t)b0 | (uint64_t)b1 << 32;
    }
    if (p < len) {
      masks[0][p] = m;
      vals[0][p] = r;
    }
    for (int i = p; i < 2 * REFINE_SEGS * 64; i += REFINE_W) (&counts[0][0][0])[i] = 0;
    for (int i = p; i < REFINE_SEGS * 64; i += REFINE_W) (&part[0][0])[i] = 0;
    if (p == 0) {
      segs[0][0] = make_int4(0, len, 0, 0);
      n_segs[0] = len > TSP_REFINE_LEAF ? 1 : 0;
    }
    __syncthreads();
    if (len > TSP_REFINE_LEAF) refine_count(m, p < len, volume, lane, counts[0][0]); /* the root's */
    __syncthreads();
  }
  /* Level by level, every segment still to split at once (the tree of
  ** cpu/tile_refine.c in breadth-first order: the same splits).  Only each
  ** split's smaller part is counted; the larger part's counts are the
  ** segment's less those. */
  int cur = 0;
  for (int level = 0;; cur ^= 1, ++level) {
    const int n = level < depth ? n_segs[cur] : 0; /* segments at level L are L splits deep */
    if (n == 0) break;
    if (warp < n) { /* warp i chooses segment i's offset: fewest rows, some but not all */
      const int size = segs[cur][warp].y - segs[cur][warp].x;
      const int c0 = counts[cur][warp][lane], c1 = counts[cur][warp][lane + 32];
      uint32_t key = lane < volume && c0 > 0 && c0 < size ? ((uint32_t)c0 << 7) | (uint32_t)lane : none;
      const uint32_t key1 =
          lane + 32 < volume && c1 > 0 && c1 < size ? ((uint32_t)c1 << 7) | (uint32_t)(lane + 32) : none;
      key = key1 < key ? key1 : key;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const uint32_t u = __shfl_xor_sync(0xffffffffu, key, o);
        key = u < key ? u : key;
      }
      if (lane == 0) best[warp] = key;
    }
    __syncthreads();
    if (warp == 0) { /* the next level's segments (parts of more than TSP_REFINE_LEAF rows) */
      const int i = lane >> 1, h = lane & 1; /* lane 2 i + h: part h of segment i */
      int4 g = make_int4(0, 0, 0, 0), mine = make_int4(0, 0, 0, 0);
      if (i < n && best[i] != none) { /* best[i] == none: all its rows agree, a leaf */
        g = segs[cur][i];
        const int c = (int)(best[i] >> 7), n1 = g.z ? c : g.y - g.x - c;
        mine = h ? make_int4(g.x + n1, g.y, !g.z, 0) : make_int4(g.x, g.x + n1, g.z, 0);
      }
      const bool keep = mine.y - mine.x > TSP_REFINE_LEAF;
      const uint32_t kept = __ballot_sync(0xffffffffu, keep);
      const int slot = keep ? __popc(kept & below) : -1;
      if (keep) segs[cur ^ 1][slot] = mine;
      if (lane == 0) n_segs[cur ^ 1] = __popc(kept);
      /* lane 2 i: count the smaller part (the first on a tie) when the larger is kept */
      const int size1 = __shfl_down_sync(0xffffffffu, mine.y - mine.x, 1);
      const int slot1 = __shfl_down_sync(0xffffffffu, slot, 1);
      if (h == 0 && i < n) {
        const int size0 = mine.y - mine.x;
        const bool small0 = size0 <= size1;
        const int s_small = small0 ? slot : slot1, s_big = small0 ? slot1 : slot;
        const int a = small0 ? mine.x : mine.y, b = small0 ? mine.y : mine.y + size1;
        counted[i] = s_big >= 0 ? make_int4(a, b, s_small, s_big) : make_int4(0, 0, -1, -1);
      }
    }
    /* the stable partition: rows of the first part keep their order, then the second's */
    int s = -1;
    for (int i = 0; i < n; ++i)
      if (p >= segs[cur][i].x && p < segs[cur][i].y) s = i;
    const uint64_t m = s >= 0 ? masks[0][p] : 0;
    const int32_t v = s >= 0 ? vals[0][p] : -1;
    const uint32_t key = s >= 0 ? best[s] : none;
    const int k = (int)(key & 127u);
    const int4 g = s >= 0 ? segs[cur][s] : make_int4(0, 0, 0, 0);
    const bool split = key != none;
    const bool first = split && (int)((m >> k) & 1u) == g.z;
    const uint32_t bl = __ballot_sync(0xffffffffu, first);
    if (lane == 0) ballots[warp] = bl;
    __syncthreads();
    const bool warp_splits = __any_sync(0xffffffffu, split); /* else its rows stay: the warp rests */
    if (warp_splits) {
      /* rows of the first part before position q: the warps' ballots, scanned */
      const int wc = __popc(ballots[lane]);
      int incl = wc;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
      }
      const int excl = incl - wc;
      const int lo_warp = g.x >> 5;
      const int before_me = __shfl_sync(0xffffffffu, excl, warp) + __popc(bl & below);
      const int before_lo =
          __shfl_sync(0xffffffffu, excl, lo_warp) + __popc(ballots[lo_warp] & ((1u << (g.x & 31)) - 1u));
      if (split) {
        const int c = (int)(key >> 7), n1 = g.z ? c : g.y - g.x - c, r1 = before_me - before_lo;
        const int to = first ? g.x + r1 : g.x + n1 + (p - g.x - r1);
        masks[1][to] = m;
        vals[1][to] = v;
      }
    }
    __syncthreads();
    if (warp_splits) { /* split rows back in place (the others never moved), and the smaller parts' counts */
      int ci = -1;
      for (int i = 0; i < n; ++i)
        if (p >= counted[i].x && p < counted[i].y) ci = i;
      const int ci0 = __shfl_sync(0xffffffffu, ci, 0);
      const uint64_t mm = split ? masks[1][p] : 0; /* a split keeps its positions: p's row moved here */
      if (split) {
        masks[0][p] = mm;
        vals[0][p] = vals[1][p];
      }
      if (__all_sync(0xffffffffu, ci == ci0)) {
        if (ci0 >= 0) refine_count(mm, true, volume, lane, part[ci0]);
      } else if (ci >= 0) {
        for (uint64_t b = mm; b; b &= b - 1) atomicAdd(&part[ci][__ffsll((long long)b) - 1], 1);
      }
    }
    __syncthreads();
    if (p < n * 64) { /* the parts' counts for the next level: counted, and the segment's less those */
      const int i = p >> 6, kk = p & 63;
      const int4 c = counted[i];
      const int small = part[i][kk];
      if (c.z >= 0) counts[cur ^ 1][c.z][kk] = small;
      if (c.w >= 0) counts[cur ^ 1][c.w][kk] = counts[cur][i][kk] - small;
      part[i][kk] = 0;
    }
    __syncthreads();
  }
  if (p < len) {
    const int32_t r = vals[0][p];
    out[base + p] = r < 0 || r >= n_rows ? -1 : r;
  }
}

/* The refined order of map and order into out[0, n_rows) (conv_internal.cuh). */
tsp_status tsp_tile_refine_launch(const int32_t *map, int64_t n_rows, int64_t volume, const int32_t *order,
                                  int32_t *out, int depth, int64_t pad_to, cudaStream_t stream) {
  const int64_t windows = (n_rows + REFINE_W - 1) / REFINE_W;
  if (windows < 1) return TSP_OK;
  tile_refine_kernel<<<(unsigned)windows, REFINE_W, 0, stream>>>(map, n_rows, (int)volume, order, out, depth, pad_to);
  return tsp_cuda_check_launch("tsp_tile_refine_cuda");
}
