/*
** shim_ggs.h: dataflow 4 (gather-GEMM-scatter) for the CUDA shim, which
** calls it for a forward or dgrad pass that comes with segments.
*/
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "torchsp.h"

namespace torchsp {

/* A forward (dgrad false) or dgrad pass as gather-GEMM-scatter:
**   dst [map rows, c_dst] = sum_k src[map[q, k]] @ B_k,
** B_k = weight[k] [c_in, c_out] (forward: src is x, map nbmap) or weight[k]^T
** (dgrad: src is dy, map nbmap_t).  `pairs` is the pass's row list and
** `segs` its segments, one offset each (torchsp/plan.py's pair-list plan);
** pct: algo.threshold, the padding a group of offsets may add, in percent of
** its pairs.  Tensors are checked by the caller and contiguous, on the current
** device. */
at::Tensor ggs_pass(const char *op, const char *segs_arg, const at::Tensor &src,
                    const at::Tensor &weight, bool dgrad, const at::Tensor &map,
                    const at::Tensor &pairs, const std::vector<tsp_segment> &segs, int64_t pct);

}  // namespace torchsp
