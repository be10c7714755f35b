/*
** torchsp.h: the C interface between the PyTorch shim (csrc/shim_cpu.cpp, csrc/shim_cuda.cpp) and the
** kernels (C11 files in csrc/cpu, CUDA C files in csrc/cuda).
**
** Kernels see raw pointers, sizes and (CUDA) a stream; no ATen type crosses this
** line, so every .cu file compile-checks with plain `nvcc -c` and every .c file
** builds as C11.  Conventions are those of DESIGN.md:
**   - coordinates are int32 [N, 4] rows (batch, x, y, z) at full resolution;
**   - kernel offset k = (ix * Ky + iy) * Kz + iz, z fastest;
**     delta_k = sign * (i * dilation - padding) * step on each axis;
**   - weight is [V, Cin, Cout], row-major, V = Kx * Ky * Kz;
**   - a kernel map `nbmap` is int32 [N_out, V]: nbmap[q, k] is the input row at
**     out_coords[q] + delta_k, or -1.  Its transpose `nbmap_t` is [N_in, V]:
**     nbmap_t[p, k] = q where nbmap[q, k] = p, or -1 (unique: q -> q + delta_k
**     is injective for a fixed k).
** All row indices are int32 (N < 2^31); products N * V and N * C are int64.
*/
#ifndef TORCHSP_H
#define TORCHSP_H

#include <stddef.h>
#include <stdint.h>

#include "tsp_key.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TSP_OK = 0,
  TSP_ERR_RANGE = 1,     /* a coordinate, given or derived, cannot be packed into a key */
  TSP_ERR_ARGUMENT = 2,  /* a size, index or parameter the kernel cannot take */
  TSP_ERR_ALLOC = 3,     /* host allocation failed (CPU kernels) */
  TSP_ERR_CUDA = 4,      /* a CUDA call or launch failed; see tsp_cuda_last_error() */
  TSP_ERR_UNSUPPORTED = 5 /* dtype or dataflow not built for this backend */
} tsp_status;

typedef enum {
  TSP_FLOAT32 = 0,
  TSP_FLOAT64 = 1,  /* CPU only (gradcheck) */
  TSP_FLOAT16 = 2,  /* CUDA; the CPU shim upcasts to float32 */
  TSP_BFLOAT16 = 3  /* CUDA; the CPU shim upcasts to float32 */
} tsp_dtype;

/* cudaStream_t without the CUDA headers (same underlying type). */
typedef struct CUstream_st *tsp_cuda_stream;

/* One kernel's V offsets.  delta_k[a] = sign * (i_a * dilation[a] - padding[a]) * step[a]. */
typedef struct {
  int32_t kernel[3];   /* Kx, Ky, Kz, each >= 1 */
  int32_t dilation[3]; /* >= 1 */
  int32_t padding[3];  /* >= 0, in units of step */
  int32_t step[3];     /* the tensor stride offsets are measured in, >= 1 */
  int32_t sign;        /* +1: q reads q + delta (conv); -1: q reads q - delta (transposed conv) */
} tsp_kernel;

static inline TSP_HD int64_t tsp_kernel_volume(const tsp_kernel *kern) {
  return (int64_t)kern->kernel[0] * kern->kernel[1] * kern->kernel[2];
}

/* delta_k of offset k, per axis. */
static inline TSP_HD void tsp_kernel_offset(const tsp_kernel *kern, int64_t k, int32_t delta[3]) {
  int32_t iz = (int32_t)(k % kern->kernel[2]);
  int32_t iy = (int32_t)((k / kern->kernel[2]) % kern->kernel[1]);
  int32_t ix = (int32_t)(k / ((int64_t)kern->kernel[2] * kern->kernel[1]));
  delta[0] = kern->sign * (ix * kern->dilation[0] - kern->padding[0]) * kern->step[0];
  delta[1] = kern->sign * (iy * kern->dilation[1] - kern->padding[1]) * kern->step[1];
  delta[2] = kern->sign * (iz * kern->dilation[2] - kern->padding[2]) * kern->step[2];
}

/* Output coordinates of strided, generative and transposed-generative convs
** (DESIGN.md section 3).  Candidates are q = p - delta_k for every input p and
** offset k, kept when q is a multiple of `lattice` on every axis (floor mod,
** so negative coordinates work).  With floor_rule, the single candidate
** floor(p / lattice) * lattice per input is used instead (MinkowskiEngine).
** Result: the sorted unique keys of the kept candidates. */
typedef struct {
  tsp_kernel kernel;
  int32_t lattice[3]; /* output tensor stride: s * t for strided, t for generative */
  int32_t floor_rule; /* 0: active-site rule; 1: floor rule */
} tsp_out_coords_params;

/* How kernel maps are searched. */
typedef enum {
  TSP_KMAP_ZDELTA = 0, /* Spira: sorted keys, one binary search per (q, dx, dy) column, scan over z */
  TSP_KMAP_HASH = 1    /* open addressing on packed keys */
} tsp_kmap_method;

/* Dataflow of one convolution pass (forward, dgrad or wgrad). */
typedef enum {
  TSP_DATAFLOW_OUTPUT_STATIONARY = 0, /* per output row, sum over offsets; no atomics */
  TSP_DATAFLOW_WEIGHT_STATIONARY = 1, /* per offset over its pairs (CPU: conv.c; CUDA: segments) */
  TSP_DATAFLOW_HYBRID = 2,            /* offsets with L1 < threshold OS, rest WS (CUDA: segments; CPU: as 0) */
  TSP_DATAFLOW_SPLIT_K = 3,           /* output-stationary, each tile's offsets cut into algo.split runs
                                         summed by separate blocks of one launch (CUDA; CPU: as 0) */
  TSP_DATAFLOW_GATHER_GEMM_SCATTER = 4, /* TorchSparse's gather-GEMM-scatter, offsets batched into
                                         groups of similar pair counts (algo.threshold: the padding
                                         a group may add, in percent of its pairs), one cuBLAS bmm
                                         per group (CUDA forward and dgrad with segments: the shim,
                                         csrc/shim_ggs.cpp; without segments and for wgrad: as 0;
                                         CPU: as 1) */
  TSP_DATAFLOW_DENSITY_SPLIT = 5      /* output-stationary in two segments: the offsets that at
                                         least algo.threshold percent of the rows have, over all
                                         rows; then the rest, over only the rows that have any,
                                         added into the output (CUDA: segments, torchsp/plan.py;
                                         CPU and wgrad: as 0) */
} tsp_dataflow;

/* Largest algo.split of split-K (TSP_DATAFLOW_SPLIT_K): its fp32 partials take
** split * rows * n * 4 bytes of workspace. */
enum { TSP_SPLIT_K_MAX = 16 };

/* A pass's algorithm choice: what the autotuner picks and caches.  The int[]
** argument of the conv ops is these four numbers in this order.  A backend
** serves a dataflow it lacks with output-stationary (same result).  On CUDA
** the dataflow reaches the kernels as segments (tsp_segment, built by
** torchsp/plan.py from these numbers); every CUDA and CPU dataflow is
** atomic-free and deterministic.
**
** tile on CUDA, fp16/bf16: 0 is the kernel's default (on sm_90a builds on
** sm_90 devices when both channel counts are >= 64: the swizzled wgmma tile
** 18 for 33-64 produced channels (13 without a step plan or with split-K),
** the ping-pong tile 16 for 65-128 where it fits, the
** warp-specialized 15 above; on passes with few 128-row tiles for the GPU's
** SMs, tile 16 in 128-column tiles above 128 too, or 17 (the ping-pong tile in
** 64-column tiles) on the fewest; else mma.sync: cuda/conv.cu resolve_tile); 1-2
** mma.sync shapes, 3 the mma.sync default shape; 6-10, 12-18 wgmma (sm_90a
** builds; 12-18 with 128-byte swizzled operands, 14-17 warp-specialized:
** producer warps copy, consumer warpgroups multiply; 18, TSP_TILE_RING, is 13
** with a step plan's map entries read through a ring of 12 columns, four
** blocks per SM at 64 produced channels or fewer); any other value reads as 3.  wgrad's tile on
** fp16/bf16: 0 the default (the wgmma wgrad of cuda/conv_wgmma_wgrad.cu over
** pair slots, whatever the dataflow, when both channel counts are >= 32 on
** sm_90a builds on sm_90 devices, else mma.sync: cuda/conv.cu resolve_wgrad); 12, 13, 15 its 128 x 128,
** 64 x 64 and 128 x 256 tiles (c_in x c_out); any other value mma.sync
** (cuda/conv_wgrad.cu).  wgrad's dataflow on the wgmma tiles: 0 splits the
** rows into chunks, each block summing one offset of one chunk; 1 shares the
** map's pair list (tsp_conv_problem.pairs, or built in the workspace) out to
** slots as offset groups, each offset's 64-pair slabs dealt to slots in
** proportion to its pairs, or as equal pieces across offsets where more
** offsets have pairs than there are slots (algo.split scales their number;
** cuda/conv_wgrad_pairs.cuh), so the centre offset no longer sets the length.
** On float32, TSP_TILE_TF32 asks for tf32 tensor cores (mma.sync m16n8k8:
** operands rounded to tf32's 10-bit mantissa, unit roundoff 2^-11 instead of fp32's 2^-24, fp32
** accumulation) in whichever pass's algo carries it, forward, dgrad or wgrad, and
** in every dataflow (channel counts not multiples of 4 on zero-padded copies,
** cuda/conv.cu); shapes the tf32 kernels do not take (misaligned operands,
** V > 64, pre-sm_80 devices) and every other tile run the exact fp32 kernels.  Python picks it for float32 when
** torch.backends.cuda.matmul.allow_tf32 is set (torchsp/functional.py). */
enum { TSP_TILE_TF32 = 11, TSP_TILE_RING = 18 };

typedef struct {
  int32_t dataflow;  /* tsp_dataflow */
  int32_t tile;      /* kernel configuration (CUDA: tile shape index, TSP_TILE_TF32 = tf32 on
                        float32); 0 = the kernel's default */
  int32_t split;     /* output-stationary: mask splits (offset groups, torchsp/plan.py); 0 or 1 = none;
                        split-K: the runs each tile's offsets are cut into, 2 .. TSP_SPLIT_K_MAX */
  int32_t threshold; /* hybrid: L1-norm threshold t; output-stationary: -1 = ignore row order (unsorted) */
} tsp_algo;

/* One segment of a segmented output-stationary pass (CUDA): the tiles walk
** the map rows order[start .. start + count) and sum only over the offsets
** whose bit is set in `offsets` (V <= 64).  Segments run in array order and
** their sums add up (fp32 accumulation in the workspace), so one plan
** expresses every dataflow of torchsp/plan.py:
**   - mask splits (TorchSparse++): S segments over all rows, each with a row
**     order sorted by the masks of its own offset group;
**   - weight-stationary (fetch-on-demand): one segment per offset k over its
**     pair list (kernel_map_pairs), offsets = 1 << k; every tile is full;
**   - hybrid (Spira): weight-stationary segments for the offsets with L1 norm
**     >= t, then one segment over all rows for the rest;
**   - density split: the common offsets over all rows, then the rare ones
**     over the rows that have any (add_out).
** A row appears at most once per segment (the sums are plain read-add-write,
** no atomics: deterministic).  Segments with add_out come after all others:
** those first produce the output as if alone, then each add_out segment adds
** its sums into it (read in the output's dtype, fp32 add, one more rounding)
** instead of into fp32 partials, so a plan whose other segments are one
** all-rows segment needs no fp32 workspace and no rounding pass.  The flat
** int list of the ops holds [start, count, offsets, flags] per segment, flags
** = all_rows | 2 * add_out | 4 * plan. */
typedef struct {
  int64_t start;     /* first entry of the segment's rows in order / order_t */
  int64_t count;     /* how many rows */
  uint64_t offsets;  /* bit k: offset k takes part */
  int32_t all_rows;  /* 1 when the rows are every map row (a permutation, count == rows) */
  int32_t add_out;   /* 1: adds into the output the segments before produced (see above) */
  int32_t plan;      /* 1: the `count` row entries are followed in order / order_t by the
                        map rows in that order [count, V] (a tile plan, tsp_mask_plan_*) */
} tsp_segment;

/* Sizes of one convolution.  Forward: x [n_in, c_in] -> y [n_out, c_out].
** dgrad: dy [n_out, c_out] -> dx [n_in, c_in].  wgrad: x, dy -> dw [V, c_in, c_out]. */
typedef struct {
  int64_t n_in;    /* rows of x and dx */
  int64_t n_out;   /* rows of y and dy */
  int64_t c_in;    /* channels of x */
  int64_t c_out;   /* channels of y */
  int64_t volume;  /* V, columns of nbmap and nbmap_t */
  tsp_dtype dtype; /* of features, weight and gradients (all the same) */
  tsp_algo algo;
  /* Optional row orders of the maps for the CUDA output-stationary kernels;
  ** NULL when absent (a zero-initialised problem is the plain call).  Each is
  ** a permutation of its map's rows sorted by neighbour mask (torchsp/kmap.py
  ** builds them with torch.sort), so that a tile of consecutive rows in this
  ** order shares its offsets; entries outside [0, rows) are skipped.  The CPU
  ** kernels and algo.threshold == -1 ignore them.  Device pointers. */
  const int32_t *order;   /* [n_out] order of nbmap's rows (forward) */
  const int32_t *order_t; /* [n_in] order of nbmap_t's rows (dgrad) */
  /* The form of order / order_t (no segments; TSP_ORDER_*): the order alone,
  ** or a tile plan [rows * (1 + V)] (tsp_mask_plan_*: the order, then the map
  ** rows in that order, so a tile reads its rows' entries without first
  ** waiting for the order), or a step plan [tsp_tile_steps_len(rows, V)]
  ** (tsp_tile_steps_*: the order, then each 128-row tile's offsets and map
  ** entries, which the kernels with 128-row tiles copy instead of building). */
  int32_t order_plan;
  int32_t order_t_plan;
  /* Optional segmented plans of the CUDA forward / dgrad (n_segs == 0: one
  ** plain pass).  With segments, order / order_t is instead a concatenation
  ** of row lists that the segments index (see tsp_segment). */
  const tsp_segment *segs;   /* host array [n_segs] (forward) */
  int32_t n_segs;
  const tsp_segment *segs_t; /* host array [n_segs_t] (dgrad) */
  int32_t n_segs_t;
  /* Optional pair list of nbmap for the CUDA wgrad over pair pieces
  ** (tsp_kernel_map_pairs_cuda's result for this map: pairs [n_pairs],
  ** pair_starts [V + 1], device pointers), cached by the caller so that every
  ** layer sharing the map skips building it; NULL: wgrad builds it on the
  ** stream.  Read defensively: starts are clamped to [0, n_pairs] and rows
  ** outside [0, n_out) count as absent, so a list of another map gives wrong
  ** sums but never an access out of bounds.  Other passes ignore it. */
  const int32_t *pairs;
  const int64_t *pair_starts;
  int64_t n_pairs;
  /* Optional with pairs: their input rows, pair_rows[i] = nbmap[pairs[i], k]
  ** for the i of offset k's run ([n_pairs]; tsp_kernel_map_pairs_* with
  ** rows), so wgrad reads x's row beside dy's instead of looking it up in
  ** nbmap, a 32-byte sector of the map for 4 bytes, per pair.  Rows outside
  ** [0, n_in) count as absent.  NULL: wgrad looks them up. */
  const int32_t *pair_rows;
  /* Optional (CUDA forward and dgrad): 8 bytes of device memory, 8-aligned,
  ** zero whenever no pass is running on this pass's stream.  The
  ** warp-specialized tiles (14-17) take further tiles from it and count their
  ** takers out in it, and the last taker of a launch puts it back to zero
  ** (cuda/conv_wgmma_ws.cu), so such a pass needs no workspace and no memset for its tile
  ** counter (an allocator call and a memset launch, ~4 us of host time a pass
  ** on the H100 machine).  The shim keeps one per device and stream, and none
  ** while the stream is being captured into a CUDA graph (a graph may replay
  ** on another stream beside eager work on this one).  NULL: the counter lives
  ** in the workspace and is zeroed before each launch. */
  int32_t *tile_counter;
} tsp_conv_problem;


/* Row order of a kernel map [n_rows, V] for tsp_conv_problem.order: the rows
** stably sorted by neighbour mask, V <= 63.  The mask of row r has one bit
** per offset k, set when map[r, k] >= 0, at position rank(k): offsets ranked
** by how many rows have them, most common first (ties by k), so that the
** rare offsets are the most significant bits and rows sharing them are
** adjacent (lidar_198k at 0.1 m: 12.6 offsets per 128-row tile instead of
** 13.8 with bit k at position k).  `offsets` picks the offsets that take
** part (bit k set: offset k does; ~0 = all): any other offset is treated as
** absent everywhere, no bit in any mask and a count of 0 in the ranking, so
** a kernel that serves some offsets another way (weight-stationary) can sort
** its rows by the rest alone. */
enum { TSP_MASK_ORDER_MAX_VOLUME = 63 };

/* tsp_conv_problem.order_plan: what order / order_t holds. */
enum { TSP_ORDER_ROWS = 0, TSP_ORDER_TILE_PLAN = 1, TSP_ORDER_STEPS = 2 };

/* Tile plan of a map [n_rows, V] and one of its row orders (tsp_mask_plan_*):
** plan [n_rows * (1 + V)], the order (plan[i] = order[i]), then the map rows
** in that order (plan[n_rows + i * V + k] = map[order[i], k]); an order entry
** outside [0, n_rows) gives -1 and a row of -1.  Its first n_rows entries are
** the order itself, so the conv passes take it in place of the order
** (tsp_conv_problem.order_plan). */

/* Tile packing of a row order of a map [n_rows, V] (1 <= V <= 64;
** tsp_tile_pack_cpu, and on CUDA inside tsp_tile_steps_cuda;
** cpu/tile_pack.c says why and how): within each window of TSP_PACK_WINDOW
** consecutive entries of the order (from entry 0; the last may be shorter),
** TSP_PACK_ROWS-row tiles built greedily, each seeded with the mask of most
** entries left and filled with the entries whose masks lie inside the tile's
** offsets first, so that the 128-row tiles of a step plan use fewer offsets.
** out [n_rows] is a permutation of order's entries (an entry outside
** [0, n_rows) keeps its value and counts as a row without offsets); the same
** result on both devices. */
enum { TSP_PACK_WINDOW = 4096, TSP_PACK_ROWS = 128 };

/* Step plan of a map [n_rows, V] (1 <= V <= 64) and one of its row orders
** (tsp_tile_steps_*): each 128-row tile of the order, refined first when
** `refine` is nonzero (packed: tsp_tile_pack_cpu), listed once so that the CUDA output-stationary
** kernels copy it instead of reading and sorting their rows' map entries on
** every call.  steps [R + tiles * W] int32, R = tsp_tile_steps_base(n_rows)
** (n_rows rounded up to a multiple of 4, so that records start 16-byte
** aligned), tiles = ceil(n_rows / 128), W = tsp_tile_steps_words(V): the
** (refined) order (steps[i] = refined[i] or order[i], -1 for an entry
** outside [0, n_rows)), -1 up to R, then tile t's record at R + t * W, for rows
** steps[128 t .. 128 t + 127]:
**   groups[V]  bit g of groups[k] set when a row of the tile's 16-row group g
**              (tile rows 16 g .. 16 g + 15) has offset k (map entry >= 0);
**   list[V]    the offsets k with groups[k] != 0, increasing, then zeros;
**   count      how many list holds, then 3 zero words;
**   rows[128]  the map row of each tile row (the order's entry), -1 past
**              n_rows or for an entry outside [0, n_rows);
**   zeros up to H = tsp_tile_steps_head(V) words (a multiple of 4);
**   cols       V columns of 128 words from H: column j < count holds the map
**              entries of offset list[j] of the tile rows, -1 where the row is
**              -1 or the entry negative; the later columns are all -1;
** and after the last record, the schedule sched[tiles] at
** tsp_tile_steps_sched(n_rows, V), the order in which the ping-pong kernel
** (tile 16) takes the tiles: with refine, the tile indices by decreasing
** count, ties by decreasing index (the longest tiles first, so the last wave
** is of short ones); without, -1 in every word: no schedule, and the kernel
** walks the tiles by decreasing index, as the others do, without reading it.
** The conv passes take it in place of an unsegmented order
** (tsp_conv_problem.order_plan = TSP_ORDER_STEPS) and read the map entries
** from it, not from the map, so it must be the plan of the map it comes
** with; they check every word they use (a wrong plan gives wrong sums, never
** an access out of bounds). */
enum { TSP_STEPS_ROWS = 128, TSP_STEPS_MAX_VOLUME = 64 /* offsets a plan takes: 64-bit masks */ };
static inline int64_t tsp_tile_steps_head(int64_t volume) {
  return (2 * volume + 4 + TSP_STEPS_ROWS + 3) & ~(int64_t)3;
}
static inline int64_t tsp_tile_steps_words(int64_t volume) {
  return tsp_tile_steps_head(volume) + TSP_STEPS_ROWS * volume;
}
static inline int64_t tsp_tile_steps_base(int64_t n_rows) { return (n_rows + 3) & ~(int64_t)3; }
static inline int64_t tsp_tile_steps_sched(int64_t n_rows, int64_t volume) {
  return tsp_tile_steps_base(n_rows) + (n_rows + TSP_STEPS_ROWS - 1) / TSP_STEPS_ROWS * tsp_tile_steps_words(volume);
}
static inline int64_t tsp_tile_steps_len(int64_t n_rows, int64_t volume) {
  return tsp_tile_steps_sched(n_rows, volume) + (n_rows + TSP_STEPS_ROWS - 1) / TSP_STEPS_ROWS;
}

/* Weight-stationary form of a kernel map [n_rows, V] ("pairs"): for each
** offset k in increasing k, the rows q with map[q, k] >= 0 in increasing q,
** concatenated into pairs [P] (int32); starts [V + 1] (int64) delimits them:
** offset k owns pairs[starts[k] .. starts[k + 1]), starts[0] = 0 and
** starts[V] = P.  Only q is stored; the input row of the pair is map[q, k].
** Any negative entry is absent.  Two calls, because P sizes the output:
** _pair_counts fills starts, the caller allocates pairs [starts[V]], then
** _pairs fills it.  The result is a function of the map alone (no atomics
** decide a position), on both devices. */

/* ------------------------------------------------------------------ CPU --- */

tsp_status tsp_mask_order_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                              uint64_t offsets, int32_t *order);
tsp_status tsp_mask_plan_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                             const int32_t *order, int32_t *plan);
tsp_status tsp_tile_pack_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                             const int32_t *order, int32_t *out);
tsp_status tsp_tile_steps_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                              const int32_t *order, int refine, int32_t *steps);

/* starts [V + 1] of the map's pairs (see above); volume >= 1. */
tsp_status tsp_kernel_map_pair_counts_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                                          int64_t *starts);
/* pairs [starts[V]] given the starts tsp_kernel_map_pair_counts_cpu filled for this map,
** and when rows is not NULL rows [starts[V]], each pair's input row map[pairs[i], k];
** TSP_ERR_ARGUMENT, nothing written, when the map's counts do not match starts. */
tsp_status tsp_kernel_map_pairs_cpu(const int32_t *map, int64_t n_rows, int64_t volume,
                                    const int64_t *starts, int32_t *pairs, int32_t *rows);

/* Pack n coordinates [n, 4] into keys; TSP_ERR_RANGE if any cannot be packed. */
tsp_status tsp_pack_keys_cpu(const int32_t *coords, int64_t n, int64_t *keys);
void tsp_unpack_keys_cpu(const int64_t *keys, int64_t n, int32_t *coords);

/*
** SparseTensor's value checks in one pass (torchsp.tensor.check_coords_values):
** summary[0..3] = max of (b, x, y, z) over the rows, summary[4..7] = max of
** their bitwise complements (~min: ~ cannot overflow where negation can),
** summary[8] = 1 when some row's x, y or z is not a multiple of stride[axis]
** (else 0), summary[9] = 1 when two rows are equal (else 0).  n = 0 leaves
** every word at TSP_SUMMARY_NONE (the int32 of bytes 0x80).  The duplicate
** test packs keys (tsp_key.h) and skips unpackable rows, so it holds only when
** the range is valid, which the caller checks first.
*/
enum { TSP_SUMMARY_WORDS = 10 };
static const int32_t TSP_SUMMARY_NONE = (int32_t)0x80808080u;
tsp_status tsp_coords_summary_cpu(const int32_t *coords, int64_t n, const int32_t stride[3],
                                  int32_t summary[TSP_SUMMARY_WORDS]);

/* Output coordinates.  keys_out has room for n_in * V keys (n_in with the floor
** rule); *n_out receives how many sorted unique keys were written. */
tsp_status tsp_out_coords_cpu(const tsp_out_coords_params *params, const int32_t *in_coords,
                              int64_t n_in, int64_t *keys_out, int64_t *n_out);

/* Kernel map nbmap [n_out, V] (see the file header). */
tsp_status tsp_kernel_map_cpu(const tsp_kernel *kern, tsp_kmap_method method,
                              const int32_t *in_coords, int64_t n_in,
                              const int32_t *out_coords, int64_t n_out, int32_t *nbmap);

/* nbmap_t [n_in, V] from nbmap [n_out, V].  TSP_ERR_ARGUMENT if an entry is
** outside [-1, n_in) or two outputs claim one input through the same offset. */
tsp_status tsp_kernel_map_transpose_cpu(const int32_t *nbmap, int64_t n_out, int64_t volume,
                                        int64_t n_in, int32_t *nbmap_t);

/* y = sum_k x[nbmap[:, k]] @ w[k].  float32 or float64; y fully written. */
tsp_status tsp_conv_fwd_cpu(const tsp_conv_problem *prob, const void *x, const void *w,
                            const int32_t *nbmap, void *y);
/* dx = sum_k dy[nbmap_t[:, k]] @ w[k]^T; dx fully written. */
tsp_status tsp_conv_dgrad_cpu(const tsp_conv_problem *prob, const void *dy, const void *w,
                              const int32_t *nbmap_t, void *dx);
/* dw[k] = sum_q x[nbmap[q, k]]^T dy[q]; dw fully written. */
tsp_status tsp_conv_wgrad_cpu(const tsp_conv_problem *prob, const void *x, const void *dy,
                              const int32_t *nbmap, void *dw);

/* ----------------------------------------------------------------- CUDA --- */
/* Each CUDA entry point enqueues work on `stream` and does not synchronise.
** Workspace is device memory of at least the bytes its _workspace function
** returns, allocated by the shim (PyTorch's caching allocator); where that is
** 0 the convolution passes take NULL.  Device-side
** failures that need reporting (range errors) are written to a device int32
** `status` the shim reads back only where it must synchronise anyway. */

const char *tsp_cuda_last_error(void);

tsp_status tsp_pack_keys_cuda(const int32_t *coords, int64_t n, int64_t *keys,
                              int32_t *status, tsp_cuda_stream stream);
tsp_status tsp_unpack_keys_cuda(const int64_t *keys, int64_t n, int32_t *coords,
                                tsp_cuda_stream stream);

/* tsp_coords_summary_cpu on the GPU in one memset and one kernel: `buffer` is
** device memory of tsp_coords_summary_cuda_bytes(n) bytes; its first
** TSP_SUMMARY_WORDS int32 receive the summary, the rest holds the duplicate
** test's hash table. */
size_t tsp_coords_summary_cuda_bytes(int64_t n);
tsp_status tsp_coords_summary_cuda(const int32_t *coords, int64_t n, const int32_t stride[3],
                                   void *buffer, size_t buffer_bytes, tsp_cuda_stream stream);

/* Sorted unique output keys into keys_out (room for n_in * V, or n_in with the
** floor rule), their count into *n_out_device, TSP_ERR_RANGE into *status. */
size_t tsp_out_coords_cuda_workspace(const tsp_out_coords_params *params, int64_t n_in);
tsp_status tsp_out_coords_cuda(const tsp_out_coords_params *params, const int32_t *in_coords,
                               int64_t n_in, int64_t *keys_out, int64_t *n_out_device,
                               int32_t *status, void *workspace, size_t workspace_bytes,
                               tsp_cuda_stream stream);

/* Kernel map nbmap [n_out, V].  Input coordinates are assumed packable (the
** Python SparseTensor checks); a query outside the range is "not found". */
size_t tsp_kernel_map_cuda_workspace(const tsp_kernel *kern, tsp_kmap_method method, int64_t n_in,
                                     int64_t n_out);
tsp_status tsp_kernel_map_cuda(const tsp_kernel *kern, tsp_kmap_method method,
                               const int32_t *in_coords, int64_t n_in, const int32_t *out_coords,
                               int64_t n_out, int32_t *nbmap, void *workspace,
                               size_t workspace_bytes, tsp_cuda_stream stream);

/* tsp_mask_order_cpu on the GPU (CUB radix sort over the low V bits). */
size_t tsp_mask_order_cuda_workspace(int64_t n_rows, int64_t volume);
tsp_status tsp_mask_order_cuda(const int32_t *map, int64_t n_rows, int64_t volume,
                               uint64_t offsets, int32_t *order, void *workspace,
                               size_t workspace_bytes, tsp_cuda_stream stream);
tsp_status tsp_mask_plan_cuda(const int32_t *map, int64_t n_rows, int64_t volume,
                              const int32_t *order, int32_t *plan, tsp_cuda_stream stream);
tsp_status tsp_tile_steps_cuda(const int32_t *map, int64_t n_rows, int64_t volume,
                               const int32_t *order, int refine, int32_t *steps,
                               tsp_cuda_stream stream);

/* The map's pairs on the GPU, same result as the CPU twins.  _pair_counts
** fills starts_device [V + 1] and leaves in the workspace the base of every
** (offset, 128-row tile); _pairs reads those bases, so it must get the same
** workspace, unchanged, and the same map (pairs past starts[V] are never
** written); rows, when not NULL, gets each pair's input row as the CPU twin.
** n_rows == 0 needs no workspace: the counts call zeroes starts, the pairs
** call does nothing.  0 from the _workspace function otherwise: the
** sizes cannot be served (V * ceil(n_rows / 128) must stay below 2^31, a map
** of about 2^38 entries, and V <= 2^30). */
size_t tsp_kernel_map_pairs_cuda_workspace(int64_t n_rows, int64_t volume);
tsp_status tsp_kernel_map_pair_counts_cuda(const int32_t *map, int64_t n_rows, int64_t volume,
                                           int64_t *starts_device, void *workspace,
                                           size_t workspace_bytes, tsp_cuda_stream stream);
tsp_status tsp_kernel_map_pairs_cuda(const int32_t *map, int64_t n_rows, int64_t volume,
                                     const int64_t *starts_device, int32_t *pairs, int32_t *rows,
                                     void *workspace, size_t workspace_bytes,
                                     tsp_cuda_stream stream);

/* nbmap_t [n_in, V] from nbmap; entries outside [0, n_in) are ignored. */
tsp_status tsp_kernel_map_transpose_cuda(const int32_t *nbmap, int64_t n_out, int64_t volume,
                                         int64_t n_in, int32_t *nbmap_t, tsp_cuda_stream stream);

/* Gather-GEMM-scatter (TSP_DATAFLOW_GATHER_GEMM_SCATTER): the gather and the
** reduce that run around the shim's batched GEMMs (cuda/conv_ggs.cu,
** shim_ggs.cpp).  A pass's pairs (a pair list of its map, as
** tsp_kernel_map_pairs_*: rows q whose entry map[q, k] is the source row)
** sit in a dense buffer of rows x channels, one slot per offset. */
typedef struct {
  int64_t start;  /* first entry of the slot's pairs in the pair list */
  int64_t count;  /* its pairs, 0 <= count <= rows */
  int64_t base;   /* the slot's first buffer row */
  int64_t rows;   /* buffer rows of the slot: count padded to its group's largest count */
  int32_t offset; /* k, in [0, V) */
} tsp_ggs_slot;

enum { TSP_GGS_MAX_SLOTS = 64 };

/* The slots of one pass (passed to the gather kernel by value: 2.5 KB). */
typedef struct {
  int32_t n_slots; /* 0 .. TSP_GGS_MAX_SLOTS */
  tsp_ggs_slot slot[TSP_GGS_MAX_SLOTS];
} tsp_ggs_plan;

/* buf [sum of slot rows, channels]: buffer row base + r of slot s is src row
** map[q * V + offset] of its pair q = pairs[start + r] for r < count, zero when
** that entry or q is out of range, and zero for count <= r < rows.  where
** [map_rows * V] (int32) is set to -1 and then, for every gathered pair,
** where[q * V + offset] = base + r.  Rows of buf past the slots are untouched.
** Slots must satisfy base + rows <= 2^31 - 1. */
tsp_status tsp_ggs_gather_cuda(const tsp_ggs_plan *plan, const int32_t *pairs,
                               const int32_t *map, int64_t map_rows, int64_t volume,
                               const void *src, int64_t src_rows, int64_t channels,
                               tsp_dtype dtype, void *buf, int32_t *where,
                               tsp_cuda_stream stream);
/* out [rows, channels]: out[q] = sum over k = 0 .. V - 1 with where[q * V + k]
** in [0, buf_rows) of buf[where[q * V + k]], fp32 accumulation in that order;
** rows with none are zero.  float32, float16, bfloat16. */
tsp_status tsp_ggs_reduce_cuda(const int32_t *where, int64_t rows, int64_t volume,
                               const void *buf, int64_t buf_rows, int64_t channels,
                               tsp_dtype dtype, void *out, tsp_cuda_stream stream);

/* Convolution passes on CUDA: float32 (exact fp32 math, or tf32 with
** algo.tile == TSP_TILE_TF32), float16, bfloat16, fp32 accumulation.  Map
** entries outside their valid range are treated as -1. */
size_t tsp_conv_cuda_workspace(const tsp_conv_problem *prob);
/* wgrad's workspace: tsp_conv_cuda_workspace serves forward and dgrad only;
** this adds wgrad's row-chunk partials and the pieces of its tensor-core
** kernels. */
size_t tsp_conv_cuda_wgrad_workspace(const tsp_conv_problem *prob);
/* Nonzero when the forward (dgrad == 0) or dgrad (dgrad != 0) pass of prob
** may take tiles from a counter (tsp_conv_problem.tile_counter: tiles 14-17
** with more row tiles than their persistent grid has blocks).  The shim looks
** up its stream's counter for such a pass only: the lookup asks the driver
** whether the stream is being captured (~0.4 us of an H100 host's time). */
int tsp_conv_cuda_counts(const tsp_conv_problem *prob, int dgrad);
tsp_status tsp_conv_fwd_cuda(const tsp_conv_problem *prob, const void *x, const void *w,
                             const int32_t *nbmap, void *y, void *workspace,
                             size_t workspace_bytes, tsp_cuda_stream stream);
tsp_status tsp_conv_dgrad_cuda(const tsp_conv_problem *prob, const void *dy, const void *w,
                               const int32_t *nbmap_t, void *dx, void *workspace,
                               size_t workspace_bytes, tsp_cuda_stream stream);
tsp_status tsp_conv_wgrad_cuda(const tsp_conv_problem *prob, const void *x, const void *dy,
                               const int32_t *nbmap, void *dw, void *workspace,
                               size_t workspace_bytes, tsp_cuda_stream stream);


/* Batch normalisation of features [N, C] over their N rows, optionally with
** the ReLU after it fused in (csrc/cpu/batch_norm_act.c, csrc/cuda/batch_norm_act.cu).
** Why: torch's BatchNorm1d on a sparse tensor's [N, C] features and the ReLU
** after it take 13 passes over the features per training step, at a fraction
** of the copy rate (docs/performance-log.md, session 69: a quarter of a MinkUNet step's
** kernels); these passes take 8 (statistics 1, normalise 2, gradient sums 2,
** gradient 3), each at close to the copy rate.
**
** Statistics: per channel, sums of (x - K) and (x - K)^2 with K = x[0, c]
** (shifted data, so var = E[(x-K)^2] - E[x-K]^2 does not cancel when the
** mean is far from 0), fp32 per thread (fp64 for float64 data), fp64 across
** blocks, in a fixed order: results are bitwise the same run to run.
** Normalisation: y = (x - mean) * (w * invstd) + b, in fp32 (fp64), one
** rounding; relu: y = max(y, 0).  The backward recomputes that pre-ReLU value
** from x with the same operations, so it needs neither y nor a mask. */
typedef struct {
  int64_t n;             /* rows, >= 0 (training statistics need >= 1) */
  int64_t c;             /* channels, >= 1 */
  tsp_dtype dtype;       /* of x, y, dy and dx; CUDA: float32, float16, bfloat16 */
  tsp_dtype param_dtype; /* of weight, bias, the running statistics and their
                            gradients: dtype or TSP_FLOAT32 (CPU: dtype) */
  int relu;              /* nonzero: y = max(bn(x), 0), and its gradient */
} tsp_bn_problem;

/* The per-channel vectors of one normalisation.  mean and spread are float32
** (float64 for float64 data) batch statistics, mean and invstd, when
** spread_is_var == 0; with spread_is_var they are the running mean and
** variance, in param_dtype, and invstd = 1 / sqrt(var + eps) (eval).  weight
** and bias may be NULL (1 and 0), else param_dtype. */
typedef struct {
  const void *mean, *spread;
  int spread_is_var;
  double eps;
  const void *weight, *bias;
} tsp_bn_affine;

/* Training statistics, all [C]: mean and invstd (float32, float64 for
** float64 data; biased variance, as torch).  running_mean and running_var
** (param_dtype, both or neither) become (1 - momentum) r + momentum s with
** the unbiased variance (n >= 2 then); batches, when not NULL, is incremented
** (nn.BatchNorm1d's num_batches_tracked, int64).  n >= 1. */
typedef struct {
  void *mean, *invstd;
  void *running_mean, *running_var;
  int64_t *batches;
  double momentum, eps;
} tsp_bn_stats;

/* Gradients, each NULL when not wanted: dx [N, C] (dtype), dweight = sum over
** rows of dyr * xhat and dbias = sum of dyr ([C], param_dtype), dresidual =
** dyr [N, C] (dtype; with a residual and relu only: without relu it is dy),
** where xhat = (x - mean) * invstd and dyr = dy, with relu dy where the
** forward's pre-ReLU value (rounded to dtype, as y was) is > 0. */
typedef struct {
  void *dx, *dweight, *dbias, *dresidual;
} tsp_bn_grads;

/* residual: NULL, or r [N, C] (dtype) added before the ReLU: y = relu?(bn(x) + r),
** the residual block's tail in one pass (forward and backward take the same r). */
tsp_status tsp_bn_stats_cpu(const tsp_bn_problem *p, const void *x, const tsp_bn_stats *s);
tsp_status tsp_bn_forward_cpu(const tsp_bn_problem *p, const void *x, const void *residual,
                              const tsp_bn_affine *a, void *y);
/* a: the batch statistics (spread_is_var == 0). */
tsp_status tsp_bn_backward_cpu(const tsp_bn_problem *p, const void *dy, const void *x,
                               const void *residual, const tsp_bn_affine *a, const tsp_bn_grads *g);

/* CUDA: the shim allocates workspace_bytes (float partials of each block). */
size_t tsp_bn_cuda_workspace(const tsp_bn_problem *p);
tsp_status tsp_bn_stats_cuda(const tsp_bn_problem *p, const void *x, const tsp_bn_stats *s,
                             void *workspace, size_t workspace_bytes, tsp_cuda_stream stream);
tsp_status tsp_bn_forward_cuda(const tsp_bn_problem *p, const void *x, const void *residual,
                               const tsp_bn_affine *a, void *y, tsp_cuda_stream stream);
tsp_status tsp_bn_backward_cuda(const tsp_bn_problem *p, const void *dy, const void *x,
                                const void *residual, const tsp_bn_affine *a,
                                const tsp_bn_grads *g, void *workspace, size_t workspace_bytes,
                                tsp_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* TORCHSP_H */
