/*
** mask_order.cu: the row order of a kernel map sorted by neighbour mask
** (TorchSparse++'s mask sorting), for the output-stationary tensor-core
** kernels: a tile of consecutive rows in this order shares its offsets, so
** it skips the mma work of offsets none of its rows has.
**
** A first pass counts the rows of each offset (bit positions: rarest offset
** most significant, tsp_mask_rank.h); then one thread per row packs its V
** presence bits into a mask and keys it by the mask's Gray rank
** (tsp_mask_gray_rank; uint32 when V <= 32, else uint64); CUB's radix
** sort over the low V bits, which is
** stable, carries the row indices along: ties keep map order (rows sorted by
** coordinate), which keeps the gathers of a tile local.  About 25 us for
** 173k rows x 27 offsets on an H100, against ~160 us for the same sort as
** five PyTorch ops on [N, V] int64 temporaries.
**
** Other orders, measured offline on lidar_198k's 3x3x3 maps (share of the
** m64 block-offset work that is useful, at 0.05 m / 0.1 m; 2026-11-25):
** this one 0.572 / 0.553; plain binary rank 0.553 / 0.534; rarest offset
** least significant 0.489 / 0.475; offsets in map order 0.528 / 0.515;
** popcount first 0.518 / 0.484; runs of one mask cut into whole 64-row
** blocks first 0.573 / 0.553 (most masks are rare: 31k and 54k distinct).
** Row swaps between neighbouring blocks that shrink their offset unions
** (a local search) took 0.553 to 0.556 at 0.1 m.
**
** Offsets outside the `offsets` set are not counted and set no bit
** (torchsp.h), exactly as in the CPU twin.  tsp_mask_plan_cuda then copies
** the map rows into that order (a tile plan, torchsp.h).
*/
#include <cub/cub.cuh>

#include "cuda_common.cuh"
#include "tsp_mask_rank.h"

/* count[k] += rows with map[r, k] >= 0, for k in the set: a block histogram in
** shared memory, then V atomics. */
__global__ void mask_count_kernel(const int32_t *__restrict__ map, int64_t n, int volume,
                                  uint64_t offsets, unsigned long long *__restrict__ count) {
  __shared__ unsigned int s_count[TSP_MASK_ORDER_MAX_VOLUME];
  for (int k = threadIdx.x; k < volume; k += blockDim.x) s_count[k] = 0;
  __syncthreads();
  const int64_t total = n * volume;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x)
    if (map[i] >= 0) { /* 32-bit remainder when it fits: a 64-bit one is a long subroutine */
      const uint32_t k = total <= 0xffffffffLL ? (uint32_t)i % (uint32_t)volume
                                               : (uint32_t)(i % volume);
      if ((offsets >> k) & 1) atomicAdd(&s_count[k], 1u);
    }
  __syncthreads();
  for (int k = threadIdx.x; k < volume; k += blockDim.x)
    if (s_count[k]) atomicAdd(&count[k], (unsigned long long)s_count[k]);
}

/* One thread per row: the row's key.  s_value[k] is offset k's bit at its rank
** (0 outside the set, whose counts are 0 already). */
template <typename K>
__global__ void mask_keys_kernel(const int32_t *__restrict__ map, int64_t n, int volume,
                                 uint64_t offsets, const unsigned long long *__restrict__ count,
                                 K *__restrict__ keys, int32_t *__restrict__ rows) {
  __shared__ K s_value[TSP_MASK_ORDER_MAX_VOLUME];
  __shared__ int64_t s_count[TSP_MASK_ORDER_MAX_VOLUME];
  for (int k = threadIdx.x; k < volume; k += blockDim.x) s_count[k] = (int64_t)count[k];
  __syncthreads();
  for (int k = threadIdx.x; k < volume; k += blockDim.x)
    s_value[k] = ((offsets >> k) & 1) ? (K)1 << tsp_mask_bit_rank(s_count, volume, k) : (K)0;
  __syncthreads();
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < n;
       r += (int64_t)gridDim.x * blockDim.x) {
    const int32_t *row = map + r * volume;
    K m = 0;
    for (int k = 0; k < volume; ++k) m |= row[k] >= 0 ? s_value[k] : (K)0;
    keys[r] = (K)tsp_mask_gray_rank((uint64_t)m);
    rows[r] = (int32_t)r;
  }
}

/* Workspace layout: keys in, keys out, row indices in (16-byte aligned
** pieces), then CUB's temporary storage. */
static size_t align16(size_t b) { return (b + 15) & ~(size_t)15; }

template <typename K>
static size_t mask_order_bytes(int64_t n, int volume, size_t *cub_bytes) {
  size_t temp = 0;
  if (cub::DeviceRadixSort::SortPairs(NULL, temp, (const K *)NULL, (K *)NULL,
                                      (const int32_t *)NULL, (int32_t *)NULL, (int)n, 0,
                                      volume) != cudaSuccess)
    return 0;
  if (cub_bytes) *cub_bytes = temp;
  return 2 * align16((size_t)n * sizeof(K)) + align16((size_t)n * 4) +
         align16(TSP_MASK_ORDER_MAX_VOLUME * sizeof(unsigned long long)) + align16(temp);
}

size_t tsp_mask_order_cuda_workspace(int64_t n_rows, int64_t volume) {
  if (n_rows <= 0 || volume < 1 || volume > TSP_MASK_ORDER_MAX_VOLUME || n_rows > 0x7fffffffLL)
    return 0;
  return volume <= 32 ? mask_order_bytes<uint32_t>(n_rows, (int)volume, NULL)
                      : mask_order_bytes<uint64_t>(n_rows, (int)volume, NULL);
}

template <typename K>
static tsp_status mask_order(const int32_t *map, int64_t n, int volume, uint64_t offsets,
                             int32_t *order, void *workspace, size_t workspace_bytes,
                             cudaStream_t stream) {
  size_t temp = 0;
  const size_t need = mask_order_bytes<K>(n, volume, &temp);
  if (need == 0 || workspace_bytes < need) return TSP_ERR_ARGUMENT;
  char *p = (char *)workspace;
  K *keys_in = (K *)p;
  p += align16((size_t)n * sizeof(K));
  K *keys_out = (K *)p;
  p += align16((size_t)n * sizeof(K));
  int32_t *rows_in = (int32_t *)p;
  p += align16((size_t)n * 4);
  unsigned long long *count = (unsigned long long *)p;
  p += align16(TSP_MASK_ORDER_MAX_VOLUME * sizeof(unsigned long long));
  const int threads = 256;
  tsp_status s = tsp_cuda_check(cudaMemsetAsync(count, 0, (size_t)volume * sizeof(*count), stream),
                                "tsp_mask_order_cuda: counts");
  if (s != TSP_OK) return s;
  const unsigned count_blocks = tsp_grid_blocks(n * volume, threads) < 264u
                                    ? tsp_grid_blocks(n * volume, threads) : 264u;
  mask_count_kernel<<<count_blocks, threads, 0, stream>>>(map, n, volume, offsets, count);
  if ((s = tsp_cuda_check_launch("tsp_mask_order_cuda: counts")) != TSP_OK) return s;
  mask_keys_kernel<K><<<tsp_grid_blocks(n, threads), threads, 0, stream>>>(
      map, n, volume, offsets, count, keys_in, rows_in);
  if ((s = tsp_cuda_check_launch("tsp_mask_order_cuda: keys")) != TSP_OK) return s;
  return tsp_cuda_check(cub::DeviceRadixSort::SortPairs(p, temp, keys_in, keys_out, rows_in, order,
                                                        (int)n, 0, volume, stream),
                        "tsp_mask_order_cuda: sort");
}

tsp_status tsp_mask_order_cuda(const int32_t *map, int64_t n_rows, int64_t volume,
                               uint64_t offsets, int32_t *order, void *workspace,
                               size_t workspace_bytes, tsp_cuda_stream stream) {
  if (n_rows == 0 && volume >= 1 && volume <= TSP_MASK_ORDER_MAX_VOLUME)
    return TSP_OK; /* empty tensors may have NULL data */
  if (!map || !order || n_rows < 0 || volume < 1 || volume > TSP_MASK_ORDER_MAX_VOLUME ||
      n_rows > 0x7fffffffLL)
    return TSP_ERR_ARGUMENT;
  cudaStream_t st = (cudaStream_t)stream;
  return volume <= 32 ? mask_order<uint32_t>(map, n_rows, (int)volume, offsets, order, workspace,
                                              workspace_bytes, st)
                      : mask_order<uint64_t>(map, n_rows, (int)volume, offsets, order, workspace,
                                              workspace_bytes, st);
}

/* One thread per plan entry: the order [n], then the map rows in that order [n, volume]. */
__global__ void mask_plan_kernel(const int32_t *__restrict__ map, int64_t n, int volume,
                                 const int32_t *__restrict__ order, int32_t *__restrict__ plan) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n * (1 + (int64_t)volume);
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = e < n ? e : (e - n) / volume, k = e < n ? -1 : (e - n) - i * volume;
    const int32_t r = order[i];
    const bool ok = r >= 0 && r < n;
    plan[e] = !ok ? -1 : k < 0 ? r : map[(int64_t)r * volume + k];
  }
}

tsp_status tsp_mask_plan_cuda(const int32_t *map, int64_t n_rows, int64_t volume,
                              const int32_t *order, int32_t *plan, tsp_cuda_stream stream) {
  if (n_rows == 0 && volume >= 1) return TSP_OK;
  if (!map || !order || !plan || n_rows < 0 || volume < 1 || volume > 0x7fffffff ||
      n_rows > 0x7fffffffLL)
    return TSP_ERR_ARGUMENT;
  mask_plan_kernel<<<tsp_grid_blocks(n_rows * (1 + volume), 256), 256, 0, (cudaStream_t)stream>>>(
      map, n_rows, (int)volume, order, plan);
  return tsp_cuda_check_launch("tsp_mask_plan_cuda");
}
