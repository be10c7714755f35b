/*
** conv_wgrad.cu: weight gradient on tensor cores, fp16/bf16, or float32 in
** tf32 (algo.tile == TSP_TILE_TF32, conv.cu), fp32 accumulation,
** deterministic.  dW_k = X[nbmap[:, k]]^T dY over the rows q with nbmap[q, k]
** present: a GEMM of M = c_in, N = c_out and a reduction over rows.
**
** Rows are the reduction dimension, so absent pairs can simply be left out:
** each block (row chunk, offset k, c_in tile, c_out tile) scans its chunk's
** map column k, compacts the present (p, q) pairs into a shared-memory list
** (warp ballots, in row order, so the summation order is fixed), then runs a
** cp.async pipeline over slabs of 32 pairs: A = the 32 gathered x rows
** (stored pair-major, so A fragments come through ldmatrix.trans), B = the 32
** dy rows.  No zero rows are multiplied, unlike a dense formulation, which at
** ~3.5 of 27 offsets per row would do ~8x the work.
**
** float32 runs the same kernel: a 16-byte copy moves 4 floats instead of 8
** halves (channels multiples of 4), and a slab's fragments come from 32-bit
** shared loads rounded to tf32 for mma.sync m16n8k8 (ldmatrix moves 16-bit
** units); the pitches BM + 8 and BN + 8 (in elements) that keep ldmatrix
** conflict free keep those loads conflict free too (rows t of a fragment
** start t * 8 words apart mod 32, lanes g add 0..7).
**
** On sm_90a builds fp16/bf16 wgrad with both channel counts >= 32 runs
** conv_wgmma_wgrad.cu instead (same chunks, pair lists and partials); this
** kernel stays for smaller channel counts, tf32 and other GPUs.
**
** Chunks (conv_internal.cuh) write fp32 partials [chunks, V, c_in, c_out] to
** the workspace and tsp_conv_reduce_partials adds them in chunk order; with
** one chunk the block writes dw itself.  The map column is read with a stride
** of V ints (one 32-byte sector per row per offset, so ~8x the map's size in
** L2 traffic, ~15 us at 173k rows); a per-offset pair list built once would
** remove that, at the cost of a map-sized workspace.
*/
#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_wgrad_pairs.cuh"

enum { WG_BK = 32, WG_STAGES = 4 };

template <int BM_, int BN_, int WM_, int WN_> struct wgrad_cfg {
  enum {
    BM = BM_, BN = BN_, WM = WM_, WN = WN_,
    WARPS_N = BN / WN, WARPS = (BM / WM) * (BN / WN), THREADS = WARPS * 32,
    MI = WM / 16, NI = WN / 8,
    A_LD = BM + 8, A_STAGE = WG_BK * A_LD, B_LD = BN + 8, B_STAGE = WG_BK * B_LD,
  };
};

template <typename T, typename CFG> static size_t wgrad_smem_bytes() {
  return (size_t)WG_STAGES * (CFG::A_STAGE + CFG::B_STAGE) * sizeof(T) +
         tsp_wgrad_list_bytes(CFG::WARPS, WG_LIST, WG_ROWS);
}

/* One slab's products, acc += A B with A = the slab's x rows (stored
** pair-major, [WG_BK][A_LD]) transposed and B = its dy rows ([WG_BK][B_LD]),
** for the warp's WM x WN block at (wm0, wn0).  16-bit elements: ldmatrix and
** m16n8k16. */
template <typename CFG, typename T>
static __device__ __forceinline__ void wgrad_slab_mma(float (&acc)[CFG::MI][CFG::NI][4],
                                                      const T *a_s, const T *b_s, int lane,
                                                      int wm0, int wn0) {
  enum { MI = CFG::MI, NI = CFG::NI, A_LD = CFG::A_LD, B_LD = CFG::B_LD };
  static_assert(NI % 2 == 0, "B fragments are loaded two n8 blocks at a time");
#pragma unroll
  for (int ks = 0; ks < WG_BK / 16; ++ks) {
    /* A (m x pairs) is stored pair-major: matrix j of the x4 is
    ** (m block j & 1, pair block j >> 1), read transposed. */
    uint32_t af[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
      tsp_ldmatrix_x4_trans(af[mi], a_s + (ks * 16 + (lane & 7) + (lane >> 4) * 8) * A_LD +
                                        wm0 + mi * 16 + ((lane >> 3) & 1) * 8);
    uint32_t bf[NI][2];
#pragma unroll
    for (int nj = 0; nj < NI / 2; ++nj) {
      uint32_t r[4];
      tsp_ldmatrix_x4_trans(r, b_s + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * B_LD +
                                   wn0 + nj * 16 + (lane >> 4) * 8);
      bf[2 * nj][0] = r[0];
      bf[2 * nj][1] = r[1];
      bf[2 * nj + 1][0] = r[2];
      bf[2 * nj + 1][1] = r[3];
    }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) tsp_mma16816(acc[mi][ni], af[mi], bf[ni], T());
  }
}

/* The same for float32: 32-bit shared loads rounded to tf32, m16n8k8.
** A (m x pairs) at a_s[pair][m]: a0 (m g, pair t), a1 m + 8, a2 pair + 4;
** B (pairs x n) at b_s[pair][n]: b0 (pair t, n g), b1 pair + 4. */
template <typename CFG>
static __device__ __forceinline__ void wgrad_slab_mma(float (&acc)[CFG::MI][CFG::NI][4],
                                                      const float *a_s, const float *b_s,
                                                      int lane, int wm0, int wn0) {
  enum { MI = CFG::MI, NI = CFG::NI, A_LD = CFG::A_LD, B_LD = CFG::B_LD };
  static_assert(A_LD % 16 == 8 && B_LD % 16 == 8, "fragment rows t start 8 banks apart");
  const int g = lane >> 2, t = lane & 3;
  /* Two k8 steps at a time: fully unrolled, ptxas (CUDA 13.0) hoisted every
  ** step's fragment loads and spilled a register of the 64 x 64 tile. */
#pragma unroll 2
  for (int ks = 0; ks < WG_BK / 8; ++ks) {
    uint32_t af[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      const float *a = a_s + (ks * 8 + t) * A_LD + wm0 + mi * 16 + g;
      af[mi][0] = tsp_to_tf32(a[0]);
      af[mi][1] = tsp_to_tf32(a[8]);
      af[mi][2] = tsp_to_tf32(a[4 * A_LD]);
      af[mi][3] = tsp_to_tf32(a[4 * A_LD + 8]);
    }
    uint32_t bf[NI][2];
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const float *b = b_s + (ks * 8 + t) * B_LD + wn0 + ni * 8 + g;
      bf[ni][0] = tsp_to_tf32(b[0]);
      bf[ni][1] = tsp_to_tf32(b[4 * B_LD]);
    }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) tsp_mma1688_tf32(acc[mi][ni], af[mi], bf[ni]);
  }
}

template <typename T, typename CFG>
__global__ void __launch_bounds__(CFG::THREADS)
    mma_wgrad_kernel(const T *__restrict__ x, int64_t n_in, const T *__restrict__ dy,
                     int64_t n_out, const int32_t *__restrict__ map, int volume, int c_in,
                     int c_out, int64_t rows_per_chunk, float *__restrict__ partials,
                     T *__restrict__ dw) {
  enum { BM = CFG::BM, BN = CFG::BN, NT = CFG::THREADS, MI = CFG::MI, NI = CFG::NI };
  enum { A_LD = CFG::A_LD, B_LD = CFG::B_LD, STAGES = WG_STAGES, BK = WG_BK };
  enum { VEC = 16 / (int)sizeof(T) }; /* elements per 16-byte copy */

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *s_a = (T *)smem_raw;
  T *s_b = s_a + STAGES * CFG::A_STAGE;
  int32_t *s_p = (int32_t *)(s_b + STAGES * CFG::B_STAGE);
  int32_t *s_q = s_p + WG_LIST;
  int32_t *s_warp = s_q + WG_LIST;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const tsp_wgrad_block blk = tsp_wgrad_block_at(BM, BN, c_in, c_out, volume, rows_per_chunk, n_out);
  const int n0 = blk.n0, m0 = blk.m0, k = blk.k;

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;

  const int warp_m = warp / CFG::WARPS_N, warp_n = warp % CFG::WARPS_N;
  const int wm0 = warp_m * CFG::WM, wn0 = warp_n * CFG::WN;

  int64_t scan = blk.q0;
  while (scan < blk.q1) { /* block-uniform */
    const int count = tsp_wgrad_compact<NT, WG_LIST, WG_ROWS>(map, volume, k, n_in, &scan, blk.q1, s_p, s_q, s_warp);
    const int slabs = (count + BK - 1) / BK;
    auto load_slab = [&](int slab, int stage) {
      T *a_dst = s_a + stage * CFG::A_STAGE;
#pragma unroll
      for (int it = 0; it < (BK * (BM / VEC) + NT - 1) / NT; ++it) {
        const int i = tid + it * NT;
        if (i >= BK * (BM / VEC)) break;
        const int r = i / (BM / VEC), c = m0 + (i % (BM / VEC)) * VEC, j = slab * BK + r;
        const bool valid = j < count && c < c_in;
        const T *g = valid ? x + (int64_t)s_p[j] * c_in + c : x;
        tsp_cp_async16(a_dst + r * A_LD + (i % (BM / VEC)) * VEC, g, valid);
      }
      T *b_dst = s_b + stage * CFG::B_STAGE;
#pragma unroll
      for (int it = 0; it < (BK * (BN / VEC) + NT - 1) / NT; ++it) {
        const int i = tid + it * NT;
        if (i >= BK * (BN / VEC)) break;
        const int r = i / (BN / VEC), c = n0 + (i % (BN / VEC)) * VEC, j = slab * BK + r;
        const bool valid = j < count && c < c_out;
        const T *g = valid ? dy + (int64_t)s_q[j] * c_out + c : dy;
        tsp_cp_async16(b_dst + r * B_LD + (i % (BN / VEC)) * VEC, g, valid);
      }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < slabs) load_slab(s, s);
      tsp_cp_async_commit();
    }
    for (int slab = 0; slab < slabs; ++slab) {
      tsp_cp_async_wait<STAGES - 2>();
      __syncthreads();
      if (slab + STAGES - 1 < slabs) load_slab(slab + STAGES - 1, (slab + STAGES - 1) % STAGES);
      tsp_cp_async_commit();
      wgrad_slab_mma<CFG>(acc, s_a + (slab % STAGES) * CFG::A_STAGE,
                          s_b + (slab % STAGES) * CFG::B_STAGE, lane, wm0, wn0);
    }
    tsp_cp_async_wait<0>();
    __syncthreads(); /* stages and list are reused by the next batch */
  }

#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const int col = n0 + wn0 + ni * 8 + (lane & 3) * 2;
      if (col >= c_out) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + wm0 + mi * 16 + (lane >> 2) + h * 8;
        if (m < c_in)
          tsp_wgrad_store2(partials, dw, blk.chunk, volume, k, c_in, c_out, m, col,
                           acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
      }
    }
}

template <typename T, typename CFG>
static tsp_status launch_mma_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                   const int32_t *nbmap, void *dw, float *partials,
                                   cudaStream_t stream) {
  const int64_t rows = tsp_wgrad_rows_per_chunk(p), chunks = tsp_wgrad_chunks(p);
  const size_t smem = wgrad_smem_bytes<T, CFG>();
  static uint64_t smem_raised = 0; /* per instantiation: devices whose limit is raised */
  tsp_status s = tsp_raise_smem_limit((const void *)mma_wgrad_kernel<T, CFG>, smem, &smem_raised,
                                      "tsp_conv_mma_wgrad");
  if (s != TSP_OK) return s;
  const int64_t blocks = chunks * p->volume * ((p->c_in + CFG::BM - 1) / CFG::BM) *
                         ((p->c_out + CFG::BN - 1) / CFG::BN);
  if (blocks > 0x7fffffffLL) return TSP_ERR_UNSUPPORTED;
  mma_wgrad_kernel<T, CFG><<<(unsigned)blocks, CFG::THREADS, smem, stream>>>(
      (const T *)x, p->n_in, (const T *)dy, p->n_out, nbmap, (int)p->volume, (int)p->c_in,
      (int)p->c_out, rows, chunks > 1 ? partials : NULL, (T *)dw);
  s = tsp_cuda_check_launch("tsp_conv_mma_wgrad");
  if (s != TSP_OK || chunks == 1) return s;
  return tsp_conv_reduce_partials(p->dtype, partials, chunks, p->volume * p->c_in * p->c_out, dw,
                                  stream);
}

template <typename T>
static tsp_status dispatch_mma_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                     const int32_t *nbmap, void *dw, float *partials,
                                     cudaStream_t stream) {
  /* The chunking assumed this tile (tsp_wgrad_rows_per_chunk); float keeps 64 x 64. */
  if constexpr (sizeof(T) == 2)
    if (tsp_wgrad_tile(p) == 128)
      return launch_mma_wgrad<T, wgrad_cfg<128, 128, 64, 32> >(p, x, dy, nbmap, dw, partials, stream);
  if (p->c_in <= 32 && p->c_out <= 32)
    return launch_mma_wgrad<T, wgrad_cfg<32, 32, 16, 16> >(p, x, dy, nbmap, dw, partials, stream);
  return launch_mma_wgrad<T, wgrad_cfg<64, 64, 32, 32> >(p, x, dy, nbmap, dw, partials, stream);
}

tsp_status tsp_conv_mma_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                              const int32_t *nbmap, void *dw, float *partials,
                              cudaStream_t stream) {
  /* A 16-byte copy holds `vec` channels; dw takes two adjacent elements per store. */
  const int64_t vec = p->dtype == TSP_FLOAT32 ? 4 : 8;
  const uintptr_t pair_bytes = p->dtype == TSP_FLOAT32 ? 8 : 4;
  if (p->c_in % vec != 0 || p->c_out % vec != 0 || p->c_in <= 0 || p->c_out <= 0 ||
      p->c_in > 0x7fffffff || p->c_out > 0x7fffffff || p->n_out >= 0x7fffffffLL)
    return TSP_ERR_UNSUPPORTED;
  if (((uintptr_t)x | (uintptr_t)dy) % 16 != 0 || (uintptr_t)dw % pair_bytes != 0 ||
      (uintptr_t)partials % 8 != 0)
    return TSP_ERR_UNSUPPORTED;
  switch (p->dtype) {
  case TSP_FLOAT32: /* tf32: conv.cu calls with float32 only for algo.tile == TSP_TILE_TF32 */
    return dispatch_mma_wgrad<float>(p, x, dy, nbmap, dw, partials, stream);
  case TSP_FLOAT16:
    return dispatch_mma_wgrad<__half>(p, x, dy, nbmap, dw, partials, stream);
  case TSP_BFLOAT16:
    return dispatch_mma_wgrad<__nv_bfloat16>(p, x, dy, nbmap, dw, partials, stream);
  default:
    return TSP_ERR_UNSUPPORTED;
  }
}
