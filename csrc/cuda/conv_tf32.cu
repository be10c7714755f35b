/*
** conv_tf32.cu: forward and dgrad of float32 convolutions on tensor cores in
** tf32 (mma.sync m16n8k8, inputs rounded to tf32 by cvt.rna.tf32.f32, fp32
** accumulation).  out[r] = sum_k src[map[r, k]] @ W_k, one launch for all
** offsets, output-stationary (no atomics, deterministic).  Selected by
** algo.tile == TSP_TILE_TF32 (11) on a float32 problem (conv.cu); Python
** asks for it when torch.backends.cuda.matmul.allow_tf32 is set, the flag
** torch.set_float32_matmul_precision("high") sets for cuBLAS too.
**
** Why: without it a float32 conv runs conv_simple.cu, one thread per output
** element with no data reuse, tens of times slower than the fp16 kernels on
** the same layer; fp32 training and fp32 inference are common, and tf32 keeps
** fp32's range with a 10-bit mantissa (relative rounding 2^-11 per operand),
** the same trade PyTorch's own matmuls and convolutions make under that flag.
**
** Same structure as conv_implicit_gemm.cu, so that every dataflow (mask
** sorted, unsorted, the segmented plans of torchsp/plan.py) behaves the same:
**   1-2. conv_tile.cuh lists the tile's map entries and the offsets some row
**        uses, with per-offset masks of 16-row groups;
**   3.   a STAGES-deep cp.async pipeline walks (offset, BK-channel chunk)
**        steps: A = BM gathered source rows, B = the BK x BN slice of W_k
**        (forward: w[k] is [red, n], copied K-major rows of BN floats;
**        dgrad: w[k] is [n, red], copied as BN rows of BK floats, so W_k^T
**        needs no transposed copy of w);
**   4.   each warp skips the mma of 16-row groups without a row for the
**        step's offset;
**   5.   the epilogue is conv_tile.cuh's tsp_tile_write2 (store, or the
**        fp32 partial sums of a segmented pass).
** Differences from the 16-bit kernel: 16-byte cp.async moves 4 floats, so
** channel counts must be multiples of 4 (else conv_simple.cu, exact fp32);
** BK = 16 floats keeps a stage's bytes those of the fp16 kernel's BK = 32;
** ldmatrix moves 16-bit units, so fragments come from 32-bit shared loads,
** converted to tf32 as they are built.  Row pitches make those loads bank
** conflict free: the 8 rows g of an A (or transposed B) fragment start at
** g * (BK + 4) words, 8 distinct 4-word bank groups, and lanes t add 0..3;
** the 4 rows t of a [k][n] B fragment start at t * (BN + 8) words, 4
** distinct 8-word groups, and lanes g add 0..7.
*/
#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_tile.cuh"

/* One block computes a BM x BN tile with (BM / WM) x (BN / WN) warps; BK is
** the channel chunk of a pipeline step, in floats.  TW: W_k read transposed
** (dgrad). */
template <int BM_, int BN_, int BK_, int WM_, int WN_, int STAGES_, bool TW_> struct tf32_cfg {
  enum {
    BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, STAGES = STAGES_,
    WARPS_N = BN / WN, WARPS = (BM / WM) * (BN / WN), THREADS = WARPS * 32,
    MI = WM / 16, NI = WN / 8,
    A_LD = BK + 4, A_STAGE = BM * A_LD,
    B_ROWS = TW_ ? BN : BK, B_LD = TW_ ? BK + 4 : BN + 8, B_STAGE = B_ROWS * B_LD,
  };
  static const bool TW = TW_;
};

template <typename CFG> static size_t tf32_smem_bytes(int volume) {
  return (size_t)CFG::STAGES * (CFG::A_STAGE + CFG::B_STAGE) * sizeof(float) +
         tsp_tile_smem_bytes(CFG::BM, volume);
}

template <typename CFG>
__global__ void __launch_bounds__(CFG::THREADS)
    tf32_os_kernel(const float *__restrict__ src, int64_t src_rows, const float *__restrict__ w,
                   const int32_t *__restrict__ map, const int32_t *__restrict__ order, const int32_t *__restrict__ plan_map,
                   int64_t rows, int64_t tile_rows, uint64_t offsets, int volume, int red,
                   int n, float *__restrict__ out, float *__restrict__ accum, int mode, int splits) {
  enum { BM = CFG::BM, BN = CFG::BN, BK = CFG::BK, STAGES = CFG::STAGES, NT = CFG::THREADS };
  enum { MI = CFG::MI, NI = CFG::NI, A_LD = CFG::A_LD, B_LD = CFG::B_LD };
  enum { CHUNKS_K = BK / 4, CHUNKS_N = BN / 4 }; /* 16-byte copies per staged row */
  static_assert(BK % 8 == 0 && BN % 8 == 0 && BM % 16 == 0, "whole m16n8k8 fragments");
  static_assert(A_LD % 8 == 4, "A rows g start in distinct 4-word bank groups");
  static_assert(CFG::TW ? B_LD % 8 == 4 : B_LD % 16 == 8, "B fragment loads conflict free");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float *s_a = (float *)smem_raw;
  float *s_b = s_a + STAGES * CFG::A_STAGE;
  const tsp_tile_smem tile = tsp_tile_smem_at(s_b + STAGES * CFG::B_STAGE, BM, volume);
  const int32_t *s_nb = tile.nb, *s_list = tile.list, *s_rows = tile.rows;
  const uint32_t *s_groups = tile.groups;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t row0;
  int n0;
  int split; /* split-K: which run of the tile's offsets this block sums */
  tsp_tile_origin_split(n, BM, BN, splits, &row0, &n0, &split);

  /* 1-2. The tile's map entries, per-offset masks of 16-row groups, used offsets. */
  tsp_tile_offsets<BM, NT>(map, order, plan_map, rows, tile_rows, row0, volume, offsets, src_rows, tile, split, splits);
  accum = tsp_split_accum(accum, split, rows, n);
  if (tsp_tile_adds_nothing(mode, *tile.count)) return; /* block-uniform */
  const int chunks = (red + BK - 1) / BK;
  const int steps = *tile.count * chunks;

  /* 3. Pipeline stage loader: step -> (offset, channel chunk).  Copies past
  ** red or n, and absent rows, land as zeros without reading memory. */
  auto load_step = [&](int li, int c0, int stage) {
    const int k = s_list[li];
    float *a_dst = s_a + stage * CFG::A_STAGE;
#pragma unroll
    for (int it = 0; it < (BM * CHUNKS_K + NT - 1) / NT; ++it) {
      const int i = tid + it * NT;
      if (i >= BM * CHUNKS_K) break;
      const int r = i / CHUNKS_K, c = c0 + (i % CHUNKS_K) * 4;
      const int32_t p = s_nb[r * volume + k];
      const bool valid = p >= 0 && c < red;
      const float *g = valid ? src + (int64_t)p * red + c : src;
      tsp_cp_async16(a_dst + r * A_LD + (i % CHUNKS_K) * 4, g, valid);
    }
    float *b_dst = s_b + stage * CFG::B_STAGE;
    const float *wk = w + (int64_t)k * red * n;
    if (!CFG::TW) { /* W_k = w[k], [red, n]: BK rows of BN contiguous channels */
#pragma unroll
      for (int it = 0; it < (BK * CHUNKS_N + NT - 1) / NT; ++it) {
        const int i = tid + it * NT;
        if (i >= BK * CHUNKS_N) break;
        const int r = i / CHUNKS_N, j = n0 + (i % CHUNKS_N) * 4;
        const bool valid = c0 + r < red && j < n;
        const float *g = valid ? wk + (int64_t)(c0 + r) * n + j : w;
        tsp_cp_async16(b_dst + r * B_LD + (i % CHUNKS_N) * 4, g, valid);
      }
    } else { /* W_k = w[k]^T, w[k] is [n, red]: BN rows of BK contiguous channels */
#pragma unroll
      for (int it = 0; it < (BN * CHUNKS_K + NT - 1) / NT; ++it) {
        const int i = tid + it * NT;
        if (i >= BN * CHUNKS_K) break;
        const int r = i / CHUNKS_K, c = c0 + (i % CHUNKS_K) * 4;
        const bool valid = n0 + r < n && c < red;
        const float *g = valid ? wk + (int64_t)(n0 + r) * red + c : w;
        tsp_cp_async16(b_dst + r * B_LD + (i % CHUNKS_K) * 4, g, valid);
      }
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;

  const int warp_m = warp / CFG::WARPS_N, warp_n = warp % CFG::WARPS_N;
  const int wm0 = warp_m * CFG::WM, wn0 = warp_n * CFG::WN;
  const int g = lane >> 2, t = lane & 3; /* fragment row / column of this lane */

  /* (offset list index, first channel) of the next step to load and of the
  ** step being computed; advanced by counters, not divisions. */
  int load_li = 0, load_c0 = 0, comp_li = 0, comp_c0 = 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) {
      load_step(load_li, load_c0, s);
      load_c0 += BK;
      if (load_c0 >= red) load_c0 = 0, ++load_li;
    }
    tsp_cp_async_commit();
  }

  for (int step = 0; step < steps; ++step) {
    tsp_cp_async_wait<STAGES - 2>();
    __syncthreads(); /* step's stage landed for all; stage (step-1) % STAGES is free */
    if (step + STAGES - 1 < steps) {
      load_step(load_li, load_c0, (step + STAGES - 1) % STAGES);
      load_c0 += BK;
      if (load_c0 >= red) load_c0 = 0, ++load_li;
    }
    tsp_cp_async_commit();

    const int stage = step % STAGES;
    const uint32_t groups = s_groups[s_list[comp_li]];
    comp_c0 += BK;
    if (comp_c0 >= red) comp_c0 = 0, ++comp_li;
    bool on[MI];
    bool any = false;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      on[mi] = (groups >> ((wm0 + mi * 16) >> 4)) & 1u;
      any |= on[mi];
    }
    if (!any) continue; /* warp-uniform: no barrier below */

    const float *a_s = s_a + stage * CFG::A_STAGE;
    const float *b_s = s_b + stage * CFG::B_STAGE;
#pragma unroll
    for (int ks = 0; ks < BK / 8; ++ks) {
      uint32_t af[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        if (on[mi]) {
          const float *a = a_s + (wm0 + mi * 16 + g) * A_LD + ks * 8 + t;
          af[mi][0] = tsp_to_tf32(a[0]);
          af[mi][1] = tsp_to_tf32(a[8 * A_LD]);
          af[mi][2] = tsp_to_tf32(a[4]);
          af[mi][3] = tsp_to_tf32(a[8 * A_LD + 4]);
        }
      uint32_t bf[NI][2];
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        if (!CFG::TW) { /* [k][n]: b0 (k t, n g), b1 (k t + 4, n g) */
          const float *b = b_s + (ks * 8 + t) * B_LD + wn0 + ni * 8 + g;
          bf[ni][0] = tsp_to_tf32(b[0]);
          bf[ni][1] = tsp_to_tf32(b[4 * B_LD]);
        } else { /* [n][k] */
          const float *b = b_s + (wn0 + ni * 8 + g) * B_LD + ks * 8 + t;
          bf[ni][0] = tsp_to_tf32(b[0]);
          bf[ni][1] = tsp_to_tf32(b[4]);
        }
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        if (on[mi])
#pragma unroll
          for (int ni = 0; ni < NI; ++ni) tsp_mma1688_tf32(acc[mi][ni], af[mi], bf[ni]);
    }
  }
  tsp_cp_async_wait<0>(); /* no copy may outlive the block (empty groups only, but be exact) */

  /* 5. Every element of the tile is written, rows with no offset as zeros;
  ** a segmented pass first adds the partial sums it reads (conv_tile.cuh). */
  tsp_tile_epilogue(mode, out, accum, n, [&](auto f) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int col = n0 + wn0 + ni * 8 + t * 2;
        if (col >= n) continue; /* n is a multiple of 4: col + 1 < n too */
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int32_t r = s_rows[wm0 + mi * 16 + g + h * 8];
          if (r >= 0) f(r, col, acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
      }
  });
}

template <typename CFG> static tsp_status launch_tf32(const tsp_os_launch &a) {
  const size_t smem = tf32_smem_bytes<CFG>((int)a.volume);
  static uint64_t smem_raised = 0; /* per instantiation: devices whose limit is raised */
  tsp_status s = tsp_raise_smem_limit((const void *)tf32_os_kernel<CFG>, smem, &smem_raised,
                                      "tsp_conv_tf32_os");
  if (s != TSP_OK) return s;
  const int64_t tiles = ((a.tile_rows + CFG::BM - 1) / CFG::BM) * ((a.n + CFG::BN - 1) / CFG::BN);
  const int splits = a.splits > 1 ? a.splits : 1;
  if (tiles * splits > 0x7fffffffLL) return TSP_ERR_UNSUPPORTED;
  tf32_os_kernel<CFG><<<(unsigned)(tiles * splits), CFG::THREADS, smem, a.stream>>>(
      (const float *)a.src, a.src_rows, (const float *)a.w, a.map, a.order, nullptr /* plan_map: conv_tile.cuh */, a.rows, a.tile_rows,
      a.offsets, (int)a.volume, (int)a.red, (int)a.n, (float *)a.out, a.accum, a.mode, splits);
  return tsp_cuda_check_launch("tsp_conv_tf32_os");
}

/* Tile shapes, by produced channels as the fp16 kernel's tile 0 does: BN
** covers n when n <= 64, so each gathered row is read once per offset;
** wider layers take 128 x 128 tiles with 8 warps.  Warp tiles 32 x 32 or
** 32 x 64: at 32 x 64 a k8 step loads 2 KB of fragments per warp for 16 mma,
** about what the shared-memory port and the tf32 pipe take in the same time. */
template <bool TW> static tsp_status dispatch_tf32(const tsp_os_launch &a) {
  if (a.n <= 32) return launch_tf32<tf32_cfg<128, 32, 16, 32, 32, 4, TW> >(a);
  if (a.n <= 64) return launch_tf32<tf32_cfg<128, 64, 16, 32, 64, 4, TW> >(a);
  return launch_tf32<tf32_cfg<128, 128, 16, 32, 64, 4, TW> >(a);
}

tsp_status tsp_conv_tf32_check(const tsp_os_launch *a) {
  if (a->red % 4 != 0 || a->n % 4 != 0 || a->red <= 0 || a->n <= 0 ||
      a->volume > TSP_IGEMM_MAX_VOLUME || a->red > 0x7fffffff || a->n > 0x7fffffff ||
      a->src_rows > 0x7fffffff)
    return TSP_ERR_UNSUPPORTED;
  if (((uintptr_t)a->src | (uintptr_t)a->w) % 16 != 0 || (uintptr_t)a->out % 8 != 0)
    return TSP_ERR_UNSUPPORTED;
  if (tsp_device_cc() < 80) return TSP_ERR_UNSUPPORTED; /* mma.sync tf32, cp.async */
  return TSP_OK;
}

tsp_status tsp_conv_tf32_os(const tsp_os_launch *a, int transposed_w) {
  const tsp_status ok = tsp_conv_tf32_check(a);
  if (ok != TSP_OK) return ok;
  if (a->rows <= 0 || a->tile_rows <= 0) return TSP_OK;
  return transposed_w ? dispatch_tf32<true>(*a) : dispatch_tf32<false>(*a);
}
