/*
** keys.cu: packing coordinates into keys on the GPU, and the output
** coordinates of strided, generative and transposed-generative convs
** (torchsp.h, DESIGN.md section 3).
**
** Output coordinates are "every candidate q = p - delta_k on the output
** lattice, sorted and unique".  The work is one radix sort of the candidates,
** so everything here serves that sort:
**   - fewer candidates: each input writes a fixed number of slots, the most
**     candidates any input can keep (per axis, the largest number of offsets
**     that share one residue modulo the lattice; their product).  A 3x3x3
**     stride-2 conv keeps at most 8 of 27, so the sort sees 8 keys per input,
**     not 27, and no atomics or prefix sums decide where a key goes (the host
**     must know the sort's length, and it never synchronises).  Unused slots
**     hold a sentinel that sorts after every key and is dropped at the end.
**   - fewer bits: candidates are compact keys relative to their bounding box
**     (coord_box.cuh), ~29 bits for a LiDAR scan instead of 63, and the
**     sentinel is 1 << key width; onesweep passes above it see one digit and
**     become copies.  The unique keys are converted back to absolute keys
**     (tsp_key.h) in the last kernel, which also writes the count.
** A kept candidate that cannot be packed writes TSP_ERR_RANGE into *status;
** the shim reads status and count back together after its one synchronisation.
**
** Also here: SparseTensor's value checks (tsp_coords_summary_cuda): the box,
** the lattice test and a duplicate test through a hash table, in one kernel,
** so the constructor synchronises once instead of sorting with PyTorch ops.
*/
#include <algorithm>
#include <vector>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>

#include "coord_box.cuh"
#include "cuda_common.cuh"

enum { KEYS_THREADS = 256 };

/* ---------------------------------------------------- coordinate checks --- */

/*
** The summary words are the box (coord_box.cuh), then the two flags, all
** int32 cleared by one memset of 0x80 bytes (TSP_SUMMARY_NONE).  The hash
** table's keys follow, cleared by the same memset: 0x8080808080808080 has bit
** 63 set, so no packed key (< 2^63) equals the empty slot.
*/
static const uint64_t SUMMARY_EMPTY = 0x8080808080808080ULL;

typedef struct {
  tsp_coord_box box;
  int32_t off_lattice, duplicate;
} coords_summary;

static int64_t summary_slots(int64_t n) {
  int64_t cap = 64;
  while (cap < 2 * n) cap *= 2; /* load <= 1/2: short probes */
  return cap;
}

size_t tsp_coords_summary_cuda_bytes(int64_t n) {
  return n < 0 ? 0 : sizeof(coords_summary) + (size_t)summary_slots(n) * sizeof(uint64_t);
}

/* One thread per row: the box, the lattice test, and an insert of the row's key
** that finds an equal key already there (CAS linear probing). */
static __global__ void __launch_bounds__(TSP_BOX_THREADS)
    coords_summary_kernel(const int32_t *__restrict__ coords, int64_t n, bool aligned16,
                          int3 stride, coords_summary *out, uint64_t *table, uint64_t mask) {
  int m[8];
  tsp_box_start(m);
  int off_lattice = 0, duplicate = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int4 c = tsp_load_coord(coords, i, aligned16);
    tsp_box_add(m, c);
    off_lattice |= c.y % stride.x != 0 || c.z % stride.y != 0 || c.w % stride.z != 0;
    if (!tsp_key_in_range(c.x, c.y, c.z, c.w)) continue;
    const uint64_t key = (uint64_t)tsp_key_pack(c.x, c.y, c.z, c.w);
    for (uint64_t slot = tsp_hash_slot(key, mask);; slot = (slot + 1) & mask) {
      const unsigned long long prev = atomicCAS((unsigned long long *)&table[slot],
                                                (unsigned long long)SUMMARY_EMPTY,
                                                (unsigned long long)key);
      if (prev == SUMMARY_EMPTY) break;
      if (prev == key) {
        duplicate = 1;
        break;
      }
    }
  }
  tsp_box_flush(m, &out->box);
  off_lattice = __syncthreads_or(off_lattice);
  duplicate = __syncthreads_or(duplicate);
  if (threadIdx.x == 0) { /* 0 or 1 over the cleared word, as the CPU twin writes */
    atomicMax(&out->off_lattice, off_lattice);
    atomicMax(&out->duplicate, duplicate);
  }
}

tsp_status tsp_coords_summary_cuda(const int32_t *coords, int64_t n, const int32_t stride[3],
                                   void *buffer, size_t buffer_bytes, tsp_cuda_stream stream) {
  const char *where = "tsp_coords_summary_cuda";
  if (n < 0 || (n > 0 && coords == NULL) || buffer == NULL || stride[0] < 1 || stride[1] < 1 ||
      stride[2] < 1 || buffer_bytes < tsp_coords_summary_cuda_bytes(n))
    return TSP_ERR_ARGUMENT;
  cudaStream_t s = (cudaStream_t)stream;
  const size_t used = tsp_coords_summary_cuda_bytes(n);
  tsp_status st = tsp_cuda_check(cudaMemsetAsync(buffer, 0x80, n > 0 ? used : sizeof(coords_summary), s), where);
  if (st != TSP_OK || n == 0) return st;
  coords_summary *out = (coords_summary *)buffer;
  uint64_t *table = (uint64_t *)(out + 1);
  coords_summary_kernel<<<tsp_box_blocks(n), TSP_BOX_THREADS, 0, s>>>(
      coords, n, tsp_aligned16(coords), make_int3(stride[0], stride[1], stride[2]), out, table,
      (uint64_t)summary_slots(n) - 1);
  return tsp_cuda_check_launch(where);
}

/* ------------------------------------------------------------ pack keys --- */

static __global__ void pack_keys_kernel(const int32_t *__restrict__ coords, int64_t n,
                                        bool aligned16, int64_t *__restrict__ keys,
                                        int32_t *status) {
  bool bad = false;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int4 c = tsp_load_coord(coords, i, aligned16);
    if (tsp_key_in_range(c.x, c.y, c.z, c.w)) {
      keys[i] = tsp_key_pack(c.x, c.y, c.z, c.w);
    } else {
      keys[i] = TSP_KEY_NONE;
      bad = true;
    }
  }
  /* Every writer stores the same value, so the race is benign. */
  if (bad && status != NULL) *status = TSP_ERR_RANGE;
}

static __global__ void unpack_keys_kernel(const int64_t *__restrict__ keys, int64_t n,
                                          int32_t *__restrict__ coords) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    int32_t c[4];
    tsp_key_unpack(keys[i], c);
    if (tsp_aligned16(coords)) {
      reinterpret_cast<int4 *>(coords)[i] = make_int4(c[0], c[1], c[2], c[3]);
    } else {
      for (int a = 0; a < 4; ++a) coords[4 * i + a] = c[a];
    }
  }
}

extern "C" tsp_status tsp_pack_keys_cuda(const int32_t *coords, int64_t n, int64_t *keys,
                                         int32_t *status, tsp_cuda_stream stream) {
  if (n < 0) return TSP_ERR_ARGUMENT;
  if (n == 0) return TSP_OK;
  pack_keys_kernel<<<tsp_grid_blocks(n, KEYS_THREADS), KEYS_THREADS, 0, (cudaStream_t)stream>>>(
      coords, n, tsp_aligned16(coords), keys, status);
  return tsp_cuda_check_launch("tsp_pack_keys_cuda");
}

extern "C" tsp_status tsp_unpack_keys_cuda(const int64_t *keys, int64_t n, int32_t *coords,
                                           tsp_cuda_stream stream) {
  if (n < 0) return TSP_ERR_ARGUMENT;
  if (n == 0) return TSP_OK;
  unpack_keys_kernel<<<tsp_grid_blocks(n, KEYS_THREADS), KEYS_THREADS, 0,
                       (cudaStream_t)stream>>>(keys, n, coords);
  return tsp_cuda_check_launch("tsp_unpack_keys_cuda");
}

/* ---------------------------------------------------- output coordinates --- */

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

/* What the candidate and convert kernels need, by value. */
typedef struct {
  tsp_kernel kern;
  int32_t lattice[3];
  int32_t floor_rule;
  int64_t dmin[3], dmax[3]; /* smallest and largest offset per axis */
  int64_t slots;            /* candidate slots per input */
} candidate_args;

/* Workspace layout of tsp_out_coords_cuda; offsets in bytes from the base. */
typedef struct {
  candidate_args args;
  size_t box, count, candidates, temp, temp_bytes, total;
} out_coords_plan;

/*
** Most offsets on axis a that one input keeps: offsets i and j land on the
** lattice for the same inputs exactly when delta_i = delta_j modulo the
** lattice, so this is the largest residue class of the axis's offsets.
*/
static int64_t axis_slots(const tsp_kernel *kern, int a, int64_t lattice) {
  if (lattice == 1) return kern->kernel[a];
  std::vector<int64_t> residue((size_t)kern->kernel[a]);
  for (int64_t i = 0; i < kern->kernel[a]; ++i) {
    const int64_t d = axis_offset(*kern, a, i);
    residue[(size_t)i] = tsp_floor_mod(d, lattice);
  }
  std::sort(residue.begin(), residue.end());
  int64_t best = 0, run = 0;
  for (size_t i = 0; i < residue.size(); ++i) {
    run = (i > 0 && residue[i] == residue[i - 1]) ? run + 1 : 1;
    best = std::max(best, run);
  }
  return best;
}

static tsp_status plan_out_coords(const tsp_out_coords_params *params, int64_t n_in,
                                  out_coords_plan *plan) {
  if (n_in < 0 || n_in > INT32_MAX || !kernel_valid(&params->kernel)) return TSP_ERR_ARGUMENT;
  for (int a = 0; a < 3; ++a) {
    if (params->lattice[a] < 1) return TSP_ERR_ARGUMENT;
  }
  candidate_args *args = &plan->args;
  args->kern = params->kernel;
  args->floor_rule = params->floor_rule ? 1 : 0;
  args->slots = 1;
  for (int a = 0; a < 3; ++a) {
    args->lattice[a] = params->lattice[a];
    const int64_t first = axis_offset(params->kernel, a, 0);
    const int64_t last = axis_offset(params->kernel, a, params->kernel.kernel[a] - 1);
    args->dmin[a] = std::min(first, last);
    args->dmax[a] = std::max(first, last);
    if (!args->floor_rule) args->slots *= axis_slots(&params->kernel, a, params->lattice[a]);
  }
  const int64_t n_candidates = n_in * args->slots;

  size_t sort_bytes = 0, unique_bytes = 0;
  cub::DoubleBuffer<uint64_t> keys(NULL, NULL);
  if (cub::DeviceRadixSort::SortKeys(NULL, sort_bytes, keys, n_candidates, 0, 64) != cudaSuccess)
    return TSP_ERR_CUDA;
  if (cub::DeviceSelect::Unique(NULL, unique_bytes, (const uint64_t *)NULL, (uint64_t *)NULL,
                                (int64_t *)NULL, n_candidates) != cudaSuccess)
    return TSP_ERR_CUDA;
  plan->temp_bytes = std::max(sort_bytes, unique_bytes);
  plan->box = 0;
  plan->count = plan->box + tsp_align256(sizeof(tsp_coord_box));
  plan->candidates = plan->count + tsp_align256(sizeof(int64_t));
  plan->temp = plan->candidates + tsp_align256((size_t)n_candidates * sizeof(uint64_t));
  plan->total = plan->temp + tsp_align256(plan->temp_bytes);
  return TSP_OK;
}

/*
** Box of every candidate (clamped to the packable range: a kept candidate
** outside it is an error and writes no key, so clamping loses nothing) and
** its compact-key layout.  Recomputed by every thread from the input box.
*/
static __device__ __forceinline__ void candidate_layout(const tsp_coord_box *box,
                                                        const candidate_args &args,
                                                        tsp_key_layout *l) {
  int64_t lo[4], hi[4];
  tsp_box_corners(box, lo, hi);
  lo[0] = max(lo[0], (int64_t)0);
  hi[0] = min(hi[0], (int64_t)TSP_BATCH_MAX);
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    const int64_t lattice = args.lattice[a];
    if (args.floor_rule) {
      lo[a + 1] = tsp_floor_div(lo[a + 1], lattice) * lattice;
      hi[a + 1] = tsp_floor_div(hi[a + 1], lattice) * lattice;
    } else {
      lo[a + 1] -= args.dmax[a];
      hi[a + 1] -= args.dmin[a];
    }
    lo[a + 1] = max(lo[a + 1], (int64_t)TSP_COORD_MIN);
    hi[a + 1] = min(hi[a + 1], (int64_t)TSP_COORD_MAX);
  }
  tsp_layout_from_corners(lo, hi, l);
}

static __device__ __forceinline__ bool on_lattice(int64_t v, int64_t lattice) {
  return lattice == 1 || tsp_floor_mod(v, lattice) == 0;
}

/*
** One thread per input: its kept candidates into its `slots` slots, then the
** sentinel.  Axes are looped x, y, z with the lattice test hoisted per axis,
** so a stride-2 3x3x3 conv tests 3 + 9 + 27 coordinates but keys only <= 8.
*/
static __global__ void candidates_kernel(const int32_t *__restrict__ coords, int64_t n,
                                         bool aligned16, candidate_args args,
                                         const tsp_coord_box *box,
                                         uint64_t *__restrict__ candidates, int32_t *status) {
  tsp_key_layout l;
  candidate_layout(box, args, &l);
  const uint64_t sentinel = 1ULL << l.total_bits;
  bool bad = false;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int4 c = tsp_load_coord(coords, i, aligned16);
    uint64_t *slot = candidates + i * args.slots;
    int64_t kept = 0;
    if (args.floor_rule) {
      const int64_t qx = tsp_floor_div(c.y, args.lattice[0]) * args.lattice[0];
      const int64_t qy = tsp_floor_div(c.z, args.lattice[1]) * args.lattice[1];
      const int64_t qz = tsp_floor_div(c.w, args.lattice[2]) * args.lattice[2];
      if (tsp_key_in_range(c.x, qx, qy, qz))
        slot[kept++] = tsp_compact_key(&l, c.x, qx, qy, qz);
      else
        bad = true;
    } else {
      for (int64_t ix = 0; ix < args.kern.kernel[0]; ++ix) {
        const int64_t qx = c.y - axis_offset(args.kern, 0, ix);
        if (!on_lattice(qx, args.lattice[0])) continue;
        for (int64_t iy = 0; iy < args.kern.kernel[1]; ++iy) {
          const int64_t qy = c.z - axis_offset(args.kern, 1, iy);
          if (!on_lattice(qy, args.lattice[1])) continue;
          for (int64_t iz = 0; iz < args.kern.kernel[2]; ++iz) {
            const int64_t qz = c.w - axis_offset(args.kern, 2, iz);
            if (!on_lattice(qz, args.lattice[2])) continue;
            if (!tsp_key_in_range(c.x, qx, qy, qz)) {
              bad = true;
            } else if (kept < args.slots) { /* always true: slots bounds the kept count */
              slot[kept++] = tsp_compact_key(&l, c.x, qx, qy, qz);
            }
          }
        }
      }
    }
    for (; kept < args.slots; ++kept) slot[kept] = sentinel;
  }
  if (bad && status != NULL) *status = TSP_ERR_RANGE;
}

/*
** Unique compact keys -> absolute keys, and the count.  The unique keys
** include the sentinel when any slot was unused; it sorts last, so only the
** thread at index count - 1 looks for it, and that thread alone writes the
** count.  Converting may be in place (unique == keys_out): every index is
** read and written by one thread, and no thread reads another's index.
*/
static __global__ void finish_kernel(const uint64_t *unique, const int64_t *unique_count,
                                     candidate_args args, const tsp_coord_box *box,
                                     int64_t *keys_out, int64_t *n_out_device) {
  tsp_key_layout l;
  candidate_layout(box, args, &l);
  const uint64_t sentinel = 1ULL << l.total_bits;
  const int64_t count = *unique_count;
  if (count == 0 && blockIdx.x == 0 && threadIdx.x == 0) *n_out_device = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count;
       i += (int64_t)gridDim.x * blockDim.x) {
    const uint64_t key = unique[i];
    if (i == count - 1) {
      *n_out_device = key == sentinel ? count - 1 : count;
      if (key == sentinel) continue;
    }
    int64_t c[4];
    tsp_compact_unpack(&l, key, c);
    keys_out[i] = tsp_key_pack(c[0], c[1], c[2], c[3]);
  }
}

extern "C" size_t tsp_out_coords_cuda_workspace(const tsp_out_coords_params *params,
                                                int64_t n_in) {
  out_coords_plan plan;
  if (plan_out_coords(params, n_in, &plan) != TSP_OK) return 0;
  return plan.total;
}

extern "C" tsp_status tsp_out_coords_cuda(const tsp_out_coords_params *params,
                                          const int32_t *in_coords, int64_t n_in,
                                          int64_t *keys_out, int64_t *n_out_device,
                                          int32_t *status, void *workspace,
                                          size_t workspace_bytes, tsp_cuda_stream stream) {
  const char *where = "tsp_out_coords_cuda";
  cudaStream_t s = (cudaStream_t)stream;
  out_coords_plan plan;
  tsp_status st = plan_out_coords(params, n_in, &plan);
  if (st != TSP_OK) return st;
  if (n_in == 0) return tsp_cuda_check(cudaMemsetAsync(n_out_device, 0, sizeof(int64_t), s), where);
  if (workspace == NULL || workspace_bytes < plan.total) return TSP_ERR_ARGUMENT;

  char *ws = (char *)workspace;
  tsp_coord_box *box = (tsp_coord_box *)(ws + plan.box);
  int64_t *unique_count = (int64_t *)(ws + plan.count);
  uint64_t *candidates = (uint64_t *)(ws + plan.candidates);
  void *temp = ws + plan.temp;
  const int64_t n_candidates = n_in * plan.args.slots;
  const bool aligned16 = tsp_aligned16(in_coords);

  st = tsp_cuda_check(cudaMemsetAsync(box, TSP_BOX_CLEAR_BYTE, sizeof(tsp_coord_box), s), where);
  if (st != TSP_OK) return st;
  tsp_coord_box_kernel<<<tsp_box_blocks(n_in), TSP_BOX_THREADS, 0, s>>>(in_coords, n_in,
                                                                        aligned16, box);
  if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;
  candidates_kernel<<<tsp_grid_blocks(n_in, KEYS_THREADS), KEYS_THREADS, 0, s>>>(
      in_coords, n_in, aligned16, plan.args, box, candidates, status);
  if ((st = tsp_cuda_check_launch(where)) != TSP_OK) return st;

  /* keys_out (room for n_in * V >= n_candidates) is the sort's second buffer. */
  cub::DoubleBuffer<uint64_t> keys(candidates, (uint64_t *)keys_out);
  size_t temp_bytes = plan.temp_bytes;
  st = tsp_cuda_check(
      cub::DeviceRadixSort::SortKeys(temp, temp_bytes, keys, n_candidates, 0, 64, s), where);
  if (st != TSP_OK) return st;
  /* The selector is set on the host: which buffer holds the result is known now. */
  const uint64_t *sorted = keys.Current();
  uint64_t *unique = keys.Alternate();
  temp_bytes = plan.temp_bytes;
  st = tsp_cuda_check(cub::DeviceSelect::Unique(temp, temp_bytes, sorted, unique, unique_count,
                                                n_candidates, s),
                      where);
  if (st != TSP_OK) return st;
  /* Unique keys are at most n_candidates; the grid strides over the count read on the device. */
  finish_kernel<<<tsp_grid_blocks(n_candidates, KEYS_THREADS * 8), KEYS_THREADS, 0, s>>>(
      unique, unique_count, plan.args, box, keys_out, n_out_device);
  return tsp_cuda_check_launch(where);
}
