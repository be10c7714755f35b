/*
** eager_norm.cpp: torchsp._C's eager entries into the fused batch-norm ops,
** for torchsp.nn.BatchNorm's eager calls (torchsp/nn/norm.py):
**
**   batch_norm_train: batch statistics (updating the running ones in place),
**     the normalisation, a residual added (a residual block's tail) and the
**     ReLU after it when relu, as a C++ autograd
**     node whose backward calls batch_norm_act_backward: no Python on
**     autograd's device thread, two launches forward (statistics' partials,
**     their sum; normalisation: three in all) and three backward.
**   batch_norm_eval: the normalisation with the running statistics, no
**     gradient (one launch).
**
** METH_FASTCALL functions reading their arguments with py_args.h, as
** eager.cpp's conv entries do, for the same reason (host time per call).
** Traced code keeps torchsp::batch_norm_train (batch_norm.cpp).
*/
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include "py_args.h"
#include "shim_norm.h"
#include "typed_ops.h"

namespace torchsp {
namespace {

using StatsFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor &, const OptTensor &, const OptTensor &,
                                                   const OptTensor &, double, double);
using ActFn = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, const OptTensor &,
                         const OptTensor &, const OptTensor &, double, bool, bool);
using ActBackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor &, const at::Tensor &, const at::Tensor &, const at::Tensor &, const OptTensor &,
    const OptTensor &, const OptTensor &, bool, std::array<bool, 4>);

const c10::TypedOperatorHandle<StatsFn> &stats_op() {
  static const auto op = typed_op<StatsFn>("torchsp::batch_norm_stats");
  return op;
}
const c10::TypedOperatorHandle<ActFn> &act_op() {
  static const auto op = typed_op<ActFn>("torchsp::batch_norm_act");
  return op;
}
const c10::TypedOperatorHandle<ActBackwardFn> &act_backward_op() {
  static const auto op = typed_op<ActBackwardFn>("torchsp::batch_norm_act_backward");
  return op;
}

bool wants_grad(const OptTensor &t) { return t.has_value() && t->defined() && t->requires_grad(); }

OptTensor saved_opt(const at::Tensor &t) { return t.defined() ? OptTensor(t) : OptTensor(); }

/*
** y = relu?(batch_norm(x) + residual) in training (residual optional), with
** gradients for x, weight, bias and residual.  Forward: batch_norm_stats
** (running statistics and num_batches_tracked updated in place) and
** batch_norm_act below the autograd key.  Backward: batch_norm_act_backward
** with the saved batch mean and invstd; not differentiable itself (no double
** backward).
*/
struct BatchNormActFunction : public torch::autograd::Function<BatchNormActFunction> {
  /* As SparseConvFunction (eager.cpp): compiled autograd traces the backward up to torch 2.6. */
  static constexpr bool is_traceable = TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 7;

  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &x, const OptTensor &weight,
                            const OptTensor &bias, const OptTensor &residual, const OptTensor &running_mean,
                            const OptTensor &running_var, const OptTensor &batches, double momentum, double eps,
                            bool relu) {
    // The vectors batch_norm_act reads are checked before the statistics update the running ones:
    // a bad weight must not leave the buffers changed.
    const char *op = "torchsp._C.batch_norm_train";
    const int64_t c = check_norm_x(x, op, "x");
    check_norm_vector(weight, c, x, op, "weight");
    check_norm_vector(bias, c, x, op, "bias");
    check_residual(residual, x, op);
    at::Tensor mean, invstd, y;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(mean, invstd) = stats_op().call(x, running_mean, running_var, batches, momentum, eps);
      y = act_op().call(x, mean, invstd, weight, bias, residual, eps, false, relu);
    }
    // The residual is read again only for the ReLU's mask.
    const bool keep_r = residual.has_value() && residual->defined() && relu;
    ctx->save_for_backward({x, mean, invstd, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()),
                            keep_r ? *residual : at::Tensor()});
    auto &d = ctx->saved_data;
    d["relu"] = relu;
    d["dx"] = x.requires_grad();
    d["dw"] = wants_grad(weight);
    d["db"] = wants_grad(bias);
    d["dr"] = wants_grad(residual);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto &d = ctx->saved_data;
    const bool relu = d["relu"].toBool();
    const std::array<bool, 4> mask = {d["dx"].toBool(), d["dw"].toBool(), d["db"].toBool(), d["dr"].toBool()};
    torch::autograd::variable_list out(10);  // one per forward argument
    if (mask[3] && !relu && !mask[0] && !mask[1] && !mask[2]) {  // y = bn(x) + r: r's gradient is dy alone
      out[3] = grads[0];
      return out;
    }
    at::Tensor dx, dw, db, dr;
    std::array<bool, 4> asked = mask;
    asked[3] = mask[3] && relu;  // without relu, dr = dy: no copy asked of the op
    std::tie(dx, dw, db, dr) = act_backward_op().call(grads[0], saved[0], saved[1], saved[2], saved_opt(saved[3]),
                                                      saved_opt(saved[4]), saved_opt(saved[5]), relu, asked);
    if (mask[0]) out[0] = dx;
    if (mask[1]) out[1] = dw;
    if (mask[2]) out[2] = db;
    if (mask[3]) out[3] = relu ? dr : grads[0];
    return out;
  }
};

/* batch_norm_train(x, weight, bias, residual, running_mean, running_var,
** num_batches_tracked, momentum, eps, relu) -> Tensor (module doc below). */
PyObject *py_batch_norm_train(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const char *fn = "torchsp._C.batch_norm_train";
  const at::Tensor *x = nullptr;
  OptTensor w, b, r, rm, rv, nbt;
  double momentum = 0.0, eps = 0.0;
  bool relu = false;
  if (!py_nargs(nargs, 10, fn) || !py_tensor(args[0], fn, "x", &x) || !py_opt_tensor(args[1], fn, "weight", &w) ||
      !py_opt_tensor(args[2], fn, "bias", &b) || !py_opt_tensor(args[3], fn, "residual", &r) ||
      !py_opt_tensor(args[4], fn, "running_mean", &rm) || !py_opt_tensor(args[5], fn, "running_var", &rv) ||
      !py_opt_tensor(args[6], fn, "num_batches_tracked", &nbt) || !py_double(args[7], fn, "momentum", &momentum) ||
      !py_double(args[8], fn, "eps", &eps) || !py_bool(args[9], fn, "relu", &relu))
    return nullptr;
  at::Tensor y;
  {
    pybind11::gil_scoped_release no_gil;
    y = BatchNormActFunction::apply(*x, w, b, r, rm, rv, nbt, momentum, eps, relu);
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

/* batch_norm_eval(x, weight, bias, residual, running_mean, running_var, eps, relu) -> Tensor. */
PyObject *py_batch_norm_eval(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const char *fn = "torchsp._C.batch_norm_eval";
  const at::Tensor *x = nullptr, *rm = nullptr, *rv = nullptr;
  OptTensor w, b, r;
  double eps = 0.0;
  bool relu = false;
  if (!py_nargs(nargs, 8, fn) || !py_tensor(args[0], fn, "x", &x) || !py_opt_tensor(args[1], fn, "weight", &w) ||
      !py_opt_tensor(args[2], fn, "bias", &b) || !py_opt_tensor(args[3], fn, "residual", &r) ||
      !py_tensor(args[4], fn, "running_mean", &rm) || !py_tensor(args[5], fn, "running_var", &rv) ||
      !py_double(args[6], fn, "eps", &eps) || !py_bool(args[7], fn, "relu", &relu))
    return nullptr;
  at::Tensor y;
  {
    pybind11::gil_scoped_release no_gil;
    at::AutoDispatchBelowAutograd below_autograd;
    y = act_op().call(*x, *rm, *rv, w, b, r, eps, true, relu);
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

PyMethodDef norm_entries[] = {
    {"batch_norm_train", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&py_batch_norm_train)),
     METH_FASTCALL,
     "batch_norm_train(x, weight, bias, residual, running_mean, running_var, num_batches_tracked, momentum, eps, "
     "relu) -> Tensor: relu?(batch norm of x [N, C] with its batch statistics + residual [N, C] or None) as an "
     "autograd node (gradients for x, weight, bias, residual); the running statistics (both or None) and "
     "num_batches_tracked (or None) are updated in place, with the unbiased variance; positional"},
    {"batch_norm_eval", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&py_batch_norm_eval)),
     METH_FASTCALL,
     "batch_norm_eval(x, weight, bias, residual, running_mean, running_var, eps, relu) -> Tensor: relu?(batch "
     "norm of x [N, C] with the running statistics + residual or None), below the autograd key (no gradient); "
     "positional"},
};

}  // namespace

/* Adds the entries above to torchsp._C (called from eager.cpp's module init). */
void add_norm_entries(pybind11::module_ &m) {
  for (PyMethodDef &e : norm_entries) {
    PyObject *f = PyCFunction_NewEx(&e, nullptr, m.attr("__name__").ptr());
    if (f == nullptr) throw pybind11::error_already_set();
    m.add_object(e.ml_name, pybind11::reinterpret_steal<pybind11::object>(f));
  }
}

}  // namespace torchsp
