/*
** tile_pack.cu: the tile packing of a row order (torchsp.h,
** tsp_tile_pack_launch), the same result as cpu/tile_pack.c, whose header
** says why it exists and states the rule.  tile_steps.cu runs it first.
**
** One block of 1024 threads per 4096-entry window; the window's offset masks
** (then each run's), entries, run starts and the widening's counters of
** offset sets sit in shared memory (81 KB), and
** thread t holds the entries left and given of runs [t C, t C + C) in
** registers (C = ceil(runs / 1024) <= 4), so a pass over all runs is four
** iterations and a barrier or two.  A tile is built in passes that each end in
** a block-wide reduction or scan:
**   - seed: the maximum of (left << 20 | popcount << 13 | 8191 - r), taken in
**     the barriers of the tile before's write; the seed gives first;
**   - fill: subset runs add what they can give into 65 popcount buckets
**     (shared atomics); warp 0 finds the popcount p* at which the tile fills
**     from the top; runs above p* give all, those at p* give in run order
**     (a block scan of what they can give);
**   - widen: each run's key, (extra * 65536 / give) << 14 | r, while the runs
**     one or two offsets outside the union add what they can give into
**     shared counters of those offsets (single, pair); after a barrier the
**     sets' keys, (|S| * 65536 / gain) << 14 | PACK_SET0 + index, join the
**     runs' in one block minimum;
**   - write: a block scan of the runs' counts places each run's entries, and
**     each warp copies its lanes' runs one at a time, 32 entries a step.
** The windows run in parallel; the tiles of a window one after the other.
** H100, lidar_198k's maps (31-75 windows): 77-561 us a plan, against 44-56 us
** for the decision tree this replaced (tile_refine.cu, session 30): bound by
** the ~400 passes of the busiest windows (thousands of one-entry runs, up to
** eleven widenings a tile).  8192-entry windows packed 1-2% better (1.663
** against 1.688 products per pair at 0.1 m; main kernels 0.5-1% faster) for
** 1.2-1.5 ms a plan.  Hence KernelMap packs a plan only once it has served a
** few passes (torchsp.kmap.REFINE_AFTER).  With the offset sets' widening
** (session 67) packing and plan together took a little less time on the
** H200, despite the widening's extra barrier (fewer widenings a tile, most
** likely; not counted): subm 3x3x3 at 0.05 m 662 -> 619 us, at 0.1 m 684 ->
** 637, the stride-2 K = 3 forward 507 -> 487 (docs/performance-log.md).
*/
#include "conv_internal.cuh"

enum { PACK_THREADS = 1024, PACK_WARPS = PACK_THREADS / 32 };
static_assert(TSP_PACK_WINDOW % PACK_THREADS == 0 && TSP_PACK_WINDOW % TSP_PACK_ROWS == 0,
              "whole tiles and threads per window");
static_assert(TSP_PACK_WINDOW <= 8192, "run indices and entries left fit 13 and 14 bits of the keys");

/* The warp's maximum (MAX) or minimum of k; a butterfly, so every lane gets it. */
template <bool MAX>
static __device__ __forceinline__ uint64_t warp_reduce(uint64_t k) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t y = __shfl_xor_sync(0xffffffffu, k, o);
    k = MAX ? (y > k ? y : k) : (y < k ? y : k);
  }
  return k;
}

/* Exclusive prefix of v over the block's threads in thread order; *total gets the sum.
** Two barriers; every thread calls it. */
static __device__ __forceinline__ int pack_scan(int v, int32_t *wsum, int *total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int x = tsp_warp_scan(v, lane);
  if (lane == 31) wsum[warp] = x;
  __syncthreads();
  const int w = wsum[lane]; /* every warp scans the 32 warp sums itself */
  const int s = tsp_warp_scan(w, lane);
  const int before = __shfl_sync(0xffffffffu, s - w, warp);
  *total = __shfl_sync(0xffffffffu, s, 31);
  __syncthreads(); /* wsum is free again */
  return before + x - v;
}

/* pack_scan's prefix of v and, in *kmax, the block's maximum of k, in the same two barriers. */
static __device__ __forceinline__ int pack_scan_max(int v, uint64_t k, int32_t *wsum, uint64_t *wkey,
                                                    uint64_t *kmax) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int x = tsp_warp_scan(v, lane);
  k = warp_reduce<true>(k);
  if (lane == 31) wsum[warp] = x;
  if (lane == 0) wkey[warp] = k;
  __syncthreads();
  const int w = wsum[lane];
  k = wkey[lane];
  const int s = tsp_warp_scan(w, lane);
  k = warp_reduce<true>(k);
  const int before = __shfl_sync(0xffffffffu, s - w, warp);
  *kmax = k;
  __syncthreads(); /* wsum and wkey are free again */
  return before + x - v;
}

/* The largest seed key of this thread's runs (st: entries left << 8 | given to the tile being
** built; cnt of them from run r0), on what is left once the given entries are out: the most
** entries left, then the larger popcount, then the lower r; 0 when none is left. */
template <int PER>
static __device__ __forceinline__ uint64_t pack_seed_key(const int (&st)[PER], const uint64_t *rm, int cnt, int r0) {
  uint64_t key = 0;
#pragma unroll
  for (int j = 0; j < PER; ++j)
    if (j < cnt && (st[j] >> 8) - (st[j] & 255) > 0) {
      const uint64_t k = (uint64_t)((st[j] >> 8) - (st[j] & 255)) << 20 | (uint64_t)__popcll(rm[j]) << 13 | (uint64_t)(8191 - (r0 + j));
      key = k > key ? k : key;
    }
  return key;
}

/* Widening candidates' indices: a run's is r (< TSP_PACK_WINDOW), a set's
** PACK_SET0 + b1 * 65 for {b1} and PACK_SET0 + b1 * 65 + 1 + b2 for {b1 < b2},
** so runs win ties, then the sets in cpu/tile_pack.c's order. */
enum { PACK_SET0 = 8192 };

/* A widening candidate's key: `extra` offsets per entry of min(gain, need)
** (65536 / 2^14 scaled, exact: cpu/tile_pack.c), then its index.  The block's
** minimum is the candidate taken. */
static __device__ __forceinline__ uint64_t pack_widen_key(uint32_t extra, uint32_t gain, int need, int index) {
  const uint32_t give = gain < (uint32_t)need ? gain : (uint32_t)need;
  return (uint64_t)((extra << 16) / give) << 14 | (uint64_t)index; /* extra <= 64: the quotient fits 23 bits */
}

/* The block's maximum (MAX) or minimum of k, in every thread.  Two barriers. */
template <bool MAX>
static __device__ __forceinline__ uint64_t pack_reduce(uint64_t k, uint64_t *wkey) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  k = warp_reduce<MAX>(k);
  if (lane == 0) wkey[warp] = k;
  __syncthreads();
  k = warp_reduce<MAX>(wkey[lane]);
  __syncthreads(); /* wkey is free again */
  return k;
}

/* out[0, n_rows): the packed order, entries outside [0, n_rows) as -1; -1 in out[n_rows, pad_to). */
template <int PACK_W>
__global__ void __launch_bounds__(PACK_THREADS, 1)
    tile_pack_kernel(const int32_t *__restrict__ map, int64_t n_rows, int volume,
                     const int32_t *__restrict__ order, int32_t *__restrict__ out, int64_t pad_to) {
  enum { PACK_PER = PACK_W / PACK_THREADS };
  extern __shared__ __align__(16) unsigned char pack_smem[]; /* all dynamic: tsp_tile_pack_launch sizes it */
  uint64_t *masks = (uint64_t *)pack_smem;     /* [PACK_W] each entry's offset bits, then each run's */
  uint64_t *wkey = masks + PACK_W;             /* [PACK_WARPS] pack_reduce's */
  int32_t *vals = (int32_t *)(wkey + PACK_WARPS); /* [PACK_W] the entries */
  int32_t *rstart = vals + PACK_W;             /* [PACK_W + 1] run r's first entry; rstart[runs] = len */
  int32_t *wsum = rstart + PACK_W + 1;         /* [PACK_WARPS] pack_scan's */
  int32_t *bucket = wsum + PACK_WARPS;         /* [65] fill: what subset runs can give, by popcount */
  int32_t *fill = bucket + 65;                 /* [3] warp 0's p*, `before` and the need after a fill */
  int32_t *single = fill + 3;                  /* [64] widen: entries of the runs {b} outside the union */
  int32_t *pair = single + 64;                 /* [64 * 64] and of those {b1, b2}, at b1 * 64 + b2 (b1 < b2) */
  const int p = threadIdx.x, lane = p & 31, warp = p >> 5;
  const int64_t base = (int64_t)blockIdx.x * PACK_W;
  if (blockIdx.x == 0)
    for (int64_t i = n_rows + p; i < pad_to; i += PACK_THREADS) out[i] = -1;
  const int len = (int)(n_rows - base < PACK_W ? n_rows - base : PACK_W);
  /* masks: each entry's map row read by a warp in one request (lane k: offset k) */
  for (int it = 0; it < PACK_PER; ++it) {
    const int e = it * PACK_THREADS + p;
    const int32_t r = e < len ? order[base + e] : -1;
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
    if (e < len) {
      masks[e] = m;
      vals[e] = r;
    }
  }
  if (p < 65) bucket[p] = 0;
  if (p < 64) single[p] = 0;
  for (int t = p; t < 64 * 64; t += PACK_THREADS) pair[t] = 0;
  __syncthreads();
  /* runs: thread p scans entries [p PER, p PER + PER) for run starts */
  int n_runs;
  {
    const int e0 = p * PACK_PER;
    int starts = 0;
#pragma unroll
    for (int j = 0; j < PACK_PER; ++j) {
      const int e = e0 + j;
      starts += e < len && (e == 0 || masks[e] != masks[e - 1]);
    }
    int r = pack_scan(starts, wsum, &n_runs);
#pragma unroll
    for (int j = 0; j < PACK_PER; ++j) {
      const int e = e0 + j;
      if (e < len && (e == 0 || masks[e] != masks[e - 1])) rstart[r++] = e;
    }
    if (p == 0) rstart[n_runs] = len;
    __syncthreads();
  }
  /* this thread's runs [r0, r0 + cnt) */
  const int chunk = (n_runs + PACK_THREADS - 1) / PACK_THREADS;
  const int r0 = p * chunk, cnt = max(0, min(chunk, n_runs - r0));
  int st[PACK_PER]; /* entries left << 8 | entries given to this tile (<= 128) */
  { /* masks[r] becomes run r's mask (read all first: a run's first entry may lie in another thread's range) */
    uint64_t m[PACK_PER];
#pragma unroll
    for (int j = 0; j < PACK_PER; ++j) {
      m[j] = j < cnt ? masks[rstart[r0 + j]] : 0;
      st[j] = j < cnt ? (rstart[r0 + j + 1] - rstart[r0 + j]) << 8 : 0;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < PACK_PER; ++j)
      if (j < cnt) masks[r0 + j] = m[j];
    __syncthreads();
  }
  const uint64_t *rm = masks + r0; /* this thread's runs' masks */
  uint64_t key = pack_reduce<true>(pack_seed_key(st, rm, cnt, r0), wkey); /* tile 0's seed; later ones come with the write */
  for (int at = 0; at < len;) {
    const int size = len - at < TSP_PACK_ROWS ? len - at : TSP_PACK_ROWS;
    const int seed = 8191 - (int)(key & 8191u);
    uint64_t u = masks[seed]; /* the seed's mask */
    /* the seed gives first, all it can: the tile is often one run's */
    const int seed_gives = (int)(key >> 20) < size ? (int)(key >> 20) : size;
#pragma unroll
    for (int j = 0; j < PACK_PER; ++j)
      if (r0 + j == seed && j < cnt) st[j] += seed_gives;
    int need = size - seed_gives;
    while (need > 0) {
      /* fill: what subset runs can give, by popcount */
#pragma unroll
      for (int j = 0; j < PACK_PER; ++j) {
        const int avail = (st[j] >> 8) - (st[j] & 255);
        if (j < cnt && avail > 0 && (rm[j] & ~u) == 0) atomicAdd(&bucket[__popcll(rm[j])], avail);
      }
      __syncthreads();
      if (warp == 0) { /* p*: the popcount, from the top, at which the tile fills; -1: it does not */
        const int c0 = bucket[64 - lane], c1 = bucket[32 - lane], c2 = bucket[0]; /* d = lane, lane + 32, 64 */
        const int s0 = tsp_warp_scan(c0, lane);
        const int s1 = tsp_warp_scan(c1, lane) + __shfl_sync(0xffffffffu, s0, 31);
        const int t1 = __shfl_sync(0xffffffffu, s1, 31), t2 = t1 + c2;
        const uint32_t f0 = __ballot_sync(0xffffffffu, s0 >= need), f1 = __ballot_sync(0xffffffffu, s1 >= need);
        int pstar = -1, before = 0; /* before: what the popcounts above p* give */
        if (f0) { /* warp-uniform branches */
          const int d = __ffs(f0) - 1;
          pstar = 64 - d;
          before = __shfl_sync(0xffffffffu, s0 - c0, d);
        } else if (f1) {
          const int d = __ffs(f1) - 1;
          pstar = 32 - d;
          before = __shfl_sync(0xffffffffu, s1 - c1, d);
        } else if (t2 >= need) {
          pstar = 0;
          before = t1;
        }
        if (lane == 0) {
          fill[0] = pstar;
          fill[1] = before;
          fill[2] = pstar < 0 ? need - t2 : 0;
        }
        __syncwarp(); /* every lane's reads of the counts before any lane clears them */
        bucket[64 - lane] = 0;
        bucket[32 - lane] = 0;
        if (lane == 0) bucket[0] = 0;
      }
      __syncthreads();
      /* read before warp 0 writes them again: that follows a barrier of the next fill */
      const int pstar = fill[0], before = fill[1], need_after = fill[2];
      if (pstar < 0) { /* every subset run gives all it can, and the tile is not full yet */
#pragma unroll
        for (int j = 0; j < PACK_PER; ++j)
          if (j < cnt && (rm[j] & ~u) == 0) st[j] += (st[j] >> 8) - (st[j] & 255); /* sums < need <= 128 */
      } else {
        int mine = 0; /* what this thread's runs at p* can give, in run order */
#pragma unroll
        for (int j = 0; j < PACK_PER; ++j)
          if (j < cnt && (rm[j] & ~u) == 0 && __popcll(rm[j]) == pstar) mine += (st[j] >> 8) - (st[j] & 255);
        int total;
        int pre = pack_scan(mine, wsum, &total);
#pragma unroll
        for (int j = 0; j < PACK_PER; ++j) {
          if (!(j < cnt && (rm[j] & ~u) == 0)) continue;
          const int pc = __popcll(rm[j]), avail = (st[j] >> 8) - (st[j] & 255);
          if (pc > pstar) {
            st[j] += avail;
          } else if (pc == pstar && avail > 0) {
            const int want = need - before - pre;
            st[j] += want < 0 ? 0 : want < avail ? want : avail;
            pre += avail;
          }
        }
      }
      need = need_after;
      if (need == 0) break;
      /* widen u by the candidate of least extra offsets per entry it lets in: a run or a set of
      ** one or two offsets (PACK_SET0), ties the lower index */
      uint64_t best = ~(uint64_t)0;
#pragma unroll
      for (int j = 0; j < PACK_PER; ++j) {
        const int avail = (st[j] >> 8) - (st[j] & 255);
        if (j < cnt && avail > 0) {
          const uint64_t d = rm[j] & ~u;
          const uint32_t extra = (uint32_t)__popcll(d);
          const uint64_t k = pack_widen_key(extra, (uint32_t)avail, need, r0 + j);
          best = k < best ? k : best;
          if (extra == 1) atomicAdd(&single[__ffsll((long long)d) - 1], avail);
          else if (extra == 2) atomicAdd(&pair[(__ffsll((long long)d) - 1) * 64 + __ffsll((long long)(d & (d - 1))) - 1], avail);
        }
      }
      __syncthreads();
      if (p < 64 && single[p] > 0) {
        const uint64_t k = pack_widen_key(1, (uint32_t)single[p], need, PACK_SET0 + p * 65);
        best = k < best ? k : best;
      }
      for (int t = p; t < 64 * 64; t += PACK_THREADS)
        if (pair[t] > 0) { /* a window's entries: the sum fits */
          const int b1 = t >> 6, b2 = t & 63;
          const uint64_t k = pack_widen_key(2, (uint32_t)(single[b1] + single[b2] + pair[t]), need,
                                            PACK_SET0 + b1 * 65 + 1 + b2);
          best = k < best ? k : best;
        }
      best = pack_reduce<false>(best, wkey); /* its first barrier follows every read of the counters */
      if (p < 64) single[p] = 0;
      for (int t = p; t < 64 * 64; t += PACK_THREADS) pair[t] = 0;
      const int index = (int)(best & 16383u);
      if (index < PACK_SET0) {
        u |= masks[index];
      } else {
        const int b1 = (index - PACK_SET0) / 65, b2 = (index - PACK_SET0) % 65 - 1;
        u |= (uint64_t)1 << b1 | (b2 >= 0 ? (uint64_t)1 << b2 : 0);
      }
    }
    /* write: the tile's entries run by run, and in the same barriers the next tile's seed */
    int mine = 0;
#pragma unroll
    for (int j = 0; j < PACK_PER; ++j) mine += j < cnt ? st[j] & 255 : 0;
    int pos = at + pack_scan_max(mine, pack_seed_key(st, rm, cnt, r0), wsum, wkey, &key);
    /* each warp copies its lanes' runs together, one run at a time (a run may give 128 entries) */
#pragma unroll
    for (int j = 0; j < PACK_PER; ++j) {
      const int give = j < cnt ? st[j] & 255 : 0;
      const int from = rstart[r0 + j + 1] - (st[j] >> 8); /* the run's next entry */
      for (uint32_t todo = __ballot_sync(0xffffffffu, give > 0); todo; todo &= todo - 1) {
        const int l = __ffs(todo) - 1;
        const int g = __shfl_sync(0xffffffffu, give, l), f = __shfl_sync(0xffffffffu, from, l);
        const int64_t o = base + __shfl_sync(0xffffffffu, pos, l);
        for (int i = lane; i < g; i += 32) {
          const int32_t r = vals[f + i];
          out[o + i] = r < 0 || r >= n_rows ? -1 : r;
        }
      }
      pos += give;
      st[j] = ((st[j] >> 8) - give) << 8;
    }
    at += size;
  }
}

template <int PACK_W>
static tsp_status pack_launch(const int32_t *map, int64_t n_rows, int64_t volume, const int32_t *order,
                              int32_t *out, int64_t pad_to, cudaStream_t stream) {
  const int64_t windows = (n_rows + PACK_W - 1) / PACK_W;
  if (windows < 1) return TSP_OK;
  const size_t smem = (size_t)(PACK_W + PACK_WARPS) * sizeof(uint64_t) +
                      (size_t)(2 * PACK_W + 1 + PACK_WARPS + 68 + 64 + 64 * 64) * sizeof(int32_t);
  static uint64_t smem_raised = 0;
  const tsp_status s = tsp_raise_smem_limit((const void *)tile_pack_kernel<PACK_W>, smem, &smem_raised, "tsp_tile_pack");
  if (s != TSP_OK) return s;
  tile_pack_kernel<PACK_W><<<(unsigned)windows, PACK_THREADS, smem, stream>>>(map, n_rows, (int)volume, order, out, pad_to);
  return tsp_cuda_check_launch("tsp_tile_pack");
}

/* The packed order of map and order into out[0, n_rows) (conv_internal.cuh). */
tsp_status tsp_tile_pack_launch(const int32_t *map, int64_t n_rows, int64_t volume, const int32_t *order,
                                int32_t *out, int64_t pad_to, cudaStream_t stream) {
  return pack_launch<TSP_PACK_WINDOW>(map, n_rows, volume, order, out, pad_to, stream);
}
