/*
** tile_steps.cu: step plans (torchsp.h, tsp_tile_steps_cuda; conv_tile.cuh):
** the first phase of the output-stationary tensor-core kernels, run once for
** every 128-row tile of a row order and written out, so that the kernels'
** launches copy a tile's used offsets, 16-row-group masks, output rows and
** map entries (the used offsets' only, column by column) instead of reading
** and sorting V map entries per row on every call.
**
** With refine: first the order is packed (tile_pack.cu), written checked
** into the plan's order part; then one block per tile of it runs tsp_tile_offsets,
** the code the kernels run without a plan (same masks, same offset list),
** and stores the tile's record; a plan and the kernels' own first phase
** cannot disagree on a valid map.  Last, one block sorts the tiles by count
** for the schedule.  Without refine, one launch: the tile blocks also copy
** the order part and write the plain schedule.
** Entries are not checked against the source rows here (the map alone does
** not say how many there are): the kernels check them as they copy a record.
** lidar_198k, 173k rows x 27 offsets: ~8-20 us on an H100 per map and pass
** for the records, built once and cached with the map (torchsp/kmap.py).
*/
#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_tile.cuh"

enum { STEPS_THREADS = 128, STEPS_BM = TSP_STEPS_ROWS };

/* order: the row order; records: where tile 0's goes.  plain != 0 (no refinement): `order` is
** the caller's, and the block also writes its rows' entries of the plan's order part (checked;
** -1 up to `base`) and its schedule word (-1: a plain plan has no schedule); else `order` is the
** plan's own order part, refined and checked, and tile_sched_kernel writes the schedule. */
__global__ void __launch_bounds__(STEPS_THREADS)
    tile_steps_kernel(const int32_t *__restrict__ map, const int32_t *__restrict__ order, int64_t rows,
                      int volume, int32_t *__restrict__ records, int plain, int32_t *__restrict__ order_out,
                      int64_t base, int32_t *__restrict__ sched) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const tsp_tile_smem t = tsp_tile_smem_at(smem_raw, STEPS_BM, volume);
  const int64_t row0 = (int64_t)blockIdx.x * STEPS_BM;
  tsp_tile_offsets<STEPS_BM, STEPS_THREADS>(map, order, nullptr, rows, rows, row0, volume, ~(uint64_t)0,
                                            INT64_MAX, t);
  const int tid = threadIdx.x;
  if (plain) {
    if (tid < STEPS_BM && row0 + tid < base) order_out[row0 + tid] = t.rows[tid]; /* checked; -1 pads */
    if (tid == 0) sched[blockIdx.x] = -1; /* no schedule (torchsp.h) */
  }
  int32_t *rec = records + (int64_t)blockIdx.x * tsp_steps_words(STEPS_BM, volume);
  const int head = (int)tsp_steps_head_words(STEPS_BM, volume), count = *t.count;
  const int32_t *s_head = (const int32_t *)t.groups;
  for (int i = tid; i < head; i += STEPS_THREADS) {
    /* list past count, the spare words and the padding are zeros (torchsp.h) */
    const bool keep = i < volume + count || i == 2 * volume || (i >= 2 * volume + 4 && i < 2 * volume + 4 + STEPS_BM);
    rec[i] = keep ? s_head[i] : 0;
  }
  int32_t *cols = rec + head;
  for (int i = tid; i < volume * STEPS_BM; i += STEPS_THREADS) { /* unused columns: -1 */
    const int j = i / STEPS_BM, r = i % STEPS_BM; /* stride V in shared memory: V odd, no conflict */
    cols[i] = j < count ? t.nb[r * volume + t.list[j]] : -1;
  }
}

enum { SCHED_THREADS = 1024, SCHED_WARPS = SCHED_THREADS / 32, SCHED_COUNTS = TSP_STEPS_MAX_VOLUME + 1 };

/* The schedule (torchsp.h): tiles by decreasing count, ties by decreasing index.  One block:
** a histogram of the counts, then the tiles in decreasing index, 1024 at a time, each placed
** after the tiles of its count met before (ranks within a warp by __match_any_sync, across
** the block's warps by a table of per-warp counts).  Tile indices fit int32 (rows do). */
__global__ void __launch_bounds__(SCHED_THREADS)
    tile_sched_kernel(const int32_t *__restrict__ counts, int64_t words, int tiles, int volume,
                      int32_t *__restrict__ sched) {
  __shared__ int next[SCHED_COUNTS];                  /* where the next tile of count c goes */
  __shared__ int per_warp[SCHED_WARPS][SCHED_COUNTS]; /* tiles of count c in warp w of this round */
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned below = (1u << lane) - 1u;
  for (int c = tid; c < SCHED_COUNTS; c += SCHED_THREADS) next[c] = 0;
  __syncthreads();
  for (int first = 0; first < tiles; first += SCHED_THREADS) { /* the histogram, one add per count a warp */
    const int t = first + tid;
    const int c = t < tiles ? min(max(counts[(int64_t)t * words], 0), volume) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, c);
    if (c >= 0 && (peers & below) == 0) atomicAdd(&next[c], __popc(peers));
  }
  __syncthreads();
  if (warp == 0) { /* starts, by decreasing count: lane l takes counts V - 3 l .. V - 3 l - 2 */
    const int c0 = volume - 3 * lane, c1 = c0 - 1, c2 = c0 - 2;
    const int a = c0 >= 0 ? next[c0] : 0, b = c1 >= 0 ? next[c1] : 0, d = c2 >= 0 ? next[c2] : 0;
    const int incl = tsp_warp_scan(a + b + d, lane);
    const int excl = incl - a - b - d;
    __syncwarp();
    if (c0 >= 0) next[c0] = excl;
    if (c1 >= 0) next[c1] = excl + a;
    if (c2 >= 0) next[c2] = excl + a + b;
  }
  for (int first = 0; first < tiles; first += SCHED_THREADS) {
    for (int i = tid; i < SCHED_WARPS * SCHED_COUNTS; i += SCHED_THREADS)
      per_warp[i / SCHED_COUNTS][i % SCHED_COUNTS] = 0;
    __syncthreads();
    const int t = tiles - 1 - (first + tid); /* decreasing index */
    const int c = t >= 0 ? min(max(counts[(int64_t)t * words], 0), volume) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, c);
    const int rank = __popc(peers & below);
    if (c >= 0 && rank == 0) per_warp[warp][c] = __popc(peers);
    __syncthreads();
    if (c >= 0) {
      int at = next[c] + rank;
      for (int w = 0; w < warp; ++w) at += per_warp[w][c];
      sched[at] = t;
    }
    __syncthreads();
    if (tid <= volume) {
      int sum = 0;
      for (int w = 0; w < SCHED_WARPS; ++w) sum += per_warp[w][tid];
      next[tid] += sum;
    }
    __syncthreads(); /* per_warp read before the next round clears it */
  }
}

tsp_status tsp_tile_steps_cuda(const int32_t *map, int64_t n_rows, int64_t volume, const int32_t *order,
                               int refine, int32_t *steps, tsp_cuda_stream stream) {
  if (n_rows == 0 && volume >= 1 && volume <= TSP_IGEMM_MAX_VOLUME) return TSP_OK;
  if (!map || !order || !steps || n_rows < 0 || volume < 1 || volume > TSP_IGEMM_MAX_VOLUME ||
      n_rows > 0x7fffffffLL)
    return TSP_ERR_ARGUMENT;
  /* the kernels' record layout (conv_tile.cuh) is the one torchsp.h states */
  if (tsp_steps_words(STEPS_BM, (int)volume) != tsp_tile_steps_words(volume) ||
      tsp_steps_head_words(STEPS_BM, (int)volume) != tsp_tile_steps_head(volume))
    return TSP_ERR_UNSUPPORTED;
  const int64_t tiles = (n_rows + STEPS_BM - 1) / STEPS_BM;
  const size_t smem = tsp_tile_smem_bytes(STEPS_BM, (int)volume);
  static uint64_t smem_raised = 0;
  tsp_status s = tsp_raise_smem_limit((const void *)tile_steps_kernel, smem, &smem_raised, "tsp_tile_steps_cuda");
  if (s != TSP_OK) return s;
  const int64_t base = tsp_tile_steps_base(n_rows);
  int32_t *sched = steps + tsp_tile_steps_sched(n_rows, volume);
  if (!refine) { /* one launch: order part, records and the plain schedule */
    tile_steps_kernel<<<(unsigned)tiles, STEPS_THREADS, smem, (cudaStream_t)stream>>>(
        map, order, n_rows, (int)volume, steps + base, 1, steps, base, sched);
    return tsp_cuda_check_launch("tsp_tile_steps_cuda");
  }
  s = tsp_tile_pack_launch(map, n_rows, volume, order, steps, base, (cudaStream_t)stream);
  if (s != TSP_OK) return s;
  tile_steps_kernel<<<(unsigned)tiles, STEPS_THREADS, smem, (cudaStream_t)stream>>>(
      map, steps, n_rows, (int)volume, steps + base, 0, nullptr, base, nullptr);
  s = tsp_cuda_check_launch("tsp_tile_steps_cuda");
  if (s != TSP_OK) return s;
  const int64_t words = tsp_tile_steps_words(volume);
  tile_sched_kernel<<<1, SCHED_THREADS, 0, (cudaStream_t)stream>>>(steps + base + 2 * volume, words, (int)tiles,
                                                                   (int)volume, sched);
  return tsp_cuda_check_launch("tsp_tile_steps_cuda (schedule)");
}
