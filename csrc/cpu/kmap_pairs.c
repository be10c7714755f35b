/*
** kmap_pairs.c: the weight-stationary form of a kernel map on the CPU, the
** twin of cuda/kmap_pairs.cu: for each offset k, the rows q with
** map[q, k] >= 0 in increasing q, concatenated (torchsp.h).
**
** Why: a weight-stationary pass walks one offset at a time over that
** offset's pairs; nbmap [N, V] would make it scan all N rows per offset.
**
** Rows are cut into fixed chunks of CHUNK_ROWS (not one per thread, so the
** result and the work split do not depend on the thread count).  Both calls
** count each chunk's rows per offset in parallel; the counts call sums them
** into starts, the pairs call scans them per offset into the chunk's first
** position and each chunk then writes its rows in order: every entry is
** written once, by one thread, at a position that is a function of the map.
*/
#include <stdlib.h>

#include "cpu_common.h"

enum { CHUNK_ROWS = 4096 };

/* Arguments both calls accept; n_rows == 0 needs no data. */
static int pairs_args_valid(const int32_t *map, int64_t n_rows, int64_t volume) {
  return n_rows >= 0 && n_rows <= INT32_MAX && volume >= 1 && volume <= INT32_MAX &&
         (map != NULL || n_rows == 0);
}

/* count[c * V + k] = rows q of chunk c with map[q, k] >= 0 (malloc'd; NULL when out of
** memory).  *chunks receives the number of chunks. */
static int64_t *chunk_counts(const int32_t *map, int64_t n_rows, int64_t volume,
                             int64_t *chunks) {
  const int64_t nc = (n_rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
  *chunks = nc;
  int64_t *count = (int64_t *)calloc((size_t)(nc > 0 ? nc * volume : 1), sizeof(int64_t));
  if (!count) return NULL;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nc; ++c) {
    int64_t *cc = count + c * volume;
    const int64_t end = (c + 1) * CHUNK_ROWS < n_rows ? (c + 1) * CHUNK_ROWS : n_rows;
    for (int64_t q = c * CHUNK_ROWS; q < end; ++q) {
      const int32_t *row = map + q * volume;
      for (int64_t k = 0; k < volume; ++k) cc[k] += row[k] >= 0;
    }
  }
  return count;
}

tsp_status tsp_kernel_map_pair_counts_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                                          int64_t *starts) {
  if (!starts || !pairs_args_valid(map, n_rows, volume)) return TSP_ERR_ARGUMENT;
  int64_t nc = 0;
  int64_t *count = chunk_counts(map, n_rows, volume, &nc);
  if (!count) return TSP_ERR_ALLOC;
  /* starts = exclusive scan over k of the per-offset totals. */
  int64_t total = 0;
  for (int64_t k = 0; k < volume; ++k) {
    starts[k] = total;
    for (int64_t c = 0; c < nc; ++c) total += count[c * volume + k];
  }
  starts[volume] = total;
  free(count);
  return TSP_OK;
}

tsp_status tsp_kernel_map_pairs_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                                    const int64_t *starts, int32_t *pairs, int32_t *rows) {
  if (!starts || !pairs_args_valid(map, n_rows, volume)) return TSP_ERR_ARGUMENT;
  if (starts[0] != 0 || (starts[volume] > 0 && !pairs)) return TSP_ERR_ARGUMENT;
  int64_t nc = 0;
  int64_t *base = chunk_counts(map, n_rows, volume, &nc);
  if (!base) return TSP_ERR_ALLOC;
  /* Counts become positions: base[c * V + k] = starts[k] + rows of offset k in chunks < c.
  ** A map that does not match `starts` (the counts call saw another one) is an error
  ** before anything is written. */
  int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
  for (int64_t k = 0; k < volume; ++k) {
    int64_t pos = starts[k];
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t n = base[c * volume + k];
      base[c * volume + k] = pos;
      pos += n;
    }
    bad |= pos != starts[k + 1];
  }
  if (bad) {
    free(base);
    return TSP_ERR_ARGUMENT;
  }
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nc; ++c) {
    int64_t *pos = base + c * volume;
    const int64_t end = (c + 1) * CHUNK_ROWS < n_rows ? (c + 1) * CHUNK_ROWS : n_rows;
    for (int64_t q = c * CHUNK_ROWS; q < end; ++q) {
      const int32_t *row = map + q * volume;
      for (int64_t k = 0; k < volume; ++k)
        if (row[k] >= 0) {
          if (rows) rows[pos[k]] = row[k];
          pairs[pos[k]++] = (int32_t)q;
        }
    }
  }
  free(base);
  return TSP_OK;
}
