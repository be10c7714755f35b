/*
** keys.c: packing (batch, x, y, z) rows into 64-bit keys (tsp_key.h), the
** radix sort every CPU kernel sorts keys with, and the output coordinates of
** strided, generative and transposed-generative convs.
**
** Output coordinates are "every candidate q = p - delta_k on the output
** lattice, sorted and unique".  A generative 3x3x3 conv over a 173k-voxel
** LiDAR scan makes 4.7M candidates, so the sort dominates: a stable LSD radix
** sort is linear in n, runs its histogram and scatter passes on every core,
** and skips the bytes no key differs in (the batch bits of a one-scan batch,
** the high bits of a small bounding box).  Candidates are computed once, into
** per-chunk slices of the output buffer, then compacted in chunk order, so the
** result does not depend on the number of threads.
*/
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "cpu_common.h"

/* Below this many keys a single thread sorts faster than a team forks. */
enum { RADIX_SERIAL_BELOW = 1 << 16 };

int64_t *tsp_cpu_offsets(const tsp_kernel *kern) {
  const int64_t volume = tsp_kernel_volume(kern);
  int64_t *deltas = malloc((size_t)volume * 3 * sizeof(int64_t));
  if (deltas == NULL) return NULL;
  for (int64_t k = 0; k < volume; ++k) tsp_cpu_offset(kern, k, deltas + 3 * k);
  return deltas;
}

/*
** One stable counting pass on the byte at `shift`: every thread histograms its
** contiguous slice, the offsets are laid out byte-major then thread-major, and
** every thread scatters its slice in order.  That layout is what keeps the
** pass stable, and stability is what makes LSD radix sorting correct.
*/
static void radix_pass(const int64_t *restrict src, const int32_t *restrict src_rows,
                       int64_t *restrict dst, int32_t *restrict dst_rows, int64_t n, int shift,
                       int64_t *restrict hist, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
    int64_t *restrict h = hist + (int64_t)256 * t;
    memset(h, 0, 256 * sizeof(int64_t));
    for (int64_t i = lo; i < hi; ++i) h[(src[i] >> shift) & 0xff]++;
#pragma omp barrier
#pragma omp single
    {
      int64_t sum = 0;
      for (int b = 0; b < 256; ++b) {
        for (int u = 0; u < nt; ++u) {
          const int64_t c = hist[(int64_t)256 * u + b];
          hist[(int64_t)256 * u + b] = sum;
          sum += c;
        }
      }
    }
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t pos = h[(src[i] >> shift) & 0xff]++;
      dst[pos] = src[i];
      if (src_rows != NULL) dst_rows[pos] = src_rows[i];
    }
  }
}

tsp_status tsp_cpu_radix_sort(int64_t *keys, int32_t *rows, int64_t n) {
  if (n < 2) return TSP_OK;
  /* Bits that differ from the first key somewhere: a byte with none is skipped. */
  const int64_t first = keys[0];
  uint64_t differ = 0;
#pragma omp parallel for reduction(| : differ) if (n >= RADIX_SERIAL_BELOW)
  for (int64_t i = 0; i < n; ++i) differ |= (uint64_t)(keys[i] ^ first);
  if (differ == 0) return TSP_OK;

  const int threads = n < RADIX_SERIAL_BELOW ? 1 : omp_get_max_threads();
  int64_t *tmp = malloc((size_t)n * sizeof(int64_t));
  int32_t *tmp_rows = rows != NULL ? malloc((size_t)n * sizeof(int32_t)) : NULL;
  int64_t *hist = malloc((size_t)threads * 256 * sizeof(int64_t));
  if (tmp == NULL || hist == NULL || (rows != NULL && tmp_rows == NULL)) {
    free(tmp);
    free(tmp_rows);
    free(hist);
    return TSP_ERR_ALLOC;
  }
  int64_t *src = keys, *dst = tmp;
  int32_t *src_rows = rows, *dst_rows = tmp_rows;
  for (int shift = 0; shift < 64; shift += 8) {
    if (((differ >> shift) & 0xff) == 0) continue;
    radix_pass(src, src_rows, dst, dst_rows, n, shift, hist, threads);
    int64_t *s = src;
    src = dst;
    dst = s;
    int32_t *r = src_rows;
    src_rows = dst_rows;
    dst_rows = r;
  }
  if (src != keys) {
    memcpy(keys, src, (size_t)n * sizeof(int64_t));
    if (rows != NULL) memcpy(rows, src_rows, (size_t)n * sizeof(int32_t));
  }
  free(tmp);
  free(tmp_rows);
  free(hist);
  return TSP_OK;
}

tsp_status tsp_pack_keys_cpu(const int32_t *coords, int64_t n, int64_t *keys) {
  if (n < 0) return TSP_ERR_ARGUMENT;
  int bad = 0;
#pragma omp parallel for reduction(| : bad) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int32_t *c = coords + 4 * i;
    if (tsp_key_in_range(c[0], c[1], c[2], c[3])) {
      keys[i] = tsp_key_pack(c[0], c[1], c[2], c[3]);
    } else {
      keys[i] = TSP_KEY_NONE;
      bad = 1;
    }
  }
  return bad ? TSP_ERR_RANGE : TSP_OK;
}

void tsp_unpack_keys_cpu(const int64_t *keys, int64_t n, int32_t *coords) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) tsp_key_unpack(keys[i], coords + 4 * i);
}

tsp_status tsp_coords_summary_cpu(const int32_t *coords, int64_t n, const int32_t stride[3],
                                  int32_t summary[TSP_SUMMARY_WORDS]) {
  if (n < 0 || (n > 0 && coords == NULL) || stride[0] < 1 || stride[1] < 1 || stride[2] < 1)
    return TSP_ERR_ARGUMENT;
  for (int w = 0; w < TSP_SUMMARY_WORDS; ++w) summary[w] = TSP_SUMMARY_NONE;
  if (n == 0) return TSP_OK;
  int32_t m[8] = {INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                  INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN};
  int off_lattice = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t *c = coords + 4 * i;
    for (int a = 0; a < 4; ++a) {
      if (c[a] > m[a]) m[a] = c[a];
      if (~c[a] > m[4 + a]) m[4 + a] = ~c[a];
    }
    for (int a = 0; a < 3; ++a) off_lattice |= c[1 + a] % stride[a] != 0;
  }
  for (int w = 0; w < 8; ++w) summary[w] = m[w];
  summary[8] = off_lattice;
  /* Duplicates: sort the packable rows' keys, compare neighbours. */
  int64_t *keys = malloc((size_t)n * sizeof(int64_t));
  if (keys == NULL) return TSP_ERR_ALLOC;
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t *c = coords + 4 * i;
    if (tsp_key_in_range(c[0], c[1], c[2], c[3])) keys[kept++] = tsp_key_pack(c[0], c[1], c[2], c[3]);
  }
  tsp_status st = tsp_cpu_radix_sort(keys, NULL, kept);
  int duplicate = 0;
  for (int64_t i = 1; st == TSP_OK && i < kept && !duplicate; ++i) duplicate = keys[i] == keys[i - 1];
  free(keys);
  summary[9] = duplicate;
  return st;
}

/* 1 when q is a multiple of the lattice on every axis (floor mod: q may be negative). */
static inline int on_lattice(const int64_t q[3], const int32_t lattice[3]) {
  for (int a = 0; a < 3; ++a) {
    if (lattice[a] != 1 && tsp_floor_mod(q[a], lattice[a]) != 0) return 0;
  }
  return 1;
}

/*
** Candidates of inputs [lo, hi) written from out[0]; returns how many were
** kept, or -1 when a kept candidate cannot be packed.  Off-lattice candidates
** are not output sites, so their range does not matter.
*/
static int64_t chunk_candidates(const tsp_out_coords_params *params, const int64_t *deltas,
                                int64_t volume, const int32_t *in_coords, int64_t lo, int64_t hi,
                                int64_t *out) {
  int64_t kept = 0;
  for (int64_t i = lo; i < hi; ++i) {
    const int32_t *c = in_coords + 4 * i;
    const int64_t b = c[0];
    if (params->floor_rule) {
      int64_t q[3];
      for (int a = 0; a < 3; ++a)
        q[a] = tsp_floor_div(c[a + 1], params->lattice[a]) * params->lattice[a];
      if (!tsp_key_in_range(b, q[0], q[1], q[2])) return -1;
      out[kept++] = tsp_key_pack(b, q[0], q[1], q[2]);
      continue;
    }
    for (int64_t k = 0; k < volume; ++k) {
      const int64_t *d = deltas + 3 * k;
      const int64_t q[3] = {c[1] - d[0], c[2] - d[1], c[3] - d[2]};
      if (!on_lattice(q, params->lattice)) continue;
      if (!tsp_key_in_range(b, q[0], q[1], q[2])) return -1;
      out[kept++] = tsp_key_pack(b, q[0], q[1], q[2]);
    }
  }
  return kept;
}

tsp_status tsp_out_coords_cpu(const tsp_out_coords_params *params, const int32_t *in_coords,
                              int64_t n_in, int64_t *keys_out, int64_t *n_out) {
  *n_out = 0;
  if (n_in < 0 || !tsp_cpu_kernel_valid(&params->kernel)) return TSP_ERR_ARGUMENT;
  for (int a = 0; a < 3; ++a) {
    if (params->lattice[a] < 1) return TSP_ERR_ARGUMENT;
  }
  if (n_in == 0) return TSP_OK;
  const int64_t volume = params->floor_rule ? 1 : tsp_kernel_volume(&params->kernel);
  int64_t *deltas = tsp_cpu_offsets(&params->kernel);
  /* A fixed chunk count (not the thread count) keeps the result thread-independent. */
  const int64_t chunks = n_in < 256 ? 1 : 256;
  int64_t *kept = malloc((size_t)chunks * sizeof(int64_t));
  if (deltas == NULL || kept == NULL) {
    free(deltas);
    free(kept);
    return TSP_ERR_ALLOC;
  }
  int bad = 0;
#pragma omp parallel for reduction(| : bad) schedule(dynamic, 1)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const int64_t lo = n_in * ch / chunks, hi = n_in * (ch + 1) / chunks;
    kept[ch] = chunk_candidates(params, deltas, volume, in_coords, lo, hi, keys_out + lo * volume);
    if (kept[ch] < 0) bad = 1;
  }
  free(deltas);
  if (bad) {
    free(kept);
    return TSP_ERR_RANGE;
  }
  /* Compact the chunk slices in order; destinations never pass their sources. */
  int64_t total = 0;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const int64_t lo = n_in * ch / chunks;
    if (total != lo * volume)
      memmove(keys_out + total, keys_out + lo * volume, (size_t)kept[ch] * sizeof(int64_t));
    total += kept[ch];
  }
  free(kept);
  const tsp_status s = tsp_cpu_radix_sort(keys_out, NULL, total);
  if (s != TSP_OK) return s;
  int64_t unique = 0;
  for (int64_t i = 0; i < total; ++i) {
    if (unique == 0 || keys_out[i] != keys_out[unique - 1]) keys_out[unique++] = keys_out[i];
  }
  *n_out = unique;
  return TSP_OK;
}
