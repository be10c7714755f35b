/*
** cuda_common.cuh: what every torchsp .cu file shares: error recording for
** tsp_cuda_last_error(), the launch check, and 64-bit grid helpers.
** No torch headers here or in any .cu file (DESIGN.md section 6), so each
** kernel file compile-checks alone with `nvcc -c -arch=sm_90 -Icsrc`.
*/
#ifndef TSP_CUDA_COMMON_CUH
#define TSP_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "../torchsp.h"

/* Record a failed CUDA call for tsp_cuda_last_error(); defined in errors.cu. */
void tsp_cuda_record_error(cudaError_t err, const char *where);

/* Map a CUDA return code to a tsp_status, recording failures. */
static inline tsp_status tsp_cuda_check(cudaError_t err, const char *where) {
  if (err == cudaSuccess) return TSP_OK;
  tsp_cuda_record_error(err, where);
  return TSP_ERR_CUDA;
}

/* After a launch: configuration errors surface here (never synchronises). */
static inline tsp_status tsp_cuda_check_launch(const char *where) {
  return tsp_cuda_check(cudaGetLastError(), where);
}

/* Blocks for n items at `threads` per block, at least 1 and at most
** max_blocks; kernels use grid-stride loops with int64 indices. */
static inline unsigned int tsp_grid_blocks_max(int64_t n, int threads, int64_t max_blocks) {
  int64_t b = (n + threads - 1) / threads;
  if (b > max_blocks) b = max_blocks;
  if (b < 1) b = 1;
  return (unsigned int)b;
}

/* The same, capped only so gridDim.x stays legal. */
static inline unsigned int tsp_grid_blocks(int64_t n, int threads) {
  return tsp_grid_blocks_max(n, threads, 65535LL * 32);
}

#ifdef __CUDACC__
/* Inclusive prefix sum of x over the 32 lanes of a full warp, in lane order:
** five shuffles, no shared memory (tile_pack.cu, tile_steps.cu). */
static __device__ __forceinline__ int tsp_warp_scan(int x, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}
#endif

#endif /* TSP_CUDA_COMMON_CUH */
