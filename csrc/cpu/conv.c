/*
** conv.c: the three convolution passes of training on the CPU, for float32
** and float64 (the shim computes float16 and bfloat16 in float32).
**   forward  y[q]  = sum_k x[nbmap[q, k]] @ w[k]
**   dgrad    dx[p] = sum_k dy[nbmap_t[p, k]] @ w[k]^T
**   wgrad    dw[k] = sum_q x[nbmap[q, k]]^T dy[q]
**
** The CPU path is for correctness, gradcheck and CI, so it favours simple,
** deterministic loops over peak speed: no atomics anywhere, and each output
** element is summed in one fixed order (see conv_impl.h).  Two dataflows:
** output-stationary (a thread per output row, walking its map row) and
** weight-stationary (offset by offset over compact (src, dst) pair lists, the
** zero-waste layout when most of the 27 offsets are absent, as in LiDAR maps
** with ~3.5-10 neighbours per row).  Hybrid is accepted as output-stationary:
** the L1-norm split only pays on GPUs, where it picks tensor-core tiles.
**
** Map entries are checked before any row is read: an entry outside
** [-1, rows) is TSP_ERR_ARGUMENT, never an out-of-bounds read.
*/
#include <stdlib.h>

#include <omp.h>

#include "cpu_common.h"

/* Per-offset lists of the (src, dst) row pairs of a map, in dst order. */
typedef struct {
  int64_t volume;
  int64_t *start; /* [volume + 1]: pairs of offset k are [start[k], start[k + 1]) */
  int32_t *src;   /* the map's entry: the row read */
  int32_t *dst;   /* the map's row: the row written (or dy's row for wgrad) */
} pair_lists;

/*
** PAIR_CHUNK_ROWS: rows per chunk when building pair lists (fixed, so the
** layout does not depend on the thread count).  CO_BLOCK: output columns a
** register tile holds (16 floats = one AVX-512 or four SSE registers).
** PAIR_BLOCK: pairs whose rows wgrad keeps in L1 at once.
*/
enum { PAIR_CHUNK_ROWS = 8192, CO_BLOCK = 16, PAIR_BLOCK = 64 };

#define TSP_REAL float
#define TSP_NAME(f) f##_f32
#include "conv_impl.h"
#undef TSP_REAL
#undef TSP_NAME

#define TSP_REAL double
#define TSP_NAME(f) f##_f64
#include "conv_impl.h"
#undef TSP_REAL
#undef TSP_NAME

static void pairs_free(pair_lists *pairs) {
  free(pairs->start);
  free(pairs->src);
  free(pairs->dst);
}

/*
** Pair lists of map [n_rows, volume]: count per (chunk, offset), lay the
** offsets out one after another with chunks in row order inside each, fill.
** One pass over the map instead of V strided passes.
*/
static tsp_status pairs_build(const int32_t *map, int64_t n_rows, int64_t volume,
                              pair_lists *pairs) {
  const int64_t chunks = (n_rows + PAIR_CHUNK_ROWS - 1) / PAIR_CHUNK_ROWS;
  pairs->volume = volume;
  pairs->start = malloc((size_t)(volume + 1) * sizeof(int64_t));
  pairs->src = NULL;
  pairs->dst = NULL;
  int64_t *next = calloc((size_t)(chunks * volume + 1), sizeof(int64_t));
  if (pairs->start == NULL || next == NULL) goto fail;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    int64_t *count = next + ch * volume;
    const int64_t hi = (ch + 1) * PAIR_CHUNK_ROWS < n_rows ? (ch + 1) * PAIR_CHUNK_ROWS : n_rows;
    for (int64_t q = ch * PAIR_CHUNK_ROWS; q < hi; ++q) {
      for (int64_t k = 0; k < volume; ++k) count[k] += map[q * volume + k] >= 0;
    }
  }
  int64_t total = 0;
  for (int64_t k = 0; k < volume; ++k) {
    pairs->start[k] = total;
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const int64_t c = next[ch * volume + k];
      next[ch * volume + k] = total;
      total += c;
    }
  }
  pairs->start[volume] = total;
  pairs->src = malloc((size_t)(total + 1) * sizeof(int32_t));
  pairs->dst = malloc((size_t)(total + 1) * sizeof(int32_t));
  if (pairs->src == NULL || pairs->dst == NULL) goto fail;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    int64_t *pos = next + ch * volume;
    const int64_t hi = (ch + 1) * PAIR_CHUNK_ROWS < n_rows ? (ch + 1) * PAIR_CHUNK_ROWS : n_rows;
    for (int64_t q = ch * PAIR_CHUNK_ROWS; q < hi; ++q) {
      for (int64_t k = 0; k < volume; ++k) {
        const int32_t p = map[q * volume + k];
        if (p < 0) continue;
        pairs->src[pos[k]] = p;
        pairs->dst[pos[k]++] = (int32_t)q;
      }
    }
  }
  free(next);
  return TSP_OK;
fail:
  free(next);
  pairs_free(pairs);
  return TSP_ERR_ALLOC;
}

/* 1 when every one of `entries` map entries is in [-1, rows). */
static int map_entries_valid(const int32_t *map, int64_t entries, int64_t rows) {
  int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
  for (int64_t i = 0; i < entries; ++i) bad |= map[i] < -1 || map[i] >= rows;
  return !bad;
}

/* Sizes, dtype and dataflow of a problem; *dataflow receives the dataflow this file runs. */
static tsp_status check_problem(const tsp_conv_problem *prob, tsp_dataflow *dataflow) {
  if (prob->n_in < 0 || prob->n_in > INT32_MAX || prob->n_out < 0 || prob->n_out > INT32_MAX ||
      prob->c_in < 0 || prob->c_out < 0 || prob->volume < 0)
    return TSP_ERR_ARGUMENT;
  if (prob->dtype != TSP_FLOAT32 && prob->dtype != TSP_FLOAT64) return TSP_ERR_UNSUPPORTED;
  switch (prob->algo.dataflow) {
    case TSP_DATAFLOW_OUTPUT_STATIONARY:
    case TSP_DATAFLOW_HYBRID:
    case TSP_DATAFLOW_SPLIT_K: /* a GPU occupancy device: one thread sums whole rows here anyway */
    case TSP_DATAFLOW_DENSITY_SPLIT: /* a GPU tile-waste device: no tiles here */
      *dataflow = TSP_DATAFLOW_OUTPUT_STATIONARY;
      return TSP_OK;
    case TSP_DATAFLOW_WEIGHT_STATIONARY:
    case TSP_DATAFLOW_GATHER_GEMM_SCATTER: /* per offset over its pairs, as here already */
      *dataflow = TSP_DATAFLOW_WEIGHT_STATIONARY;
      return TSP_OK;
    default:
      return TSP_ERR_ARGUMENT;
  }
}

/*
** dst [n_rows, c_dst] = sum_k src[map[:, k]] @ w[k], w [V, c_src, c_dst]: the
** forward pass, and dgrad with the transposed map and weight.
*/
static tsp_status gather_gemm(tsp_dataflow dataflow, tsp_dtype dtype, int64_t n_rows,
                              int64_t volume, int64_t c_src, int64_t c_dst, const void *src,
                              const void *w, const int32_t *map, void *dst) {
  if (dataflow == TSP_DATAFLOW_OUTPUT_STATIONARY) {
    if (dtype == TSP_FLOAT32)
      gather_output_stationary_f32(n_rows, volume, c_src, c_dst, src, w, map, dst);
    else
      gather_output_stationary_f64(n_rows, volume, c_src, c_dst, src, w, map, dst);
    return TSP_OK;
  }
  pair_lists pairs;
  const tsp_status s = pairs_build(map, n_rows, volume, &pairs);
  if (s != TSP_OK) return s;
  if (dtype == TSP_FLOAT32)
    gather_weight_stationary_f32(n_rows, c_src, c_dst, src, w, &pairs, dst);
  else
    gather_weight_stationary_f64(n_rows, c_src, c_dst, src, w, &pairs, dst);
  pairs_free(&pairs);
  return TSP_OK;
}

tsp_status tsp_conv_fwd_cpu(const tsp_conv_problem *prob, const void *x, const void *w,
                            const int32_t *nbmap, void *y) {
  tsp_dataflow dataflow;
  const tsp_status s = check_problem(prob, &dataflow);
  if (s != TSP_OK) return s;
  if (!map_entries_valid(nbmap, prob->n_out * prob->volume, prob->n_in)) return TSP_ERR_ARGUMENT;
  return gather_gemm(dataflow, prob->dtype, prob->n_out, prob->volume, prob->c_in, prob->c_out,
                     x, w, nbmap, y);
}

tsp_status tsp_conv_dgrad_cpu(const tsp_conv_problem *prob, const void *dy, const void *w,
                              const int32_t *nbmap_t, void *dx) {
  tsp_dataflow dataflow;
  tsp_status s = check_problem(prob, &dataflow);
  if (s != TSP_OK) return s;
  if (!map_entries_valid(nbmap_t, prob->n_in * prob->volume, prob->n_out))
    return TSP_ERR_ARGUMENT;
  const size_t real = prob->dtype == TSP_FLOAT32 ? sizeof(float) : sizeof(double);
  void *wt = malloc((size_t)(prob->volume * prob->c_in * prob->c_out) * real + 1);
  if (wt == NULL) return TSP_ERR_ALLOC;
  if (prob->dtype == TSP_FLOAT32)
    transpose_weight_f32(prob->volume, prob->c_in, prob->c_out, w, wt);
  else
    transpose_weight_f64(prob->volume, prob->c_in, prob->c_out, w, wt);
  s = gather_gemm(dataflow, prob->dtype, prob->n_in, prob->volume, prob->c_out, prob->c_in, dy,
                  wt, nbmap_t, dx);
  free(wt);
  return s;
}

tsp_status tsp_conv_wgrad_cpu(const tsp_conv_problem *prob, const void *x, const void *dy,
                              const int32_t *nbmap, void *dw) {
  tsp_dataflow dataflow;
  tsp_status s = check_problem(prob, &dataflow);
  if (s != TSP_OK) return s;
  if (!map_entries_valid(nbmap, prob->n_out * prob->volume, prob->n_in)) return TSP_ERR_ARGUMENT;
  /* wgrad has one loop: per offset over its pairs (the dataflow choice is for the GPU). */
  pair_lists pairs;
  s = pairs_build(nbmap, prob->n_out, prob->volume, &pairs);
  if (s != TSP_OK) return s;
  /* Enough (offset, Cin block) tasks for every thread, blocks of at least 8 channels. */
  const int64_t want = (4 * (int64_t)omp_get_max_threads() + prob->volume - 1) /
                       (prob->volume > 0 ? prob->volume : 1);
  int64_t ci_blocks = prob->c_in / 8 < want ? prob->c_in / 8 : want;
  if (ci_blocks < 1) ci_blocks = 1;
  if (prob->dtype == TSP_FLOAT32)
    wgrad_f32(prob->c_in, prob->c_out, ci_blocks, x, dy, &pairs, dw);
  else
    wgrad_f64(prob->c_in, prob->c_out, ci_blocks, x, dy, &pairs, dw);
  pairs_free(&pairs);
  return TSP_OK;
}
