/*
** ops.cpp: the one TORCH_LIBRARY(torchsp, m) block: every op's schema.
** Registration happens in static initialisers when the shared object is
** loaded, by `import torchsp._C` (eager.cpp defines that module).
**
** Ops are functional: they allocate and return their outputs, so fake kernels
** (torchsp/_fake.py), autograd (torchsp/_autograd.py), torch.compile, export
** and TorchScript all see plain schemas.  docs/internals.md explains each.
*/
#include <torch/library.h>

TORCH_LIBRARY(torchsp, m) {
  const std::vector<at::Tag> tags = {at::Tag::pt2_compliant_tag};
  m.def(
      "out_coords(Tensor coords, int[] kernel, int[] dilation, int[] padding, int[] step, "
      "int sign, int[] lattice, bool floor_rule) -> Tensor",
      tags);
  m.def(
      "kernel_map(Tensor in_coords, Tensor out_coords, int[] kernel, int[] dilation, "
      "int[] padding, int[] step, int sign, int method) -> Tensor",
      tags);
  m.def("coords_summary(Tensor coords, int[] stride) -> Tensor", tags);
  m.def("kernel_map_transpose(Tensor nbmap, Tensor in_coords) -> Tensor", tags);
  m.def("kernel_map_pairs(Tensor nbmap, bool bounded=False, bool rows=False) -> (Tensor, Tensor)", tags);
  m.def("mask_order(Tensor nbmap, int offsets=-1, bool with_map=False) -> Tensor", tags);
  m.def("tile_steps(Tensor nbmap, Tensor order, bool refine=True) -> Tensor", tags);
  m.def(
      "conv_fwd(Tensor x, Tensor weight, Tensor nbmap, Tensor nbmap_t, int[] fwd_algo, "
      "int[] dgrad_algo, int[] wgrad_algo, Tensor? order=None, Tensor? order_t=None, int[] segs=[], "
      "int[] segs_t=[]) -> Tensor",
      tags);
  m.def("conv_dgrad(Tensor dy, Tensor weight, Tensor nbmap_t, int[] algo, Tensor? order_t=None, "
        "int[] segs_t=[]) -> Tensor",
        tags);
  m.def("conv_wgrad(Tensor x, Tensor dy, Tensor nbmap, int[] algo, Tensor? pairs=None, "
        "Tensor? pair_starts=None) -> Tensor",
        tags);
  // Batch norm for traced training graphs (batch_norm.cpp, torchsp/nn/_batch_norm.py).
  m.def("batch_norm_train(Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean, Tensor? running_var, "
        "float momentum, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        tags);
  m.def("batch_norm_train_backward(Tensor grad, Tensor x, Tensor? weight, Tensor mean, Tensor invstd, float eps, "
        "bool[3] mask) -> (Tensor, Tensor, Tensor)",
        tags);
  // Fused batch norm (+ ReLU) for eager calls (torchsp.h tsp_bn_*, shim_norm_*.cpp, eager_norm.cpp).  The
  // statistics update the running ones in place, as nn.BatchNorm1d does; traced code keeps the ops above.
  m.def("batch_norm_stats(Tensor x, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
        "Tensor(c!)? num_batches_tracked, float momentum, float eps) -> (Tensor, Tensor)",
        tags);
  m.def("batch_norm_act(Tensor x, Tensor mean, Tensor spread, Tensor? weight, Tensor? bias, Tensor? residual, "
        "float eps, bool spread_is_var, bool relu) -> Tensor",
        tags);
  m.def("batch_norm_act_backward(Tensor grad, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, "
        "Tensor? residual, bool relu, bool[4] mask) -> (Tensor, Tensor, Tensor, Tensor)",
        tags);
}
