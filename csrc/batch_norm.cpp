/*
** batch_norm.cpp: torchsp::batch_norm_train and batch_norm_train_backward for
** CPU, over ATen's native_batch_norm and its backward; on CUDA the same for
** what torchsp's kernels do not take (shim_norm_cuda.cpp registers CUDA).
**
** Why torchsp has batch-norm ops (torchsp/nn/_batch_norm.py tells more): in a
** compiled training graph, inductor lowers aten's batch norm to Triton
** reductions over the row count N, which after a strided conv is unknown when
** compiling, so it cannot split them; on an H100 those reductions made a
** compiled MinkUNet training step slower than eager (54 ms against 40).  An op
** of this library is opaque to inductor, so the compiled graph runs ATen's
** CUDA kernels, as eager does.  They are C++ because a Python custom op costs
** ~100 us of host time a call (its checks and wrappers), more than the kernels.
**
** Functional (torch.library takes autograd formulas for functional ops only):
** the new running statistics are returned, and the caller copies them into its
** buffers.  Autograd and fake kernels: torchsp/nn/_batch_norm.py, _fake.py.
*/
#include <ATen/ATen.h>
#include <torch/library.h>

#include "batch_norm.h"

namespace torchsp {

using OptTensor = std::optional<at::Tensor>;

namespace {

/* dtype of the saved mean and invstd: float32 for fp16 / bf16 on CUDA (what
** ATen's CUDA kernel returns), the input's dtype on CPU (its CPU kernel keeps it). */
at::ScalarType stat_dtype(const at::Tensor &x) {
  const bool low = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  return x.is_cuda() && low ? at::kFloat : x.scalar_type();
}

void check_vector(const OptTensor &t, int64_t c, const char *op, const char *name) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == c, op, ": ", name, " must be [", c, "], got ", t->sizes());
}

void check_x(const at::Tensor &x, const char *op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [N, C], got ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": x must be floating point, got ", x.scalar_type());
}

}  // namespace

/* (y [N, C], mean [C], invstd [C], new running_mean [C] or [0], new running_var [C] or [0]). */
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_train_aten(
    const at::Tensor &x, const OptTensor &weight, const OptTensor &bias, const OptTensor &running_mean,
    const OptTensor &running_var, double momentum, double eps) {
  const char *op = "torchsp.batch_norm_train";
  check_x(x, op);
  const int64_t c = x.size(1);
  check_vector(weight, c, op, "weight");
  check_vector(bias, c, op, "bias");
  check_vector(running_mean, c, op, "running_mean");
  check_vector(running_var, c, op, "running_var");
  const bool stats = running_mean.has_value() && running_mean->defined();
  TORCH_CHECK(stats == (running_var.has_value() && running_var->defined()), op,
              ": running_mean and running_var must both be given or both be None");
  at::Tensor rm = stats ? running_mean->clone() : at::empty({0}, x.options());
  at::Tensor rv = stats ? running_var->clone() : at::empty({0}, x.options());
  const at::ScalarType dt = stat_dtype(x);
  if (x.size(0) == 0)  // as nn.BatchNorm1d: an empty output, the statistics kept (ATen's kernel rejects N = 0)
    return {x.clone(), at::zeros({c}, x.options().dtype(dt)), at::ones({c}, x.options().dtype(dt)), rm, rv};
  OptTensor rm_arg = stats ? OptTensor(rm) : OptTensor();
  OptTensor rv_arg = stats ? OptTensor(rv) : OptTensor();
  auto out = at::native_batch_norm(x.contiguous(), weight, bias, rm_arg, rv_arg, true, momentum, eps);
  return {std::get<0>(out), std::get<1>(out).to(dt), std::get<2>(out).to(dt), rm, rv};
}

/* (grad_x [N, C], grad_weight [C], grad_bias [C]); an entry whose mask flag is false is empty ([0]). */
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_train_backward_aten(const at::Tensor &grad,
                                                                              const at::Tensor &x,
                                                                              const OptTensor &weight,
                                                                              const at::Tensor &mean,
                                                                              const at::Tensor &invstd, double eps,
                                                                              std::array<bool, 3> mask) {
  const char *op = "torchsp.batch_norm_train_backward";
  check_x(x, op);
  TORCH_CHECK(grad.sizes() == x.sizes(), op, ": grad must be ", x.sizes(), ", got ", grad.sizes());
  const int64_t c = x.size(1);
  check_vector(weight, c, op, "weight");
  at::Tensor gx, gw, gb;
  if (x.size(0) == 0) {  // zero weight and bias gradients (ATen's kernel faults on N = 0)
    gx = at::empty_like(x);
    gw = at::zeros({c}, x.options());
    gb = at::zeros({c}, x.options());
  } else {
    std::tie(gx, gw, gb) = at::native_batch_norm_backward(grad.contiguous(), x.contiguous(), weight, {}, {}, mean,
                                                          invstd, true, eps, mask);
  }
  auto or_empty = [&](bool want, const at::Tensor &t) { return want && t.defined() ? t : at::empty({0}, x.options()); };
  return {or_empty(mask[0], gx), or_empty(mask[1], gw), or_empty(mask[2], gb)};  // three tensors: no aliases
}

TORCH_LIBRARY_IMPL(torchsp, CPU, m) {
  m.impl("batch_norm_train", &batch_norm_train_aten);
  m.impl("batch_norm_train_backward", &batch_norm_train_backward_aten);
}

// CUDA: shim_norm_cuda.cpp (torchsp's kernels, these for what they do not take).

}  // namespace torchsp
