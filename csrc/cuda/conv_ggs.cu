/*
** conv_ggs.cu: the two memory passes of gather-GEMM-scatter (dataflow 4,
** TorchSparse's adaptive grouping); the batched GEMMs between them are
** cuBLAS's, called by the shim through ATen (csrc/shim_ggs.cpp).
**
**   gather: every pair of the pass's map goes to one row of a dense buffer,
**           offset by offset (a "slot" per offset); the slots of a group of
**           offsets are padded to the group's largest pair count, so the
**           group is one [slots, rows, C] batch for one bmm;
**   reduce: each output row sums its pairs' GEMM rows, offset k in
**           increasing order with fp32 accumulation.  This is the scatter
**           made atomic-free: the gather records, per (row, offset), which
**           buffer row holds that pair (`where`, -1 for none), so the reduce
**           reads instead of adding into the output (deterministic, as every
**           torchsp dataflow).
**
** Why this dataflow at all: it turns a sparse conv into dense GEMMs that
** cuBLAS runs near the tensor-core peak with no wasted MACs beyond the
** padding, at the price of writing and reading the gathered and the
** multiplied rows through memory (2 x pairs x (c_in + c_out) x bytes per
** element).  It pays where the output-stationary kernels waste most (many
** distinct masks per tile) and the rows are few; torchsp's tuner measures it
** beside the others (torchsp/tune.py).
**
** Both kernels move raw words (16, 8, 4 or 2 bytes, the widest that the row
** length and the pointers allow), so the gather serves every dtype; the
** reduce converts fp16 / bf16 / fp32 elements to float.  Indices read from
** memory (pairs, map, where) are clamped: a plan of another map gives wrong
** sums, never an access out of bounds (as tsp_conv_problem.pairs).
*/
#include "conv_internal.cuh"

enum { GGS_THREADS = 256 };

/* --------------------------------------------------------------- gather --- */

/* Slot blockIdx.y: buffer rows [base, base + rows) x `words` words per row;
** row base + r is src row map[q, k] of pair q = pairs[start + r] for r < count
** (zero when absent), and zero up to `rows` (bmm reads padding; wgrad-style
** uses of the buffer need it zero, and zero keeps NaN out of rows no pair
** reads). */
template <typename W>
__global__ void __launch_bounds__(GGS_THREADS)
    ggs_gather_kernel(tsp_ggs_plan plan, const int32_t *__restrict__ pairs,
                      const int32_t *__restrict__ map, int64_t map_rows, int volume,
                      const W *__restrict__ src, int64_t src_rows, int64_t words,
                      W *__restrict__ buf, int32_t *__restrict__ where) {
  const tsp_ggs_slot s = plan.slot[blockIdx.y];
  const int64_t items = s.rows * words;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < items;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / words, c = i - r * words;
    W v{};
    if (r < s.count) {
      const int32_t q = pairs[s.start + r];
      if (q >= 0 && q < map_rows) {
        const int32_t p = map[(int64_t)q * volume + s.offset];
        if (p >= 0 && p < src_rows) {
          v = src[(int64_t)p * words + c];
          if (c == 0) where[(int64_t)q * volume + s.offset] = (int32_t)(s.base + r);
        }
      }
    }
    buf[(s.base + r) * words + c] = v;
  }
}

/* The widest word (16, 8, 4 or 2 bytes) that divides a row of `row_bytes`
** and both base addresses. */
static int ggs_word_bytes(int64_t row_bytes, const void *a, const void *b) {
  const uintptr_t al = (uintptr_t)a | (uintptr_t)b;
  for (int w = 16; w > 2; w /= 2)
    if (row_bytes % w == 0 && al % w == 0) return w;
  return 2;
}

template <typename W>
static void ggs_gather_launch(const tsp_ggs_plan *plan, int64_t max_rows, const int32_t *pairs,
                              const int32_t *map, int64_t map_rows, int volume, const void *src,
                              int64_t src_rows, int64_t words, void *buf, int32_t *where,
                              cudaStream_t stream) {
  const dim3 grid(tsp_grid_blocks(max_rows * words, GGS_THREADS), (unsigned)plan->n_slots);
  ggs_gather_kernel<W><<<grid, GGS_THREADS, 0, stream>>>(*plan, pairs, map, map_rows, volume,
                                                         (const W *)src, src_rows, words, (W *)buf,
                                                         where);
}

extern "C" tsp_status tsp_ggs_gather_cuda(const tsp_ggs_plan *plan, const int32_t *pairs,
                                          const int32_t *map, int64_t map_rows, int64_t volume,
                                          const void *src, int64_t src_rows, int64_t channels,
                                          tsp_dtype dtype, void *buf, int32_t *where,
                                          tsp_cuda_stream stream) {
  if (!plan || plan->n_slots < 0 || plan->n_slots > TSP_GGS_MAX_SLOTS || map_rows < 0 ||
      volume < 1 || volume > 0x7fffffffLL || channels < 1 || src_rows < 0 || dtype == TSP_FLOAT64)
    return TSP_ERR_ARGUMENT;
  cudaStream_t st = (cudaStream_t)stream;
  tsp_status s = tsp_cuda_check(
      cudaMemsetAsync(where, 0xff, (size_t)(map_rows * volume) * sizeof(int32_t), st),
      "ggs where memset");
  if (s != TSP_OK || plan->n_slots == 0) return s;
  int64_t max_rows = 0;
  for (int i = 0; i < plan->n_slots; ++i) {
    const tsp_ggs_slot *g = &plan->slot[i];
    if (g->count < 0 || g->rows < g->count || g->base < 0 || g->start < 0 || g->offset < 0 ||
        g->offset >= volume || g->base + g->rows > 0x7fffffffLL)
      return TSP_ERR_ARGUMENT;
    if (g->rows > max_rows) max_rows = g->rows;
  }
  if (max_rows == 0) return TSP_OK;
  const int64_t row_bytes = channels * (dtype == TSP_FLOAT32 ? 4 : 2);
  const int w = ggs_word_bytes(row_bytes, src, buf);
  const int64_t words = row_bytes / w;
  const int v = (int)volume;
  if (w == 16)
    ggs_gather_launch<uint4>(plan, max_rows, pairs, map, map_rows, v, src, src_rows, words, buf, where, st);
  else if (w == 8)
    ggs_gather_launch<uint2>(plan, max_rows, pairs, map, map_rows, v, src, src_rows, words, buf, where, st);
  else if (w == 4)
    ggs_gather_launch<uint32_t>(plan, max_rows, pairs, map, map_rows, v, src, src_rows, words, buf, where, st);
  else
    ggs_gather_launch<uint16_t>(plan, max_rows, pairs, map, map_rows, v, src, src_rows, words, buf, where, st);
  return tsp_cuda_check_launch("ggs gather");
}

/* --------------------------------------------------------------- reduce --- */

/* out[q, VEC c .. VEC c + VEC) = sum over k of buf[where[q, k], same
** channels], k increasing, fp32; one thread per (row, VEC channels). */
template <typename T, int VEC>
__global__ void __launch_bounds__(GGS_THREADS)
    ggs_reduce_kernel(const int32_t *__restrict__ where, int64_t rows, int volume,
                      const T *__restrict__ buf, int64_t buf_rows, int64_t channels,
                      T *__restrict__ out) {
  const int64_t vecs = channels / VEC, items = rows * vecs;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < items;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t q = i / vecs, c = (i - q * vecs) * VEC;
    float acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
    const int32_t *wq = where + q * volume;
    for (int k = 0; k < volume; ++k) {
      const int32_t j = wq[k];
      if (j < 0 || j >= buf_rows) continue;
      alignas(16) T v[VEC];
      if constexpr (VEC * sizeof(T) == 16) {
        *(uint4 *)v = *(const uint4 *)(buf + (int64_t)j * channels + c);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[e] = buf[(int64_t)j * channels + c + e];
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += tsp_to_float(v[e]);
    }
    alignas(16) T o[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] = tsp_from_float<T>(acc[e]);
    if constexpr (VEC * sizeof(T) == 16) {
      *(uint4 *)(out + q * channels + c) = *(const uint4 *)o;
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) out[q * channels + c + e] = o[e];
    }
  }
}

template <typename T>
static tsp_status ggs_reduce_typed(const int32_t *where, int64_t rows, int volume, const void *buf,
                                   int64_t buf_rows, int64_t channels, void *out, cudaStream_t st) {
  enum { WIDE = 16 / sizeof(T) };
  const bool wide = channels % WIDE == 0 && ((uintptr_t)buf | (uintptr_t)out) % 16 == 0;
  const int64_t items = rows * (wide ? channels / WIDE : channels);
  const unsigned blocks = tsp_grid_blocks(items, GGS_THREADS);
  if (wide)
    ggs_reduce_kernel<T, WIDE><<<blocks, GGS_THREADS, 0, st>>>(where, rows, volume, (const T *)buf,
                                                             buf_rows, channels, (T *)out);
  else
    ggs_reduce_kernel<T, 1><<<blocks, GGS_THREADS, 0, st>>>(where, rows, volume, (const T *)buf,
                                                          buf_rows, channels, (T *)out);
  return tsp_cuda_check_launch("ggs reduce");
}

extern "C" tsp_status tsp_ggs_reduce_cuda(const int32_t *where, int64_t rows, int64_t volume,
                                          const void *buf, int64_t buf_rows, int64_t channels,
                                          tsp_dtype dtype, void *out, tsp_cuda_stream stream) {
  if (rows < 0 || volume < 1 || volume > 0x7fffffffLL || channels < 1 || buf_rows < 0)
    return TSP_ERR_ARGUMENT;
  if (rows == 0) return TSP_OK;
  cudaStream_t st = (cudaStream_t)stream;
  const int v = (int)volume;
  switch (dtype) {
    case TSP_FLOAT32: return ggs_reduce_typed<float>(where, rows, v, buf, buf_rows, channels, out, st);
    case TSP_FLOAT16: return ggs_reduce_typed<__half>(where, rows, v, buf, buf_rows, channels, out, st);
    case TSP_BFLOAT16:
      return ggs_reduce_typed<__nv_bfloat16>(where, rows, v, buf, buf_rows, channels, out, st);
    default: return TSP_ERR_UNSUPPORTED;
  }
}
