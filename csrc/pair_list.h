/*
** pair_list.h: a kernel map's pair list (kernel_map_pairs: for each offset k
** the output rows that have it), built on first use and shared by every
** holder of the map.
**
** The CUDA wgrad over pair pieces walks nbmap's pair list.  An eager training
** call builds it in backward, not at forward: a forward in grad mode that no
** backward follows (an evaluation loop without no_grad) never pays for it.
** torchsp.plan keeps one PairList per map and direction in the map's plans;
** the training node (eager.cpp) keeps a reference to its map's, so a list is
** built once however many layers and passes read it.
**
** On CUDA the list is built bounded (kernel_map_pairs(nbmap, bounded=True):
** N * V entries, the pairs then -1), so its length never travels to the
** host and a training call on a new submanifold map makes no synchronisation
** that torch's sync debug mode catches (tests/test_conv.py).  Before, the
** first backward of each map read the length back: the host stalled until
** the GPU drained, then the GPU idled while the host queued launches.  H100,
** MinkUNet at 0.05 m, fp16, a training step on a new SparseTensor each call
** (.peers/s44/pairsync.py, one process, alternating rounds): that read-back
** 27.5 ms against 24.0 ms with no list passed (every wgrad building its own
** on the stream) on a fast host; on a slow host (session 44, calls 3-4) the
** bounded list against the old build was 40.2 against 40.8 ms, within noise.
** The cost: up to N * V * 4 bytes per list, as much as nbmap, while the map
** lives; twice that for a list with rows (below).
**
** A list made with rows holds the pairs' input rows too (kernel_map_pairs(
** nbmap, rows=True): pairs [2, P]), which the CUDA wgrad reads beside the
** output rows instead of looking each up in nbmap (tsp_conv_problem.pair_rows;
** torchsp.plan asks for them on the wgrad direction's list on CUDA).
*/
#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <mutex>
#include <tuple>

#include "typed_ops.h"

namespace torchsp {

/* Whether t is a tracer's stand-in: a fake or proxy tensor (Python-keyed, or
** with symbolic sizes), or anything made while a Python dispatch mode runs
** (compiled autograd tracing a backward, FakeTensorMode). */
inline bool stand_in(const at::Tensor &t) {
  return t.key_set().has(c10::DispatchKey::Python) ||
         c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Python) ||
         t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

/* One map direction's pair list.  nbmap: int32 [N, V], the map rows; rows:
** whether the list holds the input rows too; pairs (int32 [P], or [N * V] on
** CUDA with the pairs first; with rows [2, P] or [2, N * V]) and starts
** (int64 [V + 1]) are undefined until the first
** get().  get() may run on autograd's device threads and on the caller's at
** once: a mutex orders the builds. */
struct PairList : torch::CustomClassHolder {
  explicit PairList(at::Tensor nbmap_, bool rows_ = false) : nbmap(std::move(nbmap_)), rows(rows_) {}
  /* A list restored as built (pickling): pairs and starts both given, or neither. */
  PairList(at::Tensor nbmap_, const std::optional<at::Tensor> &pairs_, const std::optional<at::Tensor> &starts_,
           bool rows_)
      : nbmap(std::move(nbmap_)), rows(rows_) {
    TORCH_CHECK(pairs_.has_value() == starts_.has_value(), "PairList: pairs and starts come together");
    if (pairs_) {
      pairs = *pairs_;
      starts = *starts_;
    }
  }

  /* (pairs, starts) = kernel_map_pairs(nbmap, bounded on CUDA, rows), built
  ** on the first call; a tracer's stand-ins are returned, never kept. */
  std::tuple<at::Tensor, at::Tensor> get() {
    std::lock_guard<std::mutex> lock(mu);
    if (pairs.defined()) return {pairs, starts};
    auto built = kernel_map_pairs_op().call(nbmap, nbmap.is_cuda(), rows);
    if (!stand_in(std::get<0>(built))) std::tie(pairs, starts) = built;
    return built;
  }

  /* (pairs, starts) as built, or (None, None): the state pickling keeps. */
  std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> state() {
    std::lock_guard<std::mutex> lock(mu);
    if (!pairs.defined()) return {std::nullopt, std::nullopt};
    return {pairs, starts};
  }

  /* Whether get() has built the list. */
  bool built() {
    std::lock_guard<std::mutex> lock(mu);
    return pairs.defined();
  }

  const at::Tensor nbmap;
  const bool rows;

 private:
  std::mutex mu;
  at::Tensor pairs, starts;
};

using OptPairList = std::optional<c10::intrusive_ptr<PairList>>;

/*
** A PairList carried by a tensor, for the training node's saved data: compiled
** autograd (torch._dynamo.compiled_autograd) hashes every saved value, and a
** tensor hashes where a capsule of a C++ object does not.  The tensor has no
** elements; its storage's context owns one reference to the list, dropped by
** release_pair_list when the storage goes.
*/
inline void release_pair_list(void *ctx) { c10::intrusive_ptr<PairList>::reclaim(static_cast<PairList *>(ctx)); }

inline at::Tensor pair_list_tensor(const c10::intrusive_ptr<PairList> &list) {
  PairList *ref = c10::intrusive_ptr<PairList>(list).release();  // the reference the storage owns
  return at::for_blob(ref, {0}).context(ref, &release_pair_list).options(at::TensorOptions(at::kByte)).make_tensor();
}

/* The list pair_list_tensor put in t, or nullptr for any other tensor (a
** tracer's stand-in, say). */
inline PairList *pair_list_of(const at::Tensor &t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const c10::DataPtr &data = t.storage().data_ptr();
  return data.get_deleter() == &release_pair_list ? static_cast<PairList *>(data.get_context()) : nullptr;
}

}  // namespace torchsp
