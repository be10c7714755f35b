/*
** conv_wgmma.cu: forward and dgrad on Hopper's warpgroup tensor-core
** instruction (wgmma.mma_async, sm_90a), fp16/bf16 with fp32 accumulation.
** Same problem, map handling and row order as conv_implicit_gemm.cu
** (out[r] = sum_k src[map[r, k]] @ W_k, output-stationary, deterministic).
**
** Why a second kernel: at C >= 128 the layer is compute-bound and the
** mma.sync kernel keeps the tensor pipe ~27% busy (ncu, C = 256: issue-bound
** on ldmatrix and fragment traffic).  wgmma reads both operands from shared
** memory itself, so a warpgroup issues one instruction per 64 x N x 16 block
** instead of 8-32 mma.sync plus their ldmatrix.
**
** One block = two warpgroups (256 threads) computing a 128 MW x BN tile;
** warpgroup g owns tile rows [64 MW g, 64 MW (g + 1)), MW m64 blocks.  Per tile (conv_tile.cuh) the rows'
** map entries and the offsets used are listed; then a STAGES-deep cp.async
** pipeline walks (offset, BK-channel chunk) steps and each warpgroup issues
** BK / 16 wgmma per m64 block for a step unless none of the block's 64 rows
** uses the step's offset (mask-sorted rows make that frequent).
**
** Shared-memory operand layout: both operands K-major without swizzle, in
** 8 x 16-byte "core matrices": element (r, c) of a [rows x BK] stage sits at
**   (r / 8) * 8 * BK + (c / 8) * 64 + (r % 8) * 8          (elements)
** so a core matrix is 128 contiguous bytes, the next one along K is 128 bytes
** on (descriptor LBO) and the next 8 rows are 16 * BK bytes on (SBO).  With
** this layout the i-th 16-byte cp.async chunk of a stage lands at byte 16 i:
** a quarter warp writes one whole core matrix (no bank conflict), and its
** global reads are 8 rows x 16 bytes, the lanes of one warp covering 64
** contiguous bytes of each row.
** Tiles 12 and 13 (SW) use the 128-byte swizzled layout instead (BK = 64:
** row r's 128 bytes at 128 r, its chunk c at chunk c ^ (r % 8); see
** wg_desc_lo_sw128), which lets a warp copy 4 whole rows per instruction.
** Tiles 6-10 read B K-major: dgrad's w[k] is [n, red] already; forward's
** w[k] is [red, n], so conv.cu first writes w^T into the caller's workspace
** (tsp_conv_wgmma_weights, V * red * n elements: 2.2 us and a launch at
** C = 64).  The swizzled tiles 12 and 13 read the forward's w as stored,
** MN-major (BT below), and need no copy.
** Only compiled for sm_90a (TORCH_CUDA_ARCH_LIST=9.0a defines TSP_WGMMA);
** elsewhere tsp_conv_wgmma_os answers TSP_ERR_UNSUPPORTED and conv.cu falls
** back to the mma.sync kernel.
*/
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TSP_WGMMA_DEVICE 1
#endif

#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_tile.cuh"
#include "conv_wgmma_util.cuh"

#ifdef TSP_WGMMA /* the kernels exist in sm_90a builds only */

enum { WG_THREADS = 256 };

/* MW: m64 blocks per warpgroup, so a tile has BM = 128 MW rows.  SW: the
** 128-byte swizzled layout (BK = 64), whose stages start 1024-byte aligned. */
/* RING: the ring, then B's two mbarriers (16 bytes: static shared memory would not fit beside the
** device's maximum dynamic size, which tsp_raise_smem_limit sets). */
template <int MW, int BN, int BK, int STAGES, bool SW, bool RING = false> static size_t wg_smem_bytes(int volume) {
  return (size_t)STAGES * (128 * MW + BN) * BK * 2 +
         (RING ? tsp_tile_ring_smem_bytes(128 * MW, volume) + 16 : tsp_tile_smem_bytes(128 * MW, volume)) +
         (SW ? 1024 : 0);
}

/* src [src_rows, red]; w K-major: w[k] is [n, red]; out [rows, n]. */
/* PIPE: keep one step's wgmma in flight while the next step's barrier and
** loads are issued; stages then run STAGES - 2 steps ahead instead of
** STAGES - 1 (the stage read by the pending wgmma is not overwritten). */
/* SW: both operands in the 128-byte swizzled layout (wg_desc_lo_sw128): a warp's
** 32 16-byte copies then read 4 whole 128-byte row segments (one L2 request
** each) instead of 64-byte halves of 8 rows, and still write shared memory
** without bank conflicts. */
/* BT (SW only): w is the forward's [volume, red, n] as stored, so B is
** MN-major: a stage holds BN / 64 blocks of BK reduction rows x 64 channels,
** reduction row j's 128 bytes at 128 j of its block, chunk q at chunk q ^ (j % 8)
** (wg_desc_lo_sw128_mn), and wgmma reads it transposed (imm-trans-b).  A warp's
** copies still read 4 whole 128-byte row segments of w. */
/* BN = 32 (tile 13 at n <= 32, four blocks per SM: 55 KB of shared memory at
** V = 27, 64 registers): m64n32 wgmma, where BN = 64 copied and multiplied
** as many zero columns as channels at n = 32.  B holds 4 KB a stage: dgrad's
** K-major rows as at BN = 64, the forward's MN-major rows of 32 channels in
** the 64-byte swizzle (B64, wg_desc_sw64_of_lo), one 16-byte copy a thread.
** H100, lidar_198k, 3x3x3 at 0.05 m and fp16 unless said, main kernel us,
** BN = 64 -> 32 (mma.sync tile 3 in brackets), three rounds each way in one
** call (2026-11-28, session 55 call 2): subm C = 32 fwd 28.2 -> 21.8 [25.1],
** dgrad 28.4 -> 21.4 [25.6]; bf16 fwd 27.8 -> 21.3 [24.3]; 0.1 m 128 -> 32
** fwd 82.9 -> 66.0 [101.5]; 16 -> 16 fwd 21.6 -> 16.9 [24.4]; down3 C = 32
** fwd 37.8 -> 29.0 [29.4], dgrad 23.1 -> 18.0 [22.0]; down2 64 -> 32 fwd
** 12.4 -> 10.7 [15.0]; down2 C = 32 fwd 11.3 -> 9.6 [9.9], dgrad 14.7 ->
** 12.3 [11.1]; up2 C = 32 fwd 14.1 -> 12.0 [12.0].  Call 1: 64 -> 32 fwd
** 35.8 -> 29.3, dgrad of 32 -> 64 34.9 -> 29.5.
** Tried and not kept (call 5, three rounds): n = 64 as two 32-column tiles
** (each gathers the tile's rows again), bitwise equal to BN = 64 and slower:
** subm C = 64 fwd 37.9 -> 53.3, dgrad 37.5 -> 54.0; down3 fwd 47.8 -> 62.6;
** down2 fwd 15.8 -> 21.8; up2 fwd 17.6 -> 25.9. */
/* RING (wgmma_ring_kernel: tile TSP_TILE_RING with a step plan, one step
** loaded ahead): the tile's map entries stay in the plan, and a ring of 12
** columns in shared memory holds those of its first 12 used offsets, the
** later ones each copied into the slot of the column gathered before it,
** 11 steps ahead of its gather (conv_tile.cuh tsp_tile_ring_*), so the block
** needs 7.5 KB less shared memory at V = 27 and four fit an SM.  Its B (w's
** 64 x 64 box of the step) is one tensor-map copy (TMA) that thread 0 issues
** on the stage's mbarrier, and every thread waits on that barrier before the
** step's wgmma, instead of every thread's two cp.async and their addresses
** (wgmma_ring_kernel's comment: what it gained). */
template <typename T, int MW, int BN, int BK, int STAGES, bool PIPE, bool SW, bool BT, bool RING, bool PACK>
static __device__ __forceinline__ void
    wgmma_os_tile(const T *__restrict__ src, int64_t src_rows, const T *__restrict__ w,
                  const int32_t *__restrict__ map, const int32_t *__restrict__ order,
                  const int32_t *__restrict__ plan_map, int64_t rows, int64_t tile_rows, uint64_t offsets,
                  int volume, int red, int n, T *__restrict__ out, float *__restrict__ accum, int mode,
                  int splits, const int32_t *__restrict__ plan_steps, const CUtensorMap *wmap = nullptr) {
  enum { BM = 128 * MW, NT = WG_THREADS, A_STAGE = BM * BK, B_STAGE = BN * BK, ACC = BN / 2 };
  static_assert(!SW || BK == 64, "the 128-byte swizzle holds rows of 64 16-bit elements");
  static_assert(!BT || SW, "MN-major weights come in the swizzled layout only");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T *s_a = (T *)(smem_raw + (SW ? (1024 - (tsp_smem_addr(smem_raw) & 1023)) & 1023 : 0));
  T *s_b = s_a + STAGES * A_STAGE;
  static_assert(!RING || (!PIPE && STAGES == 2 && MW == 1 && SW), "the ring: one step ahead, the lean loader");
  static_assert(!PACK || (MW == 1 && SW && !RING), "packed steps come with the lean loader, entries in shared memory");
  /* B64: the forward's B at BN = 32 in the 64-byte swizzle (wg_desc_sw64_of_lo), 4 KB a stage */
  enum { B64 = BT && BN == 32 };
  static_assert(BN >= 64 || (MW == 1 && SW && !RING), "32 columns come with the lean loader");
  int32_t *s_ring = nullptr;
  const tsp_tile_smem tile = RING ? tsp_tile_ring_at(s_b + STAGES * B_STAGE, BM, volume, &s_ring)
                                  : tsp_tile_smem_at(s_b + STAGES * B_STAGE, BM, volume);
  const int32_t *s_list = tile.list, *s_rows = tile.rows;
  const uint32_t *s_groups = tile.groups;

  /* wg through a shuffle: provably warp-uniform, so the wgmma descriptors built
  ** from it stay in uniform registers (no R2UR per descriptor and step). */
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), lane = tid & 31,
            wwarp = (tid >> 5) & 3;
  const bool first_warp = __shfl_sync(0xffffffffu, tid >> 5, 0) == 0; /* RING: copies the ring's columns */
  int64_t row0;
  int n0;
  int split; /* split-K: which run of the tile's offsets this block sums */
  tsp_tile_origin_split(n, BM, BN, splits, &row0, &n0, &split);

  const bool from_steps = plan_steps != nullptr; /* a step plan (conv_tile.cuh) */
  /* RING: B's barriers b_full[stage] after the ring (wg_smem_bytes), one arrival each (thread
  ** 0's, with the copy's bytes); the tile set-up's barrier publishes their initialisation. */
  uint64_t *const b_full =
      RING ? (uint64_t *)((unsigned char *)(s_b + STAGES * B_STAGE) + tsp_tile_ring_smem_bytes(BM, volume)) : nullptr;
  if constexpr (RING)
    if (tid == 0) mb_init(&b_full[0], 1), mb_init(&b_full[1], 1);
  /* RING is launched with a step plan only (dispatch_swizzled below), so
  ** its tsp_tile_offsets branch is never taken (it would fault: the ring has
  ** no tile.nb).  The runtime test is there on purpose: with the ring's
  ** set-up alone, ptxas (nvcc 13.0) kept the step counter and the warpgroup
  ** index in ordinary registers and moved the four wgmma descriptors through
  ** R2UR each step; with it, the step loop went 222 -> 200 SASS instructions
  ** and none is an R2UR (cuobjdump).  H200, lidar_198k, fp16, main kernel us
  ** from CUDA graph replays, two rounds each in one call (2026-11-28, this
  ** and PACK's change below): subm C = 64 fwd 36.3, 36.1 -> 35.9, 35.5;
  ** down3 fwd 42.6, 42.6 -> 41.6, 41.5, dgrad 27.8, 27.9 -> 27.4, 27.4;
  ** down2 fwd 13.1, 13.1 -> 12.7, 12.7; others within 2%; sums bitwise. */
  if constexpr (RING) {
    if (from_steps)
      tsp_tile_ring_from_steps<BM, NT>(plan_steps, row0, volume, rows, tile, s_ring, first_warp);
    else
      tsp_tile_offsets<BM, NT>(map, order, plan_map, rows, tile_rows, row0, volume, offsets, src_rows, tile, split,
                               splits);
  } else if (from_steps) {
    tsp_tile_from_steps<BM, NT>(plan_steps, row0, volume, rows, src_rows, tile);
  } else {
    tsp_tile_offsets<BM, NT>(map, order, plan_map, rows, tile_rows, row0, volume, offsets, src_rows, tile, split, splits);
  }
  accum = tsp_split_accum(accum, split, rows, n);
  if (tsp_tile_adds_nothing(mode, *tile.count)) return; /* block-uniform */
  const int chunks = (red + BK - 1) / BK;
  /* PACK (tile 13 at red <= 32): one BK = 64 step holds P = 8 / cpo offsets,
  ** cpo 16-byte chunks each (red rounded up to 8, 16 or 32 channels): K rows
  ** [8 cpo s, 8 cpo (s + 1)) of step li are list entry P li + s, and the
  ** weights' K rows likewise.  Without it a red = 32 step copies and
  ** multiplies as many zeros as channels, and a tile walks twice the steps.
  ** H100, lidar_198k, subm C = 32, fp16, main kernel us, two rounds each way
  ** in one call (2026-11-28): fwd 34.3 -> 28.2, dgrad 34.2 -> 28.4 (BN = 64;
  ** with BN = 32, below, 21.4 / 21.0). */
  const int gsh = !PACK ? 3 : red <= 8 ? 0 : red <= 16 ? 1 : 2; /* log2 cpo */
  const int pk = 8 >> gsh;                                       /* P */
  const int tile_count = *tile.count; /* the used offsets */
  const int steps = PACK ? (tile_count + pk - 1) / pk : tile_count * chunks;

  /* Stage loader: chunk i of a stage (16 bytes) lands at element 8 i (file header).
  ** Tried, not kept: 0-byte cp.async zero fills instead of the branch to a shared store
  ** (what sped up conv_implicit_gemm.cu and wgrad): tile 13 at C = 64 fwd 66.0 / 65.8 ->
  ** 69.5 / 69.9 us, dgrad likewise (H200 host, same run, 2026-11-25).  The lean loader
  ** below, whose copies are fewer instructions, gained from them (session 77). */
  auto load_step = [&](int li, int c0, int stage) {
    const int k = s_list[li];
    const uint32_t used = s_groups[k]; /* m64 blocks with no row for k are skipped, never read */
    T *a_dst = s_a + stage * A_STAGE;
#pragma unroll
    for (int it = 0; it < BM * BK / 8 / NT; ++it) {
      const int i = tid + it * NT;
      /* SW: 8 lanes per row, chunk i % 8 of row i / 8, stored at chunk (i ^ r) % 8. */
      const int r = SW ? i >> 3 : (i / BK) * 8 + (i & 7);
      const int c = c0 + (SW ? i & 7 : (i >> 3) % (BK / 8)) * 8;
      if (!((used >> ((r >> 6) * 4)) & 0xFu)) continue;
      const int32_t p = tsp_tile_entry(tile, from_steps, BM, volume, r, li, k); /* RING takes load_lean */
      const bool valid = p >= 0 && c < red;
      T *dst = SW ? a_dst + r * 64 + ((i ^ r) & 7) * 8 : a_dst + 8 * i;
      tsp_cp_async16(dst, valid ? src + (int64_t)p * red + c : src, valid);
    }
    T *b_dst = s_b + stage * B_STAGE;
    const T *wk = w + (int64_t)k * red * n;
#pragma unroll
    for (int it = 0; it < (BN * BK / 8 + NT - 1) / NT; ++it) {
      const int i = tid + it * NT;
      if (i >= BN * BK / 8) break;
      if (BT) { /* 64-channel block i / (8 BK), reduction row j, chunk q */
        const int j = (i >> 3) % BK, q = i & 7, c = c0 + j, col = n0 + (i / (8 * BK)) * 64 + q * 8;
        const bool valid = c < red && col < n;
        T *dst = b_dst + (i / (8 * BK)) * BK * 64 + j * 64 + ((q ^ j) & 7) * 8;
        tsp_cp_async16(dst, valid ? wk + (int64_t)c * n + col : w, valid);
        continue;
      }
      const int j = SW ? i >> 3 : (i / BK) * 8 + (i & 7);
      const int c = c0 + (SW ? i & 7 : (i >> 3) % (BK / 8)) * 8;
      const bool valid = n0 + j < n && c < red;
      T *dst = SW ? b_dst + j * 64 + ((i ^ j) & 7) * 8 : b_dst + 8 * i;
      tsp_cp_async16(dst, valid ? wk + (int64_t)(n0 + j) * red + c : w, valid);
    }
  };

  /* The lean loader (LEAN: MW == 1 with the swizzle, tile 13 and the ring).
  ** Thread tid copies chunk tq = tid % 8 of rows tr + 32 it (tr = tid / 8) of
  ** A and of B, and for both the chunk lands at the same byte of its 32-row
  ** slab, sw_off + 4096 it: rows tr + 32 it share tr % 8, so the swizzle is a
  ** constant of the thread, and so are the m64 block of a copy (it / 2) and
  ** its stage address but for the stage's offset.  load_step rebuilt each of
  ** these a copy: its 6 copies a step at C = 64 took ~240 of the step loop's
  ** 349 instructions (cuobjdump, session-49 build), ~22 per gathered row
  ** chunk, on kernels that Nsight Compute found issue-bound (58% of issue
  ** slots busy, the integer pipe the busiest).  A gathered row's address is
  ** one wide multiply-add of its map entry and the row's bytes (red2 < 2^31:
  ** tsp_conv_wgmma_check).  The step loop: 349 -> 216 instructions, 80 -> 64
  ** registers.  H100, lidar_198k, fp16, main kernel us, three rounds each way
  ** in one call (2026-11-27), tile 13: subm C = 64 fwd 45.4 / 45.7 / 45.3 ->
  ** 39.3 / 39.1 / 39.3, dgrad 45.6 -> 39.0; down3 fwd 54.7 -> 49.0, dgrad 38.0
  ** -> 34.9; down2 fwd 18.0 -> 15.7, dgrad 18.4 -> 17.7; up2 fwd 21.6 -> 17.6,
  ** dgrad 16.3 -> 15.4; subm C = 32 fwd 41.3 -> 36.3; subm C = 128 (BN = 128,
  ** PIPE) fwd 180.8 -> 134.6, dgrad 186.9 -> 138.3.  Tile 18 (the ring): subm
  ** C = 64 fwd 50.7 -> 39.4, dgrad 50.8 -> 39.2; down3 fwd 55.9 -> 46.2, dgrad
  ** 35.0 -> 31.3; down2 fwd 17.4 -> 15.9; up2 fwd 18.0 -> 17.1, dgrad 17.1 ->
  ** 15.7.
  ** Each copy or zero fill is one cp.async (tsp_cp_async16_or_zero), not a
  ** branch to a shared store as in load_step: the packed fp16 BN = 32
  ** forward's step loop 229 -> 202 SASS instructions.  H200, lidar_198k,
  ** fp16, tile 0, main kernel us from CUDA graph replays, three processes
  ** each way alternating (session 77; sums bitwise equal): subm C = 32 fwd
  ** 20.5 / 20.6 / 20.9 -> 19.8 / 19.8 / 20.4 (dgrad within 0.1); subm C = 64
  ** (the ring) fwd 34.5 / 34.7 / 34.9 -> 33.7 / 33.7 / 33.9, dgrad 34.5 / 34.6
  ** / 34.9 -> 33.5 / 33.7 / 33.8; down2, down3 and up2 C = 64 within 0.3. */
  enum { LEAN = MW == 1 && SW };
  const int tr = tid >> 3, tq = tid & 7;
  const uint32_t sw_off = (uint32_t)(tr * 128 + ((tq ^ tr) & 7) * 16);
  const uint32_t a_sm0 = tsp_smem_addr(s_a) + sw_off, b_sm0 = tsp_smem_addr(s_b) + sw_off;
  /* B64: thread tid copies chunk tid % 4 of K row tid / 4, stored at chunk (tid % 4) ^ (row / 2 % 4) */
  const uint32_t b64_sm0 = tsp_smem_addr(s_b) + (uint32_t)((tid >> 2) * 64 + (((tid & 3) ^ (tid >> 3)) & 3) * 16);
  const int red2 = 2 * red, n2 = 2 * n;
  /* RING: the stages' B and their barriers, as shared addresses */
  const uint32_t b_stage0 = RING ? tsp_smem_addr(s_b) : 0u, bar_sm0 = RING ? tsp_smem_addr(b_full) : 0u;
  auto load_lean = [&](int li, int c0, int stage) -> uint32_t {
    /* PACK: step li's list entries are P li .. P li + P - 1; this thread's
    ** chunk tq is chunk cq of entry j (k; absent past the count). */
    const int count = *tile.count, cq = tq & ((1 << gsh) - 1);
    const int j = PACK ? pk * li + (tq >> gsh) : li;
    const bool has = !PACK || j < count;
    const int jh = has ? j : 0; /* an entry past the count reads entry 0's row and copies zeros */
    const int k = s_list[jh];
    /* m64 blocks with no row for the step's offsets are skipped, never read.
    ** PACK: the step's P entries are those of lanes tq = 0 .. 7 of each row,
    ** so the warp's OR of its lanes' words is the step's: one REDUX instead
    ** of a loop of 2 P dependent shared loads, whose trip count (from shared
    ** memory) also cost ptxas the uniform registers of the stage and the
    ** wgmma descriptors (R2UR each step).  Every lane of the warp is here:
    ** the loads are block-uniform.  Step loop, fp16 BN = 32: forward 404 ->
    ** 228 SASS instructions, dgrad 387 -> 206; main kernel us (as above):
    ** subm C = 32 fwd 21.1, 21.1 -> 20.4, 20.4, dgrad 21.2, 21.1 -> 20.2,
    ** 20.2; C = 16 fwd 17.2, 17.1 -> 16.8, 16.9, dgrad 17.3, 17.2 -> 16.5,
    ** 16.5. */
    uint32_t used = has ? s_groups[k] : 0u;
    if (PACK) used = __reduce_or_sync(0xffffffffu, used);
    /* Entry of row tr + 32 it: ent[it * es], in the layout the tile was built in. */
    const int32_t *ent = RING         ? s_ring + ((unsigned)li % TSP_STEPS_RING) * BM + tr
                         : from_steps ? tile.nb + jh * BM + tr
                                      : tile.nb + tr * volume + k;
    const int es = RING || from_steps ? 32 : 32 * volume;
    const bool c_ok = has && c0 + cq * 8 < red;
    /* RING: the entries landed unchecked; one unsigned compare tests 0 <= p < src_rows */
    const uint32_t p_lim = src_rows < 0x80000000LL ? (uint32_t)src_rows : 0x80000000u;
    const char *src_c = (const char *)(src + c0 + cq * 8);
    const uint32_t a_sm = a_sm0 + (uint32_t)stage * (A_STAGE * 2);
#pragma unroll
    for (int it = 0; it < BM * BK / 8 / NT; ++it) {
      if (!((used >> (4 * (32 * it / 64))) & 0xFu)) continue;
      const int32_t p = ent[it * es];
      const bool valid = c_ok && (RING ? (uint32_t)p < p_lim : p >= 0);
      tsp_cp_async16_or_zero(a_sm + it * 4096, src_c + (int64_t)p * red2, src, valid);
    }
    const uint32_t b_sm = b_sm0 + (uint32_t)stage * (B_STAGE * 2);
    /* The forward's weights (BT), K row rr of the step, channels col .. col + 7: PACK's channel rr % 8 cpo
    ** of entry rr / 8 cpo, else reduction row c0 + rr of k; copied when `valid`. */
    auto w_chunk = [&](int rr, int col, bool &valid) -> const char * {
      const int jb = PACK ? pk * li + (rr >> (gsh + 3)) : li, cb = PACK ? rr & ((8 << gsh) - 1) : c0 + rr;
      valid = (!PACK || jb < count) && cb < red && col < n;
      const int kb = PACK ? s_list[valid ? jb : 0] : k;
      return (const char *)(w + col) + ((int64_t)kb * red + cb) * n2;
    };
    if constexpr (RING) { /* one tensor-map copy (wmap: w's, wg_weight_map) by thread 0 */
      if (tid == 0) { /* the 64 x 64 box at (n0, c0, k) (forward) or (c0, n0, k): 8192 bytes, zeros counted */
        const uint32_t bar = bar_sm0 + 8 * (uint32_t)stage;
        mb_arrive_expect_tx_at(bar, B_STAGE * 2);
        tma_load_3d_at(b_stage0 + (uint32_t)stage * (B_STAGE * 2), wmap, BT ? n0 : c0, BT ? c0 : n0, k, bar);
      }
    } else if (B64) { /* K row tid / 4 */
      bool valid;
      const char *wc = w_chunk(tid >> 2, n0 + (tid & 3) * 8, valid);
      tsp_cp_async16_or_zero(b64_sm0 + (uint32_t)stage * (B_STAGE * 2), wc, w, valid);
    } else if (BT && PACK) { /* copy it: K row tr + 32 (it % 2) of 64-channel block it / 2 */
#pragma unroll
      for (int it = 0; it < BN / 32; ++it) {
        bool valid;
        const char *wc = w_chunk(tr + 32 * (it & 1), n0 + tq * 8 + 64 * (it >> 1), valid);
        tsp_cp_async16_or_zero(b_sm + it * 4096, wc, w, valid);
      }
    } else if (BT) { /* copy it: reduction row c0 + tr + 32 (it % 2) of 64-channel block it / 2 */
      const int col = n0 + tq * 8;
      const char *wr = (const char *)(w + col) + ((int64_t)k * red + c0 + tr) * n2;
#pragma unroll
      for (int it = 0; it < BN / 32; ++it) {
        const bool valid = c0 + tr + 32 * (it & 1) < red && col + 64 * (it >> 1) < n;
        tsp_cp_async16_or_zero(b_sm + it * 4096, wr + (int64_t)(it & 1) * 32 * n2 + (it >> 1) * 128, w, valid);
      }
    } else { /* copy it: produced channel n0 + tr + 32 it, reduction chunk cq of k (tq without PACK) */
      const char *wr = (const char *)(w + c0 + cq * 8) + ((int64_t)k * n + n0 + tr) * red2;
#pragma unroll
      for (int it = 0; it < BN / 32; ++it)
        tsp_cp_async16_or_zero(b_sm + it * 4096, wr + (int64_t)it * 32 * red2, w, c_ok && n0 + tr + 32 * it < n);
    }
    return used;
  };
  /* Returns the loaded step's groups word (LEAN), or 0 (the compute reads it from shared memory). */
  auto load = [&](int li, int c0, int stage) -> uint32_t {
    if (LEAN) return load_lean(li, c0, stage);
    load_step(li, c0, stage);
    return 0u;
  };

  float acc[MW][ACC];
#pragma unroll
  for (int m = 0; m < MW; ++m)
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[m][i] = 0.0f;

  /* wgmma descriptors' low words of stage 0 (SW): this warpgroup's A rows, and B. */
  const uint32_t a_lo0 = wg_desc_lo_sw128(s_a + MW * wg * 64 * BK);
  const uint32_t b_lo0 =
      B64 ? wg_desc_lo_sw64_mn(s_b) : BT ? wg_desc_lo_sw128_mn(s_b, BK * 64 * 2) : wg_desc_lo_sw128(s_b);

  enum { AHEAD = PIPE ? STAGES - 2 : STAGES - 1 };
  static_assert(AHEAD >= 1, "PIPE needs at least 3 stages");
  int load_li = 0, load_c0 = 0, comp_li = 0, comp_c0 = 0;
  /* A step is the next BK channels of list entry li, or entry li + 1's first.  PACK: red <= 32 <
  ** BK, so each step is the next entry's at c0 = 0, and `PACK ||` below says so at compile time
  ** (ptxas cannot know red): the lean loader's source address then depends on no step and
  ** leaves the step loop (cuobjdump, nvcc 13.0, fp16 / bf16: BN = 32 forward 204 -> 191 SASS
  ** instructions, dgrad 194 -> 175; BN = 64 253 -> 239, 232 -> 202; 64 registers, no spills;
  ** the unpacked kernels unchanged).  H200, lidar_198k, fp16, main kernel us from CUDA graph
  ** replays, three processes each way alternating (session 78; sums bitwise equal): subm C = 32
  ** fwd 20.0 / 19.9 / 20.3 -> 19.8 / 19.9 / 19.9, dgrad 19.9 / 19.7 / 20.2 -> 19.6 / 19.6 /
  ** 19.6; C = 16, the 4-channel stem and down2 C = 32 within 0.3.  Fewer instructions no longer
  ** buy much here (session 77's 229 -> 202 gave 3%).  The advance stays written out at its three
  ** places: as a helper function or lambda it cost the unpacked kernels' step loops 1-2 SASS
  ** instructions each (.peers/s78/next_step_fn.patch, untracked). */
  /* LEAN: the groups words of the steps loaded ahead, oldest first, as the
  ** loader read them: the compute then reads no list or groups word itself
  ** (two dependent shared loads a step ahead of its wgmma).  With the
  ** warp-uniform wg above, tile 13's step loop went 217 -> 188 SASS
  ** instructions (no LDS, R2UR or descriptor moves left before the HGMMA;
  ** cuobjdump, fp16 forward, 64 registers).  H100, lidar_198k, fp16, main
  ** kernel us, two rounds each way in one call (2026-11-27): tile 13 subm C =
  ** 64 fwd 39.1 -> 37.6, dgrad 39.1 -> 37.5; down3 fwd 49.0 -> 47.8, dgrad 35.0
  ** -> 34.4; down2 and up2 within 2%; C = 128 (PIPE, two steps ahead) fwd 134.0
  ** -> 124.7.  Tile 18: down3 fwd 46.2 -> 45.0, subm and up2 dgrad 1-2% slower.
  ** Tried with it, not kept: the loader's per-thread pointers hoisted out of
  ** the loop (185 instructions, but down2 / up2 5% slower: ptxas rebuilt them
  ** anyway, and the tile set-up grew). */
  uint32_t ahead[AHEAD];
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    ahead[s] = 0u;
    if (s < steps) {
      ahead[s] = load(load_li, load_c0, s);
      load_c0 += BK;
      if (PACK || load_c0 >= red) load_c0 = 0, ++load_li;
    }
    tsp_cp_async_commit();
  }

  /* RING: the barrier and parity of the step computed next, carried through the loop: worked out
  ** from the step instead, ptxas rebuilt the barrier's address each step (the step loop 227 -> 218
  ** SASS instructions; main kernel us, three processes each way alternating: down2 C = 64 fwd /
  ** dgrad 13.1 / 15.3 -> 12.8 / 15.0, up2 15.1 / 13.1 -> 14.8 / 12.8, subm and down3 C = 64
  ** within 0.1; .peers/s68 call 5) */
  uint32_t wait_bar = bar_sm0, wait_par = 0u;
  for (int step = 0; step < steps; ++step) {
    tsp_cp_async_wait<AHEAD - 1>();
    proxy_fence();
    __syncthreads(); /* step's stage landed for all; the stage loaded next is free */
    uint32_t loaded = 0u;
    if (step + AHEAD < steps) {
      loaded = load(load_li, load_c0, (step + AHEAD) % STAGES);
      /* Column load_li + slots - 1 goes to the slot of column load_li - 1, read
      ** before this step's barrier; it is gathered slots - 1 list entries on
      ** (conv_tile.cuh).  Columns below the slot count came at the tile's start. */
      if constexpr (RING)
        if (first_warp && load_c0 == 0 && load_li >= 1 && load_li + TSP_STEPS_RING - 1 < tile_count) {
          /* the record's place again, not a pointer held through the loop (64 registers) */
          int64_t r0;
          int c0_, s_;
          tsp_tile_origin_split(n, BM, BN, splits, &r0, &c0_, &s_);
          tsp_steps_col_async<BM>(tsp_steps_cols<BM>(plan_steps, r0, volume), load_li + TSP_STEPS_RING - 1,
                                  s_ring, lane);
        }
      load_c0 += BK;
      if (PACK || load_c0 >= red) load_c0 = 0, ++load_li;
    }
    tsp_cp_async_commit();

    const int stage = step % STAGES;
    /* RING: B landed.  Every thread waits, its warpgroup's rows used or not, so that no copy is in
    ** flight at the epilogue (whose staged stores reuse the stages) */
    if constexpr (RING) {
      mb_wait_at(wait_bar, wait_par);
      /* bar_sm0 is 16-byte aligned (the stages are 1024-byte aligned, the ring's bytes a multiple of
      ** 16), so bit 3 names the stage: after stage 1's barrier the next lap waits on the other parity */
      wait_par ^= (wait_bar >> 3) & 1u;
      wait_bar ^= 8u;
    }
    const uint32_t oldest = tsp_ahead_next(ahead, loaded);
    const uint32_t groups = LEAN ? oldest : s_groups[s_list[comp_li]];
    comp_c0 += BK;
    if (PACK || comp_c0 >= red) comp_c0 = 0, ++comp_li;
    /* Warpgroup wg owns 16-row groups [4 MW wg, 4 MW (wg + 1)); m64 block m of it
    ** is groups 4 (MW wg + m) .. + 3.  All tests are warpgroup-uniform. */
    bool on[MW], any = false;
#pragma unroll
    for (int m = 0; m < MW; ++m) {
      on[m] = ((groups >> (4 * (MW * wg + m))) & 0xFu) != 0;
      any |= on[m];
    }
    if (!any) {
      if (PIPE) wg_wait<0>(); /* the pending step's stage is reloaded after the next barrier */
      continue;
    }

    const T *b_s = s_b + stage * B_STAGE;
    auto issue = [&](float(&d)[ACC], int m) {
      const T *a_s = s_a + stage * A_STAGE + (MW * wg + m) * 64 * BK;
      /* SW: the descriptors' low words (conv_wgmma_util.cuh), stage 0's plus byte offsets >> 4 */
      const uint32_t a_lo = a_lo0 + (uint32_t)(stage * A_STAGE + m * 64 * BK) / 8;
      const uint32_t b_lo = b_lo0 + (uint32_t)(stage * B_STAGE) / 8;
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        if (B64) /* k16 slice ks: 16 reduction rows of 64 bytes, 1024 bytes on */
          wg_op<BN>::template run_bt<T>(d, wg_desc_of_lo(a_lo + 2 * ks), wg_desc_sw64_of_lo(b_lo + 64 * ks));
        else if (BT) /* k16 slice ks: 16 reduction rows, 2048 bytes on; 64-channel blocks BK * 128 bytes apart */
          wg_op<BN>::template run_bt<T>(d, wg_desc_of_lo(a_lo + 2 * ks), wg_desc_of_lo(b_lo + 128 * ks));
        else if (SW)
          wg_op<BN>::template run<T>(d, wg_desc_of_lo(a_lo + 2 * ks), wg_desc_of_lo(b_lo + 2 * ks));
        else
          wg_op<BN>::template run<T>(d, wg_desc(a_s + ks * 128, 128, 16 * BK),
                                     wg_desc(b_s + ks * 128, 128, 16 * BK));
      }
    };
#pragma unroll
    for (int m = 0; m < MW; ++m) acc_fence(acc[m]);
    /* No branch between a fence and its wgmma: ptxas serialises wgmma issued
    ** on a path it cannot prove uniform, so each case is straight-line code. */
    static_assert(MW == 1 || MW == 2, "one or two m64 blocks per warpgroup");
    if (MW == 1 || (on[0] && on[MW - 1])) {
      wg_fence();
#pragma unroll
      for (int m = 0; m < MW; ++m) issue(acc[m], m);
      wg_commit();
    } else if (on[0]) {
      wg_fence();
      issue(acc[0], 0);
      wg_commit();
    } else {
      wg_fence();
      issue(acc[MW - 1], MW - 1);
      wg_commit();
    }
    /* This step's stage is overwritten AHEAD steps later, after a barrier. */
    if (PIPE)
      wg_wait<1>();
    else
      wg_wait<0>();
  }
  wg_wait<0>();
#pragma unroll
  for (int m = 0; m < MW; ++m) acc_fence(acc[m]);
  tsp_cp_async_wait<0>();

  if (tsp_stage_ok(mode, out)) { /* block-uniform: plain stores, staged (conv_tile.cuh) */
    static_assert(STAGES * (BM + BN) * BK >= BM * BN, "the stages hold the staged tile");
    __syncthreads(); /* both warpgroups' wgmma are done reading the stages, which now stage the tile */
#pragma unroll
    for (int m = 0; m < MW; ++m) tsp_stage_acc<BN>(s_a + (MW * wg + m) * 64 * BN, acc[m], tid & 127);
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MW; ++m)
      tsp_stage_rows<BN, 64, 128>(s_a + (MW * wg + m) * 64 * BN, s_rows + (MW * wg + m) * 64, out, n, n0,
                                   tid & 127);
    return;
  }
  /* Epilogue: accumulator layout of conv_wgmma_ops.cuh; a segmented pass
  ** first adds the partial sums it reads (conv_tile.cuh). */
  tsp_tile_epilogue(mode, out, accum, n, [&](auto f) {
#pragma unroll
    for (int m = 0; m < MW; ++m)
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = n0 + j * 8 + (lane & 3) * 2;
        if (col >= n) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int32_t r = s_rows[(MW * wg + m) * 64 + wwarp * 16 + (lane >> 2) + h * 8];
          if (r >= 0) f(r, col, acc[m][4 * j + 2 * h], acc[m][4 * j + 2 * h + 1]);
        }
      }
  });
}

/* Tile 13 at n <= 64 keeps to 64 registers, so that a V = 8 pass (53.6 KB of
** shared memory) runs four blocks per SM.  The landed code needs no more; a
** try that hoisted the loader's pointers took 71 without this bound, and its
** down2 dgrad / up2 fwd at C = 64 went 18.1 -> 20.1 / 18.6 -> 20.0 us against
** the same code held to 64 (three blocks per SM instead of four, 2026-11-27). */
/* Tried 2026-11-28 and not kept (H100, lidar_198k, fp16, main kernel us, two
** rounds each against tile 13 in the same call; both passed test_dataflows'
** real-scan cases):
**   - tile 13 on a persistent grid (three blocks per SM walking tiles t, t +
**     grid, ...; the next tile's record head and first two columns loaded
**     while a tile runs, its first gather issued before the epilogue; 74
**     registers): subm C = 64 fwd 37.3 -> 51.0, down3 47.6 -> 62.5, down2
**     15.5 -> 19.0; only up2 fwd (17.1 -> 15.6) and down2 dgrad (17.4 ->
**     15.9) gained;
**   - 64-row half tiles on one warpgroup (128 threads, 41.5 KB, five blocks
**     per SM; block 2 t + h took half h of the plan's tile t and walked only
**     the offsets its half uses), tried because Nsight Compute found tile
**     13's warps stalled most at the step barrier (subm C = 64 fwd: 2.3
**     warps per issued instruction, then long scoreboard 1.8, wait 1.8, short
**     scoreboard 1.6; L2 48% and DRAM 28% of peak, issue slots 50% busy):
**     subm C = 64 fwd 37.5 -> 50.9, down3 47.5 -> 59.7, down2 15.4 -> 19.4,
**     up2 17.4 -> 18.8.  (It walked the tiles forward, not in tile 13's
**     reverse order, so the longest tiles came last; a half tile also keeps
**     half the bytes of a step in flight.) */
template <typename T, int MW, int BN, int BK, int STAGES, bool PIPE, bool SW, bool BT, bool PACK>
__global__ void __launch_bounds__(WG_THREADS, MW == 1 && SW && BN <= 64 ? 4 : 1)
    wgmma_os_kernel(const T *__restrict__ src, int64_t src_rows, const T *__restrict__ w,
                    const int32_t *__restrict__ map, const int32_t *__restrict__ order,
                    const int32_t *__restrict__ plan_map, int64_t rows, int64_t tile_rows, uint64_t offsets,
                    int volume, int red, int n, T *__restrict__ out, float *__restrict__ accum, int mode,
                    int splits, const int32_t *__restrict__ plan_steps) {
  wgmma_os_tile<T, MW, BN, BK, STAGES, PIPE, SW, BT, false, PACK>(src, src_rows, w, map, order, plan_map, rows,
      tile_rows, offsets, volume, red, n, out, accum, mode, splits, plan_steps);
}

/* Tile TSP_TILE_RING at n <= 64 with a step plan (tile 0 there, conv.cu
** resolve_tile): tile 13's shape with the entries in a ring of 12 columns,
** four blocks per SM (55.7 KB of shared memory at V = 27 and at most 64
** registers a thread each; tile 13 holds the tile's BM x V entries, 64.8
** KB, three blocks).  wmap: w's tensor map (wg_weight_map), which B's copies
** read (RING in wgmma_os_tile).
** Session 68 (H200, lidar_198k, fp16, main kernel us from CUDA graph replays,
** median of 5 rounds, three processes each way alternating, .peers/s68 call
** 3): B from every thread's cp.async (their addresses and the copy hazard's
** three no-op LDS each) -> one TMA copy a step: subm C = 64 fwd 36.2 / 35.5 /
** 35.7 -> 34.4 / 34.4 / 35.2, dgrad 35.5 / 35.2 / 35.2 -> 34.6 / 34.7 / 35.4;
** down3 fwd 41.8 / 41.6 / 41.7 -> 40.3 / 39.9 / 40.5, dgrad 28.0 / 27.6 / 27.7
** -> 27.5 / 26.8 / 27.4; down2 fwd 13.3 / 13.1 / 13.0 -> 13.1 / 12.7 / 12.8,
** dgrad 15.1 / 15.0 / 14.8 -> 15.3 / 15.0 / 15.2; up2 fwd within 0.1, dgrad
** 13.1 / 13.0 / 12.9 -> 12.8 / 12.5 / 12.7; sums bitwise equal.  The step loop
** went 200 -> 227 SASS instructions, ~25 of them thread 0's copy, so ~200 for
** the other threads: the barrier's address and parity cost most of what B's
** addresses had (218 with them carried through the loop, wgmma_os_tile);
** 64 -> 62 registers.
** Session 60 (H200, lidar_198k, fp16, main kernel us from CUDA graph
** replays, two rounds in one call, .peers/s60 call 3): the ring went from two
** columns (one copied every step, a step ahead) to 12, and its step loop
** from 342 to 222 SASS instructions (tile 13: 188): the column copies by
** warp 0 alone, not a loop over tid (which cost ptxas the uniform registers
** of the stage and the descriptors: R2UR each step), the record's place
** worked out again at a copy rather than held in two registers, one
** unsigned test of an entry (session 61: 200, wgmma_os_tile's set-up
** test).  Tile 13 / two-column ring / this:
** subm C = 64 fwd 36.5, 36.2 / 39.8, 39.3 / 36.3, 36.0, dgrad 36.7, 36.3 /
** 39.4, 39.4 / 35.7, 35.4; down3 fwd 45.8, 45.4 / 44.5, 44.2 / 42.6, 42.5,
** dgrad 31.6, 31.4 / 29.0, 28.8 / 28.0, 27.7; down2 fwd 13.2, 13.0 / 13.5,
** 13.4 / 13.2, 13.0, dgrad 15.7, 15.5 / 15.2, 15.2 / 15.0, 14.8; up2 fwd
** 15.8, 15.5 / 15.2, 15.3 / 15.1, 14.9, dgrad 13.5, 13.2 / 13.5, 13.7 /
** 13.2, 13.0.  Eight columns (53.7 KB): subm fwd 37.4, 37.1 (22.6% of its
** tiles use more than 8 offsets, 15.6% more than 12).  Calls 1-2 placed the
** loss of the ring before: 12 columns with the old step loop took subm fwd
** 39.1-39.6 (three blocks per SM, padded: 39.7-39.8), as slow as two
** columns, so neither the per-step copies nor the fourth block was it.
** Before (H100, 2026-11-27), tile 13 -> the two-column ring: down2 C = 64 fwd
** 17.9 -> 17.2, dgrad 18.4 -> 17.4; down3 fwd 54.5 -> 54.7, dgrad 37.8 ->
** 34.6; up2 fwd 21.5 -> 17.9, dgrad 16.2 -> 17.0; subm fwd 45.0 -> 48.5,
** dgrad 45.3 -> 48.8.
** Tried 2026-11-28 and not kept (H100, lidar_198k, fp16, main kernel us, two
** rounds, one call each; all passed test_dataflows' real-scan cases):
**   - 3 stages with two steps loaded ahead (each column copied two steps
**     before its gather, a 4-column ring; 75 KB without the 1024-byte pad,
**     three blocks per SM at 75 registers): subm C = 64 fwd 37.6 against tile
**     13's 37.5 and this kernel's 40.0; down2 fwd 16.9 / dgrad 19.9 and up2
**     fwd 20.4 against this kernel's 16.1 / 16.6 and 17.1.  Loads further
**     ahead do not pay: the C <= 64 steps do not wait on one gather's latency;
**   - 3 stages with one wgmma kept in flight (PIPE, one step ahead): subm
**     C = 64 fwd 43.0 against tile 13's 39.4, down2 fwd 18.0 against 16.4. */
enum { RING_BLOCKS = 4 };
template <typename T, bool BT>
__global__ void __launch_bounds__(WG_THREADS, RING_BLOCKS)
    wgmma_ring_kernel(const T *__restrict__ src, int64_t src_rows, const __grid_constant__ CUtensorMap wmap,
                      int64_t rows, int64_t tile_rows, int volume, int red, int n, T *__restrict__ out,
                      float *__restrict__ accum, int mode, const int32_t *__restrict__ plan_steps) {
  wgmma_os_tile<T, 1, 64, 64, 2, false, true, BT, true, false>(src, src_rows, nullptr, nullptr, nullptr, nullptr, rows,
      tile_rows, 0, volume, red, n, out, accum, mode, 1, plan_steps, &wmap);
}

/* wt[k][j][c] = w[k][c][j]: forward's [red, n] weights made K-major.  A 32 x
** 32 tile per block through shared memory (blockIdx: n tile, red tile, k), so
** both the reads along w's rows and the writes along wt's are coalesced (a
** thread per element read w with a stride of n: 4.8 us at C = 128, H100). */
enum { WG_TR = 32, WG_TR_ROWS = 8 };
template <typename T>
__global__ void __launch_bounds__(WG_TR * WG_TR_ROWS)
    wg_transpose_kernel(const T *__restrict__ w, int red, int n, T *__restrict__ wt) {
  __shared__ T s[WG_TR][WG_TR + 1];
  const int64_t base = (int64_t)blockIdx.z * red * n;
  const int j0 = blockIdx.x * WG_TR, c0 = blockIdx.y * WG_TR, tx = threadIdx.x;
  for (int y = threadIdx.y; y < WG_TR; y += WG_TR_ROWS)
    if (c0 + y < red && j0 + tx < n) s[y][tx] = w[base + (int64_t)(c0 + y) * n + j0 + tx];
  __syncthreads();
  for (int y = threadIdx.y; y < WG_TR; y += WG_TR_ROWS)
    if (j0 + y < n && c0 + tx < red) wt[base + (int64_t)(j0 + y) * red + c0 + tx] = s[tx][y];
}

template <typename T, int MW, int BN, int BK, int STAGES, bool PIPE = false, bool SW = false,
          bool BT = false, bool RING = false, bool PACK = false>
static tsp_status launch_wgmma(const tsp_os_launch &a) {
  const size_t smem = wg_smem_bytes<MW, BN, BK, STAGES, SW, RING>((int)a.volume);
  CUtensorMap wmap; /* RING: w's, which its B copies read */
  if constexpr (RING) /* n <= 64, one column tile, no split (dispatch_swizzled) */
    if (wg_weight_map(&wmap, a, BT, 64) != TSP_OK) /* no encoder: tile 13, whose B is every thread's cp.async */
      return launch_wgmma<T, MW, BN, BK, STAGES, PIPE, SW, BT, false, PACK>(a);
  static uint64_t smem_raised = 0;
  const void *kernel = RING ? (const void *)wgmma_ring_kernel<T, BT>
                            : (const void *)wgmma_os_kernel<T, MW, BN, BK, STAGES, PIPE, SW, BT, PACK>;
  tsp_status s = tsp_raise_smem_limit(kernel, smem, &smem_raised, "tsp_conv_wgmma_os");
  if (s != TSP_OK) return s;
  const int64_t tiles = ((a.tile_rows + 128 * MW - 1) / (128 * MW)) * ((a.n + BN - 1) / BN);
  const int splits = a.splits > 1 ? a.splits : 1;
  if (tiles * splits > 0x7fffffffLL) return TSP_ERR_UNSUPPORTED;
  if constexpr (RING)
    wgmma_ring_kernel<T, BT><<<(unsigned)tiles, WG_THREADS, smem, a.stream>>>(
        (const T *)a.src, a.src_rows, wmap, a.rows, a.tile_rows, (int)a.volume, (int)a.red, (int)a.n, (T *)a.out,
        a.accum, a.mode, a.steps);
  else
    wgmma_os_kernel<T, MW, BN, BK, STAGES, PIPE, SW, BT, PACK><<<(unsigned)(tiles * splits), WG_THREADS, smem,
                                                                a.stream>>>(
        (const T *)a.src, a.src_rows, (const T *)a.w, a.map, a.order, nullptr /* plan_map: conv_tile.cuh */, a.rows,
        a.tile_rows, a.offsets, (int)a.volume, (int)a.red, (int)a.n, (T *)a.out, a.accum, a.mode, splits,
        MW == 1 ? a.steps : nullptr);
  return tsp_cuda_check_launch("tsp_conv_wgmma_os");
}

/* Tile shapes (algo.tile):
**   6: 128 x BN tiles, BK = 64, 3 stages (BN = 64, 128 or 256 covers n);
**   7: 128 x BN tiles, BK = 32, 4 stages;
**   8: 256 x min(BN, 128) tiles, BK = 64, 3 stages (n > 128 takes two column
**      tiles): the weights, re-read from L2 for every (tile, offset), are most
**      of the traffic at C >= 128 (ncu: L2 77% busy with 128-row tiles), and
**      a 256-row tile of mask-sorted rows uses barely more offsets than a
**      128-row one (lidar_198k at 0.1 m: 14.9 vs 13.8 of 27), so the weight
**      bytes per output row halve;
**   9: as 8 with 4 stages and one step's wgmma kept in flight (PIPE);
**  10: as 6 with 4 stages and PIPE;
**  12, 13: 9 and 10 with both operands in the 128-byte swizzled layout (SW);
**      13 at n <= 64 has 2 stages without PIPE instead (three blocks per SM),
**      at n <= 32 32-column tiles (four);
**  18 (TSP_TILE_RING): 13, and at n <= 64 with a step plan wgmma_ring_kernel
**      (four blocks per SM).
** Tile 9 moved 3.48 GB through L2 for one C = 256 forward on lidar_198k (ncu
** lts__t_bytes) in ~1000 us, and 6-10 all took about as long: a warp's copies
** read 64-byte halves of 8 rows, two L2 requests per 128-byte row segment.
** With SW a warp reads 4 whole segments: 1.86 GB, 810 us (12), 696 us (13).
** Deeper pipelines without SW (BK = 32 with 8 stages, 6 stages of BK = 64)
** changed nothing (H100, 2026-11-23), so the copies, not latency, bound them.
** 64-row tiles on one warpgroup (three blocks per SM; 3 stages, or 4 with
** PIPE) were slower than tile 0 at every C (fwd us at C = 32 / 64 / 128 /
** 256: 110 / 108 / 285 / 1195 against 54 / 91 / 212 / 465; one run,
** 2026-11-23): not kept.  Tile 13 at C = 64 with 3 / 6 / 8 stages instead of
** 4: 81.6 / 124.8 / 125.1 us against 78.4 (one run, 2026-11-24): 6 or more
** stages leave one block per SM, and the short tiles (~7 steps at 0.05 m)
** then wait out their prologues and epilogues alone.  With the staged
** epilogue, 2 stages (one step loaded ahead, 63 KB: three blocks per SM,
** which 80 registers a thread allow) against 4 (two blocks), H100,
** lidar_198k, op call, same process, three alternating rounds, median us
** (2026-11-25): C = 64 fwd 63.4 -> 55.9, dgrad 63.6 -> 56.6; down3 C = 64 fwd
** 85.3 -> 73.6, dgrad 49.2 -> 46.6; down2 C = 64 dgrad 32.8 -> 25.2; up2 C =
** 64 dgrad 26.6 -> 24.6 (the forwards of down2 and up2, host-bound, 36.7
** either way); 3 stages without PIPE (two blocks) 63.5 / 83.8.  The short
** tiles want more of them in flight, not deeper pipelines. */
/* The swizzled tiles 12 (9 swizzled) and 13 (10 swizzled); BT: w as the
** forward stores it, read MN-major. */
template <typename T, bool BT> static tsp_status dispatch_swizzled(const tsp_os_launch &a, int tile) {
  const int64_t n = a.n;
  if (tile == 12)
    return n <= 64 ? launch_wgmma<T, 2, 64, 64, 4, true, true, BT>(a)
                   : launch_wgmma<T, 2, 128, 64, 4, true, true, BT>(a);
  if (n <= 32 && tile == 13) /* 32-column tiles (wgmma_os_tile's B64), packed at red <= 32 */
    return a.red <= 32 ? launch_wgmma<T, 1, 32, 64, 2, false, true, BT, false, true>(a)
                       : launch_wgmma<T, 1, 32, 64, 2, false, true, BT>(a);
  if (n <= 64 && a.red <= 32 && tile == 13) /* 2, 4 or 8 offsets a K step (wgmma_os_tile's PACK) */
    return launch_wgmma<T, 1, 64, 64, 2, false, true, BT, false, true>(a);
  if (n <= 64) /* three blocks per SM; four with a step plan's entries in a ring (wgmma_ring_kernel) */
    return tile == TSP_TILE_RING && a.steps != nullptr && a.splits <= 1
               ? launch_wgmma<T, 1, 64, 64, 2, false, true, BT, true>(a)
               : launch_wgmma<T, 1, 64, 64, 2, false, true, BT>(a);
  if (n <= 128) return launch_wgmma<T, 1, 128, 64, 4, true, true, BT>(a);
  return launch_wgmma<T, 1, 256, 64, 4, true, true, BT>(a);
}

template <typename T> static tsp_status dispatch_wgmma(const tsp_os_launch &a, int tile, int k_major) {
  const int64_t n = a.n;
  if (!k_major) return dispatch_swizzled<T, true>(a, tile); /* tsp_conv_wgmma_os checked the tile */
  switch (tile) {
  case 6:
    if (n <= 64) return launch_wgmma<T, 1, 64, 64, 4>(a);
    if (n <= 128) return launch_wgmma<T, 1, 128, 64, 3>(a);
    return launch_wgmma<T, 1, 256, 64, 3>(a);
  case 7:
    if (n <= 64) return launch_wgmma<T, 1, 64, 32, 4>(a);
    if (n <= 128) return launch_wgmma<T, 1, 128, 32, 4>(a);
    return launch_wgmma<T, 1, 256, 32, 4>(a);
  case 8:
    if (n <= 64) return launch_wgmma<T, 2, 64, 64, 3>(a);
    return launch_wgmma<T, 2, 128, 64, 3>(a);
  case 9:
    if (n <= 64) return launch_wgmma<T, 2, 64, 64, 4, true>(a);
    return launch_wgmma<T, 2, 128, 64, 4, true>(a);
  case 10:
    if (n <= 64) return launch_wgmma<T, 1, 64, 64, 4, true>(a);
    if (n <= 128) return launch_wgmma<T, 1, 128, 64, 4, true>(a);
    return launch_wgmma<T, 1, 256, 64, 4, true>(a);
  default: /* 12, 13, TSP_TILE_RING */
    return dispatch_swizzled<T, false>(a, tile);
  }
}

#endif /* TSP_WGMMA */

size_t tsp_conv_wgmma_workspace(int64_t volume, int64_t red, int64_t n) {
#ifdef TSP_WGMMA
  return (size_t)(volume * red * n) * 2;
#else
  (void)volume, (void)red, (void)n;
  return 0;
#endif
}

int tsp_conv_wgmma_available(void) {
#ifdef TSP_WGMMA
  return tsp_device_cc() == 90;
#else
  return 0;
#endif
}

tsp_status tsp_conv_wgmma_check(tsp_dtype dtype, const tsp_os_launch *a, int tile) {
#ifndef TSP_WGMMA
  (void)dtype, (void)a, (void)tile;
  return TSP_ERR_UNSUPPORTED;
#else
  if (tsp_is_ws_tile(tile)) return tsp_conv_wgmma_ws_check(dtype, a, tile);
  if (!wg_launch_ok(dtype, a) || ((tile < 6 || tile > 13) && tile != TSP_TILE_RING) || tile == TSP_TILE_TF32)
    return TSP_ERR_UNSUPPORTED;
  if ((a->n > 256 && tile != 8 && tile != 9 && tile != 12) || (uintptr_t)a->w % 16 != 0)
    return TSP_ERR_UNSUPPORTED;
  if (a->red > 0x3fffffff) return TSP_ERR_UNSUPPORTED; /* the lean loader's row bytes 2 red fit an int */
  /* 256-row tiles with 4 stages of 128 columns leave room for the map rows of
  ** V <= 32 offsets in 227 KB of shared memory (wg_smem_bytes). */
  if ((tile == 9 || tile == 12) && a->n > 64 && a->volume > 32) return TSP_ERR_UNSUPPORTED;
  if (tsp_device_cc() != 90) return TSP_ERR_UNSUPPORTED; /* sm_90a code runs on sm_90 only */
  return TSP_OK;
#endif
}

/* Forward's w [volume, red, n] made K-major into wt (tsp_conv_wgmma_workspace bytes). */
tsp_status tsp_conv_wgmma_weights(tsp_dtype dtype, const tsp_os_launch *a, void *wt) {
#ifndef TSP_WGMMA
  (void)dtype, (void)a, (void)wt;
  return TSP_ERR_UNSUPPORTED;
#else
  if (wt == NULL || (uintptr_t)wt % 16 != 0) return TSP_ERR_UNSUPPORTED;
  if (a->volume * a->red * a->n <= 0) return TSP_OK;
  if (a->volume > 65535 || a->red > 65535LL * WG_TR || a->n > 0x7fffffffLL) return TSP_ERR_UNSUPPORTED;
  const dim3 grid((unsigned)((a->n + WG_TR - 1) / WG_TR), (unsigned)((a->red + WG_TR - 1) / WG_TR),
                  (unsigned)a->volume);
  const dim3 block(WG_TR, WG_TR_ROWS);
  if (dtype == TSP_FLOAT16)
    wg_transpose_kernel<__half><<<grid, block, 0, a->stream>>>((const __half *)a->w, (int)a->red,
                                                               (int)a->n, (__half *)wt);
  else
    wg_transpose_kernel<__nv_bfloat16><<<grid, block, 0, a->stream>>>(
        (const __nv_bfloat16 *)a->w, (int)a->red, (int)a->n, (__nv_bfloat16 *)wt);
  return tsp_cuda_check_launch("tsp_conv_wgmma_weights: transpose w");
#endif
}

int tsp_conv_wgmma_reads_mn(int tile) {
  return tile == 12 || tile == 13 || tile == TSP_TILE_RING || tsp_is_ws_tile(tile);
}

/* One launch; a->w is K-major ([volume, n, red]: k_major != 0), or for tiles
** 12-17 also the forward's [volume, red, n] (k_major == 0). */
tsp_status tsp_conv_wgmma_os(tsp_dtype dtype, const tsp_os_launch *a, int tile, int k_major) {
#ifndef TSP_WGMMA
  (void)dtype, (void)a, (void)tile, (void)k_major;
  return TSP_ERR_UNSUPPORTED;
#else
  if (tsp_is_ws_tile(tile)) return tsp_conv_wgmma_ws_os(dtype, a, tile, k_major);
  const tsp_status ok = tsp_conv_wgmma_check(dtype, a, tile);
  if (ok != TSP_OK) return ok;
  if (!k_major && !tsp_conv_wgmma_reads_mn(tile)) return TSP_ERR_ARGUMENT;
  if (a->rows <= 0 || a->tile_rows <= 0) return TSP_OK;
  switch (dtype) {
  case TSP_FLOAT16:
    return dispatch_wgmma<__half>(*a, tile, k_major);
  case TSP_BFLOAT16:
    return dispatch_wgmma<__nv_bfloat16>(*a, tile, k_major);
  default:
    return TSP_ERR_UNSUPPORTED;
  }
#endif
}
