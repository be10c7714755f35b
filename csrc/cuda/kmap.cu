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
** Two searches:
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
**     the same launches build and query a 64-bit-key hash table instead.
**     Every nbmap entry is written exactly once.
**   - hash: open addressing over 4-slot buckets (32 bytes, one L2 sector),
**     capacity a power of two >= 4 * n_in slots (load <= 0.25), linear
**     probing over buckets, atomicCAS insert.  The table (8 MB at 173k) lives
**     in L2; what costs is L2 sectors per row, and, as ncu showed on the H100
**     (a per-slot version: fewer sectors than before, yet more instructions),
**     the warp-wide wait for the longest probe chain:
**       * one 64-bit word per slot, (row << 32) | tag, with tag 32 bits of the
**         key's hash: no separate key and row loads.  A tag match is confirmed
**         by reading in_coords[row] (16 bytes), which only hits pay; exact for
**         any coordinate range, so no box, no compact key and no wide-box
**         fallback to choose on the device.
**       * z-groups: the bucket is hash(b, x, y, z >> 2) (z in units of the
**         step when it is a power of two), so the Kz lookups of one (dx, dy)
**         column usually read one sector, shared by neighbouring threads of a
**         warp: ~1.5 sectors per 3-z column instead of 3 for a per-key hash.
**       * whole-bucket reads: a lookup reads its bucket (two 16-byte loads)
**         and stops at the first bucket with a free slot, 1.01 buckets per
**         lookup and rarely more than 2 in a warp (modelled on a 173k scan),
**         where per-slot linear probing at load 0.33 ran chains of up to 20
**         (one L2 round trip each, the warp waiting for the slowest lane).
**         Insert likewise: one CAS on the preferred slot, else a free slot of
**         the bucket; at most ~4 round trips instead of ~20 (the insert
**         launch took 11.6 us for 173k keys, which we put down to that tail).
**       * submanifold symmetry: when out_coords is in_coords (same pointer,
**         n_out == n_in) and every axis has 2 * padding == (K - 1) * dilation,
**         delta_{V-1-k} = -delta_k, so nbmap[q, k] = p iff nbmap[p, V-1-k] = q.
**         Only k < V / 2 is looked up; a found pair is also written mirrored,
**         the centre (V odd) is q itself, and the other entries are -1,
**         written by the insert launch before the query launch runs.  Half the
**         lookups, a handful of scattered 4-byte mirror writes.
**       * three launches: clear (table, flag), insert (+ the -1 fill of the
**         mirrored half, overlapping the inserts' atomics), query; one thread
**         per (q, k) for the k looked up.
**     Inputs outside the packable range (a broken SparseTensor invariant) are
**     not inserted and set a device flag; the query launch then answers every
**     offset itself instead of mirroring, so the map is the same either way.
** A query outside the packable range, or outside the input box, is "not found".
**
** Measured before the hash changes above (H100, 173k-voxel two-scan
** LiDAR-like set, graph replay, median of 50): 3x3x3 hash 66-73 us (separate
** key and row arrays, murmur slot per key, one thread per (q, k) for all 27
** offsets, memset + two kernels; ncu: insert 11.6 us, query 59 us), z-delta
** 112-114 us, of which CUB's 32-bit SortPairs alone is 52 us; 5x5x5 hash
** 244-265 us, z-delta 238-243 us.  Goal 30 us for 3x3x3.  An intermediate
** version (per-slot probing at capacity 2 * n_in, otherwise as above)
** measured 55.8 us with the half map and 78.6 us without (ncu: clear 3.6,
** insert+fill 17.8, query 39.8 us); the buckets, capacity 4 * n_in and the
** one-wave insert launch address its probe tails.
** Measured with this version (tools/bench_kmap.py, H100, lidar_198k.npz at
** 0.05 m = 173k voxels, CUDA events around the Python call, median of 50,
** 2026-11-23): 3x3x3 hash 51.7 us (map + transpose 83.9), z-delta 124.4;
** all maps of a 5-level U-Net 950 us (hash).  Still over the 30 us and
** 150 us goals.  Next: one thread per (q, column) sharing the coordinate
** load and the bucket hash; for z-delta, a cheaper sort than onesweep at this
** size and the same half-map mirroring.
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

/* ------------------------------------- 64-bit table (z-delta fallback) --- */

/* Inputs are unique (a SparseTensor invariant), so each key is inserted once. */
static __device__ __forceinline__ void hash_insert(uint64_t *table_keys, int32_t *table_rows,
                                                   uint64_t mask, uint64_t key, int32_t row) {
  uint64_t slot = tsp_hash_slot(key, mask);
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
  uint64_t slot = tsp_hash_slot(key, mask);
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

/* ----------------------------------------------- hash path (TSP_KMAP_HASH) --- */

/*
** The table is an array of buckets of 4 slots, 32 bytes (one L2 sector; the
** table is 32-byte aligned in the workspace).  Slot word: (row << 32) | tag,
** HASH_EMPTY (all ones, what the clear launch writes) when free; rows are
** < 2^31, so no entry equals HASH_EMPTY.
*/
enum { HASH_BUCKET_SLOTS = 4 };

typedef struct {
  uint32_t bucket; /* first bucket probed (capacity <= 2^33 slots, so < 2^31 buckets) */
  uint32_t slot;   /* the slot of that bucket insert tries first: zs & 3 */
  uint32_t tag;    /* low word of the slot word; equal tags are confirmed on the coordinates */
} hash_probe;

/*
** Bucket, preferred slot and tag of an in-range (b, x, y, z).  zs = z >>
** zshift counts z in units of the step (zshift = log2 step_z when it is a
** power of two, else 0; coordinates off that lattice still work, they only
** share buckets more).  The bucket is a hash of the group (b, x, y, zs >> 2)
** (murmur3's 64-bit finaliser, a bijection), so a z-column's neighbours share
** a bucket, i.e. one sector.  The tag takes the hash's high 32 bits
** (independent of the bucket's low bits) xor z, so two keys of one group never
** share a tag and keys of two groups do with chance 2^-32.
*/
static __device__ __forceinline__ hash_probe hash_probe_of(int64_t b, int64_t x, int64_t y,
                                                           int64_t z, int zshift,
                                                           uint32_t bucket_mask) {
  const int64_t zs = z >> zshift; /* arithmetic shift: floor, so negatives group too */
  uint64_t h = (uint64_t)tsp_key_pack(b, x, y, zs >> 2);
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  hash_probe pr;
  pr.bucket = (uint32_t)h & bucket_mask;
  pr.slot = (uint32_t)(zs & (HASH_BUCKET_SLOTS - 1));
  pr.tag = (uint32_t)(h >> 32) ^ (uint32_t)z;
  return pr;
}

/*
** Row of input (b, x, y, z), or -1 when absent or unpackable.  Linear probing
** over buckets: a bucket is read whole (two 16-byte loads of one sector), a
** tag match is confirmed by reading in_coords[row], and a bucket with a free
** slot ends the search, since insert moves on to the next bucket only past a
** full one (and slots are never freed).  Why buckets: a warp waits for its
** slowest lane, and per-slot probe chains reach ~20 steps at load 0.33 on a
** LiDAR scan; a bucket read is usually the only one (1.01 per lookup at load
** <= 0.25, modelled on a 173k scan), and the order within a bucket is free.
*/
static __device__ __forceinline__ int32_t hash_path_lookup(const uint64_t *__restrict__ table,
                                                           uint32_t bucket_mask, int zshift,
                                                           const int32_t *__restrict__ in_coords,
                                                           bool in_aligned, int64_t b, int64_t x,
                                                           int64_t y, int64_t z) {
  if (!tsp_key_in_range(b, x, y, z)) return -1;
  const hash_probe pr = hash_probe_of(b, x, y, z, zshift, bucket_mask);
  const ulonglong2 *pairs = reinterpret_cast<const ulonglong2 *>(table);
  for (uint32_t bucket = pr.bucket;; bucket = (bucket + 1) & bucket_mask) {
    const ulonglong2 lo = __ldg(pairs + 2 * (uint64_t)bucket),
                     hi = __ldg(pairs + 2 * (uint64_t)bucket + 1);
    const uint64_t word[HASH_BUCKET_SLOTS] = {lo.x, lo.y, hi.x, hi.y};
    bool has_free = false;
#pragma unroll
    for (int i = 0; i < HASH_BUCKET_SLOTS; ++i) {
      if (word[i] == HASH_EMPTY) {
        has_free = true;
      } else if ((uint32_t)word[i] == pr.tag) {
        const int32_t row = (int32_t)(word[i] >> 32);
        const int4 c = tsp_load_coord(in_coords, row, in_aligned);
        if (c.x == b && c.y == x && c.z == y && c.w == z) return row;
      }
    }
    if (has_free) return -1;
  }
}

/* Clear launch: every slot to HASH_EMPTY (16-byte stores, capacity is even), the flag to 0. */
static __global__ void hash_clear_kernel(uint64_t *table, int64_t capacity,
                                         int32_t *unpackable) {
  const int64_t start = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  if (start == 0) *unpackable = 0;
  ulonglong2 *pairs = reinterpret_cast<ulonglong2 *>(table);
  const ulonglong2 empty = make_ulonglong2(HASH_EMPTY, HASH_EMPTY);
  for (int64_t i = start; i < capacity / 2; i += stride) pairs[i] = empty;
}

/*
** Insert launch.  First, when the query launch mirrors (fill_rows > 0),
** entries k >= first of every row get -1, where first = ceil(V / 2) (the
** mirrored half): the query launch writes those entries only where it finds
** a pair, and this launch ends before it starts.  The stores go first and the
** grid is one wave, so they overlap the inserts' atomic round trips.
**
** Then the inserts.  Inputs are unique (a SparseTensor invariant), so each
** key is inserted once: one CAS on the preferred slot (usually free: a
** group's z values prefer distinct slots), else the bucket is read from L2
** (__ldcg: L1 may hold a stale copy) and a free slot CASed, moving to the next
** bucket only when this one is full.  The capacity (>= 4 * n_in) leaves free
** slots, so this ends.  A CAS of the whole word publishes row and tag
** together.  An unpackable input is skipped (no query can name it) and raises
** the flag that turns mirroring off.
*/
static __global__ void hash_insert_fill_kernel(const int32_t *__restrict__ in_coords, int64_t n_in,
                                               bool in_aligned, int zshift, uint64_t *table,
                                               uint32_t bucket_mask, int32_t *unpackable,
                                               int32_t *__restrict__ nbmap, int64_t fill_rows,
                                               int64_t volume, int64_t first,
                                               fast_div div_upper) {
  const int64_t start = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  /* fill_rows * (V - first) entries; the one-multiply division is exact below 2^32. */
  const int64_t fills = fill_rows * (int64_t)div_upper.d;
  const bool fast = fills <= (int64_t)UINT32_MAX;
  for (int64_t t = start; t < fills; t += stride) {
    const int64_t q = fast ? (int64_t)div_fast((uint32_t)t, div_upper) : t / div_upper.d;
    nbmap[q * volume + first + (t - q * div_upper.d)] = -1;
  }
  const ulonglong2 *pairs = reinterpret_cast<const ulonglong2 *>(table);
  for (int64_t i = start; i < n_in; i += stride) {
    const int4 c = tsp_load_coord(in_coords, i, in_aligned);
    if (!tsp_key_in_range(c.x, c.y, c.z, c.w)) {
      *unpackable = 1;
      continue;
    }
    const hash_probe pr = hash_probe_of(c.x, c.y, c.z, c.w, zshift, bucket_mask);
    const unsigned long long word = ((unsigned long long)i << 32) | pr.tag;
    unsigned long long *slots = (unsigned long long *)table;
    const unsigned long long empty = (unsigned long long)HASH_EMPTY;
    if (atomicCAS(&slots[(uint64_t)pr.bucket * HASH_BUCKET_SLOTS + pr.slot], empty, word) == empty)
      continue;
    for (uint32_t bucket = pr.bucket;; bucket = (bucket + 1) & bucket_mask) {
      unsigned long long *base = slots + (uint64_t)bucket * HASH_BUCKET_SLOTS;
      int free_slot = 0;
      while (free_slot >= 0) { /* a lost CAS means the bucket changed: read it again */
        const ulonglong2 lo = __ldcg(pairs + 2 * (uint64_t)bucket),
                         hi = __ldcg(pairs + 2 * (uint64_t)bucket + 1);
        free_slot = lo.x == empty   ? 0
                    : lo.y == empty ? 1
                    : hi.x == empty ? 2
                    : hi.y == empty ? 3
                                    : -1;
        if (free_slot >= 0 && atomicCAS(&base[free_slot], empty, word) == empty) break;
      }
      if (free_slot >= 0) break; /* inserted */
    }
  }
}

/*
** Query launch: one thread per (q, k) of rows [q0, q0 + rows); consecutive
** threads write consecutive entries of a row, and the Kz threads of a column
** read the same bucket (sector).  Full mode: every k < V.  Half mode
** (symmetric, and no unpackable input): k < first = ceil(V / 2); the centre
** k = (V - 1) / 2 of an odd V is q itself (delta 0, inputs unique); a pair
** found at (q, k) -> p is also written at (p, V - 1 - k).  Each entry has one
** writer: (p, V-1-k) is reached only from the q with in[q] = in[p] - delta_k.
*/
static __global__ void hash_query_kernel(tsp_kernel kern, const int32_t *__restrict__ in_coords,
                                         bool in_aligned, const int32_t *__restrict__ out_coords,
                                         bool out_aligned, int64_t q0, uint32_t rows,
                                         bool symmetric, fast_div div_first, fast_div div_volume,
                                         fast_div div_kz, fast_div div_ky, int zshift,
                                         const uint64_t *__restrict__ table, uint32_t bucket_mask,
                                         const int32_t *__restrict__ unpackable,
                                         int32_t *__restrict__ nbmap) {
  const bool half = symmetric && __ldg(unpackable) == 0;
  const fast_div per_row = half ? div_first : div_volume;
  const uint32_t volume = div_volume.d;
  /* V odd: the centre is the last offset looked up in half mode; V even has none. */
  const uint32_t centre = half && (volume & 1) ? volume / 2 : UINT32_MAX;
  const uint32_t entries = rows * per_row.d;
  for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < entries;
       t += gridDim.x * blockDim.x) {
    const uint32_t local_q = div_fast(t, per_row), k = t - local_q * per_row.d;
    const int64_t q = q0 + local_q;
    if (k == centre) {
      nbmap[q * volume + k] = (int32_t)q;
      continue;
    }
    const uint32_t xy = div_fast(k, div_kz), iz = k - xy * div_kz.d;
    const uint32_t ix = div_fast(xy, div_ky), iy = xy - ix * div_ky.d;
    const int4 c = tsp_load_coord(out_coords, q, out_aligned);
    const int32_t p = hash_path_lookup(table, bucket_mask, zshift, in_coords, in_aligned, c.x,
                                       c.y + axis_offset(kern, 0, ix),
                                       c.z + axis_offset(kern, 1, iy),
                                       c.w + axis_offset(kern, 2, iz));
    nbmap[q * volume + k] = p;
    if (half && p >= 0) nbmap[(int64_t)p * volume + (volume - 1 - k)] = (int32_t)q;
  }
}

/*
** 1 when delta_{V-1-k} = -delta_k for every k: on each axis delta(K-1-i) =
** sign * ((K-1-i) * d - pad) * t equals -delta(i) = sign * (pad - i * d) * t
** iff 2 * pad == (K - 1) * d (whatever sign and step).  Flipping every axis
** index maps k = (ix * Ky + iy) * Kz + iz to V - 1 - k.
*/
static bool kernel_symmetric(const tsp_kernel *kern) {
  for (int a = 0; a < 3; ++a) {
    if (2 * (int64_t)kern->padding[a] != (int64_t)(kern->kernel[a] - 1) * kern->dilation[a])
      return false;
  }
  return true;
}

/* log2 of step_z when it is a power of two, else 0 (the z unit of hash_probe_of). */
static int hash_zshift(const tsp_kernel *kern) {
  const int64_t step = kern->step[2];
  if (step & (step - 1)) return 0;
  int shift = 0;
  while (((int64_t)1 << shift) < step) ++shift;
  return shift;
}

/* ------------------------------------------------------------- workspace --- */

typedef struct {
  int64_t capacity;                          /* hash slots, a power of two */
  size_t table_keys;                         /* both: capacity 64-bit slots (hash: +32 to align) */
  size_t table_rows;                         /* z-delta fallback: capacity rows */
  size_t unpackable;                         /* hash: int32 flag, an input was unpackable */
  size_t box, keys, keys_alt, rows, rows_alt; /* z-delta: byte offsets */
  size_t temp, temp_bytes, total;
} kmap_plan;

/*
** Slots: a power of two >= 2 * n_in (z-delta's fallback table) or >= 4 *
** n_in (the hash path: load <= 0.25, so that nearly every lookup reads one
** bucket; 126k inputs would otherwise load a 2^18 table to 0.48).
*/
static int64_t hash_capacity(int64_t n_in, int64_t slots_per_input) {
  int64_t cap = 1024;
  while (cap < slots_per_input * n_in) cap *= 2;
  return cap;
}

static tsp_status plan_kernel_map(const tsp_kernel *kern, tsp_kmap_method method, int64_t n_in,
                                  int64_t n_out, kmap_plan *plan) {
  if (!kernel_valid(kern) || n_in < 0 || n_in > INT32_MAX || n_out < 0 || n_out > INT32_MAX)
    return TSP_ERR_ARGUMENT;
  if (method != TSP_KMAP_ZDELTA && method != TSP_KMAP_HASH) return TSP_ERR_ARGUMENT;
  plan->capacity = hash_capacity(n_in, method == TSP_KMAP_HASH ? 4 : 2);
  size_t at = 0;
  plan->table_keys = at;
  at += tsp_align256((size_t)plan->capacity * sizeof(uint64_t) + 32);
  plan->temp_bytes = 0;
  if (method == TSP_KMAP_HASH) {
    /* The hash path keeps rows inside its 64-bit slots: no row array. */
    plan->unpackable = at;
    at += tsp_align256(sizeof(int32_t));
  } else {
    const size_t n32 = tsp_align256((size_t)n_in * sizeof(uint32_t));
    plan->table_rows = at;
    at += tsp_align256((size_t)plan->capacity * sizeof(int32_t));
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
static unsigned int kmap_blocks(int64_t n) { return tsp_grid_blocks_max(n, KMAP_THREADS, 132 * 16); }

/*
** The hash path: clear, insert (+ fill), query (one launch per row chunk).
** Half mode is chosen here from what the host knows (same coordinate array,
** symmetric offsets) and confirmed on the device (no unpackable input).
*/
static tsp_status kernel_map_hash(const tsp_kernel *kern, const kmap_plan *plan,
                                  const int32_t *in_coords, int64_t n_in,
                                  const int32_t *out_coords, int64_t n_out, int32_t *nbmap,
                                  char *ws, cudaStream_t s) {
  const char *where = "tsp_kernel_map_cuda";
  tsp_status st;
  /* 32-byte aligned whatever the workspace's alignment: a bucket is one sector. */
  uint64_t *table = (uint64_t *)(((uintptr_t)(ws + plan->table_keys) + 31) & ~(uintptr_t)31);
  int32_t *unpackable = (int32_t *)(ws + plan->unpackable);
  const uint32_t bucket_mask = (uint32_t)(plan->capacity / HASH_BUCKET_SLOTS - 1);
  const bool in_aligned = tsp_aligned16(in_coords), out_aligned = tsp_aligned16(out_coords);
  const int64_t volume = tsp_kernel_volume(kern);
  const int64_t first = (volume + 1) / 2; /* offsets looked up in half mode */
  const bool symmetric = in_coords == out_coords && n_in == n_out && kernel_symmetric(kern);
  const int zshift = hash_zshift(kern);

  hash_clear_kernel<<<kmap_blocks(plan->capacity / 2), KMAP_THREADS, 0, s>>>(
      table, plan->capacity, unpackable);
  if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;
  /* The -1 fill of the mirrored half: V - first entries per row, none for V == 1. */
  const int64_t fill_rows = symmetric && volume > first ? n_out : 0;
  const fast_div div_upper = make_fast_div((uint32_t)(volume > first ? volume - first : 1));
  const int64_t insert_items = fill_rows * (volume - first) > n_in ? fill_rows * (volume - first)
                                                                   : n_in;
  /* One wave (8 blocks of 256 on each of an H100's 132 SMs): the fill overlaps the inserts. */
  const unsigned int insert_blocks = tsp_grid_blocks_max(insert_items, KMAP_THREADS, 132 * 8);
  hash_insert_fill_kernel<<<insert_blocks, KMAP_THREADS, 0, s>>>(
      in_coords, n_in, in_aligned, zshift, table, bucket_mask, unpackable, nbmap, fill_rows,
      volume, first, div_upper);
  if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;

  const fast_div div_first = make_fast_div((uint32_t)first);
  const fast_div div_volume = make_fast_div((uint32_t)volume);
  const fast_div div_kz = make_fast_div((uint32_t)kern->kernel[2]);
  const fast_div div_ky = make_fast_div((uint32_t)kern->kernel[1]);
  /* Chunks sized for full mode, so either mode keeps rows * per_row below 2^31. */
  const int64_t chunk = rows_per_launch(volume);
  for (int64_t q0 = 0; q0 < n_out; q0 += chunk) {
    const int64_t rows = n_out - q0 < chunk ? n_out - q0 : chunk;
    hash_query_kernel<<<kmap_blocks(rows * (symmetric ? first : volume)), KMAP_THREADS, 0, s>>>(
        *kern, in_coords, in_aligned, out_coords, out_aligned, q0, (uint32_t)rows, symmetric,
        div_first, div_volume, div_kz, div_ky, zshift, table, bucket_mask, unpackable, nbmap);
    if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;
  }
  return TSP_OK;
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

  if (method == TSP_KMAP_HASH)
    return kernel_map_hash(kern, &plan, in_coords, n_in, out_coords, n_out, nbmap, ws, s);

  uint64_t *table_keys = (uint64_t *)(ws + plan.table_keys);
  int32_t *table_rows = (int32_t *)(ws + plan.table_rows);
  const uint64_t mask = (uint64_t)plan.capacity - 1;
  const bool in_aligned = tsp_aligned16(in_coords), out_aligned = tsp_aligned16(out_coords);
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
