/*
** shim_cuda.cpp: TORCH_LIBRARY_IMPL(torchsp, CUDA): the same checks as the CPU
** shim, a device guard, workspace from PyTorch's caching allocator, and launch
** on the current stream.  Only out_coords and kernel_map_pairs (unless
** bounded) synchronise: their output sizes are data-dependent and must be
** known to allocate.  The kernel map, its transpose, mask_order and the three
** convolution passes never do, so a layer's launches can be captured in a
** CUDA graph.
*/
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <utility>

#include "shim_common.h"
#include "shim_ggs.h"
#include "torchsp.h"

namespace torchsp {
namespace {

void check_status(tsp_status s, const char *op) {
  if (s == TSP_ERR_CUDA) TORCH_CHECK(false, op, ": CUDA error: ", tsp_cuda_last_error());
  TORCH_CHECK(s == TSP_OK, op, ": ", status_text(s));
}

tsp_cuda_stream current_stream() {
  return reinterpret_cast<tsp_cuda_stream>(c10::cuda::getCurrentCUDAStream().stream());
}

at::Tensor workspace(size_t bytes, const at::Tensor &like) {
  return at::empty({static_cast<int64_t>(bytes > 0 ? bytes : 1)}, like.options().dtype(at::kByte));
}

/* A convolution pass's workspace: none at all when it needs none (most fp16
** forward and dgrad plans), so the pass makes no allocator call for it; the
** kernels take NULL with 0 bytes. */
at::Tensor conv_workspace(size_t bytes, const at::Tensor &like) {
  return bytes > 0 ? workspace(bytes, like) : at::Tensor();
}

/* The persistent tile counter of the current stream (tsp_conv_problem.tile_counter):
** 8 zeroed bytes per device and stream, allocated on first use and
** kept for the process (never freed: no destructor runs after the driver
** shuts down), which the kernels leave zeroed.  nullptr, so that the pass
** keeps a counter in its workspace, for float32 (no tile takes one), for the
** per-thread default stream (one handle for every host thread's own stream)
** and while the stream is being captured: a graph may replay on another
** stream while eager passes use this one's counter.  Asked only for a pass
** that counts (tsp_conv_cuda_counts): the capture query costs ~0.4 us. */
int32_t *stream_counter(const at::Tensor &like) {
  if (like.scalar_type() != at::kHalf && like.scalar_type() != at::kBFloat16) return nullptr;
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(like.device().index());
  const cudaStream_t raw = stream.stream();
  if (raw == cudaStreamPerThread) return nullptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(raw, &capture) != cudaSuccess) {
    (void)cudaGetLastError(); /* the query's own error: the pass runs as before */
    return nullptr;
  }
  if (capture != cudaStreamCaptureStatusNone) return nullptr;
  static std::mutex lock;
  static auto *counters = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  std::lock_guard<std::mutex> hold(lock);
  at::Tensor &c = (*counters)[{static_cast<int>(like.device().index()), raw}];
  if (!c.defined()) c = at::zeros({2}, like.options().dtype(at::kInt));
  return c.data_ptr<int32_t>();
}

void *data_or_null(const at::Tensor &t) { return t.defined() ? t.data_ptr() : nullptr; }
size_t bytes_of(const at::Tensor &t) { return t.defined() ? static_cast<size_t>(t.numel()) : 0; }

at::Tensor out_coords_cuda(const at::Tensor &coords_in, c10::IntArrayRef kernel,
                           c10::IntArrayRef dilation, c10::IntArrayRef padding,
                           c10::IntArrayRef step, int64_t sign, c10::IntArrayRef lattice,
                           bool floor_rule) {
  const char *op = "torchsp.out_coords";
  check_coords(coords_in, op, "coords");
  c10::cuda::CUDAGuard guard(coords_in.device());
  tsp_out_coords_params p;
  p.kernel = make_kernel(op, kernel, dilation, padding, step, sign);
  fill3(p.lattice, lattice, op, "lattice", 1);
  p.floor_rule = floor_rule ? 1 : 0;
  at::Tensor coords = coords_in.contiguous();
  const int64_t n = coords.size(0);
  if (n == 0) return at::empty({0, 4}, coords.options());
  const int64_t cap = floor_rule ? n : n * tsp_kernel_volume(&p.kernel);
  at::Tensor keys = at::empty({cap}, coords.options().dtype(at::kLong));
  /* [count, status]: one small tensor so one copy brings both back. */
  at::Tensor result = at::zeros({2}, coords.options().dtype(at::kLong));
  int64_t *res = result.data_ptr<int64_t>();
  at::Tensor ws = workspace(tsp_out_coords_cuda_workspace(&p, n), coords);
  check_status(tsp_out_coords_cuda(&p, coords.data_ptr<int32_t>(), n, keys.data_ptr<int64_t>(),
                                   res, reinterpret_cast<int32_t *>(res + 1), ws.data_ptr(),
                                   static_cast<size_t>(ws.numel()), current_stream()),
               op);
  at::Tensor host = result.cpu();
  const int64_t n_out = host[0].item<int64_t>();
  check_status(static_cast<tsp_status>(host[1].item<int64_t>()), op);
  at::Tensor out = at::empty({n_out, 4}, coords.options());
  if (n_out > 0)
    check_status(tsp_unpack_keys_cuda(keys.data_ptr<int64_t>(), n_out, out.data_ptr<int32_t>(),
                                      current_stream()),
                 op);
  return out;
}

at::Tensor coords_summary_cuda(const at::Tensor &coords_in, c10::IntArrayRef stride) {
  const char *op = "torchsp.coords_summary";
  check_coords(coords_in, op, "coords");
  int32_t st[3];
  fill3(st, stride, op, "stride", 1);
  c10::cuda::CUDAGuard guard(coords_in.device());
  at::Tensor coords = coords_in.contiguous();
  const size_t bytes = tsp_coords_summary_cuda_bytes(coords.size(0));
  /* The summary, then the hash table: one allocation, one memset (torchsp.h). */
  at::Tensor buffer = at::empty({static_cast<int64_t>((bytes + 3) / 4)}, coords.options());
  check_status(tsp_coords_summary_cuda(coords.data_ptr<int32_t>(), coords.size(0), st, buffer.data_ptr(),
                                       static_cast<size_t>(buffer.numel()) * 4, current_stream()),
               op);
  return buffer.narrow(0, 0, TSP_SUMMARY_WORDS);
}

at::Tensor kernel_map_cuda(const at::Tensor &in_coords_, const at::Tensor &out_coords_,
                           c10::IntArrayRef kernel, c10::IntArrayRef dilation,
                           c10::IntArrayRef padding, c10::IntArrayRef step, int64_t sign,
                           int64_t method) {
  const char *op = "torchsp.kernel_map";
  check_coords(in_coords_, op, "in_coords");
  check_coords(out_coords_, op, "out_coords");
  check_same_device(in_coords_, "in_coords", out_coords_, "out_coords", op);
  TORCH_CHECK(method == TSP_KMAP_ZDELTA || method == TSP_KMAP_HASH, op,
              ": method must be 0 (z-delta) or 1 (hash), got ", method);
  c10::cuda::CUDAGuard guard(in_coords_.device());
  tsp_kernel k = make_kernel(op, kernel, dilation, padding, step, sign);
  at::Tensor in_coords = in_coords_.contiguous(), out_coords = out_coords_.contiguous();
  const int64_t v = tsp_kernel_volume(&k), n_in = in_coords.size(0), n_out = out_coords.size(0);
  at::Tensor nbmap = at::empty({n_out, v}, in_coords.options());
  if (n_out == 0) return nbmap;
  if (n_in == 0) return nbmap.fill_(-1);
  const tsp_kmap_method m = static_cast<tsp_kmap_method>(method);
  at::Tensor ws = workspace(tsp_kernel_map_cuda_workspace(&k, m, n_in, n_out), in_coords);
  check_status(tsp_kernel_map_cuda(&k, m, in_coords.data_ptr<int32_t>(), n_in,
                                   out_coords.data_ptr<int32_t>(), n_out,
                                   nbmap.data_ptr<int32_t>(), ws.data_ptr(),
                                   static_cast<size_t>(ws.numel()), current_stream()),
               op);
  return nbmap;
}

at::Tensor kernel_map_transpose_cuda(const at::Tensor &nbmap_, const at::Tensor &in_coords) {
  const char *op = "torchsp.kernel_map_transpose";
  check_map(nbmap_, op, "nbmap");
  check_same_device(nbmap_, "nbmap", in_coords, "in_coords", op);
  c10::cuda::CUDAGuard guard(nbmap_.device());
  at::Tensor nbmap = nbmap_.contiguous();
  const int64_t n_in = in_coords.size(0), v = nbmap.size(1);
  at::Tensor out = at::empty({n_in, v}, nbmap.options());
  if (n_in == 0) return out;
  if (nbmap.size(0) == 0 || v == 0) return out.fill_(-1);
  check_status(tsp_kernel_map_transpose_cuda(nbmap.data_ptr<int32_t>(), nbmap.size(0), v, n_in,
                                             out.data_ptr<int32_t>(), current_stream()),
               op);
  return out;
}

void check_cuda_dtype(const at::Tensor &t, const char *op, const char *arg) {
  TORCH_CHECK(t.scalar_type() != at::kDouble, op, ": ", arg,
              " is float64, which the CUDA kernels do not support; use float32, float16 or "
              "bfloat16 on the GPU (float64 works on the CPU)");
}

/* A checked optional row order as a contiguous tensor (kept alive by the
** caller) and its data pointer in *ptr; undefined and NULL when absent. */
at::Tensor contiguous_order(const std::optional<at::Tensor> &o, const int32_t **ptr) {
  if (!o.has_value() || !o->defined()) return at::Tensor();
  at::Tensor t = o->contiguous();
  *ptr = t.data_ptr<int32_t>();
  return t;
}

at::Tensor conv_fwd_cuda(const at::Tensor &x_, const at::Tensor &w_, const at::Tensor &nbmap_,
                         const at::Tensor &nbmap_t, c10::IntArrayRef fwd_algo,
                         c10::IntArrayRef dgrad_algo, c10::IntArrayRef wgrad_algo,
                         const std::optional<at::Tensor> &order_,
                         const std::optional<at::Tensor> &order_t, c10::IntArrayRef segs_,
                         c10::IntArrayRef segs_t) {
  const char *op = "torchsp.conv_fwd";
  tsp_conv_problem p = fwd_problem(x_, w_, nbmap_, nbmap_t, fwd_algo, op);
  make_algo(dgrad_algo, op, "dgrad_algo");
  make_algo(wgrad_algo, op, "wgrad_algo");
  p.order_plan = check_order(order_, p.n_out, nbmap_, op, "order", !segs_.empty());
  check_order(order_t, p.n_in, nbmap_, op, "order_t", !segs_t.empty());
  const std::vector<tsp_segment> segs = make_segments(segs_, order_, p.n_out, p.volume, op, "segs", "order");
  make_segments(segs_t, order_t, p.n_in, p.volume, op, "segs_t", "order_t");
  p.segs = segs.data();
  p.n_segs = static_cast<int32_t>(segs.size());
  check_cuda_dtype(x_, op, "x");
  c10::cuda::CUDAGuard guard(x_.device());
  at::Tensor x = x_.contiguous(), w = w_.contiguous(), nbmap = nbmap_.contiguous();
  at::Tensor order = contiguous_order(order_, &p.order);
  at::Tensor y = at::empty({p.n_out, p.c_out}, x.options());
  if (p.n_out == 0 || p.c_out == 0) return y;
  if (p.n_in == 0 || p.c_in == 0 || p.volume == 0) return y.zero_();
  if (p.algo.dataflow == TSP_DATAFLOW_GATHER_GEMM_SCATTER) {
    if (!segs.empty()) return ggs_pass(op, "segs", x, w, false, nbmap, order, segs, p.algo.threshold);
    p.algo.dataflow = TSP_DATAFLOW_OUTPUT_STATIONARY; /* no plan (tracing, exact float32): the plain pass */
    p.algo.threshold = 0;
  }
  p.tile_counter = tsp_conv_cuda_counts(&p, 0) ? stream_counter(x) : nullptr;
  at::Tensor ws = conv_workspace(tsp_conv_cuda_workspace(&p), x);
  check_status(tsp_conv_fwd_cuda(&p, x.data_ptr(), w.data_ptr(), nbmap.data_ptr<int32_t>(),
                                 y.data_ptr(), data_or_null(ws), bytes_of(ws),
                                 current_stream()),
               op);
  return y;
}

at::Tensor conv_dgrad_cuda(const at::Tensor &dy_, const at::Tensor &w_,
                           const at::Tensor &nbmap_t_, c10::IntArrayRef algo,
                           const std::optional<at::Tensor> &order_t_, c10::IntArrayRef segs_t_) {
  const char *op = "torchsp.conv_dgrad";
  tsp_conv_problem p = dgrad_problem(dy_, w_, nbmap_t_, algo, op);
  p.order_t_plan = check_order(order_t_, p.n_in, nbmap_t_, op, "order_t", !segs_t_.empty());
  const std::vector<tsp_segment> segs_t =
      make_segments(segs_t_, order_t_, p.n_in, p.volume, op, "segs_t", "order_t");
  p.segs_t = segs_t.data();
  p.n_segs_t = static_cast<int32_t>(segs_t.size());
  check_cuda_dtype(dy_, op, "dy");
  c10::cuda::CUDAGuard guard(dy_.device());
  at::Tensor dy = dy_.contiguous(), w = w_.contiguous(), nbmap_t = nbmap_t_.contiguous();
  at::Tensor order_t = contiguous_order(order_t_, &p.order_t);
  at::Tensor dx = at::empty({p.n_in, p.c_in}, dy.options());
  if (p.n_in == 0 || p.c_in == 0) return dx;
  if (p.n_out == 0 || p.c_out == 0 || p.volume == 0) return dx.zero_();
  if (p.algo.dataflow == TSP_DATAFLOW_GATHER_GEMM_SCATTER) {
    if (!segs_t.empty()) return ggs_pass(op, "segs_t", dy, w, true, nbmap_t, order_t, segs_t, p.algo.threshold);
    p.algo.dataflow = TSP_DATAFLOW_OUTPUT_STATIONARY; /* no plan: the plain pass */
    p.algo.threshold = 0;
  }
  p.tile_counter = tsp_conv_cuda_counts(&p, 1) ? stream_counter(dy) : nullptr;
  at::Tensor ws = conv_workspace(tsp_conv_cuda_workspace(&p), dy);
  check_status(tsp_conv_dgrad_cuda(&p, dy.data_ptr(), w.data_ptr(), nbmap_t.data_ptr<int32_t>(),
                                   dx.data_ptr(), data_or_null(ws), bytes_of(ws),
                                   current_stream()),
               op);
  return dx;
}

at::Tensor conv_wgrad_cuda(const at::Tensor &x_, const at::Tensor &dy_, const at::Tensor &nbmap_,
                           c10::IntArrayRef algo, const std::optional<at::Tensor> &pairs_,
                           const std::optional<at::Tensor> &pair_starts_) {
  const char *op = "torchsp.conv_wgrad";
  tsp_conv_problem p = wgrad_problem(x_, dy_, nbmap_, algo, op);
  check_pair_list(pairs_, pair_starts_, x_, &p, op);
  check_cuda_dtype(x_, op, "x");
  /* Dataflow 4's wgrad is 0's: tile 0's pair pieces already are per-offset gathered GEMMs. */
  if (p.algo.dataflow == TSP_DATAFLOW_GATHER_GEMM_SCATTER) p.algo.dataflow = TSP_DATAFLOW_OUTPUT_STATIONARY;
  c10::cuda::CUDAGuard guard(x_.device());
  at::Tensor x = x_.contiguous(), dy = dy_.contiguous(), nbmap = nbmap_.contiguous();
  at::Tensor pairs, pair_starts; /* kept alive over the launch */
  if (pairs_.has_value() && pairs_->defined()) { /* pair_starts too: check_pair_list */
    pairs = pairs_->contiguous();
    pair_starts = pair_starts_->contiguous();
    p.pairs = pairs.data_ptr<int32_t>();
    p.pair_rows = pair_rows_of(pairs);
    p.pair_starts = pair_starts.data_ptr<int64_t>();
  }
  at::Tensor dw = at::empty({p.volume, p.c_in, p.c_out}, x.options());
  if (dw.numel() == 0) return dw;
  if (p.n_out == 0 || p.n_in == 0) return dw.zero_();
  at::Tensor ws = conv_workspace(tsp_conv_cuda_wgrad_workspace(&p), x);
  check_status(tsp_conv_wgrad_cuda(&p, x.data_ptr(), dy.data_ptr(), nbmap.data_ptr<int32_t>(),
                                   dw.data_ptr(), data_or_null(ws), bytes_of(ws),
                                   current_stream()),
               op);
  return dw;
}

}  // namespace

at::Tensor mask_order_cuda(const at::Tensor &nbmap_, int64_t offsets, bool with_map) {
  const char *op = "torchsp.mask_order";
  check_mask_order_map(nbmap_, op);
  c10::cuda::CUDAGuard guard(nbmap_.device());
  at::Tensor nbmap = nbmap_.contiguous();
  const int64_t n = nbmap.size(0), v = nbmap.size(1);
  at::Tensor order = at::empty({n}, nbmap.options());
  if (n == 0) return order;
  const size_t bytes = tsp_mask_order_cuda_workspace(n, v);
  TORCH_CHECK(bytes > 0, op, ": could not size the sort workspace for ", n, " rows");
  at::Tensor ws = workspace(bytes, nbmap);
  check_status(tsp_mask_order_cuda(nbmap.data_ptr<int32_t>(), n, v, static_cast<uint64_t>(offsets),
                                   order.data_ptr<int32_t>(), ws.data_ptr(),
                                   static_cast<size_t>(ws.numel()), current_stream()),
               op);
  if (!with_map) return order;
  at::Tensor plan = at::empty({n * (1 + v)}, nbmap.options());
  check_status(tsp_mask_plan_cuda(nbmap.data_ptr<int32_t>(), n, v, order.data_ptr<int32_t>(),
                                  plan.data_ptr<int32_t>(), current_stream()),
               op);
  return plan;
}

/* The step plan [tsp_tile_steps_len(N, V)] of nbmap and order, refined or not (torchsp.h). */
at::Tensor tile_steps_cuda(const at::Tensor &nbmap_, const at::Tensor &order_, bool refine) {
  const char *op = "torchsp.tile_steps";
  check_steps_args(nbmap_, order_, op);
  c10::cuda::CUDAGuard guard(nbmap_.device());
  at::Tensor nbmap = nbmap_.contiguous(), order = order_.contiguous();
  const int64_t n = nbmap.size(0), v = nbmap.size(1);
  at::Tensor steps = at::empty({tsp_tile_steps_len(n, v)}, nbmap.options());
  check_status(tsp_tile_steps_cuda(nbmap.data_ptr<int32_t>(), n, v, order.data_ptr<int32_t>(), refine ? 1 : 0,
                                   steps.data_ptr<int32_t>(), current_stream()),
               op);
  return steps;
}

/* (pairs int32, starts [V + 1] int64): count and scan, then either read P back
** (the one synchronisation), allocate [P] and fill, or (bounded) fill
** [N * V] of -1, the most the map can hold, with no synchronisation: the fill
** writes the first starts[V] entries, read on the device.  rows: pairs is
** [2, P] (or [2, N * V]), the input rows in its second row.  The workspace
** carries the scanned cell bases from the first call to the second. */
std::tuple<at::Tensor, at::Tensor> kernel_map_pairs_cuda(const at::Tensor &nbmap_, bool bounded, bool rows) {
  const char *op = "torchsp.kernel_map_pairs";
  check_pairs_map(nbmap_, op);
  c10::cuda::CUDAGuard guard(nbmap_.device());
  at::Tensor nbmap = nbmap_.contiguous();
  const int64_t n = nbmap.size(0), v = nbmap.size(1);
  at::Tensor starts = at::empty({v + 1}, nbmap.options().dtype(at::kLong));
  if (n == 0 || v == 0) return {pair_list_tensor(0, bounded, rows, nbmap), starts.zero_()};
  const size_t bytes = tsp_kernel_map_pairs_cuda_workspace(n, v);
  TORCH_CHECK(bytes > 0, op, ": nbmap of ", n, " rows x ", v,
              " offsets is too large for the pair scan");
  at::Tensor ws = workspace(bytes, nbmap);
  check_status(tsp_kernel_map_pair_counts_cuda(nbmap.data_ptr<int32_t>(), n, v,
                                               starts.data_ptr<int64_t>(), ws.data_ptr(),
                                               static_cast<size_t>(ws.numel()), current_stream()),
               op);
  const int64_t p = bounded ? n * v : starts[v].item<int64_t>();
  at::Tensor pairs = pair_list_tensor(p, bounded, rows, nbmap);
  if (p > 0)
    check_status(tsp_kernel_map_pairs_cuda(nbmap.data_ptr<int32_t>(), n, v, starts.data_ptr<int64_t>(),
                                           pairs.data_ptr<int32_t>(), pair_rows_of(pairs),
                                           ws.data_ptr(), static_cast<size_t>(ws.numel()), current_stream()),
                 op);
  return {pairs, starts};
}

TORCH_LIBRARY_IMPL(torchsp, CUDA, m) {
  m.impl("mask_order", &mask_order_cuda);
  m.impl("tile_steps", &tile_steps_cuda);
  m.impl("out_coords", &out_coords_cuda);
  m.impl("coords_summary", &coords_summary_cuda);
  m.impl("kernel_map", &kernel_map_cuda);
  m.impl("kernel_map_transpose", &kernel_map_transpose_cuda);
  m.impl("kernel_map_pairs", &kernel_map_pairs_cuda);
  m.impl("conv_fwd", &conv_fwd_cuda);
  m.impl("conv_dgrad", &conv_dgrad_cuda);
  m.impl("conv_wgrad", &conv_wgrad_cuda);
}

}  // namespace torchsp
