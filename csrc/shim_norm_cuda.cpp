/*
** shim_norm_cuda.cpp: TORCH_LIBRARY_IMPL(torchsp, CUDA) of the fused
** batch-norm ops over csrc/cuda/batch_norm_act.cu, on the current stream, with no
** host synchronisation (CUDA-graph capturable).
**
** Data: float32, float16, bfloat16 (float64 on CUDA is refused with a message;
** torchsp.nn.BatchNorm keeps torch's kernels for it).  The per-channel vectors
** (weight, bias, running statistics) may be float32 or x's dtype, all given
** ones the same (float32 ones beside float16 data are autocast's), and are
** read and written in place; the batch statistics are float32.
**
** Also the CUDA kernels of the traced graphs' norm ops, batch_norm_train and
** batch_norm_train_backward (batch_norm.cpp has their CPU kernels and the
** ATen fallback used here for what these kernels do not take).
*/
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "batch_norm.h"
#include "shim_norm.h"

namespace torchsp {
namespace {

void check_cuda_status(tsp_status s, const char *op) {
  if (s == TSP_ERR_CUDA) TORCH_CHECK(false, op, ": CUDA error: ", tsp_cuda_last_error());
  TORCH_CHECK(s == TSP_OK, op, ": ", status_text(s));
}

tsp_cuda_stream stream_of(const at::Tensor &x) {
  return reinterpret_cast<tsp_cuda_stream>(c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

tsp_dtype data_dtype(const at::Tensor &x, const char *op) {
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, op,
              ": x must be float32, float16 or bfloat16 on CUDA, got ", t);
  return to_tsp_dtype(t, op);
}

/* The dtype of the per-channel vectors given: all one, x's or float32. */
tsp_dtype param_dtype(const at::Tensor &x, std::initializer_list<std::pair<const OptTensor *, const char *>> vs,
                      const char *op) {
  std::optional<at::ScalarType> seen;
  const char *first = nullptr;
  for (const auto &v : vs) {
    if (!given(*v.first)) continue;
    const at::ScalarType t = (*v.first)->scalar_type();
    TORCH_CHECK(t == x.scalar_type() || t == at::kFloat, op, ": ", v.second, " must be float32 or x's dtype ",
                x.scalar_type(), ", got ", t);
    TORCH_CHECK(!seen || *seen == t, op, ": ", v.second, " is ", t, " but ", first, " is ", *seen,
                "; the per-channel vectors must share one dtype");
    TORCH_CHECK((*v.first)->is_contiguous(), op, ": ", v.second, " must be contiguous");
    seen = t;
    first = v.second;
  }
  return to_tsp_dtype(seen.value_or(x.scalar_type()), op);
}

const void *ptr(const OptTensor &t) { return given(t) ? t->data_ptr() : nullptr; }

void check_stat(const at::Tensor &s, const char *op, const char *arg) {
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous(), op, ": ", arg,
              " must be a contiguous float32 tensor (batch_norm_stats' output), got ", s.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> batch_norm_stats_cuda(const at::Tensor &x, const OptTensor &running_mean,
                                                         const OptTensor &running_var,
                                                         const OptTensor &num_batches_tracked, double momentum,
                                                         double eps) {
  const char *op = "torchsp.batch_norm_stats";
  TORCH_CHECK(x.is_cuda(), op, ": x is on ", x.device(), " but another argument is on CUDA");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t c = check_norm_x(x, op, "x");
  check_running(x, running_mean, running_var, op);
  check_batches(num_batches_tracked, x, op);
  tsp_bn_problem p;
  p.dtype = data_dtype(x, op);
  p.param_dtype = param_dtype(x, {{&running_mean, "running_mean"}, {&running_var, "running_var"}}, op);
  p.n = x.size(0);
  p.c = c;
  p.relu = 0;
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  if (p.n == 0) {  // no rows: the running statistics kept, as nn.BatchNorm1d keeps them
    if (given(num_batches_tracked)) num_batches_tracked->add_(1);
    return {at::zeros({c}, f32), at::ones({c}, f32)};
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor mean = at::empty({c}, f32), invstd = at::empty({c}, f32);
  const size_t bytes = tsp_bn_cuda_workspace(&p);
  at::Tensor ws = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
  tsp_bn_stats s = {mean.data_ptr(),
                    invstd.data_ptr(),
                    given(running_mean) ? running_mean->data_ptr() : nullptr,
                    given(running_var) ? running_var->data_ptr() : nullptr,
                    given(num_batches_tracked) ? num_batches_tracked->data_ptr<int64_t>() : nullptr,
                    momentum,
                    eps};
  check_cuda_status(tsp_bn_stats_cuda(&p, xc.data_ptr(), &s, ws.data_ptr(), bytes, stream_of(x)), op);
  return {mean, invstd};
}

at::Tensor batch_norm_act_cuda(const at::Tensor &x, const at::Tensor &mean, const at::Tensor &spread,
                               const OptTensor &weight, const OptTensor &bias, const OptTensor &residual, double eps,
                               bool spread_is_var, bool relu) {
  const char *op = "torchsp.batch_norm_act";
  TORCH_CHECK(x.is_cuda(), op, ": x is on ", x.device(), " but another argument is on CUDA");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t c = check_act_args(x, mean, spread, weight, bias, residual, spread_is_var, op);
  tsp_bn_problem p;
  p.dtype = data_dtype(x, op);
  const OptTensor m(mean), sp(spread);
  if (spread_is_var)
    p.param_dtype = param_dtype(x, {{&weight, "weight"}, {&bias, "bias"}, {&m, "running_mean"}, {&sp, "running_var"}},
                                op);
  else {
    check_stat(mean, op, "mean");
    check_stat(spread, op, "invstd");
    p.param_dtype = param_dtype(x, {{&weight, "weight"}, {&bias, "bias"}}, op);
  }
  p.n = x.size(0);
  p.c = c;
  p.relu = relu ? 1 : 0;
  const at::Tensor xc = x.contiguous();
  const OptTensor rc = given(residual) ? OptTensor(residual->contiguous()) : OptTensor();
  at::Tensor y = at::empty_like(xc);
  const tsp_bn_affine a = {mean.data_ptr(), spread.data_ptr(), spread_is_var ? 1 : 0, eps, ptr(weight), ptr(bias)};
  check_cuda_status(tsp_bn_forward_cuda(&p, xc.data_ptr(), ptr(rc), &a, y.data_ptr(), stream_of(x)), op);
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_act_backward_cuda(
    const at::Tensor &grad, const at::Tensor &x, const at::Tensor &mean, const at::Tensor &invstd,
    const OptTensor &weight, const OptTensor &bias, const OptTensor &residual, bool relu, std::array<bool, 4> mask) {
  const char *op = "torchsp.batch_norm_act_backward";
  TORCH_CHECK(x.is_cuda(), op, ": x is on ", x.device(), " but another argument is on CUDA");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t c = check_act_backward_args(grad, x, mean, invstd, weight, bias, residual, mask[3], op);
  check_stat(mean, op, "mean");
  check_stat(invstd, op, "invstd");
  tsp_bn_problem p;
  p.dtype = data_dtype(x, op);
  p.param_dtype = param_dtype(x, {{&weight, "weight"}, {&bias, "bias"}}, op);
  p.n = x.size(0);
  p.c = c;
  p.relu = relu ? 1 : 0;
  const at::Tensor xc = x.contiguous(), g = grad.contiguous();
  const at::TensorOptions po = x.options().dtype(p.param_dtype == TSP_FLOAT32 ? at::kFloat : x.scalar_type());
  at::Tensor dx = mask[0] ? at::empty_like(xc) : at::empty({0}, x.options());
  at::Tensor dw = mask[1] ? at::empty({c}, po) : at::empty({0}, x.options());
  at::Tensor db = mask[2] ? at::empty({c}, po) : at::empty({0}, x.options());
  // With a residual and relu the kernels pass the masked gradient through dr (a scratch one when the
  // residual's gradient is not wanted); without relu the residual's gradient is grad itself.
  const bool masked = given(residual) && relu;
  at::Tensor dr = masked ? at::empty_like(g) : mask[3] ? grad.clone() : at::empty({0}, x.options());
  if (!mask[0] && !mask[1] && !mask[2] && !masked) return {dx, dw, db, dr};
  const OptTensor rc = given(residual) ? OptTensor(residual->contiguous()) : OptTensor();
  const size_t bytes = tsp_bn_cuda_workspace(&p);
  at::Tensor ws = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
  const tsp_bn_affine a = {mean.data_ptr(), invstd.data_ptr(), 0, 0.0, ptr(weight), ptr(bias)};
  const tsp_bn_grads gr = {mask[0] ? dx.data_ptr() : nullptr, mask[1] ? dw.data_ptr() : nullptr,
                           mask[2] ? db.data_ptr() : nullptr, masked ? dr.data_ptr() : nullptr};
  check_cuda_status(tsp_bn_backward_cuda(&p, g.data_ptr(), xc.data_ptr(), ptr(rc), &a, &gr, ws.data_ptr(), bytes,
                                         stream_of(x)),
                    op);
  return {dx, dw, db, mask[3] ? dr : at::empty({0}, x.options())};
}

/* Whether the kernels take x and these per-channel vectors: 2-D float32, float16 or bfloat16 data,
** vectors of one dtype (x's or float32), contiguous.  Otherwise the traced ops below run ATen's. */
bool kernels_take(const at::Tensor &x, std::initializer_list<const OptTensor *> vs) {
  const at::ScalarType t = x.scalar_type();
  if (x.dim() != 2 || !(t == at::kFloat || t == at::kHalf || t == at::kBFloat16)) return false;
  std::optional<at::ScalarType> seen;
  for (const OptTensor *v : vs) {
    if (!given(*v)) continue;
    const at::ScalarType vt = (*v)->scalar_type();
    if ((vt != t && vt != at::kFloat) || (seen && *seen != vt) || !(*v)->is_contiguous()) return false;
    seen = vt;
  }
  return true;
}

/* torchsp::batch_norm_train (the traced graphs' training norm, torchsp/nn/_batch_norm.py) on
** CUDA: the same statistics and normalisation kernels as the eager path, on clones of the
** running statistics (the op is functional); ATen's kernels for what they do not take. */
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_train_cuda(
    const at::Tensor &x, const OptTensor &weight, const OptTensor &bias, const OptTensor &running_mean,
    const OptTensor &running_var, double momentum, double eps) {
  if (!kernels_take(x, {&weight, &bias, &running_mean, &running_var}) || x.size(0) == 0 ||
      given(running_mean) != given(running_var))
    return batch_norm_train_aten(x, weight, bias, running_mean, running_var, momentum, eps);
  const bool stats = given(running_mean);
  const OptTensor rm = stats ? OptTensor(running_mean->clone()) : OptTensor();
  const OptTensor rv = stats ? OptTensor(running_var->clone()) : OptTensor();
  at::Tensor mean, invstd;
  std::tie(mean, invstd) = batch_norm_stats_cuda(x, rm, rv, std::nullopt, momentum, eps);
  at::Tensor y = batch_norm_act_cuda(x, mean, invstd, weight, bias, std::nullopt, eps, false, false);
  const at::Tensor none = at::empty({0}, x.options());
  return {y, mean, invstd, stats ? *rm : none, stats ? *rv : none.clone()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_train_backward_cuda(
    const at::Tensor &grad, const at::Tensor &x, const OptTensor &weight, const at::Tensor &mean,
    const at::Tensor &invstd, double eps, std::array<bool, 3> mask) {
  const OptTensor m(mean), is(invstd);
  if (!kernels_take(x, {&weight}) || mean.scalar_type() != at::kFloat || invstd.scalar_type() != at::kFloat ||
      x.size(0) == 0 || grad.scalar_type() != x.scalar_type())
    return batch_norm_train_backward_aten(grad, x, weight, mean, invstd, eps, mask);
  at::Tensor dx, dw, db, dr;
  std::tie(dx, dw, db, dr) = batch_norm_act_backward_cuda(grad, x, mean.contiguous(), invstd.contiguous(), weight,
                                                          std::nullopt, std::nullopt, false,
                                                          {mask[0], mask[1], mask[2], false});
  return {dx, dw, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchsp, CUDA, m) {
  m.impl("batch_norm_stats", &batch_norm_stats_cuda);
  m.impl("batch_norm_act", &batch_norm_act_cuda);
  m.impl("batch_norm_act_backward", &batch_norm_act_backward_cuda);
  m.impl("batch_norm_train", &batch_norm_train_cuda);
  m.impl("batch_norm_train_backward", &batch_norm_train_backward_cuda);
}

}  // namespace torchsp
