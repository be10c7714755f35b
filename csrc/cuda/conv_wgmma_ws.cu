/*
** conv_wgmma_ws.cu: the output-stationary forward and dgrad of
** conv_wgmma.cu, warp-specialized (algo.tile 14, 15 and 16; sm_90a, fp16/bf16,
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
**     for absent neighbours, in the 128-byte swizzled layout (wg_desc_lo_sw128),
**     rows of a 64-row block no row of which uses the offset not copied;
**     each producer thread's copies arrive on the stage's `full` barrier when
**     they land (cp.async.mbarrier.arrive.noinc);
**   - B, the weights: tensor-map copies (TMA, the copy engine) straight
**     from w, swizzled and zero-filled past n, red and V by the hardware, so
**     no thread computes B addresses: dgrad's w [V, n, red] lands K-major,
**     the forward's w [V, red, n] MN-major (blocks of 64 reduced x 64
**     produced channels), which its wgmma reads transposed (BT).
**     Before 2026-11-26 a weight image kernel wrote a K-major copy of w
**     first and one bulk copy moved a stage of it: 2.4-5.9 us and a launch
**     per pass (H100, fwd / dgrad at C = 128: 3.9 / 2.4; C = 256: 5.9 /
**     4.3), partly hidden by a programmatic dependent launch.
** A consumer warpgroup waits for `full`, issues 4 wgmma (k16 each) unless
** none of its 64 rows uses the step's offset, keeps one step in flight
** (wgmma.wait_group 1) and then frees the previous step's stage (`empty`).
** Every consumer warp waits on every stage even when it skips the step, and
** each consumer warp (not warpgroup) arrives on `empty`.  Why: the four warps
** of a warpgroup meet only inside a wgmma; through the steps it skips (C =
** 256: one unused offset is 4 steps, a whole lap of the stages) warp 0 ran
** ahead, its arrival let the producers refill the stage, and a sibling warp
** still waiting on `full` then saw the barrier two phases on, which its
** parity wait cannot tell from none: it waited for one more phase, fell a lap
** behind and, at the tile's end, waited for a phase that never came.  That
** was the hang of 2026-11-24 (MinkUNet's tuner, batch 4, a hybrid forward of
** a 42197-row 128 -> 256 layer).
**
** Tile 16 (ping-pong) keeps the producers and stages but gives each
** consumer warpgroup whole tiles, every other one of the block, which it
** builds itself; see the PP branch of the kernel.  Its two accumulators per
** thread hold at most 128 columns, so above 128 produced channels it runs in
** 128-column tiles (ws_bn), and tile 17 is the same kernel in 64-column
** tiles: narrower tiles for passes with few row tiles (conv.cu
** resolve_tile).  With a step plan it takes the row tiles in the plan's
** schedule, the most offsets first (torchsp.h):
** lidar_198k, H100, main kernel, stride-2 K = 3 C = 128 fwd 77.5 -> 66.5 us,
** subm C = 128 98.6 -> 94.0 (with the refined order, session 30).  The
** schedule made tile 15 (C = 256) and the all-warps kernels (C <= 64) 1-5%
** slower there, so they keep walking the tiles from the last to the first.
** A plain (unrefined) plan has no schedule (-1 words) and the kernel then
** reads none: plain plans, main kernel, two rounds, 2026-11-26, up2 C = 128
** fwd 31.1 / 31.4 -> 30.5 / 30.6 us, subm C = 128 104.8 / 105.1 -> 103.7 /
** 104.2, down3 C = 128 89.6 / 90.0 -> 87.9 / 88.5 (the lookups' cost).
*/
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TSP_WGMMA_DEVICE 1
#endif

#include <stdio.h>

#include <cuda.h> /* CUtensorMap and its encoder's types only: the encoder is fetched at run time */

#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_tile.cuh"
#include "conv_wgmma_util.cuh"

#ifdef TSP_WGMMA /* the kernels exist in sm_90a builds only */

/* ------------------------------------------------------------ kernel --- */

enum { WS_BM = 128, WS_BK = 64, WS_CONSUMERS = 256, WS_STAGES = 4, WS_TILE_BAR = 1 };
/* algo.tile of the ping-pong consumers: 16 at up to 128 columns a block, 17 at 64 */
enum { WS_PINGPONG_TILE = 16, WS_PINGPONG_NARROW_TILE = 17 };
enum { WS_SMEM_MAX = 232448 }; /* sm_90's dynamic shared memory per block */

static int ws_pingpong(int tile) { return tile == WS_PINGPONG_TILE || tile == WS_PINGPONG_NARROW_TILE; }

/* Columns per block for n produced channels, and so B's boxes (wg_weight_map):
** tiles 14 and 15 up to 256; the ping-pong tile 16 up to 128
** (two m64nBN accumulators per consumer thread), column tiles above; tile 17
** 64.  Why narrower tiles: a layer with fewer 128-row tiles than the GPU has
** SMs (a U-Net's deep levels) leaves SMs idle at full width, and the longest
** tile sets the time; column tiles multiply the blocks without the fp32
** slabs of split-K, at the price of gathering each row once per column tile. */
static int ws_bn_max(int64_t n) { return n <= 64 ? 64 : n <= 128 ? 128 : 256; }
static int ws_bn(int tile, int64_t n) {
  const int bn = ws_bn_max(n);
  if (tile == WS_PINGPONG_NARROW_TILE) return 64;
  return tile == WS_PINGPONG_TILE && bn > 128 ? 128 : bn;
}

/* Stages, their barriers, the tile barriers and `tbufs` tile buffers (conv_tile.cuh). */
static size_t ws_smem_bytes(int bn, int stages, int volume, int tbufs) {
  return 1024 /* stage alignment */ + (size_t)stages * (WS_BM + bn) * WS_BK * 2 +
         (size_t)stages * 16 /* full, empty */ + 80 /* tile_full, tile_free, mma_done, g_next .. next_rec */ +
         (size_t)tbufs * tsp_tile_smem_bytes(WS_BM, volume);
}

/* The ping-pong consumers' staged epilogue (tsp_stage_acc): one 64 x bn block of
** 16-bit elements per warpgroup, after the tile buffers (128-byte aligned). */
static size_t ws_stage_bytes(int bn) { return 128 + 2 * (size_t)64 * bn * 2; }

/* Ping-pong registers per thread after the launch's 168 (setmaxnreg; 128 x 56
** + 256 x 224 = 64512 of the SM's 65536): the consumers hold two accumulators
** (128 floats at n = 128) and build tiles, and spilled at 168 (ptxas: 124
** bytes); the producers only copy. */
enum { WS_PP_PRODUCER_REGS = 56, WS_PP_CONSUMER_REGS = 224 };
/* Tile 15 at BN = 256 (setmaxnreg, 128 x 184 + 256 x 160 = 64512): the
** producers, which list tiles, take registers from the consumers, whose
** m64n256 accumulator is 128 floats.  At the launch's 168 for all, ptxas
** spilled 56 bytes; with these counts none.  H100, lidar_198k at 0.1 m, C =
** 256, main kernel us, 12 rounds of 20 calls each way in one call
** (2026-11-25): fwd median 303 against 315, dgrad 317 against 322 (rounds
** spread 296-335 either way: clocks moved 1785-1950 MHz).  Noticed
** 2026-11-26: nvcc 13.0's ptxas spills in the producers' code of this
** instantiation (fp16 forward: 192 bytes with 64-bit row pointers, 160 with
** the 32-bit row offsets; all local loads and stores lie after the
** producers' setmaxnreg), and 200 or 232 producer registers leave that
** unchanged.  Not kept: the rows' presence as a bit mask instead of a word
** a row (128 bytes of spills), against the wide multiply-add alone: subm C =
** 256 fwd 263.7 / 273.6 / 275.7 -> 260.6 / 260.4 / 276.2 us, C = 128 fwd
** 82.6-83.0 -> 85.0-85.5 (H100, main kernel, three rounds each way). */
enum { WS_WIDE_PRODUCER_REGS = 184, WS_WIDE_CONSUMER_REGS = 160 };
template <bool INC, int N> static __device__ __forceinline__ void ws_set_max_regs() {
#ifdef TSP_WGMMA_DEVICE
  if (INC)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
  else
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

/* One k16 wgmma of a stage: acc += A (64 K-major rows) B (K-major rows of
** produced channels, or with BT the forward's MN-major blocks of 64 reduced x
** 64 produced channels, 8 KB apart, read transposed), given the low words of
** their descriptors at k = 0 (wg_desc_of_lo; the kernel's a_lo0, b_lo0).  A
** k16 slice starts 32 bytes on in A and in K-major B, 16 rows of 128 bytes
** on in MN-major B. */
template <int BN, bool BT, typename T, int N>
static __device__ __forceinline__ void ws_k16(float (&acc)[N], uint32_t a_lo, uint32_t b_lo, int ks) {
  const uint64_t a = wg_desc_of_lo(a_lo + ks * (16 * 2 >> 4));
  if (BT)
    wg_op<BN>::template run_bt<T>(acc, a, wg_desc_of_lo(b_lo + ks * (16 * 64 * 2 >> 4)));
  else
    wg_op<BN>::template run<T>(acc, a, wg_desc_of_lo(b_lo + ks * (16 * 2 >> 4)));
}

/* What A's second 64-row half adds to a descriptor's low word (its byte offset >> 4). */
enum { WS_A_HALF_DESC = 64 * WS_BK * 2 >> 4 };

/* One ping-pong step: the stage's 4 k16 wgmma into the accumulators of the
** 64-row halves that use its offset (U0: rows 0-63 into acc0, U1: rows 64-127
** into acc1), as one commit group, keeping one step in flight.  The kernel
** calls one instantiation per case, each a straight run of fence, wgmma,
** commit and wait. */
template <int BN, bool U0, bool U1, bool BT, typename T, int N>
static __device__ __forceinline__ void ws_pp_step(float (&acc0)[N], float (&acc1)[N], uint32_t a_lo,
                                                  uint32_t b_lo) {
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < WS_BK / 16; ++ks) {
    if (U0) ws_k16<BN, BT, T>(acc0, a_lo, b_lo, ks);
    if (U1) ws_k16<BN, BT, T>(acc1, a_lo + WS_A_HALF_DESC, b_lo, ks);
  }
  wg_commit();
  wg_wait<1>(); /* the previous step's wgmma has read its stage */
}

/* Ping-pong: the barrier of consumer warpgroup wg's 128 threads, hardware
** barrier 2 + wg (the id in a register; the tile builds, templated on it,
** name 2 and 3 as constants). */
static __device__ __forceinline__ void ws_wg_sync(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
}

/* The index of the next tile a block takes: word 1 of a tile buffer's count. */
static __device__ __forceinline__ int32_t *ws_tile_index(const tsp_tile_smem &t) { return t.count + 1; }

/* Which 16-row groups of the tile use its li-th listed offset (0 past the list). */
static __device__ __forceinline__ uint32_t ws_groups_of(const tsp_tile_smem &tile, int li, int count) {
  return li < count ? tile.groups[tile.list[li]] : 0u;
}

/* A consumer's step g of its tile: returns which 16-row groups use the step's
** offset (`next`, read a step ahead), advances (li, ch) through the tile's
** (offset, 64-channel chunk) steps, and waits until the step's stage is full.
** Why a step ahead: the two dependent shared loads were on the consumers'
** path from one step's wgmma to the next (Nsight Compute, ping-pong tile at
** C = 128, 2026-11-26); issued before the wait, they land during it. */
template <int STAGES>
static __device__ __forceinline__ uint32_t ws_step_wait(const tsp_tile_smem &tile, int &li, int &ch, int chunks,
                                                        int count, uint32_t &next, uint64_t *full, uint32_t g) {
  const uint32_t groups = next;
  if (++ch == chunks) {
    ch = 0;
    next = ws_groups_of(tile, ++li, count);
  }
  mb_wait(&full[g % STAGES], (g / STAGES) & 1);
  return groups;
}

/* The tile counter is one 64-bit word: the low half counts the tiles taken,
** the high half the takers (the one thread of a block, or of each ping-pong
** warpgroup, that reads the counter) that have left.  All of a launch's
** atomics act on that one word, so they fall in one order that keeps each
** thread's own order: the taker whose leaving completes the count comes after
** every take, and puts the word back to zero.  So a counter the stream keeps
** (tsp_conv_problem.tile_counter) is zero again for its next launch, with no
** memset and no fence.  (A separate word for the leavers, ordered by
** __threadfence, cost ~1.2 us at the end of a counted pass: H100, 2026-11-27.) */
static __device__ __forceinline__ int ws_take(int *next_tile) {
  return (int)(uint32_t)atomicAdd((unsigned long long *)next_tile, 1ull);
}

static __device__ __forceinline__ void ws_leave(int *next_tile, int takers) {
  const unsigned long long was = atomicAdd((unsigned long long *)next_tile, 1ull << 32);
  if ((int)(was >> 32) == takers - 1) atomicExch((unsigned long long *)next_tile, 0ull);
}

/* src [src_rows, red]; wmap: the tensor map of w (launch_ws: [V, red, n] with
** BT, the forward's, else [V, n, red]); out [rows, n]; next_tile: a counter
** the blocks take tiles from where `counted` (launch_ws decides, ws_counted:
** more tiles than each block's first, PP: first two), zero at launch: 8
** bytes, 8-aligned, tiles taken and takers gone (ws_take, ws_leave), which
** the launch leaves zero; `tiles` tiles in all, `tbufs` (1 or 2) tile buffers.
** Split-K (splits > 1): tile t is run t % splits of row/column tile t / splits
** (tsp_tile_origin_split's order), its sums in accum + run * rows * n.
** PP (tile 16, needs tbufs == 2): ping-pong consumers, see the consumers' PP branch;
** staged (PP only): ws_stage_bytes follow the tile buffers, for the staged epilogue. */
template <typename T, int BN, int STAGES, int PW, int MINB, bool PP, bool BT>
__global__ void __launch_bounds__(WS_CONSUMERS + 32 * PW, MINB)
    wgmma_ws_kernel(const T *__restrict__ src, int64_t src_rows, const __grid_constant__ CUtensorMap wmap,
                    const int32_t *__restrict__ map, const int32_t *__restrict__ order, const int32_t *__restrict__ plan_map,
                    int64_t rows, int64_t tile_rows, uint64_t offsets, int volume, int red,
                    int n, T *__restrict__ out, float *__restrict__ accum, int mode,
                    int *__restrict__ next_tile, int counted, int tiles, int tbufs, int splits,
                    int staged, const int32_t *__restrict__ plan_steps) {
  enum { BM = WS_BM, BK = WS_BK, PT = 32 * PW, NT = WS_CONSUMERS + PT };
  const bool from_steps = plan_steps != nullptr; /* a step plan (conv_tile.cuh; conv.cu: plain passes only) */
  /* tile 15 at BN = 256: registers to the producers (WS_WIDE_*_REGS) */
  enum { WIDE_REGS = !PP && PW == 4 && BN == 256 };
  enum { A_STAGE = BM * BK, B_STAGE = BN * BK, ACC = BN / 2 };
  static_assert(BM * BK / 8 % PT == 0, "producer threads split a stage's copies evenly");
  static_assert(sizeof(T) == 2, "16-bit elements (wg_elem_addr16)");
  static_assert(!PP || PW == 4, "setmaxnreg's counts assume one producer warpgroup");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T *s_a = (T *)(smem_raw + ((1024 - (tsp_smem_addr(smem_raw) & 1023)) & 1023));
  T *s_b = s_a + STAGES * A_STAGE; /* stages are multiples of 1024 bytes */
  uint64_t *full = (uint64_t *)(s_b + STAGES * B_STAGE), *empty = full + STAGES;
  uint64_t *tile_full = empty + STAGES, *tile_free = tile_full + 2, *mma_done = tile_free + 2;
  /* PP: g_next[i % 2], tile i's first step (a warpgroup writes tile i + 1's
  ** while warps of its own may still read tile i's: two slots); next_idx[wg],
  ** each warpgroup's next tile index, and next_rec[wg] its step plan's
  ** schedule entry (tsp_steps_sched_entry) */
  int32_t *g_next = (int32_t *)(mma_done + 2), *next_idx = g_next + 2, *next_rec = g_next + 4;
  const size_t tile_bytes = tsp_tile_smem_bytes(BM, volume);
  unsigned char *tile_base = (unsigned char *)(mma_done + 2) + 32;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mb_init(&full[s], PT + 1); /* every producer thread's copies, plus B's expect_tx */
      /* one arrival per consumer warp (PP: of the one warpgroup that owns the step's tile) */
      mb_init(&empty[s], PP ? 4 : WS_CONSUMERS / 32);
    }
    for (int b = 0; b < 2; ++b) {
      mb_init(&tile_full[b], PP ? 128 : PT); /* every thread that built the tile, its writes done */
      /* every consumer thread done reading the tile (PP: every producer thread) */
      mb_init(&tile_free[b], PP ? PT : WS_CONSUMERS);
      mb_init(&mma_done[b], 128); /* PP: each thread of warpgroup b, done waiting on its tile's stages */
    }
  }
  __syncthreads(); /* publishes the barriers; the last block-wide barrier */
  const int chunks = (red + BK - 1) / BK;

  if (tid >= WS_CONSUMERS) { /* producer warps */
    if (PP) ws_set_max_regs<false, WS_PP_PRODUCER_REGS>();
    else if (WIDE_REGS) ws_set_max_regs<true, WS_WIDE_PRODUCER_REGS>();
    /* Producer thread p copies 16-byte chunk cc of rows r_it = p / 8 + (PT / 8) it
    ** of every stage.  It reads its rows' map entries once per offset, not once
    ** per 64-channel chunk, all before the first copy, and keeps their source
    ** offsets in registers.  Why: Nsight Compute put these warps ~93% busy in
    ** a loop of ~30 instructions per copy (a shared load, its wait, 64-bit
    ** address math) while the consumers waited on `full` ~60% of their time
    ** (C = 256, tile 15, H100, 2026-11-24). */
    enum { CPT = BM * BK / 8 / PT, RSTEP = PT / 8 }; /* copies per thread per stage; row step */
    const int p = tid - WS_CONSUMERS, cc = p & 7, r0 = p >> 3;
    /* Every row r_it has r_it % 8 == r0 % 8 (RSTEP is a multiple of 8): one swizzled slot. */
    const int dst0 = r0 * 64 + ((cc ^ r0) & 7) * 8;
    uint32_t g = 0; /* steps issued by this block so far: stage g % STAGES, round g / STAGES */
    for (int i = 0;; ++i) {
      const int tb = i % tbufs;
      const tsp_tile_smem tile = tsp_tile_smem_at(tile_base + tb * tile_bytes, BM, volume);
      int t;
      int64_t row0;
      int n0;
      if (PP) { /* tile i is built by consumer warpgroup tb (the consumers' PP branch) */
        mb_wait(&tile_full[tb], (i / 2) & 1);
        t = *ws_tile_index(tile);
        if (t >= tiles) break; /* so are all later tiles */
        tsp_tile_origin_of(t / splits, tiles / splits, n, BM, BN, &row0, &n0);
      } else {
        mb_wait(&tile_free[tb], ((i / tbufs) & 1) ^ 1); /* its previous tile's epilogue is done */
        if (p == 0)
          *ws_tile_index(tile) = i == 0 ? (int)blockIdx.x : counted ? (int)gridDim.x + ws_take(next_tile) : tiles;
        tsp_tile_sync<WS_TILE_BAR, PT>();
        t = *ws_tile_index(tile);
        if (t >= tiles) { /* no tile left: tell the consumers, and stop */
          mb_arrive(&tile_full[tb]);
          break;
        }
        tsp_tile_origin_of(t / splits, tiles / splits, n, BM, BN, &row0, &n0);
        if (from_steps)
          tsp_tile_from_steps_by<BM, PT, WS_TILE_BAR>(plan_steps, row0, volume, rows, src_rows, tile, p);
        else
          tsp_tile_offsets_by<BM, PT, WS_TILE_BAR>(map, order, plan_map, rows, tile_rows, row0, volume, offsets,
                                                    src_rows, tile, p, t % splits, splits);
        mb_arrive(&tile_full[tb]); /* release: the consumers see the tile */
      }
      const int steps = *tile.count * chunks;
      /* Per offset: row r_it's source as an element offset in src (chunk cc of
      ** its first 64 channels; row 0 when absent, then read as 0 bytes), its
      ** bytes (16, or 0 when absent) and which 64-row blocks use the offset at
      ** all (bit b of `blocks`; row r_it is in block RSTEP it / 64, a constant
      ** of the unrolled loop).  32-bit offsets (tsp_conv_wgmma_ws_check: src
      ** holds fewer than 2^32 - 64 elements) where 64-bit pointers were: half
      ** the registers the rows hold through the steps, one wide multiply-add a
      ** copy.  H100, lidar_198k, main kernel us, three rounds each way in one
      ** call (2026-11-26): subm C = 128 fwd 87.2 / 86.2 / 86.2 -> 84.6 / 84.6
      ** / 84.7, dgrad 87.0 / 85.5 / 86.0 -> 83.8 / 83.8 / 83.6; C = 128 at
      ** 0.4 m 29.6 -> 28.7, dgrad 29.7 -> 28.1; C = 256 (tile 15) fwd 279.6 /
      ** 290.0 / 280.1 -> 272.7 / 267.5 / 272.0; C = 256 at 0.8 m 48.3 ->
      ** 46.8, dgrad 47.4 -> 45.6; down3 and up2 C = 128 within 1%. */
      uint32_t from[CPT];
      uint32_t have[CPT], blocks = 0;
      int li = 0, ch = 0;
      for (int step = 0; step < steps; ++step, ++g) {
        const uint32_t s = g % STAGES;
        const int k = tile.list[li];
        if (ch == 0) { /* a new offset */
          const uint32_t used = tile.groups[k];
          blocks = 0;
#pragma unroll
          for (int b = 0; b < BM / 64; ++b) blocks |= ((used >> (4 * b)) & 0xFu) ? 1u << b : 0u;
          int32_t q[CPT];
#pragma unroll
          for (int it = 0; it < CPT; ++it) q[it] = tsp_tile_entry(tile, from_steps, BM, volume, r0 + RSTEP * it, li, k);
          /* Unsigned, the row clamped to 0 when absent (then read as 0 bytes):
          ** the signed 64-bit form took ~17 instructions a row (Nsight Compute,
          ** 2026-11-26). */
#pragma unroll
          for (int it = 0; it < CPT; ++it) {
            have[it] = q[it] >= 0 ? 16u : 0u;
            from[it] = (uint32_t)max(q[it], 0) * (uint32_t)red + (uint32_t)(cc * 8);
          }
        }
        const int c0 = ch * BK;
        const uint32_t bytes = c0 + cc * 8 < red ? 16 : 0; /* 0: the chunk is past red, zeros */
        mb_wait(&empty[s], ((g / STAGES) & 1) ^ 1); /* round 0 passes on the fresh barrier */
        /* B first, the larger copy in flight while the rows are issued, by lane 0
        ** of each producer warp in turn: the warp that issues it runs ~25
        ** instructions more that step, and `full` waits for the slowest warp. */
        if (p == 32 * (int)(s % PW)) {
          mb_arrive_expect_tx(&full[s], B_STAGE * 2); /* zero-filled bytes count too */
          if (BT) {
#pragma unroll
            for (int b = 0; b < BN / 64; ++b) /* [64 reduced x 64 produced] blocks */
              tma_load_3d(s_b + s * B_STAGE + b * 64 * BK, &wmap, n0 + 64 * b, c0, k, &full[s]);
          } else {
            tma_load_3d(s_b + s * B_STAGE, &wmap, c0, n0, k, &full[s]); /* [BN produced x 64 reduced] */
          }
        }
        /* Straight-line copies: Nsight Compute put these warps ~90% busy in
        ** a per-copy branch, select and pointer rebuild, and the consumers
        ** 31% of their samples waiting for them (C = 256, 2026-11-24). */
        const uint32_t a_dst = tsp_smem_addr(s_a + s * A_STAGE + dst0);
        const uint64_t src_c0 = (uint64_t)(src + c0);
#pragma unroll
        for (int it = 0; it < CPT; ++it)
          if ((blocks >> (RSTEP * it / 64)) & 1u) /* rows of an unused block are not copied */
            tsp_cp_async16_bytes(a_dst + RSTEP * it * 64 * 2, wg_elem_addr16(src_c0, from[it]), have[it] & bytes);
        mb_arrive_cp_async(&full[s]);
        if (++ch == chunks) ch = 0, ++li;
      }
      if (PP) mb_arrive(&tile_free[tb]); /* done reading the tile: its warpgroup may build the next */
    }
    tsp_cp_async_wait<0>(); /* leave no copy of this thread in flight */
    if (!PP && counted && p == 0) ws_leave(next_tile, (int)gridDim.x);
    return;
  }

  const int wg = tid >> 7, lane = tid & 31, wwarp = (tid >> 5) & 3;
  /* wgmma descriptors' low words of stage 0's A and B (ws_k16; B MN-major with
  ** BT, 64 x 64 blocks 8 KB apart) and what a stage adds (its byte offset >> 4) */
  enum { A_DESC_STAGE = A_STAGE * 2 >> 4, B_DESC_STAGE = B_STAGE * 2 >> 4 };
  const uint32_t a_lo0 = wg_desc_lo_sw128(s_a),
                 b_lo0 = BT ? wg_desc_lo_sw128_mn(s_b, WS_BK * 64 * 2) : wg_desc_lo_sw128(s_b);
  if (PP) {
    ws_set_max_regs<true, WS_PP_CONSUMER_REGS>();
    /* Ping-pong (tile 16): warpgroup wg owns every other tile of
    ** the block, all 128 rows of it (two m64 accumulators), and builds it in
    ** tile buffer wg itself, so one warpgroup's epilogue and next tile's
    ** build run while the other multiplies, and the producers only copy.
    ** Why: Nsight Compute put 15% of tile 15's consumer samples at C = 128 in
    ** the epilogue and 14% on the wait for the producers' next tile, with the
    ** tensor cores idle (2026-11-25).
    ** The stages stay one ring in the producers' order, so a warpgroup waits
    ** on its tile's stages only once the other has waited on all of the
    ** previous tile's (mma_done): every earlier phase of each `full` has then
    ** completed, and its parity wait cannot take an older phase for the one it
    ** wants.  Tile indices rise with i in a block: tiles 0 and 1 are blockIdx.x
    ** and gridDim.x + blockIdx.x (or 2 gridDim.x - 1 - blockIdx.x: `snake`
    ** below), tile i + 2 is taken from the counter before
    ** tile i's mma_done, that is before tile i + 1's warpgroup takes its own.
    ** So once one index is past the end so are the later ones: its warpgroup
    ** hands it to the producers (tile_full) and both stop.  A warpgroup
    ** rebuilds its buffer only after the producers are done reading it
    ** (tile_free), even when a tile has no step to wait on. */
    const int wt = tid & 127; /* thread in the warpgroup */
    const tsp_tile_smem tile = tsp_tile_smem_at(tile_base + wg * tile_bytes, BM, volume);
    /* With a step plan the warpgroup takes the row tiles in its schedule, the
    ** longest first (torchsp.h; plans come without split-K).  Tile i + 2's
    ** entry is asked for when its index is (hand_over) and stored here only
    ** once this tile's epilogue is done, so its latency hides behind it. */
    int32_t sched_ahead = -1;
    /* a plan without a schedule (not refined) has -1 there: no lookups then */
    const bool sched = from_steps && tsp_steps_sched_entry(plan_steps, 0, tiles, n, BM, BN, volume) >= 0;
    /* With a schedule (longest tiles first) and fewer than 2 G tiles for G
    ** blocks, the first two tiles of a block are all its work, and the second
    ** ones go the other way round: block b takes schedule positions b and
    ** 2 G - 1 - b, so the blocks with the longest first tiles get the shortest
    ** second ones, or none.  H100, main kernel, two rounds against b + G in one
    ** call (2026-11-26, refined plans): subm C = 128 at 0.4 m (218 row tiles)
    ** fwd 46.1 / 45.8 -> 35.9 / 34.8 us, dgrad 45.6 / 45.1 -> 34.2 / 34.2;
    ** C = 256 at 0.8 m (166 tiles of 128 columns) 71.3 / 70.8 -> 51.6 / 51.9.
    ** A first version that did so always lost with more tiles (C = 256 at
    ** 0.4 m, 436: 108.7 -> 116.5) and on the plain walk, whose tile lengths
    ** are not sorted (down3 128 -> 256 at 0.4 m dgrad 26.6 -> 37.1). */
    const bool snake = sched && tiles < 2 * (int)gridDim.x;
    if (wt == 0) {
      next_idx[wg] = wg == 0 ? (int)blockIdx.x : snake ? 2 * (int)gridDim.x - 1 - (int)blockIdx.x
                                                       : (int)gridDim.x + (int)blockIdx.x;
      next_rec[wg] = sched ? tsp_steps_sched_entry(plan_steps, next_idx[wg], tiles, n, BM, BN, volume) : -1;
    }
    for (int j = 0;; ++j) { /* this warpgroup's j-th tile, the block's tile 2 j + wg */
      const int i = 2 * j + wg;
      if (wt == 0 && j > 0) next_rec[wg] = sched_ahead;
      /* the epilogue's reads of the buffer are done and next_idx[wg] written */
      ws_wg_sync(wg);
      const int t = next_idx[wg];
      const int32_t rec = next_rec[wg]; /* read before the tile build's barrier, as t */
      if (j > 0) mb_wait(&tile_free[wg], (j - 1) & 1); /* the producers are done with tile i - 2 */
      if (wt == 0) *ws_tile_index(tile) = t;
      if (t >= tiles) { /* the producers stop on this index; so does this warpgroup */
        mb_arrive(&tile_full[wg]);
        break;
      }
      int64_t row0;
      int n0;
      if (from_steps)
        tsp_tile_origin_sched(rec, t, tiles, n, BM, BN, &row0, &n0);
      else
        tsp_tile_origin_of(t / splits, tiles / splits, n, BM, BN, &row0, &n0);
      if (from_steps && wg == 0)
        tsp_tile_from_steps_by<BM, 128, 2>(plan_steps, row0, volume, rows, src_rows, tile, wt);
      else if (from_steps)
        tsp_tile_from_steps_by<BM, 128, 3>(plan_steps, row0, volume, rows, src_rows, tile, wt);
      else if (wg == 0)
        tsp_tile_offsets_by<BM, 128, 2>(map, order, plan_map, rows, tile_rows, row0, volume, offsets,
                                        src_rows, tile, wt, t % splits, splits);
      else
        tsp_tile_offsets_by<BM, 128, 3>(map, order, plan_map, rows, tile_rows, row0, volume, offsets,
                                        src_rows, tile, wt, t % splits, splits);
      mb_arrive(&tile_full[wg]); /* release: the producers see the tile */
      if (i > 0) mb_wait(&mma_done[wg ^ 1], ((i - 1) / 2) & 1); /* tile i - 1's stages all seen */
      /* Tile i + 2's index, taken now: tile i + 1's was taken before tile i -
      ** 1's mma_done, and tile i + 1's warpgroup takes its next only after
      ** this tile's, so indices still rise with i.  Why here and not at
      ** hand_over: the other warpgroup starts its tile only once hand_over's
      ** mma_done arrives, and there thread 0 waited out the atomic's round
      ** trip with the tensor cores idle.  Here it runs beside this tile's steps
      ** (measured, and what was tried beside it: the end of this file's notes). */
      const int taken = wt == 0 && counted ? 2 * (int)gridDim.x + ws_take(next_tile) : tiles;
      uint32_t g = i > 0 ? (uint32_t)g_next[i & 1] : 0u;
      float *const acc_out = tsp_split_accum(accum, t % splits, rows, n);
      const int count = *tile.count, steps = count * chunks;
      /* this warpgroup's next tile index (i + 2, taken above) and the other's first step of tile i + 1 */
      const auto hand_over = [&](uint32_t g_end) {
        if (wt == 0) {
          next_idx[wg] = taken;
          g_next[(i + 1) & 1] = (int32_t)g_end;
          if (sched) sched_ahead = tsp_steps_sched_entry(plan_steps, taken, tiles, n, BM, BN, volume);
        }
        /* every thread: each arrival releases its own read of g_next[i % 2], which
        ** the other warpgroup writes next (tile i + 2's first step) */
        mb_arrive(&mma_done[wg]);
      };
      if (tsp_tile_adds_nothing(mode, count)) {
        hand_over(g);
        continue;
      }
      float acc0[ACC], acc1[ACC];
#pragma unroll
      for (int e = 0; e < ACC; ++e) acc0[e] = 0.0f, acc1[e] = 0.0f;
      int li = 0, ch = 0;
      uint32_t next_groups = ws_groups_of(tile, 0, count);
      for (int step = 0; step < steps; ++step, ++g) {
        const uint32_t s = g % STAGES;
        const uint32_t groups = ws_step_wait<STAGES>(tile, li, ch, chunks, count, next_groups, full, g);
        proxy_fence(); /* the cp.async (generic proxy) writes, seen through the barrier, to wgmma */
        const uint32_t a_lo = a_lo0 + s * A_DESC_STAGE, b_lo = b_lo0 + s * B_DESC_STAGE;
        /* Which 64-row halves use the offset (warpgroup-uniform; the tile lists
        ** only used offsets, so at least one).  Each case is one straight run of
        ** fence, wgmma, commit and wait: wgmma under a branch of its own inside
        ** one commit group made ptxas serialize them all (C7520). */
        const int use = ((groups & 0xFu) ? 1 : 0) | ((groups & 0xF0u) ? 2 : 0);
        acc_fence(acc0);
        acc_fence(acc1);
        if (use == 3)
          ws_pp_step<BN, true, true, BT, T>(acc0, acc1, a_lo, b_lo);
        else if (use == 1)
          ws_pp_step<BN, true, false, BT, T>(acc0, acc1, a_lo, b_lo);
        else
          ws_pp_step<BN, false, true, BT, T>(acc0, acc1, a_lo, b_lo);
        acc_fence(acc0);
        acc_fence(acc1);
        if (step > 0 && lane == 0) mb_arrive(&empty[(g - 1) % STAGES]);
      }
      hand_over(g); /* the other warpgroup may wait on the next tile's stages */
      wg_wait<0>();
      acc_fence(acc0);
      acc_fence(acc1);
      if (steps > 0 && lane == 0) mb_arrive(&empty[(g - 1) % STAGES]);
      if (staged && tsp_stage_ok(mode, out)) { /* warpgroup-uniform: plain stores, staged (conv_tile.cuh) */
        T *const buf = (T *)(((uintptr_t)tile_base + 2 * tile_bytes + 127) & ~(uintptr_t)127) + wg * 64 * BN;
        tsp_stage_acc<BN>(buf, acc0, wt);
        ws_wg_sync(wg);
        tsp_stage_rows<BN, 64, 128>(buf, tile.rows, out, n, n0, wt);
        ws_wg_sync(wg); /* buf read: rows 64-127 next */
        tsp_stage_acc<BN>(buf, acc1, wt);
        ws_wg_sync(wg);
        tsp_stage_rows<BN, 64, 128>(buf, tile.rows + 64, out, n, n0, wt);
        continue; /* the loop's first barrier orders these reads of buf before the next tile's writes */
      }
      /* Epilogue, in runs of 4 column groups (16 pairs of a thread) that first
      ** add what a segmented pass reads back (tsp_tile_epilogue's two sweeps),
      ** then write.  Why runs: with both accumulators live, one read sweep over
      ** all 64 pairs holds 128 loaded floats too (it spilled at 168 registers);
      ** a run's loads still overlap, and stores wait only between runs.
      ** `half`, `jj` and `h` are constants of the unrolled loops. */
      const bool reads = tsp_tile_reads(mode);
      const int wmode = tsp_tile_store_mode(mode);
      int32_t rr[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) rr[q] = tile.rows[(q >> 1) * 64 + wwarp * 16 + (lane >> 2) + (q & 1) * 8];
      /* f(at, v0, v1) on the in-range pairs of one run: column groups j0 .. j0 + 3 of one half */
      const auto each_pair = [&](float *acc, int half, int j0, auto &&f) {
#pragma unroll
        for (int jj = j0; jj < j0 + 4; ++jj) {
          const int col = n0 + jj * 8 + (lane & 3) * 2;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int32_t r = rr[2 * half + h];
            if (r >= 0 && col < n) f((int64_t)r * n + col, acc[4 * jj + 2 * h], acc[4 * jj + 2 * h + 1]);
          }
        }
      };
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float *const acc = half == 0 ? acc0 : acc1;
#pragma unroll
        for (int j0 = 0; j0 < BN / 8; j0 += 4) {
          if (reads)
            each_pair(acc, half, j0, [&](int64_t at, float &v0, float &v1) { tsp_tile_read2(mode, out, acc_out, at, &v0, &v1); });
          each_pair(acc, half, j0, [&](int64_t at, float &v0, float &v1) {
            tsp_tile_write2(wmode, out, acc_out, at, v0, v1);
          });
        }
      }
    }
    if (counted && wt == 0) ws_leave(next_tile, 2 * (int)gridDim.x);
    return;
  }
  if (WIDE_REGS) ws_set_max_regs<false, WS_WIDE_CONSUMER_REGS>();
  uint32_t g = 0; /* as the producers count */
  for (int i = 0;; ++i) {
    const int tb = i % tbufs;
    const tsp_tile_smem tile = tsp_tile_smem_at(tile_base + tb * tile_bytes, BM, volume);
    mb_wait(&tile_full[tb], (i / tbufs) & 1);
    const int t = *ws_tile_index(tile);
    if (t >= tiles) break;
    int64_t row0;
    int n0;
    tsp_tile_origin_of(t / splits, tiles / splits, n, BM, BN, &row0, &n0);
    float *const acc_out = tsp_split_accum(accum, t % splits, rows, n);
    const int count = *tile.count, steps = count * chunks;
    if (tsp_tile_adds_nothing(mode, count)) {
      mb_arrive(&tile_free[tb]);
      continue;
    }
    float acc[ACC];
#pragma unroll
    for (int e = 0; e < ACC; ++e) acc[e] = 0.0f;
    int li = 0, ch = 0;
    uint32_t next_groups = ws_groups_of(tile, 0, count);
    for (int step = 0; step < steps; ++step, ++g) {
      const uint32_t s = g % STAGES;
      const uint32_t groups = ws_step_wait<STAGES>(tile, li, ch, chunks, count, next_groups, full, g);
      if ((groups >> (4 * wg)) & 0xFu) { /* warpgroup-uniform */
        proxy_fence(); /* the cp.async (generic proxy) writes, seen through the barrier, to wgmma */
        acc_fence(acc);
        const uint32_t a_lo = a_lo0 + s * A_DESC_STAGE + wg * WS_A_HALF_DESC, b_lo = b_lo0 + s * B_DESC_STAGE;
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) ws_k16<BN, BT, T>(acc, a_lo, b_lo, ks);
        wg_commit();
        wg_wait<1>(); /* the previous step's wgmma has read its stage */
      } else {
        wg_wait<0>();
      }
      acc_fence(acc);
      if (step > 0 && lane == 0) mb_arrive(&empty[(g - 1) % STAGES]);
    }
    wg_wait<0>();
    acc_fence(acc);
    /* The tile's last stage is free: the producers may already be filling
    ** stages with the next tile while this epilogue writes. */
    if (steps > 0 && lane == 0) mb_arrive(&empty[(g - 1) % STAGES]);

    /* Epilogue: accumulator layout of conv_wgmma_ops.cuh; a segmented pass
    ** first adds the partial sums it reads (conv_tile.cuh). */
    tsp_tile_epilogue(mode, out, acc_out, n, [&](auto f) {
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = n0 + j * 8 + (lane & 3) * 2;
        if (col >= n) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int32_t r = tile.rows[wg * 64 + wwarp * 16 + (lane >> 2) + h * 8];
          if (r >= 0) f(r, col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        }
      }
    });
    mb_arrive(&tile_free[tb]); /* this thread is done with the tile buffer */
  }
}

/* The persistent grid's blocks per wave (launch_ws), MINB blocks per SM. */
static int64_t ws_per_wave(int minb) {
  const int sms = tsp_device_sms();
  return (int64_t)(sms > 0 ? sms : 1) * minb;
}

/* Whether the blocks take tiles from the counter (the kernel's `counted`, with
** gridDim.x = min(tiles, per_wave)): more tiles than each block's first (ping-pong:
** first two).  Only then does a pass need the counter, and a launch to zero it:
** a U-Net's deep levels (few tiles) need neither. */
static int ws_counted(int64_t tiles, bool pp, int64_t per_wave) { return tiles > (pp ? 2 : 1) * per_wave; }

/* cuTensorMapEncodeTiled, fetched from the driver once (no link to libcuda:
** torch's extension build links the runtime only); NULL when unavailable. */
typedef CUresult (*ws_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                 const cuuint64_t *, const cuuint32_t *, const cuuint32_t *,
                                 CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                 CUtensorMapFloatOOBfill);
static ws_encode_fn ws_encoder(void) {
  static ws_encode_fn fn = NULL;
  static int asked = 0; /* the answer is fixed for the process */
  if (!asked) {
    void *f = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess) (void)cudaGetLastError(); /* the query's own error, not a launch's */
    fn = e == cudaSuccess && q == cudaDriverEntryPointSuccess ? (ws_encode_fn)f : NULL;
    asked = 1;
  }
  return fn;
}

/* The tensor maps this host thread encoded last, by what they encode: w's
** address, its dims (which give the pitches) and the box's second extent;
** the other fields of the encoding are constants.  Why: a layer's weight stays
** at one address from call to call (an optimizer steps it in place), and the
** encoder is a driver call on the host in every pass: 2.2 us a call through
** ctypes on the H100 machine's host (2026-11-26).  Measured end to end, a
** pass's host time stayed within that host's noise (forward op calls, host
** us a call, medians of three processes each way: C = 128 at 0.4 m 14.9
** against 16.1 without, down2 C = 128 18.1 / 17.8, C = 256 at 0.8 m 16.1 /
** 15.4).  A map
** is only a description of the address and extents, so an entry that outlives
** its tensor is still exactly what a new encoding of that key would give.
** Per thread: no lock, and a thread's first pass still encodes (the retry
** for a thread without a current context stays on that path). */
typedef struct {
  const void *w;       /* w's address; NULL: an empty slot */
  cuuint64_t dims[3];  /* innermost first, as encoded */
  cuuint32_t box1;     /* the box's extent along dims[1] */
  CUtensorMap map;     /* the encoding */
} ws_map_memo;
enum { WS_MAP_MEMOS = 8 };
static thread_local ws_map_memo ws_map_memos[WS_MAP_MEMOS];
static thread_local int ws_map_next; /* the slot the next new encoding takes (round robin) */

static ws_map_memo *ws_map_lookup(const void *w, const cuuint64_t dims[3], cuuint32_t box1) {
  for (int i = 0; i < WS_MAP_MEMOS; ++i) {
    ws_map_memo *m = &ws_map_memos[i];
    if (m->w == w && m->dims[0] == dims[0] && m->dims[1] == dims[1] && m->dims[2] == dims[2] &&
        m->box1 == box1)
      return m;
  }
  return NULL;
}

static void ws_map_remember(const void *w, const cuuint64_t dims[3], cuuint32_t box1, const CUtensorMap *map) {
  ws_map_memo *m = &ws_map_memos[ws_map_next];
  ws_map_next = (ws_map_next + 1) % WS_MAP_MEMOS;
  m->w = w;
  for (int d = 0; d < 3; ++d) m->dims[d] = dims[d];
  m->box1 = box1;
  m->map = *map;
}

/* The tensor map of w that B's copies read (conv_wgmma_util.cuh): here, and
** for conv_wgmma.cu's ring, whose w is the same [V, red, n] or [V, n, red]. */
tsp_status wg_weight_map(CUtensorMap *map, const tsp_os_launch &a, int bt, int bn) {
  const cuuint64_t inner = (cuuint64_t)(bt ? a.n : a.red), outer = (cuuint64_t)(bt ? a.red : a.n);
  const cuuint64_t dims[3] = {inner, outer, (cuuint64_t)a.volume};
  const cuuint64_t pitches[2] = {inner * 2, inner * outer * 2}; /* bytes, dims 1 and 2 */
  const cuuint32_t box[3] = {64, (cuuint32_t)(bt ? 64 : bn), 1}, unit[3] = {1, 1, 1};
  ws_map_memo *const hit = ws_map_lookup(a.w, dims, box[1]);
  if (hit != NULL) {
    *map = hit->map;
    return TSP_OK;
  }
  const ws_encode_fn encode = ws_encoder();
  if (encode == NULL) return tsp_cuda_check(cudaErrorNotSupported, "wg_weight_map: cuTensorMapEncodeTiled");
  CUresult r = CUDA_SUCCESS;
  for (int attempt = 0; attempt < 2; ++attempt) {
    r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, (void *)a.w, dims, pitches, box, unit,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_ERROR_INVALID_CONTEXT) break;
    /* The encoder is a driver call and needs a current context.  A host thread
    ** whose first CUDA work is this pass has none: autograd's device thread in a
    ** backward, whose device guard skips cudaSetDevice when the device already is
    ** the thread's (H100, 2026-11-26: a bench whose first layer was C = 128 failed
    ** in conv_dgrad).  cudaSetDevice (CUDA 12) and cudaFree(0) make the device's
    ** primary context current; then once more. */
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaSetDevice(dev) != cudaSuccess || cudaFree(0) != cudaSuccess) break;
  }
  if (r == CUDA_SUCCESS) {
    ws_map_remember(a.w, dims, box[1], map);
    return TSP_OK;
  }
  char where[128];
  snprintf(where, sizeof where, "wg_weight_map: the tensor map of w (cuTensorMapEncodeTiled returned %d)", (int)r);
  return tsp_cuda_check(cudaErrorInvalidValue, where);
}

template <typename T, int BN, int STAGES, int PW, int MINB, bool PP, bool BT>
static tsp_status launch_ws(const tsp_os_launch &a) {
  const int tbufs = ws_smem_bytes(BN, STAGES, (int)a.volume, 2) <= WS_SMEM_MAX ? 2 : 1;
  if (PP && tbufs != 2) return TSP_ERR_UNSUPPORTED; /* tsp_conv_wgmma_ws_check refuses it first */
  /* the staged epilogue where its buffers fit beside the rest (V <= 63 at n = 128) */
  const int staged = PP && ws_smem_bytes(BN, STAGES, (int)a.volume, tbufs) + ws_stage_bytes(BN) <= WS_SMEM_MAX;
  const size_t smem = ws_smem_bytes(BN, STAGES, (int)a.volume, tbufs) + (staged ? ws_stage_bytes(BN) : 0);
  static uint64_t smem_raised = 0;
  tsp_status s = tsp_raise_smem_limit((const void *)wgmma_ws_kernel<T, BN, STAGES, PW, MINB, PP, BT>, smem,
                                      &smem_raised, "tsp_conv_wgmma_ws");
  if (s != TSP_OK) return s;
  const int splits = a.splits > 1 ? a.splits : 1;
  const int64_t tiles = ((a.tile_rows + WS_BM - 1) / WS_BM) * ((a.n + BN - 1) / BN) * splits;
  if (tiles > 0x3fffffffLL) return TSP_ERR_UNSUPPORTED; /* gridDim.x + counter stay int */
  /* A persistent grid: one block per SM (MINB per SM) takes tiles from the
  ** counter, and its producers list tile i + 1 into the second tile buffer
  ** while the consumers finish tile i.  C = 256, H100: 390.9 us for the main
  ** kernel against 409-412 with one block per tile (2026-11-24). */
  const int64_t per_wave = ws_per_wave(MINB);
  const int64_t blocks = tiles < per_wave ? tiles : per_wave;
  const int counted = ws_counted(tiles, PP, per_wave);
  if (counted && a.tile_counter == NULL) return TSP_ERR_ARGUMENT;
  CUtensorMap wmap;
  s = wg_weight_map(&wmap, a, BT, BN);
  if (s != TSP_OK) return s;
  if (counted && !a.counter_clean) { /* a workspace counter: the only launch spent on it */
    s = tsp_cuda_check(cudaMemsetAsync(a.tile_counter, 0, 2 * sizeof(int32_t), a.stream),
                       "tsp_conv_wgmma_ws: zero the tile counter");
    if (s != TSP_OK) return s;
  }
  wgmma_ws_kernel<T, BN, STAGES, PW, MINB, PP, BT><<<(unsigned)blocks, WS_CONSUMERS + 32 * PW, smem, a.stream>>>(
      (const T *)a.src, a.src_rows, wmap, a.map, a.order, tsp_os_plan_map(&a), a.rows, a.tile_rows, a.offsets,
      (int)a.volume, (int)a.red, (int)a.n, (T *)a.out, a.accum, a.mode, a.tile_counter, counted, (int)tiles, tbufs,
      splits, staged, a.steps);
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
** and tile 15 is tile 0 for n > 64 (conv.cu resolve_tile).  (An earlier
** tile 15, BN <= 128 at two blocks per SM, measured 144 / 271 / 868.)
** With the producers reading map entries once per offset (2026-11-24, one
** run each): tile 15 at C = 256 fwd 407 us, dgrad 407 (before, same day:
** 462 / 463).  A 256-row variant (two m64 blocks per consumer warpgroup,
** n <= 128) measured 213 vs 205 for tile 12 at C = 128 and 140 vs 85 for
** tile 13 at C = 64 in the same run: not kept.  On the persistent grid
** (launch_ws), 2026-11-24, one run with FlexGEMM: C = 256 fwd 408.9, dgrad
** 408.8 (FlexGEMM 605.5); C = 64 / 128 as tile 15: 143.9 / 231.3 against
** 83.5 / 200.5 for tiles 13 / 12, which stay tile 0 there.  One block per
** tile instead (while the hang of the file header was not understood): the
** main kernel 409-412 us at C = 256, the weight image 11.4 -> 4-6 us (16-byte
** pieces, 2026-11-24).  Straight-line producer copies (2026-11-24, one run,
** fwd op): C = 256 420 -> 312-338 us, C = 128 231 -> 157, C = 64 145 -> 112
** (tile 13: 84); 6 stages at C = 128 and 8 at C = 64 changed nothing, nor
** did freeing each stage before the next step's wgmma (wgmma.wait_group 0);
** two blocks per SM at C = 64 (3 stages): 102.
** Tried 2026-11-25 and not kept (H100, lidar_198k, main kernel us, two
** rounds against this code in the same run; each passed the ws tests, the
** last three also compute-sanitizer memcheck and racecheck):
**   - 256-row blocks (two 64-row blocks per consumer warpgroup, one commit
**     group per block, 3 stages at n = 128), to halve the weights' L2
**     traffic: Nsight Compute at C = 128 gave 612 MB through L2 instead of
**     722, but 143.7 / 145.5 against 130.7 / 131.2; C = 64 70-71 against
**     67 for tile 13.  L2 is 48% busy on this kernel at C = 128: its limit
**     is latency, not L2 bandwidth;
**   - the next tile built once STAGES steps of this one are issued, not
**     after its last copy: C = 128 130 -> 152, C = 256 304 -> 466 (the copies
**     wait for the build while the consumers drain the stages);
**   - a 13th warp that builds tiles a buffer ahead (Nsight Compute put 14%
**     of the consumer warps' samples at C = 128 on the wait for the next
**     tile): C = 128 130 -> 177, C = 64 77 -> 143.  One warp builds a tile
**     in four passes, slower than the tiles go, and 13 warps cap registers
**     at 128 (one SM sub-partition holds four of them);
**   - an epilogue that tests the mode once and reads its two map rows
**     before the column loop (Nsight Compute put 15% of the consumer warps'
**     samples at C = 128 in the epilogue, on per-pair row loads and mode
**     branches; the kernel's shared loads went 216 -> 92): C = 128 130.2 ->
**     134.8, C = 64 (tile 13) 67.2 -> 68.5, C = 32 (mma.sync) 52.4 -> 51.3;
**   - the tile counter read a tile ahead (its atomic issued while the
**     current tile is built, 2026-11-25): main kernel C = 128 fwd 129.4 /
**     130.1 -> 132.5 / 132.3, dgrad 129.2 / 130.2 -> 131.7 / 132.1.
** Tile 16, ping-pong (2026-11-25, same run, two rounds, main kernel us):
**   - first with the producers still building every tile: C = 128 fwd 129.9 /
**     130.8 against 130.2 / 130.2 for tile 15, C = 64 75.9 / 75.6 against
**     67.0 / 67.7 for tile 13: hiding the epilogue alone gained nothing;
**   - with each consumer warpgroup building its own tiles while the other
**     multiplies (the producers only copy; setmaxnreg 56 / 224, no spills):
**     C = 128 fwd 115.4 / 114.4 against 130.1 / 129.2 for tile 15, dgrad
**     114.9 / 114.0 against 130.2 / 129.9; C = 64 fwd 65.3 / 65.2 against
**     66.9 / 67.9 for tile 13, dgrad 65.4 / 65.3 against 66.3 / 67.1.  So
**     the producers' tile builds, not the epilogue, held the tensor cores
**     back; tile 16 is tile 0 for 64 < n <= 128 (conv.cu resolve_tile; at
**     n = 64 the weight image it wrote first, before 2026-11-26, cost more
**     than it saved);
**   - Nsight Compute's stall samples (C = 64 fwd, 2026-11-25): the producer
**     warps spend ~27% of their samples waiting on tile_full (the next tile
**     not built yet), the active consumers ~20% on `full`.  Tiles built two
**     ahead instead (four tile buffers, each warpgroup rebuilding a buffer
**     after its epilogue with the block's tile i + 4) passed the tests and
**     compute-sanitizer, but were slower, op call in the same run, three
**     rounds (us): C = 128 fwd 130.4-130.6 against 115.4-116.1, dgrad
**     130.0-132.2 against 121.7-123.0; C = 64 fwd 72.0-72.4 against
**     68.4-69.3.  The extra 29 KB of tile buffers leaves less L1 for the
**     tile builds' map loads (the carveout follows the shared memory), one
**     suspect not yet measured;
**   - more stages (2026-11-25, op call, same process, three rounds, us):
**     n = 64 with 4 / 6 / 8 stages, C = 64 fwd 70.2 / 71.0 / 70.7, down3
**     C = 64 99.9 / 100.3 / 99.8; n = 128 with 4 / 5 / 6, C = 128 fwd 118.8
**     / 123.3 / 120.6, down3 C = 128 105.4 / 108.0 / 106.0: the copies
**     already run far enough ahead.
** Where the time goes (2026-11-26, H100, main kernel us, builds with
** timing-only switches that skip parts after the first lap of stages):
** subm C = 128 at 0.1 m fwd 93.9; no copies 89.0, no wgmma 71.2, neither
** 55.1, and with no epilogue stores either 48.0.  So half the kernel is the
** flow (tile builds, counter, barriers), and of that ~38 of 53 us scale with
** the steps (every tile cut to one step: 14.8): ~240 ns of barrier round
** trips per (offset, 64-channel) step, against ~350 ns of wgmma in a full
** 128 x 128 x 64 step.  Not the cause, each tried: one `full` arrival per
** producer warp instead of per thread (flow 57.4 against 54.2; lagged by two
** steps on real data, full kernel 112.5 against 100.9), the consumers'
** proxy fence (55.0 against 54.7), the producers' map-entry loads (51.8).
** L2 is 57% busy (Nsight Compute), so the weights' traffic is not it either
** (skipping B's copies: 92.4 -> 89.9).
** Fewer, larger steps, tried next and not kept (2026-11-26, session 35): the
** ping-pong tile in 128-channel steps (two 64-channel sub-blocks a stage, 3
** stages, one barrier round trip per offset at C = 128; the fp64 tests passed),
** main kernel, two rounds each way in one build, fwd: subm C = 128 92.4 / 92.7
** -> 101.3 / 100.6, down2 C = 128 26.6 -> 37.4, down3 65.8 -> 77.4, up2 31.7
** -> 50.7, C = 128 at 0.4 m 31.7 -> 33.8, only C = 256 at 0.8 m faster (51.7
** -> 49.3); dgrad alike.  Half the round trips took no time off, so their
** count is not the per-step cost either.  Also not kept, same day: this kernel
** as a programmatic dependent launch of the kernel before it (griddepcontrol
** .wait ahead of every global access): op calls back to back, event us,
** medians of three processes each way, C = 128 at 0.4 m fwd 33.95 against
** 34.35, subm C = 128 101.9 / 101.5, C = 256 at 0.8 m 54.8 / 54.7, while
** cudaLaunchKernelEx and the capture query added host time (subm C = 128 fwd
** 25.6 against 15.9 us a call); with an event recorded between calls, as
** tools/bench.py times them, no kernel precedes it to overlap.
** Nsight Compute's source view, same day (subm C = 128 fwd, 99.5 us under
** the profiler; 20814 warpgroup steps, 158 per SM): 94% of the steps use
** both 64-row halves (8 HGMMA); per step and warp the consumers execute ~160
** instructions (~95 of them rebuild the wgmma descriptors) and the producers
** ~170 for their 8 cp.async (~20 per 16-byte copy: 64-bit addresses, the
** zero-fill predicates, map entries every other step); the issue slots are
** 37% busy, the stalls mostly long scoreboard and fixed-latency waits.  The
** consumers re-test `full` ~10 times a step on average, the producers
** `empty` ~2 times.  More stages did not help, so the prefetch depth is not
** what they wait for: 5 / 6 stages (6 without the staged epilogue), main
** kernel, two rounds: subm C = 128 fwd 92.9 -> 94.9 / 105.9, down3 65.6 ->
** 66.3 / 79.6, C = 128 at 0.4 m 32.0 -> 33.3 / 36.5.  Next lead: the
** producers' instructions per copy.
** Leaner steps on both sides, kept (2026-11-26, session 36): the producers
** compute a row's source unsigned (one wide multiply-add and a shift-add
** pair, where the signed 64-bit form took ~17 instructions a row) and B's
** tensor-map copies go round the producer warps by stage; the consumers
** build wgmma descriptors from per-stage low words (ws_k16) and read a
** step's row groups a step ahead (ws_step_wait).  H100, main kernel us, two
** rounds, before / producers only / both, in one call: subm C = 128 fwd
** 93.9 / 92.6 -> 89.0 / 89.2 -> 86.8 / 87.4, dgrad 93.9 / 92.6 -> 88.9 /
** 89.2 -> 86.6 / 86.5; C = 128 at 0.4 m fwd 32.1 / 32.3 -> 31.0 / 31.0 ->
** 29.4 / 29.7; C = 256 at 0.8 m 51.8 / 51.8 -> 50.4 / 50.2 -> 48.7 / 49.0;
** down3 C = 128 66.2 / 66.1 -> 63.9 / 64.2 -> 63.5 / 63.1.  Tried after it
** and not kept: a case per stage in the ping-pong consumers, so that every
** descriptor is built in uniform registers (no R2UR; subm C = 128 fwd 87.4 /
** 87.4 -> 87.1 / 87.4, C = 256 at 0.8 m 48.9 -> 49.6), and 5 or 6 stages
** for the ping-pong tiles (6 without the staged epilogue): subm C = 128 fwd
** 87.0 / 87.1 -> 86.9 / 87.3 / 99.5 / 99.7, up2 C = 128 31.4 / 31.6 -> 31.3
** / 31.4 / 46.9 / 47.0.  Nsight Compute after it (subm C = 128 fwd): the
** consumers still re-test `full` ~12 times a step, tensor pipe ~48% busy.
** A clock64 timeline of blocks 0-3 (same day; an untracked build that
** stores each producer's and consumer's step times): ~970 cycles a step at
** C = 128 (0.1 m and 0.4 m alike), of which lane 0 of a producer warp spends
** ~100 waiting on `empty`, ~410 issuing its 8 copies (and B's tensor-map
** copies one step in four) and ~450 between steps; the active consumer
** warpgroup ~210 waiting on `full`, ~460 from `full` to the previous
** step's wgmma done.  So the producers are busy the whole step.  Three
** producer changes aimed at it were measured and not kept (main kernel us,
** two rounds against this code in one call): the copies under a guard
** predicate instead of a branch per 64-row block (subm C = 128 fwd 86.5 ->
** 92.6), the next offset's map words read an offset ahead (87.0 -> 86.4,
** down3 dgrad 47.0 -> 47.5: noise), and zero-filled slots not filled again
** (~40% of the copied rows are absent neighbours; 87.1 -> 88.0, C = 256 at
** 0.8 m 48.9 -> 47.7).  Neither the copies' count nor their shared loads is
** what a step waits for.
** Tile 16's counter take moved from the hand-over to the start of the tile's
** steps (2026-11-29, session 65): H200, lidar_198k, fp16, main kernel us from
** graph replays, medians of three rounds against the take in hand_over,
** outputs bitwise equal: up2 C = 128 fwd 29.9 -> 29.6, dgrad 24.4 -> 23.6;
** down2 C = 128 fwd 24.8 -> 24.0, dgrad 30.3 -> 29.6; down3 C = 128 dgrad
** 44.0 -> 43.1; subm C = 128 within 1%; tile 16 forced at C = 64, up2 fwd
** 28.1 -> 26.8, down2 dgrad 28.7 -> 27.3, down3 fwd 59.9 -> 57.7.  Not kept,
** same day: tiles 14 and 15's producers taking tile i + 1's index once tile
** i is built (no gain; 8 bytes more stack at BN = 256); tile i + 2 built
** before tile i's epilogue, its rows saved and half the sums staged first
** (up2 C = 128 fwd 29.8 -> 30.3, down2 C = 128 dgrad 29.9 -> 30.6, the rest
** within 1%); that with tile i + 2's schedule entry asked for after tile
** i's first step (1-6% slower: warp 0 waits out the atomic inside the step
** loop); the index known a tile earlier (each warpgroup taking the one three
** tiles ahead, for the other; three static tiles a block), the schedule
** entry asked for at tile i's start, with and without the record's first
** bytes requested during the epilogue: up2 C = 128 fwd 29.4 -> 29.1, but
** dgrad 23.6 -> 25.3, down2 C = 128 fwd 24.1 -> 25.9, down3 C = 128 fwd 61.2
** -> 64.2. */
/* bt: the forward's w [V, red, n], B read MN-major; else dgrad's [V, n, red]. */
template <typename T, bool BT> static tsp_status dispatch_ws(const tsp_os_launch &a, int tile) {
  const int bn = ws_bn(tile, a.n);
  if (tile == 14) {
    if (bn == 64) return launch_ws<T, 64, WS_STAGES, 2, 1, false, BT>(a);
    if (bn == 128) return launch_ws<T, 128, WS_STAGES, 2, 1, false, BT>(a);
    return launch_ws<T, 256, WS_STAGES, 2, 1, false, BT>(a);
  }
  if (ws_pingpong(tile)) { /* two m64nBN accumulators per consumer thread: BN <= 128 */
    if (bn == 64) return launch_ws<T, 64, WS_STAGES, 4, 1, true, BT>(a);
    if (bn == 128) return launch_ws<T, 128, WS_STAGES, 4, 1, true, BT>(a);
    return TSP_ERR_UNSUPPORTED;
  }
  if (bn == 64) return launch_ws<T, 64, WS_STAGES, 4, 1, false, BT>(a);
  if (bn == 128) return launch_ws<T, 128, WS_STAGES, 4, 1, false, BT>(a);
  return launch_ws<T, 256, WS_STAGES, 4, 1, false, BT>(a);
}

#endif /* TSP_WGMMA */

int tsp_conv_wgmma_ws_counted(int64_t tile_rows, int64_t n, int tile, int splits) {
#ifndef TSP_WGMMA
  (void)tile_rows, (void)n, (void)tile, (void)splits;
  return 0;
#else
  if (!tsp_is_ws_tile(tile) || tile_rows <= 0 || n <= 0) return 0;
  const int bn = ws_bn(tile, n);
  const int64_t tiles = (tile_rows + WS_BM - 1) / WS_BM * ((n + bn - 1) / bn) * (splits > 1 ? splits : 1);
  return ws_counted(tiles, ws_pingpong(tile), ws_per_wave(1)); /* MINB: 1 for every tile (dispatch_ws) */
#endif
}

int tsp_conv_wgmma_pingpong_fits(int64_t n, int64_t volume) {
#ifndef TSP_WGMMA
  (void)n, (void)volume;
  return 0;
#else
  return n >= 1 && volume >= 1 && volume <= 65535 &&
         ws_smem_bytes(ws_bn(WS_PINGPONG_TILE, n), WS_STAGES, (int)volume, 2) <= WS_SMEM_MAX;
#endif
}

tsp_status tsp_conv_wgmma_ws_check(tsp_dtype dtype, const tsp_os_launch *a, int tile) {
#ifndef TSP_WGMMA
  (void)dtype, (void)a, (void)tile;
  return TSP_ERR_UNSUPPORTED;
#else
  if (!wg_launch_ok(dtype, a) || !tsp_is_ws_tile(tile) || (uintptr_t)a->w % 16 != 0)
    return TSP_ERR_UNSUPPORTED;
  /* the producers address src in 32-bit element offsets */
  if (!wg_offsets_fit(a->src_rows, a->red)) return TSP_ERR_UNSUPPORTED;
  /* ping-pong: each consumer warpgroup has its own tile buffer, and two accumulators of BN <= 128 */
  const int tbufs = ws_pingpong(tile) ? 2 : 1;
  if (ws_smem_bytes(ws_bn(tile, a->n), WS_STAGES, (int)a->volume, tbufs) > WS_SMEM_MAX) return TSP_ERR_UNSUPPORTED;
  if (tsp_device_cc() != 90) return TSP_ERR_UNSUPPORTED; /* sm_90a code runs on sm_90 only */
  return TSP_OK;
#endif
}

/* One launch; a->w is w as the caller holds it: [V, n, red] when k_major
** (dgrad), else the forward's [V, red, n]. */
tsp_status tsp_conv_wgmma_ws_os(tsp_dtype dtype, const tsp_os_launch *a, int tile, int k_major) {
#ifndef TSP_WGMMA
  (void)dtype, (void)a, (void)tile, (void)k_major;
  return TSP_ERR_UNSUPPORTED;
#else
  const tsp_status ok = tsp_conv_wgmma_ws_check(dtype, a, tile);
  if (ok != TSP_OK) return ok;
  if (a->rows <= 0 || a->tile_rows <= 0) return TSP_OK;
  if (dtype == TSP_FLOAT16) return k_major ? dispatch_ws<__half, false>(*a, tile) : dispatch_ws<__half, true>(*a, tile);
  return k_major ? dispatch_ws<__nv_bfloat16, false>(*a, tile) : dispatch_ws<__nv_bfloat16, true>(*a, tile);
#endif
}
