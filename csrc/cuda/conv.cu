/*
** conv.cu: the CUDA convolution entry points of torchsp.h (forward, dgrad,
** wgrad, workspace size) and the choice of kernel for each call.
**
**   forward  y[q]  = sum_k x[nbmap[q, k]] @ w[k]          (rows: n_out)
**   dgrad    dx[p] = sum_k dy[nbmap_t[p, k]] @ w[k]^T      (rows: n_in)
**   wgrad    dw[k] = sum_q x[nbmap[q, k]]^T dy[q]
**
** Dispatch, per call, from sizes and pointers alone (no device queries that
** synchronise, no host sync, current stream only):
**   - fp16 / bf16, both channel counts multiples of 8, 16-byte aligned
**     operands, V <= 64, compute capability >= 8.0: tensor cores
**     (conv_implicit_gemm.cu for forward and dgrad, conv_wgrad.cu for wgrad;
**     wgrad tiles 12, 13, 15 and tile 0 at C >= 32 run conv_wgmma_wgrad.cu
**     on sm_90a builds, resolve_wgrad);
**     algo.tile 6-10 and 12-13 ask for the wgmma kernels of conv_wgmma.cu,
**     14-15 the warp-specialized ones of conv_wgmma_ws.cu (15 is tile 0's
**     choice for n > 64; 14 lost everywhere), which exist in sm_90a builds
**     (TORCH_CUDA_ARCH_LIST=9.0a) and run on
**     sm_90 devices; elsewhere those tiles fall back to the mma.sync kernel;
**     tile 0 picks between them (resolve_tile), tile 3 is mma.sync's default;
**   - float32 with algo.tile == TSP_TILE_TF32 (11; Python's default when
**     torch.backends.cuda.matmul.allow_tf32 is set), both channel counts
**     multiples of 4, 16-byte aligned operands, V <= 64, compute capability
**     >= 8.0: tf32 tensor cores, fp32 accumulation (conv_tf32.cu for forward
**     and dgrad, every dataflow; conv_wgrad.cu's kernel in tf32 for wgrad,
**     whose own algo carries the tile);
**   - fp16 / bf16 (tf32) channel counts that are not multiples of 8 (4),
**     such as the 3-5 input channels of a LiDAR or RGB-D net's stem: the
**     tensor-core passes above on zero-padded images (Channel padding below);
**   - everything else (float32 with any other tile: exact fp32; misaligned
**     views; V > 64; devices below sm_80): conv_simple.cu, correct for any shape.
** The dataflow of a tensor-core forward or dgrad is its list of segments
** (tsp_segment; torchsp/plan.py builds them: mask splits, weight-stationary,
** hybrid): one launch per segment, summed in an fp32 workspace, see
** output_stationary() below.  Split-K (dataflow 3, for passes with fewer
** tiles than the GPU has SMs) is one launch of tiles x algo.split blocks,
** each summing one run of its tile's used offsets into its own fp32 slab,
** then tsp_conv_reduce_partials adds the slabs in index order.  Without
** segments the tiles walk prob->order / order_t (mask-sorted) when given,
** unless algo.threshold == -1 (unsorted).
** All paths are deterministic (no float atomics): wgrad's split over rows
** reduces in a fixed order.
** float64 is TSP_ERR_UNSUPPORTED (the CPU kernels serve gradcheck).
**
** Measured (H100, tools/bench.py, fp16, lidar_198k.npz, map cached, CUDA
** events, median of 50, us; floor of DESIGN.md 7; 2026-11-23, sm_90a build,
** one run with FlexGEMM; "fwd op" times torch.ops.torchsp.conv_fwd alone):
**     layer        nb/row  floor  fwd op  dgrad  wgrad  fwd+bwd  FlexGEMM fwd / fwd+bwd
**     subm3 C32      3.5    13.6      53     54     90      688        250 / 1242
**     subm3 C64      3.5    21.1      92     88    133      803        199 / 1036
**     subm3 C128     6.3    32.7     209    202    217      662        247 /  821
**     subm3 C256     6.3   130.9     465    465    673     1656        616 / 1655
** Later run, wgrad over pair pieces (tile 0 = 13 / 12 / 15 in dataflow 1):
**     subm3 C32  fwd call 106.3 (op 64.3) dgrad 54 wgrad 90  fwd+bwd  979  FlexGEMM 304 / 1242
**     subm3 C64               126.5 (92.3)       88       107           782            298 / 1520
**     subm3 C128              212.0             205       171          1212            464 / 1601
**     subm3 C256              462.0             462       357          1363            612 / 1660
** (tile 0 is wgmma tile 13, 12, 15 at C = 64, 128, 256 and mma.sync at
** C = 32; wgrad 128 x 128 tiles at C >= 128.  wgrad on wgmma, tile 0 =
** 13 / 12 / 15, later run without peers: 121 / 205 / 521 at C = 64 / 128
** / 256, fwd+bwd 748 / 650 / 1508; A/B of the wgrad tiles in one run,
** mma.sync 134 / 220 / 690 vs wgmma 122 / 206 / 531.  Tile 3 (mma.sync) in another
** run: 96 / 247 at C = 64 / 128.  Before the reversed tile order and the
** Gray-code row order (conv_tile.cuh, tsp_mask_rank.h): fwd 114 / 266 / 545
** at C = 64 / 128 / 256; before the swizzled tiles 138 / 322 / 1040, wgrad
** 133 / 348 / 1293; C = 256 before the warp-specialized tile 15: 694.)
** Reading a sorted tile's map rows with independent loads (conv_tile.cuh)
** took C = 32 from 104 to 73 us and C = 64 from 161 to 135; reading each
** row as one coalesced warp request (conv_tile.cuh) took the fwd op from
** 91.4 to 82.8 us at C = 64, 212 to 202 at C = 128, 465 to 467 at C = 256
** and 53.6 to 56.6 at C = 32 (two runs, two machines, 2026-11-23).  At C >= 128
** every unswizzled kernel variant (mma.sync 32x64 or 64x64 warps, BK 32 or
** 64, wgmma with 128- or 256-row tiles, pipelined or not) landed within 10%
** of the others, with ncu reporting the L2 ~78% busy (3.4-3.8 TB/s of L2
** traffic); the swizzled wgmma tiles halve that traffic (conv_wgmma.cu).  Segmented dataflows, same tool (2026-11-23,
** fwd us at C = 32 / 64 / 128 / 256): mask splits S = 2 130 / 236 / 356 /
** 957 (the only win: 7% at C = 256), weight-stationary 461 / 744 / 983 /
** 2068, hybrid t = 3 205 / 362 / 514 / 1249: on this scan the fp32 partial
** sums (read-add-write per pair) and one launch per offset cost more than
** the skipped tile work saves, and the tuner keeps output-stationary.
** The all-warps kernels' tile prologue (conv_tile.cuh: a warp's order and
** map loads issued before the barrier that clears the offset masks, one pass
** per warp for volume <= 32), main kernel, 2026-11-25, same run, two rounds
** (us, before -> after): C = 32 fwd 54.5 / 54.2 -> 43.2 / 43.1, dgrad 52.1 /
** 51.9 -> 42.8 / 42.7; C = 64 fwd 78.2 / 78.4 -> 67.2 / 66.6, dgrad 78.4 /
** 78.1 -> 67.2 / 66.2.  A persistent grid that fetched the next tile's map
** entries during the current tile lost to a block per tile (C = 32 fwd 62.8
** against 52.4, C = 64 79.3 against 70.3): not kept.
** Split-K (dataflow 3), fwd op, 2026-11-24, one run (us, default -> S = 2 / 4 /
** 8): C = 256 at 0.8 m (10.6k rows, 83 tiles) 126.3 -> 96.1 / 108.6 / -;
** C = 128 at 0.4 m (27.9k rows, 218 tiles) 108.3 -> 109.3 / 126.8 / 180.2;
** C = 64 at 0.05 m (173k rows) 83.6 -> 180.9 / 267.5 / 476.5: the fp32 slabs
** cost more than the occupancy gains once tiles outnumber the SMs.
** Density split (dataflow 5: a STORE segment of the common offsets over all
** rows, then an add_out segment of the rest over the rows that have any; no
** fp32 partials), 2026-11-25, one run, fwd us, plain -> d = 20: C = 64 91.7 ->
** 105.3, C = 128 117.6 -> 149.8, C = 256 334.5 -> 385.8.  Main kernel per
** segment at C = 128: 74.0 common + 72.3 rare against 115.5 plain, and the
** centre offset alone over all rows 54.5 (C = 64: 39-44): each tile pays a
** large fixed cost (ncu: the unrolled epilogue's instruction fetch, the
** producers waiting for the next tile's build), so more tiles lose even when
** they compute fewer row products.
** Staged store epilogue (conv_tile.cuh tsp_stage_*: plain-store tiles of the
** mma.sync, all-warps wgmma and ping-pong kernels go through shared memory
** and leave in whole 16-byte chunks), 2026-11-25, the op call against the
** previous commit's build in the same call, three alternating rounds each,
** median us, fwd / dgrad: C = 32 42.2 -> 39.6 / 43.1 -> 40.7; C = 64 69.2 ->
** 62.6 / 69.2 -> 62.9; C = 128 118.4 -> 109.6 / 117.8 -> 109.0; down3 C = 64
** 96.7 -> 85.7 / 56.2 -> 49.7; down3 C = 128 103.6 -> 95.5 / 69.7 -> 56.9;
** up2 C = 64 44.1 -> 37.9 / 32.3 -> 26.6; up2 C = 128 56.7 -> 41.4 / 39.2 ->
** 32.4; down2 C = 128 dgrad 56.9 -> 40.0 (forwards of down2, host-bound,
** within the rounds' spread).  The one-offset tiles gain most: their
** epilogue was most of a tile's time.  C = 256 (tile 15, whose stages leave
** no room to stage a 128 x 256 tile) is unchanged.
** Step plans (torchsp.h; conv_tile.cuh tsp_tile_from_steps_by: a tile copies
** its offsets and map entries, listed once per map, instead of reading and
** sorting V entries per row), 2026-11-26, H100, against the previous commit's
** build in the same call, three alternating rounds, event median us, fwd /
** dgrad: C = 32 41.0 -> 37.0 / 40.6 -> 32.8; C = 64 56.0 -> 51.5 / 56.4 ->
** 51.9; C = 128 109.9 -> 106.4 / 109.0 -> 106.1; down3 C = 64 74.1 -> 65.9 /
** 46.8 -> 40.6; down3 C = 128 96.2 -> 91.7 / 57.3 -> 49.8; down2 C = 128 dgrad
** 40.5 -> 34.4; the host-bound down2 / up2 C = 64 calls within their spread.
** Main kernels (torch.profiler, same call): C = 32 fwd 29.8, dgrad 30.3
** (37.5 / 38.1 in session 28's run), up2 C = 128 fwd 30.8 (36.9).
*/
#include "conv_internal.cuh"

/* Validate what every pass shares; *empty set when there is nothing to compute. */
static tsp_status check_problem(const tsp_conv_problem *p) {
  if (!p) return TSP_ERR_ARGUMENT;
  if (p->n_in < 0 || p->n_out < 0 || p->c_in < 0 || p->c_out < 0 || p->volume < 1 ||
      p->volume > 65535)
    return TSP_ERR_ARGUMENT;
  if (p->n_in > 0x7fffffffLL || p->n_out > 0x7fffffffLL) return TSP_ERR_ARGUMENT;
  if (p->dtype == TSP_FLOAT64) return TSP_ERR_UNSUPPORTED;
  if (p->dtype != TSP_FLOAT32 && p->dtype != TSP_FLOAT16 && p->dtype != TSP_BFLOAT16)
    return TSP_ERR_ARGUMENT;
  return TSP_OK;
}

static size_t element_bytes(tsp_dtype dtype) { return dtype == TSP_FLOAT32 ? 4 : 2; }

/* algo.tile values served by conv_wgmma.cu (sm_90a builds); others by conv_implicit_gemm.cu. */
static int is_wgmma_tile(int tile) {
  return (tile >= 6 && tile <= 17 && tile != TSP_TILE_TF32) || tile == TSP_TILE_RING;
}

static int fast_dtype(tsp_dtype dtype) {
  return dtype == TSP_FLOAT16 || dtype == TSP_BFLOAT16;
}

/* algo.tile 0 ("the kernel's default") of an fp16/bf16 pass with red input and
** n produced channels, where each measured fastest (sm_90a build on an sm_90
** device; H100, lidar_198k, main kernel us):
** n <= 32 with more than 8 offsets tile 13 in 32-column tiles (conv_wgmma.cu
** BN = 32, any red; 2026-11-28, three rounds, mma.sync -> tile 13: subm C =
** 32 fwd 25.1 -> 21.8, dgrad 25.6 -> 21.4; 16 -> 16 fwd 24.4 -> 16.9; 64 ->
** 16 fwd 45.1 -> 29.7; 0.1 m 128 -> 32 fwd 101.5 -> 66.0; down3 C = 32 fwd
** 29.4 -> 29.0, dgrad 22.0 -> 18.0); with 8 offsets or fewer (stride-2 K = 2
** and its transpose) the rules below, so mma.sync at red <= 32: its dgrad,
** one offset a row, took 11.1 against 12.3 at C = 32, 10.3 against 11.9 for
** 16 -> 32, the forwards within 0.4 us (down2 64 -> 32 fwd, tile 13 by the
** next rule, 15.0 -> 10.7);
** red > 32 and n >= 32:
** 64 < n <= 128 the ping-pong tile 16 where its two tile buffers fit
** (2026-11-25, same run, two rounds: C = 128 fwd 115.4 / 114.4 against 130.1
** / 129.2 for tile 15, dgrad 114.9 / 114.0 against 130.2 / 129.9; the op call
** 122.7 / 122.1 against 137.9 / 165.1), else n > 64 the warp-specialized tile 15
** (2026-11-24, one run: C = 128 157 vs 199 for tile 12, dgrad 155 vs 194;
** C = 256 312-338 vs 420 before), n = 64 tile 13 (C = 64: 84 vs 111 for
** tile 15, 102 for tile 15 at two blocks per SM, 126 for 12, 139 mma.sync;
** tile 16's main kernel beat it, 65.3 / 65.2 against 66.9 / 67.9, but its
** op call lost, 71.6 / 73.4 against 69.6 / 69.3: tile 13 reads w as it is,
** tile 16 then wrote a weight image first; with both epilogues staged, main
** kernel, 2026-11-25: C = 64 fwd 64.3 against 61.4, down3 C = 64 93.2
** against 83.8, before tile 13 went to three blocks per SM; without the
** image, 2026-11-26, all kernels: fwd 51.2 for tile 16 against 45.5; again
** on the strided 64-channel layers, whose rows have one or two neighbours,
** main kernel, two rounds, tiles 13 / 16 / 17, fwd: subm 45.0 / 50.1 / 50.7,
** down2 17.9 / 23.7 / 23.8, down3 54.4 / 64.8 / 64.9, up2 21.5 / 30.7 /
** 30.6, dgrad likewise, session 35); since session 60 32 < n <= 64 tile
** TSP_TILE_RING (tile 13 with the step plan's entries in a 12-column ring,
** four blocks per SM; 13 itself where the pass has no step plan or splits
** K): H200, lidar_198k, main kernel us from CUDA graph replays, two rounds,
** tile 13 -> ring: subm C = 64 fwd 36.5 / 36.2 -> 36.3 / 36.0, dgrad 36.7
** / 36.3 -> 35.7 / 35.4; down3 fwd 45.8 / 45.4 -> 42.6 / 42.5, dgrad 31.6 /
** 31.4 -> 28.0 / 27.7; up2 fwd 15.8 / 15.5 -> 15.1 / 14.9 (conv_wgmma.cu
** wgmma_ring_kernel);
** 32 <= n < 64 produced channels tile 13 as well (the times here are its BN
** = 64's, before the 32-column tiles).  H100, lidar_198k, 3x3x3 unless said,
** main kernel us, three rounds (2026-11-28), mma.sync -> this rule: fwd 64 -> 32 45.0 ->
** 35.9, 128 -> 48 (0.1 m) 108.8 -> 83.4, 96 -> 32 64.0 -> 62.3, down2 64 ->
** 32 14.8 -> 12.3, up2 64 -> 32 14.7 -> 13.7; dgrad of 32 -> 64 (red 64,
** n 32) 43.4 -> 34.8, of 40 -> 128 (0.1 m, red 128, n 40) 112.6 -> 80.2.
** Between 32 and 64 input channels mma.sync (BK = 32) takes two K chunks a
** row where wgmma's BK = 64 takes one.  Three rounds, mma.sync -> this rule:
** fwd 40 -> 128 (0.1 m, conv_wgmma_ws.cu) 98.5 -> 58.0, 48 -> 64
** 47.1 -> 38.1, 40 -> 32 44.9 -> 35.5, 48 -> 48 46.5 -> 37.6 (dgrad 48.6 ->
** 37.3), down2 48 -> 96 28.7 -> 29.1; dgrad of 128 -> 48 (0.1 m, red 48,
** n 128) 102.4 -> 58.3.  At red = 32 mma.sync held (0.1 m, two rounds,
** mma.sync / tile 16): fwd 32 -> 128 56.3 / 56.3, 32 -> 96 (0.05 m) 50.7 /
** 53.7, dgrad of 96 -> 32 (red 32, n 96) 51.6 / 53.4;
** else mma.sync: red <= 32 with n > 32 (32 -> 64 fwd 30.4 against 31.2 for
** tile 13, 2026-11-28, and the red = 32 rows above), and with 8 offsets or
** fewer red <= 32 or n < 32.
** Few row tiles: the longest tile sets such a pass's time, so narrower
** column tiles (more blocks, each shorter) pay although each gathers its
** rows again.  Above 128 produced channels, a pass over `rows` rows with at
** most FEW_ROW_TILES_PER_SM 128-row tiles per SM runs tile 16 in 128-column
** tiles instead of tile 15's 256; where tile 16 would have at most half as
** many blocks as SMs, tile 17 (64 columns).  H100, lidar_198k, 3x3x3, main
** kernel, two rounds each, 2026-11-26, fwd us, tile 15 / 16 / 17:
**   C = 256, 0.1 m (981 row tiles) 347 / 357 / -;  0.2 m (525) 231 / 236 /
**   374;  0.3 m 152 / 151 / 235;  0.4 m (218) 124 / 109 / 168;  0.8 m (83)
**   88.1 / 70.6 / 74.8;  1.6 m (24) 86 / 49.2 / 43.4;
**   C = 128 (tile 16 is tile 0 anyway), 0.8 m (83) 35.7 / 30.3 / 35.8;
**   1.6 m (24) 35.6 / 30.2 / 27.0; dgrad alike. */
enum { FEW_ROW_TILES_PER_SM = 2 };
static int resolve_tile(tsp_dtype dtype, int64_t red, int64_t n, int64_t volume, int64_t rows, int tile) {
  if (tile != 0 || !fast_dtype(dtype) || !tsp_conv_wgmma_available()) return tile;
  if (n <= 32 && volume > 8) return 13; /* 32-column tiles (conv_wgmma.cu BN = 32) */
  if (red <= 32 || n < 32) return tile;
  if (n <= 64) return n > 32 ? TSP_TILE_RING : 13; /* the ring: 13 without a step plan */
  const int64_t row_tiles = (rows + 127) / 128, sms = tsp_device_sms();
  if (!tsp_conv_wgmma_pingpong_fits(n, volume)) return 15;
  if (n > 128 && row_tiles > FEW_ROW_TILES_PER_SM * sms) return 15;
  return row_tiles * ((n + 127) / 128) * 2 <= sms ? 17 : 16;
}

/* wgrad's algo.tile 0 on fp16/bf16 with both channel counts >= 32 (sm_90a
** build, sm_90 device; torchsp/plan.py WGRAD_PIECES_MIN_C mirrors the 32):
** the wgmma kernel of conv_wgmma_wgrad.cu, 128 x 256 tiles for c_out > 128,
** 128 x 128 above 64 channels, else 64 x 64, over pair pieces (dataflow 1);
** other tiles 12, 13 and 15 ask for those shapes in the algo's own dataflow
** (TSP_TILE_RING for 13's), any other value for mma.sync (conv_wgrad.cu).  H100,
** lidar_198k, fp16, one run (us, row chunks -> pair pieces): C = 64 tile 13
** 140 -> 106, C = 128 tile 12 231 -> 169, C = 256 tile 15 610 -> 355; at
** C = 32 mma.sync (90) stayed ahead of tile 13's pieces (103) until the
** pieces' copies went straight-line (2026-11-25, same build, two rounds,
** kernels: mma.sync 86.4 / 85.8 us, tile 13 pieces 41.0 / 41.7). */
static tsp_conv_problem resolve_wgrad(const tsp_conv_problem *p) {
  tsp_conv_problem r = *p;
  if (p->algo.tile == TSP_TILE_RING) r.algo.tile = 13; /* forward and dgrad's ring variant of 13 */
  if (p->algo.tile != 0 || !fast_dtype(p->dtype) || p->c_in < 32 || p->c_out < 32 ||
      !tsp_conv_wgmma_available())
    return r;
  r.algo.tile = p->c_out > 128 ? 15 : p->c_in > 64 || p->c_out > 64 ? 12 : 13;
  r.algo.dataflow = 1;
  return r;
}

/* float32 computed in tf32 on tensor cores: asked for by the pass's tile alone. */
static int tf32_asked(tsp_dtype dtype, int tile) {
  return dtype == TSP_FLOAT32 && tile == TSP_TILE_TF32;
}

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

/*
** Channel padding.  The tensor-core kernels take channel counts in multiples
** of 8 (fp16, bf16) or 4 (tf32).  A pass whose c_in or c_out is not one (a
** stem's 3-5 input channels, a head's 19 classes) runs the padded problem
** instead: the operands it reads copied into zero-padded images in the
** workspace (x or dy to the padded width, w to [V, c_in', c_out']), its
** output written to an image and cropped into the caller's tensor (wgrad:
** dw's).  The sums are the unpadded problem's (conv_pad.cu says why, and
** what it gained).  Exact float32, V > 64 and devices below sm_80 keep
** conv_simple.cu: no tensor-core kernel takes them padded either.
*/
static int64_t pad_to(int64_t c, int m) { return (c + m - 1) / m * m; }

/* The channel multiple the pass's tensor-core kernels need where p's channel
** counts are not multiples of it; 0: no padding. */
static int pad_multiple(const tsp_conv_problem *p) {
  const int m = fast_dtype(p->dtype) ? 8 : tf32_asked(p->dtype, p->algo.tile) ? 4 : 0;
  if (m == 0 || (p->c_in % m == 0 && p->c_out % m == 0)) return 0;
  if (p->c_in <= 0 || p->c_out <= 0 || p->n_in <= 0 || p->n_out <= 0) return 0; /* nothing to pad */
  if (p->volume > TSP_IGEMM_MAX_VOLUME || tsp_device_cc() < 80) return 0;
  return m;
}

static tsp_conv_problem padded_problem(const tsp_conv_problem *p, int m) {
  tsp_conv_problem q = *p;
  q.c_in = pad_to(p->c_in, m);
  q.c_out = pad_to(p->c_out, m);
  return q;
}

/* The images of a padded pass, carved from the front of its workspace:
** `in` [n_in, c_in'] (x, or dgrad's dx) where c_in is padded, else NULL;
** `w` [V, c_in', c_out'] (wgrad: dw); `out` [n_out, c_out'] (y, or dgrad's
** and wgrad's dy) where c_out is padded, else NULL; then the padded pass's
** own workspace, `rest`. */
typedef struct {
  void *in, *w, *out;
  void *rest;
  size_t rest_bytes;
  int e; /* bytes an element */
} pad_images;

static size_t pad_images_bytes(const tsp_conv_problem *p, const tsp_conv_problem *q) {
  const size_t e = element_bytes(p->dtype);
  return (q->c_in != p->c_in ? align256((size_t)(q->n_in * q->c_in) * e) : 0) +
         align256((size_t)(q->volume * q->c_in * q->c_out) * e) +
         (q->c_out != p->c_out ? align256((size_t)(q->n_out * q->c_out) * e) : 0);
}

/* *q = the padded problem of p (multiple m) and *im its images in the workspace. */
static tsp_status carve_images(const tsp_conv_problem *p, int m, void *workspace, size_t workspace_bytes,
                               tsp_conv_problem *q, pad_images *im) {
  *q = padded_problem(p, m);
  const size_t need = pad_images_bytes(p, q), e = element_bytes(p->dtype);
  if (workspace == NULL || workspace_bytes < need) return TSP_ERR_ARGUMENT;
  unsigned char *at = (unsigned char *)workspace;
  im->in = im->out = NULL;
  if (q->c_in != p->c_in) {
    im->in = at;
    at += align256((size_t)(q->n_in * q->c_in) * e);
  }
  im->w = at;
  at += align256((size_t)(q->volume * q->c_in * q->c_out) * e);
  if (q->c_out != p->c_out) im->out = at;
  im->e = (int)e;
  im->rest_bytes = workspace_bytes - need;
  im->rest = im->rest_bytes > 0 ? (unsigned char *)workspace + need : NULL;
  return TSP_OK;
}

/* Workspace of tiles 14-17: their tile counter, where the blocks read it
** (tsp_conv_wgmma_ws_counted over all the pass's rows: no segment has more;
** launch_ws zeroes it; a segmented pass's launches take turns with it, in stream
** order) and the problem brings no counter of its stream
** (tsp_conv_problem.tile_counter).  Passes with fewer tiles (a U-Net's deep
** levels) allocate nothing.  256 bytes for an 8-byte counter: the fp32
** partials after it stay aligned. */
enum { WS_COUNTER_BYTES = 256 };

/* Split-K's runs per tile (TSP_DATAFLOW_SPLIT_K, the shim checks 2 .. TSP_SPLIT_K_MAX); 1: none. */
static int split_k(tsp_algo algo) {
  if (algo.dataflow != TSP_DATAFLOW_SPLIT_K || algo.split < 2) return 1;
  return algo.split < TSP_SPLIT_K_MAX ? algo.split : TSP_SPLIT_K_MAX;
}

/* Whether a segmented plan sums in fp32 partials: when more than one of the
** segments that produce the output (not add_out) sums anything, or the only
** one covers some rows only.  One all-rows segment, alone or followed by
** add_out segments (the density split), stores straight into the output. */
static int segs_need_accum(const tsp_segment *segs, int n_segs) {
  int works = 0, all_rows = 0;
  for (int i = 0; i < n_segs && segs && !segs[i].add_out; ++i)
    if (segs[i].count > 0 && segs[i].offsets != 0) {
      ++works;
      all_rows = segs[i].all_rows;
    }
  return works > 1 || (works == 1 && !all_rows);
}

/* Whether one output-stationary pass's blocks take tiles from a counter:
** output_stationary's test, with the tile it resolves for all the pass's
** rows (no segment has more); os_counts_tile when the caller resolved it. */
static int os_counts_tile(const tsp_conv_problem *p, int64_t rows, int64_t n, int tile) {
  return tsp_is_ws_tile(tile) && tsp_conv_wgmma_ws_counted(rows, n, tile, split_k(p->algo));
}

static int os_counts(const tsp_conv_problem *p, int64_t rows, int64_t red, int64_t n) {
  return os_counts_tile(p, rows, n, resolve_tile(p->dtype, red, n, p->volume, rows, p->algo.tile));
}

/* Workspace of one output-stationary pass: the wgmma forward's K-major copy
** of w (tiles 6-10; 14-17: the blocks' tile counter), then
** fp32 partial sums: [rows, n] for segmented plans that need them
** (segs_need_accum), [splits, rows, n] for split-K. */
static size_t os_workspace(const tsp_conv_problem *p, int64_t rows, int64_t red, int64_t n,
                           const tsp_segment *segs, int n_segs) {
  size_t bytes = 0;
  const int tile = resolve_tile(p->dtype, red, n, p->volume, rows, p->algo.tile);
  if (tsp_is_ws_tile(tile))
    bytes = p->tile_counter == NULL && os_counts_tile(p, rows, n, tile) ? WS_COUNTER_BYTES : 0;
  else if (is_wgmma_tile(tile) && !tsp_conv_wgmma_reads_mn(tile))
    bytes = align256(tsp_conv_wgmma_workspace(p->volume, p->c_in, p->c_out));
  if (n_segs > 0 && segs_need_accum(segs, n_segs))
    bytes += (size_t)(rows * n) * sizeof(float);
  else if (split_k(p->algo) > 1)
    bytes += (size_t)split_k(p->algo) * (size_t)(rows * n) * sizeof(float);
  return bytes;
}

/* The shim asks once per pass with that pass's problem: the size covers the
** forward (segs) and dgrad (segs_t) output-stationary passes' tile counters,
** K-major weights and fp32 partials, whichever is set; wgrad asks
** tsp_conv_cuda_wgrad_workspace.  Why not wgrad's row-chunk partials here too
** (as before 2026-11-26): a forward then allocated chunks * V * Cin * Cout
** floats it never touched, an allocator call on every forward (C = 32 at
** 0.05 m) and 7 MB per chunk at C = 256. */
size_t tsp_conv_cuda_workspace(const tsp_conv_problem *prob) {
  if (check_problem(prob) != TSP_OK || prob->n_out == 0) return 0;
  const int m = pad_multiple(prob);
  if (m) {
    const tsp_conv_problem q = padded_problem(prob, m);
    return pad_images_bytes(prob, &q) + tsp_conv_cuda_workspace(&q);
  }
  size_t bytes = os_workspace(prob, prob->n_out, prob->c_in, prob->c_out, prob->segs, prob->n_segs);
  const size_t dgrad = os_workspace(prob, prob->n_in, prob->c_out, prob->c_in, prob->segs_t, prob->n_segs_t);
  return dgrad > bytes ? dgrad : bytes;
}

int tsp_conv_cuda_counts(const tsp_conv_problem *prob, int dgrad) {
  if (check_problem(prob) != TSP_OK || prob->n_out == 0) return 0;
  const int m = pad_multiple(prob);
  if (m) {
    const tsp_conv_problem q = padded_problem(prob, m);
    return tsp_conv_cuda_counts(&q, dgrad);
  }
  return dgrad ? os_counts(prob, prob->n_in, prob->c_out, prob->c_in)
               : os_counts(prob, prob->n_out, prob->c_in, prob->c_out);
}

size_t tsp_conv_cuda_wgrad_workspace(const tsp_conv_problem *prob) {
  if (check_problem(prob) != TSP_OK || prob->n_out == 0) return 0;
  const int m = pad_multiple(prob);
  if (m) {
    const tsp_conv_problem q = padded_problem(prob, m);
    return pad_images_bytes(prob, &q) + tsp_conv_cuda_wgrad_workspace(&q);
  }
  size_t bytes = tsp_conv_cuda_workspace(prob);
  const int64_t chunks = tsp_wgrad_chunks(prob);
  if (chunks > 1) {
    const size_t partials = (size_t)chunks * (size_t)(prob->volume * prob->c_in * prob->c_out) * sizeof(float);
    if (partials > bytes) bytes = partials;
  }
  const tsp_conv_problem r = resolve_wgrad(prob);
  const size_t pieces = tsp_conv_wgmma_wgrad_workspace(&r, r.algo.tile);
  return pieces > bytes ? pieces : bytes;
}

typedef enum { OS_SIMPLE, OS_IGEMM, OS_WGMMA, OS_TF32 } os_kernel;

/* transposed_w: a->w is [volume, n, red] (K-major for wgmma). */
static tsp_status os_launch(os_kernel kind, tsp_dtype dtype, const tsp_os_launch *a,
                            int transposed_w, int tile) {
  if (kind == OS_WGMMA) return tsp_conv_wgmma_os(dtype, a, tile, transposed_w);
  if (kind == OS_TF32) return tsp_conv_tf32_os(a, transposed_w);
  return tsp_conv_igemm_os(dtype, a, transposed_w, tile);
}

/* Launch segment g of a segmented pass in `mode` (a: the pass's launch). */
static tsp_status segment_launch(os_kernel kind, tsp_dtype dtype, const tsp_os_launch *a,
                                 const tsp_segment *g, int mode, int transposed_w, int tile) {
  tsp_os_launch sa = *a;
  sa.order = a->order + g->start;
  sa.plan = g->plan; /* its map rows follow its row entries: tsp_os_plan_map */
  sa.tile_rows = g->count;
  sa.offsets = g->offsets;
  sa.mode = mode;
  if (mode == TSP_EPI_OUT_ADD) sa.accum = NULL;
  return os_launch(kind, dtype, &sa, transposed_w, tile);
}

/*
** Forward and dgrad are one output-stationary problem with roles swapped.
** Without segments: one launch over all rows and offsets.  With segments
** (tsp_segment): one launch per non-empty segment, in order.  The segments
** that produce the output sum in fp32 partials: the first initialises them
** (or, when its rows are not all rows, a memset does), the last all-rows
** segment rounds partials + sum into out; if the last covers only some rows,
** a final pass rounds the partials; a lone all-rows segment stores straight
** into out.  Then each add_out segment adds its sums into out.  Shapes the
** tensor-core kernels do not take run the plain pass (the same sum; segments
** only steer which tile does which part).
*/
static tsp_status output_stationary(tsp_dtype dtype, const tsp_os_launch *base, int transposed_w,
                                    tsp_algo algo, const tsp_segment *segs, int n_segs,
                                    void *workspace, size_t workspace_bytes) {
  const int64_t rows = base->rows, n = base->n;
  cudaStream_t stream = base->stream;
  if (rows == 0 || n == 0) return TSP_OK;
  if (base->red == 0 || base->src_rows == 0) /* no term in any sum */
    return tsp_cuda_check(cudaMemsetAsync(base->out, 0, (size_t)(rows * n) * element_bytes(dtype),
                                          stream),
                          "tsp_conv: zero output");
  tsp_os_launch a = *base;
  const int tile = resolve_tile(dtype, a.red, n, a.volume, rows, algo.tile);
  os_kernel kind = OS_SIMPLE;
  if (fast_dtype(dtype) && is_wgmma_tile(tile) && tsp_conv_wgmma_check(dtype, &a, tile) == TSP_OK)
    kind = OS_WGMMA;
  else if (fast_dtype(dtype) && tsp_conv_igemm_check(dtype, &a) == TSP_OK)
    kind = OS_IGEMM;
  else if (tf32_asked(dtype, tile) && tsp_conv_tf32_check(&a) == TSP_OK)
    kind = OS_TF32;
  if (kind == OS_SIMPLE)
    return tsp_conv_simple_os(dtype, a.src, a.src_rows, a.w, a.map, rows, a.volume, a.red, n,
                              transposed_w, a.out, stream);
  if (a.plan && n_segs > 0) return TSP_ERR_ARGUMENT; /* the shim refuses it first */
  unsigned char *ws = (unsigned char *)workspace;
  size_t used = 0;
  if (kind == OS_WGMMA && tsp_is_ws_tile(tile)) { /* both passes read w as it is */
    if (a.tile_counter == NULL && tsp_conv_wgmma_ws_counted(rows, n, tile, split_k(algo))) {
      if (ws == NULL || workspace_bytes < WS_COUNTER_BYTES) return TSP_ERR_ARGUMENT;
      a.tile_counter = (int32_t *)ws;
      used = WS_COUNTER_BYTES;
    }
  } else if (kind == OS_WGMMA && !transposed_w && !tsp_conv_wgmma_reads_mn(tile)) {
    /* forward on tiles 6-10: K-major copy of w first */
    const size_t wbytes = align256(tsp_conv_wgmma_workspace(a.volume, a.red, n));
    if (ws == NULL || workspace_bytes < wbytes) return TSP_ERR_ARGUMENT;
    tsp_status s = tsp_conv_wgmma_weights(dtype, &a, ws);
    if (s != TSP_OK) return s;
    a.w = ws;
    used = wbytes;
    transposed_w = 1; /* the copy is [volume, n, red] */
  }
  const int splits = split_k(algo);
  if (n_segs <= 0 && splits > 1) { /* split-K: runs write partials, then a fixed-order sum */
    const size_t acc_bytes = (size_t)splits * (size_t)(rows * n) * sizeof(float);
    if (ws == NULL || workspace_bytes < used + acc_bytes) return TSP_ERR_ARGUMENT;
    a.tile_rows = rows;
    a.offsets = ~(uint64_t)0;
    a.accum = (float *)(ws + used);
    a.mode = TSP_EPI_ACC_INIT;
    a.splits = splits;
    tsp_status s = os_launch(kind, dtype, &a, transposed_w, tile);
    if (s != TSP_OK) return s;
    return tsp_conv_reduce_partials(dtype, a.accum, splits, rows * n, a.out, stream);
  }
  if (n_segs <= 0) {
    a.tile_rows = rows;
    a.offsets = ~(uint64_t)0;
    a.accum = NULL;
    a.mode = TSP_EPI_STORE;
    return os_launch(kind, dtype, &a, transposed_w, tile);
  }
  if (a.order == NULL || segs == NULL) return TSP_ERR_ARGUMENT;
  int n_base = 0, last = -1, adds = 0;
  for (int i = 0; i < n_segs; ++i) {
    const tsp_segment *g = &segs[i];
    if (g->start < 0 || g->count < 0 || (g->all_rows && g->count != rows) ||
        (!g->add_out && n_base != i)) /* a producing segment after an add_out one */
      return TSP_ERR_ARGUMENT;
    if (!g->add_out) ++n_base;
    const int works = g->count > 0 && g->offsets != 0;
    if (works && !g->add_out) last = i;
    adds += works && g->add_out;
  }
  const int need_accum = segs_need_accum(segs, n_segs);
  const size_t acc_bytes = (size_t)(rows * n) * sizeof(float);
  if (need_accum && (ws == NULL || workspace_bytes < used + acc_bytes)) return TSP_ERR_ARGUMENT;
  a.accum = need_accum ? (float *)(ws + used) : NULL;
  if (last < 0) { /* nothing produces the output: zeros, which the add_out segments add to */
    tsp_status s = tsp_cuda_check(cudaMemsetAsync(a.out, 0, (size_t)(rows * n) * element_bytes(dtype), stream),
                                  "tsp_conv: zero output");
    if (s != TSP_OK || adds == 0) return s;
  } else {
    int started = 0, finished = 0;
    for (int i = 0; i <= last; ++i) {
      const tsp_segment *g = &segs[i];
      if (g->count == 0 || g->offsets == 0) continue;
      int mode;
      if (!started) {
        if (g->all_rows) {
          mode = i == last ? TSP_EPI_STORE : TSP_EPI_ACC_INIT;
        } else {
          tsp_status s = tsp_cuda_check(cudaMemsetAsync(a.accum, 0, acc_bytes, stream),
                                        "tsp_conv: zero partial sums");
          if (s != TSP_OK) return s;
          mode = TSP_EPI_ACC_ADD;
        }
        started = 1;
      } else {
        mode = i == last && g->all_rows ? TSP_EPI_ACC_FINISH : TSP_EPI_ACC_ADD;
      }
      tsp_status s = segment_launch(kind, dtype, &a, g, mode, transposed_w, tile);
      if (s != TSP_OK) return s;
      finished = mode == TSP_EPI_STORE || mode == TSP_EPI_ACC_FINISH;
    }
    if (!finished) {
      tsp_status s = tsp_conv_reduce_partials(dtype, a.accum, 1, rows * n, a.out, stream);
      if (s != TSP_OK) return s;
    }
  }
  for (int i = n_base; i < n_segs; ++i) {
    const tsp_segment *g = &segs[i];
    if (g->count == 0 || g->offsets == 0) continue;
    tsp_status s = segment_launch(kind, dtype, &a, g, TSP_EPI_OUT_ADD, transposed_w, tile);
    if (s != TSP_OK) return s;
  }
  return TSP_OK;
}

/* The one place that decides whether a pass reads a step plan (torchsp.h):
** the records after the `rows` entries of `order` when it holds one (`form`,
** tsp_conv_problem.order_plan) and the pass is plain (no segments, no
** split-K, rows sorted: the plan lists every row and offset of the unsplit
** tiles), else NULL.  Also NULL when the records are not 16-byte aligned (a
** view at an odd offset): the kernels copy them in 16-byte words, and the
** order alone gives the same sums.  Kernels without 128-row tiles ignore it. */
static const int32_t *pass_steps(const int32_t *order, int32_t form, int64_t rows, int n_segs, tsp_algo algo) {
  if (order == NULL || form != TSP_ORDER_STEPS || n_segs > 0 || algo.threshold == -1 || split_k(algo) > 1)
    return NULL;
  const int32_t *steps = order + tsp_tile_steps_base(rows);
  return ((uintptr_t)steps & 15) == 0 ? steps : NULL;
}

/* Forward (dgrad 0: src x, out y) or dgrad (src dy, out dx) of p on padded
** images, `m` = pad_multiple(p) (Channel padding, above). */
static tsp_status padded_os(const tsp_conv_problem *p, int m, int dgrad, const void *src, const void *w,
                            const int32_t *map, void *out, void *workspace, size_t workspace_bytes,
                            tsp_cuda_stream stream) {
  tsp_conv_problem q;
  pad_images im;
  tsp_status s = carve_images(p, m, workspace, workspace_bytes, &q, &im);
  if (s != TSP_OK) return s;
  /* The gathered operand's image is on the output side of the map for dgrad. */
  void *src_img = dgrad ? im.out : im.in, *out_img = dgrad ? im.in : im.out;
  const int64_t src_rows = dgrad ? p->n_out : p->n_in, out_rows = dgrad ? p->n_in : p->n_out;
  const int64_t src_c = dgrad ? p->c_out : p->c_in, src_c2 = dgrad ? q.c_out : q.c_in;
  const int64_t out_c = dgrad ? p->c_in : p->c_out, out_c2 = dgrad ? q.c_in : q.c_out;
  const tsp_pad_job jobs[2] = {{w, im.w, p->volume, p->c_in, p->c_out, q.c_in, q.c_out},
                               {src, src_img, 1, src_rows, src_c, src_rows, src_c2}};
  s = tsp_conv_pad_images(jobs, src_img ? 2 : 1, im.e, (cudaStream_t)stream);
  if (s != TSP_OK) return s;
  const void *src_q = src_img ? src_img : src;
  void *out_q = out_img ? out_img : out;
  s = dgrad ? tsp_conv_dgrad_cuda(&q, src_q, im.w, map, out_q, im.rest, im.rest_bytes, stream)
            : tsp_conv_fwd_cuda(&q, src_q, im.w, map, out_q, im.rest, im.rest_bytes, stream);
  if (s != TSP_OK || out_img == NULL) return s;
  return tsp_conv_crop(out_img, out, 1, out_rows, out_c, out_rows, out_c2, im.e, (cudaStream_t)stream);
}

tsp_status tsp_conv_fwd_cuda(const tsp_conv_problem *prob, const void *x, const void *w,
                             const int32_t *nbmap, void *y, void *workspace,
                             size_t workspace_bytes, tsp_cuda_stream stream) {
  tsp_status s = check_problem(prob);
  if (s != TSP_OK) return s;
  const int m = pad_multiple(prob);
  if (m) return padded_os(prob, m, 0, x, w, nbmap, y, workspace, workspace_bytes, stream);
  const int segmented = prob->n_segs > 0;
  const tsp_os_launch a = {x, prob->n_in, w, nbmap,
                           segmented || prob->algo.threshold != -1 ? prob->order : NULL,
                           prob->n_out, prob->volume, prob->c_in, prob->c_out, y,
                           (cudaStream_t)stream, prob->n_out, ~(uint64_t)0, NULL, TSP_EPI_STORE,
                           prob->tile_counter, 0, prob->order_plan == TSP_ORDER_TILE_PLAN,
                           pass_steps(prob->order, prob->order_plan, prob->n_out, prob->n_segs, prob->algo),
                           prob->tile_counter != NULL};
  return output_stationary(prob->dtype, &a, 0, prob->algo, prob->segs, prob->n_segs,
                           workspace, workspace_bytes);
}

tsp_status tsp_conv_dgrad_cuda(const tsp_conv_problem *prob, const void *dy, const void *w,
                               const int32_t *nbmap_t, void *dx, void *workspace,
                               size_t workspace_bytes, tsp_cuda_stream stream) {
  tsp_status s = check_problem(prob);
  if (s != TSP_OK) return s;
  const int m = pad_multiple(prob);
  if (m) return padded_os(prob, m, 1, dy, w, nbmap_t, dx, workspace, workspace_bytes, stream);
  const int segmented = prob->n_segs_t > 0;
  const tsp_os_launch a = {dy, prob->n_out, w, nbmap_t,
                           segmented || prob->algo.threshold != -1 ? prob->order_t : NULL,
                           prob->n_in, prob->volume, prob->c_out, prob->c_in, dx,
                           (cudaStream_t)stream, prob->n_in, ~(uint64_t)0, NULL, TSP_EPI_STORE,
                           prob->tile_counter, 0, prob->order_t_plan == TSP_ORDER_TILE_PLAN,
                           pass_steps(prob->order_t, prob->order_t_plan, prob->n_in, prob->n_segs_t,
                                      prob->algo),
                           prob->tile_counter != NULL};
  return output_stationary(prob->dtype, &a, 1, prob->algo, prob->segs_t, prob->n_segs_t,
                           workspace, workspace_bytes);
}

/* wgrad of p on padded images (Channel padding, above): dw's image cropped into dw. */
static tsp_status padded_wgrad(const tsp_conv_problem *p, int m, const void *x, const void *dy,
                               const int32_t *nbmap, void *dw, void *workspace, size_t workspace_bytes,
                               tsp_cuda_stream stream) {
  tsp_conv_problem q;
  pad_images im;
  tsp_status s = carve_images(p, m, workspace, workspace_bytes, &q, &im);
  if (s != TSP_OK) return s;
  tsp_pad_job jobs[2];
  int n_jobs = 0;
  const tsp_pad_job x_job = {x, im.in, 1, p->n_in, p->c_in, p->n_in, q.c_in};
  const tsp_pad_job dy_job = {dy, im.out, 1, p->n_out, p->c_out, p->n_out, q.c_out};
  if (im.in) jobs[n_jobs++] = x_job;
  if (im.out) jobs[n_jobs++] = dy_job;
  s = tsp_conv_pad_images(jobs, n_jobs, im.e, (cudaStream_t)stream);
  if (s != TSP_OK) return s;
  s = tsp_conv_wgrad_cuda(&q, im.in ? im.in : x, im.out ? im.out : dy, nbmap, im.w, im.rest, im.rest_bytes,
                          stream);
  if (s != TSP_OK) return s;
  return tsp_conv_crop(im.w, dw, p->volume, p->c_in, p->c_out, q.c_in, q.c_out, im.e, (cudaStream_t)stream);
}

tsp_status tsp_conv_wgrad_cuda(const tsp_conv_problem *prob, const void *x, const void *dy,
                               const int32_t *nbmap, void *dw, void *workspace,
                               size_t workspace_bytes, tsp_cuda_stream stream) {
  tsp_status s = check_problem(prob);
  if (s != TSP_OK) return s;
  cudaStream_t st = (cudaStream_t)stream;
  const int64_t count = prob->volume * prob->c_in * prob->c_out;
  if (count == 0) return TSP_OK;
  if (prob->n_out == 0 || prob->n_in == 0) /* no pair anywhere: dw = 0 */
    return tsp_cuda_check(cudaMemsetAsync(dw, 0, (size_t)count * element_bytes(prob->dtype), st),
                          "tsp_conv_wgrad: zero dw");
  const int m = pad_multiple(prob);
  if (m) return padded_wgrad(prob, m, x, dy, nbmap, dw, workspace, workspace_bytes, stream);
  if (workspace_bytes < tsp_conv_cuda_wgrad_workspace(prob)) return TSP_ERR_ARGUMENT;
  float *partials = (float *)workspace;
  if (fast_dtype(prob->dtype)) { /* unsupported tiles and shapes fall through to mma.sync */
    const tsp_conv_problem r = resolve_wgrad(prob);
    s = tsp_conv_wgmma_wgrad(&r, x, dy, nbmap, dw, workspace, workspace_bytes, r.algo.tile, st);
    if (s != TSP_ERR_UNSUPPORTED) return s;
  }
  if ((fast_dtype(prob->dtype) || tf32_asked(prob->dtype, prob->algo.tile)) &&
      tsp_device_cc() >= 80) {
    s = tsp_conv_mma_wgrad(prob, x, dy, nbmap, dw, partials, st);
    if (s != TSP_ERR_UNSUPPORTED) return s;
  }
  return tsp_conv_simple_wgrad(prob, x, dy, nbmap, dw, partials, st);
}
