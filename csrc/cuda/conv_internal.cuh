/*
** conv_internal.cuh: what the convolution files (conv.cu, conv_simple.cu,
** conv_implicit_gemm.cu, conv_tf32.cu, conv_wgrad.cu) share: the launchers each kernel file
** exports to conv.cu's dispatch, the element conversions, and the wgrad
** row-chunking rule that tsp_conv_cuda_wgrad_workspace and every wgrad kernel must
** agree on.
**
** Naming inside these files: a "gathered" operand is the one whose rows come
** through the map (x in forward, dy in dgrad); "red" is the reduction channel
** count (c_in in forward, c_out in dgrad) and "n" the produced channel count.
*/
#ifndef TSP_CONV_INTERNAL_CUH
#define TSP_CONV_INTERNAL_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_common.cuh"

/* ------------------------------------------------------- element access --- */

static __device__ __forceinline__ float tsp_to_float(float v) { return v; }
static __device__ __forceinline__ float tsp_to_float(__half v) { return __half2float(v); }
static __device__ __forceinline__ float tsp_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> static __device__ __forceinline__ T tsp_from_float(float v);
template <> __device__ __forceinline__ float tsp_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half tsp_from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 tsp_from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

/* ------------------------------------------------------- wgrad chunking --- */

/*
** wgrad reduces over output rows.  Deterministically: rows are cut into
** `chunks` equal chunks, each (offset, chunk) block writes fp32 partial sums
** to the workspace ([chunks, V, c_in, c_out]), and one reduction adds the
** chunks in index order.  With one chunk the kernel writes dw directly.
**
** How many chunks: enough (offset, chunk, tile) blocks to fill 132 SMs
** several times over (~2048), chunks of at least 256 rows, and at most 16M
** partial floats (64 MB: reading them back costs ~21 us at 3 TB/s, so large
** channel counts, which have few chunks anyway, stay bounded).  The centre
** offset of a submanifold conv has every row present, so a chunk's block for
** it does the most work: many chunks also keep that critical path short.
*/
enum { TSP_WGRAD_TARGET_BLOCKS = 2048, TSP_WGRAD_MIN_ROWS = 256 };
static const int64_t TSP_WGRAD_MAX_PARTIALS = 16LL << 20;

/* The side of conv_wgrad.cu's square c_in x c_out tile for p: 128 (eight
** warps) for 16-bit types with both channel counts >= 128, else 64 (which
** also sizes the 32 x 32 kernel's chunks).  H100, lidar_198k, fp16: 128 x 128
** took wgrad from 348 to 218 us at C = 128 and from 1293 to 687 at C = 256
** (each pair's rows are gathered c / 128 times instead of c / 64); at C = 64
** it was slower (186 vs 133 us), as were 128 x 256 and 64 x 128. */
static inline int tsp_wgrad_tile(const tsp_conv_problem *p) {
  return p->dtype != TSP_FLOAT32 && p->c_in >= 128 && p->c_out >= 128 ? 128 : 64;
}

static inline int64_t tsp_wgrad_rows_per_chunk(const tsp_conv_problem *p) {
  const int64_t n = p->n_out;
  if (n <= 0) return 1;
  const int64_t vcc = p->volume * p->c_in * p->c_out;
  const int t = tsp_wgrad_tile(p);
  const int64_t tiles = ((p->c_in + t - 1) / t) * ((p->c_out + t - 1) / t);
  int64_t chunks = (TSP_WGRAD_TARGET_BLOCKS + p->volume * tiles - 1) / (p->volume * tiles);
  const int64_t by_rows = (n + TSP_WGRAD_MIN_ROWS - 1) / TSP_WGRAD_MIN_ROWS;
  const int64_t by_ws = vcc > 0 ? TSP_WGRAD_MAX_PARTIALS / vcc : chunks;
  if (chunks > by_rows) chunks = by_rows;
  if (chunks > by_ws) chunks = by_ws;
  if (chunks < 1) chunks = 1;
  return (n + chunks - 1) / chunks;
}

static inline int64_t tsp_wgrad_chunks(const tsp_conv_problem *p) {
  if (p->n_out <= 0) return 1;
  const int64_t rows = tsp_wgrad_rows_per_chunk(p);
  return (p->n_out + rows - 1) / rows;
}

/* Attribute `attr` of the current device, 0 on error, remembered in known[]
** per device (devices 0 .. 63) as value + 1 (0: not asked yet; a minor
** version is often 0): a conv pass asks several times, and on a virtualised
** host each runtime call costs.  A race between host threads writes the same
** value twice. */
static inline int tsp_device_attr_of(cudaDeviceAttr attr, int dev, int *known) {
  int v = 0;
  if (dev >= 0 && dev < 64 && known[dev] != 0) return known[dev] - 1;
  if (cudaDeviceGetAttribute(&v, attr, dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < 64) known[dev] = v + 1;
  return v;
}

/* The same for the current device. */
static inline int tsp_device_attr(cudaDeviceAttr attr, int *known) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  return tsp_device_attr_of(attr, dev, known);
}

/* Compute capability of the current device as 10 * major + minor, 0 on error. */
static inline int tsp_device_cc(void) {
  static int major[64], minor[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0; /* once for both: a pass asks several times */
  return 10 * tsp_device_attr_of(cudaDevAttrComputeCapabilityMajor, dev, major) +
         tsp_device_attr_of(cudaDevAttrComputeCapabilityMinor, dev, minor);
}

/* Multiprocessors of the current device, 0 on error. */
static inline int tsp_device_sms(void) {
  static int known[64];
  return tsp_device_attr(cudaDevAttrMultiProcessorCount, known);
}

/* ------------------------------------------------------ shared memory --- */

/*
** Kernels with more than 48 KB of dynamic shared memory need the limit raised
** once per (kernel, device).  Remembered per device in a bit mask kept by the
** caller (one per kernel instantiation), so the host-side call is not paid on
** every launch; a race between host threads only repeats the idempotent call.
*/
static inline tsp_status tsp_raise_smem_limit(const void *kernel, size_t bytes, uint64_t *done,
                                              const char *where) {
  int dev = 0;
  tsp_status s = tsp_cuda_check(cudaGetDevice(&dev), where);
  if (s != TSP_OK) return s;
  /* Remembered per device: the query is a runtime call on every pass (~0.4 us
  ** of an H100 host's ~20 us per pass, torch.profiler, 2026-11-26).  0: not
  ** known, so ask again for the error. */
  static int optin[64];
  int max_optin = tsp_device_attr_of(cudaDevAttrMaxSharedMemoryPerBlockOptin, dev, optin);
  if (max_optin == 0) {
    s = tsp_cuda_check(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                       where);
    if (s != TSP_OK) return s;
  }
  if (bytes > (size_t)max_optin) return TSP_ERR_UNSUPPORTED; /* e.g. V = 64 on a 99 KB part */
  const uint64_t bit = dev < 64 ? 1ULL << dev : 0;
  if (bit && (*done & bit)) return TSP_OK;
  /* Always the device maximum, so one call serves every V. */
  s = tsp_cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          max_optin),
                     where);
  if (s == TSP_OK) *done |= bit;
  return s;
}

/* ------------------------------------------------------------ launchers --- */
/* Each returns TSP_OK or TSP_ERR_CUDA (launch check); sizes are validated by
** conv.cu.  `transposed_w`: read w[k] as [n, red] (dgrad: w is [V, c_in, c_out]
** and the pass reduces over c_out) instead of [red, n]. */

/* Output-stationary gather-sum, any channel count: out[r] = sum_k src[map[r, k]] @ W_k. */
tsp_status tsp_conv_simple_os(tsp_dtype dtype, const void *src, int64_t src_rows,
                              const void *w, const int32_t *map, int64_t rows, int64_t volume,
                              int64_t red, int64_t n, int transposed_w, void *out,
                              cudaStream_t stream);

/* wgrad, any channel count: partials (or dw directly when chunks == 1). */
tsp_status tsp_conv_simple_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                 const int32_t *nbmap, void *dw, float *partials,
                                 cudaStream_t stream);

/* dw[e] = sum over chunks c in order of partials[c * count + e]. */
tsp_status tsp_conv_reduce_partials(tsp_dtype dtype, const float *partials, int64_t chunks,
                                    int64_t count, void *dw, cudaStream_t stream);

/* conv_pad.cu, for conv.cu's padded passes.  A pad job copies src [batch,
** rows, cols] into dst [batch, rows_to, cols_to] with zeros around it (dst
** 16-byte aligned, rows of whole 16-byte chunks); tsp_conv_pad_images runs
** up to TSP_PAD_JOBS of them in one launch.  tsp_conv_crop copies each
** matrix's top-left [rows, cols] of src [batch, rows_to, cols_to] into dst
** [batch, rows, cols].  elem_bytes 2 or 4, copied as bits. */
typedef struct {
  const void *src;
  void *dst;
  int64_t batch, rows, cols, rows_to, cols_to;
} tsp_pad_job;
enum { TSP_PAD_JOBS = 2 };
tsp_status tsp_conv_pad_images(const tsp_pad_job *jobs, int n_jobs, int elem_bytes, cudaStream_t stream);
tsp_status tsp_conv_crop(const void *src, void *dst, int64_t batch, int64_t rows, int64_t cols, int64_t rows_to,
                         int64_t cols_to, int elem_bytes, cudaStream_t stream);

/* tile_pack.cu, for tile_steps.cu: the tile packing of `order` (torchsp.h,
** tsp_tile_pack_cpu's result) into out[0, n_rows), entries outside
** [0, n_rows) written -1, and -1 in out[n_rows, pad_to). */
tsp_status tsp_tile_pack_launch(const int32_t *map, int64_t n_rows, int64_t volume, const int32_t *order,
                                int32_t *out, int64_t pad_to, cudaStream_t stream);

/* Tensor-core paths: fp16/bf16, red and n multiples of 8, 16-byte aligned
** operands, volume <= TSP_IGEMM_MAX_VOLUME.  Return TSP_ERR_UNSUPPORTED when
** the shape is not theirs (the caller falls back).  `order` ([rows] or NULL)
** is the row order tiles walk (tsp_conv_problem.order); NULL is 0, 1, 2, ... */
enum { TSP_IGEMM_MAX_VOLUME = 64 };

/* How a tensor-core tile writes its sums (segmented passes, conv.cu):
** out = sum; accum = sum; accum += sum; out = accum + sum; out = out + sum
** (OUT_ADD: the output as earlier launches stored it, in its own dtype, plus
** the fp32 sum, rounded once more: a segment with tsp_segment.add_out). */
enum { TSP_EPI_STORE = 0, TSP_EPI_ACC_INIT = 1, TSP_EPI_ACC_ADD = 2, TSP_EPI_ACC_FINISH = 3,
       TSP_EPI_OUT_ADD = 4 };

/* One output-stationary launch: out[r] = sum over k in offsets of src[map[r, k]] @ W_k,
** for the rows r the tiles walk (see conv.cu). */
typedef struct {
  const void *src;     /* [src_rows, red] gathered operand */
  int64_t src_rows;
  const void *w;       /* [volume, red, n], or [volume, n, red] when transposed */
  const int32_t *map;  /* [rows, volume] */
  const int32_t *order; /* [tile_rows] map rows the tiles walk, or NULL: 0 .. rows - 1;
                           or a tile plan (plan below) */
  int64_t rows, volume, red, n;
  void *out;           /* [rows, n] */
  cudaStream_t stream;
  int64_t tile_rows;   /* entries of order (rows when order is NULL) */
  uint64_t offsets;    /* bit k: offset k takes part (~0: all) */
  float *accum;        /* [rows, n] fp32 partial sums (the TSP_EPI_ACC_* modes) */
  int mode;            /* TSP_EPI_* */
  int32_t *tile_counter; /* tiles 14-17: 8 device bytes, 8-aligned, the blocks take
                            further tiles from where tsp_conv_wgmma_ws_counted (one
                            64-bit word: tiles taken, takers gone; the last taker
                            zeroes it); NULL elsewhere */
  int splits;          /* split-K: > 1 cuts each tile's offsets into this many runs, block
                          (tile, s) writing its sums to accum + s * rows * n in `mode`
                          (TSP_EPI_ACC_INIT); 0 or 1: none */
  int plan;            /* order is a tile plan (tsp_conv_problem.order_plan): the order
                          [tile_rows], then the map rows in that order [tile_rows, volume] */
  const int32_t *steps; /* the pass's step plan (torchsp.h, conv_tile.cuh: all rows
                           and offsets), NULL unless the pass is plain (conv.cu,
                           pass_steps); read by the fp16/bf16 kernels with 128-row
                           tiles (mma.sync 0 / 2 / 3, wgmma 6, 7, 10, 13-17),
                           ignored by the others */
  int counter_clean;   /* tile_counter is zero at launch (tsp_conv_problem.tile_counter,
                          the stream's own): the launcher does not zero it */
} tsp_os_launch;

/* The warp-specialized wgmma tiles (conv_wgmma_ws.cu: 14, 15 and the
** ping-pong 16 and 17), which read w through a tensor map and take tiles from a counter. */
static inline int tsp_is_ws_tile(int tile) { return tile >= 14 && tile <= 17; }

/* The map rows of a launch's tile plan, in tile order, or NULL (conv_tile.cuh). */
static inline const int32_t *tsp_os_plan_map(const tsp_os_launch *a) {
  return a->plan && a->order ? a->order + a->tile_rows : NULL;
}

/* TSP_OK when the mma.sync kernel takes this shape (fp16/bf16, channels
** multiples of 8, aligned operands, V <= 64, sm_80+), else TSP_ERR_UNSUPPORTED. */
tsp_status tsp_conv_igemm_check(tsp_dtype dtype, const tsp_os_launch *a);
tsp_status tsp_conv_igemm_os(tsp_dtype dtype, const tsp_os_launch *a, int transposed_w, int tile);
/* The tf32 kernel of conv_tf32.cu (float32 operands, algo.tile ==
** TSP_TILE_TF32): TSP_OK when it takes this shape (red and n multiples of 4,
** src and w 16-byte aligned, out 8-byte aligned, V <= 64, sm_80+), else
** TSP_ERR_UNSUPPORTED (the caller runs conv_simple.cu, exact fp32). */
tsp_status tsp_conv_tf32_check(const tsp_os_launch *a);
tsp_status tsp_conv_tf32_os(const tsp_os_launch *a, int transposed_w);
/* wgrad on tensor cores (conv_wgrad.cu): fp16/bf16 with channels multiples
** of 8, or float32 in tf32 with channels multiples of 4 (the caller asks for
** float32 only when algo.tile == TSP_TILE_TF32); x and dy 16-byte aligned.
** TSP_ERR_UNSUPPORTED for other shapes (the caller falls back). */
tsp_status tsp_conv_mma_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                              const int32_t *nbmap, void *dw, float *partials,
                              cudaStream_t stream);
/* The wgmma kernels (sm_90a builds on sm_90 devices only, tiles 6-10 and
** 12-17; TSP_ERR_UNSUPPORTED otherwise).  Tiles 6-10 read w K-major
** ([volume, n, red], k_major = 1): dgrad's w already is; forward first writes
** a K-major copy with tsp_conv_wgmma_weights into tsp_conv_wgmma_workspace
** bytes and passes it as a->w.  Tiles 12 and 13 (tsp_conv_wgmma_reads_mn) also
** read the forward's [volume, red, n] as stored (k_major = 0).  So do the
** warp-specialized tiles 14-17 (conv_wgmma_ws.cu), through a tensor map of
** w, in both layouts; where tsp_conv_wgmma_ws_counted, they need
** a->tile_counter (8 bytes: the stream's counter, or workspace). */
size_t tsp_conv_wgmma_workspace(int64_t volume, int64_t red, int64_t n);
int tsp_conv_wgmma_available(void); /* sm_90a build on an sm_90 device */
tsp_status tsp_conv_wgmma_check(tsp_dtype dtype, const tsp_os_launch *a, int tile);
tsp_status tsp_conv_wgmma_weights(tsp_dtype dtype, const tsp_os_launch *a, void *wt);
int tsp_conv_wgmma_reads_mn(int tile);
tsp_status tsp_conv_wgmma_os(tsp_dtype dtype, const tsp_os_launch *a, int tile, int k_major);
tsp_status tsp_conv_wgmma_ws_check(tsp_dtype dtype, const tsp_os_launch *a, int tile);
/* Whether the ping-pong tile 16 takes n produced channels at this kernel volume
** (two tile buffers in shared memory beside its stages); 0 without sm_90a code. */
int tsp_conv_wgmma_pingpong_fits(int64_t n, int64_t volume);
/* Whether a launch of tile 14-17 over tile_rows rows (split-K: splits runs) reads its
** tile counter (a->tile_counter, 8 bytes; NULL may be passed otherwise). */
int tsp_conv_wgmma_ws_counted(int64_t tile_rows, int64_t n, int tile, int splits);
tsp_status tsp_conv_wgmma_ws_os(tsp_dtype dtype, const tsp_os_launch *a, int tile, int k_major);

/* wgrad on wgmma (conv_wgmma_wgrad.cu; sm_90a builds on sm_90 devices, fp16 /
** bf16, channels multiples of 8, tiles 12, 13, 15), else TSP_ERR_UNSUPPORTED.
** algo.dataflow 1 sums balanced pieces of a pair list it builds in the
** workspace (tsp_conv_wgmma_wgrad_workspace bytes, 0 when that path does not
** apply), any other dataflow row chunks with partials as for
** tsp_conv_mma_wgrad (the workspace holds them). */
size_t tsp_conv_wgmma_wgrad_workspace(const tsp_conv_problem *p, int tile);
tsp_status tsp_conv_wgmma_wgrad(const tsp_conv_problem *p, const void *x, const void *dy,
                                const int32_t *nbmap, void *dw, void *workspace,
                                size_t workspace_bytes, int tile, cudaStream_t stream);

#endif /* TSP_CONV_INTERNAL_CUH */
