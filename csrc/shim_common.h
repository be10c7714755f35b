/*
** shim_common.h: argument checks and tensor-to-struct conversions shared by
** the CPU and CUDA shims.  Every check names the op, the argument and the
** value, so a user who passes a float coordinate tensor or a weight of the
** wrong shape reads what to fix instead of a crash in a kernel.
*/
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <vector>

#include "torchsp.h"

namespace torchsp {

/* A 3-vector argument (kernel, dilation, padding, step, lattice). */
inline void fill3(int32_t out[3], c10::IntArrayRef v, const char *op, const char *arg,
                  int64_t min_value) {
  TORCH_CHECK(v.size() == 3, op, ": ", arg, " must have 3 entries (x, y, z), got ", v);
  for (int a = 0; a < 3; ++a) {
    TORCH_CHECK(v[a] >= min_value && v[a] <= (1 << 20), op, ": ", arg, " entries must be in [",
                min_value, ", 2^20], got ", v);
    out[a] = static_cast<int32_t>(v[a]);
  }
}

inline tsp_kernel make_kernel(const char *op, c10::IntArrayRef kernel, c10::IntArrayRef dilation,
                              c10::IntArrayRef padding, c10::IntArrayRef step, int64_t sign) {
  tsp_kernel k;
  fill3(k.kernel, kernel, op, "kernel", 1);
  fill3(k.dilation, dilation, op, "dilation", 1);
  fill3(k.padding, padding, op, "padding", 0);
  fill3(k.step, step, op, "step", 1);
  TORCH_CHECK(sign == 1 || sign == -1, op, ": sign must be +1 or -1, got ", sign);
  k.sign = static_cast<int32_t>(sign);
  TORCH_CHECK(tsp_kernel_volume(&k) <= 4096, op, ": kernel volume must be at most 4096, got ",
              tsp_kernel_volume(&k));
  return k;
}

inline void check_coords(const at::Tensor &c, const char *op, const char *arg) {
  TORCH_CHECK(c.dim() == 2 && c.size(1) == 4, op, ": ", arg,
              " must be [N, 4] (batch, x, y, z), got shape ", c.sizes());
  TORCH_CHECK(c.scalar_type() == at::kInt, op, ": ", arg, " must be int32, got ",
              c.scalar_type());
  TORCH_CHECK(c.size(0) < (int64_t(1) << 31) - 1, op, ": ", arg,
              " has more rows than int32 indices can address: ", c.size(0));
}

inline void check_map(const at::Tensor &m, const char *op, const char *arg) {
  TORCH_CHECK(m.dim() == 2, op, ": ", arg, " must be [N, V], got shape ", m.sizes());
  TORCH_CHECK(m.scalar_type() == at::kInt, op, ": ", arg, " must be int32, got ",
              m.scalar_type());
}

/* An optional row order (tsp_conv_problem.order): int32 [rows] beside `ref`
** (the map [rows, V]), or a tile plan [rows * (1 + V)] (returns 1: the
** problem's order_plan), or, for a segmented pass (`segmented`), a row list
** of any length that the segments index.  Its values are not read here (that
** would synchronise); the kernels skip entries outside [0, rows) and clamp a
** plan's map entries as they do the map's. */
inline int32_t check_order(const std::optional<at::Tensor> &o, int64_t rows, const at::Tensor &ref,
                           const char *op, const char *arg, bool segmented = false) {
  if (!o.has_value() || !o->defined()) return TSP_ORDER_ROWS;
  const int64_t plan_len = rows * (1 + ref.size(1));
  const int64_t steps_len = ref.size(1) <= TSP_STEPS_MAX_VOLUME ? tsp_tile_steps_len(rows, ref.size(1)) : -1;
  const bool unseg = !segmented && o->dim() == 1 && rows > 0;
  const bool plan = unseg && o->size(0) == plan_len && plan_len != rows;
  const bool steps = unseg && o->size(0) == steps_len; /* never plan_len: a record outgrows its rows */
  TORCH_CHECK(o->dim() == 1 && (segmented || o->size(0) == rows || plan || steps), op, ": ", arg,
              " must be [", rows, "] (one entry per map row) or, without segments, a tile plan [", plan_len,
              "] (mask_order with_map=True) or a step plan [", steps_len, "] (tile_steps), got shape ",
              o->sizes());
  TORCH_CHECK(o->scalar_type() == at::kInt, op, ": ", arg, " must be int32, got ",
              o->scalar_type());
  TORCH_CHECK(o->device() == ref.device(), op, ": ", arg, " is on ", o->device(), " but the map is on ",
              ref.device());
  return plan ? TSP_ORDER_TILE_PLAN : steps ? TSP_ORDER_STEPS : TSP_ORDER_ROWS;
}

/* A segmented plan (tsp_segment, torchsp/plan.py): flat [start, count,
** offsets, flags] per segment (flags = all_rows | 2 * add_out | 4 * plan),
** indexing the row list `order` of a map with `rows` rows and `volume`
** offsets.  Empty: no segments. */
inline std::vector<tsp_segment> make_segments(c10::IntArrayRef v, const std::optional<at::Tensor> &order,
                                              int64_t rows, int64_t volume, const char *op,
                                              const char *arg, const char *order_arg) {
  std::vector<tsp_segment> segs;
  if (v.empty()) return segs;
  TORCH_CHECK(v.size() % 4 == 0, op, ": ", arg, " must hold [start, count, offsets, flags] per segment, got ",
              v.size(), " numbers");
  TORCH_CHECK(order.has_value() && order->defined(), op, ": ", arg, " needs the row list ", order_arg);
  TORCH_CHECK(volume <= 64, op, ": ", arg, ": segmented passes take at most 64 offsets, got ", volume);
  const int64_t listed = order->size(0);
  bool adding = false;
  for (size_t i = 0; i < v.size(); i += 4) {
    tsp_segment g;
    g.start = v[i];
    g.count = v[i + 1];
    g.offsets = static_cast<uint64_t>(v[i + 2]);
    const int64_t flags = v[i + 3];
    TORCH_CHECK(flags >= 0 && flags <= 7, op, ": ", arg, " segment ", i / 4,
                ": flags must be all_rows | 2 * add_out | 4 * plan (0 to 7), got ", flags);
    g.all_rows = static_cast<int32_t>(flags & 1);
    g.add_out = static_cast<int32_t>((flags >> 1) & 1);
    g.plan = static_cast<int32_t>((flags >> 2) & 1);
    /* a plan segment also lists its rows' map entries after its row entries */
    const int64_t per_row = g.plan ? 1 + volume : 1;
    TORCH_CHECK(g.start >= 0 && g.count >= 0 && g.start <= listed && g.count <= (listed - g.start) / per_row,
                op, ": ", arg, " segment ", i / 4, " [start ", g.start, ", count ", g.count,
                g.plan ? ", with its map rows" : "", "] is outside ", order_arg, " (", listed, " entries)");
    TORCH_CHECK(!g.all_rows || g.count == rows, op, ": ", arg, " segment ", i / 4,
                ": all_rows (flags bit 0) needs count == ", rows, " rows, got count ", g.count);
    TORCH_CHECK(g.add_out || !adding, op, ": ", arg, " segment ", i / 4,
                ": segments that add into the output (flags bit 1) must come after all others");
    adding = adding || g.add_out;
    TORCH_CHECK(volume == 64 || (g.offsets >> volume) == 0, op, ": ", arg, " segment ", i / 4,
                ": offsets mask ", v[i + 2], " names offsets past V = ", volume);
    segs.push_back(g);
  }
  TORCH_CHECK(segs.size() <= 0x7fffffff, op, ": ", arg, ": too many segments");
  return segs;
}

/* mask_order's map: int32 [N, V] with V <= TSP_MASK_ORDER_MAX_VOLUME. */
inline void check_mask_order_map(const at::Tensor &m, const char *op) {
  check_map(m, op, "nbmap");
  TORCH_CHECK(m.size(1) >= 1 && m.size(1) <= TSP_MASK_ORDER_MAX_VOLUME, op,
              ": nbmap must have 1 to ", static_cast<int>(TSP_MASK_ORDER_MAX_VOLUME),
              " offsets (one bit each in the sort key), got ", m.size(1));
  TORCH_CHECK(m.size(0) < (int64_t(1) << 31) - 1, op, ": nbmap has more rows than int32 can index: ",
              m.size(0));
}

/* tile_steps' arguments: a map int32 [N, V], 1 <= V <= 64, and an order int32 [N] on its device. */
inline void check_steps_args(const at::Tensor &m, const at::Tensor &order, const char *op) {
  check_map(m, op, "nbmap");
  TORCH_CHECK(m.size(1) >= 1 && m.size(1) <= TSP_STEPS_MAX_VOLUME, op, ": nbmap must have 1 to ",
              int(TSP_STEPS_MAX_VOLUME), " offsets, got ", m.size(1));
  TORCH_CHECK(m.size(0) < (int64_t(1) << 31) - 1, op, ": nbmap has more rows than int32 can index: ",
              m.size(0));
  TORCH_CHECK(order.dim() == 1 && order.size(0) == m.size(0), op, ": order must be [", m.size(0),
              "] (one entry per map row; mask_order without with_map), got shape ", order.sizes());
  TORCH_CHECK(order.scalar_type() == at::kInt, op, ": order must be int32, got ", order.scalar_type());
  TORCH_CHECK(order.device() == m.device(), op, ": order is on ", order.device(), " but nbmap is on ",
              m.device());
}

/* kernel_map_pairs' map: int32 [N, V] whose row indices fit the int32 pairs. */
inline void check_pairs_map(const at::Tensor &m, const char *op) {
  check_map(m, op, "nbmap");
  TORCH_CHECK(m.size(0) < (int64_t(1) << 31) - 1, op, ": nbmap has more rows than int32 can index: ",
              m.size(0));
}

/* kernel_map_pairs' list for P pairs: [P] of output rows, or with `rows` [2, P]
** (output rows, then each pair's input row); -1 everywhere when `bounded` (the
** builder fills only the pairs; the entries past them read as absent).  Both
** shims' one allocation, the empty map's (P = 0) included. */
inline at::Tensor pair_list_tensor(int64_t p, bool bounded, bool rows, const at::Tensor &nbmap) {
  const std::vector<int64_t> shape = rows ? std::vector<int64_t>{2, p} : std::vector<int64_t>{p};
  return bounded && p > 0 ? at::full(shape, -1, nbmap.options()) : at::empty(shape, nbmap.options());
}

/* The second row of a contiguous pair list `pairs` [2, P] (each pair's input
** row), or nullptr for a list [P] of output rows only. */
inline int32_t *pair_rows_of(const at::Tensor &pairs) {
  return pairs.dim() == 2 ? pairs.data_ptr<int32_t>() + pairs.size(1) : nullptr;
}

inline void check_same_device(const at::Tensor &a, const char *an, const at::Tensor &b,
                              const char *bn, const char *op) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", an, " is on ", a.device(), " but ", bn,
              " is on ", b.device());
}

inline tsp_algo make_algo(c10::IntArrayRef v, const char *op, const char *arg) {
  TORCH_CHECK(v.size() == 4, op, ": ", arg,
              " must be [dataflow, tile, split, threshold], got ", v);
  TORCH_CHECK(v[0] >= 0 && v[0] <= 5, op, ": ", arg, "[0] (dataflow) must be 0, 1, 2, 3, 4 or 5, got ",
              v[0]);
  TORCH_CHECK(v[0] != TSP_DATAFLOW_DENSITY_SPLIT || (v[3] >= 1 && v[3] <= 100), op, ": ", arg,
              "[3] (threshold) of the density split (dataflow 5) is the share of rows, in percent, from "
              "which an offset counts as common: 1 to 100, got ", v[3]);
  TORCH_CHECK(v[0] != TSP_DATAFLOW_GATHER_GEMM_SCATTER || (v[3] >= 0 && v[3] <= 0x7fffffff), op, ": ", arg,
              "[3] (threshold) of gather-GEMM-scatter (dataflow 4) is the padding a group may add, in "
              "percent, >= 0, got ", v[3]);
  TORCH_CHECK(v[0] != TSP_DATAFLOW_SPLIT_K || (v[2] >= 2 && v[2] <= TSP_SPLIT_K_MAX), op, ": ", arg,
              "[2] (split) of split-K (dataflow 3) must be in [2, ", int(TSP_SPLIT_K_MAX), "], got ", v[2]);
  tsp_algo a;
  a.dataflow = static_cast<int32_t>(v[0]);
  a.tile = static_cast<int32_t>(v[1]);
  a.split = static_cast<int32_t>(v[2]);
  a.threshold = static_cast<int32_t>(v[3]);
  return a;
}

/* Checks shared by the three conv passes; fills the sizes of `prob`.
** x: [n_in, c_in] (or dx's shape), w: [V, c_in, c_out], map: [rows, V]. */
inline void check_features(const at::Tensor &f, const char *op, const char *arg) {
  TORCH_CHECK(f.dim() == 2, op, ": ", arg, " must be [N, C], got shape ", f.sizes());
  TORCH_CHECK(at::isFloatingType(f.scalar_type()), op, ": ", arg,
              " must be a floating-point tensor, got ", f.scalar_type());
}

inline void check_weight(const at::Tensor &w, const at::Tensor &f, const char *fname,
                         const char *op) {
  TORCH_CHECK(w.dim() == 3, op, ": weight must be [V, Cin, Cout], got shape ", w.sizes());
  TORCH_CHECK(w.scalar_type() == f.scalar_type(), op, ": weight dtype ", w.scalar_type(),
              " does not match ", fname, " dtype ", f.scalar_type());
  check_same_device(w, "weight", f, fname, op);
}

inline tsp_dtype to_tsp_dtype(at::ScalarType t, const char *op) {
  switch (t) {
    case at::kFloat: return TSP_FLOAT32;
    case at::kDouble: return TSP_FLOAT64;
    case at::kHalf: return TSP_FLOAT16;
    case at::kBFloat16: return TSP_BFLOAT16;
    default: TORCH_CHECK(false, op, ": unsupported feature dtype ", t);
  }
  return TSP_FLOAT32;
}

/* Forward: x [n_in, c_in], weight [V, c_in, c_out], nbmap [n_out, V], nbmap_t [n_in, V]. */
inline tsp_conv_problem fwd_problem(const at::Tensor &x, const at::Tensor &w, const at::Tensor &nbmap,
                                    const at::Tensor &nbmap_t, c10::IntArrayRef algo,
                                    const char *op) {
  check_features(x, op, "x");
  check_weight(w, x, "x", op);
  check_map(nbmap, op, "nbmap");
  check_map(nbmap_t, op, "nbmap_t");
  check_same_device(nbmap, "nbmap", x, "x", op);
  check_same_device(nbmap_t, "nbmap_t", x, "x", op);
  TORCH_CHECK(w.size(1) == x.size(1), op, ": x has ", x.size(1),
              " channels but weight expects ", w.size(1), " input channels");
  TORCH_CHECK(nbmap.size(1) == w.size(0), op, ": nbmap has ", nbmap.size(1),
              " offsets but weight has ", w.size(0));
  TORCH_CHECK(nbmap_t.size(1) == w.size(0), op, ": nbmap_t has ", nbmap_t.size(1),
              " offsets but weight has ", w.size(0));
  TORCH_CHECK(nbmap_t.size(0) == x.size(0), op, ": nbmap_t has ", nbmap_t.size(0),
              " rows but x has ", x.size(0));
  tsp_conv_problem p{};
  p.n_in = x.size(0);
  p.n_out = nbmap.size(0);
  p.c_in = w.size(1);
  p.c_out = w.size(2);
  p.volume = w.size(0);
  p.dtype = to_tsp_dtype(x.scalar_type(), op);
  p.algo = make_algo(algo, op, "fwd_algo");
  return p;
}

/* dgrad: dy [n_out, c_out], weight [V, c_in, c_out], nbmap_t [n_in, V] -> dx [n_in, c_in]. */
inline tsp_conv_problem dgrad_problem(const at::Tensor &dy, const at::Tensor &w,
                                      const at::Tensor &nbmap_t, c10::IntArrayRef algo,
                                      const char *op) {
  check_features(dy, op, "dy");
  check_weight(w, dy, "dy", op);
  check_map(nbmap_t, op, "nbmap_t");
  check_same_device(nbmap_t, "nbmap_t", dy, "dy", op);
  TORCH_CHECK(w.size(2) == dy.size(1), op, ": dy has ", dy.size(1),
              " channels but weight has ", w.size(2), " output channels");
  TORCH_CHECK(nbmap_t.size(1) == w.size(0), op, ": nbmap_t has ", nbmap_t.size(1),
              " offsets but weight has ", w.size(0));
  tsp_conv_problem p{};
  p.n_in = nbmap_t.size(0);
  p.n_out = dy.size(0);
  p.c_in = w.size(1);
  p.c_out = w.size(2);
  p.volume = w.size(0);
  p.dtype = to_tsp_dtype(dy.scalar_type(), op);
  p.algo = make_algo(algo, op, "algo");
  return p;
}

/* wgrad: x [n_in, c_in], dy [n_out, c_out], nbmap [n_out, V] -> dw [V, c_in, c_out]. */
inline tsp_conv_problem wgrad_problem(const at::Tensor &x, const at::Tensor &dy,
                                      const at::Tensor &nbmap, c10::IntArrayRef algo,
                                      const char *op) {
  check_features(x, op, "x");
  check_features(dy, op, "dy");
  TORCH_CHECK(x.scalar_type() == dy.scalar_type(), op, ": x dtype ", x.scalar_type(),
              " does not match dy dtype ", dy.scalar_type());
  check_same_device(dy, "dy", x, "x", op);
  check_map(nbmap, op, "nbmap");
  check_same_device(nbmap, "nbmap", x, "x", op);
  TORCH_CHECK(nbmap.size(0) == dy.size(0), op, ": nbmap has ", nbmap.size(0),
              " rows but dy has ", dy.size(0));
  tsp_conv_problem p{};
  p.n_in = x.size(0);
  p.n_out = dy.size(0);
  p.c_in = x.size(1);
  p.c_out = dy.size(1);
  p.volume = nbmap.size(1);
  p.dtype = to_tsp_dtype(x.scalar_type(), op);
  p.algo = make_algo(algo, op, "algo");
  return p;
}

/* The optional cached pair list of nbmap for wgrad (kernel_map_pairs(nbmap)):
** both or neither; pairs int32 [P], or [2, P] with the pairs' input rows in
** its second row (kernel_map_pairs(nbmap, rows=True)), P <= n_out * V;
** pair_starts int64 [V + 1]; on x's device.  Sets p->n_pairs; the CUDA shim
** sets the pointers (the CPU kernels do not read them).  Values are not read
** here (no sync): the CUDA kernels clamp them (torchsp.h,
** tsp_conv_problem.pairs). */
inline void check_pair_list(const std::optional<at::Tensor> &pairs,
                            const std::optional<at::Tensor> &starts, const at::Tensor &x,
                            tsp_conv_problem *p, const char *op) {
  const bool has_pairs = pairs.has_value() && pairs->defined();
  const bool has_starts = starts.has_value() && starts->defined();
  TORCH_CHECK(has_pairs == has_starts, op,
              ": pairs and pair_starts go together (both from kernel_map_pairs(nbmap)) or not at all");
  if (!has_pairs) return;
  TORCH_CHECK(pairs->scalar_type() == at::kInt && (pairs->dim() == 1 || (pairs->dim() == 2 && pairs->size(0) == 2)),
              op, ": pairs must be int32 [P] or [2, P] (output rows, then their input rows), got ",
              pairs->scalar_type(), " of shape ", pairs->sizes());
  TORCH_CHECK(starts->scalar_type() == at::kLong && starts->dim() == 1 &&
                  starts->size(0) == p->volume + 1,
              op, ": pair_starts must be int64 [V + 1] = [", p->volume + 1, "], got ",
              starts->scalar_type(), " of shape ", starts->sizes());
  const int64_t n_pairs = pairs->size(-1);
  TORCH_CHECK(n_pairs <= p->n_out * p->volume, op, ": pairs has ", n_pairs, " entries, more than nbmap's ",
              p->n_out * p->volume);
  check_same_device(*pairs, "pairs", x, "x", op);
  check_same_device(*starts, "pair_starts", x, "x", op);
  p->n_pairs = n_pairs;
}

inline const char *status_text(tsp_status s) {
  switch (s) {
    case TSP_OK: return "ok";
    case TSP_ERR_RANGE:
      return "a coordinate is outside the packable range (batch in [0, 511], x, y, z in "
             "[-131072, 131071])";
    case TSP_ERR_ARGUMENT: return "an index or parameter is out of range";
    case TSP_ERR_ALLOC: return "out of host memory";
    case TSP_ERR_CUDA: return "CUDA error";
    case TSP_ERR_UNSUPPORTED: return "dtype or dataflow not supported on this device";
  }
  return "unknown status";
}

}  // namespace torchsp
