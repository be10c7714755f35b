/*
** batch_norm.h: the ATen implementations of torchsp::batch_norm_train and
** batch_norm_train_backward (batch_norm.cpp): the CPU kernels of those ops,
** and on CUDA the fallback of shim_norm_cuda.cpp for what torchsp's batch-norm
** kernels do not take (float64, per-channel vectors of mixed dtypes).
*/
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

namespace torchsp {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_train_aten(
    const at::Tensor &x, const std::optional<at::Tensor> &weight, const std::optional<at::Tensor> &bias,
    const std::optional<at::Tensor> &running_mean, const std::optional<at::Tensor> &running_var, double momentum,
    double eps);

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_train_backward_aten(
    const at::Tensor &grad, const at::Tensor &x, const std::optional<at::Tensor> &weight, const at::Tensor &mean,
    const at::Tensor &invstd, double eps, std::array<bool, 3> mask);

}  // namespace torchsp
