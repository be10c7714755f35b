/*
** autograd.cpp: TORCH_LIBRARY_IMPL(torchsp, Autograd, m) for the gradient ops
** conv_dgrad and conv_wgrad.  They are not differentiable: torchsp has no
** double backward.  Without a kernel here, a backward run with
** create_graph=True left their outputs with autograd's "not implemented"
** fallback, which only warns, so a second-order gradient came back silently
** missing.  Here each call runs the op below the autograd key; when gradients
** are being recorded (grad mode on, an input requiring grad) its output gets
** a node whose backward fails with a message that says why.
**
** conv_fwd's autograd stays in Python (torchsp/_autograd.py,
** torch.library.register_autograd) and in eager.cpp's training node.
*/
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "typed_ops.h"

namespace torchsp {
namespace {

void no_double_backward(const char *op) {
  TORCH_CHECK(false, op,
              ": a gradient of a sparse convolution's gradient was requested (double backward, e.g. "
              "torch.autograd.grad(..., create_graph=True) and then a backward through its result); torchsp's "
              "conv_dgrad and conv_wgrad are not differentiable");
}

/* The ops as the nodes below call them (`op`: below the autograd key) and name them. */
struct Dgrad {
  static constexpr const char *name = "torchsp.conv_dgrad";
  static at::Tensor op(const at::Tensor &dy, const at::Tensor &w, const at::Tensor &nbmap_t, c10::IntArrayRef algo,
                       const OptTensor &order_t, c10::IntArrayRef segs_t) {
    at::AutoDispatchBelowADInplaceOrView below;
    return conv_dgrad_op().call(dy, w, nbmap_t, algo, order_t, segs_t);
  }
};
struct Wgrad {
  static constexpr const char *name = "torchsp.conv_wgrad";
  static at::Tensor op(const at::Tensor &x, const at::Tensor &dy, const at::Tensor &nbmap, c10::IntArrayRef algo,
                       const OptTensor &pairs, const OptTensor &pair_starts) {
    at::AutoDispatchBelowADInplaceOrView below;
    return conv_wgrad_op().call(x, dy, nbmap, algo, pairs, pair_starts);
  }
};

/* Op's output as recorded while gradients are: a node whose backward raises. */
template <typename Op> struct OnceNode : public torch::autograd::Function<OnceNode<Op>> {
  template <typename... Args> static at::Tensor forward(torch::autograd::AutogradContext *, const Args &...args) {
    return Op::op(args...);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *,
                                                 torch::autograd::variable_list) {
    no_double_backward(Op::name);
    return {};
  }
};

/* Whether a call records gradients: only then is a node built (Function::apply
** costs allocations on every backward's hot path otherwise). */
bool recording(const at::Tensor &a, const at::Tensor &b) {
  return at::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad());
}

at::Tensor conv_dgrad_autograd(const at::Tensor &dy, const at::Tensor &w, const at::Tensor &nbmap_t,
                               c10::IntArrayRef algo, const OptTensor &order_t, c10::IntArrayRef segs_t) {
  if (recording(dy, w)) return OnceNode<Dgrad>::apply(dy, w, nbmap_t, algo, order_t, segs_t);
  return Dgrad::op(dy, w, nbmap_t, algo, order_t, segs_t);
}

at::Tensor conv_wgrad_autograd(const at::Tensor &x, const at::Tensor &dy, const at::Tensor &nbmap,
                               c10::IntArrayRef algo, const OptTensor &pairs, const OptTensor &pair_starts) {
  if (recording(x, dy)) return OnceNode<Wgrad>::apply(x, dy, nbmap, algo, pairs, pair_starts);
  return Wgrad::op(x, dy, nbmap, algo, pairs, pair_starts);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchsp, Autograd, m) {
  m.impl("conv_dgrad", &conv_dgrad_autograd);
  m.impl("conv_wgrad", &conv_wgrad_autograd);
}

}  // namespace torchsp
