/*
** kmap.cu: kernel maps on the GPU.  nbmap[q, k] is the input row at
** out_coords[q] + delta_k, or -1; nbmap_t[p, k] is the output row that reads
** input p through offset k, or -1 (torchsp.h).
**
** Workload: a LiDAR scan of ~100-200k voxels, 27 or 125 offsets, ~3.5-10 of
** 27 neighbours present.  The map itself is 173k * 27 * 4 = 18.7 MB, ~6 us of
** writes at 3 TB/s, so the build is about latency and launch count, not
** bandwidth: every launch costs ~2 us of stream time at this size.
**
** Two searches; every nbmap entry is written exactly once by one thread:
**   - z-delta (Spira): compact input keys (coord_box.cuh) with their rows,
**     sorted by CUB as 32-bit keys (4 onesweep passes, not the 8 of 64-bit
**     keys).  One thread per (output q, (dx, dy) column): offsets are numbered
**     z fastest, so a column's Kz offsets are consecutive in k and their keys
**     contiguous in key order; one binary search finds the lower bound of the
**     column's smallest z, then a short forward scan (a binary search when the
**     scan runs long) meets the column's z offsets in ascending dz (sign -1
**     reverses iz).  9 searches per output for 3x3x3 instead of 27 lookups.
**     The 32-bit keys need the input box to fit in 32 bits (a single 5 cm
**     LiDAR scan needs ~29); the host cannot know (it never synchronises), so
**     the kernels read the box from device memory and, when it does not fit,
**     the same launches build and query a hash table instead.
**   - hash: open addressing on absolute 64-bit keys (tsp_key.h), capacity a
**     power of two >= 2 * n_in, linear probing, atomicCAS insert; one thread
**     per (q, k), so a warp writes 32 consecutive entries.  Three launches.
** A query outside the packable range, or outside the input box, is "not found".
**
** Measured (H100, 173k-voxel two-scan LiDAR-like set, graph replay, median of
** 50): 3x3x3 hash 66-73 us, z-delta 112-114 us, of which CUB's 32-bit
** SortPairs alone is 52 us; 5x5x5 hash 244-265 us, z-delta 238-243 us.  Both
** are far above the 30 us goal: next steps are a cheaper sort than onesweep at
** this size, column-bucketed hashing (a column's z keys in one cache line),
** 32-bit compact keys packed with the row in one 64-bit slot, and building
** half a submanifold map and mirroring it.
*/
#include <cub/device/device_radix_sort.cuh>

#include "coord_box.cuh"
#include "cuda_common.cuh"

enum { KMAP_THREADS = 256 };

static const uint64_t HASH_EMPTY = ~0ULL; /* every valid key is < 2^63 */

/*
** Division by a run-time constant with one multiply-high, an add and a shift
** (Granlund-Montgomery), exact for every 32-bit dividend.  Why: the map
** kernels split a flat index into (q, k) per entry, and a 64-bit division is
** a ~70-instruction subroutine.  Measured on H100: hash 3x3x3 at 173k went
** from 84 to 73 us (less than hoped: the probes, not the divisions, dominate).
** Launches are split into row chunks so that the flat index stays below 2^31.
*/
typedef struct {
  uint32_t d, m, shift;
} fast_div;

static fast_div make_fast_div(uint32_t d) {
  fast_div f;
  f.d = d;
  f.shift = 0;
  while (((uint64_t)1 << f.shift) < d) ++f.shift;
  f.m = (uint32_t)((((uint64_t)1 << 32) * (((uint64_t)1 << f.shift) - d)) / d + 1);
  return f;
}

static __device__ __forceinline__ uint32_t div_fast(uint32_t n, fast_div f) {
  return (uint32_t)(((uint64_t)__umulhi(n, f.m) + n) >> f.shift);
}

/* Rows per launch so that rows * per_row < 2^31 (one launch for any LiDAR-sized map). */
static int64_t rows_per_launch(int64_t per_row) {
  const int64_t rows = (((int64_t)1 << 31) - 1) / (per_row > 0 ? per_row : 1);
  return rows > 0 ? rows : 1;
}

/* Offset of index i on axis a, in int64: kernel, dilation, padding and step may each reach 2^20. */
static __host__ __device__ __forceinline__ int64_t axis_offset(const tsp_kernel &kern, int a,
                                                               int64_t i) {
  return (int64_t)kern.sign * (i * kern.dilation[a] - kern.padding[a]) * kern.step[a];
}

static bool kernel_valid(const tsp_kernel *kern) {
  for (int a = 0; a < 3; ++a) {
    if (kern->kernel[a] < 1 || kern->dilation[a] < 1 || kern->padding[a] < 0 ||
        kern->step[a] < 1)
      return false;
  }
  return (kern->sign == 1 || kern->sign == -1) && tsp_kernel_volume(kern) <= INT32_MAX;
}

/* ------------------------------------------------------------ hash table --- */

/* murmur3's 64-bit finaliser: neighbouring keys differ in low bits, which it spreads. */
static __device__ __forceinline__ uint64_t hash_slot(uint64_t key, uint64_t mask) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ULL;
  key ^= key >> 33;
  return key & mask;
}

/* Inputs are unique (a SparseTensor invariant), so each key is inserted once. */
static __device__ __forceinline__ void hash_insert(uint64_t *table_keys, int32_t *table_rows,
                                                   uint64_t mask, uint64_t key, int32_t row) {
  uint64_t slot = hash_slot(key, mask);
  for (;;) {
    const unsigned long long prev = atomicCAS((unsigned long long *)&table_keys[slot],
                                              (unsigned long long)HASH_EMPTY,
                                              (unsigned long long)key);
    if (prev == HASH_EMPTY || prev == key) {
      table_rows[slot] = row;
      return;
    }
    slot = (slot + 1) & mask;
  }
}

static __device__ __forceinline__ int32_t hash_find(const uint64_t *__restrict__ table_keys,
                                                    const int32_t *__restrict__ table_rows,
                                                    uint64_t mask, uint64_t key) {
  uint64_t slot = hash_slot(key, mask);
  for (;;) {
    const uint64_t k = table_keys[slot];
    if (k == key) return table_rows[slot];
    if (k == HASH_EMPTY) return -1;
    slot = (slot + 1) & mask;
  }
}

/* Row of input (b, x, y, z) through the table, -1 when absent or unpackable. */
static __device__ __forceinline__ int32_t hash_lookup(const uint64_t *__restrict__ table_keys,
                                                      const int32_t *__restrict__ table_rows,
                                                      uint64_t mask, int64_t b, int64_t x,
                                                      int64_t y, int64_t z) {
  if (!tsp_key_in_range(b, x, y, z)) return -1;
  return hash_find(table_keys, table_rows, mask, (uint64_t)tsp_key_pack(b, x, y, z));
}

static __global__ void hash_insert_kernel(const int32_t *__restrict__ coords, int64_t n,
                                          bool aligned16, uint64_t *table_keys,
                                          int32_t *table_rows, uint64_t mask) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int4 c = tsp_load_coord(coords, i, aligned16);
    if (!tsp_key_in_range(c.x, c.y, c.z, c.w)) continue; /* cannot be found by any query */
    hash_insert(table_keys, table_rows, mask, (uint64_t)tsp_key_pack(c.x, c.y, c.z, c.w),
                (int32_t)i);
  }
}

/* One thread per (q, k) of rows [q0, q0 + rows): consecutive threads write consecutive nbmap entries. */
static __global__ void hash_query_kernel(tsp_kernel kern, const int32_t *__restrict__ out_coords,
                                         int64_t q0, uint32_t rows, bool aligned16,
                                         fast_div div_volume, fast_div div_kz, fast_div div_ky,
                                         const uint64_t *__restrict__ table_keys,
                                         const int32_t *__restrict__ table_rows, uint64_t mask,
                                         int32_t *__restrict__ nbmap) {
  const uint32_t entries = rows * div_volume.d;
  for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < entries;
       t += gridDim.x * blockDim.x) {
    const uint32_t q = div_fast(t, div_volume), k = t - q * div_volume.d;
    const uint32_t xy = div_fast(k, div_kz), iz = k - xy * div_kz.d;
    const uint32_t ix = div_fast(xy, div_ky), iy = xy - ix * div_ky.d;
    const int4 c = tsp_load_coord(out_coords, q0 + q, aligned16);
    const int64_t x = c.y + axis_offset(kern, 0, ix);
    const int64_t y = c.z + axis_offset(kern, 1, iy);
    const int64_t z = c.w + axis_offset(kern, 2, iz);
    nbmap[q0 * div_volume.d + t] = hash_lookup(table_keys, table_rows, mask, c.x, x, y, z);
  }
}

/* --------------------------------------------------------------- z-delta --- */

/* 1 when the compact keys of the input box fit in 32 bits: the z-delta path. */
static __device__ __forceinline__ bool box_fits32(const tsp_coord_box *box, tsp_key_layout *l) {
  int64_t lo[4], hi[4];
  tsp_box_corners(box, lo, hi);
  /* A box wider than the packable range cannot fit; clamp so shifts stay < 64. */
  for (int a = 0; a < 4; ++a) {
    if (hi[a] - lo[a] > ((int64_t)1 << 32)) hi[a] = lo[a] + ((int64_t)1 << 32);
  }
  tsp_layout_from_corners(lo, hi, l);
  return l->total_bits <= 32;
}

/* Fill the hash table's keys, only when the box is too wide for 32-bit keys. */
static __global__ void fallback_clear_kernel(const tsp_coord_box *box, uint64_t *table_keys,
                                             int64_t capacity) {
  tsp_key_layout l;
  if (box_fits32(box, &l)) return;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < capacity;
       i += (int64_t)gridDim.x * blockDim.x)
    table_keys[i] = HASH_EMPTY;
}

/*
** Compact 32-bit keys and row ids for the sort.  When the box does not fit,
** the keys are zeros (every onesweep pass becomes a copy) and the inputs go
** into the hash table instead.
*/
static __global__ void zdelta_pack_kernel(const int32_t *__restrict__ coords, int64_t n,
                                          bool aligned16, const tsp_coord_box *box,
                                          uint32_t *__restrict__ keys,
                                          int32_t *__restrict__ rows, uint64_t *table_keys,
                                          int32_t *table_rows, uint64_t mask) {
  tsp_key_layout l;
  const bool fits = box_fits32(box, &l);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int4 c = tsp_load_coord(coords, i, aligned16);
    rows[i] = (int32_t)i;
    if (fits) {
      keys[i] = (uint32_t)tsp_compact_key(&l, c.x, c.y, c.z, c.w);
    } else {
      keys[i] = 0;
      if (tsp_key_in_range(c.x, c.y, c.z, c.w))
        hash_insert(table_keys, table_rows, mask, (uint64_t)tsp_key_pack(c.x, c.y, c.z, c.w),
                    (int32_t)i);
    }
  }
}

/* First index in sorted keys[lo, hi) with keys[i] >= key. */
static __device__ __forceinline__ int64_t lower_bound32(const uint32_t *__restrict__ keys,
                                                        int64_t lo, int64_t hi, uint32_t key) {
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (__ldg(keys + mid) < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Past this many steps the forward scan gives way to a binary search (large dilations). */
enum { ZDELTA_SCAN_STEPS = 8 };

/*
** One thread per (q, column), column = ix * Ky + iy.  Neighbouring threads
** share q (one coordinate load, broadcast) and write neighbouring runs of Kz
** entries, so a warp's stores cover a contiguous stretch of nbmap.
*/
static __global__ void zdelta_search_kernel(tsp_kernel kern, const tsp_coord_box *box,
                                            const uint32_t *__restrict__ keys,
                                            const int32_t *__restrict__ rows, int64_t n_in,
                                            const int32_t *__restrict__ out_coords, int64_t q0,
                                            uint32_t n_rows, bool aligned16,
                                            fast_div div_columns, fast_div div_ky,
                                            const uint64_t *__restrict__ table_keys,
                                            const int32_t *__restrict__ table_rows,
                                            uint64_t mask, int32_t *__restrict__ nbmap) {
  tsp_key_layout l;
  const bool fits = box_fits32(box, &l);
  const int64_t kx = kern.kernel[0], ky = kern.kernel[1], kz = kern.kernel[2];
  const int64_t volume = kx * ky * kz;
  /* Ascending dz: iz ascending for sign +1, descending for sign -1. */
  const int64_t iz_first = kern.sign > 0 ? 0 : kz - 1, iz_step = kern.sign > 0 ? 1 : -1;
  const uint32_t items = n_rows * div_columns.d;
  for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < items;
       t += gridDim.x * blockDim.x) {
    const uint32_t local_q = div_fast(t, div_columns), col = t - local_q * div_columns.d;
    const uint32_t ix = div_fast(col, div_ky), iy = col - ix * div_ky.d;
    const int64_t q = q0 + local_q;
    const int4 c = tsp_load_coord(out_coords, q, aligned16);
    const int64_t x = c.y + axis_offset(kern, 0, ix);
    const int64_t y = c.z + axis_offset(kern, 1, iy);
    int32_t *dst = nbmap + q * volume + col * kz;
    if (!fits) {
      for (int64_t iz = 0; iz < kz; ++iz)
        dst[iz] = hash_lookup(table_keys, table_rows, mask, c.x, x, y,
                              c.w + axis_offset(kern, 2, iz));
      continue;
    }
    const int64_t z_first = c.w + axis_offset(kern, 2, iz_first);
    const int64_t z_last = c.w + axis_offset(kern, 2, iz_first + (kz - 1) * iz_step);
    if (c.x < l.lo[0] || c.x > l.hi[0] || x < l.lo[1] || x > l.hi[1] || y < l.lo[2] ||
        y > l.hi[2] || z_last < l.lo[3] || z_first > l.hi[3]) {
      for (int64_t iz = 0; iz < kz; ++iz) dst[iz] = -1;
      continue;
    }
    const uint32_t column_key = (uint32_t)tsp_compact_key(&l, c.x, x, y, l.lo[3]);
    int64_t idx = lower_bound32(keys, 0, n_in,
                                column_key + (uint32_t)(max(z_first, l.lo[3]) - l.lo[3]));
    for (int64_t j = 0, iz = iz_first; j < kz; ++j, iz += iz_step) {
      const int64_t z = c.w + axis_offset(kern, 2, iz);
      int32_t row = -1;
      if (z >= l.lo[3] && z <= l.hi[3]) {
        const uint32_t target = column_key + (uint32_t)(z - l.lo[3]);
        int steps = 0;
        while (idx < n_in && __ldg(keys + idx) < target && steps < ZDELTA_SCAN_STEPS) {
          ++idx;
          ++steps;
        }
        if (idx < n_in && __ldg(keys + idx) < target) idx = lower_bound32(keys, idx, n_in, target);
        if (idx < n_in && __ldg(keys + idx) == target) row = __ldg(rows + idx);
      }
      dst[iz] = row;
    }
  }
}

/* ------------------------------------------------------------- workspace --- */

typedef struct {
  int64_t capacity;                          /* hash slots, a power of two */
  size_t box, keys, keys_alt, rows, rows_alt; /* z-delta: byte offsets */
  size_t table_keys, table_rows, temp, temp_bytes, total;
} kmap_plan;

static int64_t hash_capacity(int64_t n_in) {
  int64_t cap = 1024;
  while (cap < 2 * n_in) cap *= 2;
  return cap;
}

static tsp_status plan_kernel_map(const tsp_kernel *kern, tsp_kmap_method method, int64_t n_in,
                                  int64_t n_out, kmap_plan *plan) {
  if (!kernel_valid(kern) || n_in < 0 || n_in > INT32_MAX || n_out < 0 || n_out > INT32_MAX)
    return TSP_ERR_ARGUMENT;
  if (method != TSP_KMAP_ZDELTA && method != TSP_KMAP_HASH) return TSP_ERR_ARGUMENT;
  plan->capacity = hash_capacity(n_in);
  size_t at = 0;
  plan->table_keys = at;
  at += tsp_align256((size_t)plan->capacity * sizeof(uint64_t));
  plan->table_rows = at;
  at += tsp_align256((size_t)plan->capacity * sizeof(int32_t));
  plan->temp_bytes = 0;
  if (method == TSP_KMAP_ZDELTA) {
    const size_t n32 = tsp_align256((size_t)n_in * sizeof(uint32_t));
    plan->box = at;
    at += tsp_align256(sizeof(tsp_coord_box));
    plan->keys = at;
    at += n32;
    plan->keys_alt = at;
    at += n32;
    plan->rows = at;
    at += n32;
    plan->rows_alt = at;
    at += n32;
    cub::DoubleBuffer<uint32_t> keys(NULL, NULL);
    cub::DoubleBuffer<int32_t> rows(NULL, NULL);
    if (cub::DeviceRadixSort::SortPairs(NULL, plan->temp_bytes, keys, rows, n_in, 0, 32) !=
        cudaSuccess)
      return TSP_ERR_CUDA;
  }
  plan->temp = at;
  at += tsp_align256(plan->temp_bytes);
  plan->total = at;
  return TSP_OK;
}

extern "C" size_t tsp_kernel_map_cuda_workspace(const tsp_kernel *kern, tsp_kmap_method method,
                                                int64_t n_in, int64_t n_out) {
  kmap_plan plan;
  if (plan_kernel_map(kern, method, n_in, n_out, &plan) != TSP_OK) return 0;
  return plan.total;
}

/* Grid for `n` grid-stride items: a few waves at most, so per-thread setup (the box layout) amortises. */
static unsigned int kmap_blocks(int64_t n) {
  unsigned int b = tsp_grid_blocks(n, KMAP_THREADS);
  return b > 132 * 16 ? 132 * 16 : b;
}

extern "C" tsp_status tsp_kernel_map_cuda(const tsp_kernel *kern, tsp_kmap_method method,
                                          const int32_t *in_coords, int64_t n_in,
                                          const int32_t *out_coords, int64_t n_out,
                                          int32_t *nbmap, void *workspace, size_t workspace_bytes,
                                          tsp_cuda_stream stream) {
  const char *where = "tsp_kernel_map_cuda";
  cudaStream_t s = (cudaStream_t)stream;
  kmap_plan plan;
  tsp_status st = plan_kernel_map(kern, method, n_in, n_out, &plan);
  if (st != TSP_OK) return st;
  const int64_t volume = tsp_kernel_volume(kern);
  if (n_out == 0) return TSP_OK;
  if (n_in == 0)
    return tsp_cuda_check(cudaMemsetAsync(nbmap, 0xff, (size_t)(n_out * volume) * 4, s), where);
  if (workspace == NULL || workspace_bytes < plan.total) return TSP_ERR_ARGUMENT;

  char *ws = (char *)workspace;
  uint64_t *table_keys = (uint64_t *)(ws + plan.table_keys);
  int32_t *table_rows = (int32_t *)(ws + plan.table_rows);
  const uint64_t mask = (uint64_t)plan.capacity - 1;
  const bool in_aligned = tsp_aligned16(in_coords), out_aligned = tsp_aligned16(out_coords);

  if (method == TSP_KMAP_HASH) {
    st = tsp_cuda_check(
        cudaMemsetAsync(table_keys, 0xff, (size_t)plan.capacity * sizeof(uint64_t), s), where);
    if (st != TSP_OK) return st;
    hash_insert_kernel<<<kmap_blocks(n_in), KMAP_THREADS, 0, s>>>(in_coords, n_in, in_aligned,
                                                                  table_keys, table_rows, mask);
    if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;
    const fast_div div_volume = make_fast_div((uint32_t)volume);
    const fast_div div_kz = make_fast_div((uint32_t)kern->kernel[2]);
    const fast_div div_ky = make_fast_div((uint32_t)kern->kernel[1]);
    const int64_t chunk = rows_per_launch(volume);
    for (int64_t q0 = 0; q0 < n_out; q0 += chunk) {
      const int64_t rows = n_out - q0 < chunk ? n_out - q0 : chunk;
      hash_query_kernel<<<kmap_blocks(rows * volume), KMAP_THREADS, 0, s>>>(
          *kern, out_coords, q0, (uint32_t)rows, out_aligned, div_volume, div_kz, div_ky,
          table_keys, table_rows, mask, nbmap);
      if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;
    }
    return TSP_OK;
  }

  tsp_coord_box *box = (tsp_coord_box *)(ws + plan.box);
  cub::DoubleBuffer<uint32_t> keys((uint32_t *)(ws + plan.keys), (uint32_t *)(ws + plan.keys_alt));
  cub::DoubleBuffer<int32_t> rows((int32_t *)(ws + plan.rows), (int32_t *)(ws + plan.rows_alt));
  st = tsp_cuda_check(cudaMemsetAsync(box, TSP_BOX_CLEAR_BYTE, sizeof(tsp_coord_box), s), where);
  if (st != TSP_OK) return st;
  tsp_coord_box_kernel<<<tsp_box_blocks(n_in), TSP_BOX_THREADS, 0, s>>>(in_coords, n_in,
                                                                        in_aligned, box);
  if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;
  fallback_clear_kernel<<<kmap_blocks(plan.capacity), KMAP_THREADS, 0, s>>>(box, table_keys,
                                                                            plan.capacity);
  if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;
  zdelta_pack_kernel<<<kmap_blocks(n_in), KMAP_THREADS, 0, s>>>(
      in_coords, n_in, in_aligned, box, keys.Current(), rows.Current(), table_keys, table_rows,
      mask);
  if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;
  size_t temp_bytes = plan.temp_bytes;
  st = tsp_cuda_check(cub::DeviceRadixSort::SortPairs(ws + plan.temp, temp_bytes, keys, rows,
                                                      n_in, 0, 32, s),
                      where);
  if (st != TSP_OK) return st;
  const int64_t columns = (int64_t)kern->kernel[0] * kern->kernel[1];
  const fast_div div_columns = make_fast_div((uint32_t)columns);
  const fast_div div_ky = make_fast_div((uint32_t)kern->kernel[1]);
  const int64_t chunk = rows_per_launch(columns);
  for (int64_t q0 = 0; q0 < n_out; q0 += chunk) {
    const int64_t n_rows = n_out - q0 < chunk ? n_out - q0 : chunk;
    zdelta_search_kernel<<<kmap_blocks(n_rows * columns), KMAP_THREADS, 0, s>>>(
        *kern, box, keys.Current(), rows.Current(), n_in, out_coords, q0, (uint32_t)n_rows,
        out_aligned, div_columns, div_ky, table_keys, table_rows, mask, nbmap);
    if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;
  }
  return TSP_OK;
}

/* ------------------------------------------------------------- transpose --- */

/* Each (p, k) has at most one writer (q -> q + delta_k is injective), so the scatter is race-free. */
static __global__ void transpose_scatter_kernel(const int32_t *__restrict__ nbmap, int64_t q0,
                                                uint32_t rows, fast_div div_volume, int64_t n_in,
                                                int32_t *__restrict__ nbmap_t) {
  const uint32_t entries = rows * div_volume.d;
  const int32_t *map = nbmap + q0 * div_volume.d;
  for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < entries;
       t += gridDim.x * blockDim.x) {
    const int32_t p = map[t];
    if (p < 0 || p >= n_in) continue;
    const uint32_t q = div_fast(t, div_volume), k = t - q * div_volume.d;
    nbmap_t[(int64_t)p * div_volume.d + k] = (int32_t)(q0 + q);
  }
}

extern "C" tsp_status tsp_kernel_map_transpose_cuda(const int32_t *nbmap, int64_t n_out,
                                                    int64_t volume, int64_t n_in,
                                                    int32_t *nbmap_t, tsp_cuda_stream stream) {
  const char *where = "tsp_kernel_map_transpose_cuda";
  cudaStream_t s = (cudaStream_t)stream;
  if (n_out < 0 || n_out > INT32_MAX || volume < 0 || volume > INT32_MAX || n_in < 0)
    return TSP_ERR_ARGUMENT;
  if (n_in == 0 || volume == 0) return TSP_OK;
  /* 0xff bytes are int32 -1. */
  tsp_status st =
      tsp_cuda_check(cudaMemsetAsync(nbmap_t, 0xff, (size_t)(n_in * volume) * sizeof(int32_t), s),
                     where);
  if (st != TSP_OK || n_out == 0) return st;
  const fast_div div_volume = make_fast_div((uint32_t)volume);
  const int64_t chunk = rows_per_launch(volume);
  for (int64_t q0 = 0; q0 < n_out; q0 += chunk) {
    const int64_t rows = n_out - q0 < chunk ? n_out - q0 : chunk;
    transpose_scatter_kernel<<<kmap_blocks(rows * volume), KMAP_THREADS, 0, s>>>(
        nbmap, q0, (uint32_t)rows, div_volume, n_in, nbmap_t);
    if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;
  }
  return TSP_OK;
}
