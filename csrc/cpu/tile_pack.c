/*
** tile_pack.c: the tile packing of a row order (torchsp.h, tsp_tile_pack_cpu),
** the CPU twin of cuda/tile_pack.cu: the first thing a refined step plan does
** with the order it is given (tile_steps.c).
**
** Why: a 128-row output-stationary tile multiplies all its rows by every
** offset any of them has (the union of their masks).  The mask order
** (mask_order.c) sorts rows by one global key, so a tile cut from it often
** mixes rows whose masks differ in a few offsets, while a row whose mask lies
** inside another tile's union would cost nothing there.  Packing builds each
** tile greedily instead: seed it with the mask that most remaining rows have,
** then fill it with rows whose masks are subsets of its union, and widen the
** union only when none is left.  On lidar_198k the products a 128-row tile
** computes per useful one fall from 1.78 (the decision tree of session 30
** that this replaces) to 1.69 for subm 3x3x3 at 0.1 m, 1.73 to 1.63 at 0.05 m
** and 2.07 to 1.90 for the stride-2 K = 3 forward, and the H100 main kernels
** run 5-9% faster there (README, session 32).
**
** The rule, per window (entries at the order's positions [w W, w W + W), W =
** TSP_PACK_WINDOW; the last window may be shorter; a multiple of 128 so that
** the window's tiles are the plan's):
**   - runs: maximal stretches of consecutive entries with equal masks (the
**     mask order puts equal masks together), numbered r = 0, 1, ... in order;
**     an entry outside [0, n_rows) is a row without offsets (mask 0);
**   - tiles of min(128, entries left) entries, one after the other.  A tile's
**     seed is the run with the most entries left (ties: the larger popcount,
**     then the lower r); it gives all it can first, and the tile's union U
**     starts as its mask;
**   - fill: the runs with entries left whose masks are subsets of U give them
**     by decreasing popcount, ties by increasing r, until the tile is full;
**   - if it is not: U takes the mask of the run (with entries left) of least
**     extra offsets per entry it can give, popcount(mask & ~U) * 65536 /
**     min(left in run, left in tile) in integer division (exact: two such
**     fractions differ by at least 1 / 128^2), ties by the lower r; fill again;
**   - the tile lists its entries run by run in increasing r, each run's next
**     entries in their order.
** The result is a permutation of the order's entries, a function of map and
** order alone, the same on both devices (integer arithmetic throughout).
*/
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

typedef struct {
  uint64_t mask; /* the run's offset bits */
  int32_t start; /* first entry (window position) */
  int32_t len;   /* entries */
  int32_t taken; /* entries given to earlier tiles */
  int32_t tt;    /* entries given to the tile being built */
  int32_t pc;    /* popcount of mask */
} pack_run;

static inline int pack_popc(uint64_t m) {
  int c = 0;
  for (; m; m &= m - 1) ++c;
  return c;
}

/* Pack one window: vals[len] its entries, masks[len] their offset bits; runs, cand, sorted:
** scratch of len; out[len]: the packed entries. */
static void pack_window(const uint64_t *masks, const int32_t *vals, int32_t len, pack_run *runs, int32_t *cand,
                        int32_t *sorted, int32_t *out) {
  int32_t n_runs = 0;
  for (int32_t i = 0; i < len; ++i) {
    if (i == 0 || masks[i] != masks[i - 1])
      runs[n_runs++] = (pack_run){masks[i], i, 0, 0, 0, pack_popc(masks[i])};
    ++runs[n_runs - 1].len;
  }
  int32_t at = 0;
  while (at < len) {
    const int32_t size = len - at < TSP_PACK_ROWS ? len - at : TSP_PACK_ROWS;
    int32_t seed = -1;
    for (int32_t r = 0; r < n_runs; ++r) {
      const int32_t left = runs[r].len - runs[r].taken;
      if (left <= 0) continue;
      if (seed < 0) {
        seed = r;
        continue;
      }
      const int32_t sl = runs[seed].len - runs[seed].taken;
      if (left > sl || (left == sl && runs[r].pc > runs[seed].pc)) seed = r;
    }
    uint64_t u = runs[seed].mask;
    const int32_t seed_left = runs[seed].len - runs[seed].taken;
    runs[seed].tt = seed_left < size ? seed_left : size; /* the seed gives first */
    int32_t need = size - runs[seed].tt;
    while (need > 0) {
      /* fill: subsets of u by decreasing popcount, ties by increasing r (a counting sort) */
      int32_t n_cand = 0, bucket[66] = {0};
      for (int32_t r = 0; r < n_runs; ++r) {
        const pack_run *q = &runs[r];
        if (q->len - q->taken - q->tt > 0 && (q->mask & ~u) == 0) {
          cand[n_cand++] = r;
          ++bucket[64 - q->pc];
        }
      }
      for (int b = 0, sum = 0; b < 66; ++b) {
        const int c = bucket[b];
        bucket[b] = sum;
        sum += c;
      }
      for (int32_t i = 0; i < n_cand; ++i) sorted[bucket[64 - runs[cand[i]].pc]++] = cand[i];
      for (int32_t i = 0; i < n_cand && need > 0; ++i) {
        pack_run *q = &runs[sorted[i]];
        const int32_t avail = q->len - q->taken - q->tt;
        const int32_t take = avail < need ? avail : need;
        q->tt += take;
        need -= take;
      }
      if (need == 0) break;
      /* widen u by the run of least extra offsets per entry it gives */
      int32_t best = -1;
      int64_t best_key = 0;
      for (int32_t r = 0; r < n_runs; ++r) {
        const int32_t avail = runs[r].len - runs[r].taken - runs[r].tt;
        if (avail <= 0) continue;
        const int64_t extra = pack_popc(runs[r].mask & ~u);
        const int64_t key = (extra << 16) / (avail < need ? avail : need);
        if (best < 0 || key < best_key) best = r, best_key = key;
      }
      u |= runs[best].mask; /* entries are left (need > 0), so best >= 0 */
    }
    for (int32_t r = 0; r < n_runs; ++r) {
      pack_run *q = &runs[r];
      for (int32_t i = 0; i < q->tt; ++i) out[at++] = vals[q->start + q->taken + i];
      q->taken += q->tt;
      q->tt = 0;
    }
  }
}

tsp_status tsp_tile_pack_cpu(const int32_t *map, int64_t n_rows, int64_t volume, const int32_t *order,
                             int32_t *out) {
  if (n_rows == 0 && volume >= 1 && volume <= TSP_STEPS_MAX_VOLUME) return TSP_OK;
  if (!map || !order || !out || n_rows < 0 || volume < 1 || volume > TSP_STEPS_MAX_VOLUME ||
      n_rows > 0x7fffffffLL)
    return TSP_ERR_ARGUMENT;
  const int64_t windows = (n_rows + TSP_PACK_WINDOW - 1) / TSP_PACK_WINDOW;
  int failed = 0;
#pragma omp parallel
  {
    uint64_t *masks = (uint64_t *)malloc(TSP_PACK_WINDOW * sizeof(uint64_t));
    int32_t *vals = (int32_t *)malloc(TSP_PACK_WINDOW * sizeof(int32_t));
    pack_run *runs = (pack_run *)malloc(TSP_PACK_WINDOW * sizeof(pack_run));
    int32_t *cand = (int32_t *)malloc(2 * TSP_PACK_WINDOW * sizeof(int32_t));
    if (!masks || !vals || !runs || !cand) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < windows; ++w) {
      if (!masks || !vals || !runs || !cand) continue;
      const int64_t base = w * TSP_PACK_WINDOW;
      const int32_t len = (int32_t)(n_rows - base < TSP_PACK_WINDOW ? n_rows - base : TSP_PACK_WINDOW);
      for (int32_t i = 0; i < len; ++i) {
        const int32_t r = order[base + i];
        uint64_t m = 0;
        if (r >= 0 && r < n_rows)
          for (int64_t k = 0; k < volume; ++k) m |= (uint64_t)(map[(int64_t)r * volume + k] >= 0) << k;
        masks[i] = m;
        vals[i] = r;
      }
      pack_window(masks, vals, len, runs, cand, cand + TSP_PACK_WINDOW, out + base);
    }
    free(masks);
    free(vals);
    free(runs);
    free(cand);
  }
  return failed ? TSP_ERR_ALLOC : TSP_OK;
}
