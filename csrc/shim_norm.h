/*
** shim_norm.h: argument checks shared by the CPU and CUDA implementations of
** the fused batch-norm ops (shim_norm_cpu.cpp, shim_norm_cuda.cpp):
** batch_norm_stats, batch_norm_act and batch_norm_act_backward (schemas in
** ops.cpp, what they compute in torchsp.h's tsp_bn_* section).
*/
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "shim_common.h"

namespace torchsp {

using OptTensor = std::optional<at::Tensor>;

inline bool given(const OptTensor &t) { return t.has_value() && t->defined(); }

/* x (or grad): a 2-D floating tensor; returns C. */
inline int64_t check_norm_x(const at::Tensor &x, const char *op, const char *arg) {
  TORCH_CHECK(x.dim() == 2, op, ": ", arg, " must be [N, C], got shape ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": ", arg, " must be floating point, got ",
              x.scalar_type());
  TORCH_CHECK(x.size(1) >= 1, op, ": ", arg, " must have at least one channel, got shape ", x.sizes());
  return x.size(1);
}

/* A per-channel vector: [C], floating, on x's device. */
inline void check_norm_vector(const at::Tensor &v, int64_t c, const at::Tensor &x, const char *op, const char *arg) {
  TORCH_CHECK(v.dim() == 1 && v.size(0) == c, op, ": ", arg, " must be [", c, "] (one entry per channel of x), got ",
              v.sizes());
  TORCH_CHECK(at::isFloatingType(v.scalar_type()), op, ": ", arg, " must be floating point, got ", v.scalar_type());
  check_same_device(v, arg, x, "x", op);
}

inline void check_norm_vector(const OptTensor &v, int64_t c, const at::Tensor &x, const char *op, const char *arg) {
  if (given(v)) check_norm_vector(*v, c, x, op, arg);
}

/* num_batches_tracked: one int64 value on x's device. */
inline void check_batches(const OptTensor &b, const at::Tensor &x, const char *op) {
  if (!given(b)) return;
  TORCH_CHECK(b->scalar_type() == at::kLong && b->numel() == 1, op,
              ": num_batches_tracked must hold one int64 value, got ", b->scalar_type(), " ", b->sizes());
  check_same_device(*b, "num_batches_tracked", x, "x", op);
}

/* The statistics' dtype: float32, or float64 for float64 data. */
inline at::ScalarType norm_stat_dtype(const at::Tensor &x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

/* running_mean and running_var: both or neither; training on one row with
** them has no unbiased variance (nn.BatchNorm1d refuses it too). */
inline void check_running(const at::Tensor &x, const OptTensor &rm, const OptTensor &rv, const char *op) {
  const int64_t c = x.size(1);
  TORCH_CHECK(given(rm) == given(rv), op, ": running_mean and running_var must both be given or both be None");
  check_norm_vector(rm, c, x, op, "running_mean");
  check_norm_vector(rv, c, x, op, "running_var");
  TORCH_CHECK(!given(rm) || x.size(0) != 1, op,
              ": expected more than 1 value per channel when training with running statistics, got x of shape ",
              x.sizes());
}

/* residual: x's shape, dtype and device. */
inline void check_residual(const OptTensor &r, const at::Tensor &x, const char *op) {
  if (!given(r)) return;
  TORCH_CHECK(r->sizes() == x.sizes(), op, ": residual must have x's shape ", x.sizes(), ", got ", r->sizes());
  TORCH_CHECK(r->scalar_type() == x.scalar_type(), op, ": residual dtype ", r->scalar_type(), " does not match x's ",
              x.scalar_type());
  check_same_device(*r, "residual", x, "x", op);
}

/* batch_norm_act's arguments; returns C. */
inline int64_t check_act_args(const at::Tensor &x, const at::Tensor &mean, const at::Tensor &spread,
                              const OptTensor &weight, const OptTensor &bias, const OptTensor &residual,
                              bool spread_is_var, const char *op) {
  const int64_t c = check_norm_x(x, op, "x");
  check_norm_vector(mean, c, x, op, "mean");
  check_norm_vector(spread, c, x, op, spread_is_var ? "running_var" : "invstd");
  check_norm_vector(weight, c, x, op, "weight");
  check_norm_vector(bias, c, x, op, "bias");
  check_residual(residual, x, op);
  return c;
}

/* batch_norm_act_backward's arguments (grad: x's shape, dtype and device); returns C. */
inline int64_t check_act_backward_args(const at::Tensor &grad, const at::Tensor &x, const at::Tensor &mean,
                                       const at::Tensor &invstd, const OptTensor &weight, const OptTensor &bias,
                                       const OptTensor &residual, bool dresidual, const char *op) {
  const int64_t c = check_act_args(x, mean, invstd, weight, bias, residual, false, op);
  check_norm_x(grad, op, "grad");
  TORCH_CHECK(grad.sizes() == x.sizes(), op, ": grad must have x's shape ", x.sizes(), ", got ", grad.sizes());
  TORCH_CHECK(grad.scalar_type() == x.scalar_type(), op, ": grad dtype ", grad.scalar_type(), " does not match x's ",
              x.scalar_type());
  check_same_device(grad, "grad", x, "x", op);
  TORCH_CHECK(!dresidual || given(residual), op, ": a residual gradient was asked for without a residual");
  return c;
}

}  // namespace torchsp
