/*
** kmap.c: kernel maps on the CPU.  nbmap[q, k] is the input row at
** out_coords[q] + delta_k, or -1; its transpose nbmap_t[p, k] is the output
** row that reads input p through offset k, or -1.
**
** Two searches, both over packed keys (tsp_key.h), both parallel over output
** rows with every nbmap entry written exactly once by one thread:
**   - z-delta (Spira): sort the input keys once with their rows.  Offsets are
**     numbered z fastest, so the Kz offsets of one (dx, dy) column are
**     consecutive and their keys are contiguous in key order: one binary search
**     finds the column's smallest z, then a short forward scan over z meets the
**     column's offsets in order of dz.  A 3x3x3 map costs 9 binary searches per
**     output instead of 27 lookups; the scan is short because LiDAR maps have
**     only ~3.5-10 of 27 neighbours present.
**   - hash: open addressing on the packed keys, capacity a power of two at
**     least twice the input count, linear probing; 27 probes per output, each
**     usually one cache miss.
** Input coordinates that cannot be packed are an error (TSP_ERR_RANGE); a
** query that leaves the packable range cannot match an input and is -1.
*/
#include <stdlib.h>

#include "cpu_common.h"

enum { KEY_AXIS_MASK = (1 << TSP_KEY_AXIS_BITS) - 1, KEY_BIAS = 1 << (TSP_KEY_AXIS_BITS - 1) };

/* First index i in sorted keys[0, n) with keys[i] >= key. */
static inline int64_t lower_bound(const int64_t *keys, int64_t n, int64_t key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static inline int axis_in_range(int64_t v) {
  return v >= TSP_COORD_MIN && v <= TSP_COORD_MAX;
}

/*
** First index i >= from in sorted keys[0, n) with keys[i] >= key, given that
** keys[from - 1] < key: gallop forward, then bisect.  Costs O(log distance),
** so a cursor that moves little between consecutive outputs is nearly free.
*/
static inline int64_t gallop_lower_bound(const int64_t *keys, int64_t n, int64_t from,
                                         int64_t key) {
  if (from >= n || keys[from] >= key) return from;
  int64_t lo = from, step = 1; /* keys[lo] < key */
  while (lo + step < n && keys[lo + step] < key) {
    lo += step;
    step *= 2;
  }
  const int64_t hi = lo + step < n ? lo + step : n;
  return lo + 1 + lower_bound(keys + lo + 1, hi - lo - 1, key);
}

/* Lexicographic (b, x, y, z) order of two coordinate rows, packable or not. */
static inline int coords_less(const int32_t *a, const int32_t *b) {
  for (int i = 0; i < 4; ++i) {
    if (a[i] != b[i]) return a[i] < b[i];
  }
  return 0;
}

/*
** z-delta search.  dz_sorted / iz_sorted are the column's z offsets in
** ascending order of dz with their z indices: the same for every column, and
** reversed relative to iz when sign = -1.
**
** Outputs are visited in key order (`order`, or row order when NULL: the
** caller sorts them unless they already are), and every thread keeps, per
** column, the lower bound found for its previous output.  In key order each
** column's lower bound only moves forward, so the search gallops a short way
** from the last one instead of bisecting all n_in keys: a merge join in
** effect, and cache-friendly (random-order binary searches over 173k keys
** were 10x slower).  When an output sorts before the previous one (a new
** chunk, or an unpackable output sorted last) the cursors are found by full
** binary searches again, so correctness never depends on the order.
*/
static tsp_status kmap_zdelta(const tsp_kernel *kern, const int64_t *deltas, const int64_t *keys,
                              const int32_t *rows, int64_t n_in, const int32_t *out_coords,
                              int64_t n_out, const int32_t *order, const int64_t *dz_sorted,
                              const int32_t *iz_sorted, int32_t *nbmap) {
  const int64_t volume = tsp_kernel_volume(kern), kz = kern->kernel[2];
  const int64_t columns = (int64_t)kern->kernel[0] * kern->kernel[1];
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    int64_t *cursor = malloc((size_t)columns * sizeof(int64_t));
    int64_t previous = -2;
    const int32_t *c_previous = NULL;
    if (cursor == NULL) failed = 1;
#pragma omp for schedule(dynamic, 256)
    for (int64_t i_out = 0; i_out < n_out; ++i_out) {
      if (cursor == NULL) continue;
      const int64_t q = order != NULL ? order[i_out] : i_out;
      int32_t *row = nbmap + q * volume;
      for (int64_t k = 0; k < volume; ++k) row[k] = -1;
      const int32_t *c = out_coords + 4 * q;
      const int fresh = i_out != previous + 1 || coords_less(c, c_previous);
      previous = i_out;
      c_previous = c;
      if (fresh) {
        for (int64_t col = 0; col < columns; ++col) cursor[col] = -1;
      }
      const int64_t b = c[0], z = c[3];
      if (b < 0 || b > TSP_BATCH_MAX) continue;
      for (int64_t col = 0; col < columns; ++col) {
        const int64_t *d = deltas + 3 * col * kz;
        const int64_t x = c[1] + d[0], y = c[2] + d[1];
        if (!axis_in_range(x) || !axis_in_range(y)) continue;
        int64_t z_lo = z + dz_sorted[0], z_hi = z + dz_sorted[kz - 1];
        if (z_lo < TSP_COORD_MIN) z_lo = TSP_COORD_MIN;
        if (z_hi > TSP_COORD_MAX) z_hi = TSP_COORD_MAX;
        if (z_lo > z_hi) continue;
        const int64_t key_lo = tsp_key_pack(b, x, y, z_lo), key_hi = tsp_key_pack(b, x, y, z_hi);
        const int64_t first = cursor[col] < 0 ? lower_bound(keys, n_in, key_lo)
                                              : gallop_lower_bound(keys, n_in, cursor[col], key_lo);
        cursor[col] = first;
        int64_t j = 0;
        for (int64_t i = first; i < n_in && keys[i] <= key_hi; ++i) {
          /* Merge the ascending input z's with the ascending offset z's. */
          const int64_t zi = (keys[i] & KEY_AXIS_MASK) - KEY_BIAS;
          while (j < kz && z + dz_sorted[j] < zi) ++j;
          if (j == kz) break;
          if (z + dz_sorted[j] == zi) row[col * kz + iz_sorted[j]] = rows[i];
        }
      }
    }
    free(cursor);
  }
  return failed ? TSP_ERR_ALLOC : TSP_OK;
}

/*
** *order = the output rows sorted by key (unpackable ones last), or NULL when
** the outputs are already in key order (out_coords results, sorted inputs):
** then the sort is skipped.
*/
static tsp_status output_order(const int32_t *out_coords, int64_t n_out, int32_t **order) {
  int unsorted = 0;
#pragma omp parallel for schedule(static) reduction(| : unsorted)
  for (int64_t q = 1; q < n_out; ++q)
    unsorted |= coords_less(out_coords + 4 * q, out_coords + 4 * q - 4);
  *order = NULL;
  if (!unsorted) return TSP_OK;
  int64_t *keys = malloc((size_t)n_out * sizeof(int64_t));
  int32_t *rows = malloc((size_t)n_out * sizeof(int32_t));
  if (keys == NULL || rows == NULL) {
    free(keys);
    free(rows);
    return TSP_ERR_ALLOC;
  }
  (void)tsp_pack_keys_cpu(out_coords, n_out, keys); /* unpackable -> TSP_KEY_NONE, sorted last */
#pragma omp parallel for schedule(static)
  for (int64_t q = 0; q < n_out; ++q) rows[q] = (int32_t)q;
  const tsp_status s = tsp_cpu_radix_sort(keys, rows, n_out);
  free(keys);
  if (s != TSP_OK) {
    free(rows);
    return s;
  }
  *order = rows;
  return TSP_OK;
}

static inline uint64_t hash_slot(int64_t key, int bits) {
  return ((uint64_t)key * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - bits);
}

/*
** Hash search.  The table is filled in parallel: a slot is claimed with a
** compare-and-swap on its key, and the row is stored by the claiming thread.
** Lookups start after the fill (the implicit barrier of the first loop).
*/
static tsp_status kmap_hash(const tsp_kernel *kern, const int64_t *deltas, const int64_t *keys,
                            int64_t n_in, const int32_t *out_coords, int64_t n_out,
                            int32_t *nbmap) {
  const int64_t volume = tsp_kernel_volume(kern);
  int bits = 4;
  while (((int64_t)1 << bits) < 2 * n_in) ++bits;
  const uint64_t capacity = (uint64_t)1 << bits, mask = capacity - 1;
  int64_t *table_keys = malloc(capacity * sizeof(int64_t));
  int32_t *table_rows = malloc(capacity * sizeof(int32_t));
  if (table_keys == NULL || table_rows == NULL) {
    free(table_keys);
    free(table_rows);
    return TSP_ERR_ALLOC;
  }
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (uint64_t s = 0; s < capacity; ++s) table_keys[s] = TSP_KEY_NONE;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n_in; ++i) {
      uint64_t s = hash_slot(keys[i], bits);
      for (;;) {
        int64_t expected = TSP_KEY_NONE;
        if (__atomic_compare_exchange_n(&table_keys[s], &expected, keys[i], 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
          table_rows[s] = (int32_t)i;
          break;
        }
        if (expected == keys[i]) break; /* duplicate coordinate (invalid input): one claim stays */
        s = (s + 1) & mask;
      }
    }
#pragma omp for schedule(dynamic, 256)
    for (int64_t q = 0; q < n_out; ++q) {
      const int32_t *c = out_coords + 4 * q;
      int32_t *row = nbmap + q * volume;
      for (int64_t k = 0; k < volume; ++k) {
        const int64_t *d = deltas + 3 * k;
        const int64_t x = c[1] + d[0], y = c[2] + d[1], z = c[3] + d[2];
        int32_t found = -1;
        if (tsp_key_in_range(c[0], x, y, z)) {
          const int64_t key = tsp_key_pack(c[0], x, y, z);
          for (uint64_t s = hash_slot(key, bits); table_keys[s] != TSP_KEY_NONE;
               s = (s + 1) & mask) {
            if (table_keys[s] == key) {
              found = table_rows[s];
              break;
            }
          }
        }
        row[k] = found;
      }
    }
  }
  free(table_keys);
  free(table_rows);
  return TSP_OK;
}

tsp_status tsp_kernel_map_cpu(const tsp_kernel *kern, tsp_kmap_method method,
                              const int32_t *in_coords, int64_t n_in, const int32_t *out_coords,
                              int64_t n_out, int32_t *nbmap) {
  if (!tsp_cpu_kernel_valid(kern) || n_in < 0 || n_in > INT32_MAX || n_out < 0 ||
      n_out > INT32_MAX || (method != TSP_KMAP_ZDELTA && method != TSP_KMAP_HASH))
    return TSP_ERR_ARGUMENT;
  const int64_t volume = tsp_kernel_volume(kern);
  if (n_out == 0) return TSP_OK;
  if (n_in == 0) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n_out * volume; ++i) nbmap[i] = -1;
    return TSP_OK;
  }
  int64_t *keys = malloc((size_t)n_in * sizeof(int64_t));
  int64_t *deltas = tsp_cpu_offsets(kern);
  int32_t *rows = NULL;
  tsp_status status = TSP_ERR_ALLOC;
  if (keys == NULL || deltas == NULL) goto done;
  status = tsp_pack_keys_cpu(in_coords, n_in, keys);
  if (status != TSP_OK) goto done;

  if (method == TSP_KMAP_HASH) {
    status = kmap_hash(kern, deltas, keys, n_in, out_coords, n_out, nbmap);
    goto done;
  }

  status = TSP_ERR_ALLOC;
  rows = malloc((size_t)n_in * sizeof(int32_t));
  if (rows == NULL) goto done;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n_in; ++i) rows[i] = (int32_t)i;
  status = tsp_cpu_radix_sort(keys, rows, n_in);
  if (status != TSP_OK) goto done;
  {
    /* The column's z offsets by ascending dz (insertion sort of Kz numbers). */
    const int64_t kz = kern->kernel[2];
    int64_t *dz_sorted = malloc((size_t)kz * sizeof(int64_t));
    int32_t *iz_sorted = malloc((size_t)kz * sizeof(int32_t));
    if (dz_sorted == NULL || iz_sorted == NULL) {
      free(dz_sorted);
      free(iz_sorted);
      status = TSP_ERR_ALLOC;
      goto done;
    }
    for (int64_t iz = 0; iz < kz; ++iz) {
      const int64_t dz = deltas[3 * iz + 2];
      int64_t j = iz;
      for (; j > 0 && dz_sorted[j - 1] > dz; --j) {
        dz_sorted[j] = dz_sorted[j - 1];
        iz_sorted[j] = iz_sorted[j - 1];
      }
      dz_sorted[j] = dz;
      iz_sorted[j] = (int32_t)iz;
    }
    int32_t *order = NULL;
    status = output_order(out_coords, n_out, &order);
    if (status == TSP_OK)
      status = kmap_zdelta(kern, deltas, keys, rows, n_in, out_coords, n_out, order, dz_sorted,
                           iz_sorted, nbmap);
    free(order);
    free(dz_sorted);
    free(iz_sorted);
  }
done:
  free(keys);
  free(deltas);
  free(rows);
  return status;
}

tsp_status tsp_kernel_map_transpose_cpu(const int32_t *nbmap, int64_t n_out, int64_t volume,
                                        int64_t n_in, int32_t *nbmap_t) {
  if (n_out < 0 || n_out > INT32_MAX || volume < 0 || n_in < 0) return TSP_ERR_ARGUMENT;
  const int64_t entries = n_out * volume;
  int bad = 0;
#pragma omp parallel
  {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n_in * volume; ++i) nbmap_t[i] = -1;
#pragma omp for schedule(static) reduction(| : bad)
    for (int64_t i = 0; i < entries; ++i) bad |= nbmap[i] < -1 || nbmap[i] >= n_in;
  }
  if (bad) return TSP_ERR_ARGUMENT;
  /*
  ** The scatter is serial: it is one pass over n_out * V ints, and a second
  ** claim on (p, k) must be detected, not raced.
  */
  for (int64_t q = 0; q < n_out; ++q) {
    const int32_t *row = nbmap + q * volume;
    for (int64_t k = 0; k < volume; ++k) {
      const int32_t p = row[k];
      if (p < 0) continue;
      int32_t *slot = nbmap_t + (int64_t)p * volume + k;
      if (*slot != -1) return TSP_ERR_ARGUMENT;
      *slot = (int32_t)q;
    }
  }
  return TSP_OK;
}
