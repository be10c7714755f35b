/*
** conv_simple.cu: the fallback convolution kernels, correct for every shape
** the interface accepts: any channel count (3, 5, 384, ...), any row count,
** float32 / float16 / bfloat16 with fp32 accumulation, map entries outside
** their valid range treated as absent.
**
** Why they exist beside the tensor-core paths (conv_implicit_gemm.cu,
** conv_wgrad.cu): those need channel counts that are multiples of 8 and
** 16-byte aligned rows, and take fp16/bf16 only.  Everything else lands here:
** the first layer of a LiDAR net (4 or 5 input channels), float32 training,
** odd user shapes.  So these are written to be obviously right, and only
** reasonably fast:
**   - forward and dgrad: output-stationary, one thread per output element
**     (lanes across output channels, so weight reads and output writes are
**     coalesced and the gathered row is a broadcast), loop over offsets and
**     reduction channels.  No atomics: deterministic.
**   - wgrad: one block per (element tile, offset, row chunk); each thread sums
**     its (c_in, c_out) element over the chunk's rows in row order, writes an
**     fp32 partial; tsp_conv_reduce_partials adds the chunks in index order.
**     Deterministic for a given problem size (conv_internal.cuh fixes the
**     chunking from the sizes alone).
*/
#include "conv_internal.cuh"
#include "conv_mma.cuh" /* tsp_store2 */

enum { SIMPLE_COLS = 32, SIMPLE_ROWS = 8, WGRAD_SIMPLE_THREADS = 256, REDUCE_THREADS = 256 };

/*
** out[r, j] = sum_k sum_c src[map[r, k], c] * W_k[c, j], W_k = w[k] ([red, n])
** or w[k]^T when transposed_w (w[k] stored [n, red]).
*/
template <typename T, bool TRANSPOSED_W>
__global__ void __launch_bounds__(SIMPLE_COLS *SIMPLE_ROWS)
    simple_os_kernel(const T *__restrict__ src, int64_t src_rows, const T *__restrict__ w,
                     const int32_t *__restrict__ map, int64_t rows, int volume, int64_t red,
                     int64_t n, T *__restrict__ out) {
  const int64_t col = (int64_t)blockIdx.x * SIMPLE_COLS + threadIdx.x;
  if (col >= n) return; /* no barriers in this kernel */
  for (int64_t r = (int64_t)blockIdx.y * SIMPLE_ROWS + threadIdx.y; r < rows;
       r += (int64_t)gridDim.y * SIMPLE_ROWS) {
    float acc = 0.0f;
    for (int k = 0; k < volume; ++k) {
      const int32_t p = map[r * volume + k];
      if (p < 0 || (int64_t)p >= src_rows) continue;
      const T *s = src + (int64_t)p * red;
      const T *wk = w + (int64_t)k * red * n;
      if (TRANSPOSED_W) {
        const T *wc = wk + col * red;
        for (int64_t c = 0; c < red; ++c) acc += tsp_to_float(s[c]) * tsp_to_float(wc[c]);
      } else {
        for (int64_t c = 0; c < red; ++c) acc += tsp_to_float(s[c]) * tsp_to_float(wk[c * n + col]);
      }
    }
    out[r * n + col] = tsp_from_float<T>(acc);
  }
}

template <typename T>
static tsp_status launch_simple_os(const void *src, int64_t src_rows, const void *w,
                                   const int32_t *map, int64_t rows, int64_t volume, int64_t red,
                                   int64_t n, int transposed_w, void *out, cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return TSP_OK;
  dim3 block(SIMPLE_COLS, SIMPLE_ROWS);
  int64_t gy = (rows + SIMPLE_ROWS - 1) / SIMPLE_ROWS;
  if (gy > 65535) gy = 65535;
  dim3 grid((unsigned)((n + SIMPLE_COLS - 1) / SIMPLE_COLS), (unsigned)gy);
  if (transposed_w)
    simple_os_kernel<T, true><<<grid, block, 0, stream>>>(
        (const T *)src, src_rows, (const T *)w, map, rows, (int)volume, red, n, (T *)out);
  else
    simple_os_kernel<T, false><<<grid, block, 0, stream>>>(
        (const T *)src, src_rows, (const T *)w, map, rows, (int)volume, red, n, (T *)out);
  return tsp_cuda_check_launch("tsp_conv_simple_os");
}

tsp_status tsp_conv_simple_os(tsp_dtype dtype, const void *src, int64_t src_rows,
                              const void *w, const int32_t *map, int64_t rows, int64_t volume,
                              int64_t red, int64_t n, int transposed_w, void *out,
                              cudaStream_t stream) {
  switch (dtype) {
  case TSP_FLOAT32:
    return launch_simple_os<float>(src, src_rows, w, map, rows, volume, red, n, transposed_w, out,
                                   stream);
  case TSP_FLOAT16:
    return launch_simple_os<__half>(src, src_rows, w, map, rows, volume, red, n, transposed_w,
                                    out, stream);
  case TSP_BFLOAT16:
    return launch_simple_os<__nv_bfloat16>(src, src_rows, w, map, rows, volume, red, n,
                                           transposed_w, out, stream);
  default:
    return TSP_ERR_UNSUPPORTED;
  }
}

/*
** One block per (tile of 256 (ci, co) elements, offset k, row chunk).  The map
** entry of a row is the same for the whole block (a broadcast load); dy reads
** are coalesced across co.
*/
template <typename T>
__global__ void __launch_bounds__(WGRAD_SIMPLE_THREADS)
    simple_wgrad_kernel(const T *__restrict__ x, int64_t n_in, const T *__restrict__ dy,
                        int64_t n_out, const int32_t *__restrict__ map, int volume, int64_t c_in,
                        int64_t c_out, int64_t rows_per_chunk, float *__restrict__ partials,
                        T *__restrict__ dw) {
  const int64_t count = c_in * c_out;
  const int64_t e = (int64_t)blockIdx.x * WGRAD_SIMPLE_THREADS + threadIdx.x;
  const int k = blockIdx.y;
  const int64_t chunk = blockIdx.z;
  if (e >= count) return;
  const int64_t ci = e / c_out, co = e - ci * c_out;
  const int64_t q0 = chunk * rows_per_chunk;
  const int64_t q1 = q0 + rows_per_chunk < n_out ? q0 + rows_per_chunk : n_out;
  float acc = 0.0f;
  for (int64_t q = q0; q < q1; ++q) {
    const int32_t p = map[q * volume + k];
    if (p < 0 || (int64_t)p >= n_in) continue;
    acc += tsp_to_float(x[(int64_t)p * c_in + ci]) * tsp_to_float(dy[q * c_out + co]);
  }
  if (partials)
    partials[(chunk * volume + k) * count + e] = acc;
  else
    dw[(int64_t)k * count + e] = tsp_from_float<T>(acc);
}

template <typename T>
static tsp_status launch_simple_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                      const int32_t *nbmap, void *dw, float *partials,
                                      cudaStream_t stream) {
  const int64_t rows = tsp_wgrad_rows_per_chunk(p), chunks = tsp_wgrad_chunks(p);
  const int64_t count = p->c_in * p->c_out;
  dim3 grid((unsigned)((count + WGRAD_SIMPLE_THREADS - 1) / WGRAD_SIMPLE_THREADS),
            (unsigned)p->volume, (unsigned)chunks);
  simple_wgrad_kernel<T><<<grid, WGRAD_SIMPLE_THREADS, 0, stream>>>(
      (const T *)x, p->n_in, (const T *)dy, p->n_out, nbmap, (int)p->volume, p->c_in, p->c_out,
      rows, chunks > 1 ? partials : NULL, (T *)dw);
  tsp_status s = tsp_cuda_check_launch("tsp_conv_simple_wgrad");
  if (s != TSP_OK || chunks == 1) return s;
  return tsp_conv_reduce_partials(p->dtype, partials, chunks, p->volume * count, dw, stream);
}

tsp_status tsp_conv_simple_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                 const int32_t *nbmap, void *dw, float *partials,
                                 cudaStream_t stream) {
  switch (p->dtype) {
  case TSP_FLOAT32:
    return launch_simple_wgrad<float>(p, x, dy, nbmap, dw, partials, stream);
  case TSP_FLOAT16:
    return launch_simple_wgrad<__half>(p, x, dy, nbmap, dw, partials, stream);
  case TSP_BFLOAT16:
    return launch_simple_wgrad<__nv_bfloat16>(p, x, dy, nbmap, dw, partials, stream);
  default:
    return TSP_ERR_UNSUPPORTED;
  }
}

/* Fixed-order sum over chunks: the same bits on every run.  W elements a
** thread, n = count / W groups of them.  W = 4: 16-byte loads of each chunk,
** and the four results stored as two pairs (partials 16-byte and dw 2-element
** aligned).  Why: one thread per element moved 4 bytes per load and per store;
** split-K's slabs (C = 256 at 0.8 m, two of 10600 x 256 fp32) took ~14 us this
** way on an H100, against ~9 for their bytes at 3 TB/s. */
template <typename T, int W>
__global__ void __launch_bounds__(REDUCE_THREADS)
    reduce_partials_kernel(const float *__restrict__ partials, int64_t chunks, int64_t n,
                           T *__restrict__ dw) {
  static_assert(W == 1 || W == 4, "scalar or float4");
  for (int64_t e = (int64_t)blockIdx.x * REDUCE_THREADS + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * REDUCE_THREADS) {
    float acc[W] = {}; /* from +0 at either width: the same bits */
    for (int64_t c = 0; c < chunks; ++c) {
      if constexpr (W == 4) {
        const float4 v = ((const float4 *)partials)[c * n + e];
        acc[0] += v.x, acc[1] += v.y, acc[2] += v.z, acc[3] += v.w;
      } else {
        acc[0] += partials[c * n + e];
      }
    }
    if constexpr (W == 4) {
      tsp_store2(dw + 4 * e, acc[0], acc[1]);
      tsp_store2(dw + 4 * e + 2, acc[2], acc[3]);
    } else {
      dw[e] = tsp_from_float<T>(acc[0]);
    }
  }
}

template <int W>
static tsp_status launch_reduce_partials(tsp_dtype dtype, const float *partials, int64_t chunks,
                                         int64_t count, void *dw, cudaStream_t stream) {
  const unsigned blocks = tsp_grid_blocks(count / W, REDUCE_THREADS);
  switch (dtype) {
  case TSP_FLOAT32:
    reduce_partials_kernel<float, W><<<blocks, REDUCE_THREADS, 0, stream>>>(partials, chunks, count / W,
                                                                            (float *)dw);
    break;
  case TSP_FLOAT16:
    reduce_partials_kernel<__half, W><<<blocks, REDUCE_THREADS, 0, stream>>>(partials, chunks, count / W,
                                                                             (__half *)dw);
    break;
  case TSP_BFLOAT16:
    reduce_partials_kernel<__nv_bfloat16, W><<<blocks, REDUCE_THREADS, 0, stream>>>(
        partials, chunks, count / W, (__nv_bfloat16 *)dw);
    break;
  default:
    return TSP_ERR_UNSUPPORTED;
  }
  return tsp_cuda_check_launch("tsp_conv_reduce_partials");
}

tsp_status tsp_conv_reduce_partials(tsp_dtype dtype, const float *partials, int64_t chunks,
                                    int64_t count, void *dw, cudaStream_t stream) {
  if (count <= 0) return TSP_OK;
  const size_t pair_bytes = dtype == TSP_FLOAT32 ? 8 : 4;
  /* four at a time only where count is a multiple of 4 and both ends aligned; else all scalar */
  if (chunks >= 1 && count % 4 == 0 && (uintptr_t)partials % 16 == 0 && (uintptr_t)dw % pair_bytes == 0 &&
      (dtype == TSP_FLOAT32 || dtype == TSP_FLOAT16 || dtype == TSP_BFLOAT16))
    return launch_reduce_partials<4>(dtype, partials, chunks, count, dw, stream);
  return launch_reduce_partials<1>(dtype, partials, chunks, count, dw, stream);
}
