/*
** tile_steps.cu: step plans (torchsp.h, tsp_tile_steps_cuda; conv_tile.cuh):
** the first phase of the output-stationary tensor-core kernels, run once for
** every 128-row tile of a row order and written out, so that the kernels'
** launches copy a tile's used offsets, 16-row-group masks, output rows and
** map entries (the used offsets' only, column by column) instead of reading
** and sorting V map entries per row on every call.
**
** One block per tile runs tsp_tile_offsets, the code the kernels run without
** a plan (same masks, same offset list), then stores the tile's record; a
** plan and the kernels' own first phase cannot disagree on a valid map.
** Entries are not checked against the source rows here (the map alone does
** not say how many there are): the kernels check them as they copy a record.
** lidar_198k, 173k rows x 27 offsets: ~8-20 us on an H100 per map and pass,
** built once and cached with the map (torchsp/kmap.py).
*/
#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_tile.cuh"

enum { STEPS_THREADS = 128, STEPS_BM = TSP_STEPS_ROWS };

__global__ void __launch_bounds__(STEPS_THREADS)
    tile_steps_kernel(const int32_t *__restrict__ map, const int32_t *__restrict__ order, int64_t rows,
                      int volume, int64_t base, int32_t *__restrict__ steps) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const tsp_tile_smem t = tsp_tile_smem_at(smem_raw, STEPS_BM, volume);
  const int64_t row0 = (int64_t)blockIdx.x * STEPS_BM;
  tsp_tile_offsets<STEPS_BM, STEPS_THREADS>(map, order, nullptr, rows, rows, row0, volume, ~(uint64_t)0,
                                            INT64_MAX, t);
  const int tid = threadIdx.x;
  if (tid < STEPS_BM && row0 + tid < base) steps[row0 + tid] = t.rows[tid]; /* the order, checked; -1 pads */
  int32_t *rec = steps + base + (int64_t)blockIdx.x * tsp_steps_words(STEPS_BM, volume);
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

tsp_status tsp_tile_steps_cuda(const int32_t *map, int64_t n_rows, int64_t volume, const int32_t *order,
                               int32_t *steps, tsp_cuda_stream stream) {
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
  tile_steps_kernel<<<(unsigned)tiles, STEPS_THREADS, smem, (cudaStream_t)stream>>>(map, order, n_rows, (int)volume,
                                                                                     tsp_tile_steps_base(n_rows), steps);
  return tsp_cuda_check_launch("tsp_tile_steps_cuda");
}
