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
** run 5-9% faster there (docs/performance-log.md, session 32).
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
**   - if it is not, U widens by the candidate of least extra offsets per
**     entry it lets in, |S| * 65536 / min(gain, left in tile) in integer
**     division (exact: two such fractions differ by at least 1 / 128^2), and
**     the tile fills again.  The candidates: each run with entries left (S:
**     its offsets outside U, gain: its own entries left), and each set S of
**     one or two offsets outside U that some run's offsets outside U equal
**     (gain: the entries left of every run whose offsets outside U lie inside
**     S).  Ties: runs before sets, runs by r, sets by b1 * 65 for {b1} and
**     b1 * 65 + 1 + b2 for {b1 < b2}.  The sets see what widening lets in
**     besides one run: a run's key counted only its own entries, so an offset
**     that admits many small runs lost to a run of two offsets.  lidar_198k,
**     128-row tiles, products per useful one: subm 3x3x3 at 0.1 m 1.688 ->
**     1.644 (1.635 -> 1.599 at the 64-row halves the kernels skip by), at
**     0.05 m 1.630 -> 1.587, the stride-2 K = 3 forward at 0.1 m 1.900 ->
**     1.841; H200 main kernels (CUDA graph replays, one process): subm C =
**     128 fwd 92.3 -> 90.4 us, C = 256 fwd 316.9 -> 306.5 and dgrad 317.0 ->
**     307.6 (settled, at the power cap), the C <= 64 passes within 1.5%
**     (docs/performance-log.md, session 67).  Sets of three offsets took 0.1-0.3% more off, and
**     ordering each tile's runs so that its two 64-row halves use fewer
**     offsets (1.599 -> 1.578 at the halves) no time but 0.45 ms a plan;
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

/* Scratch of the widening's sets: single[b] and pair[b1 * 64 + b2] (b1 < b2)
** the entries of the runs whose offsets outside the union are {b} or
** {b1, b2}; touched: the pair indices made nonzero, so that they alone are
** read and cleared (all zero between widenings). */
typedef struct {
  int32_t single[64];
  int32_t pair[64 * 64];
  int32_t touched[64 * 64];
} pack_sets;

/* A widening candidate's key: `extra` offsets per entry of min(gain, need),
** scaled by 65536 (exact: the header). */
static inline int64_t pack_widen_key(int extra, int32_t gain, int32_t need) {
  return ((int64_t)extra << 16) / (gain < need ? gain : need);
}

/* Widening candidate (key, index) a beats b: the lower key, ties the lower index. */
static inline int pack_beats(int64_t ka, int32_t ia, int64_t kb, int32_t ib) {
  return ka < kb || (ka == kb && ia < ib);
}

static inline int pack_popc(uint64_t m) {
  int c = 0;
  for (; m; m &= m - 1) ++c;
  return c;
}

/* The index of the lowest set bit of m != 0. */
static inline int pack_low_bit(uint64_t m) {
  int b = 0;
  for (; !(m & 1); m >>= 1) ++b;
  return b;
}

/* The union u widened for a tile that still needs `need` entries, once every
** run inside u has given all it has (cpu/tile_pack.c's header: the rule). */
static uint64_t pack_widen(const pack_run *runs, int32_t n_runs, uint64_t u, int32_t need, pack_sets *sets) {
  int64_t best_key = INT64_MAX;
  int32_t best = INT32_MAX; /* runs r < TSP_PACK_WINDOW; sets TSP_PACK_WINDOW + b1 * 65 (+ 1 + b2) */
  uint64_t best_set = 0;
  int32_t n_touched = 0;
  for (int32_t r = 0; r < n_runs; ++r) {
    const int32_t avail = runs[r].len - runs[r].taken - runs[r].tt;
    if (avail <= 0) continue;
    const uint64_t d = runs[r].mask & ~u;
    const int extra = pack_popc(d);
    const int64_t key = pack_widen_key(extra, avail, need);
    if (pack_beats(key, r, best_key, best)) best_key = key, best = r, best_set = d;
    if (extra == 1) {
      sets->single[pack_low_bit(d)] += avail;
    } else if (extra == 2) {
      const int32_t at = pack_low_bit(d) * 64 + pack_low_bit(d & (d - 1)); /* b1 < b2 */
      if (sets->pair[at] == 0) sets->touched[n_touched++] = at;
      sets->pair[at] += avail;
    }
  }
  for (int b = 0; b < 64; ++b) {
    const int32_t g = sets->single[b];
    if (g > 0) {
      const int64_t key = pack_widen_key(1, g, need);
      const int32_t index = TSP_PACK_WINDOW + b * 65;
      if (pack_beats(key, index, best_key, best)) best_key = key, best = index, best_set = (uint64_t)1 << b;
    }
  }
  for (int32_t i = 0; i < n_touched; ++i) {
    const int32_t at = sets->touched[i], b1 = at / 64, b2 = at % 64;
    const int32_t g = sets->single[b1] + sets->single[b2] + sets->pair[at]; /* < 2^31: entries of a window */
    const int64_t key = pack_widen_key(2, g, need);
    const int32_t index = TSP_PACK_WINDOW + b1 * 65 + 1 + b2;
    if (pack_beats(key, index, best_key, best))
      best_key = key, best = index, best_set = (uint64_t)1 << b1 | (uint64_t)1 << b2;
    sets->pair[at] = 0;
  }
  memset(sets->single, 0, sizeof(sets->single));
  return u | best_set; /* entries are left (need > 0), so a run was a candidate */
}

/* Pack one window: vals[len] its entries, masks[len] their offset bits; runs, cand, sorted:
** scratch of len; sets: pack_widen's (zeroed); out[len]: the packed entries. */
static void pack_window(const uint64_t *masks, const int32_t *vals, int32_t len, pack_run *runs, int32_t *cand,
                        int32_t *sorted, pack_sets *sets, int32_t *out) {
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
      u = pack_widen(runs, n_runs, u, need, sets);
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
    pack_sets *sets = (pack_sets *)calloc(1, sizeof(pack_sets));
    if (!masks || !vals || !runs || !cand || !sets) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < windows; ++w) {
      if (!masks || !vals || !runs || !cand || !sets) continue;
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
      pack_window(masks, vals, len, runs, cand, cand + TSP_PACK_WINDOW, sets, out + base);
    }
    free(masks);
    free(vals);
    free(runs);
    free(cand);
    free(sets);
  }
  return failed ? TSP_ERR_ALLOC : TSP_OK;
}
