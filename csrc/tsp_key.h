/*
** tsp_key.h: packing (batch, x, y, z) coordinates into one 64-bit key, and the
** kernel-offset arithmetic of DESIGN.md section 2.  Shared by the C11 CPU kernels
** and the CUDA kernels, so every helper here is `static inline` plain C that
** also compiles as device code.
**
** Key layout (Spira's bounded packing): bit 63 is zero, then 9 bits of batch,
** then 18 bits each of x, y, z biased by 2^17.  Numeric order of keys equals
** the lexicographic order of (b, x, y, z), so one sort serves search, unique
** and "output coordinates sorted by key".  Coordinates outside
** [TSP_COORD_MIN, TSP_COORD_MAX] or batches outside [0, TSP_BATCH_MAX] cannot
** be packed: callers report TSP_ERR_RANGE (never wrap around).  18 bits is
** +-6.5 km of 5 cm voxels, far beyond any LiDAR or RGB-D scan.
*/
#ifndef TSP_KEY_H
#define TSP_KEY_H

#include <stdint.h>

#ifdef __CUDACC__
#define TSP_HD __host__ __device__
#else
#define TSP_HD
#endif

enum {
  TSP_KEY_AXIS_BITS = 18,
  TSP_KEY_BATCH_BITS = 9,
  TSP_COORD_MIN = -131072, /* -2^17 */
  TSP_COORD_MAX = 131071,  /* 2^17 - 1 */
  TSP_BATCH_MAX = 511      /* 2^9 - 1 */
};

/* Sentinel for "no key": larger than every valid key. */
static const int64_t TSP_KEY_NONE = INT64_MAX;

/* 1 when (b, x, y, z) can be packed. */
static inline TSP_HD int tsp_key_in_range(int64_t b, int64_t x, int64_t y, int64_t z) {
  return b >= 0 && b <= TSP_BATCH_MAX &&
         x >= TSP_COORD_MIN && x <= TSP_COORD_MAX &&
         y >= TSP_COORD_MIN && y <= TSP_COORD_MAX &&
         z >= TSP_COORD_MIN && z <= TSP_COORD_MAX;
}

/* Pack an in-range coordinate; the caller has checked tsp_key_in_range. */
static inline TSP_HD int64_t tsp_key_pack(int64_t b, int64_t x, int64_t y, int64_t z) {
  const int64_t bias = (int64_t)1 << (TSP_KEY_AXIS_BITS - 1);
  return (b << (3 * TSP_KEY_AXIS_BITS)) | ((x + bias) << (2 * TSP_KEY_AXIS_BITS)) |
         ((y + bias) << TSP_KEY_AXIS_BITS) | (z + bias);
}

static inline TSP_HD void tsp_key_unpack(int64_t key, int32_t out[4]) {
  const int64_t bias = (int64_t)1 << (TSP_KEY_AXIS_BITS - 1);
  const int64_t mask = ((int64_t)1 << TSP_KEY_AXIS_BITS) - 1;
  out[0] = (int32_t)(key >> (3 * TSP_KEY_AXIS_BITS));
  out[1] = (int32_t)(((key >> (2 * TSP_KEY_AXIS_BITS)) & mask) - bias);
  out[2] = (int32_t)(((key >> TSP_KEY_AXIS_BITS) & mask) - bias);
  out[3] = (int32_t)((key & mask) - bias);
}

/* Floor division and modulo for possibly negative coordinates (C rounds to zero). */
static inline TSP_HD int64_t tsp_floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

static inline TSP_HD int64_t tsp_floor_mod(int64_t a, int64_t b) {
  return a - tsp_floor_div(a, b) * b;
}

#endif /* TSP_KEY_H */
