/*
** mask_order.c: the row order of a kernel map sorted by neighbour mask, the
** CPU twin of cuda/mask_order.cu (same result: rows stably sorted by their
** presence bits).  The CPU conv kernels do not need it; it exists so the op
** behaves the same on both devices and the CUDA order has a reference.
** Rows are sorted by the Gray rank of their mask (tsp_mask_gray_rank).
** Bit positions follow tsp_mask_rank.h (rarest offsets most significant).
** Offsets outside the `offsets` set count 0 and set no bit (torchsp.h).
** tsp_mask_plan_cpu copies the map rows into that order (a tile plan).
*/
#include <stdlib.h>

#include "cpu_common.h"
#include "tsp_mask_rank.h"

typedef struct {
  uint64_t mask; /* Gray rank of the row's mask: bit rank(k) set when map[row, k] >= 0 and
                 ** offset k is in the set (tsp_mask_rank.h) */
  int32_t row;
} mask_row;

/* (mask, row) order: stable by construction, so qsort may be used. */
static int cmp_mask_row(const void *a, const void *b) {
  const mask_row *x = (const mask_row *)a, *y = (const mask_row *)b;
  if (x->mask != y->mask) return x->mask < y->mask ? -1 : 1;
  return (x->row > y->row) - (x->row < y->row);
}

tsp_status tsp_mask_order_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                              uint64_t offsets, int32_t *order) {
  /* Empty tensors may have NULL data. */
  if (n_rows == 0 && volume >= 1 && volume <= TSP_MASK_ORDER_MAX_VOLUME) return TSP_OK;
  if (!map || !order || n_rows < 0 || volume < 1 || volume > TSP_MASK_ORDER_MAX_VOLUME ||
      n_rows > 0x7fffffffLL)
    return TSP_ERR_ARGUMENT;
  /* Bit position of each offset: its rank by row count, most common first;
  ** an offset outside the set counts 0 and its bit value is 0. */
  int64_t count[TSP_MASK_ORDER_MAX_VOLUME] = {0};
  uint64_t value[TSP_MASK_ORDER_MAX_VOLUME];
#pragma omp parallel for schedule(static) reduction(+ : count[:TSP_MASK_ORDER_MAX_VOLUME])
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t k = 0; k < volume; ++k) count[k] += map[r * volume + k] >= 0;
  for (int64_t k = 0; k < volume; ++k)
    if (!((offsets >> k) & 1)) count[k] = 0;
  for (int64_t k = 0; k < volume; ++k)
    value[k] = ((offsets >> k) & 1) ? (uint64_t)1 << tsp_mask_bit_rank(count, (int)volume, (int)k)
                                    : 0;
  mask_row *tmp = (mask_row *)malloc((size_t)n_rows * sizeof(mask_row));
  if (!tmp) return TSP_ERR_ALLOC;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n_rows; ++r) {
    uint64_t m = 0;
    for (int64_t k = 0; k < volume; ++k) m |= map[r * volume + k] >= 0 ? value[k] : 0;
    tmp[r].mask = tsp_mask_gray_rank(m);
    tmp[r].row = (int32_t)r;
  }
  qsort(tmp, (size_t)n_rows, sizeof(mask_row), cmp_mask_row);
  for (int64_t r = 0; r < n_rows; ++r) order[r] = tmp[r].row;
  free(tmp);
  return TSP_OK;
}

tsp_status tsp_mask_plan_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                             const int32_t *order, int32_t *plan) {
  if (n_rows == 0 && volume >= 1) return TSP_OK;
  if (!map || !order || !plan || n_rows < 0 || volume < 1 || n_rows > 0x7fffffffLL)
    return TSP_ERR_ARGUMENT;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n_rows; ++i) {
    const int32_t r = order[i];
    const int ok = r >= 0 && r < n_rows;
    int32_t *row = plan + n_rows + i * volume;
    plan[i] = ok ? r : -1;
    for (int64_t k = 0; k < volume; ++k) row[k] = ok ? map[(int64_t)r * volume + k] : -1;
  }
  return TSP_OK;
}
