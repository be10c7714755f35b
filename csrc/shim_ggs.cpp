/*
** shim_ggs.cpp: gather-GEMM-scatter (dataflow 4, TorchSparse's adaptive
** grouping) for the CUDA shim: group the pass's offsets by pair count, gather
** each group's pairs into one dense batch (cuda/conv_ggs.cu), multiply every
** group with one cuBLAS bmm through ATen, and sum each output row's products
** in offset order (conv_ggs.cu's reduce: no atomics, deterministic).
**
** Grouping (TorchSparse, MLSys 2022, section 4.1): offsets sorted by pair
** count, largest first; a group takes the next offset while its rows padded to
** its largest count stay within (100 + pct)% of its pairs.  pct = 0 groups
** only equal counts (a submanifold map's offsets k and V - 1 - k), larger pct
** fewer and larger GEMMs with more padding; >= 6300 puts every offset of a
** 3x3x3 map in one bmm.  The group sizes come from the plan's segments, which
** torchsp/plan.py reads back once per kernel map, so a pass makes no host
** synchronisation; its launches are capturable in a CUDA graph.
*/
#include "shim_ggs.h"

#include "shim_common.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace torchsp {
namespace {

struct ggs_offset {
  int32_t k;
  int64_t start, count;
};

/* Offsets into groups, each group's largest count first (see the file header). */
std::vector<std::vector<ggs_offset>> ggs_groups(std::vector<ggs_offset> offs, int64_t pct) {
  std::sort(offs.begin(), offs.end(), [](const ggs_offset &a, const ggs_offset &b) {
    return a.count != b.count ? a.count > b.count : a.k < b.k;
  });
  pct = std::min<int64_t>(std::max<int64_t>(pct, 0), 6400); /* padding never exceeds 64x */
  std::vector<std::vector<ggs_offset>> groups;
  int64_t sum = 0;
  for (const ggs_offset &o : offs) {
    if (!groups.empty()) {
      std::vector<ggs_offset> &g = groups.back();
      const int64_t padded = g[0].count * static_cast<int64_t>(g.size() + 1);
      if (padded * 100 <= (sum + o.count) * (100 + pct)) {
        g.push_back(o);
        sum += o.count;
        continue;
      }
    }
    groups.push_back({o});
    sum = o.count;
  }
  return groups;
}

tsp_cuda_stream stream_now() {
  return reinterpret_cast<tsp_cuda_stream>(c10::cuda::getCurrentCUDAStream().stream());
}

void check(tsp_status s, const char *op, const char *what) {
  if (s == TSP_ERR_CUDA) TORCH_CHECK(false, op, ": ", what, ": CUDA error: ", tsp_cuda_last_error());
  TORCH_CHECK(s == TSP_OK, op, ": ", what, ": ", status_text(s));
}

}  // namespace

at::Tensor ggs_pass(const char *op, const char *segs_arg, const at::Tensor &src,
                    const at::Tensor &weight, bool dgrad, const at::Tensor &map,
                    const at::Tensor &pairs, const std::vector<tsp_segment> &segs, int64_t pct) {
  TORCH_CHECK(src.scalar_type() != at::kDouble, op, ": gather-GEMM-scatter takes float32, float16 or bfloat16");
  const int64_t rows = map.size(0), volume = map.size(1);
  const int64_t c_src = src.size(1), c_dst = dgrad ? weight.size(1) : weight.size(2);
  std::vector<ggs_offset> offs;
  uint64_t seen = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const uint64_t bits = segs[i].offsets;
    TORCH_CHECK(bits != 0 && (bits & (bits - 1)) == 0, op, ": ", segs_arg, " segment ", i,
                ": gather-GEMM-scatter (dataflow 4) takes one offset per segment (torchsp.plan's "
                "pair-list plan), got offsets mask ", static_cast<int64_t>(bits));
    TORCH_CHECK((seen & bits) == 0, op, ": ", segs_arg, " segment ", i, ": offset ", __builtin_ctzll(bits),
                " appears in two segments; gather-GEMM-scatter takes each offset once");
    seen |= bits;
    if (segs[i].count > 0) offs.push_back({__builtin_ctzll(bits), segs[i].start, segs[i].count});
  }
  const std::vector<std::vector<ggs_offset>> groups = ggs_groups(offs, pct);
  tsp_ggs_plan plan{};
  int64_t total = 0;
  for (const std::vector<ggs_offset> &g : groups) {
    for (size_t i = 0; i < g.size(); ++i) {
      tsp_ggs_slot &s = plan.slot[plan.n_slots++];
      s.start = g[i].start;
      s.count = g[i].count;
      s.base = total + static_cast<int64_t>(i) * g[0].count;
      s.rows = g[0].count;
      s.offset = g[i].k;
    }
    total += g[0].count * static_cast<int64_t>(g.size());
  }
  TORCH_CHECK(total <= 0x7fffffffLL, op, ": gather-GEMM-scatter would gather ", total,
              " rows, more than its int32 indices address; use another dataflow");
  const tsp_dtype dt = to_tsp_dtype(src.scalar_type(), op);
  at::Tensor out = at::empty({rows, c_dst}, src.options());
  at::Tensor where = at::empty({rows, volume}, map.options());
  at::Tensor gathered = at::empty({total, c_src}, src.options());
  check(tsp_ggs_gather_cuda(&plan, pairs.data_ptr<int32_t>(), map.data_ptr<int32_t>(), rows, volume,
                            src.data_ptr(), src.size(0), c_src, dt, total ? gathered.data_ptr() : nullptr,
                            where.data_ptr<int32_t>(), stream_now()),
        op, "gather-GEMM-scatter gather");
  at::Tensor products = at::empty({total, c_dst}, src.options());
  int64_t row = 0;
  for (const std::vector<ggs_offset> &g : groups) {
    const int64_t n = static_cast<int64_t>(g.size()), top = g[0].count;
    std::vector<at::Tensor> ws;
    for (const ggs_offset &o : g) ws.push_back(weight.select(0, o.k));
    at::Tensor b = at::stack(ws); /* [n, c_in, c_out]: a device copy, no host transfer */
    if (dgrad) b = b.transpose(1, 2);
    at::Tensor dst = products.narrow(0, row, n * top).view({n, top, c_dst});
    at::bmm_out(dst, gathered.narrow(0, row, n * top).view({n, top, c_src}), b);
    row += n * top;
  }
  check(tsp_ggs_reduce_cuda(where.data_ptr<int32_t>(), rows, volume, total ? products.data_ptr() : nullptr,
                            total, c_dst, dt, out.data_ptr(), stream_now()),
        op, "gather-GEMM-scatter reduce");
  return out;
}

}  // namespace torchsp
