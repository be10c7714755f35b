/*
** conv_pad.cu: copies between a convolution operand and its channel-padded
** image, for conv.cu's padded passes (its "Channel padding").
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

/* The pad jobs of one launch, and where each one's chunks end in the
** launch's index space (end[k] = chunks of jobs 0..k). */
typedef struct {
  tsp_pad_job job[TSP_PAD_JOBS];
  int64_t end[TSP_PAD_JOBS];
  int n;
} pad_launch;

/* pad: dst[b, i, j] = i < rows && j < cols ? src[b, i, j] : 0 over dst
** [batch, rows_to, cols_to], src [batch, rows, cols], for each job of the
** launch (a pass's operands in one launch: each launch costs the host ~4 us,
** more than the copies of a stem's images take on the GPU).  A thread builds
** one 16-byte chunk of a destination row in registers and stores it at once:
** the padded widths are whole chunks (multiples of 8 16-bit or 4 32-bit
** elements) and the images 256-byte aligned.  Element-wide stores of an
** [N, 8] image took ~27 us at 692k rows on an H200 (eight partial-sector
** writes per chunk; session 71, call 2). */
template <typename E> static __global__ void pad_kernel(const pad_launch L) {
  enum { PER = 16 / sizeof(E) };
  const int64_t total = L.end[L.n - 1];
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
       e += (int64_t)gridDim.x * blockDim.x) {
    int k = 0;
    while (k + 1 < L.n && e >= L.end[k]) ++k;
    const tsp_pad_job &J = L.job[k];
    const int64_t c = e - (k > 0 ? L.end[k - 1] : 0), chunks = J.cols_to / PER;
    /* The 64-bit divisions only where there is more than one chunk a row or more than one matrix. */
    const int64_t row = chunks == 1 ? c : c / chunks, j0 = (c - row * chunks) * PER;
    const int64_t i = J.batch == 1 ? row : row % J.rows_to, b = J.batch == 1 ? 0 : row / J.rows_to;
    const E *s = (const E *)J.src + (b * J.rows + i) * J.cols;
    union {
      uint4 v;
      E x[PER];
    } u;
#pragma unroll
    for (int t = 0; t < PER; ++t) u.x[t] = i < J.rows && j0 + t < J.cols ? s[j0 + t] : (E)0;
    ((uint4 *)J.dst)[c] = u.v;
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

enum { THREADS = 256 };

static int64_t max_blocks(void) { return (int64_t)tsp_device_sms() * 16 + 16; }

tsp_status tsp_conv_pad_images(const tsp_pad_job *jobs, int n_jobs, int elem_bytes, cudaStream_t stream) {
  if (n_jobs < 0 || n_jobs > TSP_PAD_JOBS || (elem_bytes != 2 && elem_bytes != 4)) return TSP_ERR_ARGUMENT;
  const int per = 16 / elem_bytes;
  pad_launch L;
  L.n = 0;
  int64_t total = 0;
  for (int k = 0; k < n_jobs; ++k) {
    const tsp_pad_job *j = &jobs[k];
    if (j->batch < 0 || j->rows < 0 || j->cols < 0 || j->rows_to < j->rows || j->cols_to < j->cols)
      return TSP_ERR_ARGUMENT;
    if (j->cols_to % per != 0 || (uintptr_t)j->dst % 16 != 0) return TSP_ERR_ARGUMENT; /* whole, aligned chunks */
    const int64_t chunks = j->batch * j->rows_to * (j->cols_to / per);
    if (chunks == 0) continue;
    total += chunks;
    L.job[L.n] = *j;
    L.end[L.n++] = total;
  }
  if (total == 0) return TSP_OK;
  const unsigned int blocks = tsp_grid_blocks_max(total, THREADS, max_blocks());
  if (elem_bytes == 2)
    pad_kernel<uint16_t><<<blocks, THREADS, 0, stream>>>(L);
  else
    pad_kernel<uint32_t><<<blocks, THREADS, 0, stream>>>(L);
  return tsp_cuda_check_launch("tsp_conv_pad_images");
}

template <typename E>
static void launch_crop(const void *src, void *dst, int64_t batch, int64_t rows, int64_t cols, int64_t rows_to,
                        int64_t cols_to, cudaStream_t stream) {
  const int64_t total = batch * rows * cols;
  const unsigned int blocks = tsp_grid_blocks_max(total, THREADS, max_blocks());
  if (batch * rows_to * cols_to < ((int64_t)1 << 32) - (int64_t)blocks * THREADS) /* no index wraps */
    crop_kernel<E, uint32_t><<<blocks, THREADS, 0, stream>>>(
        (const E *)src, (E *)dst, (uint32_t)batch, (uint32_t)rows, (uint32_t)cols, (uint32_t)rows_to,
        (uint32_t)cols_to, (uint32_t)total);
  else
    crop_kernel<E, int64_t><<<blocks, THREADS, 0, stream>>>((const E *)src, (E *)dst, batch, rows, cols, rows_to,
                                                            cols_to, total);
}

tsp_status tsp_conv_crop(const void *src, void *dst, int64_t batch, int64_t rows, int64_t cols, int64_t rows_to,
                         int64_t cols_to, int elem_bytes, cudaStream_t stream) {
  if (batch < 0 || rows < 0 || cols < 0 || rows_to < rows || cols_to < cols) return TSP_ERR_ARGUMENT;
  if (batch * rows * cols == 0) return TSP_OK;
  if (elem_bytes == 2)
    launch_crop<uint16_t>(src, dst, batch, rows, cols, rows_to, cols_to, stream);
  else if (elem_bytes == 4)
    launch_crop<uint32_t>(src, dst, batch, rows, cols, rows_to, cols_to, stream);
  else
    return TSP_ERR_ARGUMENT;
  return tsp_cuda_check_launch("tsp_conv_crop");
}
