/*
** shim_cpu.cpp: TORCH_LIBRARY_IMPL(torchsp, CPU): checks arguments, makes
** inputs contiguous, allocates outputs and calls the C11 kernels of csrc/cpu.
**
** float16 and bfloat16 features are computed in float32 and cast back: the C
** kernels stay plain C (no half type in C11) and the CPU path is for
** correctness, gradcheck and CI, not speed.
*/
#include <ATen/ATen.h>
#include <torch/library.h>

#include "shim_common.h"
#include "torchsp.h"

namespace torchsp {
namespace {

void check_status(tsp_status s, const char *op) {
  TORCH_CHECK(s == TSP_OK, op, ": ", status_text(s));
}

at::Tensor out_coords_cpu(const at::Tensor &coords_in, c10::IntArrayRef kernel,
                          c10::IntArrayRef dilation, c10::IntArrayRef padding,
                          c10::IntArrayRef step, int64_t sign, c10::IntArrayRef lattice,
                          bool floor_rule) {
  const char *op = "torchsp.out_coords";
  check_coords(coords_in, op, "coords");
  tsp_out_coords_params p;
  p.kernel = make_kernel(op, kernel, dilation, padding, step, sign);
  fill3(p.lattice, lattice, op, "lattice", 1);
  p.floor_rule = floor_rule ? 1 : 0;
  at::Tensor coords = coords_in.contiguous();
  const int64_t n = coords.size(0);
  const int64_t cap = floor_rule ? n : n * tsp_kernel_volume(&p.kernel);
  if (n == 0) return at::empty({0, 4}, coords.options());
  at::Tensor keys = at::empty({cap}, coords.options().dtype(at::kLong));
  int64_t n_out = 0;
  check_status(tsp_out_coords_cpu(&p, coords.data_ptr<int32_t>(), n, keys.data_ptr<int64_t>(),
                                  &n_out),
               op);
  at::Tensor out = at::empty({n_out, 4}, coords.options());
  tsp_unpack_keys_cpu(keys.data_ptr<int64_t>(), n_out, out.data_ptr<int32_t>());
  return out;
}

at::Tensor coords_summary_cpu(const at::Tensor &coords_in, c10::IntArrayRef stride) {
  const char *op = "torchsp.coords_summary";
  check_coords(coords_in, op, "coords");
  int32_t st[3];
  fill3(st, stride, op, "stride", 1);
  at::Tensor coords = coords_in.contiguous();
  at::Tensor out = at::empty({TSP_SUMMARY_WORDS}, coords.options());
  check_status(tsp_coords_summary_cpu(coords.data_ptr<int32_t>(), coords.size(0), st, out.data_ptr<int32_t>()),
               op);
  return out;
}

at::Tensor kernel_map_cpu(const at::Tensor &in_coords_, const at::Tensor &out_coords_,
                          c10::IntArrayRef kernel, c10::IntArrayRef dilation,
                          c10::IntArrayRef padding, c10::IntArrayRef step, int64_t sign,
                          int64_t method) {
  const char *op = "torchsp.kernel_map";
  check_coords(in_coords_, op, "in_coords");
  check_coords(out_coords_, op, "out_coords");
  check_same_device(in_coords_, "in_coords", out_coords_, "out_coords", op);
  TORCH_CHECK(method == TSP_KMAP_ZDELTA || method == TSP_KMAP_HASH, op,
              ": method must be 0 (z-delta) or 1 (hash), got ", method);
  tsp_kernel k = make_kernel(op, kernel, dilation, padding, step, sign);
  at::Tensor in_coords = in_coords_.contiguous(), out_coords = out_coords_.contiguous();
  const int64_t v = tsp_kernel_volume(&k);
  at::Tensor nbmap = at::empty({out_coords.size(0), v}, in_coords.options());
  if (out_coords.size(0) == 0) return nbmap;
  if (in_coords.size(0) == 0) return nbmap.fill_(-1);
  check_status(tsp_kernel_map_cpu(&k, static_cast<tsp_kmap_method>(method),
                                  in_coords.data_ptr<int32_t>(), in_coords.size(0),
                                  out_coords.data_ptr<int32_t>(), out_coords.size(0),
                                  nbmap.data_ptr<int32_t>()),
               op);
  return nbmap;
}

at::Tensor kernel_map_transpose_cpu(const at::Tensor &nbmap_, const at::Tensor &in_coords) {
  const char *op = "torchsp.kernel_map_transpose";
  check_map(nbmap_, op, "nbmap");
  check_same_device(nbmap_, "nbmap", in_coords, "in_coords", op);
  at::Tensor nbmap = nbmap_.contiguous();
  const int64_t n_in = in_coords.size(0), v = nbmap.size(1);
  at::Tensor out = at::empty({n_in, v}, nbmap.options());
  /* n_in == 0 still goes to the kernel: an entry >= 0 then names an input that is not there. */
  if (nbmap.size(0) == 0 || v == 0) return out.fill_(-1);
  check_status(tsp_kernel_map_transpose_cpu(nbmap.data_ptr<int32_t>(), nbmap.size(0), v, n_in,
                                            out.data_ptr<int32_t>()),
               op);
  return out;
}

/* The C kernels take float32 or float64; half types go through float32. */
at::ScalarType compute_type(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

at::Tensor conv_fwd_cpu(const at::Tensor &x_, const at::Tensor &w_, const at::Tensor &nbmap_,
                        const at::Tensor &nbmap_t, c10::IntArrayRef fwd_algo,
                        c10::IntArrayRef dgrad_algo, c10::IntArrayRef wgrad_algo,
                        const std::optional<at::Tensor> &order,
                        const std::optional<at::Tensor> &order_t, c10::IntArrayRef segs,
                        c10::IntArrayRef segs_t) {
  const char *op = "torchsp.conv_fwd";
  tsp_conv_problem p = fwd_problem(x_, w_, nbmap_, nbmap_t, fwd_algo, op);
  make_algo(dgrad_algo, op, "dgrad_algo");
  make_algo(wgrad_algo, op, "wgrad_algo");
  /* Row orders and segments only steer the CUDA tiles (the CPU kernels sum
  ** every offset in one fixed order); checked here so both devices agree. */
  check_order(order, p.n_out, nbmap_, op, "order", !segs.empty());
  check_order(order_t, p.n_in, nbmap_, op, "order_t", !segs_t.empty());
  make_segments(segs, order, p.n_out, p.volume, op, "segs", "order");
  make_segments(segs_t, order_t, p.n_in, p.volume, op, "segs_t", "order_t");
  const at::ScalarType ct = compute_type(x_.scalar_type());
  at::Tensor x = x_.to(ct).contiguous(), w = w_.to(ct).contiguous();
  at::Tensor nbmap = nbmap_.contiguous();
  p.dtype = to_tsp_dtype(ct, op);
  at::Tensor y = at::empty({p.n_out, p.c_out}, x.options());
  if (p.n_out > 0 && p.c_out > 0) {
    if (p.n_in == 0 || p.c_in == 0 || p.volume == 0) {
      y.zero_();
    } else {
      check_status(tsp_conv_fwd_cpu(&p, x.data_ptr(), w.data_ptr(), nbmap.data_ptr<int32_t>(),
                                    y.data_ptr()),
                   op);
    }
  }
  return y.to(x_.scalar_type());
}

at::Tensor conv_dgrad_cpu(const at::Tensor &dy_, const at::Tensor &w_,
                          const at::Tensor &nbmap_t_, c10::IntArrayRef algo,
                          const std::optional<at::Tensor> &order_t, c10::IntArrayRef segs_t) {
  const char *op = "torchsp.conv_dgrad";
  tsp_conv_problem p = dgrad_problem(dy_, w_, nbmap_t_, algo, op);
  check_order(order_t, p.n_in, nbmap_t_, op, "order_t", !segs_t.empty());
  make_segments(segs_t, order_t, p.n_in, p.volume, op, "segs_t", "order_t");
  const at::ScalarType ct = compute_type(dy_.scalar_type());
  at::Tensor dy = dy_.to(ct).contiguous(), w = w_.to(ct).contiguous();
  at::Tensor nbmap_t = nbmap_t_.contiguous();
  p.dtype = to_tsp_dtype(ct, op);
  at::Tensor dx = at::empty({p.n_in, p.c_in}, dy.options());
  if (p.n_in > 0 && p.c_in > 0) {
    if (p.n_out == 0 || p.c_out == 0 || p.volume == 0) {
      dx.zero_();
    } else {
      check_status(tsp_conv_dgrad_cpu(&p, dy.data_ptr(), w.data_ptr(),
                                      nbmap_t.data_ptr<int32_t>(), dx.data_ptr()),
                   op);
    }
  }
  return dx.to(dy_.scalar_type());
}

at::Tensor conv_wgrad_cpu(const at::Tensor &x_, const at::Tensor &dy_, const at::Tensor &nbmap_,
                          c10::IntArrayRef algo, const std::optional<at::Tensor> &pairs,
                          const std::optional<at::Tensor> &pair_starts) {
  const char *op = "torchsp.conv_wgrad";
  tsp_conv_problem p = wgrad_problem(x_, dy_, nbmap_, algo, op);
  check_pair_list(pairs, pair_starts, x_, &p, op); /* checked, not needed: conv.c walks nbmap */
  const at::ScalarType ct = compute_type(x_.scalar_type());
  at::Tensor x = x_.to(ct).contiguous(), dy = dy_.to(ct).contiguous();
  at::Tensor nbmap = nbmap_.contiguous();
  p.dtype = to_tsp_dtype(ct, op);
  at::Tensor dw = at::empty({p.volume, p.c_in, p.c_out}, x.options());
  if (dw.numel() > 0) {
    if (p.n_out == 0 || p.n_in == 0) {
      dw.zero_();
    } else {
      check_status(tsp_conv_wgrad_cpu(&p, x.data_ptr(), dy.data_ptr(), nbmap.data_ptr<int32_t>(),
                                      dw.data_ptr()),
                   op);
    }
  }
  return dw.to(x_.scalar_type());
}

}  // namespace

at::Tensor mask_order_cpu(const at::Tensor &nbmap_, int64_t offsets, bool with_map) {
  const char *op = "torchsp.mask_order";
  check_mask_order_map(nbmap_, op);
  at::Tensor nbmap = nbmap_.contiguous();
  const int64_t n = nbmap.size(0), v = nbmap.size(1);
  at::Tensor order = at::empty({n}, nbmap.options());
  check_status(tsp_mask_order_cpu(nbmap.data_ptr<int32_t>(), n, v, static_cast<uint64_t>(offsets),
                                  order.data_ptr<int32_t>()),
               op);
  if (!with_map) return order;
  at::Tensor plan = at::empty({n * (1 + v)}, nbmap.options());
  check_status(tsp_mask_plan_cpu(nbmap.data_ptr<int32_t>(), n, v, order.data_ptr<int32_t>(),
                                 plan.data_ptr<int32_t>()),
               op);
  return plan;
}

/* The step plan [tsp_tile_steps_len(N, V)] of nbmap and order, refined or not (torchsp.h). */
at::Tensor tile_steps_cpu(const at::Tensor &nbmap_, const at::Tensor &order_, bool refine) {
  const char *op = "torchsp.tile_steps";
  check_steps_args(nbmap_, order_, op);
  at::Tensor nbmap = nbmap_.contiguous(), order = order_.contiguous();
  const int64_t n = nbmap.size(0), v = nbmap.size(1);
  at::Tensor steps = at::empty({tsp_tile_steps_len(n, v)}, nbmap.options());
  check_status(tsp_tile_steps_cpu(nbmap.data_ptr<int32_t>(), n, v, order.data_ptr<int32_t>(), refine ? 1 : 0,
                                  steps.data_ptr<int32_t>()),
               op);
  return steps;
}

/* (pairs int32, starts [V + 1] int64): count, allocate P (bounded: N * V of
** -1), fill the first P (torchsp.h); rows: pairs is [2, P], the input rows in
** its second row. */
std::tuple<at::Tensor, at::Tensor> kernel_map_pairs_cpu(const at::Tensor &nbmap_, bool bounded, bool rows) {
  const char *op = "torchsp.kernel_map_pairs";
  check_pairs_map(nbmap_, op);
  at::Tensor nbmap = nbmap_.contiguous();
  const int64_t n = nbmap.size(0), v = nbmap.size(1);
  at::Tensor starts = at::zeros({v + 1}, nbmap.options().dtype(at::kLong));
  if (n == 0 || v == 0) return {pair_list_tensor(0, bounded, rows, nbmap), starts};
  check_status(tsp_kernel_map_pair_counts_cpu(nbmap.data_ptr<int32_t>(), n, v,
                                              starts.data_ptr<int64_t>()),
               op);
  const int64_t p = bounded ? n * v : starts.data_ptr<int64_t>()[v];
  at::Tensor pairs = pair_list_tensor(p, bounded, rows, nbmap);
  if (starts.data_ptr<int64_t>()[v] > 0)
    check_status(tsp_kernel_map_pairs_cpu(nbmap.data_ptr<int32_t>(), n, v, starts.data_ptr<int64_t>(),
                                          pairs.data_ptr<int32_t>(), pair_rows_of(pairs)),
                 op);
  return {pairs, starts};
}

TORCH_LIBRARY_IMPL(torchsp, CPU, m) {
  m.impl("mask_order", &mask_order_cpu);
  m.impl("tile_steps", &tile_steps_cpu);
  m.impl("out_coords", &out_coords_cpu);
  m.impl("coords_summary", &coords_summary_cpu);
  m.impl("kernel_map", &kernel_map_cpu);
  m.impl("kernel_map_transpose", &kernel_map_transpose_cpu);
  m.impl("kernel_map_pairs", &kernel_map_pairs_cpu);
  m.impl("conv_fwd", &conv_fwd_cpu);
  m.impl("conv_dgrad", &conv_dgrad_cpu);
  m.impl("conv_wgrad", &conv_wgrad_cpu);
}

}  // namespace torchsp
