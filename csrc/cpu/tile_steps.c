/*
** tile_steps.c: the step plan of a kernel map and row order (torchsp.h,
** tsp_tile_steps_cpu), the CPU twin of cuda/tile_steps.cu.  The CPU conv
** kernels take no plan; this exists so the op behaves the same on both
** devices and the CUDA plan has a reference written independently of the
** CUDA kernels' first phase (conv_tile.cuh).  With `refine` the order is
** packed first (tile_pack.c) and the plan lists the packed one.
*/
#include <string.h>

#include "cpu_common.h"

tsp_status tsp_tile_steps_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                              const int32_t *order, int refine, int32_t *steps) {
  if (n_rows == 0 && volume >= 1 && volume <= TSP_STEPS_MAX_VOLUME) return TSP_OK;
  if (!map || !order || !steps || n_rows < 0 || volume < 1 || volume > TSP_STEPS_MAX_VOLUME ||
      n_rows > 0x7fffffffLL)
    return TSP_ERR_ARGUMENT;
  const int64_t tiles = (n_rows + TSP_STEPS_ROWS - 1) / TSP_STEPS_ROWS;
  const int64_t head = tsp_tile_steps_head(volume), words = tsp_tile_steps_words(volume);
  /* the (refined) order, then its entries checked in place (rows below read them) */
  if (refine) {
    tsp_status s = tsp_tile_pack_cpu(map, n_rows, volume, order, steps);
    if (s != TSP_OK) return s;
  } else {
    memcpy(steps, order, (size_t)n_rows * sizeof(int32_t));
  }
  for (int64_t i = 0; i < n_rows; ++i) steps[i] = steps[i] >= 0 && steps[i] < n_rows ? steps[i] : -1;
  for (int64_t i = n_rows; i < tsp_tile_steps_base(n_rows); ++i) steps[i] = -1;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    int32_t *rec = steps + tsp_tile_steps_base(n_rows) + t * words;
    int32_t *groups = rec, *list = rec + volume, *rows = rec + 2 * volume + 4, *cols = rec + head;
    memset(rec, 0, (size_t)head * sizeof(int32_t));
    for (int i = 0; i < TSP_STEPS_ROWS; ++i) {
      const int64_t q = t * TSP_STEPS_ROWS + i;
      rows[i] = q < n_rows ? steps[q] : -1;
      for (int64_t k = 0; k < volume && rows[i] >= 0; ++k)
        if (map[(int64_t)rows[i] * volume + k] >= 0) groups[k] |= (int32_t)(1u << (i / 16));
    }
    int32_t count = 0;
    for (int64_t k = 0; k < volume; ++k)
      if (groups[k] != 0) list[count++] = (int32_t)k;
    rec[2 * volume] = count;
    for (int64_t j = 0; j < volume; ++j)
      for (int i = 0; i < TSP_STEPS_ROWS; ++i) {
        const int32_t e = j < count && rows[i] >= 0 ? map[(int64_t)rows[i] * volume + list[j]] : -1;
        cols[j * TSP_STEPS_ROWS + i] = e >= 0 ? e : -1;
      }
  }
  /* the schedule: without refine none (-1 words), else by decreasing count, ties by
  ** decreasing index (a counting sort) */
  int64_t start[TSP_STEPS_MAX_VOLUME + 1] = {0}; /* start[c]: where the tiles of count c begin */
  int32_t *sched = steps + tsp_tile_steps_sched(n_rows, volume);
  if (!refine) {
    for (int64_t t = 0; t < tiles; ++t) sched[t] = -1;
    return TSP_OK;
  }
  const int32_t *counts = steps + tsp_tile_steps_base(n_rows) + 2 * volume;
  for (int64_t t = 0; t < tiles; ++t) ++start[counts[t * words]];
  for (int64_t c = volume, at = 0; c >= 0; --c) {
    const int64_t here = start[c];
    start[c] = at;
    at += here;
  }
  for (int64_t t = tiles - 1; t >= 0; --t) sched[start[counts[t * words]]++] = (int32_t)t;
  return TSP_OK;
}
