/*
** conv_implicit_gemm.cu: forward and dgrad on tensor cores, fp16/bf16 with
** fp32 accumulation.  out[r] = sum_k src[map[r, k]] @ W_k, one launch for all
** offsets, output-stationary (no atomics, deterministic).
**
** Workload: 100-200k rows, 27 offsets of which ~3.5-10 are present per row,
** C in {16..256}.  At C <= 64 the layer is memory-bound (the 173k x 27 int32
** map alone is 18.7 MB, as much as x and y together at C = 32), at C >= 128
** compute-bound.  Rows arrive sorted by coordinate key, so a tile of 128
** consecutive rows is a compact patch of the scene and sees only some of the
** offsets.
**
** One block computes a BM x BN tile of out:
**   1. it copies the tile's BM x V map entries into shared memory (one
**      contiguous read, all cp.async in flight at once; entries outside
**      [0, src_rows) become -1); with a row order (rows sorted by their
**      neighbour mask, TorchSparse++'s mask sorting) tile row i is map row
**      order[row0 + i], so the rows of a 16-row group share their offsets
**      and step 4 skips far more mma work,
**      and builds per offset a bit mask of the 16-row groups that use it;
**   2. the offsets used by no row of the tile are dropped (a warp ballot
**      compacts the rest into a list);
**   3. a STAGES-deep cp.async pipeline walks (offset, BK-channel chunk)
**      steps: A = BM gathered source rows (absent rows are zero-filled in
**      shared memory; the rows of 16-row groups with no row for the offset
**      are not loaded at all, step 4 never reads them), B = the BK x BN
**      slice of W_k;
**   4. each warp skips the mma of 16-row groups that have no row for the
**      step's offset (the tensor cores are the bottleneck at large C, and
**      ~3.5 of 27 offsets per row leaves most groups empty);
**   5. fp32 accumulators are rounded once and stored.
** dgrad is the same kernel on nbmap_t with W_k read transposed: w[k] is
** [c_in, c_out] = [n, red] there, so B is copied N-major into shared memory
** and loaded with plain ldmatrix instead of ldmatrix.trans (no transposed
** copy of w is needed).
**
** Shared memory rows are padded by 16 bytes so that the 8 rows an ldmatrix
** reads fall in 8 different bank groups.
*/
#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_tile.cuh"

template <int BM_, int BN_, int BK_, int WM_, int WN_, int STAGES_, bool TW_> struct igemm_cfg {
  enum {
    BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, STAGES = STAGES_,
    WARPS_N = BN / WN, WARPS = (BM / WM) * (BN / WN), THREADS = WARPS * 32,
    MI = WM / 16, NI = WN / 8,
    A_LD = BK + 8, A_STAGE = BM * A_LD,
    B_ROWS = TW_ ? BN : BK, B_LD = TW_ ? BK + 8 : BN + 8, B_STAGE = B_ROWS * B_LD,
  };
  static const bool TW = TW_;
};

template <typename CFG>
static size_t igemm_smem_bytes(int volume) {
  return (size_t)CFG::STAGES * (CFG::A_STAGE + CFG::B_STAGE) * 2 /* 16-bit elements */ +
         tsp_tile_smem_bytes(CFG::BM, volume);
}

template <typename T, typename CFG>
__global__ void __launch_bounds__(CFG::THREADS)
    igemm_os_kernel(const T *__restrict__ src, int64_t src_rows, const T *__restrict__ w,
                    const int32_t *__restrict__ map, const int32_t *__restrict__ order, const int32_t *__restrict__ plan_map,
                    int64_t rows, int64_t tile_rows, uint64_t offsets, int volume, int red,
                    int n, T *__restrict__ out, float *__restrict__ accum, int mode, int splits,
                    const int32_t *__restrict__ plan_steps) {
  enum { BM = CFG::BM, BN = CFG::BN, BK = CFG::BK, STAGES = CFG::STAGES, NT = CFG::THREADS };
  enum { MI = CFG::MI, NI = CFG::NI, A_LD = CFG::A_LD, B_LD = CFG::B_LD };
  static_assert(NI % 2 == 0, "B fragments are loaded two n8 blocks at a time");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *s_a = (T *)smem_raw;
  T *s_b = s_a + STAGES * CFG::A_STAGE;
  const tsp_tile_smem tile = tsp_tile_smem_at(s_b + STAGES * CFG::B_STAGE, BM, volume);
  const int32_t *s_list = tile.list, *s_rows = tile.rows;
  const uint32_t *s_groups = tile.groups;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t row0;
  int n0;
  int split; /* split-K: which run of the tile's offsets this block sums */
  tsp_tile_origin_split(n, BM, BN, splits, &row0, &n0, &split);

  /* 1-2. The tile's map entries, per-offset masks of 16-row groups, used offsets:
  ** copied from the step plan when there is one (conv_tile.cuh). */
  const bool from_steps = plan_steps != nullptr;
  if (from_steps)
    tsp_tile_from_steps<BM, NT>(plan_steps, row0, volume, rows, src_rows, tile);
  else
    tsp_tile_offsets<BM, NT>(map, order, plan_map, rows, tile_rows, row0, volume, offsets, src_rows, tile, split, splits);
  accum = tsp_split_accum(accum, split, rows, n);
  if (tsp_tile_adds_nothing(mode, *tile.count)) return; /* block-uniform */
  const int chunks = (red + BK - 1) / BK;
  const int steps = *tile.count * chunks;

  /* 3. Pipeline stage loader: step -> (offset, channel chunk).  Absent neighbours and
  ** out-of-range channels zero-fill through 0-byte copies: no divergent branch between a
  ** copy and a shared store, as in wgrad's slab copies.  lidar_198k, C = 32, fp16, same
  ** run, two rounds (an H200 host, 2026-11-25): fwd 42.4 / 42.2 -> 39.9 / 40.1 us, dgrad
  ** 42.2 / 42.3 -> 40.2 / 40.1.
  ** Thread tid copies chunk aq = tid % CPR of A rows ar + RPP it (ar = tid / CPR), and
  ** likewise for B, so a copy's shared address is the thread's own plus a constant of
  ** the unrolled loop, and a gathered row's address one wide multiply-add of its map
  ** entry (red2 < 2^31: tsp_conv_igemm_check); conv_wgmma.cu's lean loader says why.
  ** H100, lidar_198k, fp16, main kernel us, three rounds each way in one call
  ** (2026-11-27): tile 1 subm C = 32 fwd 49.8 -> 43.1, dgrad 49.6 -> 42.7; subm C = 64
  ** fwd 75.0 -> 65.7, dgrad 79.0 -> 74.3.  Tile 0 at C = 32 (128 x 32, 63 registers
  ** for four blocks an SM, where ptxas rebuilds addresses to stay under 64) within
  ** 1.5%: fwd 25.9 -> 25.6, dgrad 26.5 -> 26.3. */
  enum { CPR = BK / 8, RPP = NT / CPR, A_IT = BM / RPP };
  enum { CPRB = CFG::TW ? BK / 8 : BN / 8, RPB = NT / CPRB, B_ROWS = CFG::B_ROWS };
  enum { B_IT = (B_ROWS + RPB - 1) / RPB };
  static_assert(NT % CPR == 0 && BM % RPP == 0 && RPP % 16 == 0, "whole rows a pass, whole 16-row groups");
  static_assert(NT % CPRB == 0, "whole B rows a pass");
  const int ar = tid / CPR, aq = tid % CPR, br = tid / CPRB, bq = tid % CPRB;
  const uint32_t a_sm0 = tsp_smem_addr(s_a + ar * A_LD + aq * 8);
  const uint32_t b_sm0 = tsp_smem_addr(s_b + br * B_LD + bq * 8);
  const int red2 = 2 * red;
  /* Returns the step's 16-row-group word, which its compute reads (ahead[] below). */
  auto load_step = [&](int li, int c0, int stage) -> uint32_t {
    const int k = s_list[li];
    const uint32_t used = s_groups[k]; /* rows of other 16-row groups are never read (step 4) */
    /* Entry of row ar + RPP it: ent[it * es], in the layout the tile was built in. */
    const int32_t *ent = from_steps ? tile.nb + li * BM + ar : tile.nb + ar * volume + k;
    const int es = from_steps ? RPP : RPP * volume;
    const bool c_ok = c0 + aq * 8 < red;
    const char *src_c = (const char *)(src + c0 + aq * 8);
    const uint32_t a_sm = a_sm0 + (uint32_t)stage * (CFG::A_STAGE * 2);
#pragma unroll
    for (int it = 0; it < A_IT; ++it) {
      if (!((used >> ((ar >> 4) + RPP / 16 * it)) & 1u)) continue;
      const int32_t p = ent[it * es];
      const bool valid = c_ok && p >= 0;
      tsp_cp_async16_bytes(a_sm + it * RPP * A_LD * 2, valid ? src_c + (int64_t)p * red2 : (const char *)src,
                           valid ? 16u : 0u);
    }
    const uint32_t b_sm = b_sm0 + (uint32_t)stage * (CFG::B_STAGE * 2);
    const T *wk = w + (int64_t)k * red * n;
#pragma unroll
    for (int it = 0; it < B_IT; ++it) {
      const int r = br + RPB * it; /* shared row of B */
      if (B_ROWS % RPB != 0 && r >= B_ROWS) break;
      /* !TW: W_k = w[k], [red, n]: row c0 + r, channels n0 + 8 bq;
      ** TW: w[k] is [n, red]: row n0 + r, reduction chunk c0 + 8 bq. */
      const bool valid = CFG::TW ? n0 + r < n && c0 + bq * 8 < red : c0 + r < red && n0 + bq * 8 < n;
      const T *g = CFG::TW ? wk + (int64_t)(n0 + r) * red + c0 + bq * 8 : wk + (int64_t)(c0 + r) * n + n0 + bq * 8;
      tsp_cp_async16_bytes(b_sm + it * RPB * B_LD * 2, valid ? g : w, valid ? 16u : 0u);
    }
    return used;
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

  /* (offset list index, first channel) of the next step to load; advanced by
  ** counters, not divisions. */
  int load_li = 0, load_c0 = 0;
  /* The 16-row-group words of the steps loaded ahead, oldest first, as the
  ** loader read them: the compute reads no list or groups word itself (two
  ** dependent shared loads before its ldmatrix; conv_wgmma.cu does the same).
  ** Tile 0 at C = 32 (128 x 32): step loop 183 -> 174 SASS instructions, still
  ** 63 registers; H100, lidar_198k, fp16, main kernel us, three rounds each way
  ** in one call (2026-11-27): fwd 25.6 -> 24.9, dgrad 26.2 -> 25.9; tile 1 fwd
  ** 42.9 -> 42.4, dgrad 42.6 -> 42.1. */
  uint32_t ahead[STAGES - 1];
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    ahead[s] = 0u;
    if (s < steps) {
      ahead[s] = load_step(load_li, load_c0, s);
      load_c0 += BK;
      if (load_c0 >= red) load_c0 = 0, ++load_li;
    }
    tsp_cp_async_commit();
  }

  for (int step = 0; step < steps; ++step) {
    tsp_cp_async_wait<STAGES - 2>();
    __syncthreads(); /* step's stage landed for all; stage (step-1) % STAGES is free */
    uint32_t loaded = 0u;
    if (step + STAGES - 1 < steps) {
      loaded = load_step(load_li, load_c0, (step + STAGES - 1) % STAGES);
      load_c0 += BK;
      if (load_c0 >= red) load_c0 = 0, ++load_li;
    }
    tsp_cp_async_commit();

    const int stage = step % STAGES;
    const uint32_t groups = tsp_ahead_next(ahead, loaded);
    bool on[MI];
    bool any = false;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      on[mi] = (groups >> ((wm0 + mi * 16) >> 4)) & 1u;
      any |= on[mi];
    }
    if (!any) continue; /* warp-uniform: no barrier below */

    const T *a_s = s_a + stage * CFG::A_STAGE;
    const T *b_s = s_b + stage * CFG::B_STAGE;
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      uint32_t af[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        if (on[mi])
          tsp_ldmatrix_x4(af[mi], a_s + (wm0 + mi * 16 + (lane & 15)) * A_LD + ks * 16 +
                                      (lane >> 4) * 8);
      uint32_t bf[NI][2];
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        uint32_t r[4];
        if (!CFG::TW)
          tsp_ldmatrix_x4_trans(r, b_s + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * B_LD +
                                       wn0 + nj * 16 + (lane >> 4) * 8);
        else
          tsp_ldmatrix_x4(r, b_s + (wn0 + nj * 16 + (lane & 7) + (lane >> 4) * 8) * B_LD +
                                 ks * 16 + ((lane >> 3) & 1) * 8);
        bf[2 * nj][0] = r[0];
        bf[2 * nj][1] = r[1];
        bf[2 * nj + 1][0] = r[2];
        bf[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        if (on[mi])
#pragma unroll
          for (int ni = 0; ni < NI; ++ni) tsp_mma16816(acc[mi][ni], af[mi], bf[ni], T());
    }
  }
  tsp_cp_async_wait<0>(); /* no copy may outlive the block (empty groups only, but be exact) */

  if (tsp_stage_ok(mode, out)) { /* block-uniform: plain stores, staged (conv_tile.cuh) */
    static_assert(STAGES * (CFG::A_STAGE + CFG::B_STAGE) >= BM * BN, "the stages hold the staged tile");
    __syncthreads(); /* every warp is done reading the stages, which now stage the tile */
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          tsp_stage_pair<BN>(s_a, wm0 + mi * 16 + (lane >> 2) + h * 8, (wn0 + ni * 8) >> 3, lane,
                             acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
    __syncthreads();
    tsp_stage_rows<BN, BM, NT>(s_a, s_rows, out, n, n0, tid);
    return;
  }

  /* 5. Every element of the tile is written, rows with no offset as zeros;
  ** a segmented pass first adds the partial sums it reads (conv_tile.cuh). */
  tsp_tile_epilogue(mode, out, accum, n, [&](auto f) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int col = n0 + wn0 + ni * 8 + (lane & 3) * 2;
        if (col >= n) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int32_t r = s_rows[wm0 + mi * 16 + (lane >> 2) + h * 8];
          if (r >= 0) f(r, col, acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
      }
  });
}

template <typename T, typename CFG> static tsp_status launch_igemm(const tsp_os_launch &a) {
  const size_t smem = igemm_smem_bytes<CFG>((int)a.volume);
  static uint64_t smem_raised = 0; /* per instantiation: devices whose limit is raised */
  tsp_status s = tsp_raise_smem_limit((const void *)igemm_os_kernel<T, CFG>, smem, &smem_raised,
                                      "tsp_conv_igemm_os");
  if (s != TSP_OK) return s;
  const int64_t tiles = ((a.tile_rows + CFG::BM - 1) / CFG::BM) * ((a.n + CFG::BN - 1) / CFG::BN);
  const int splits = a.splits > 1 ? a.splits : 1;
  if (tiles * splits > 0x7fffffffLL) return TSP_ERR_UNSUPPORTED;
  igemm_os_kernel<T, CFG><<<(unsigned)(tiles * splits), CFG::THREADS, smem, a.stream>>>(
      (const T *)a.src, a.src_rows, (const T *)a.w, a.map, a.order, nullptr /* plan_map: conv_tile.cuh */, a.rows, a.tile_rows,
      a.offsets, (int)a.volume, (int)a.red, (int)a.n, (T *)a.out, a.accum, a.mode, splits,
      CFG::BM == 128 ? a.steps : nullptr);
  return tsp_cuda_check_launch("tsp_conv_igemm_os");
}

/* Tile shapes, chosen by algo.tile (the tuner measures them):
**   0: by produced channels: BN covers n when n <= 64, so each gathered row is
**      read once per offset; wider layers take 128 x 128 tiles with 8 warps;
**   1: 64-row tiles: fewer offsets in the union of a tile's rows (sorted rows
**      change mask every few rows), twice the blocks, half the weight reuse;
**   2: n > 128: 128 x 256 tiles with 16 warps, so C = 256 gathers each source
**      row once per offset instead of twice; otherwise as 0.
** At n <= 32 the 128 x 32 tile runs 8 warps of 16 x 32 and 3 stages: 53 KB
** and 64 registers a thread, so four blocks (32 warps) per SM where 4 warps
** of 32 x 32 and 4 stages fitted three (12 warps).  With step plans the
** first phase no longer dominates and the warps wait on dependent latency
** (Nsight Compute, 2026-11-26: "wait" the top stall, 3 warps per scheduler);
** main kernel on lidar_198k, H100, same process, three rounds: fwd 29.5 ->
** 26.9 us, dgrad 30.4 -> 27.0 (8 warps at 4 stages 28.7 / 29.8; 4 warps at
** 3 stages 29.0 / 29.1, at 2 stages 34.1 / 34.2).  The same shapes at n = 64
** (8 warps of 16 x 64 at 3 or 2 stages, 8 of 32 x 32 at 3) stayed behind
** wgmma tile 13, tile 0's choice there: C = 64 fwd 60.5-63.6 against 49.4,
** down3 C = 64 74.0-77.8 against 62.8 (2026-11-26, one call).
** Any other value is 0 (3 names it explicitly: conv.cu resolves tile 0 to the
** wgmma kernels, tiles 12, 13 and 15, on sm_90a).  Tried and
** dropped (2026-11-23, H100, lidar_198k): BK = 64 chunks and 64 x 64 warp
** tiles, 0-25% slower than 0 at C = 64-256.  Fewer stages at n <= 32 with 4
** warps, for more blocks per SM as tile 13 gained from them (conv_wgmma.cu),
** did not pay before step plans (2026-11-25): C = 32 dgrad op 41.0 / 40.9 /
** 42.3 us at 4 / 2 / 3 stages (same process, three rounds), fwd kernel 40.0
** us at 2 stages against 37.5 at 4 (another call). */
template <typename T, bool TW> static tsp_status dispatch_igemm(const tsp_os_launch &a, int tile) {
  if (tile == 1) {
    if (a.n <= 32) return launch_igemm<T, igemm_cfg<64, 32, 32, 32, 32, 4, TW> >(a);
    if (a.n <= 64) return launch_igemm<T, igemm_cfg<64, 64, 32, 32, 32, 4, TW> >(a);
    return launch_igemm<T, igemm_cfg<64, 128, 32, 32, 64, 4, TW> >(a);
  }
  if (a.n <= 32) return launch_igemm<T, igemm_cfg<128, 32, 32, 16, 32, 3, TW> >(a); /* 8 warps, 4 blocks per SM */
  if (a.n <= 64) return launch_igemm<T, igemm_cfg<128, 64, 32, 32, 64, 4, TW> >(a);
  if (tile == 2 && a.n > 128) return launch_igemm<T, igemm_cfg<128, 256, 32, 32, 64, 3, TW> >(a);
  return launch_igemm<T, igemm_cfg<128, 128, 32, 32, 64, 4, TW> >(a);
}

tsp_status tsp_conv_igemm_check(tsp_dtype dtype, const tsp_os_launch *a) {
  if (dtype != TSP_FLOAT16 && dtype != TSP_BFLOAT16) return TSP_ERR_UNSUPPORTED;
  if (a->red % 8 != 0 || a->n % 8 != 0 || a->red <= 0 || a->n <= 0 ||
      a->volume > TSP_IGEMM_MAX_VOLUME || a->red > 0x3fffffff || a->n > 0x7fffffff ||
      a->src_rows > 0x7fffffff)
    return TSP_ERR_UNSUPPORTED;
  if (((uintptr_t)a->src | (uintptr_t)a->w) % 16 != 0 || (uintptr_t)a->out % 4 != 0)
    return TSP_ERR_UNSUPPORTED;
  if (tsp_device_cc() < 80) return TSP_ERR_UNSUPPORTED; /* mma.sync bf16, cp.async */
  return TSP_OK;
}

tsp_status tsp_conv_igemm_os(tsp_dtype dtype, const tsp_os_launch *a, int transposed_w, int tile) {
  const tsp_status ok = tsp_conv_igemm_check(dtype, a);
  if (ok != TSP_OK) return ok;
  if (a->rows <= 0 || a->tile_rows <= 0) return TSP_OK;
  switch (dtype) {
  case TSP_FLOAT16:
    return transposed_w ? dispatch_igemm<__half, true>(*a, tile) : dispatch_igemm<__half, false>(*a, tile);
  case TSP_BFLOAT16:
    return transposed_w ? dispatch_igemm<__nv_bfloat16, true>(*a, tile)
                        : dispatch_igemm<__nv_bfloat16, false>(*a, tile);
  default:
    return TSP_ERR_UNSUPPORTED;
  }
}
