/*
** conv_wgmma_ws.cu: the output-stationary forward and dgrad of
** conv_wgmma.cu, warp-specialized (algo.tile 14 and 15; sm_90a, fp16/bf16,
** fp32 accumulation).  Same problem, map handling, row order and result:
** out[r] = sum_k src[map[r, k]] @ W_k.
**
** Why: in conv_wgmma.cu every warp both copies and multiplies, so a step's
** loads are issued only after the block-wide barrier that ends the step
** before, and at one 225 KB block per SM nothing else hides that latency
** (ncu, C = 256, tile 12: L2 22% busy, issue slots 33%, 790 us for ~6x the
** floor).  Here producer warps only copy and two consumer warpgroups only
** multiply; they meet at per-stage mbarriers, so copies run up to STAGES
** steps ahead and no barrier spans the block inside the main loop.
**
** One block: BM = 128 output rows x BN columns; warps 0-7 are the consumer
** warpgroups (warpgroup g owns rows [64 g, 64 g + 64)), warps 8.. the PW
** producer warps.  After the tile's map rows and used offsets are in shared
** memory (conv_tile.cuh, all threads), the producers walk the (offset,
** 64-channel chunk) steps:
**   - A, the gathered rows: 16-byte cp.async per (row, chunk), zero-filled
**     for absent neighbours, in the 128-byte swizzled layout (wg_desc_sw128),
**     rows of a 64-row block no row of which uses the offset not copied;
**     each producer thread's copies arrive on the stage's `full` barrier when
**     they land (cp.async.mbarrier.arrive.noinc);
**   - B, the weights: one bulk copy (cp.async.bulk, the copy engine) of a
**     stage image prepared by ws_image_kernel in the workspace, already
**     K-major, swizzled and zero-padded, so no thread computes B addresses.
** A consumer warpgroup waits for `full`, issues 4 wgmma (k16 each) unless
** none of its 64 rows uses the step's offset, keeps one step in flight
** (wgmma.wait_group 1) and then frees the previous step's stage (`empty`).
** Every consumer waits on every stage even when it skips the step: an
** mbarrier phase must not be arrived at twice by one warpgroup.
*/
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TSP_WGMMA_DEVICE 1
#endif

#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_tile.cuh"
#include "conv_wgmma_util.cuh"

#ifdef TSP_WGMMA /* the kernels exist in sm_90a builds only */

/* ------------------------------------------------ mbarrier and copies --- */

static __device__ __forceinline__ void mb_init(uint64_t *bar, uint32_t count) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tsp_smem_addr(bar)), "r"(count)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  (void)bar, (void)count;
#endif
}

/* Spin until the phase with this parity has completed. */
static __device__ __forceinline__ void mb_wait(uint64_t *bar, uint32_t parity) {
#ifdef TSP_WGMMA_DEVICE
  const uint32_t addr = tsp_smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
#else
  (void)bar, (void)parity;
#endif
}

static __device__ __forceinline__ void mb_arrive(uint64_t *bar) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(tsp_smem_addr(bar)) : "memory");
#else
  (void)bar;
#endif
}

/* One arrival that also announces `bytes` of bulk copies completing on bar. */
static __device__ __forceinline__ void mb_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(tsp_smem_addr(bar)),
               "r"(bytes)
               : "memory");
#else
  (void)bar, (void)bytes;
#endif
}

/* Arrive on bar once all of this thread's earlier cp.async have landed (the
** arrival is one of those counted at init: .noinc). */
static __device__ __forceinline__ void mb_arrive_cp_async(uint64_t *bar) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(tsp_smem_addr(bar))
               : "memory");
#else
  (void)bar;
#endif
}

/* Global -> shared bulk copy (16-byte aligned, bytes % 16 == 0) completing on bar. */
static __device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes,
                                                 uint64_t *bar) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          tsp_smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(tsp_smem_addr(bar))
      : "memory");
#else
  (void)dst, (void)src, (void)bytes, (void)bar;
#endif
}

/* 16-byte cp.async that writes zeros when !valid (source size 0): every
** write of a stage is then a cp.async that the stage's barrier tracks. */
static __device__ __forceinline__ void cp_async16_zfill(void *dst, const void *src, bool valid) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tsp_smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  (void)dst, (void)src, (void)valid;
#endif
}

/* ------------------------------------------------------------ kernel --- */

enum { WS_BM = 128, WS_BK = 64, WS_CONSUMERS = 256, WS_STAGES = 4 };

/* Columns per block for n produced channels (both tiles); the weight image is laid out for it. */
static int ws_bn(int64_t n) { return n <= 64 ? 64 : n <= 128 ? 128 : 256; }

static size_t ws_smem_bytes(int bn, int stages, int volume) {
  return 1024 /* stage alignment */ + (size_t)stages * (WS_BM + bn) * WS_BK * 2 +
         (size_t)stages * 16 /* full, empty */ + tsp_tile_smem_bytes(WS_BM, volume);
}

/* src [src_rows, red]; wimg: ws_image_kernel's stage images; out [rows, n]. */
template <typename T, int BN, int STAGES, int PW, int MINB>
__global__ void __launch_bounds__(WS_CONSUMERS + 32 * PW, MINB)
    wgmma_ws_kernel(const T *__restrict__ src, int64_t src_rows, const T *__restrict__ wimg,
                    const int32_t *__restrict__ map, const int32_t *__restrict__ order,
                    int64_t rows, int64_t tile_rows, uint64_t offsets, int volume, int red,
                    int n, T *__restrict__ out, float *__restrict__ accum, int mode) {
  enum { BM = WS_BM, BK = WS_BK, PT = 32 * PW, NT = WS_CONSUMERS + PT };
  enum { A_STAGE = BM * BK, B_STAGE = BN * BK, ACC = BN / 2 };
  static_assert(BM * BK / 8 % PT == 0, "producer threads split a stage's copies evenly");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T *s_a = (T *)(smem_raw + ((1024 - (tsp_smem_addr(smem_raw) & 1023)) & 1023));
  T *s_b = s_a + STAGES * A_STAGE; /* stages are multiples of 1024 bytes */
  uint64_t *full = (uint64_t *)(s_b + STAGES * B_STAGE), *empty = full + STAGES;
  const tsp_tile_smem tile = tsp_tile_smem_at(empty + STAGES, BM, volume);
  const int tid = threadIdx.x;
  if (tid == 0)
    for (int s = 0; s < STAGES; ++s) {
      mb_init(&full[s], PT + 1); /* every producer thread's copies, plus B's expect_tx */
      mb_init(&empty[s], 2);     /* one arrival per consumer warpgroup */
    }
  int64_t row0;
  int n0;
  tsp_tile_origin(n, BM, BN, &row0, &n0);
  /* All threads; ends with __syncthreads (which also publishes the barriers). */
  tsp_tile_offsets<BM, NT>(map, order, rows, tile_rows, row0, volume, offsets, src_rows, tile);
  if (mode == TSP_EPI_ACC_ADD && *tile.count == 0) return; /* adds nothing (block-uniform) */
  const int chunks = (red + BK - 1) / BK;
  const int steps = *tile.count * chunks;

  if (tid >= WS_CONSUMERS) { /* producer warps; no block-wide barrier from here on */
    const int p = tid - WS_CONSUMERS;
    const T *wtile = wimg + (int64_t)(n0 / BN) * volume * chunks * B_STAGE;
    int li = 0, ch = 0;
    for (int step = 0; step < steps; ++step) {
      const int s = step % STAGES;
      mb_wait(&empty[s], ((step / STAGES) & 1) ^ 1); /* round 0 passes on the fresh barrier */
      const int k = tile.list[li];
      const uint32_t used = tile.groups[k];
      T *a_dst = s_a + s * A_STAGE;
      const int c0 = ch * BK;
#pragma unroll
      for (int it = 0; it < BM * BK / 8 / PT; ++it) {
        const int i = p + it * PT, r = i >> 3, cc = i & 7; /* 8 lanes copy one row's 128 bytes */
        if (!((used >> ((r >> 6) * 4)) & 0xFu)) continue; /* its warpgroup skips this step */
        const int32_t q = tile.nb[r * volume + k];
        const int c = c0 + cc * 8;
        const bool valid = q >= 0 && c < red;
        cp_async16_zfill(a_dst + r * 64 + ((cc ^ r) & 7) * 8, valid ? src + (int64_t)q * red + c : src,
                         valid);
      }
      mb_arrive_cp_async(&full[s]);
      if (p == 0) {
        mb_arrive_expect_tx(&full[s], B_STAGE * 2);
        bulk_copy(s_b + s * B_STAGE, wtile + ((int64_t)k * chunks + ch) * B_STAGE, B_STAGE * 2, &full[s]);
      }
      if (++ch == chunks) ch = 0, ++li;
    }
    tsp_cp_async_wait<0>(); /* leave no copy of this thread in flight */
    return;
  }

  const int wg = tid >> 7, lane = tid & 31, wwarp = (tid >> 5) & 3;
  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.0f;
  int li = 0, ch = 0;
  for (int step = 0; step < steps; ++step) {
    const int s = step % STAGES;
    const uint32_t groups = tile.groups[tile.list[li]];
    if (++ch == chunks) ch = 0, ++li;
    mb_wait(&full[s], (step / STAGES) & 1);
    if ((groups >> (4 * wg)) & 0xFu) { /* warpgroup-uniform */
      proxy_fence(); /* the cp.async (generic proxy) writes, seen through the barrier, to wgmma */
      acc_fence(acc);
      const T *a_s = s_a + s * A_STAGE + wg * 64 * BK, *b_s = s_b + s * B_STAGE;
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks)
        wg_op<BN>::template run<T>(acc, wg_desc_sw128(a_s + ks * 16), wg_desc_sw128(b_s + ks * 16));
      wg_commit();
      wg_wait<1>(); /* the previous step's wgmma has read its stage */
    } else {
      wg_wait<0>();
    }
    acc_fence(acc);
    if (step > 0 && (tid & 127) == 0) mb_arrive(&empty[(step - 1) % STAGES]);
  }
  wg_wait<0>();
  acc_fence(acc);

  /* Epilogue: accumulator layout of conv_wgmma_ops.cuh. */
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = n0 + j * 8 + (lane & 3) * 2;
    if (col >= n) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t r = tile.rows[wg * 64 + wwarp * 16 + (lane >> 2) + h * 8];
      if (r >= 0)
        tsp_tile_write2(mode, out, accum, (int64_t)r * n + col, acc[4 * j + 2 * h],
                        acc[4 * j + 2 * h + 1]);
    }
  }
}

/* The weights as the bulk copies read them: for column tile t, offset k and
** 64-channel chunk c, one [bn x 64] stage image at ((t V + k) chunks + c) bn 64,
** row j (produced channel t bn + j) holding reduced channels 64 c .. 64 c + 63
** in the 128-byte swizzle (16-byte chunk u of row j at u ^ (j % 8)); zero past
** n or red.  W_k(j, c) is w[k][c][j] (forward, w [V, red, n]) or w[k][j][c]
** (dgrad, transposed: w [V, n, red]).  Elements are moved as 16-bit words:
** the same code serves fp16 and bf16. */
__global__ void ws_image_kernel(const uint16_t *__restrict__ w, int volume, int red, int n,
                                int transposed, int bn, int chunks, int64_t total,
                                uint16_t *__restrict__ img) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int e = (int)(i % (bn * 64));
    const int64_t blk = i / (bn * 64);
    const int ch = (int)(blk % chunks);
    const int64_t rest = blk / chunks;
    const int k = (int)(rest % volume), t = (int)(rest / volume);
    const int j = e >> 6, slot = e & 63;
    const int c = ch * 64 + ((((slot >> 3) ^ j) & 7) << 3) + (slot & 7);
    const int row = t * bn + j;
    uint16_t v = 0; /* +0.0 in fp16 and bf16 */
    if (row < n && c < red)
      v = transposed ? w[((int64_t)k * n + row) * red + c] : w[((int64_t)k * red + c) * n + row];
    img[i] = v;
  }
}

template <typename T, int BN, int STAGES, int PW, int MINB>
static tsp_status launch_ws(const tsp_os_launch &a) {
  const size_t smem = ws_smem_bytes(BN, STAGES, (int)a.volume);
  static uint64_t smem_raised = 0;
  tsp_status s = tsp_raise_smem_limit((const void *)wgmma_ws_kernel<T, BN, STAGES, PW, MINB>, smem,
                                      &smem_raised, "tsp_conv_wgmma_ws");
  if (s != TSP_OK) return s;
  const int64_t tiles = ((a.tile_rows + WS_BM - 1) / WS_BM) * ((a.n + BN - 1) / BN);
  if (tiles > 0x7fffffffLL) return TSP_ERR_UNSUPPORTED;
  wgmma_ws_kernel<T, BN, STAGES, PW, MINB><<<(unsigned)tiles, WS_CONSUMERS + 32 * PW, smem, a.stream>>>(
      (const T *)a.src, a.src_rows, (const T *)a.w, a.map, a.order, a.rows, a.tile_rows, a.offsets,
      (int)a.volume, (int)a.red, (int)a.n, (T *)a.out, a.accum, a.mode);
  return tsp_cuda_check_launch("tsp_conv_wgmma_ws");
}

/* Tile 14: 4 stages, two producer warps, one block per SM (BN = 256: 208 KB
** at V = 27).  Tile 15: the same with four producer warps (a whole
** warpgroup).  Measured (H100, lidar_198k, fp16, fwd us, 2026-11-23):
**   tile 14: 154 / 415 / 818 at C = 64 / 128 / 256 (ncu at 256: tensor pipe
**            24.6% busy, issue slots 14.8%, warps stalled mostly on the L1TEX
**            scoreboard: the consumers wait for data);
**   tile 15: 273 / 552 at C = 128 / 256, dgrad 272 / 549;
**   the all-warps swizzled tiles of conv_wgmma.cu: 113 (13) / 266 (12) / 695 (13).
** So two warps cannot issue a stage's 1024 row copies fast enough; four can,
** and tile 15 is tile 0 for n > 128 (conv.cu resolve_tile).  (An earlier
** tile 15, BN <= 128 at two blocks per SM, measured 144 / 271 / 868.) */
template <typename T> static tsp_status dispatch_ws(const tsp_os_launch &a, int tile) {
  const int bn = ws_bn(a.n);
  if (tile == 14) {
    if (bn == 64) return launch_ws<T, 64, WS_STAGES, 2, 1>(a);
    if (bn == 128) return launch_ws<T, 128, WS_STAGES, 2, 1>(a);
    return launch_ws<T, 256, WS_STAGES, 2, 1>(a);
  }
  if (bn == 64) return launch_ws<T, 64, WS_STAGES, 4, 1>(a);
  if (bn == 128) return launch_ws<T, 128, WS_STAGES, 4, 1>(a);
  return launch_ws<T, 256, WS_STAGES, 4, 1>(a);
}

#endif /* TSP_WGMMA */

size_t tsp_conv_wgmma_ws_image_bytes(int64_t volume, int64_t red, int64_t n) {
#ifndef TSP_WGMMA
  (void)volume, (void)red, (void)n;
  return 0;
#else
  const int64_t bn = ws_bn(n);
  return (size_t)(volume * ((red + 63) / 64 * 64) * ((n + bn - 1) / bn * bn)) * 2;
#endif
}

tsp_status tsp_conv_wgmma_ws_check(tsp_dtype dtype, const tsp_os_launch *a, int tile) {
#ifndef TSP_WGMMA
  (void)dtype, (void)a, (void)tile;
  return TSP_ERR_UNSUPPORTED;
#else
  if (!wg_launch_ok(dtype, a) || (tile != 14 && tile != 15)) return TSP_ERR_UNSUPPORTED;
  if (ws_smem_bytes(ws_bn(a->n), WS_STAGES, (int)a->volume) > 232448) return TSP_ERR_UNSUPPORTED;
  if (tsp_device_cc() != 90) return TSP_ERR_UNSUPPORTED; /* sm_90a code runs on sm_90 only */
  return TSP_OK;
#endif
}

tsp_status tsp_conv_wgmma_ws_image(tsp_dtype dtype, const tsp_os_launch *a, int transposed_w,
                                   void *img) {
#ifndef TSP_WGMMA
  (void)dtype, (void)a, (void)transposed_w, (void)img;
  return TSP_ERR_UNSUPPORTED;
#else
  if (dtype != TSP_FLOAT16 && dtype != TSP_BFLOAT16) return TSP_ERR_UNSUPPORTED;
  if (img == NULL || (uintptr_t)img % 16 != 0) return TSP_ERR_UNSUPPORTED;
  const int bn = ws_bn(a->n);
  const int chunks = (int)((a->red + 63) / 64);
  const int64_t total = (int64_t)tsp_conv_wgmma_ws_image_bytes(a->volume, a->red, a->n) / 2;
  if (total <= 0) return TSP_OK;
  const unsigned blocks = tsp_grid_blocks_max(total, 256, 132 * 8); /* one wave on an H100 */
  ws_image_kernel<<<blocks, 256, 0, a->stream>>>((const uint16_t *)a->w, (int)a->volume, (int)a->red,
                                                 (int)a->n, transposed_w, bn, chunks, total,
                                                 (uint16_t *)img);
  return tsp_cuda_check_launch("tsp_conv_wgmma_ws_image");
#endif
}

/* One launch; a->w is the image written by tsp_conv_wgmma_ws_image. */
tsp_status tsp_conv_wgmma_ws_os(tsp_dtype dtype, const tsp_os_launch *a, int tile) {
#ifndef TSP_WGMMA
  (void)dtype, (void)a, (void)tile;
  return TSP_ERR_UNSUPPORTED;
#else
  const tsp_status ok = tsp_conv_wgmma_ws_check(dtype, a, tile);
  if (ok != TSP_OK) return ok;
  if (a->rows <= 0 || a->tile_rows <= 0) return TSP_OK;
  if (((uintptr_t)a->w % 16) != 0) return TSP_ERR_UNSUPPORTED;
  if (dtype == TSP_FLOAT16) return dispatch_ws<__half>(*a, tile);
  return dispatch_ws<__nv_bfloat16>(*a, tile);
#endif
}
