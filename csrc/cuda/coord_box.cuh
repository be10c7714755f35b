/*
** coord_box.cuh: the bounding box of a coordinate set, computed on the device,
** the compact keys it allows, and the slot hash of the key tables.  Private to
** keys.cu and kmap.cu.
**
** Why: a radix sort costs one pass per 8 key bits, and the absolute keys of
** tsp_key.h spend 63 bits on every coordinate.  A LiDAR scan spans ~2000
** voxels in x and y and ~100 in z at 5 cm, so keys relative to the box's low
** corner, each field just wide enough for the box, need ~29 bits: half the
** passes of a 64-bit sort, and CUB's onesweep turns a pass whose digit is the
** same in every key into a plain copy.  The host never learns the box (no
** synchronisation inside an op), so every kernel that packs or unpacks compact
** keys recomputes the layout from the box in device memory: a handful of
** integer instructions per thread.
**
** Compact key: ((b - lo_b) << (wx + wy + wz)) | ((x - lo_x) << (wy + wz)) |
** ((y - lo_y) << wz) | (z - lo_z), w_a the bit width of hi_a - lo_a.  Same
** lexicographic order as (b, x, y, z), like the absolute key.
*/
#ifndef TSP_COORD_BOX_CUH
#define TSP_COORD_BOX_CUH

#include <stdint.h>

#include "cuda_common.cuh"

/*
** Running maxima of (b, x, y, z) and of their bitwise complements (the max of
** ~c is ~min c, and ~ cannot overflow where negation can).  Cleared by
** cudaMemsetAsync(box, 0x80, sizeof): every field starts at -2139062144, below
** any coordinate and any complement of a coordinate a SparseTensor can hold.
*/
typedef struct {
  int32_t max_c[4];
  int32_t max_not_c[4];
} tsp_coord_box;

enum { TSP_BOX_CLEAR_BYTE = 0x80, TSP_BOX_THREADS = 256 };

/* Bits needed to hold 0..range (0 for an empty or single-valued range). */
static __device__ __forceinline__ int tsp_range_bits(int64_t range) {
  if (range <= 0) return 0;
  return 64 - __clzll((unsigned long long)range);
}

typedef struct {
  int64_t lo[4];  /* low corner, (b, x, y, z) */
  int64_t hi[4];  /* high corner, inclusive */
  int shift[4];   /* left shift of each field in the compact key */
  int total_bits; /* key width; <= 63 when every axis is clamped to the packable range */
} tsp_key_layout;

/* Layout of compact keys for the box [lo, hi] (hi < lo on an axis: empty, width 0). */
static __device__ __forceinline__ void tsp_layout_from_corners(const int64_t lo[4],
                                                               const int64_t hi[4],
                                                               tsp_key_layout *l) {
  int width[4];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    l->lo[a] = lo[a];
    l->hi[a] = hi[a];
    width[a] = tsp_range_bits(hi[a] - lo[a]);
  }
  l->shift[3] = 0;
  l->shift[2] = width[3];
  l->shift[1] = width[3] + width[2];
  l->shift[0] = width[3] + width[2] + width[1];
  l->total_bits = l->shift[0] + width[0];
}

static __device__ __forceinline__ void tsp_box_corners(const tsp_coord_box *box, int64_t lo[4],
                                                       int64_t hi[4]) {
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    lo[a] = (int64_t)~box->max_not_c[a];
    hi[a] = (int64_t)box->max_c[a];
  }
}

/* Caller has checked lo <= c <= hi on every axis. */
static __device__ __forceinline__ uint64_t tsp_compact_key(const tsp_key_layout *l, int64_t b,
                                                          int64_t x, int64_t y, int64_t z) {
  return ((uint64_t)(b - l->lo[0]) << l->shift[0]) | ((uint64_t)(x - l->lo[1]) << l->shift[1]) |
         ((uint64_t)(y - l->lo[2]) << l->shift[2]) | (uint64_t)(z - l->lo[3]);
}

static __device__ __forceinline__ void tsp_compact_unpack(const tsp_key_layout *l, uint64_t key,
                                                          int64_t c[4]) {
#pragma unroll
  for (int a = 3; a >= 0; --a) {
    const int width = (a == 0 ? l->total_bits : l->shift[a - 1]) - l->shift[a];
    const uint64_t mask = width >= 64 ? ~0ULL : ((1ULL << width) - 1);
    c[a] = (int64_t)((key >> l->shift[a]) & mask) + l->lo[a];
  }
}

/* Row i of an [n, 4] int32 coordinate array; one 16-byte load when aligned. */
static __device__ __forceinline__ int4 tsp_load_coord(const int32_t *coords, int64_t i,
                                                      bool aligned16) {
  if (aligned16) return __ldg(reinterpret_cast<const int4 *>(coords) + i);
  const int32_t *c = coords + 4 * i;
  return make_int4(__ldg(c), __ldg(c + 1), __ldg(c + 2), __ldg(c + 3));
}

/* A thread's running box (max of c, then of ~c, per field), before its first row. */
static __device__ __forceinline__ void tsp_box_start(int m[8]) {
  for (int a = 0; a < 8; ++a) m[a] = INT32_MIN;
}

static __device__ __forceinline__ void tsp_box_add(int m[8], int4 c) {
  m[0] = max(m[0], c.x);
  m[1] = max(m[1], c.y);
  m[2] = max(m[2], c.z);
  m[3] = max(m[3], c.w);
  m[4] = max(m[4], ~c.x);
  m[5] = max(m[5], ~c.y);
  m[6] = max(m[6], ~c.z);
  m[7] = max(m[7], ~c.w);
}

/*
** The block's boxes into *box: a warp then a block reduction, and 8 atomics
** per block.  Every thread of a TSP_BOX_THREADS block calls it once.
*/
static __device__ __forceinline__ void tsp_box_flush(int m[8], tsp_coord_box *box) {
  __shared__ int warp_max[TSP_BOX_THREADS / 32][8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  /* Shuffles rather than __reduce_max_sync: the extension may be built for pre-sm_80 too. */
  for (int a = 0; a < 8; ++a) {
    for (int o = 16; o > 0; o >>= 1) m[a] = max(m[a], __shfl_xor_sync(0xffffffffu, m[a], o));
  }
  if (lane == 0) {
    for (int a = 0; a < 8; ++a) warp_max[warp][a] = m[a];
  }
  __syncthreads();
  if (threadIdx.x < 8) {
    int v = INT32_MIN;
    for (int w = 0; w < TSP_BOX_THREADS / 32; ++w) v = max(v, warp_max[w][threadIdx.x]);
    int *field = threadIdx.x < 4 ? &box->max_c[threadIdx.x] : &box->max_not_c[threadIdx.x - 4];
    atomicMax(field, v);
  }
}

/*
** Box of coords [n, 4].  Launch with TSP_BOX_THREADS threads and a grid of a
** few blocks per SM (grid-stride), so the atomics stay in the hundreds.
*/
static __global__ void __launch_bounds__(TSP_BOX_THREADS)
    tsp_coord_box_kernel(const int32_t *__restrict__ coords, int64_t n, bool aligned16,
                         tsp_coord_box *box) {
  int m[8];
  tsp_box_start(m);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    tsp_box_add(m, tsp_load_coord(coords, i, aligned16));
  tsp_box_flush(m, box);
}

/* Slot of a 64-bit key in an open-addressing table of mask + 1 slots: murmur3's
** 64-bit finaliser (neighbouring keys differ in low bits, which it spreads). */
static __device__ __forceinline__ uint64_t tsp_hash_slot(uint64_t key, uint64_t mask) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ULL;
  key ^= key >> 33;
  return key & mask;
}

/* Blocks for the box kernel: enough to fill the chip, few enough that the atomics are cheap. */
static inline unsigned int tsp_box_blocks(int64_t n) {
  unsigned int b = tsp_grid_blocks(n, TSP_BOX_THREADS * 4);
  return b > 264 ? 264 : b;
}

static inline __host__ __device__ bool tsp_aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* Round a workspace sub-buffer up to 256 bytes (CUB and 16-byte loads want aligned bases). */
static inline size_t tsp_align256(size_t bytes) { return (bytes + 255) & ~(size_t)255; }

#endif /* TSP_COORD_BOX_CUH */
