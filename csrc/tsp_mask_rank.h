/*
** tsp_mask_rank.h: the bit position of an offset in mask_order's row masks,
** shared by the C and CUDA implementations so both sort identically.
**
** Why ranks and not k: sorting by the mask as a number groups rows by their
** most significant bits first.  Putting the rarest offsets there makes the
** rows that share a rare offset adjacent, which is what lets a tile of
** consecutive rows skip the offsets none of them has.
*/
#ifndef TSP_MASK_RANK_H
#define TSP_MASK_RANK_H

#include <stdint.h>

#ifdef __CUDACC__
#define TSP_HD __host__ __device__
#else
#define TSP_HD
#endif

/* Number of offsets ranked before k: those in more rows, or as many and j < k. */
static inline TSP_HD int tsp_mask_bit_rank(const int64_t *count, int volume, int k) {
  int rank = 0;
  for (int j = 0; j < volume; ++j)
    rank += count[j] > count[k] || (count[j] == count[k] && j < k);
  return rank;
}

#undef TSP_HD
#endif /* TSP_MASK_RANK_H */
