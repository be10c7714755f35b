/*
** conv_wgmma_wgrad.cu: the weight gradient on Hopper's wgmma (sm_90a),
** fp16/bf16 with fp32 accumulation, deterministic.  Same problem, chunking
** and pair lists as conv_wgrad.cu (mma.sync):
**   dw[k] = sum over present pairs (p, q) of map column k of x[p]^T dy[q],
** each block owning (row chunk, offset k, c_in tile, c_out tile), pairs
** compacted in row order (conv_wgrad_pairs.cuh), chunks reduced in order.
**
** Why: the mma.sync kernel ran at 15-20% of the tensor peak (H100, lidar_198k
** at 0.1 m: C = 128 217 us, C = 256 673 us for 25.8 and 103 GFLOP), the
** slowest pass of a training step at C >= 128.
**
** The reduction runs over pairs and a gathered row holds its channels
** contiguously, so both operands are MN-major in shared memory (wgmma
** imm-trans-a = imm-trans-b = 1), which a 16-byte cp.async per 8 channels
** fills directly: A = the slab's x rows (BK pairs x BM channels of c_in), B
** = its dy rows (BK pairs x BN channels of c_out).  Each operand is stored as
** 64-channel blocks of BK rows x 128 bytes, 128-byte swizzle (pair r's
** 16-byte chunk c at chunk c ^ (r % 8); wg_desc_sw128_mn): a warp's copies
** read 4 whole 128-byte row segments and write shared memory without bank
** conflicts.  Warpgroup g multiplies c_in rows [64 g, 64 g + 64) of the tile
** by all BN columns: BK / 16 wgmma m64nBNk16 per slab, one slab kept in
** flight while the next barrier and copies are issued (stages run
** STAGES - 2 slabs ahead, as conv_wgmma.cu's PIPE).
**
** Tiles (algo.tile of the wgrad pass; conv.cu resolves 0):
**   12: 128 x 128 (two warpgroups), 6 stages;
**   13: 64 x 64 (one warpgroup), 4 stages;
**   15: 128 x 256 (two warpgroups, m64n256), 4 stages.
** Only compiled for sm_90a (TSP_WGMMA); elsewhere tsp_conv_wgmma_wgrad
** answers TSP_ERR_UNSUPPORTED and conv.cu runs conv_wgrad.cu.
*/
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TSP_WGMMA_DEVICE 1
#endif

#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_wgrad_pairs.cuh"
#include "conv_wgmma_util.cuh"

#ifdef TSP_WGMMA /* the kernels exist in sm_90a builds only */

/* WW_BK: pairs per slab (64 channels x 64 pairs = one 8 KB block). */
enum { WW_BK = 64 };

/* The pair list of a tile of WGS warpgroups: (pairs, map rows per thread per
** compaction round).  Two warpgroups take 4096 x 16 instead of conv_wgrad.cu's
** 2048 x 4: a block for a sparse offset scans ~8 rows per pair with the
** pipeline drained (H100, lidar_198k: C = 128 214 -> 206 us, C = 256 551 ->
** 531); one warpgroup keeps 2048 x 4 (C = 64: 122 us, 141 with 4096 x 16). */
template <int WGS> struct ww_list {
  enum { LIST = WGS == 1 ? WG_LIST : 4096, ROWS = WGS == 1 ? WG_ROWS : 16 };
};

template <int WGS, int BN, int STAGES> static size_t wgmma_wgrad_smem_bytes() {
  return 1024 + (size_t)STAGES * WW_BK * (64 * WGS + BN) * 2 +
         tsp_wgrad_list_bytes(4 * WGS, ww_list<WGS>::LIST, ww_list<WGS>::ROWS);
}

/* Copies rows [slab * BK, slab * BK + BK) of the pair list (`rows`: s_p or
** s_q) of src [., ld] channels [c0, c0 + W) into dst in the layout of the
** file header; rows past `count` and channels past `ld` are zero. */
template <typename T, int W, int NT>
static __device__ __forceinline__ void ww_load(T *dst, const T *__restrict__ src, int ld, int c0,
                                               const int32_t *rows, int slab, int count) {
  enum { CHUNKS = W / 8, PER = WW_BK * CHUNKS / NT };
  static_assert(PER * NT == WW_BK * CHUNKS, "whole copies per thread");
#pragma unroll
  for (int it = 0; it < PER; ++it) {
    const int i = threadIdx.x + it * NT;
    const int r = i / CHUNKS, c = i % CHUNKS, j = slab * WW_BK + r, ch = c0 + c * 8;
    const bool valid = j < count && ch < ld;
    T *d = dst + (c >> 3) * (WW_BK * 64) + r * 64 + ((c ^ r) & 7) * 8;
    tsp_cp_async16(d, valid ? src + (int64_t)rows[j] * ld + ch : src, valid);
  }
}

template <typename T, int WGS, int BN, int STAGES>
__global__ void __launch_bounds__(128 * WGS, 1)
    wgmma_wgrad_kernel(const T *__restrict__ x, int64_t n_in, const T *__restrict__ dy,
                       int64_t n_out, const int32_t *__restrict__ map, int volume, int c_in,
                       int c_out, int64_t rows_per_chunk, float *__restrict__ partials,
                       T *__restrict__ dw) {
  enum { BM = 64 * WGS, NT = 128 * WGS, BK = WW_BK, ACC = BN / 2, AHEAD = STAGES - 2 };
  enum { A_STAGE = BK * BM, B_STAGE = BK * BN, BLOCK = BK * 64 };
  enum { LIST = ww_list<WGS>::LIST, ROWS = ww_list<WGS>::ROWS };
  static_assert(AHEAD >= 1, "one slab in flight needs at least 3 stages");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T *s_a = (T *)(smem_raw + ((1024 - (tsp_smem_addr(smem_raw) & 1023)) & 1023));
  T *s_b = s_a + STAGES * A_STAGE;
  int32_t *s_p = (int32_t *)(s_b + STAGES * B_STAGE);
  int32_t *s_q = s_p + LIST;
  int32_t *s_warp = s_q + LIST;

  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, wwarp = (tid >> 5) & 3;
  const tsp_wgrad_block blk = tsp_wgrad_block_at(BM, BN, c_in, c_out, volume, rows_per_chunk, n_out);

  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.0f;

  int64_t scan = blk.q0;
  while (scan < blk.q1) { /* block-uniform */
    const int count = tsp_wgrad_compact<NT, LIST, ROWS>(map, volume, blk.k, n_in, &scan, blk.q1, s_p, s_q, s_warp);
    const int slabs = (count + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
      if (s < slabs) {
        ww_load<T, BM, NT>(s_a + s * A_STAGE, x, c_in, blk.m0, s_p, s, count);
        ww_load<T, BN, NT>(s_b + s * B_STAGE, dy, c_out, blk.n0, s_q, s, count);
      }
      tsp_cp_async_commit();
    }
    for (int slab = 0; slab < slabs; ++slab) {
      tsp_cp_async_wait<AHEAD - 1>();
      proxy_fence();
      __syncthreads(); /* slab's stage landed for all; the stage loaded next is free */
      const int next = slab + AHEAD;
      if (next < slabs) {
        ww_load<T, BM, NT>(s_a + (next % STAGES) * A_STAGE, x, c_in, blk.m0, s_p, next, count);
        ww_load<T, BN, NT>(s_b + (next % STAGES) * B_STAGE, dy, c_out, blk.n0, s_q, next, count);
      }
      tsp_cp_async_commit();
      const T *a_s = s_a + (slab % STAGES) * A_STAGE + wg * BLOCK;
      const T *b_s = s_b + (slab % STAGES) * B_STAGE;
      acc_fence(acc);
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks)
        wg_op<BN>::template run_tt<T>(acc, wg_desc_sw128_mn(a_s + ks * 16 * 64, BLOCK * 2),
                                      wg_desc_sw128_mn(b_s + ks * 16 * 64, BLOCK * 2));
      wg_commit();
      /* This slab's stage is overwritten AHEAD slabs later, after a barrier. */
      wg_wait<1>();
      acc_fence(acc);
    }
    wg_wait<0>();
    acc_fence(acc);
    tsp_cp_async_wait<0>();
    __syncthreads(); /* stages and list are reused by the next batch */
  }

  /* Epilogue: accumulator layout of conv_wgmma_ops.cuh; rows are c_in, columns c_out. */
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = blk.n0 + j * 8 + (lane & 3) * 2;
    if (col >= c_out) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = blk.m0 + wg * 64 + wwarp * 16 + (lane >> 2) + h * 8;
      if (m < c_in)
        tsp_wgrad_store2(partials, dw, blk.chunk, volume, blk.k, c_in, c_out, m, col,
                         acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
}

template <typename T, int WGS, int BN, int STAGES>
static tsp_status launch_wgmma_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                     const int32_t *nbmap, void *dw, float *partials,
                                     cudaStream_t stream) {
  const int64_t rows = tsp_wgrad_rows_per_chunk(p), chunks = tsp_wgrad_chunks(p);
  const size_t smem = wgmma_wgrad_smem_bytes<WGS, BN, STAGES>();
  static uint64_t smem_raised = 0; /* per instantiation: devices whose limit is raised */
  tsp_status s = tsp_raise_smem_limit((const void *)wgmma_wgrad_kernel<T, WGS, BN, STAGES>, smem,
                                      &smem_raised, "tsp_conv_wgmma_wgrad");
  if (s != TSP_OK) return s;
  const int64_t blocks = chunks * p->volume * ((p->c_in + 64 * WGS - 1) / (64 * WGS)) *
                         ((p->c_out + BN - 1) / BN);
  if (blocks > 0x7fffffffLL) return TSP_ERR_UNSUPPORTED;
  wgmma_wgrad_kernel<T, WGS, BN, STAGES><<<(unsigned)blocks, 128 * WGS, smem, stream>>>(
      (const T *)x, p->n_in, (const T *)dy, p->n_out, nbmap, (int)p->volume, (int)p->c_in,
      (int)p->c_out, rows, chunks > 1 ? partials : NULL, (T *)dw);
  s = tsp_cuda_check_launch("tsp_conv_wgmma_wgrad");
  if (s != TSP_OK || chunks == 1) return s;
  return tsp_conv_reduce_partials(p->dtype, partials, chunks, p->volume * p->c_in * p->c_out, dw,
                                  stream);
}

template <typename T>
static tsp_status dispatch_wgmma_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                       const int32_t *nbmap, void *dw, float *partials, int tile,
                                       cudaStream_t stream) {
  switch (tile) {
  case 13:
    return launch_wgmma_wgrad<T, 1, 64, 4>(p, x, dy, nbmap, dw, partials, stream);
  case 15:
    return launch_wgmma_wgrad<T, 2, 256, 4>(p, x, dy, nbmap, dw, partials, stream);
  default: /* 12 */
    return launch_wgmma_wgrad<T, 2, 128, 6>(p, x, dy, nbmap, dw, partials, stream);
  }
}

#endif /* TSP_WGMMA */

tsp_status tsp_conv_wgmma_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                const int32_t *nbmap, void *dw, float *partials, int tile,
                                cudaStream_t stream) {
#ifndef TSP_WGMMA
  (void)p, (void)x, (void)dy, (void)nbmap, (void)dw, (void)partials, (void)tile, (void)stream;
  return TSP_ERR_UNSUPPORTED;
#else
  if (tile != 12 && tile != 13 && tile != 15) return TSP_ERR_UNSUPPORTED;
  if (p->dtype != TSP_FLOAT16 && p->dtype != TSP_BFLOAT16) return TSP_ERR_UNSUPPORTED;
  /* 16-byte copies of 8 channels; dw takes two adjacent elements per store. */
  if (p->c_in % 8 != 0 || p->c_out % 8 != 0 || p->c_in <= 0 || p->c_out <= 0 ||
      p->c_in > 0x7fffffff || p->c_out > 0x7fffffff || p->n_out >= 0x7fffffffLL)
    return TSP_ERR_UNSUPPORTED;
  if (((uintptr_t)x | (uintptr_t)dy) % 16 != 0 || (uintptr_t)dw % 4 != 0 ||
      (uintptr_t)partials % 8 != 0)
    return TSP_ERR_UNSUPPORTED;
  if (tsp_device_cc() != 90) return TSP_ERR_UNSUPPORTED; /* sm_90a code runs on sm_90 only */
  if (p->dtype == TSP_FLOAT16)
    return dispatch_wgmma_wgrad<__half>(p, x, dy, nbmap, dw, partials, tile, stream);
  return dispatch_wgmma_wgrad<__nv_bfloat16>(p, x, dy, nbmap, dw, partials, tile, stream);
#endif
}
