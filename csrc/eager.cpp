/*
** eager.cpp: the torchsp._C Python module: two entries for torchsp's eager
** calls into the registered convolution ops.
**
** conv_fwd: torch.ops.torchsp.conv_fwd(...) turns each Python argument into a boxed
** IValue checked against the schema before the dispatcher runs.  For conv_fwd's
** 11 arguments that costs ~3 us a call on a 2-core x86 host, paid on every
** layer call ahead of the kernel launch.  This entry reads the arguments
** itself (py_args.h) and calls the same op through its typed dispatcher
** handle below the autograd key (it serves the gradless calls,
** torchsp.functional._gradless), so every other dispatch key still applies:
** CPU / CUDA, Python modes, the profiler's record.
**
** conv_train: the eager training call, a C++ autograd node (the forward below
** the autograd key, the backward calling conv_dgrad and conv_wgrad with the
** plans the caller passed), so a backward runs no Python on autograd's device
** thread.  The wgrad pair list comes as the map's PairList (pair_list.h),
** built by the first backward that reads it, not at forward.
**
** Both entries are METH_FASTCALL CPython functions, not pybind11 ones:
** pybind11's casters took ~4 us more of the H200 machine's host per conv_fwd
** call than the readers of py_args.h.
**
** PairList: the class behind torchsp.plan's pair lists (pybind11: built once
** per map, off the per-call path).
**
** The batch-norm entries are eager_norm.cpp's.
**
** torchsp.functional and torchsp._autograd call them on the eager path only;
** traced code calls torch.ops.torchsp.* (and conv_fwd's registered autograd)
** as before.
*/
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <vector>

#include "pair_list.h"
#include "py_args.h"
#include "typed_ops.h"

namespace torchsp {
namespace {

/* The first seven arguments both entries take, in this order. */
struct ConvHead {
  const at::Tensor *x, *w, *nbmap, *nbmap_t;
  PyInts fwd_algo, dgrad_algo, wgrad_algo;
};

/* *h = args[0 .. 6] of the entry `fn`, or false with a TypeError. */
bool py_conv_head(PyObject *const *args, const char *fn, ConvHead *h) {
  return py_tensor(args[0], fn, "x", &h->x) && py_tensor(args[1], fn, "weight", &h->w) &&
         py_tensor(args[2], fn, "nbmap", &h->nbmap) && py_tensor(args[3], fn, "nbmap_t", &h->nbmap_t) &&
         py_ints(args[4], fn, "fwd_algo", &h->fwd_algo) && py_ints(args[5], fn, "dgrad_algo", &h->dgrad_algo) &&
         py_ints(args[6], fn, "wgrad_algo", &h->wgrad_algo);
}

/* conv_fwd(x, weight, nbmap, nbmap_t, fwd_algo, dgrad_algo, wgrad_algo, order,
** order_t, segs, segs_t) -> Tensor (module doc below). */
PyObject *py_conv_fwd(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const char *fn = "torchsp._C.conv_fwd";
  ConvHead h;
  PyInts segs, segs_t;
  OptTensor order, order_t;
  if (!py_nargs(nargs, 11, fn) || !py_conv_head(args, fn, &h) || !py_opt_tensor(args[7], fn, "order", &order) ||
      !py_opt_tensor(args[8], fn, "order_t", &order_t) || !py_ints(args[9], fn, "segs", &segs) ||
      !py_ints(args[10], fn, "segs_t", &segs_t))
    return nullptr;
  at::Tensor y;
  {
    pybind11::gil_scoped_release no_gil;
    /* Below the autograd key here rather than under Python's
    ** torch._C._AutoDispatchBelowAutograd: a `with` block costs ~0.7 us a call. */
    at::AutoDispatchBelowAutograd below_autograd;
    y = conv_fwd_op().call(*h.x, *h.w, *h.nbmap, *h.nbmap_t, h.fwd_algo, h.dgrad_algo, h.wgrad_algo, order, order_t,
                           segs, segs_t);
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

/* A thread's side stream of one device and the two events that fork it from
** and join it back to the current stream.  Kept for the thread's life (and
** leaked at its end, as torch's own per-device caches are): a stream taken
** from torch's pool per call would be a different one each time (the pool
** hands its 32 out in turn), each with its own cached allocations of wgrad's
** workspace, and two events made and destroyed per backward add host time
** (docs/performance-log.md, session 58). */
struct SideStream {
  c10::Stream stream;
  c10::Event fork, join;
  SideStream(const c10::impl::VirtualGuardImpl &impl, c10::Device device)
      : stream(impl.getStreamFromGlobalPool(device, false)), fork(device.type()), join(device.type()) {}
};

SideStream &side_stream(const c10::impl::VirtualGuardImpl &impl, c10::Device device) {
  thread_local std::vector<SideStream *> sides;
  const size_t at = static_cast<size_t>(device.index());
  if (sides.size() <= at) sides.resize(at + 1, nullptr);
  if (sides[at] == nullptr || sides[at]->stream.device_type() != device.type())
    sides[at] = new SideStream(impl, device);
  return *sides[at];
}

/* (first(), second()) with second() on the thread's side stream of the
** device, forked from and joined back to the current stream, so its kernels
** may run beside first()'s.  Device-generic (c10's virtual guard), so this
** file needs no CUDA header.  second()'s result was allocated on the side
** stream: record_stream keeps its memory from being handed out there again
** before the current stream has used it.  Tensors the side stream reads
** (saved inputs, dy) stay alive until the join is queued, and the current
** stream's later work, which alone may reuse their memory, runs after it. */
template <typename First, typename Second>
std::pair<at::Tensor, at::Tensor> on_two_streams(c10::Device device, First &&first, Second &&second) {
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream current = impl.getStream(device);
  SideStream &side = side_stream(impl, device);
  side.fork.record(current);
  side.fork.block(side.stream);
  at::Tensor b;
  {
    const c10::StreamGuard on_side(side.stream);
    b = second();
  }
  at::Tensor a = first();
  side.join.record(side.stream);
  side.join.block(current);
  if (b.defined()) b.record_stream(current);
  return {a, b};
}

}  // namespace

/*
** y = conv_fwd(x, w) with the op's gradients.  Forward: conv_fwd below the
** autograd key (Function::apply has turned grad mode off, which would still
** enter conv_fwd's registered Python autograd kernel).  Backward: dx =
** conv_dgrad(dy, w, nbmap_t, dgrad_algo, order_t, segs_t) when x required
** grad, dw = conv_wgrad(x, dy, nbmap, wgrad_algo, pairs, pair_starts) when w
** did, pairs and pair_starts from pair_list->get() (built there on the map's
** first backward) or none: the same calls, arguments and sums as the
** registered autograd of torchsp/_autograd.py.  With `overlap` (and both
** gradients wanted, on a GPU) wgrad runs on a side stream beside dgrad
** (on_two_streams): the same kernels, so the same sums.  The dgrad and wgrad
** ops are not differentiable, so neither is this backward.
*/
struct SparseConvFunction : public torch::autograd::Function<SparseConvFunction> {
  /* Compiled autograd takes a C++ node only when it may trace its backward up
  ** to torch 2.6; torch 2.7 and newer call an untraced backward as one opaque
  ** op (pytorch#146229), which keeps the pair list's cache.  The backward is
  ** traceable: every tensor goes through the ops, whose fake kernels exist. */
  static constexpr bool is_traceable = TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 7;

  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &x, const at::Tensor &w,
                            const at::Tensor &nbmap, const at::Tensor &nbmap_t, c10::IntArrayRef fwd_algo,
                            c10::IntArrayRef dgrad_algo, c10::IntArrayRef wgrad_algo, const OptTensor &order,
                            c10::IntArrayRef segs, const OptTensor &order_t, c10::IntArrayRef segs_t,
                            const OptPairList &pair_list, bool overlap) {
    at::Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      y = conv_fwd_op().call(x, w, nbmap, nbmap_t, fwd_algo, dgrad_algo, wgrad_algo, order, std::nullopt, segs, {});
    }
    const bool dx = x.requires_grad(), dw = w.requires_grad();
    ctx->save_for_backward({dw ? x : at::Tensor(), w});
    auto &d = ctx->saved_data;
    d["dx"] = dx;
    d["dw"] = dw;
    d["overlap"] = overlap && dx && dw && x.device().type() != c10::DeviceType::CPU;
    if (dx) {
      d["nbmap_t"] = nbmap_t;
      d["dgrad_algo"] = dgrad_algo;
      d["order_t"] = order_t;
      d["segs_t"] = segs_t;
    }
    if (dw) {
      d["nbmap"] = nbmap;
      d["wgrad_algo"] = wgrad_algo;
      if (pair_list) d["pair_list"] = pair_list_tensor(*pair_list);
    }
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &dy = grads[0];
    auto &d = ctx->saved_data;
    auto dgrad = [&] {
      return conv_dgrad_op().call(dy, saved[1], d["nbmap_t"].toTensor(), d["dgrad_algo"].toIntVector(),
                                  d["order_t"].toOptional<at::Tensor>(), d["segs_t"].toIntVector());
    };
    OptTensor pairs, starts;
    if (d["dw"].toBool()) {
      const auto held = d.find("pair_list");
      PairList *list = held != d.end() ? pair_list_of(held->second.toTensor()) : nullptr;
      // A traced backward (compiled autograd below torch 2.7) leaves the list alone.  Built here,
      // on the current stream, even when wgrad then runs on a side one: the map keeps the list,
      // and memory it keeps must not come from a side stream's pool.
      if (list && !stand_in(dy)) std::tie(pairs, starts) = list->get();
    }
    auto wgrad = [&] {
      return conv_wgrad_op().call(saved[0], dy, d["nbmap"].toTensor(), d["wgrad_algo"].toIntVector(), pairs,
                                  starts);
    };
    at::Tensor dx, dw;
    if (d["overlap"].toBool() && !stand_in(dy)) {
      std::tie(dx, dw) = on_two_streams(dy.device(), dgrad, wgrad);
    } else {
      if (d["dx"].toBool()) dx = dgrad();
      if (d["dw"].toBool()) dw = wgrad();
    }
    torch::autograd::variable_list out(13); // one per forward argument
    out[0] = dx;
    out[1] = dw;
    return out;
  }
};

/* *out = the PairList `o`, or nullopt for None; else a TypeError. */
bool py_pair_list(PyObject *o, const char *fn, OptPairList *out) {
  if (o == Py_None) {
    out->reset();
    return true;
  }
  pybind11::detail::make_caster<c10::intrusive_ptr<PairList>> caster;
  if (!caster.load(o, false)) {
    PyErr_Format(PyExc_TypeError, "%s: pair_list must be a torchsp._C.PairList or None, got %s", fn,
                 Py_TYPE(o)->tp_name);
    return false;
  }
  *out = pybind11::detail::cast_op<c10::intrusive_ptr<PairList>>(caster);
  return true;
}

/* conv_train(x, weight, nbmap, nbmap_t, fwd_algo, dgrad_algo, wgrad_algo,
** order, segs, order_t, segs_t, pair_list, overlap) -> Tensor (module doc below). */
PyObject *py_conv_train(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const char *fn = "torchsp._C.conv_train";
  ConvHead h;
  PyInts segs, segs_t;
  OptTensor order, order_t;
  OptPairList pair_list;
  bool overlap = false;
  if (!py_nargs(nargs, 13, fn) || !py_conv_head(args, fn, &h) || !py_opt_tensor(args[7], fn, "order", &order) ||
      !py_ints(args[8], fn, "segs", &segs) || !py_opt_tensor(args[9], fn, "order_t", &order_t) ||
      !py_ints(args[10], fn, "segs_t", &segs_t) || !py_pair_list(args[11], fn, &pair_list) ||
      !py_bool(args[12], fn, "overlap", &overlap))
    return nullptr;
  at::Tensor y;
  {
    pybind11::gil_scoped_release no_gil;
    y = SparseConvFunction::apply(*h.x, *h.w, *h.nbmap, *h.nbmap_t, c10::IntArrayRef(h.fwd_algo),
                                  c10::IntArrayRef(h.dgrad_algo), c10::IntArrayRef(h.wgrad_algo), order,
                                  c10::IntArrayRef(segs), order_t, c10::IntArrayRef(segs_t), pair_list, overlap);
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

c10::intrusive_ptr<PairList> pair_list_new(const at::Tensor &nbmap, bool rows) {
  return c10::make_intrusive<PairList>(nbmap, rows);
}

/* Pickling (copy.deepcopy, pickle, torch.save of a SparseTensor whose map
** holds a list): (nbmap, pairs or None, starts or None, rows); a state of
** three, pickled before lists had rows, reads as rows=False. */
pybind11::tuple pair_list_getstate(PairList &self) {
  auto state = self.state();
  return pybind11::make_tuple(self.nbmap, std::get<0>(state), std::get<1>(state), self.rows);
}

c10::intrusive_ptr<PairList> pair_list_setstate(const pybind11::tuple &state) {
  if (state.size() != 3 && state.size() != 4)
    throw pybind11::value_error("PairList: a pickled state is (nbmap, pairs, starts, rows)");
  HANDLE_TH_ERRORS
  return c10::make_intrusive<PairList>(state[0].cast<at::Tensor>(), state[1].cast<OptTensor>(),
                                       state[2].cast<OptTensor>(), state.size() == 4 && state[3].cast<bool>());
  END_HANDLE_TH_ERRORS_PYBIND
}

std::tuple<at::Tensor, at::Tensor> pair_list_get(PairList &self) {
  HANDLE_TH_ERRORS
  pybind11::gil_scoped_release no_gil;  // the build launches kernels (and waits on the mutex)
  return self.get();
  END_HANDLE_TH_ERRORS_PYBIND
}

void add_norm_entries(pybind11::module_ &m);  // eager_norm.cpp

}  // namespace torchsp

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchsp's compiled library: loading it registers torch.ops.torchsp.*; the functions below are "
            "eager entries into conv_fwd through its typed dispatcher handle (csrc/eager.cpp)";
  static PyMethodDef entries[] = {
      {"conv_fwd", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&torchsp::py_conv_fwd)),
       METH_FASTCALL,
       "conv_fwd(x, weight, nbmap, nbmap_t, fwd_algo, dgrad_algo, wgrad_algo, order, order_t, segs, segs_t) "
       "-> Tensor: torch.ops.torchsp.conv_fwd with every argument given, positionally, below the autograd key "
       "(the result has no gradient)"},
      {"conv_train", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&torchsp::py_conv_train)),
       METH_FASTCALL,
       "conv_train(x, weight, nbmap, nbmap_t, fwd_algo, dgrad_algo, wgrad_algo, order, segs, order_t, segs_t, "
       "pair_list, overlap) -> Tensor: conv_fwd as an autograd node whose backward calls conv_dgrad (order_t, "
       "segs_t) and conv_wgrad (pair_list.get() when pair_list is a PairList of nbmap, built then if it is not "
       "yet); overlap: wgrad on a side stream beside dgrad when both are wanted on a GPU; positional"},
  };
  for (PyMethodDef &e : entries) {
    PyObject *f = PyCFunction_NewEx(&e, nullptr, m.attr("__name__").ptr());
    if (f == nullptr) throw pybind11::error_already_set();
    m.add_object(e.ml_name, pybind11::reinterpret_steal<pybind11::object>(f));
  }
  torchsp::add_norm_entries(m);
  pybind11::class_<torchsp::PairList, c10::intrusive_ptr<torchsp::PairList>>(
      m, "PairList",
      "PairList(nbmap, rows=False): the pair list of a kernel map direction (nbmap int32 [N, V]), with the "
      "pairs' input rows when rows, built on the first get() and kept (csrc/pair_list.h)")
      .def(pybind11::init(&torchsp::pair_list_new), pybind11::arg("nbmap"), pybind11::arg("rows") = false)
      .def(pybind11::pickle(&torchsp::pair_list_getstate, &torchsp::pair_list_setstate))
      .def("get", &torchsp::pair_list_get,
           "get() -> (pairs int32, starts int64 [V + 1]): torch.ops.torchsp.kernel_map_pairs(nbmap, bounded, "
           "rows), bounded on CUDA (pairs [N * V], the pairs then -1, no synchronisation), exact "
           "on the CPU (pairs [P]); with rows [2, .], the input rows in the second row; built on the first call "
           "and returned as built after it")
      .def_readonly("rows", &torchsp::PairList::rows, "whether the list holds the pairs' input rows")
      .def_property_readonly("built", &torchsp::PairList::built, "whether get() has built the list")
      .def_property_readonly(
          "refs", [](torchsp::PairList &self) { return c10::raw::intrusive_ptr::use_count(&self); },
          "references to the list: Python's, and one per conv_train node that keeps it")
      .def_readonly("nbmap", &torchsp::PairList::nbmap, "int32 [N, V]: the map rows");
}
