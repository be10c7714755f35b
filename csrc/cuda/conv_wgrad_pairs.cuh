/*
** conv_wgrad_pairs.cuh: what the two tensor-core wgrad kernels share
** (conv_wgrad.cu on mma.sync, conv_wgmma_wgrad.cu on wgmma): the
** compaction of one map column into a shared-memory pair list, the pair
** slots of dataflow 1 (pieces and offset groups over a map's pair list; the
** kernel streams each slot's pairs itself, conv_wgmma_wgrad.cu) and the
** store of two adjacent dw (or fp32 partial) elements.
**
** A wgrad block owns (row chunk, offset k, c_in tile, c_out tile); rows are
** the reduction dimension, so its pairs are the rows q of the chunk with
** nbmap[q, k] present.  They are compacted in row order (warp ballots), which
** fixes the summation order: the result is bitwise reproducible.
*/
#ifndef TSP_CONV_WGRAD_PAIRS_CUH
#define TSP_CONV_WGRAD_PAIRS_CUH

#include <stdint.h>

#include "conv_internal.cuh"

/* The pair list of a batch: LIST pairs (s_p, s_q); ROWS map entries per
** thread are loaded before each compaction round so that they are in flight
** together (one at a time cost a round trip per 128 rows).  conv_wgrad.cu
** uses WG_LIST x WG_ROWS; conv_wgmma_wgrad.cu a longer list and more rows in
** flight (see there). */
enum { WG_LIST = 2048, WG_ROWS = 4 };

/* Shared memory of a pair list: s_p, s_q, then `rows` counts per warp. */
static inline size_t tsp_wgrad_list_bytes(int warps, int list, int rows) {
  return (size_t)list * 8 + (size_t)rows * warps * 4;
}

/* What a wgrad block owns: c_out columns from n0, c_in rows from m0 (tiles
** of bn x bm), offset k, and the output rows [q0, q1) of its chunk.  Block
** indices run c_out tiles fastest, then c_in tiles, offsets, chunks, so the
** blocks resident together share a chunk's rows in L2. */
typedef struct {
  int n0, m0, k;
  int64_t chunk, q0, q1;
} tsp_wgrad_block;

static __device__ __forceinline__ tsp_wgrad_block tsp_wgrad_block_at(int bm, int bn, int c_in,
                                                                     int c_out, int volume,
                                                                     int64_t rows_per_chunk,
                                                                     int64_t n_out) {
  const int tiles_n = (c_out + bn - 1) / bn, tiles_m = (c_in + bm - 1) / bm;
  int64_t b = blockIdx.x;
  tsp_wgrad_block o;
  o.n0 = (int)(b % tiles_n) * bn;
  b /= tiles_n;
  o.m0 = (int)(b % tiles_m) * bm;
  b /= tiles_m;
  o.k = (int)(b % volume);
  o.chunk = b / volume;
  o.q0 = o.chunk * rows_per_chunk;
  o.q1 = o.q0 + rows_per_chunk < n_out ? o.q0 + rows_per_chunk : n_out;
  return o;
}

/* Compacts the present pairs of map column k over rows [*scan, q1) into
** s_p (input rows) and s_q (output rows) until the LIST-pair list could overflow;
** advances *scan past the rows read and returns the pair count.  Called by
** all NT threads (block-uniform); ends with a barrier, so the list is ready
** and s_warp free.  Entries outside [0, n_in) count as absent. */
template <int NT, int LIST, int ROWS>
static __device__ __forceinline__ int tsp_wgrad_compact(const int32_t *__restrict__ map, int volume,
                                                        int k, int64_t n_in, int64_t *scan,
                                                        int64_t q1, int32_t *s_p, int32_t *s_q,
                                                        int32_t *s_warp) {
  enum { WARPS = NT / 32 };
  static_assert(LIST >= ROWS * NT, "the list holds one batch");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int count = 0;
  while (*scan < q1 && count + ROWS * NT <= LIST) {
    int32_t p[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const int64_t q = *scan + j * NT + tid;
      p[j] = q < q1 ? map[q * volume + k] : -1;
    }
    unsigned ballot[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      if (p[j] < 0 || (int64_t)p[j] >= n_in) p[j] = -1;
      ballot[j] = __ballot_sync(0xffffffffu, p[j] >= 0);
      if (lane == 0) s_warp[j * WARPS + warp] = __popc(ballot[j]);
    }
    __syncthreads();
    /* Pairs land in row order: batch j, then warp, then lane. */
    int offset = count;
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      int before = 0, total = 0;
      for (int w = 0; w < WARPS; ++w) {
        const int c = s_warp[j * WARPS + w];
        before += w < warp ? c : 0;
        total += c;
      }
      if (p[j] >= 0) {
        const int pos = offset + before + __popc(ballot[j] & ((1u << lane) - 1));
        s_p[pos] = p[j];
        s_q[pos] = (int32_t)(*scan + j * NT + tid);
      }
      offset += total;
    }
    count = offset;
    *scan += ROWS * NT;
    __syncthreads(); /* s_warp is rewritten next batch; the list is read after */
  }
  return count;
}

/* ------------------------------------------------------- pair pieces --- */
/* wgrad dataflow 1 (conv_wgmma_wgrad.cu): the map's pair list (kmap_pairs.cu,
** built on the device into the workspace: offset k owns pairs[starts[k] ..
** starts[k + 1])) is cut into `pieces` equal runs of tsp_wgrad_piece_len
** pairs, whatever offsets they fall in, so every block gets the same work
** (the centre offset of a submanifold map no longer sets the length).  A
** piece g writes one fp32 partial per offset k it meets, at slot g + k: two
** pieces meeting the same slot would need g' + k' = g + k with g' > g and
** k' < k, i.e. an earlier offset reaching past a later piece's start, which
** the sorted list rules out.  Slots: pieces + V - 1. */
static __host__ __device__ __forceinline__ int64_t tsp_wgrad_piece_len(int64_t total,
                                                                       int64_t pieces) {
  return total > 0 ? (total + pieces - 1) / pieces : 1;
}

/* starts[k] clamped to [0, total], and total = starts[V] clamped to [0,
** n_pairs]: a pair list cached by the caller (tsp_conv_problem.pairs) is not
** trusted to be this map's, so no index taken from it leaves its arrays. */
static __device__ __forceinline__ int64_t tsp_pair_start(const int64_t *__restrict__ starts, int k,
                                                         int64_t total) {
  const int64_t v = starts[k];
  return v < 0 ? 0 : v > total ? total : v;
}

static __device__ __forceinline__ int64_t tsp_pair_total(const int64_t *__restrict__ starts,
                                                         int volume, int64_t n_pairs) {
  return tsp_pair_start(starts, volume, n_pairs);
}

/* Offset groups, the other way to share the pair list out (used instead of
** the equal pieces whenever every offset with pairs can have a block of its
** own): offset k's S_k 64-pair slabs are dealt round-robin to B_k =
** ceil(S_k / L) blocks, L the smallest slab count for which the groups fit
** in `groups` blocks, so no block has more than L slabs.  Block j of group k
** sums slabs j, j + B_k, j + 2 B_k, ... into partial slot first_k + j
** (first_k = B_0 + ... + B_{k-1}); dw[k] adds slots first_k .. first_{k+1}
** - 1 in order.  Why: equal pieces are contiguous runs of the list, so the
** resident blocks stream 132 different stretches of rows at once; at C =
** 256 the x and dy rows (64 MB each) then mostly miss L2 (Nsight Compute,
** H100, lidar_198k: L2 hit rate 28%, DRAM 67% busy at 2.25 TB/s, 269 us).
** The blocks of a group read neighbouring slabs, and all groups move
** through the rows at about the same pace, so each row comes from DRAM
** about once. */
/* One whole warp: slabs[k] = S_k for every offset (`slabs`: shared memory,
** `volume` entries), then L, or 0 when the groups cannot be formed (more
** offsets with pairs than blocks, no pair at all, or a list too long for
** 32-bit slab counts): then the equal pieces.  Lane-uniform. */
static __device__ int32_t tsp_wgrad_group_len(const int64_t *__restrict__ starts, int volume,
                                              int64_t total, int64_t groups, int32_t *slabs) {
  const int lane = threadIdx.x & 31;
  if (total >= (1LL << 36) || groups >= (1LL << 30)) return 0;
  int32_t most = 0, used = 0;
  int64_t all = 0; /* T = sum_k S_k */
  for (int k = lane; k < volume; k += 32) {
    const int64_t a = tsp_pair_start(starts, k, total), b = tsp_pair_start(starts, k + 1, total);
    const int32_t s = b > a ? (int32_t)((b - a + 63) / 64) : 0;
    slabs[k] = s;
    most = s > most ? s : most;
    used += s > 0;
    all += s;
  }
  for (int o = 16; o > 0; o >>= 1) {
    most = max(most, __shfl_xor_sync(0xffffffffu, most, o));
    used += __shfl_xor_sync(0xffffffffu, used, o);
    all += __shfl_xor_sync(0xffffffffu, (long long)all, o);
  }
  __syncwarp();
  if (most == 0 || used > groups) return 0;
  /* sum_k ceil(S_k / L) lies in [T / L, T / L + used), so L is at least
  ** ceil(T / groups) and at most ceil(T / (groups - used)) */
  int64_t lo = (all + groups - 1) / groups, hi = most;
  if (groups > used) hi = min(hi, (all + groups - used - 1) / (groups - used));
  lo = max(lo, (int64_t)1);
  while (lo < hi) {
    const int32_t mid = (int32_t)(lo + (hi - lo) / 2);
    int32_t need = 0;
    for (int k = lane; k < volume; k += 32) need += (slabs[k] + mid - 1) / mid;
    for (int o = 16; o > 0; o >>= 1) need += __shfl_xor_sync(0xffffffffu, need, o);
    if (need <= groups) hi = mid;
    else lo = mid + 1;
  }
  return (int32_t)lo;
}

/* One whole warp, len > 0, `slabs` as tsp_wgrad_group_len left it: group
** slot g's offset (*k; -1 when g is past the last group), its member index
** *j and group size *b.  With `firsts` (volume + 1 entries) also writes every
** first_k and the total. */
static __device__ void tsp_wgrad_group_of(const int32_t *slabs, int volume, int32_t len, int64_t g,
                                          int *k, int64_t *j, int64_t *b, int64_t *firsts) {
  const int lane = threadIdx.x & 31;
  int64_t base = 0;
  *k = -1, *j = 0, *b = 0;
  for (int k0 = 0; k0 < volume; k0 += 32) {
    const int kk = k0 + lane;
    const int32_t size = kk < volume ? (slabs[kk] + len - 1) / len : 0;
    int32_t inc = size; /* inclusive scan over the lanes */
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t t = __shfl_up_sync(0xffffffffu, inc, o);
      if (lane >= o) inc += t;
    }
    const int64_t first = base + inc - size;
    if (firsts && kk < volume) firsts[kk] = first;
    const unsigned hit = __ballot_sync(0xffffffffu, size > 0 && g >= first && g < first + size);
    if (hit && *k < 0) {
      const int src = __ffs(hit) - 1;
      *k = k0 + src;
      *j = g - __shfl_sync(0xffffffffu, (long long)first, src);
      *b = __shfl_sync(0xffffffffu, size, src);
    }
    base += __shfl_sync(0xffffffffu, inc, 31);
  }
  if (firsts && lane == 0) firsts[volume] = base;
}

/* dw[k][m][col..col+1] = (v0, v1), or with row chunks the fp32 partials
** [chunks, V, c_in, c_out] of this chunk (tsp_conv_reduce_partials adds them). */
template <typename T>
static __device__ __forceinline__ void tsp_wgrad_store2(float *partials, T *dw, int64_t chunk,
                                                        int volume, int k, int c_in, int c_out,
                                                        int m, int col, float v0, float v1) {
  const int64_t vcc = (int64_t)c_in * c_out, at = (int64_t)m * c_out + col;
  if (partials)
    *(float2 *)(partials + (chunk * volume + k) * vcc + at) = make_float2(v0, v1);
  else
    tsp_store2(dw + (int64_t)k * vcc + at, v0, v1);
}

#endif /* TSP_CONV_WGRAD_PAIRS_CUH */
