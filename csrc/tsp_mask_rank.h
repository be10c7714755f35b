/*
** tsp_mask_rank.h: the bit position of an offset in mask_order's row masks,
** shared by the C and CUDA implementations so both sort identically.
**
** Why ranks and not k: sorting by the mask (as its Gray rank, below) groups
** rows by their most significant bits first.  Putting the rarest offsets there makes the
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

/* The sort key of a row's mask m: its rank in the reflected binary Gray code
** (the prefix XOR of m from the top bit down; stays within m's bits).
** Consecutive Gray codes differ in one bit, so neighbouring groups of rows
** differ by one offset rather than by a carry's worth of low bits; rows of
** one mask stay together, and the top bit (the rarest offset) still splits
** the order in two halves.  FlexGEMM orders its rows this way.  On
** lidar_198k (3x3x3, 128-row tiles) it raises the share of a tile's mma
** work that meets a present pair from 0.497 to 0.516 (0.1 m) and from 0.508
** to 0.528 (0.05 m); H100 fwd at C = 256: 476 -> 465 us. */
static inline TSP_HD uint64_t tsp_mask_gray_rank(uint64_t m) {
  m ^= m >> 1;
  m ^= m >> 2;
  m ^= m >> 4;
  m ^= m >> 8;
  m ^= m >> 16;
  m ^= m >> 32;
  return m;
}

#undef TSP_HD
#endif /* TSP_MASK_RANK_H */
