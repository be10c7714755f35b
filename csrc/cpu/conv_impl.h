/*
** conv_impl.h: the convolution loops of conv.c for one real type.  conv.c
** includes this file twice, with TSP_REAL = float and TSP_NAME(f) = f##_f32,
** then TSP_REAL = double and TSP_NAME(f) = f##_f64.  The macros only name the
** type and the functions; every loop is spelled out here.
**
** Accumulation is in TSP_REAL: float for float32 (as PyTorch's own CPU
** convolutions do), double for float64 (gradcheck).  Every output element is
** summed in a fixed order (offsets ascending, then channels ascending, then
** rows ascending for wgrad) whatever the thread count or dataflow, so results
** are deterministic and the two dataflows agree bit for bit.
*/

/*
** dst_row[0, c_dst) += src_row[0, c_src) @ wk[c_src, c_dst].  Columns go in
** blocks of CO_BLOCK held in a fixed-size local array, which the compiler keeps
** in vector registers across the whole c_src loop (the trip count is a
** constant); the tail runs the plain loop.  Either way each element is summed
** over ci in ascending order.
*/
static inline void TSP_NAME(row_axpy)(const TSP_REAL *restrict src_row,
                                      const TSP_REAL *restrict wk, int64_t c_src, int64_t c_dst,
                                      TSP_REAL *restrict dst_row) {
  int64_t co0 = 0;
  for (; co0 + CO_BLOCK <= c_dst; co0 += CO_BLOCK) {
    TSP_REAL acc[CO_BLOCK];
    for (int j = 0; j < CO_BLOCK; ++j) acc[j] = dst_row[co0 + j];
    for (int64_t ci = 0; ci < c_src; ++ci) {
      const TSP_REAL s = src_row[ci];
      const TSP_REAL *restrict wr = wk + ci * c_dst + co0;
      for (int j = 0; j < CO_BLOCK; ++j) acc[j] += s * wr[j];
    }
    for (int j = 0; j < CO_BLOCK; ++j) dst_row[co0 + j] = acc[j];
  }
  if (co0 == c_dst) return;
  for (int64_t ci = 0; ci < c_src; ++ci) {
    const TSP_REAL s = src_row[ci];
    const TSP_REAL *restrict wr = wk + ci * c_dst;
#pragma omp simd
    for (int64_t co = co0; co < c_dst; ++co) dst_row[co] += s * wr[co];
  }
}

/*
** Output-stationary: one thread owns output row q, zeroes it and adds the
** contribution of every present offset.  No atomics; rows with few neighbours
** (the common case: ~3.5-10 of 27 in LiDAR) cost little, hence the dynamic
** schedule.
*/
static void TSP_NAME(gather_output_stationary)(int64_t n_rows, int64_t volume, int64_t c_src,
                                               int64_t c_dst, const TSP_REAL *restrict src,
                                               const TSP_REAL *restrict w,
                                               const int32_t *restrict map,
                                               TSP_REAL *restrict dst) {
#pragma omp parallel for schedule(dynamic, 64)
  for (int64_t q = 0; q < n_rows; ++q) {
    TSP_REAL *restrict dst_row = dst + q * c_dst;
    for (int64_t co = 0; co < c_dst; ++co) dst_row[co] = 0;
    const int32_t *restrict map_row = map + q * volume;
    for (int64_t k = 0; k < volume; ++k) {
      const int64_t p = map_row[k];
      if (p < 0) continue;
      TSP_NAME(row_axpy)(src + p * c_src, w + k * c_src * c_dst, c_src, c_dst, dst_row);
    }
  }
}

/*
** Weight-stationary: zero dst, then offset by offset, every pair of that
** offset adds its row product.  Within one offset each destination row appears
** at most once, so the rows of one offset run in parallel without atomics.
*/
static void TSP_NAME(gather_weight_stationary)(int64_t n_rows, int64_t c_src, int64_t c_dst,
                                               const TSP_REAL *restrict src,
                                               const TSP_REAL *restrict w,
                                               const pair_lists *pairs,
                                               TSP_REAL *restrict dst) {
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n_rows * c_dst; ++i) dst[i] = 0;
    for (int64_t k = 0; k < pairs->volume; ++k) {
      const TSP_REAL *restrict wk = w + k * c_src * c_dst;
#pragma omp for schedule(static)
      for (int64_t i = pairs->start[k]; i < pairs->start[k + 1]; ++i) {
        TSP_NAME(row_axpy)(src + (int64_t)pairs->src[i] * c_src, wk, c_src, c_dst,
                           dst + (int64_t)pairs->dst[i] * c_dst);
      }
    }
  }
}

/* wt[k] = w[k]^T: [V, c_in, c_out] -> [V, c_out, c_in], so dgrad runs the forward loops. */
static void TSP_NAME(transpose_weight)(int64_t volume, int64_t c_in, int64_t c_out,
                                       const TSP_REAL *restrict w, TSP_REAL *restrict wt) {
#pragma omp parallel for schedule(static) collapse(2)
  for (int64_t k = 0; k < volume; ++k) {
    for (int64_t co = 0; co < c_out; ++co) {
      const TSP_REAL *restrict wk = w + k * c_in * c_out;
      TSP_REAL *restrict out = wt + k * c_in * c_out + co * c_in;
      for (int64_t ci = 0; ci < c_in; ++ci) out[ci] = wk[ci * c_out + co];
    }
  }
}

/*
** dw[k][ci][co] = sum over pairs (p, q) of offset k, in q order, of
** x[p][ci] * dy[q][co].  A task is one offset and one block of input channels,
** so every dw element has exactly one owner and one summation order; blocks
** split Cin only when there are fewer offsets than threads to keep busy.
** Pairs go PAIR_BLOCK at a time so their x and dy rows stay in L1 while every
** (ci, CO_BLOCK columns) tile of dw accumulates in registers over the block.
*/
static void TSP_NAME(wgrad)(int64_t c_in, int64_t c_out, int64_t ci_blocks,
                            const TSP_REAL *restrict x, const TSP_REAL *restrict dy,
                            const pair_lists *pairs, TSP_REAL *restrict dw) {
  const int64_t tasks = pairs->volume * ci_blocks;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t k = t / ci_blocks, blk = t % ci_blocks;
    const int64_t ci_lo = c_in * blk / ci_blocks, ci_hi = c_in * (blk + 1) / ci_blocks;
    TSP_REAL *restrict dwk = dw + k * c_in * c_out;
    for (int64_t i = ci_lo * c_out; i < ci_hi * c_out; ++i) dwk[i] = 0;
    const int32_t *restrict src = pairs->src, *restrict dst = pairs->dst;
    const int64_t end = pairs->start[k + 1];
    for (int64_t b0 = pairs->start[k]; b0 < end; b0 += PAIR_BLOCK) {
      const int64_t b1 = b0 + PAIR_BLOCK < end ? b0 + PAIR_BLOCK : end;
      for (int64_t ci = ci_lo; ci < ci_hi; ++ci) {
        TSP_REAL *restrict dw_row = dwk + ci * c_out;
        int64_t co0 = 0;
        for (; co0 + CO_BLOCK <= c_out; co0 += CO_BLOCK) {
          TSP_REAL acc[CO_BLOCK];
          for (int j = 0; j < CO_BLOCK; ++j) acc[j] = dw_row[co0 + j];
          for (int64_t i = b0; i < b1; ++i) {
            const TSP_REAL s = x[(int64_t)src[i] * c_in + ci];
            const TSP_REAL *restrict dy_row = dy + (int64_t)dst[i] * c_out + co0;
            for (int j = 0; j < CO_BLOCK; ++j) acc[j] += s * dy_row[j];
          }
          for (int j = 0; j < CO_BLOCK; ++j) dw_row[co0 + j] = acc[j];
        }
        if (co0 == c_out) continue;
        for (int64_t i = b0; i < b1; ++i) {
          const TSP_REAL s = x[(int64_t)src[i] * c_in + ci];
          const TSP_REAL *restrict dy_row = dy + (int64_t)dst[i] * c_out;
#pragma omp simd
          for (int64_t co = co0; co < c_out; ++co) dw_row[co] += s * dy_row[co];
        }
      }
    }
  }
}
