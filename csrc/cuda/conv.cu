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
** events around the Python call, median of 50, us; floor of DESIGN.md 7):
**     layer        nb/row  floor  fwd sorted  fwd unsorted  dgrad sorted  wgrad
**     subm3 C32      3.5    13.6      102          92           105         91
**     subm3 C64      3.5    21.1      157         190           160        137
**     subm3 C128     6.3    32.7      334         493           341        362
**     subm3 C256     6.3   130.9     1087        1883          1114       1325
**     down3 C128     3.1    27.6      274         570           138        233
** Mask sorting pays 1.4-2.1x from C = 64 up; at C = 32 the scattered map
** reads cost more than the skipped mma work (the tuner picks per group).
** Still 5-10x over the floor (not profiled since sorting).  Next: split
** rows by mask (TorchSparse++), wgmma (sm_90a) for C >= 128, per-offset pair
** lists for wgrad, tf32 for float32.
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

/* Tensor cores need sm_80 (mma.sync m16n8k16 with bf16, cp.async).  The
** attribute query is a cached host-side lookup, not a synchronisation. */
static int tensor_cores_available(void) {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
    return 0;
  return major >= 8;
}

static int fast_dtype(tsp_dtype dtype) {
  return dtype == TSP_FLOAT16 || dtype == TSP_BFLOAT16;
}

/* Bytes of fp32 wgrad partials; forward and dgrad need none, but the shim
** asks once per pass with the same problem, so the size covers wgrad. */
size_t tsp_conv_cuda_workspace(const tsp_conv_problem *prob) {
  if (check_problem(prob) != TSP_OK || prob->n_out == 0) return 0;
  const int64_t chunks = tsp_wgrad_chunks(prob);
  if (chunks <= 1) return 0;
  return (size_t)chunks * (size_t)(prob->volume * prob->c_in * prob->c_out) * sizeof(float);
}

/* Forward and dgrad are one output-stationary problem with roles swapped. */
static tsp_status output_stationary(tsp_dtype dtype, const void *src, int64_t src_rows,
                                    const void *w, const int32_t *map, const int32_t *order,
                                    int64_t rows,
                                    int64_t volume, int64_t red, int64_t n, int transposed_w, int tile,
                                    void *out, cudaStream_t stream) {
  if (rows == 0 || n == 0) return TSP_OK;
  if (red == 0 || src_rows == 0) /* no term in any sum */
    return tsp_cuda_check(cudaMemsetAsync(out, 0, (size_t)(rows * n) * element_bytes(dtype),
                                          stream),
                          "tsp_conv: zero output");
  if (fast_dtype(dtype) && tensor_cores_available()) {
    tsp_status s = tsp_conv_igemm_os(dtype, src, src_rows, w, map, order, rows, volume, red, n,
                                     transposed_w, tile, out, stream);
    if (s != TSP_ERR_UNSUPPORTED) return s;
  }
  return tsp_conv_simple_os(dtype, src, src_rows, w, map, rows, volume, red, n, transposed_w, out,
                            stream);
}

tsp_status tsp_conv_fwd_cuda(const tsp_conv_problem *prob, const void *x, const void *w,
                             const int32_t *nbmap, void *y, void *workspace,
                             size_t workspace_bytes, tsp_cuda_stream stream) {
  (void)workspace;
  (void)workspace_bytes;
  tsp_status s = check_problem(prob);
  if (s != TSP_OK) return s;
  const int32_t *order = prob->algo.threshold == -1 ? NULL : prob->order;
  return output_stationary(prob->dtype, x, prob->n_in, w, nbmap, order, prob->n_out, prob->volume,
                           prob->c_in, prob->c_out, 0, prob->algo.tile, y, (cudaStream_t)stream);
}

tsp_status tsp_conv_dgrad_cuda(const tsp_conv_problem *prob, const void *dy, const void *w,
                               const int32_t *nbmap_t, void *dx, void *workspace,
                               size_t workspace_bytes, tsp_cuda_stream stream) {
  (void)workspace;
  (void)workspace_bytes;
  tsp_status s = check_problem(prob);
  if (s != TSP_OK) return s;
  const int32_t *order = prob->algo.threshold == -1 ? NULL : prob->order_t;
  return output_stationary(prob->dtype, dy, prob->n_out, w, nbmap_t, order, prob->n_in, prob->volume,
                           prob->c_out, prob->c_in, 1, prob->algo.tile, dx, (cudaStream_t)stream);
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
