/*
** conv_wgmma_wgrad.cu: the weight gradient on Hopper's wgmma (sm_90a),
** fp16/bf16 with fp32 accumulation, deterministic:
**   dw[k] = sum over present pairs (p, q) of map column k of x[p]^T dy[q].
** Two ways to cut the work (algo.dataflow of the wgrad pass):
**   0, row chunks, as conv_wgrad.cu (mma.sync): each block owns (row chunk,
**      offset k, c_in tile, c_out tile) and compacts its column's present
**      rows (conv_wgrad_pairs.cuh); chunks reduced in order;
**   1, pair slots (the default, conv.cu resolve_wgrad): the map's pair list
**      (passed in, cached by torchsp/kmap.py for all layers of a map, or else
**      built on the stream into the workspace: kmap_pairs.cu, no host sync)
**      is shared out to a fixed number of slots, one block per (slot, c_in
**      tile, c_out tile), as offset groups (each offset's 64-pair slabs
**      dealt round-robin to a group of slots sized to its pairs) where every
**      offset with pairs can have a slot, else as equal pieces across
**      offsets (conv_wgrad_pairs.cuh); a slot writes one partial per offset
**      it meets, and one more kernel adds them in slot order.  A slot's
**      pairs stream through a ring of 64-pair slabs copied a few slabs
**      ahead of its products (ww_tile::product_stream), not through a list
**      filled in batches between them; with the pairs' input rows
**      (tsp_conv_problem.pair_rows, or built with the list) beside them, so
**      no pair looks its row up in the map.
**
** Why: the mma.sync kernel ran at 15-20% of the tensor peak (H100, lidar_198k
** at 0.1 m: C = 128 217 us, C = 256 673 us for 25.8 and 103 GFLOP), the
** slowest pass of a training step at C >= 128.  Row chunks on wgmma took
** C = 256 to 531-610 us, but Nsight Compute showed the SMs busy only 58% of
** the time: the centre offset of a submanifold map holds every row (125,565)
** against 16,758 for the rarest, and its blocks set the length.  Equal pieces
** took it to 355 us (C = 128: 231 -> 169, C = 64: 140 -> 106; one run).
** Nsight Compute on the pieces (C = 256 / 128): the main kernel 312 / 125 us
** (compute 35% / 25%, memory 59% / 52% of peak), the pair list's two map
** passes 27 us and the reduction 12 / 10 us.  With the pair list cached on
** the kernel map (built once for all its layers, tsp_conv_problem.pairs)
** wgrad took 62 / 135 / 321 us at C = 64 / 128 / 256 (tools/bench.py, one
** run, 2026-11-23; 107 / 170 / 354 building it per call in an earlier run).
** Straight-line slab copies (ww_load, 2026-11-25; main kernel, tools/
** kernel_times.py, H100, same run against 7bf7775, two rounds): C = 64
** 49.3 / 48.4 -> 40.6 / 40.8 us, C = 128 123.1 / 123.7 -> 106.1 / 105.5, C =
** 256 312.5 / 315.3 -> 269.0 / 268.8.  Not kept: the pair list filled in two
** passes with all of a thread's loads in flight (tsp_wgrad_fill), 3-5 us
** slower at each size in a later run whose 7bf7775 matched this one's.
** Offset groups instead of equal pieces (2026-11-25; main kernel, cached
** pair list, H100, two rounds): equal pieces C = 32 / 64 / 128 / 256 32.1 /
** 33.0, 40.9 / 41.3, 110.3 / 110.9, 270.3 / 271.1 us; in the same call a
** first groups version (64-bit slab search in global memory, 66 slots at C
** = 256) 34.9 / 35.3, 40.5 / 40.6, 86.7 / 87.2, 270.8 / 270.8; this one, a
** later call, 32.3 / 32.5, 37.8 / 37.9, 85.5 / 85.8, 244.3 / 243.8.  Nsight
** Compute at C = 256: L2 hit rate 28% -> 63%, DRAM 67% -> 29% busy.
** Tried 2026-11-25 and not kept (H100, main kernel us, cached pair list,
** each against this kernel in the same call, two rounds; all passed the
** wgrad tests).  Nsight Compute on this kernel at C = 256 showed no warp
** eligible 73% of the cycles at 2 warps per scheduler, L2 63% and DRAM 39%
** busy, so the tries aimed at latency and locality:
**   - a warp-specialized variant for tiles 12 and 15 (a producer warpgroup
**     fills the pair list and copies slabs STAGES ahead, the consumers meet
**     it only at per-stage mbarriers, as conv_wgmma_ws.cu): C = 128 104.5 /
**     104.4 against 84.8 / 84.7, C = 256 242.8 / 242.9 against 245.4 /
**     242.7; with 8 producer warps at C = 128 and a 2048-pair list, 89.3 /
**     89.5 against 86.1 / 85.7.  The block barrier per slab is not what
**     holds it back;
**   - blocks ordered with the c_in tiles slowest (one wave per c_in tile
**     sweeping all offsets): C = 256 248.5 / 243.8 against 251.9 / 248.4,
**     and 12 rounds later in one call a median of 253 against 253.
** The reduction runs over pairs and a gathered row holds its channels
** contiguously, so both operands are MN-major in shared memory (wgmma
** imm-trans-a = imm-trans-b = 1), which a 16-byte cp.async per 8 channels
** fills directly: A = the slab's x rows (BK pairs x BM channels of c_in), B
** = its dy rows (BK pairs x BN channels of c_out).  Each operand is stored as
** 64-channel blocks of BK rows x 128 bytes, 128-byte swizzle (pair r's
** 16-byte chunk c at chunk c ^ (r % 8); wg_desc_lo_sw128_mn): a warp's copies
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

#include <limits.h>

#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_wgrad_pairs.cuh"
#include "conv_wgmma_util.cuh"

#ifdef TSP_WGMMA /* the kernels exist in sm_90a builds only */

/* WW_BK: pairs per slab (64 channels x 64 pairs = one 8 KB block). */
enum { WW_BK = 64 };

/* 4 bytes global -> shared, asynchronously (product_stream's ring entries). */
static __device__ __forceinline__ void tsp_cp_async4(int32_t *dst, const int32_t *src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(tsp_smem_addr(dst)), "l"(src) : "memory");
}

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

/* Dataflow 1's sizes: `pieces` slots (offset-group members or pair pieces,
** conv_wgrad_pairs.cuh), a grid of pieces x tiles blocks, and the workspace:
** fp32 partials [pieces + V - 1, c_in, c_out], the group table [V + 2]
** (int64), starts [V + 1] (int64), the pair list and its input rows [n_out
** * V] each (int32: the most a map can hold, so its length never travels to
** the host), then kmap_pairs.cu's workspace; partials and table alone when
** the caller passes the map's pair list (p->pairs, with or without its
** rows).  bytes == 0: these sizes are not served.
**
** pieces x tiles is one wave of resident blocks on a 132-SM H100 (WW_SMS;
** tile 13 fits two blocks per SM, 12 and 15 one) times algo.split (0 reads as
** 1), but no fewer than WW_SMS x split slots per tile: equal pieces need no
** second wave to even out, while offset groups are whole blocks, and 66 of
** them for 27 offsets (tile 15 at C = 256: two c_in tiles) leave the largest
** group member 1.32x the mean (lidar_198k at 0.1 m), 132 1.09x: C = 256
** wgrad main kernel 270.8 / 270.8 us at 66 slots against 249.4 / 247.4 at
** 132 (H100, same run, two rounds; equal pieces 270.3 / 271.1).  The count is
** a constant, so results do not depend on the device.  Pieces shrink to no
** fewer than WW_MIN_PIECE (row, offset) entries of the map each. */
enum { WW_SMS = 132, WW_MIN_PIECE = 1024 };
static const int64_t WW_MAX_PARTIALS = 64LL << 20; /* floats (256 MB) */

typedef struct {
  int64_t pieces, tiles;
  size_t table_at, starts_at, pairs_at, rows_at, pairs_ws_at, bytes;
} ww_pieces_plan;

static size_t ww_align(size_t b) { return (b + 255) & ~(size_t)255; }

static ww_pieces_plan plan_pieces(const tsp_conv_problem *p, int tile) {
  ww_pieces_plan pl = {0, 0, 0, 0, 0, 0, 0, 0};
  const int bm = tile == 13 ? 64 : 128, bn = tile == 15 ? 256 : tile == 13 ? 64 : 128;
  const int resident = tile == 13 ? 2 : 1;
  const int64_t vcc = p->c_in * p->c_out, v = p->volume;
  pl.tiles = ((p->c_in + bm - 1) / bm) * ((p->c_out + bn - 1) / bn);
  const int64_t split = p->algo.split > 1 ? p->algo.split : 1;
  int64_t g = (int64_t)WW_SMS * resident * split / pl.tiles;
  /* see above: offset groups of whole blocks, while the partials fit */
  if (g < WW_SMS * split && vcc <= WW_MAX_PARTIALS / (WW_SMS * split + v - 1)) g = WW_SMS * split;
  const int64_t by_map = (p->n_out * v + WW_MIN_PIECE - 1) / WW_MIN_PIECE;
  if (g > by_map) g = by_map;
  if (g < 1) g = 1;
  /* A given pair list needs no scan workspace: CUB's size query (asked three
  ** times a pass) is skipped. */
  const int given = p->pairs != NULL && p->pair_starts != NULL;
  const size_t pairs_ws = given ? 0 : tsp_kernel_map_pairs_cuda_workspace(p->n_out, v);
  if ((!given && pairs_ws == 0) || vcc > WW_MAX_PARTIALS / (g + v - 1) || g * pl.tiles > 0x7fffffffLL)
    return pl;
  pl.pieces = g;
  pl.table_at = ww_align((size_t)((g + v - 1) * vcc) * sizeof(float));
  pl.starts_at = pl.table_at + ww_align((size_t)(v + 2) * sizeof(int64_t));
  if (given) {
    pl.pairs_at = pl.rows_at = pl.pairs_ws_at = pl.bytes = pl.starts_at;
    return pl;
  }
  pl.pairs_at = pl.starts_at + ww_align((size_t)(v + 1) * sizeof(int64_t));
  pl.rows_at = pl.pairs_at + ww_align((size_t)(p->n_out * v) * sizeof(int32_t));
  pl.pairs_ws_at = pl.rows_at + ww_align((size_t)(p->n_out * v) * sizeof(int32_t));
  pl.bytes = pl.pairs_ws_at + ww_align(pairs_ws);
  return pl;
}

/* Copies rows [slab * BK, slab * BK + BK) of the pair list (`rows`: s_p or
** s_q) of src [., ld] channels [c0, c0 + W) into dst in the layout of the
** file header; rows past `count`, row indices outside [0, limit) and
** channels past `ld` are zero.  A thread copies one 16-byte chunk c of PER
** consecutive rows: their indices come in PER / 4 vector loads and every
** copy is a cp.async of 16 or 0 bytes, with no branch.  (With a 4-byte shared load and a branch per
** copy, the copies drew ~80% of the C = 256 pieces kernel's warp samples,
** stalled mostly on those loads: Nsight Compute's source view, bc2e51c.) */
template <typename T, int W, int NT>
static __device__ __forceinline__ void ww_load(T *dst, const T *__restrict__ src, int ld, int c0,
                                               const int32_t *rows, int slab, int count, int limit) {
  enum { CHUNKS = W / 8, PER = WW_BK * CHUNKS / NT };
  static_assert(PER * NT == WW_BK * CHUNKS && NT % CHUNKS == 0, "whole rows per thread");
  static_assert(PER == 4 || PER % 8 == 0, "vector loads; the swizzle of r0 + it below");
  const int c = threadIdx.x % CHUNKS, r0 = threadIdx.x / CHUNKS * PER, ch = c0 + c * 8;
  const int j0 = slab * WW_BK + r0; /* rows are 16-byte aligned and the list a multiple of BK */
  int32_t q[PER];
#pragma unroll
  for (int v = 0; v < PER / 4; ++v) {
    const int4 e = *(const int4 *)(rows + j0 + 4 * v);
    q[4 * v] = e.x, q[4 * v + 1] = e.y, q[4 * v + 2] = e.z, q[4 * v + 3] = e.w;
  }
  /* r0 % 8 == 0, or r0 % 4 == 0 with PER == 4: (c ^ (r0 + it)) & 7 == (sw ^ it) & 7 */
  const int sw = (c ^ r0) & 7;
  const uint32_t d0 = tsp_smem_addr(dst + (c >> 3) * (WW_BK * 64) + r0 * 64);
  const bool c_ok = ch < ld;
  /* Rows as 32-bit element offsets from channel ch (wgmma_wgrad_takes bounds the
  ** sources), the row clamped to 0 where nothing is read (tsp_cp_async16_bytes
  ** reads no byte of a 0-byte copy): one wide multiply-add a copy where a signed
  ** 64-bit multiply and add were.  H100, lidar_198k, main kernel us, three
  ** rounds each way in one call (2026-11-26): C = 128 85.3 / 84.9 / 85.7 ->
  ** 82.3 / 80.8 / 80.7, down3 C = 128 61.0 / 61.4 / 61.4 -> 56.7 / 56.3 / 56.4,
  ** C = 128 at 0.4 m 31.1 -> 28.5-29.2, C = 256 at 0.8 m 47.3-47.7 -> 44.8-45.0,
  ** C = 256 253.2-255.2 -> 232.0-257.1; C = 32 and 64 within 1%. */
  const uint64_t base = (uint64_t)(src + ch);
#pragma unroll
  for (int it = 0; it < PER; ++it) {
    const bool valid = c_ok && j0 + it < count && q[it] >= 0 && q[it] < limit;
    tsp_cp_async16_bytes(d0 + (it * 64 + ((sw ^ it) & 7) * 8) * (int)sizeof(T),
                         wg_elem_addr16(base, (uint32_t)max(q[it], 0) * (uint32_t)ld), valid ? 16u : 0u);
  }
}

/* The tile's shapes and shared memory, common to both kernels. */
template <typename T, int WGS, int BN, int STAGES> struct ww_tile {
  enum { BM = 64 * WGS, NT = 128 * WGS, BK = WW_BK, ACC = BN / 2, AHEAD = STAGES - 2 };
  enum { A_STAGE = BK * BM, B_STAGE = BK * BN, BLOCK = BK * 64 };
  enum { LIST = ww_list<WGS>::LIST, ROWS = ww_list<WGS>::ROWS };
  static_assert(AHEAD >= 1, "one slab in flight needs at least 3 stages");
  T *s_a, *s_b;
  int32_t *s_p, *s_q, *s_warp;

  __device__ __forceinline__ explicit ww_tile(unsigned char *smem_raw) {
    s_a = (T *)(smem_raw + ((1024 - (tsp_smem_addr(smem_raw) & 1023)) & 1023));
    s_b = s_a + STAGES * A_STAGE;
    s_p = (int32_t *)(s_b + STAGES * B_STAGE);
    s_q = s_p + LIST;
    s_warp = s_q + LIST;
  }

  /* Copies slab `at` of the pair rows (s_p, s_q) into stage `stage`: x's
  ** rows channels [m0, m0 + BM) into A, dy's [n0, n0 + BN) into B (ww_load). */
  __device__ __forceinline__ void load(int stage, int at, const T *__restrict__ x, const T *__restrict__ dy,
                                       int c_in, int c_out, int m0, int n0, int count, int lim_in,
                                       int lim_out) const {
    ww_load<T, BM, NT>(s_a + stage * A_STAGE, x, c_in, m0, s_p, at, count, lim_in);
    ww_load<T, BN, NT>(s_b + stage * B_STAGE, dy, c_out, n0, s_q, at, count, lim_out);
  }

  /* acc += the products of the slab in stage slab % STAGES (BK / 16 wgmma for
  ** warpgroup wg), queued, then a wait for the slab before: this slab's stage
  ** is overwritten AHEAD slabs later, after a barrier. */
  __device__ __forceinline__ void multiply(float (&acc)[ACC], int slab, int wg) const {
    /* the descriptors' low words once a slab; a k16 slice is 2048 bytes (128 >> 4) on */
    const uint32_t a_lo = wg_desc_lo_sw128_mn(s_a + (slab % STAGES) * A_STAGE + wg * BLOCK, BLOCK * 2);
    const uint32_t b_lo = wg_desc_lo_sw128_mn(s_b + (slab % STAGES) * B_STAGE, BLOCK * 2);
    acc_fence(acc);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks)
      wg_op<BN>::template run_tt<T>(acc, wg_desc_of_lo(a_lo + 128 * ks), wg_desc_of_lo(b_lo + 128 * ks));
    wg_commit();
    wg_wait<1>();
    acc_fence(acc);
  }

  /* The last products and copies landed, then a barrier. */
  __device__ __forceinline__ void drain(float (&acc)[ACC]) const {
    wg_wait<0>();
    acc_fence(acc);
    tsp_cp_async_wait<0>();
    __syncthreads();
  }

  /* acc += x[s_p[j]]^T dy[s_q[j]] over the list's `count` pairs (checked
  ** by the fill), channels [m0, m0 + BM) x [n0, n0 + BN).  Block-uniform; ends
  ** with a barrier, so the stages and the list may be rewritten. */
  __device__ __forceinline__ void product(float (&acc)[ACC], const T *__restrict__ x,
                                          const T *__restrict__ dy, int c_in, int c_out, int m0,
                                          int n0, int count) const {
    /* through a shuffle: provably warp-uniform, so the wgmma descriptors stay
    ** in uniform registers (conv_wgmma.cu; with multiply()'s low words 175 ->
    ** 145 SASS instructions a slab at C = 64, no R2UR) */
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    const int slabs = (count + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
      if (s < slabs) {
        load(s, s, x, dy, c_in, c_out, m0, n0, count, INT_MAX, INT_MAX);
      }
      tsp_cp_async_commit();
    }
    for (int slab = 0; slab < slabs; ++slab) {
      tsp_cp_async_wait<AHEAD - 1>();
      proxy_fence();
      __syncthreads(); /* slab's stage landed for all; the stage loaded next is free */
      const int next = slab + AHEAD;
      if (next < slabs) {
        load(next % STAGES, next, x, dy, c_in, c_out, m0, n0, count, INT_MAX, INT_MAX);
      }
      tsp_cp_async_commit();
      multiply(acc, slab, wg);
    }
    drain(acc); /* stages and list are reused by the next batch */
  }

  /* The pair ring of product_stream: slab t's 64 entries at slot t % RING of
  ** s_q (output rows) and s_p (input rows), in the list's space.  RING >= 3
  ** AHEAD (the slabs filled before the loop) and > 2 AHEAD (the slabs whose
  ** entries are in flight or read at once in the loop). */
  enum { RING = AHEAD <= 2 ? 8 : 16, FILL = (3 * AHEAD * 64 + NT - 1) / NT };
  static_assert(RING >= 3 * AHEAD && 64 * RING <= LIST && BK == 64, "ring of 64-pair slabs in the list's space");

  /* Slabs [0, min(slabs, 3 AHEAD)) into the ring, every thread's loads in
  ** flight together (FILL entries a thread): q = -1 past `end` or outside
  ** [0, n_out), p = rows[.] (ROWS) or map[q, k], -1 when absent or outside
  ** [0, n_in) (a zero row).  All threads; the caller syncs. */
  template <bool ROWS>
  __device__ __forceinline__ void ring_fill(const int32_t *__restrict__ pairs, const int32_t *__restrict__ rows,
                                            const int32_t *__restrict__ map, int volume, int k, int64_t n_in,
                                            int64_t n_out, int64_t first, int64_t stride, int64_t end,
                                            int slabs) const {
    const int n = (slabs < 3 * AHEAD ? slabs : 3 * AHEAD) * 64;
    int32_t q[FILL], p[FILL];
#pragma unroll
    for (int u = 0; u < FILL; ++u) {
      const int i = u * NT + (int)threadIdx.x;
      const int64_t at = first + (int64_t)(i >> 6) * stride + (i & 63);
      const bool in = i < n && at < end;
      q[u] = in ? pairs[at] : -1;
      if (ROWS) p[u] = in ? rows[at] : -1;
      if (q[u] < 0 || (int64_t)q[u] >= n_out) q[u] = -1;
    }
    if (!ROWS) {
#pragma unroll
      for (int u = 0; u < FILL; ++u) p[u] = q[u] >= 0 ? map[(int64_t)q[u] * volume + k] : -1;
    }
#pragma unroll
    for (int u = 0; u < FILL; ++u) {
      const int i = u * NT + (int)threadIdx.x; /* slab i / 64 < RING: its slot is i / 64 */
      if (i < n) {
        s_q[i] = q[u];
        s_p[i] = q[u] >= 0 && p[u] >= 0 && (int64_t)p[u] < n_in ? p[u] : -1;
      }
    }
  }

  /* product() over a stream of pairs instead of a filled list: `slabs`
  ** 64-pair slabs, slab t = pairs[first + t stride .. + 64) cut at `end`,
  ** q = pairs[.] and p = map[q, k].  Threads 0-63 copy slab t's q into the
  ** ring (4-byte cp.async) 3 AHEAD slabs before it is multiplied and its p
  ** from the address q gives 2 AHEAD slabs before, both in the commit groups
  ** of the stage copies: q has landed for the thread that copies p (the wait
  ** of that iteration), and p for every thread once ww_load reads the slab
  ** (AHEAD slabs before, after the wait and the barrier).  Entries outside
  ** their run are stored as -1; others are checked where ww_load reads them
  ** (its limit), as the list's fill checks them.  Same sums in the same order
  ** as product() over a list of the same pairs, so the same bits.
  ** ROWS: p comes from rows[.] beside q, both copied 3 AHEAD slabs ahead
  ** (two 4-byte copies a thread of the first 64), no map lookup; entries
  ** past `end` are -1 and ww_load's limits check the rest.  Same pairs, same
  ** sums: dw bitwise as without.  Why: the lookup read a 32-byte sector of
  ** the map per pair for its 4 bytes (the map rows of consecutive pairs are V
  ** entries apart), about a fifth of a pair's traffic at C = 32.  Neither
  ** more blocks per SM (three at tile 13, its shared memory cut to the ring
  ** and 396 slots: wgrad op, subm C = 32 34.1 / 34.6 -> 35.6 / 36.1 us) nor
  ** fewer (one, 132 slots: 34.1-35.1 -> 47.0-47.9) had helped.  H200,
  ** lidar_198k, fp16, HEAD -> this in one call (2026-11-29, session 63),
  ** main kernel us (tools/kernel_times.py): subm C = 32 27.2 -> 21.7, C = 64
  ** 29.7 -> 26.0, C = 128 (tile 12) 65.2 -> 56.1, C = 256 (tile 15) 192.8
  ** -> 173.2; the wgrad op from CUDA graph replays, median of three rounds:
  ** down2 C = 64 17.8 -> 15.1, down3 C = 64 36.0 -> 31.6, up2 C = 64 18.9
  ** -> 15.9, down3 C = 128 48.1 -> 40.1, up2 C = 128 26.4 -> 24.7.
  ** Why: the list was filled in batches of up to LIST pairs, each fill (two
  ** dependent loads a pair) waiting on a drained pipeline: skipping every
  ** fill after a block's first took the C = 256 kernel from 231.4 to 222.5
  ** us, and with no products at all it still took 63.9 (fills, slot table,
  ** partials, reduction).  The wgrad op, 20 calls back to back, median of 5,
  ** HEAD's library -> this one, two rounds each in one call (H200, lidar_198k,
  ** fp16, 2026-11-28, bitwise equal dw): subm C = 256 231.1 / 231.3 -> 207.2
  ** / 206.6 us, C = 128 83.8 / 84.9 -> 77.4 / 77.0, C = 64 42.4 / 42.4 ->
  ** 38.6 / 39.5, C = 32 40.3 / 39.6 -> 36.6 / 35.8, down3 C = 128 58.8 / 59.3
  ** -> 52.5 / 52.4, C = 128 at 0.4 m 34.1 / 34.4 -> 33.0 / 33.5; down2 C =
  ** 64 21.8 / 21.8 -> 20.9 / 22.2.  Not kept (same call series, main kernel):
  ** the slab's products issued before the next copies (C = 256 237.7 ->
  ** 243.3), 32-pair slabs with twice the stages (295.0), the fill with 16
  ** loads a thread in flight (231.4 -> 229.0). */
  template <bool ROWS>
  __device__ __forceinline__ void product_stream(float (&acc)[ACC], const T *__restrict__ x,
                                                 const T *__restrict__ dy, int c_in, int c_out, int m0, int n0,
                                                 const int32_t *__restrict__ pairs, const int32_t *__restrict__ rows,
                                                 const int32_t *__restrict__ map, int volume, int k, int64_t n_in,
                                                 int64_t n_out, int64_t first, int64_t stride, int64_t end,
                                                 int slabs) const {
    /* wg and the slab count through shuffles: ptxas then knows both are
    ** warp-uniform, keeps the slab counter and the wgmma descriptors in
    ** uniform registers and moves none through R2UR (16 a slab before).
    ** With multiply()'s low words, the slab loop at C = 64 went 238 -> 201
    ** SASS instructions, C = 256 304 -> 267 (cuobjdump, nvcc 13.0).  H200,
    ** lidar_198k, fp16, main kernel us from CUDA graph replays, three rounds
    ** in one call, the libraries' order rotated (2026-11-28): subm C = 128
    ** 75.0 / 75.4 / 74.2 -> 70.1 / 70.5 / 69.9, down3 C = 128 50.5 / 51.1 /
    ** 50.6 -> 47.1 / 48.2 / 47.5, subm C = 256 (power-capped) 221.2 / 222.5 /
    ** 205.9 -> 203.6 / 218.0 / 191.1, subm C = 32 35.1 / 35.3 / 34.7 -> 34.0
    ** / 34.7 / 34.3; C = 64 within the noise (subm 36.6-37.5 -> 36.4-39.0);
    ** dw bitwise.  The shuffles without the low words were slower at subm C =
    ** 64 (37.5-38.7), the low words without the slab-count shuffle gained
    ** half as much at C = 128 (72.1-72.7). */
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    slabs = __shfl_sync(0xffffffffu, slabs, 0);
    const int lim_in = n_in < INT_MAX ? (int)n_in : INT_MAX, lim_out = n_out < INT_MAX ? (int)n_out : INT_MAX;
    ring_fill<ROWS>(pairs, rows, map, volume, k, n_in, n_out, first, stride, end, slabs);
    __syncthreads();
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
      if (s < slabs) {
        load(s, s, x, dy, c_in, c_out, m0, n0, INT_MAX, lim_in, lim_out);
      }
      tsp_cp_async_commit();
    }
    for (int slab = 0; slab < slabs; ++slab) {
      tsp_cp_async_wait<AHEAD - 1>();
      proxy_fence();
      __syncthreads(); /* slab's stage and slab + AHEAD's ring entries landed for all */
      const int next = slab + AHEAD;
      if (next < slabs) {
        load(next % STAGES, next % RING, x, dy, c_in, c_out, m0, n0, INT_MAX, lim_in, lim_out);
      }
      if (threadIdx.x < 64) { /* the ring, one entry a thread */
        const int e = threadIdx.x, tq = slab + 3 * AHEAD, tp = slab + 2 * AHEAD;
        if (tq < slabs) {
          const int64_t at = first + (int64_t)tq * stride + e;
          int32_t *dq = s_q + (tq % RING) * 64 + e, *dp = s_p + (tq % RING) * 64 + e;
          if (at < end) {
            tsp_cp_async4(dq, pairs + at);
            if (ROWS) tsp_cp_async4(dp, rows + at);
          } else {
            *dq = -1;
            if (ROWS) *dp = -1;
          }
        }
        if (!ROWS && tp >= 3 * AHEAD && tp < slabs) { /* ring_fill filled the first 3 AHEAD */
          const int32_t q = s_q[(tp % RING) * 64 + e];
          int32_t *dp = s_p + (tp % RING) * 64 + e;
          if (q >= 0 && (int64_t)q < n_out) tsp_cp_async4(dp, map + (int64_t)q * volume + k);
          else *dp = -1;
        }
      }
      tsp_cp_async_commit();
      multiply(acc, slab, wg);
    }
    drain(acc); /* stages and ring are reused by the next run */
  }
};

/* Calls store(m, col, v0, v1) for the accumulator's element pairs inside
** c_in x c_out (layout of conv_wgmma_ops.cuh; rows are c_in, columns c_out). */
template <int BN, int ACC, typename F>
static __device__ __forceinline__ void ww_epilogue(const float (&acc)[ACC], int m0, int n0, int c_in,
                                                   int c_out, F store) {
  const int lane = threadIdx.x & 31, wwarp = (threadIdx.x >> 5) & 3, wg = threadIdx.x >> 7;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = n0 + j * 8 + (lane & 3) * 2;
    if (col >= c_out) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + wg * 64 + wwarp * 16 + (lane >> 2) + h * 8;
      if (m < c_in) store(m, col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
}

/* Dataflow 0: blocks own (row chunk, offset, tile) and compact their map
** column's present rows (conv_wgrad_pairs.cuh). */
template <typename T, int WGS, int BN, int STAGES>
__global__ void __launch_bounds__(128 * WGS, 1)
    wgmma_wgrad_kernel(const T *__restrict__ x, int64_t n_in, const T *__restrict__ dy,
                       int64_t n_out, const int32_t *__restrict__ map, int volume, int c_in,
                       int c_out, int64_t rows_per_chunk, float *__restrict__ partials,
                       T *__restrict__ dw) {
  typedef ww_tile<T, WGS, BN, STAGES> tile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const tile t(smem_raw);
  const tsp_wgrad_block blk = tsp_wgrad_block_at(tile::BM, BN, c_in, c_out, volume, rows_per_chunk, n_out);

  float acc[tile::ACC];
#pragma unroll
  for (int i = 0; i < tile::ACC; ++i) acc[i] = 0.0f;

  int64_t scan = blk.q0;
  while (scan < blk.q1) { /* block-uniform */
    const int count = tsp_wgrad_compact<tile::NT, tile::LIST, tile::ROWS>(
        map, volume, blk.k, n_in, &scan, blk.q1, t.s_p, t.s_q, t.s_warp);
    t.product(acc, x, dy, c_in, c_out, blk.m0, blk.n0, count);
  }
  ww_epilogue<BN>(acc, blk.m0, blk.n0, c_in, c_out, [&](int m, int col, float v0, float v1) {
    tsp_wgrad_store2(partials, dw, blk.chunk, volume, blk.k, c_in, c_out, m, col, v0, v1);
  });
}

/* Dataflow 1: block (slot g, tile); ROWS: the pairs' input rows are in
** `rows`, else looked up in map.  With offset groups (conv_wgrad_pairs.cuh;
** L = tsp_wgrad_group_len > 0) slot g is member j of offset k's group and sums
** that group's slabs j, j + B_k, ... into partial slot g; block 0 also writes
** `table` (L, then first_k for k = 0 .. V) for the reduction.  Else (L = 0,
** table[0] = 0) slot g is piece g: pairs [g len, g len + len) of the list,
** one offset at a time, into partial slots g + k (tsp_wgrad_piece_len).
** Every branch below is block-uniform. */
template <typename T, int WGS, int BN, int STAGES, bool ROWS>
__global__ void __launch_bounds__(128 * WGS, 1)
    wgmma_wgrad_pieces_kernel(const T *__restrict__ x, int64_t n_in, const T *__restrict__ dy,
                              const int32_t *__restrict__ map, int volume, int c_in, int c_out,
                              int64_t n_out, const int32_t *__restrict__ pairs, const int32_t *__restrict__ rows,
                              const int64_t *__restrict__ starts, int64_t n_pairs, int64_t pieces,
                              float *__restrict__ partials, int64_t *__restrict__ table) {
  typedef ww_tile<T, WGS, BN, STAGES> tile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const tile t(smem_raw);
  /* L, k, j, B_k, S_k, in the compaction's warp area, which this kernel does
  ** not use (a static __shared__ array would push tile 15 past the 227 KB a
  ** block may have); the slab counts go in the pair list before it is filled */
  int64_t *const s_group = (int64_t *)t.s_warp;
  const int tiles_n = (c_out + BN - 1) / BN, tiles_m = (c_in + tile::BM - 1) / tile::BM;
  int64_t b = blockIdx.x;
  const int n0 = (int)(b % tiles_n) * BN;
  b /= tiles_n;
  const int m0 = (int)(b % tiles_m) * tile::BM;
  const int64_t g = b / tiles_m;
  const int64_t total = tsp_pair_total(starts, volume, n_pairs);
  const int64_t vcc = (int64_t)c_in * c_out;
  if (threadIdx.x < 32) {
    const int32_t len = volume <= tile::LIST ? tsp_wgrad_group_len(starts, volume, total, pieces, t.s_p) : 0;
    int gk = -1;
    int64_t gj = 0, gb = 0;
    if (len > 0)
      tsp_wgrad_group_of(t.s_p, volume, len, g, &gk, &gj, &gb, blockIdx.x == 0 ? table + 1 : NULL);
    if (threadIdx.x == 0) {
      if (blockIdx.x == 0) table[0] = len;
      s_group[0] = len, s_group[1] = gk, s_group[2] = gj, s_group[3] = gb;
      s_group[4] = gk >= 0 ? t.s_p[gk] : 0;
    }
  }
  __syncthreads();
  if (s_group[0] > 0) { /* offset groups */
    const int k = (int)s_group[1];
    if (k < 0) return; /* past the last group */
    const int64_t j = s_group[2], size = s_group[3];
    const int64_t k0 = tsp_pair_start(starts, k, total), k1 = tsp_pair_start(starts, k + 1, total);
    const int64_t mine = (s_group[4] - j + size - 1) / size; /* slabs j, j + size, ... */
    float acc[tile::ACC];
#pragma unroll
    for (int i = 0; i < tile::ACC; ++i) acc[i] = 0.0f;
    t.template product_stream<ROWS>(acc, x, dy, c_in, c_out, m0, n0, pairs, rows, map, volume, k, n_in, n_out,
                                    k0 + 64 * j, 64 * size, k1, (int)mine);
    float *slot = partials + g * vcc;
    ww_epilogue<BN>(acc, m0, n0, c_in, c_out, [&](int m, int col, float v0, float v1) {
      *(float2 *)(slot + (int64_t)m * c_out + col) = make_float2(v0, v1);
    });
    return;
  }
  const int64_t len = tsp_wgrad_piece_len(total, pieces);
  const int64_t a = g * len, e = a + len < total ? a + len : total;
  if (a >= e) return;
  int k = 0, hi = volume - 1; /* the first offset with starts[k + 1] > a */
  while (k < hi) {
    const int mid = (k + hi) >> 1;
    if (tsp_pair_start(starts, mid + 1, total) > a) hi = mid;
    else k = mid + 1;
  }
  for (; k < volume; ++k) {
    const int64_t k0 = tsp_pair_start(starts, k, total), k1 = tsp_pair_start(starts, k + 1, total);
    if (k0 >= e) break;
    const int64_t s0 = a > k0 ? a : k0, s1 = e < k1 ? e : k1;
    if (s0 >= s1) continue;
    float acc[tile::ACC];
#pragma unroll
    for (int i = 0; i < tile::ACC; ++i) acc[i] = 0.0f;
    t.template product_stream<ROWS>(acc, x, dy, c_in, c_out, m0, n0, pairs, rows, map, volume, k, n_in, n_out, s0,
                                    64, s1, (int)((s1 - s0 + 63) / 64));
    float *slot = partials + (g + k) * vcc;
    ww_epilogue<BN>(acc, m0, n0, c_in, c_out, [&](int m, int col, float v0, float v1) {
      *(float2 *)(slot + (int64_t)m * c_out + col) = make_float2(v0, v1);
    });
  }
}

/* dw[k] = the sum, in slot order, of offset k's partial slots: with offset
** groups (table[0] > 0) slots table[1 + k] .. table[2 + k] - 1, else the slots
** g + k of the pieces g that meet offset k; zero when it has no pair.  Four
** elements per thread. */
template <typename T>
__global__ void wgrad_pieces_reduce_kernel(const float *__restrict__ partials,
                                           const int64_t *__restrict__ starts, int volume,
                                           int64_t n_pairs, int64_t pieces, int64_t vcc,
                                           const int64_t *__restrict__ table, T *__restrict__ dw) {
  const int64_t total = tsp_pair_total(starts, volume, n_pairs);
  const int64_t len = tsp_wgrad_piece_len(total, pieces);
  const int grouped = table[0] > 0;
  const int64_t quads = volume * vcc / 4;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < quads;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t at = i * 4, k = at / vcc, in_k = at - k * vcc;
    int64_t g0 = 0, g1 = 0, shift = 0; /* slots g0 .. g1 - 1, each at (g + shift) vcc */
    if (grouped) {
      g0 = table[1 + k], g1 = table[2 + k];
    } else {
      const int64_t k0 = tsp_pair_start(starts, (int)k, total);
      const int64_t k1 = tsp_pair_start(starts, (int)k + 1, total);
      if (k1 > k0) g0 = k0 / len, g1 = (k1 - 1) / len + 1, shift = k;
    }
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int64_t g = g0; g < g1; ++g) {
      const float4 v = *(const float4 *)(partials + (g + shift) * vcc + in_k);
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    tsp_store2(dw + at, sum.x, sum.y);
    tsp_store2(dw + at + 2, sum.z, sum.w);
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

/* The pieces kernel with or without the pairs' input rows. */
template <typename T, int WGS, int BN, int STAGES, bool ROWS>
static tsp_status launch_pieces_kernel(const tsp_conv_problem *p, const void *x, const void *dy,
                                       const int32_t *nbmap, const ww_pieces_plan *plan, const int32_t *pairs,
                                       const int32_t *rows, const int64_t *starts, int64_t n_pairs,
                                       float *partials, int64_t *table, cudaStream_t stream) {
  const size_t smem = wgmma_wgrad_smem_bytes<WGS, BN, STAGES>();
  static uint64_t smem_raised = 0;
  tsp_status s = tsp_raise_smem_limit((const void *)wgmma_wgrad_pieces_kernel<T, WGS, BN, STAGES, ROWS>,
                                      smem, &smem_raised, "tsp_conv_wgmma_wgrad: pieces");
  if (s != TSP_OK) return s;
  wgmma_wgrad_pieces_kernel<T, WGS, BN, STAGES, ROWS>
      <<<(unsigned)(plan->pieces * plan->tiles), 128 * WGS, smem, stream>>>(
          (const T *)x, p->n_in, (const T *)dy, nbmap, (int)p->volume, (int)p->c_in,
          (int)p->c_out, p->n_out, pairs, rows, starts, n_pairs, plan->pieces, partials, table);
  return tsp_cuda_check_launch("tsp_conv_wgmma_wgrad: pieces");
}

template <typename T, int WGS, int BN, int STAGES>
static tsp_status launch_wgmma_wgrad_pieces(const tsp_conv_problem *p, const void *x,
                                            const void *dy, const int32_t *nbmap, void *dw,
                                            const ww_pieces_plan *plan, unsigned char *ws,
                                            cudaStream_t stream) {
  tsp_status s = TSP_OK;
  float *partials = (float *)ws;
  int64_t *table = (int64_t *)(ws + plan->table_at);
  const int32_t *pairs = p->pairs, *rows = p->pair_rows;
  const int64_t *starts = p->pair_starts;
  int64_t n_pairs = p->n_pairs;
  if (pairs == NULL || starts == NULL) {
    /* The pair list, on the stream: no host synchronisation (its length stays on the device). */
    int64_t *w_starts = (int64_t *)(ws + plan->starts_at);
    int32_t *w_pairs = (int32_t *)(ws + plan->pairs_at), *w_rows = (int32_t *)(ws + plan->rows_at);
    void *pairs_ws = ws + plan->pairs_ws_at;
    const size_t pairs_ws_bytes = plan->bytes - plan->pairs_ws_at;
    s = tsp_kernel_map_pair_counts_cuda(nbmap, p->n_out, p->volume, w_starts, pairs_ws,
                                        pairs_ws_bytes, stream);
    if (s != TSP_OK) return s;
    s = tsp_kernel_map_pairs_cuda(nbmap, p->n_out, p->volume, w_starts, w_pairs, w_rows, pairs_ws,
                                  pairs_ws_bytes, stream);
    if (s != TSP_OK) return s;
    pairs = w_pairs, rows = w_rows, starts = w_starts, n_pairs = p->n_out * p->volume;
  }
  s = rows != NULL ? launch_pieces_kernel<T, WGS, BN, STAGES, true>(p, x, dy, nbmap, plan, pairs, rows, starts,
                                                                     n_pairs, partials, table, stream)
                   : launch_pieces_kernel<T, WGS, BN, STAGES, false>(p, x, dy, nbmap, plan, pairs, NULL, starts,
                                                                      n_pairs, partials, table, stream);
  if (s != TSP_OK) return s;
  const int64_t vcc = p->c_in * p->c_out;
  wgrad_pieces_reduce_kernel<T><<<tsp_grid_blocks(p->volume * vcc / 4, 256), 256, 0, stream>>>(
      partials, starts, (int)p->volume, n_pairs, plan->pieces, vcc, table, (T *)dw);
  return tsp_cuda_check_launch("tsp_conv_wgmma_wgrad: reduce pieces");
}

template <typename T>
static tsp_status dispatch_wgmma_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                       const int32_t *nbmap, void *dw, void *workspace,
                                       size_t workspace_bytes, int tile, cudaStream_t stream) {
  if (p->algo.dataflow == 1) {
    const ww_pieces_plan plan = plan_pieces(p, tile);
    if (plan.bytes > 0) {
      if (workspace == NULL || workspace_bytes < plan.bytes) return TSP_ERR_ARGUMENT;
      unsigned char *ws = (unsigned char *)workspace;
      switch (tile) {
      case 13:
        return launch_wgmma_wgrad_pieces<T, 1, 64, 4>(p, x, dy, nbmap, dw, &plan, ws, stream);
      case 15:
        return launch_wgmma_wgrad_pieces<T, 2, 256, 4>(p, x, dy, nbmap, dw, &plan, ws, stream);
      default:
        return launch_wgmma_wgrad_pieces<T, 2, 128, 6>(p, x, dy, nbmap, dw, &plan, ws, stream);
      }
    } /* sizes the pieces cannot take: row chunks (same sums, another order) */
  }
  float *partials = (float *)workspace; /* conv.cu checked its size (tsp_conv_cuda_wgrad_workspace) */
  switch (tile) {
  case 13:
    return launch_wgmma_wgrad<T, 1, 64, 4>(p, x, dy, nbmap, dw, partials, stream);
  case 15:
    return launch_wgmma_wgrad<T, 2, 256, 4>(p, x, dy, nbmap, dw, partials, stream);
  default: /* 12 */
    return launch_wgmma_wgrad<T, 2, 128, 6>(p, x, dy, nbmap, dw, partials, stream);
  }
}

/* What this file takes (sm_90a build, sm_90 device, fp16/bf16, channels
** multiples of 8 within int, aligned operands, one of its tiles). */
static int wgmma_wgrad_takes(const tsp_conv_problem *p, int tile) {
  if (tile != 12 && tile != 13 && tile != 15) return 0;
  if (p->dtype != TSP_FLOAT16 && p->dtype != TSP_BFLOAT16) return 0;
  /* 16-byte copies of 8 channels; dw takes two adjacent elements per store. */
  if (p->c_in % 8 != 0 || p->c_out % 8 != 0 || p->c_in <= 0 || p->c_out <= 0 ||
      p->c_in > 0x7fffffff || p->c_out > 0x7fffffff || p->n_out >= 0x7fffffffLL ||
      p->volume > 0x7fffffff)
    return 0;
  /* ww_load addresses x and dy rows in 32-bit element offsets (wg_elem_addr16) */
  if (!wg_offsets_fit(p->n_in, p->c_in) || !wg_offsets_fit(p->n_out, p->c_out)) return 0;
  return tsp_device_cc() == 90; /* sm_90a code runs on sm_90 only */
}

#endif /* TSP_WGMMA */

size_t tsp_conv_wgmma_wgrad_workspace(const tsp_conv_problem *p, int tile) {
#ifndef TSP_WGMMA
  (void)p, (void)tile;
  return 0;
#else
  if (p->algo.dataflow != 1 || !wgmma_wgrad_takes(p, tile)) return 0;
  return plan_pieces(p, tile).bytes;
#endif
}

tsp_status tsp_conv_wgmma_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                const int32_t *nbmap, void *dw, void *workspace,
                                size_t workspace_bytes, int tile, cudaStream_t stream) {
#ifndef TSP_WGMMA
  (void)p, (void)x, (void)dy, (void)nbmap, (void)dw, (void)workspace, (void)workspace_bytes;
  (void)tile, (void)stream;
  return TSP_ERR_UNSUPPORTED;
#else
  if (!wgmma_wgrad_takes(p, tile)) return TSP_ERR_UNSUPPORTED;
  if (((uintptr_t)x | (uintptr_t)dy | (uintptr_t)workspace) % 16 != 0 || (uintptr_t)dw % 4 != 0)
    return TSP_ERR_UNSUPPORTED;
  if (p->dtype == TSP_FLOAT16)
    return dispatch_wgmma_wgrad<__half>(p, x, dy, nbmap, dw, workspace, workspace_bytes, tile,
                                        stream);
  return dispatch_wgmma_wgrad<__nv_bfloat16>(p, x, dy, nbmap, dw, workspace, workspace_bytes, tile,
                                             stream);
#endif
}
