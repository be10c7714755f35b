/*
** tile_refine.c: the window refinement of a row order (torchsp.h,
** tsp_tile_refine_cpu), the CPU twin of cuda/tile_refine.cu: the first thing
** a step plan does with the order it is given (tile_steps.c).
**
** Why: a 128-row output-stationary tile multiplies all its rows by every
** offset any of them has.  The mask order (mask_order.c) sorts rows by one
** global key, the masks' Gray rank with the globally rarest offsets most
** significant, so the rows a tile ends up with often differ in offsets that
** are rare overall but common among rows like them.  Re-sorting each window
** of 1024 rows (8 tiles) by a local decision tree, which splits on the offset
** rarest *within* the rows at hand, groups them better: on lidar_198k the
** products a tile computes per useful one fall from 1.89 to 1.73 (subm 3x3x3,
** 0.05 m), 1.94 to 1.78 (0.1 m) and 2.66 to 2.05 (stride-2 K = 3 forward),
** and the H100 kernels run 3-12% faster (README, session 30).
**
** The tree, per window (rows in the order's positions [w W, w W + W)):
** a segment of more than TSP_REFINE_LEAF rows, fewer than TSP_REFINE_DEPTH
** splits below the window, whose rows do not all agree on every offset is
** split on the offset k present in the fewest of its rows
** (0 < count < size; ties: lowest k), stably: rows without k first, unless
** the segment is flipped, then rows with k first; the first part keeps the
** flip, the second takes its opposite (the Gray code's reflection, so that
** neighbouring segments differ by one offset).  Other segments stay as they
** are.  The depth limit bounds the GPU's levels (the trees of lidar_198k's
** maps go 21-25 deep; at 16 the tiles use 0-1% more products than without).  An order
** entry outside [0, n_rows) counts as a row with no offset and keeps its
** value.  The result is a permutation of the order's entries, a function of
** map and order alone.
*/
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

typedef struct {
  int32_t lo, hi; /* rows [lo, hi) of the window */
  int32_t flip;   /* 1: rows with the split offset go first */
  int32_t depth;  /* splits above it */
} refine_seg;

/* Refine one window of `len` entries: masks[i] is entry i's offset bits, vals[i] its value;
** tmp_m / tmp_v are scratch of `len` entries. */
static void refine_window(uint64_t *masks, int32_t *vals, uint64_t *tmp_m, int32_t *tmp_v, int32_t len,
                          int volume) {
  refine_seg stack[TSP_REFINE_MAX_VOLUME + 2];
  int sp = 0;
  stack[sp++] = (refine_seg){0, len, 0, 0};
  while (sp > 0) {
    const refine_seg s = stack[--sp];
    const int32_t size = s.hi - s.lo;
    if (size <= TSP_REFINE_LEAF || s.depth >= TSP_REFINE_DEPTH) continue;
    int32_t count[TSP_REFINE_MAX_VOLUME] = {0};
    for (int32_t i = s.lo; i < s.hi; ++i)
      for (int k = 0; k < volume; ++k) count[k] += (int32_t)((masks[i] >> k) & 1u);
    int best = -1;
    for (int k = 0; k < volume; ++k)
      if (count[k] > 0 && count[k] < size && (best < 0 || count[k] < count[best])) best = k;
    if (best < 0) continue; /* every row agrees on every offset */
    const uint64_t want = (uint64_t)s.flip; /* the bit value of the first part */
    const int32_t n1 = s.flip ? count[best] : size - count[best];
    int32_t a = s.lo, b = s.lo + n1;
    for (int32_t i = s.lo; i < s.hi; ++i) {
      const int32_t at = ((masks[i] >> best) & 1u) == want ? a++ : b++;
      tmp_m[at] = masks[i];
      tmp_v[at] = vals[i];
    }
    memcpy(masks + s.lo, tmp_m + s.lo, (size_t)size * sizeof(uint64_t));
    memcpy(vals + s.lo, tmp_v + s.lo, (size_t)size * sizeof(int32_t));
    /* each split fixes one more offset within both parts: depth <= volume */
    stack[sp++] = (refine_seg){s.lo + n1, s.hi, !s.flip, s.depth + 1};
    stack[sp++] = (refine_seg){s.lo, s.lo + n1, s.flip, s.depth + 1};
  }
}

tsp_status tsp_tile_refine_cpu(const int32_t *map, int64_t n_rows, int64_t volume, const int32_t *order,
                               int32_t *out) {
  if (n_rows == 0 && volume >= 1 && volume <= TSP_REFINE_MAX_VOLUME) return TSP_OK;
  if (!map || !order || !out || n_rows < 0 || volume < 1 || volume > TSP_REFINE_MAX_VOLUME ||
      n_rows > 0x7fffffffLL)
    return TSP_ERR_ARGUMENT;
  const int64_t windows = (n_rows + TSP_REFINE_WINDOW - 1) / TSP_REFINE_WINDOW;
  int failed = 0;
#pragma omp parallel
  {
    uint64_t *masks = (uint64_t *)malloc(2 * TSP_REFINE_WINDOW * sizeof(uint64_t));
    int32_t *vals = (int32_t *)malloc(2 * TSP_REFINE_WINDOW * sizeof(int32_t));
    if (!masks || !vals) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 4)
    for (int64_t w = 0; w < windows; ++w) {
      if (!masks || !vals) continue;
      const int64_t base = w * TSP_REFINE_WINDOW;
      const int32_t len = (int32_t)(n_rows - base < TSP_REFINE_WINDOW ? n_rows - base : TSP_REFINE_WINDOW);
      for (int32_t i = 0; i < len; ++i) {
        const int32_t r = order[base + i];
        uint64_t m = 0;
        if (r >= 0 && r < n_rows)
          for (int64_t k = 0; k < volume; ++k) m |= (uint64_t)(map[(int64_t)r * volume + k] >= 0) << k;
        masks[i] = m;
        vals[i] = r;
      }
      refine_window(masks, vals, masks + TSP_REFINE_WINDOW, vals + TSP_REFINE_WINDOW, len, (int)volume);
      memcpy(out + base, vals, (size_t)len * sizeof(int32_t));
    }
    free(masks);
    free(vals);
  }
  return failed ? TSP_ERR_ALLOC : TSP_OK;
}
