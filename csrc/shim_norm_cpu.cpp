/*
** shim_norm_cpu.cpp: TORCH_LIBRARY_IMPL(torchsp, CPU) of the fused batch-norm
** ops batch_norm_stats, batch_norm_act and batch_norm_act_backward over the C
** kernels of csrc/cpu/batch_norm_act.c.
**
** Those take float32 and float64 with every per-channel vector in the same
** dtype, so this shim computes in float64 for float64 data and float32 for
** the rest (float16 and bfloat16 are upcast, as the CPU convolution shim
** does), converts the vectors, and writes running statistics back into their
** own dtype.  One consequence for float16 / bfloat16 with relu: the backward's
** mask is taken on the float32 value, so where y underflowed to 0 from a
** positive value below the format's smallest subnormal, dx is not zeroed.
*/
#include <torch/library.h>

#include "shim_norm.h"

namespace torchsp {
namespace {

at::ScalarType compute_dtype(const at::Tensor &x) { return norm_stat_dtype(x); }

at::Tensor in_dtype(const at::Tensor &t, at::ScalarType dt) { return t.to(dt).contiguous(); }

OptTensor in_dtype(const OptTensor &t, at::ScalarType dt) {
  return given(t) ? OptTensor(in_dtype(*t, dt)) : OptTensor();
}

const void *ptr(const OptTensor &t) { return given(t) ? t->data_ptr() : nullptr; }

void check_cpu_status(tsp_status s, const char *op) { TORCH_CHECK(s == TSP_OK, op, ": ", status_text(s)); }

tsp_bn_problem problem_of(const at::Tensor &xc, bool relu) {
  tsp_bn_problem p;
  p.n = xc.size(0);
  p.c = xc.size(1);
  p.dtype = xc.scalar_type() == at::kDouble ? TSP_FLOAT64 : TSP_FLOAT32;
  p.param_dtype = p.dtype;
  p.relu = relu ? 1 : 0;
  return p;
}

std::tuple<at::Tensor, at::Tensor> batch_norm_stats_cpu(const at::Tensor &x, const OptTensor &running_mean,
                                                        const OptTensor &running_var,
                                                        const OptTensor &num_batches_tracked, double momentum,
                                                        double eps) {
  const char *op = "torchsp.batch_norm_stats";
  check_norm_x(x, op, "x");
  check_running(x, running_mean, running_var, op);
  check_batches(num_batches_tracked, x, op);
  const at::ScalarType dt = compute_dtype(x);
  const int64_t c = x.size(1);
  if (x.size(0) == 0) {  // no rows: the running statistics kept, as nn.BatchNorm1d keeps them
    if (given(num_batches_tracked)) num_batches_tracked->add_(1);
    return {at::zeros({c}, x.options().dtype(dt)), at::ones({c}, x.options().dtype(dt))};
  }
  const at::Tensor xc = in_dtype(x, dt);
  at::Tensor mean = at::empty({c}, xc.options()), invstd = at::empty({c}, xc.options());
  OptTensor rm = in_dtype(running_mean, dt), rv = in_dtype(running_var, dt);
  int64_t batches = 0;
  tsp_bn_stats s = {mean.data_ptr(), invstd.data_ptr(), rm ? rm->data_ptr() : nullptr,
                    rv ? rv->data_ptr() : nullptr, given(num_batches_tracked) ? &batches : nullptr, momentum, eps};
  const tsp_bn_problem p = problem_of(xc, false);
  check_cpu_status(tsp_bn_stats_cpu(&p, xc.data_ptr(), &s), op);
  if (rm) {
    running_mean->copy_(*rm);
    running_var->copy_(*rv);
  }
  if (given(num_batches_tracked)) num_batches_tracked->add_(batches);
  return {mean, invstd};
}

at::Tensor batch_norm_act_cpu(const at::Tensor &x, const at::Tensor &mean, const at::Tensor &spread,
                              const OptTensor &weight, const OptTensor &bias, const OptTensor &residual, double eps,
                              bool spread_is_var, bool relu) {
  const char *op = "torchsp.batch_norm_act";
  check_act_args(x, mean, spread, weight, bias, residual, spread_is_var, op);
  const at::ScalarType dt = compute_dtype(x);
  const at::Tensor xc = in_dtype(x, dt), m = in_dtype(mean, dt), sp = in_dtype(spread, dt);
  const OptTensor w = in_dtype(weight, dt), b = in_dtype(bias, dt), r = in_dtype(residual, dt);
  at::Tensor y = at::empty_like(xc);
  const tsp_bn_affine a = {m.data_ptr(), sp.data_ptr(), spread_is_var ? 1 : 0, eps, ptr(w), ptr(b)};
  const tsp_bn_problem p = problem_of(xc, relu);
  check_cpu_status(tsp_bn_forward_cpu(&p, xc.data_ptr(), ptr(r), &a, y.data_ptr()), op);
  return y.to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_act_backward_cpu(
    const at::Tensor &grad, const at::Tensor &x, const at::Tensor &mean, const at::Tensor &invstd,
    const OptTensor &weight, const OptTensor &bias, const OptTensor &residual, bool relu, std::array<bool, 4> mask) {
  const char *op = "torchsp.batch_norm_act_backward";
  const int64_t c = check_act_backward_args(grad, x, mean, invstd, weight, bias, residual, mask[3], op);
  const at::ScalarType dt = compute_dtype(x);
  const at::Tensor xc = in_dtype(x, dt), g = in_dtype(grad, dt), m = in_dtype(mean, dt), is = in_dtype(invstd, dt);
  const OptTensor w = in_dtype(weight, dt), b = in_dtype(bias, dt), r = in_dtype(residual, dt);
  const bool masked = mask[3] && relu;  // without relu the residual's gradient is grad itself
  at::Tensor dx = mask[0] ? at::empty_like(xc) : at::Tensor();
  at::Tensor dw = mask[1] ? at::empty({c}, xc.options()) : at::Tensor();
  at::Tensor db = mask[2] ? at::empty({c}, xc.options()) : at::Tensor();
  at::Tensor dr = masked ? at::empty_like(xc) : at::Tensor();
  const tsp_bn_affine a = {m.data_ptr(), is.data_ptr(), 0, 0.0, ptr(w), ptr(b)};
  const tsp_bn_grads gr = {mask[0] ? dx.data_ptr() : nullptr, mask[1] ? dw.data_ptr() : nullptr,
                           mask[2] ? db.data_ptr() : nullptr, masked ? dr.data_ptr() : nullptr};
  const tsp_bn_problem p = problem_of(xc, relu);
  check_cpu_status(tsp_bn_backward_cpu(&p, g.data_ptr(), xc.data_ptr(), ptr(r), &a, &gr), op);
  // An unwanted gradient is an empty [0] tensor: three outputs, none undefined.
  // dweight and dbias in the vectors' dtype (weight's, else bias', else x's; as on CUDA).
  const at::ScalarType pt = given(weight) ? weight->scalar_type() : given(bias) ? bias->scalar_type() : x.scalar_type();
  const at::Tensor none = at::empty({0}, x.options());
  return {mask[0] ? dx.to(x.scalar_type()) : none, mask[1] ? dw.to(pt) : none.clone(),
          mask[2] ? db.to(pt) : none.clone(),
          masked ? dr.to(x.scalar_type()) : mask[3] ? grad.clone() : none.clone()};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchsp, CPU, m) {
  m.impl("batch_norm_stats", &batch_norm_stats_cpu);
  m.impl("batch_norm_act", &batch_norm_act_cpu);
  m.impl("batch_norm_act_backward", &batch_norm_act_backward_cpu);
}

}  // namespace torchsp
