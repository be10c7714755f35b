/*
** cpu_common.h: helpers private to the C11 CPU kernels of csrc/cpu (keys.c,
** kmap.c, conv.c).  Not part of the C interface: the shims see torchsp.h only.
**
** Offsets are recomputed here in int64 rather than with tsp_kernel_offset():
** the shim lets kernel, dilation, padding and step each reach 2^20, so
** (i * dilation - padding) * step can pass 2^31 before the range check that
** turns such an offset into "not found" or TSP_ERR_RANGE.
*/
#ifndef TSP_CPU_COMMON_H
#define TSP_CPU_COMMON_H

#include <stdint.h>

#include "torchsp.h"

/* 1 when every field of `kern` is one the kernels can take. */
static inline int tsp_cpu_kernel_valid(const tsp_kernel *kern) {
  for (int a = 0; a < 3; ++a) {
    if (kern->kernel[a] < 1 || kern->dilation[a] < 1 || kern->padding[a] < 0 ||
        kern->step[a] < 1)
      return 0;
  }
  return (kern->sign == 1 || kern->sign == -1) && tsp_kernel_volume(kern) <= INT32_MAX;
}

/* delta_k per axis in int64 (same formula as tsp_kernel_offset). */
static inline void tsp_cpu_offset(const tsp_kernel *kern, int64_t k, int64_t delta[3]) {
  const int64_t kz = kern->kernel[2], ky = kern->kernel[1];
  const int64_t i[3] = {k / (kz * ky), (k / kz) % ky, k % kz};
  for (int a = 0; a < 3; ++a)
    delta[a] = kern->sign * (i[a] * kern->dilation[a] - kern->padding[a]) * kern->step[a];
}

/* The V offsets as an int64 [V, 3] array (malloc'd; NULL when out of memory). */
int64_t *tsp_cpu_offsets(const tsp_kernel *kern);

/* Sort n keys ascending, in place, carrying `rows` along when it is not NULL.
** Stable LSD radix sort, 8 bits a pass, parallel over OpenMP threads; a pass
** whose byte is the same in every key is skipped.  Keys must be >= 0 (packed
** keys and TSP_KEY_NONE are).  Returns TSP_OK or TSP_ERR_ALLOC. */
tsp_status tsp_cpu_radix_sort(int64_t *keys, int32_t *rows, int64_t n);

#endif /* TSP_CPU_COMMON_H */
