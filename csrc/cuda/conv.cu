/*
** conv.cu: the CUDA convolution entry points of torchsp.h (forward, dgrad,
** wgrad, workspace size) and the choice of kernel for each call.
**
**   forward  y[q]  = sum_k x[nbmap[q, k]] @ w[k]          (rows: n_out)
**   dgrad    dx[p] = sum_k dy[nbmap_t[p, k]] @ w[k]^T      (rows: n_in)
**   wgrad    dw[k] = sum_q x[nbmap[q, k]]^T dy[q]
**
** Dispatch, per call, from sizes and pointers alone (no device queries that
** synchronise, no host sync, current stream only):
**   - fp16 / bf16, both channel counts multiples of 8, 16-byte aligned
**     operands, V <= 64, compute capability >= 8.0: tensor cores
**     (conv_implicit_gemm.cu for forward and dgrad, conv_wgrad.cu for wgrad);
**     algo.tile 6-10 asks for the wgmma kernels of conv_wgmma.cu, which exist
**     in sm_90a builds (TORCH_CUDA_ARCH_LIST=9.0a) and run on sm_90 devices;
**     elsewhere those tiles fall back to the mma.sync kernel;
**   - everything else (float32, odd channels such as the 4-5 input channels of
**     a LiDAR net, misaligned views): conv_simple.cu, correct for any shape.
** Every dataflow value of prob->algo is served by the output-stationary
** kernels for now; split is not read; tile picks the tensor-core tile shape
** (conv_implicit_gemm.cu).  The tensor-core kernels walk rows in
** prob->order / order_t (mask-sorted) when given, unless algo.threshold ==
** -1 (unsorted).  All paths are deterministic (no float atomics): wgrad's
** split over rows reduces in a fixed order.
** float64 is TSP_ERR_UNSUPPORTED (the CPU kernels serve gradcheck).
**
** Measured (H100, tools/bench.py, fp16, lidar_198k.npz, map cached, CUDA
** events around the Python call, median of 50, us; floor of DESIGN.md 7;
** 2026-11-23, sm_90a build):
**     layer        nb/row  floor  fwd sorted  fwd unsorted  wgmma tile 9  dgrad sorted  wgrad
**     subm3 C32      3.5    13.6       73          94           108            75         91
**     subm3 C64      3.5    21.1      135         196           145           140        133
**     subm3 C128     6.3    32.7      329         512           323           330        348
**     subm3 C256     6.3   130.9     1105        1950          1038          1085       1285
**     down3 C128     3.1    27.6      270         584           267           127        232
** Reading a sorted tile's map rows with independent loads (conv_tile.cuh)
** took C = 32 from 104 to 73 us and C = 64 from 161 to 135.  At C >= 128
** every kernel variant (mma.sync 32x64 or 64x64 warps, BK 32 or 64, wgmma
** with 128- or 256-row tiles, pipelined or not) lands within 10% of the
** others, with ncu reporting the L2 ~78% busy (3.4-3.8 TB/s of L2 traffic):
** the per-(tile, offset) weight reloads and gathers, not the tensor cores
** (23-30% busy), bound them.  Next: fewer (tile, offset) pairs (mask splits,
** a better bit order for mask sorting), weight-stationary for sparse
** offsets, tf32 for float32.
*/
#include "conv_internal.cuh"

/* Validate what every pass shares; *empty set when there is nothing to compute. */
static tsp_status check_problem(const tsp_conv_problem *p) {
  if (!p) return TSP_ERR_ARGUMENT;
  if (p->n_in < 0 || p->n_out < 0 || p->c_in < 0 || p->c_out < 0 || p->volume < 1 ||
      p->volume > 65535)
    return TSP_ERR_ARGUMENT;
  if (p->n_in > 0x7fffffffLL || p->n_out > 0x7fffffffLL) return TSP_ERR_ARGUMENT;
  if (p->dtype == TSP_FLOAT64) return TSP_ERR_UNSUPPORTED;
  if (p->dtype != TSP_FLOAT32 && p->dtype != TSP_FLOAT16 && p->dtype != TSP_BFLOAT16)
    return TSP_ERR_ARGUMENT;
  return TSP_OK;
}

static size_t element_bytes(tsp_dtype dtype) { return dtype == TSP_FLOAT32 ? 4 : 2; }

/* algo.tile values served by conv_wgmma.cu (sm_90a builds); others by conv_implicit_gemm.cu. */
static int is_wgmma_tile(int tile) { return tile >= 6 && tile <= 10; }

/* Tensor cores need sm_80 (mma.sync m16n8k16 with bf16, cp.async). */
static int tensor_cores_available(void) { return tsp_device_cc() >= 80; }

static int fast_dtype(tsp_dtype dtype) {
  return dtype == TSP_FLOAT16 || dtype == TSP_BFLOAT16;
}

/* Bytes of fp32 wgrad partials; forward and dgrad need none, but the shim
** asks once per pass with the same problem, so the size covers wgrad. */
size_t tsp_conv_cuda_workspace(const tsp_conv_problem *prob) {
  if (check_problem(prob) != TSP_OK || prob->n_out == 0) return 0;
  size_t bytes = 0;
  if (is_wgmma_tile(prob->algo.tile)) /* forward's K-major copy of w */
    bytes = tsp_conv_wgmma_workspace(prob->volume, prob->c_in, prob->c_out);
  const int64_t chunks = tsp_wgrad_chunks(prob);
  if (chunks <= 1) return bytes;
  const size_t partials = (size_t)chunks * (size_t)(prob->volume * prob->c_in * prob->c_out) * sizeof(float);
  return partials > bytes ? partials : bytes;
}

/* Forward and dgrad are one output-stationary problem with roles swapped. */
static tsp_status output_stationary(tsp_dtype dtype, const void *src, int64_t src_rows,
                                    const void *w, const int32_t *map, const int32_t *order,
                                    int64_t rows,
                                    int64_t volume, int64_t red, int64_t n, int transposed_w, int tile,
                                    void *out, void *workspace, size_t workspace_bytes,
                                    cudaStream_t stream) {
  if (rows == 0 || n == 0) return TSP_OK;
  if (red == 0 || src_rows == 0) /* no term in any sum */
    return tsp_cuda_check(cudaMemsetAsync(out, 0, (size_t)(rows * n) * element_bytes(dtype),
                                          stream),
                          "tsp_conv: zero output");
  const tsp_os_launch launch = {src, src_rows, w, map, order, rows, volume, red, n, out, stream};
  if (fast_dtype(dtype) && is_wgmma_tile(tile)) {
    tsp_status s = tsp_conv_wgmma_os(dtype, &launch, transposed_w, tile, workspace, workspace_bytes);
    if (s != TSP_ERR_UNSUPPORTED) return s;
  }
  if (fast_dtype(dtype) && tensor_cores_available()) {
    tsp_status s = tsp_conv_igemm_os(dtype, &launch, transposed_w, tile);
    if (s != TSP_ERR_UNSUPPORTED) return s;
  }
  return tsp_conv_simple_os(dtype, src, src_rows, w, map, rows, volume, red, n, transposed_w, out,
                            stream);
}

tsp_status tsp_conv_fwd_cuda(const tsp_conv_problem *prob, const void *x, const void *w,
                             const int32_t *nbmap, void *y, void *workspace,
                             size_t workspace_bytes, tsp_cuda_stream stream) {
  tsp_status s = check_problem(prob);
  if (s != TSP_OK) return s;
  const int32_t *order = prob->algo.threshold == -1 ? NULL : prob->order;
  return output_stationary(prob->dtype, x, prob->n_in, w, nbmap, order, prob->n_out, prob->volume,
                           prob->c_in, prob->c_out, 0, prob->algo.tile, y, workspace,
                           workspace_bytes, (cudaStream_t)stream);
}

tsp_status tsp_conv_dgrad_cuda(const tsp_conv_problem *prob, const void *dy, const void *w,
                               const int32_t *nbmap_t, void *dx, void *workspace,
                               size_t workspace_bytes, tsp_cuda_stream stream) {
  tsp_status s = check_problem(prob);
  if (s != TSP_OK) return s;
  const int32_t *order = prob->algo.threshold == -1 ? NULL : prob->order_t;
  return output_stationary(prob->dtype, dy, prob->n_out, w, nbmap_t, order, prob->n_in, prob->volume,
                           prob->c_out, prob->c_in, 1, prob->algo.tile, dx, workspace,
                           workspace_bytes, (cudaStream_t)stream);
}

tsp_status tsp_conv_wgrad_cuda(const tsp_conv_problem *prob, const void *x, const void *dy,
                               const int32_t *nbmap, void *dw, void *workspace,
                               size_t workspace_bytes, tsp_cuda_stream stream) {
  tsp_status s = check_problem(prob);
  if (s != TSP_OK) return s;
  cudaStream_t st = (cudaStream_t)stream;
  const int64_t count = prob->volume * prob->c_in * prob->c_out;
  if (count == 0) return TSP_OK;
  if (prob->n_out == 0 || prob->n_in == 0) /* no pair anywhere: dw = 0 */
    return tsp_cuda_check(cudaMemsetAsync(dw, 0, (size_t)count * element_bytes(prob->dtype), st),
                          "tsp_conv_wgrad: zero dw");
  if (workspace_bytes < tsp_conv_cuda_workspace(prob)) return TSP_ERR_ARGUMENT;
  float *partials = (float *)workspace;
  if (fast_dtype(prob->dtype) && tensor_cores_available()) {
    s = tsp_conv_mma_wgrad(prob, x, dy, nbmap, dw, partials, st);
    if (s != TSP_ERR_UNSUPPORTED) return s;
  }
  return tsp_conv_simple_wgrad(prob, x, dy, nbmap, dw, partials, st);
}
