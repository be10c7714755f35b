/*
** conv_tile.cuh: the first phase that the output-stationary tensor-core
** kernels (conv_implicit_gemm.cu: mma.sync, conv_wgmma.cu: wgmma, both
** fp16/bf16; conv_tf32.cu: mma.sync tf32 for float32) share: a block of BM
** output rows reads its rows' map entries into shared memory and lists the
** offsets that some row of the tile uses.
**
** Why shared: the row order, the sanitising of map entries and the per-offset
** 16-row-group masks must agree exactly between the kernels, which are
** tested against the same reference.
**
** Output, all in shared memory (tsp_tile_smem, after the kernel's operand
** stages; tsp_tile_smem_bytes of it):
**   nb[BM * volume]  map entry of (tile row i, offset k), or -1 (absent, or
**                    outside [0, src_rows), or a tile row past the end, or an
**                    offset outside the segment's `offsets` mask);
**   rows[BM]         the map row of tile row i (order[row0 + i] or row0 + i),
**                    -1 when none: its output is not written;
**   groups[volume]   bit g set when a row of 16-row group g uses offset k;
**   list[volume], *count: the offsets with groups[k] != 0, increasing.
** Ends with a __syncthreads(); every thread of the block must call it.
** tsp_tile_epilogue (over tsp_tile_read2 and tsp_tile_write2) is the shared epilogue: a sweep that
** adds the fp32 partial sums of a segmented pass (conv.cu), or the output
** itself, where the launch's mode reads them, then a sweep that stores or
** writes the partial sums.
*/
#ifndef TSP_CONV_TILE_CUH
#define TSP_CONV_TILE_CUH

#include <stdint.h>

#include "conv_internal.cuh"
#include "conv_mma.cuh"

typedef struct {
  int32_t *nb;      /* [BM * volume] sanitised map entries of the tile's rows */
  uint32_t *groups; /* [volume] per offset, the 16-row groups that use it */
  int32_t *list;    /* [volume] the used offsets, increasing */
  int32_t *count;   /* [1] (4 words reserved) how many offsets list holds */
  int32_t *rows;    /* [BM] map row of each tile row, -1 = none */
} tsp_tile_smem;

/* Words of a step plan record's head: groups[V], list[V], count and 3 spare
** words, rows[BM], padded to whole 16-byte chunks (tsp_tile_from_steps). */
static __host__ __device__ __forceinline__ int64_t tsp_steps_head_words(int bm, int volume) {
  return ((int64_t)2 * volume + 4 + bm + 3) & ~(int64_t)3;
}

/* Words of one tile's step plan record: the head, then BM entries per used offset. */
static __host__ __device__ __forceinline__ int64_t tsp_steps_words(int bm, int volume) {
  return tsp_steps_head_words(bm, volume) + (int64_t)bm * volume;
}

static __host__ __device__ __forceinline__ size_t tsp_tile_smem_bytes(int bm, int volume) {
  return (size_t)bm * volume * 4 + (size_t)tsp_steps_head_words(bm, volume) * 4;
}

static __device__ __forceinline__ tsp_tile_smem tsp_tile_smem_at(void *base, int bm, int volume) {
  tsp_tile_smem t;
  t.nb = (int32_t *)base;
  t.groups = (uint32_t *)(t.nb + bm * volume);
  t.list = (int32_t *)(t.groups + volume);
  t.count = t.list + volume;
  t.rows = t.count + 4;
  return t;
}

/* Tile `tile` of `tiles` (block blockIdx.x of gridDim.x, one block per tile,
** in tsp_tile_origin): its first row and first produced channel.
** Column tiles vary fastest, so the blocks that gather the same rows run together.
** Row tiles go in reverse (the launch is tiles_m * tiles_n blocks): the mask
** order puts the rows with rare offsets, whose tiles use the most offsets,
** last, and blocks start roughly in index order, so walking it forward left
** the longest tiles for the final wave.  On lidar_198k (128-row tiles, 3x3x3)
** the last tiles use 25-27 offsets against 6.8-12.6 on average; a greedy
** schedule of those tile lengths over 132 SMs ends 13-30% past the ideal
** forward and 2.5% past it reversed. */
static __device__ __forceinline__ void tsp_tile_origin_of(int64_t tile, int64_t tiles, int n, int bm,
                                                          int bn, int64_t *row0, int *n0) {
  const int tiles_n = (n + bn - 1) / bn;
  const int64_t tiles_m = tiles / tiles_n;
  const int64_t b = tile / tiles_n;
  *n0 = (int)(tile - b * tiles_n) * bn;
  *row0 = (tiles_m - 1 - b) * bm;
}

/* As tsp_tile_origin_of, for a kernel that takes a step plan's row tiles in
** its schedule (torchsp.h): row tile b of the walk is record sched[b], or
** tiles_m - 1 - b when that entry is out of range.  The entry is read first
** (tsp_steps_sched_entry, steps: the first record; -1 past the last tile), so
** that a kernel can ask for it ahead of the tile. */
static __device__ __forceinline__ int32_t tsp_steps_sched_entry(const int32_t *__restrict__ steps, int64_t tile,
                                                                int64_t tiles, int n, int bm, int bn, int volume) {
  const int tiles_n = (n + bn - 1) / bn;
  const int64_t tiles_m = tiles / tiles_n;
  return tile >= 0 && tile < tiles ? steps[tiles_m * tsp_steps_words(bm, volume) + tile / tiles_n] : -1;
}

static __device__ __forceinline__ void tsp_tile_origin_sched(int32_t entry, int64_t tile, int64_t tiles, int n,
                                                             int bm, int bn, int64_t *row0, int *n0) {
  const int tiles_n = (n + bn - 1) / bn;
  const int64_t tiles_m = tiles / tiles_n;
  const int64_t b = tile / tiles_n;
  *n0 = (int)(tile - b * tiles_n) * bn;
  *row0 = (entry >= 0 && entry < tiles_m ? (int64_t)entry : tiles_m - 1 - b) * bm;
}

static __device__ __forceinline__ void tsp_tile_origin(int n, int bm, int bn, int64_t *row0,
                                                       int *n0) {
  tsp_tile_origin_of(blockIdx.x, gridDim.x, n, bm, bn, row0, n0);
}

/* Split-K (splits > 1): the launch is tiles * splits blocks and block b sums
** run b % splits of tile b / splits (tsp_tile_list cuts the runs), so the
** runs of one tile, which gather the same rows, run side by side. */
static __device__ __forceinline__ void tsp_tile_origin_split(int n, int bm, int bn, int splits,
                                                             int64_t *row0, int *n0, int *split) {
  const int s = splits > 1 ? splits : 1;
  *split = (int)(blockIdx.x % s);
  tsp_tile_origin_of(blockIdx.x / s, gridDim.x / s, n, bm, bn, row0, n0);
}

/* Where run `split` of a split-K launch writes its fp32 partial sums [rows, n]. */
static __device__ __forceinline__ float *tsp_split_accum(float *accum, int split, int64_t rows, int n) {
  return split > 0 ? accum + (int64_t)split * rows * n : accum;
}

/* `rows`: rows of map (order entries outside [0, rows) name no row);
** `tile_rows`: entries of order the tiles walk (rows when order is NULL);
** `offsets`: bit k set when offset k takes part (others read as absent).
**
** One warp per pass of PASS_ROWS consecutive tile rows (one or two 16-row
** groups): lane j reads the order entry of row j, then lane k reads entry k
** of every row of the pass (rows broadcast by shuffle), so each row is one
** coalesced request and all the pass's loads are in flight together: two
** memory round trips per tile, and the lane that holds (group, k) sets the
** group's bit of offset k without a second pass over shared memory.  (Each
** thread reading its own row's entries one by one made 27 scattered 4-byte
** requests per row: Nsight Compute put a third of the C = 64 wgmma
** kernel's stall samples on the shared stores waiting for those loads.) */
/* The barrier among the NT threads that build a tile: the whole block
** (BAR == 0), or hardware barrier BAR over threads [NT_first, NT_first + NT)
** in whole warps (the warp-specialized kernel's producers). */
template <int BAR, int NT> static __device__ __forceinline__ void tsp_tile_sync() {
  if (BAR == 0)
    __syncthreads();
  else
    asm volatile("bar.sync %0, %1;\n" ::"n"(BAR), "n"(NT) : "memory");
}

/* The pieces of tsp_tile_offsets_by, the tile's first phase.  A warp's pass
** covers PASS_ROWS consecutive tile rows from `first`. */

/* Tile plans.  With a plan (torchsp.h, tsp_conv_problem.order_plan) the
** launch also gets plan_map, the map rows in tile order [tile_rows, volume]
** (NULL without one).  The warp-specialized producers' loop below then reads
** a pass's map entries from it in the same round trip as the order entries,
** no load waiting on another: C = 128 tile 15 main kernel 148.9 / 148.7 ->
** 133.8 / 133.9 us fwd, 148.5 / 146.6 -> 133.3 / 131.3 dgrad (H100, same
** run, two rounds each, 2026-11-25).  The all-warps path keeps reading the
** map through the order, and the other kernels get plan_map == NULL: the
** plan's rows made the mma.sync kernel slower (C = 32 fwd 41.1 -> 51.9 us,
** same run) and tile 13 no faster. */

/* Lane j < PASS_ROWS: the map row of tile row first + j (order[row0 + first +
** j], or row0 + first + j without an order), -1 when there is none (a row
** past the tile's rows_here, or an order entry outside [0, rows)). */
template <int PASS_ROWS>
static __device__ __forceinline__ int32_t tsp_tile_row_of(const int32_t *__restrict__ order, int64_t rows,
                                                          int64_t rows_here, int64_t row0, int first,
                                                          int lane) {
  int32_t r = -1;
  if (lane < PASS_ROWS && first + lane < rows_here) {
    if (order == nullptr) {
      r = (int32_t)(row0 + first + lane);
    } else {
      r = order[row0 + first + lane];
      if (r < 0 || (int64_t)r >= rows) r = -1;
    }
  }
  return r;
}

/* Issue the loads of entries k0 + lane of the pass's rows: p[j] is entry k0 +
** lane of row j, -1 when the row, the offset or the segment's `offsets` bit
** is absent.  From the map (r: tsp_tile_row_of's lane value, broadcast by
** shuffle) or from plan_map's rows directly (rows that r says are absent are
** cleared by tsp_tile_store_pass).  The values are not read here, so the
** loads stay in flight until tsp_tile_store_pass. */
template <int PASS_ROWS>
static __device__ __forceinline__ void tsp_tile_fetch_pass(const int32_t *__restrict__ map,
                                                           const int32_t *__restrict__ plan_map, int32_t r,
                                                           int64_t rows_here, int64_t row0, int first,
                                                           int k0, int volume, uint64_t offsets, int lane,
                                                           int32_t (&p)[PASS_ROWS]) {
  const int k = k0 + lane;
  const bool takes_part = k < volume && ((offsets >> (k & 63)) & 1u); /* volume <= 64 */
  if (plan_map != nullptr) {
    const int32_t *q = plan_map + (row0 + first) * volume + k;
#pragma unroll
    for (int j = 0; j < PASS_ROWS; ++j)
      p[j] = first + j < rows_here && takes_part ? q[(int64_t)j * volume] : -1;
    return;
  }
#pragma unroll
  for (int j = 0; j < PASS_ROWS; ++j) {
    const int32_t rj = __shfl_sync(0xffffffffu, r, j);
    p[j] = rj >= 0 && takes_part ? map[(int64_t)rj * volume + k] : -1;
  }
}

/* Store a pass's fetched entries (entries outside [0, src_rows), and with
** plan_map those of rows r names none, become -1) and set, for each offset,
** the bits of the 16-row groups g0, g0 + 1 that use it. */
template <int PASS_ROWS>
static __device__ __forceinline__ void tsp_tile_store_pass(int32_t (&p)[PASS_ROWS], const int32_t *plan_map,
                                                           int32_t r, int k0, int volume,
                                                           int64_t src_rows, int first, int g0, int lane,
                                                           const tsp_tile_smem &t) {
  const int k = k0 + lane;
  uint32_t bits = 0;
#pragma unroll
  for (int j = 0; j < PASS_ROWS; ++j) {
    if (plan_map != nullptr && __shfl_sync(0xffffffffu, r, j) < 0) p[j] = -1;
    if (p[j] < 0 || (int64_t)p[j] >= src_rows) p[j] = -1;
    if (k < volume) t.nb[(first + j) * volume + k] = p[j];
    if (p[j] >= 0) bits |= 1u << (g0 + j / 16);
  }
  if (bits) atomicOr(&t.groups[k], bits);
}

/* After every pass stored and a barrier: warp 0 lists the offsets some row of
** the tile uses, in increasing k (a warp ballot compacts); then a barrier.
** splits > 1 (split-K): list and count keep run `split` of `splits` equal runs
** of the used offsets, so the tiles' runs share the tile's work evenly; a run
** may be empty (it then sums nothing: zeros).  groups keeps every used offset. */
template <int NT, int BAR>
static __device__ __forceinline__ void tsp_tile_list(const tsp_tile_smem &t, int volume, int lane, int warp,
                                                     int split, int splits) {
  if (warp == 0) {
    int count = 0;
    for (int base = 0; base < volume; base += 32) {
      const int k = base + lane;
      const bool used = k < volume && t.groups[k] != 0;
      const unsigned ballot = __ballot_sync(0xffffffffu, used);
      if (used) t.list[count + __popc(ballot & ((1u << lane) - 1))] = k;
      count += __popc(ballot);
    }
    if (splits > 1) { /* keep entries [lo, hi) of the list (volume <= 64: two per lane) */
      const int lo = split * count / splits, hi = (split + 1) * count / splits;
      __syncwarp();
      const int k0 = lo + lane < hi ? t.list[lo + lane] : 0;
      const int k1 = lo + lane + 32 < hi ? t.list[lo + lane + 32] : 0;
      __syncwarp();
      if (lo + lane < hi) t.list[lane] = k0;
      if (lo + lane + 32 < hi) t.list[lane + 32] = k1;
      count = hi - lo;
    }
    if (lane == 0) *t.count = count;
  }
  tsp_tile_sync<BAR, NT>();
}

/* tsp_tile_offsets by NT threads numbered tid = 0 .. NT - 1 that meet at barrier BAR
** (split-K: see tsp_tile_list). */
template <int BM, int NT, int BAR>
static __device__ __forceinline__ void tsp_tile_offsets_by(
    const int32_t *__restrict__ map, const int32_t *__restrict__ order,
    const int32_t *__restrict__ plan_map, int64_t rows,
    int64_t tile_rows, int64_t row0, int volume, uint64_t offsets, int64_t src_rows,
    const tsp_tile_smem &t, const int tid, int split = 0, int splits = 1) {
  static_assert(BM % 16 == 0 && BM / 16 <= 32, "16-row groups; row-group masks are 32-bit");
  enum { G = BM / 16, WARPS = NT / 32, PASS_G = G >= 2 * WARPS ? 2 : 1, PASS_ROWS = 16 * PASS_G };
  const int lane = tid & 31, warp = tid >> 5;
  const int64_t rows_here = tile_rows - row0 < BM ? tile_rows - row0 : BM;
  if (BAR == 0 && volume <= 32 && G <= WARPS * PASS_G) {
    /* A whole block, one pass per warp, one entry per lane (3x3x3, 2x2x2):
    ** the pass's loads go out before the barrier that clears groups, and it
    ** needs no loop over passes or 32-offset chunks.  Main kernel, H100, same
    ** run, two rounds, against the loop below (us): C = 32 (mma.sync) fwd
    ** 54.5 / 54.2 -> 43.2 / 43.1, dgrad 52.1 / 51.9 -> 42.8 / 42.7; C = 64
    ** (wgmma tile 13) fwd 78.2 / 78.4 -> 67.2 / 66.6, dgrad 78.4 / 78.1 ->
    ** 67.2 / 66.2 (2026-11-25).  The warp-specialized producers (BAR != 0)
    ** keep the loop: this order made tile 15 slower, C = 128 fwd 147.8 /
    ** 148.7 -> 160.1 / 158.2 in that run. */
    const int g0 = warp * PASS_G, first = g0 * 16;
    const int32_t r = tsp_tile_row_of<PASS_ROWS>(order, rows, rows_here, row0, first, lane);
    int32_t p[PASS_ROWS];
    tsp_tile_fetch_pass<PASS_ROWS>(map, nullptr, r, rows_here, row0, first, 0, volume, offsets, lane, p);
    for (int i = tid; i < volume; i += NT) t.groups[i] = 0;
    tsp_tile_sync<BAR, NT>();
    if (g0 < G) {
      if (lane < PASS_ROWS) t.rows[first + lane] = r;
      tsp_tile_store_pass<PASS_ROWS>(p, nullptr, r, 0, volume, src_rows, first, g0, lane, t);
    }
    tsp_tile_sync<BAR, NT>();
    tsp_tile_list<NT, BAR>(t, volume, lane, warp, split, splits);
    return;
  }
  /* Any other shape or caller: pass by pass, 32 offsets at a time. */
  for (int i = tid; i < volume; i += NT) t.groups[i] = 0;
  tsp_tile_sync<BAR, NT>();
  for (int g0 = warp * PASS_G; g0 < G; g0 += WARPS * PASS_G) {
    const int first = g0 * 16;
    const int32_t r = tsp_tile_row_of<PASS_ROWS>(order, rows, rows_here, row0, first, lane);
    if (lane < PASS_ROWS) t.rows[first + lane] = r;
    for (int k0 = 0; k0 < volume; k0 += 32) {
      int32_t p[PASS_ROWS];
      tsp_tile_fetch_pass<PASS_ROWS>(map, plan_map, r, rows_here, row0, first, k0, volume, offsets, lane, p);
      tsp_tile_store_pass<PASS_ROWS>(p, plan_map, r, k0, volume, src_rows, first, g0, lane, t);
    }
  }
  tsp_tile_sync<BAR, NT>();
  tsp_tile_list<NT, BAR>(t, volume, lane, warp, split, splits);
}

/* The whole block builds its tile (the usual case). */
template <int BM, int NT>
static __device__ __forceinline__ void tsp_tile_offsets(
    const int32_t *__restrict__ map, const int32_t *__restrict__ order,
    const int32_t *__restrict__ plan_map, int64_t rows,
    int64_t tile_rows, int64_t row0, int volume, uint64_t offsets, int64_t src_rows,
    const tsp_tile_smem &t, int split = 0, int splits = 1) {
  tsp_tile_offsets_by<BM, NT, 0>(map, order, plan_map, rows, tile_rows, row0, volume, offsets, src_rows, t,
                                 (int)threadIdx.x, split, splits);
}

/* Step plans (torchsp.h, tsp_tile_steps_*).  A pass's tiles can be listed
** once per map instead of in every launch: tile_steps.cu runs the first phase
** above for every 128-row tile of a row order and writes, per tile t, a
** record of tsp_steps_words(128, V) int32 words at steps + t * that:
**   head  groups[V], list[V], count, 3 spare, rows[BM] (tsp_tile_smem's
**         layout from groups on, so it lands there as one contiguous copy),
**         padded to tsp_steps_head_words;
**   cols  count columns of BM words: column j holds the tile rows' entries
**         of offset list[j] (-1 absent), in tile-row order.
** A kernel given the plan copies its tile's record into shared memory (two
** memory round trips: count with the head and the first two columns, then
** the rest) and reads the entry of (row r,
** list index j) at nb[j * BM + r] instead of nb[r * V + list[j]]
** (tsp_tile_entry).  Why: on lidar_198k at C = 32 the first phase was 29% of
** the mma.sync kernel's instructions and ~20% of its stall samples (Nsight
** Compute, H100, 2026-11-26): 27 map entries per row read and sorted in
** every launch where a tile uses ~6.5 offsets.  The plan is built once per
** map and pass and read contiguously.
** A plan is data the caller passes in, so every word is checked as it
** lands (the copying thread owns the word, no second barrier): count within
** [0, V], list entries within [0, V), output rows within [-1, rows), map
** entries within [-1, src_rows).  A wrong plan gives wrong sums, never an
** access out of bounds. */
/* Copies a record's head (groups, list, count, rows: tsp_tile_smem's layout
** from groups on) into t, checking each word as it lands; thread tid of NT. */
template <int BM, int NT>
static __device__ __forceinline__ void tsp_steps_copy_head(const int32_t *__restrict__ rec, int volume,
                                                           int64_t rows, const tsp_tile_smem &t, int tid) {
  const int head = (int)tsp_steps_head_words(BM, volume);
  for (int i = tid; i < head / 4; i += NT) {
    int4 v = *(const int4 *)(rec + 4 * i);
    int *e = (int *)&v;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int w = 4 * i + q; /* word of the head: groups, list, count, spare, rows */
      if (w >= volume && w < 2 * volume && (e[q] < 0 || e[q] >= volume)) e[q] = 0;
      if (w == 2 * volume) e[q] = e[q] < 0 ? 0 : e[q] > volume ? volume : e[q];
      if (w >= 2 * volume + 4 && (e[q] < -1 || (int64_t)e[q] >= rows)) e[q] = -1;
    }
    if (4 * i + 3 <= 2 * volume || 4 * i >= 2 * volume + 4) {
      *(int4 *)(t.groups + 4 * i) = v;
    } else { /* the 3 words after count are the kernel's own (ws_tile_index): kept */
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (4 * i + q <= 2 * volume || 4 * i + q >= 2 * volume + 4) ((int32_t *)t.groups)[4 * i + q] = e[q];
    }
  }
}

/* Four map entries of a record's column into shared memory at dst, each
** outside [-1, src_rows) stored as -1 (absent), as every plan word is checked
** where it lands. */
static __device__ __forceinline__ void tsp_steps_store_entries(int32_t *dst, int4 v, int64_t src_rows) {
  int *e = (int *)&v;
#pragma unroll
  for (int q = 0; q < 4; ++q)
    if (e[q] < -1 || (int64_t)e[q] >= src_rows) e[q] = -1;
  *(int4 *)dst = v;
}

/* The step plan record of the tile at row0 (its head, then its columns). */
template <int BM>
static __device__ __forceinline__ const int32_t *tsp_steps_rec(const int32_t *__restrict__ steps, int64_t row0,
                                                               int volume) {
  return steps + (row0 / BM) * tsp_steps_words(BM, volume);
}

template <int BM, int NT, int BAR>
static __device__ __forceinline__ void tsp_tile_from_steps_by(const int32_t *__restrict__ steps, int64_t row0,
                                                              int volume, int64_t rows, int64_t src_rows,
                                                              const tsp_tile_smem &t, int tid) {
  const int head = (int)tsp_steps_head_words(BM, volume);
  const int32_t *rec = tsp_steps_rec<BM>(steps, row0, volume);
  const int4 *cols = (const int4 *)(rec + head);
  /* Columns 0 and 1 are requested with the head, before count is known (as
  ** the ring's first phase does): the record's first bytes in one request, and
  ** a one-offset tile (stride-2 K = 2 and its transpose) in one round trip.
  ** The record has room for V columns, so these loads stay inside it; the
  ** words of columns past count are dropped.  Main kernel us, H200,
  ** lidar_198k, fp16, two rounds each in one call against reading count first
  ** (same outputs, bitwise; 2026-11-29): up2 C = 128 fwd 32.3 -> 30.3, dgrad
  ** 24.8 -> 24.0; down2 C = 128 fwd 25.1 -> 24.2, dgrad 32.5 -> 30.2; down3
  ** C = 128 fwd 63.0 -> 62.0, dgrad 45.8 -> 44.4; subm C = 32 fwd 20.8 ->
  ** 20.3, dgrad 20.3 -> 20.0; tile 13 at up2 C = 64 fwd 15.8 -> 14.7.  Eight
  ** columns (all of a 256-thread block's first sweep) gained less and lost at
  ** one-offset tiles (tile 13, up2 C = 64 fwd 15.9): the unused columns' bytes. */
  enum { EARLY = 2 * (BM / 4) < NT ? 2 * (BM / 4) : NT };
  int4 v0 = make_int4(-1, -1, -1, -1);
  const bool early = tid < EARLY && tid < volume * (BM / 4);
  if (early) v0 = cols[tid];
  int count = rec[2 * volume]; /* the same word for every thread: one request */
  tsp_steps_copy_head<BM, NT>(rec, volume, rows, t, tid);
  count = count < 0 ? 0 : count > volume ? volume : count;
  if (early && tid < count * (BM / 4)) tsp_steps_store_entries(t.nb + 4 * tid, v0, src_rows);
#pragma unroll 4
  for (int i = tid < EARLY ? tid + NT : tid; i < count * (BM / 4); i += NT)
    tsp_steps_store_entries(t.nb + 4 * i, cols[i], src_rows);
  tsp_tile_sync<BAR, NT>();
}

/* The whole block copies its tile's record.
** Tried 2026-11-28 and not kept: each block of tile 13 prefetching into L2
** (cp.async.bulk.prefetch.L2) the record of the block W blocks on.  Main
** kernel us, H100, three rounds: W = 132 subm C = 64 fwd 40.6 -> 39.6, down3
** 51.1 -> 49.4, but down2 18.8 -> 19.8 and up2 dgrad 17.7 -> 18.7; W = 396
** subm and down3 within 1%, down2 and up2 2-4% slower.  (A no-work kernel of
** 1353 such record copies from DRAM takes 18.3 us against 4.3 without them:
** the copies' latency is real, but the other blocks of an SM hide most of
** it.) */
template <int BM, int NT>
static __device__ __forceinline__ void tsp_tile_from_steps(const int32_t *__restrict__ steps, int64_t row0,
                                                           int volume, int64_t rows, int64_t src_rows,
                                                           const tsp_tile_smem &t) {
  tsp_tile_from_steps_by<BM, NT, 0>(steps, row0, volume, rows, src_rows, t, (int)threadIdx.x);
}

/* Kernels that read a step plan's entries column by column as they gather
** (tile 18 at n <= 64, conv_wgmma.cu wgmma_ring_kernel) keep the head in
** shared memory after a ring of min(V, TSP_STEPS_RING) column slots of BM
** entries (tsp_tile_ring_at), instead of BM * V entries: 6 KB instead of 13.5
** at V = 27, so four blocks of tile 13's shape fit an SM.  Column j sits in
** slot j % TSP_STEPS_RING.  A tile's first min(count, slots) columns are
** copied at its start (tsp_tile_ring_from_steps); a tile with more used
** offsets refills the slot of column j - 1 with column j + slots - 1 as its
** loader reaches column j (tsp_steps_col_async), slots - 1 steps before that
** column's gather.  On lidar_198k (subm 3x3x3 at 0.05 m) 84% of the tiles use
** at most 12 offsets, so most tiles copy no column in their step loop. */
enum { TSP_STEPS_RING = 12 };
static __host__ __device__ __forceinline__ int tsp_tile_ring_slots(int volume) {
  return volume < TSP_STEPS_RING ? volume : TSP_STEPS_RING;
}
static __host__ __device__ __forceinline__ size_t tsp_tile_ring_smem_bytes(int bm, int volume) {
  return ((size_t)tsp_tile_ring_slots(volume) * bm + (size_t)tsp_steps_head_words(bm, volume)) * 4;
}

/* The ring's column slots at base, the head after them (nb unused: NULL). */
static __device__ __forceinline__ tsp_tile_smem tsp_tile_ring_at(void *base, int bm, int volume, int32_t **ring) {
  tsp_tile_smem t;
  *ring = (int32_t *)base;
  t.nb = nullptr;
  t.groups = (uint32_t *)(*ring + tsp_tile_ring_slots(volume) * bm);
  t.list = (int32_t *)(t.groups + volume);
  t.count = t.list + volume;
  t.rows = t.count + 4;
  return t;
}

/* The columns of the step plan record of the tile at row0. */
template <int BM>
static __device__ __forceinline__ const int32_t *tsp_steps_cols(const int32_t *__restrict__ steps, int64_t row0,
                                                                int volume) {
  return tsp_steps_rec<BM>(steps, row0, volume) + tsp_steps_head_words(BM, volume);
}

/* Column j of the record (entries of list[j], -1 past count) into ring slot
** j % TSP_STEPS_RING, by cp.async in the caller's group: BM / 4 16-byte
** copies, one by each lane of the block's first warp, so the caller calls it
** on that warp alone (a warp-uniform test).  The entries land unchecked: the
** gather checks each against [0, src_rows).  Why a warp: a loop over tid, or
** a test of tid, in the step loop cost ptxas its uniform registers there (the
** stage and the wgmma descriptors went through R2UR each step). */
template <int BM>
static __device__ __forceinline__ void tsp_steps_col_async(const int32_t *__restrict__ cols, int j, int32_t *ring,
                                                           int lane) {
  static_assert(BM == 128, "a column is one 16-byte copy per lane of a warp");
  tsp_cp_async16(ring + ((unsigned)j % TSP_STEPS_RING) * BM + 4 * lane, cols + (int64_t)j * BM + 4 * lane, true);
}

/* The ring variant's first phase: columns 0 and 1 by cp.async while the head
** is copied, so a tile waits one memory round trip before its first gather;
** then, with the head landed (a __syncthreads()), columns 2 .. min(count,
** slots) - 1 by cp.async in the caller's next group, which the caller's
** first wait lands before its second step is loaded.  first_warp: the
** calling thread is in warp 0 (warp-uniform). */
template <int BM, int NT>
static __device__ __forceinline__ void tsp_tile_ring_from_steps(const int32_t *__restrict__ steps, int64_t row0,
                                                                int volume, int64_t rows, const tsp_tile_smem &t,
                                                                int32_t *ring, bool first_warp) {
  const int tid = (int)threadIdx.x, lane = tid & 31;
  const int32_t *rec = tsp_steps_rec<BM>(steps, row0, volume);
  const int32_t *cols = tsp_steps_cols<BM>(steps, row0, volume);
  const int slots = tsp_tile_ring_slots(volume);
  if (first_warp)
    for (int j = 0; j < 2 && j < slots; ++j) tsp_steps_col_async<BM>(cols, j, ring, lane);
  tsp_cp_async_commit();
  tsp_steps_copy_head<BM, NT>(rec, volume, rows, t, tid);
  tsp_cp_async_wait<0>();
  __syncthreads();
  const int first = *t.count < slots ? *t.count : slots;
  if (first_warp)
    for (int j = 2; j < first; ++j) tsp_steps_col_async<BM>(cols, j, ring, lane);
}

/* The map entry of tile row r for list index j (offset k = list[j]) in the
** layout the tile was built in: from a step plan or by tsp_tile_offsets. */
static __device__ __forceinline__ int32_t tsp_tile_entry(const tsp_tile_smem &t, bool from_steps, int bm,
                                                         int volume, int r, int j, int k) {
  return from_steps ? t.nb[j * bm + r] : t.nb[r * volume + k];
}

/* The groups words of the steps a kernel has loaded ahead, oldest first, as
** its loader read them (conv_wgmma.cu, conv_implicit_gemm.cu): returns the
** oldest, for the step about to be computed, and appends `in`, the word of
** the step just loaded (0 when none was). */
template <int N> static __device__ __forceinline__ uint32_t tsp_ahead_next(uint32_t (&q)[N], uint32_t in) {
  const uint32_t oldest = q[0];
#pragma unroll
  for (int s = 0; s + 1 < N; ++s) q[s] = q[s + 1];
  q[N - 1] = in;
  return oldest;
}

/* The epilogues of a segmented pass run in two sweeps: first every
** read-back sum joins the accumulators (tsp_tile_read2, when
** tsp_tile_reads(mode): the fp32 partial sums, or for TSP_EPI_OUT_ADD the
** output the segments before wrote), then tsp_tile_write2 stores them in the
** mode tsp_tile_store_mode(mode) leaves.  Why: a load of accum after the previous
** element's store to out or accum cannot move ahead of it (they may alias,
** as far as the compiler knows), so a one-sweep read-add-write waits a full
** memory latency per element pair: 128 round trips per thread of a 256-wide
** wgmma tile, which made mask splits S = 2 at C = 256 take 605 us against
** 415 us unsplit (H100, 2026-11-24). */
static __device__ __forceinline__ bool tsp_tile_reads(int mode) {
  return mode == TSP_EPI_ACC_ADD || mode == TSP_EPI_ACC_FINISH || mode == TSP_EPI_OUT_ADD;
}

/* A tile that sums no offset changes nothing in the modes that only add
** (block-uniform: the kernels return or skip the tile before any mma). */
static __device__ __forceinline__ bool tsp_tile_adds_nothing(int mode, int count) {
  return count == 0 && (mode == TSP_EPI_ACC_ADD || mode == TSP_EPI_OUT_ADD);
}

/* The mode of the write sweep once the read-back sums are in the accumulators. */
static __device__ __forceinline__ int tsp_tile_store_mode(int mode) {
  return mode == TSP_EPI_ACC_ADD                                   ? TSP_EPI_ACC_INIT
         : mode == TSP_EPI_ACC_FINISH || mode == TSP_EPI_OUT_ADD ? TSP_EPI_STORE
                                                                  : mode;
}

/* *a += src[idx], *b += src[idx + 1] (idx even: one load, tsp_load2), src being the
** fp32 partial sums, or the output of type T in mode TSP_EPI_OUT_ADD. */
template <typename T>
static __device__ __forceinline__ void tsp_tile_read2(int mode, const T *out, const float *accum, int64_t idx,
                                                      float *a, float *b) {
  const float2 v = mode == TSP_EPI_OUT_ADD ? tsp_load2(out + idx) : tsp_load2(accum + idx);
  *a += v.x;
  *b += v.y;
}

/* Write two adjacent sums (col even) of tile row r as `mode` says (TSP_EPI_*):
** out is [rows, n] of T (fp16, bf16 or float), accum [rows, n] fp32; idx = r * n + col. */
template <typename T>
static __device__ __forceinline__ void tsp_tile_write2(int mode, T *__restrict__ out,
                                                       float *__restrict__ accum, int64_t idx,
                                                       float a, float b) {
  if (mode == TSP_EPI_STORE) {
    tsp_store2(out + idx, a, b);
    return;
  }
  float2 *p = (float2 *)(accum + idx); /* n and col even: 8-byte aligned */
  if (mode == TSP_EPI_ACC_INIT) {
    *p = make_float2(a, b);
    return;
  }
  const float2 v = *p;
  if (mode == TSP_EPI_ACC_ADD)
    *p = make_float2(v.x + a, v.y + b);
  else
    tsp_store2(out + idx, v.x + a, v.y + b);
}

/* The whole two-sweep epilogue of a thread.  pairs(f) calls f(r, col, a, b)
** for each of the thread's accumulator pairs with a map row r >= 0 and an
** even column col < n, a and b the pair's sums (float &); the kernel's
** accumulator layout lives in `pairs` alone. */
template <typename T, typename Pairs>
static __device__ __forceinline__ void tsp_tile_epilogue(int mode, T *__restrict__ out,
                                                         float *__restrict__ accum, int n,
                                                         Pairs pairs) {
  if (tsp_tile_reads(mode)) {
    pairs([&](int32_t r, int col, float &a, float &b) { tsp_tile_read2(mode, out, accum, (int64_t)r * n + col, &a, &b); });
    mode = tsp_tile_store_mode(mode);
  }
  pairs([&](int32_t r, int col, float &a, float &b) {
    tsp_tile_write2(mode, out, accum, (int64_t)r * n + col, a, b);
  });
}

/* The staged store epilogue of the tensor-core kernels (mode TSP_EPI_STORE,
** out 16-byte aligned, n % 8 == 0): the accumulators are rounded to T into
** shared memory (tsp_stage_pair), then written out in whole 16-byte chunks,
** consecutive threads along a row (tsp_stage_rows).  Why: the direct
** epilogue stores 4 bytes per thread and pair, so a warp's store covers 16
** bytes of each of 8 rows (half of every 32-byte sector it touches), and its
** unrolled per-pair code (a row lookup, a column test and the mode's
** branches, 64 times per thread at BN = 128) was 28% of the ping-pong
** kernel's stall samples in a one-offset pass, mostly waiting for
** instruction fetch (Nsight Compute, H100, 2026-11-25).  Measured in
** csrc/cuda/conv.cu's header.
** Layout: a [rows x BN] block of T, row r's 16-byte chunk j at chunk j ^ s(r)
** of the row, s(r) = r % 8 when a row has 8 or more chunks and (r / 2) % 4 for
** BN = 32 (two rows per 128 bytes), so that neither the accumulator-order
** writes (8 consecutive rows x 4 lanes) nor the row-order reads (8
** consecutive chunks per quarter warp) meet a bank twice.
** Tried 2026-11-28 and not kept: streaming stores (__stcs, evict-first) in
** tile 13.  Alone, as tools/kernel_times.py times it, down2 / up2 C = 64 fwd
** went 16.2 -> 12.9 / 17.9 -> 15.3 us; but a subm C = 64 layer reading that
** output next took ~3 us longer, and the pair in one CUDA graph went 71.0 ->
** 70.2 / 63.8 -> 63.3 us (H100, three alternating rounds).  The output's
** write-back cost moves to its reader. */
template <int BN> static __device__ __forceinline__ int tsp_stage_swizzle(int r) {
  static_assert(BN % 32 == 0, "4 or more 16-byte chunks a row");
  return BN >= 64 ? r & 7 : (r >> 1) & 3;
}

/* Stage the pair of sums (a, b) of block row r, columns 8 j + 2 (lane % 4) + {0, 1}
** (the m16n8 and m64nN accumulator layouts); buf is the block, 16-byte aligned. */
template <int BN, typename T>
static __device__ __forceinline__ void tsp_stage_pair(T *buf, int r, int j, int lane, float a, float b) {
  tsp_store2((T *)((unsigned char *)buf + r * BN * 2 + ((j ^ tsp_stage_swizzle<BN>(r)) << 4) + (lane & 3) * 4),
             a, b);
}

/* A wgmma warpgroup's m64nBN accumulator (conv_wgmma_ops.cuh) into a 64-row
** block; wt: the thread's index in its warpgroup. */
template <int BN, typename T>
static __device__ __forceinline__ void tsp_stage_acc(T *buf, const float *acc, int wt) {
  const int lane = wt & 31, r = (wt >> 5) * 16 + (lane >> 2);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      tsp_stage_pair<BN>(buf, r + 8 * h, j, lane, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
}

/* Write a staged block of ROWS rows by NT threads (t = 0 .. NT - 1): block row r
** to map row rows[r] (none when negative), columns n0 .. n0 + BN - 1 below n,
** out [rows, n].  Call after a barrier that follows every thread's staging. */
template <int BN, int ROWS, int NT, typename T>
static __device__ __forceinline__ void tsp_stage_rows(const T *buf, const int32_t *rows, T *__restrict__ out,
                                                      int n, int n0, int t) {
  enum { CPR = BN / 8, RPP = NT / CPR, PASSES = ROWS / RPP }; /* chunks a row, rows a pass */
  static_assert(NT % CPR == 0 && ROWS % RPP == 0, "threads cover whole rows, passes the block");
  const int c = t % CPR, r0 = t / CPR;
  const bool col_ok = n0 + c * 8 < n;
  int32_t g[PASSES];
#pragma unroll
  for (int p = 0; p < PASSES; ++p) g[p] = rows[r0 + p * RPP];
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int r = r0 + p * RPP;
    const uint4 v = *(const uint4 *)((const unsigned char *)buf + r * BN * 2 + ((c ^ tsp_stage_swizzle<BN>(r)) << 4));
    if (g[p] >= 0 && col_ok) *(uint4 *)(out + (int64_t)g[p] * n + n0 + c * 8) = v;
  }
}

/* Whether a launch's epilogue may be staged: plain stores into a 16-byte aligned output. */
template <typename T>
static __device__ __forceinline__ bool tsp_stage_ok(int mode, const T *out) {
  return mode == TSP_EPI_STORE && ((uintptr_t)out & 15) == 0;
}

#endif /* TSP_CONV_TILE_CUH */
