/*
** kmap_pairs.cu: the weight-stationary form of a kernel map on the GPU, the
** twin of cpu/kmap_pairs.c: for each offset k, the rows q with map[q, k] >= 0
** in increasing q, concatenated, and starts [V + 1] (torchsp.h).
**
** Why: a weight-stationary pass walks one offset at a time over that
** offset's pairs; nbmap [N, V] would make it read all N rows per offset.
**
** The result must not depend on scheduling, so no atomic decides a
** position.  Rows are cut into tiles of TILE_ROWS; a cell is one
** (offset k, tile t), numbered k * tiles + t, which is output order:
**   1. count: one block per tile reads the tile's rows, all V offsets, as one
**      contiguous run of the map (in chunks of TILE_COLS offsets staged in
**      shared memory, so the loads are coalesced although the pairs are
**      per offset), and writes each cell's count;
**   2. CUB's exclusive sum over the cells (plus one empty cell at the end)
**      gives each cell's first position, and starts[k] is the base of the
**      cell (k, 0) (starts[V] that of the end cell, P);
**   3. fill: the same tile walk; a warp takes one offset of the tile and
**      writes its rows 32 at a time, each at the cell base plus the ballot
**      prefix of the earlier rows: increasing q, coalesced stores.
** Steps 1-2 are tsp_kernel_map_pair_counts_cuda, step 3 is
** tsp_kernel_map_pairs_cuda; the cell bases stay in the workspace between
** them (the shim reads P back in between to allocate pairs).  The map is
** read twice: 173k x 27 is 18.7 MB, ~6 us a pass at 3 TB/s, mostly L2.
*/
#include <cub/cub.cuh>

#include "cuda_common.cuh"

enum { TILE_ROWS = 128, TILE_COLS = 32, PAIRS_THREADS = 256 };

/* Step 1 (FILL false) or 3 (FILL true) over tiles [blockIdx.x, tiles) by
** gridDim.x.  count: [cells + 1], written; base: [cells + 1] scanned counts;
** pairs: [total], only positions below total are written (a workspace from
** another map cannot write out of bounds); rows: NULL, or [total] likewise,
** each pair's map entry (its input row). */
template <bool FILL>
__global__ void __launch_bounds__(PAIRS_THREADS)
    pairs_tile_kernel(const int32_t *__restrict__ map, int64_t n, int volume, int64_t tiles,
                      int64_t *__restrict__ count, const int64_t *__restrict__ base,
                      const int64_t *__restrict__ starts, int32_t *__restrict__ pairs,
                      int32_t *__restrict__ rows_out) {
  /* entry[r][c]: map[r0 + r, k0 + c], -1 past the rows (present when >= 0);
  ** +1 column: the per-column reads of the ballot loop hit 32 different banks. */
  __shared__ int32_t entry[TILE_ROWS][TILE_COLS + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const unsigned below = (1u << lane) - 1u;
  const int64_t total = FILL ? starts[volume] : 0;
  if (!FILL && blockIdx.x == 0 && threadIdx.x == 0) count[(int64_t)volume * tiles] = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = t * TILE_ROWS;
    const int rows = n - r0 < TILE_ROWS ? (int)(n - r0) : TILE_ROWS;
    for (int k0 = 0; k0 < volume; k0 += TILE_COLS) {
      const int kc = volume - k0 < TILE_COLS ? volume - k0 : TILE_COLS;
      /* rows x kc entries, row stride V: contiguous when kc == V. */
      const int32_t *src = map + r0 * volume + k0;
      for (unsigned e = threadIdx.x; e < (unsigned)(TILE_ROWS * kc); e += blockDim.x) {
        const unsigned r = e / (unsigned)kc, c = e - r * (unsigned)kc;
        entry[r][c] = (int)r < rows ? src[(int64_t)r * volume + c] : -1;
      }
      __syncthreads();
      for (int c = warp; c < kc; c += warps) {
        const int64_t cell = (int64_t)(k0 + c) * tiles + t;
        int64_t pos = FILL ? base[cell] : 0;
        for (int j = 0; j < TILE_ROWS; j += 32) {
          const int32_t e = entry[j + lane][c];
          const int has = e >= 0;
          const unsigned ballot = __ballot_sync(0xffffffffu, has);
          if (FILL && has) {
            const int64_t p = pos + __popc(ballot & below);
            if (p < total) {
              pairs[p] = (int32_t)(r0 + j + lane);
              if (rows_out) rows_out[p] = e;
            }
          }
          pos += __popc(ballot);
        }
        if (!FILL && lane == 0) count[cell] = pos;
      }
      __syncthreads();
    }
  }
}

/* starts[k] = base of cell (k, 0), k <= V (cell (V, 0) is the end cell). */
__global__ void pairs_starts_kernel(const int64_t *__restrict__ base, int volume, int64_t tiles,
                                    int64_t *__restrict__ starts) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k <= volume) starts[k] = base[(int64_t)k * tiles];
}

/* Workspace layout: counts [cells + 1], bases [cells + 1] (int64, 16-byte
** aligned pieces), then CUB's temporary storage. */
static size_t align16(size_t b) { return (b + 15) & ~(size_t)15; }

typedef struct {
  int64_t tiles;
  int64_t cells; /* V * tiles; cells + 1 items are scanned */
  size_t temp_bytes;
  size_t bytes; /* 0: not servable */
} pairs_plan;

static pairs_plan plan_pairs(int64_t n, int64_t volume) {
  pairs_plan p = {0, 0, 0, 0};
  if (n <= 0 || n > INT32_MAX || volume < 1 || volume > (1 << 30)) return p;
  p.tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
  /* CUB's scan takes an int count on older toolkits. */
  if (p.tiles > ((int64_t)INT32_MAX - 1) / volume) return p;
  p.cells = volume * p.tiles;
  if (cub::DeviceScan::ExclusiveSum(NULL, p.temp_bytes, (const int64_t *)NULL, (int64_t *)NULL,
                                    (int)(p.cells + 1)) != cudaSuccess)
    return p;
  p.bytes = 2 * align16((size_t)(p.cells + 1) * sizeof(int64_t)) + align16(p.temp_bytes);
  return p;
}

size_t tsp_kernel_map_pairs_cuda_workspace(int64_t n_rows, int64_t volume) {
  return plan_pairs(n_rows, volume).bytes;
}

static unsigned pairs_blocks(int64_t tiles) { return tsp_grid_blocks(tiles, 1); }

tsp_status tsp_kernel_map_pair_counts_cuda(const int32_t *map, int64_t n_rows, int64_t volume,
                                           int64_t *starts_device, void *workspace,
                                           size_t workspace_bytes, tsp_cuda_stream stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (!starts_device || n_rows < 0 || volume < 1 || volume > (1 << 30)) return TSP_ERR_ARGUMENT;
  if (n_rows == 0) /* empty tensors may have NULL data; every offset is empty */
    return tsp_cuda_check(
        cudaMemsetAsync(starts_device, 0, (size_t)(volume + 1) * sizeof(int64_t), st),
        "tsp_kernel_map_pair_counts_cuda: starts");
  const pairs_plan plan = plan_pairs(n_rows, volume);
  if (!map || !workspace || plan.bytes == 0 || workspace_bytes < plan.bytes)
    return TSP_ERR_ARGUMENT;
  int64_t *count = (int64_t *)workspace;
  int64_t *base = (int64_t *)((char *)workspace + align16((size_t)(plan.cells + 1) * 8));
  void *temp = (char *)base + align16((size_t)(plan.cells + 1) * 8);
  const char *where = "tsp_kernel_map_pair_counts_cuda: counts";
  pairs_tile_kernel<false><<<pairs_blocks(plan.tiles), PAIRS_THREADS, 0, st>>>(
      map, n_rows, (int)volume, plan.tiles, count, NULL, NULL, NULL, NULL);
  tsp_status s = tsp_cuda_check_launch(where);
  if (s != TSP_OK) return s;
  size_t temp_bytes = plan.temp_bytes;
  s = tsp_cuda_check(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, count, base,
                                                   (int)(plan.cells + 1), st),
                     "tsp_kernel_map_pair_counts_cuda: scan");
  if (s != TSP_OK) return s;
  pairs_starts_kernel<<<tsp_grid_blocks(volume + 1, 256), 256, 0, st>>>(base, (int)volume,
                                                                        plan.tiles, starts_device);
  return tsp_cuda_check_launch("tsp_kernel_map_pair_counts_cuda: starts");
}

tsp_status tsp_kernel_map_pairs_cuda(const int32_t *map, int64_t n_rows, int64_t volume,
                                     const int64_t *starts_device, int32_t *pairs, int32_t *rows,
                                     void *workspace, size_t workspace_bytes,
                                     tsp_cuda_stream stream) {
  if (!starts_device || n_rows < 0 || volume < 1 || volume > (1 << 30)) return TSP_ERR_ARGUMENT;
  if (n_rows == 0) return TSP_OK; /* no pairs */
  const pairs_plan plan = plan_pairs(n_rows, volume);
  if (!map || !pairs || !workspace || plan.bytes == 0 || workspace_bytes < plan.bytes)
    return TSP_ERR_ARGUMENT;
  const int64_t *base =
      (const int64_t *)((const char *)workspace + align16((size_t)(plan.cells + 1) * 8));
  pairs_tile_kernel<true><<<pairs_blocks(plan.tiles), PAIRS_THREADS, 0, (cudaStream_t)stream>>>(
      map, n_rows, (int)volume, plan.tiles, NULL, base, starts_device, pairs, rows);
  return tsp_cuda_check_launch("tsp_kernel_map_pairs_cuda: fill");
}
