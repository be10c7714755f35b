/*
** typed_ops.h: typed dispatcher handles of the three convolution ops and of
** kernel_map_pairs, for the C++ callers that call them by handle rather than
** through torch.ops: the eager entries and the training node (eager.cpp), the
** gradient ops' autograd kernels (autograd.cpp) and the lazily built pair list
** (pair_list.h).  A typed call skips the boxed argument
** stack; it still runs every dispatch key.  Each handle is looked up once
** (ops.cpp registers the schemas when this library loads); typed() checks the
** C++ signature against the schema.
*/
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace torchsp {

using OptTensor = std::optional<at::Tensor>;
using ConvFwdFn = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, const at::Tensor &,
                             c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef, const OptTensor &,
                             const OptTensor &, c10::IntArrayRef, c10::IntArrayRef);
using ConvDgradFn = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, c10::IntArrayRef,
                               const OptTensor &, c10::IntArrayRef);
using ConvWgradFn = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, c10::IntArrayRef,
                               const OptTensor &, const OptTensor &);
using KernelMapPairsFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor &, bool, bool);

template <typename Fn> inline c10::TypedOperatorHandle<Fn> typed_op(const char *name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

inline const c10::TypedOperatorHandle<ConvFwdFn> &conv_fwd_op() {
  static const auto op = typed_op<ConvFwdFn>("torchsp::conv_fwd");
  return op;
}
inline const c10::TypedOperatorHandle<ConvDgradFn> &conv_dgrad_op() {
  static const auto op = typed_op<ConvDgradFn>("torchsp::conv_dgrad");
  return op;
}
inline const c10::TypedOperatorHandle<ConvWgradFn> &conv_wgrad_op() {
  static const auto op = typed_op<ConvWgradFn>("torchsp::conv_wgrad");
  return op;
}
inline const c10::TypedOperatorHandle<KernelMapPairsFn> &kernel_map_pairs_op() {
  static const auto op = typed_op<KernelMapPairsFn>("torchsp::kernel_map_pairs");
  return op;
}

}  // namespace torchsp
