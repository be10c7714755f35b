/*
** conv_pad.cu: copies between a convolution operand and its channel-padded
** image, for conv.cu's padded passes (tsp_conv_pad_channels).
**
** Why: the tensor-core kernels take channel counts in multiples of 8 (fp16,
** bf16; 4 for tf32), and a LiDAR or RGB-D net's stem reads 3-5 input
** channels.  Its passes ran conv_simple.cu's CUDA-core kernels: on an H200,
** batch 4 of lidar_198k (692,521 voxels, 3x3x3, 4 -> 32, fp16), the forward
** took 643 us and wgrad 3,699 us, against 52 and 80 + 6 for the same layer at
** 8 input channels on tensor cores (session 71, call 1).  A zero channel adds
** exact zeros to every sum, so padding x and w with zeros, running the padded
** problem and cropping its output gives the unpadded problem's sums.
**
** The copies move 16-bit or 32-bit words as bits (a zero word is +0.0 in
** every float type).
*/
#include "conv_internal.cuh"

/* pad: dst[b, i, j] = i < rows && j < cols ? src[b, i, j] : 0 over dst
** [batch, rows_to, cols_to], src [batch, rows, cols].  A thread builds one
** 16-byte chunk of a destination row in registers and stores it at once:
** the padded widths are whole chunks (multiples of 8 16-bit or 4 32-bit
** elements) and the images 256-byte aligned.  Element-wide stores of an
** [N, 8] image took ~27 us at 692k rows on an H200 (eight partial-sector
** writes per chunk; session 71, call 2). */
template <typename E>
static __global__ void pad_kernel(const E *__restrict__ src, uint4 *__restrict__ dst, int64_t batch, int64_t rows,
                                  int64_t cols, int64_t rows_to, int64_t cols_to) {
  enum { PER = 16 / sizeof(E) };
  const int64_t chunks = cols_to / PER, total = batch * rows_to * chunks;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
       e += (int64_t)gridDim.x * blockDim.x) {
    /* The 64-bit divisions only where there is more than one chunk a row or more than one matrix. */
    const int64_t row = chunks == 1 ? e : e / chunks, j0 = (e - row * chunks) * PER;
    const int64_t i = batch == 1 ? row : row % rows_to, b = batch == 1 ? 0 : row / rows_to;
    const E *s = src + (b * rows + i) * cols;
    union {
      uint4 v;
      E x[PER];
    } u;
#pragma unroll
    for (int t = 0; t < PER; ++t) u.x[t] = i < rows && j0 + t < cols ? s[j0 + t] : (E)0;
    dst[e] = u.v;
  }
}

/* crop: dst[b, i, j] = src[b, i, j] over dst [batch, rows, cols], src
** [batch, rows_to, cols_to]; a thread an element, so a warp's stores are
** consecutive; I (the index type) 32-bit where the count allows. */
template <typename E, typename I>
static __global__ void crop_kernel(const E *__restrict__ src, E *__restrict__ dst, I batch, I rows, I cols,
                                   I rows_to, I cols_to, I total) {
  for (I e = blockIdx.x * (I)blockDim.x + threadIdx.x; e < total; e += (I)gridDim.x * blockDim.x) {
    const I bi = e / cols, j = e - bi * cols;
    const I i = batch == 1 ? bi : bi % rows, b = batch == 1 ? 0 : bi / rows;
    dst[e] = src[(b * rows_to + i) * cols_to + j];
  }
}

template <typename E>
static tsp_status launch(const void *src, void *dst, int64_t batch, int64_t rows, int64_t cols, int64_t rows_to,
                         int64_t cols_to, int crop, cudaStream_t stream) {
  enum { THREADS = 256, PER = 16 / sizeof(E) };
  const int64_t max_blocks = (int64_t)tsp_device_sms() * 16 + 16;
  if (!crop) {
    if (cols_to % PER != 0 || (uintptr_t)dst % 16 != 0) return TSP_ERR_ARGUMENT; /* whole, aligned chunks */
    const int64_t total = batch * rows_to * (cols_to / PER);
    pad_kernel<E><<<tsp_grid_blocks_max(total, THREADS, max_blocks), THREADS, 0, stream>>>(
        (const E *)src, (uint4 *)dst, batch, rows, cols, rows_to, cols_to);
    return TSP_OK;
  }
  const int64_t total = batch * rows * cols;
  const unsigned int blocks = tsp_grid_blocks_max(total, THREADS, max_blocks);
  if (batch * rows_to * cols_to < ((int64_t)1 << 32) - (int64_t)blocks * THREADS) /* no index wraps */
    crop_kernel<E, uint32_t><<<blocks, THREADS, 0, stream>>>(
        (const E *)src, (E *)dst, (uint32_t)batch, (uint32_t)rows, (uint32_t)cols, (uint32_t)rows_to,
        (uint32_t)cols_to, (uint32_t)total);
  else
    crop_kernel<E, int64_t><<<blocks, THREADS, 0, stream>>>((const E *)src, (E *)dst, batch, rows, cols, rows_to,
                                                            cols_to, total);
  return TSP_OK;
}

tsp_status tsp_conv_pad_copy(const void *src, void *dst, int64_t batch, int64_t rows, int64_t cols,
                             int64_t rows_to, int64_t cols_to, int elem_bytes, int crop,
                             cudaStream_t stream) {
  if (batch < 0 || rows < 0 || cols < 0 || rows_to < rows || cols_to < cols) return TSP_ERR_ARGUMENT;
  if (batch * (crop ? rows * cols : rows_to * cols_to) == 0) return TSP_OK;
  tsp_status s;
  if (elem_bytes == 2)
    s = launch<uint16_t>(src, dst, batch, rows, cols, rows_to, cols_to, crop, stream);
  else if (elem_bytes == 4)
    s = launch<uint32_t>(src, dst, batch, rows, cols, rows_to, cols_to, crop, stream);
  else
    return TSP_ERR_ARGUMENT;
  return s != TSP_OK ? s : tsp_cuda_check_launch("tsp_conv_pad_copy");
}
