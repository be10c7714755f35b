"""Autograd of a sparse convolution: backward calls the dgrad and wgrad ops.

Two routes to the same kernels:
- the op's own: torch.library.register_autograd on torchsp::conv_fwd (DESIGN.md 5).  The
  dataflow choices for the backward passes travel as arguments of conv_fwd (chosen by the
  autotuner before the call), so backward reads no global state and traces cleanly under
  torch.compile / export; direct callers of torch.ops.torchsp.conv_fwd get it too;
- eager_conv, which torchsp.functional uses for eager training calls (no tracer, plain tensors,
  no functorch transform): torchsp._C.conv_train, a C++ autograd node (csrc/eager.cpp) over the
  same ops and arguments.  It skips the generic wrapper's per-call Python (on an H100 host,
  torch's wrapper re-reads conv_fwd's 11-argument schema in fill_defaults, ~28 us, and wraps
  forward and backward in two more layers) and torch.ops' per-argument parsing, its backward
  runs no Python on autograd's device thread, and it takes the dgrad row order and the wgrad
  pair list from the KernelMap (built once per map; the pair list in the first backward that
  reads it) instead of through conv_fwd.
  H100, fwd+bwd host us per call against a Python autograd.Function over the same calls
  (2026-11-26): subm C = 32 210 -> 182, down2 C = 64 227 -> 177.
"""

import torch

from . import _C
from ._tracing import capturing
from .plan import pass_plan, wgrad_pair_list

_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)

# An eager training call whose map entries x Cin x Cout reach this runs its backward's wgrad on a
# side stream beside dgrad (csrc/eager.cpp on_two_streams; same kernels and sums), where each
# pass's tail and wgrad's reduction can fill SMs the other leaves idle.  Set from measurement on
# the H200 (docs/performance-log.md, session 58): of tools/bench.py's layers only subm C = 256 at 0.1 m (2.2e11)
# gained (fwd+bwd 924.5 -> 892.0 us); below it the fork, the join and the second stream cost the
# host more than the overlap saved (up to +76 us a call, up2 C = 128).
OVERLAP_ENTRIES = 1 << 36

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_operands(feats, weight):
    """True when feats and weight are plain tensors (no subclass): the eager shortcuts of
    torchsp.functional then apply (torchsp._C.conv_fwd enters the autograd-free dispatch itself)."""
    return type(feats) in _PLAIN and type(weight) in _PLAIN


def _setup_context(ctx, inputs, output):
    x, weight, nbmap, nbmap_t, fwd_algo, dgrad_algo, wgrad_algo = inputs[:7]
    order_t = inputs[8] if len(inputs) > 8 else None
    ctx.segs_t = list(inputs[10]) if len(inputs) > 10 else []
    ctx.has_order_t = order_t is not None
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(x, weight, nbmap, nbmap_t, order_t if order_t is not None else nbmap_t)
    ctx.dgrad_algo = list(dgrad_algo)
    ctx.wgrad_algo = list(wgrad_algo)


def _backward(ctx, grad):
    x, weight, nbmap, nbmap_t, order_t = ctx.saved_tensors
    order_t = order_t if ctx.has_order_t else None
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.torchsp.conv_dgrad(grad, weight, nbmap_t, ctx.dgrad_algo, order_t, ctx.segs_t)
    if ctx.needs_input_grad[1]:
        grad_w = torch.ops.torchsp.conv_wgrad(x, grad, nbmap, ctx.wgrad_algo)
    return (grad_x, grad_w) + (None,) * (ctx.n_inputs - 2)


torch.library.register_autograd("torchsp::conv_fwd", _backward, setup_context=_setup_context)


def eager_conv(feats, weight, kmap, algos, order, segs, geom):
    """y = conv_fwd(feats, weight) with the op's gradients, for eager training calls: torchsp._C
    .conv_train, a C++ autograd node (csrc/eager.cpp) whose backward runs no Python.

    feats [N_in, Cin], weight [V, Cin, Cout] (plain tensors, eager_ok), kmap: torchsp.kmap
    .KernelMap, algos: (fwd, dgrad, wgrad) 4-lists, order: int32 [N_out] or None and segs: list of
    ints (the forward's torchsp.plan.pass_plan), geom: torchsp.kmap.ConvGeometry.
    Returns y [N_out, Cout], feats' dtype.  What backward needs is taken from the map here, once
    per map (cached on it): the dgrad plan when feats requires grad, the wgrad pair list
    (torchsp.plan.wgrad_pair_list) when weight does, unbuilt: the first backward that reads it
    builds it (on CUDA bounded, with no synchronisation: csrc/pair_list.h), so a forward in grad
    mode that no backward follows pays only for the dgrad plan.  The sums are those of the
    registered autograd.  Inference belongs under torch.no_grad() / torch.inference_mode(), which
    builds neither.  Layers of at least OVERLAP_ENTRIES map entries x Cin x Cout run the backward's
    wgrad on a side stream beside dgrad (GPU only; the node ignores it on the CPU).
    """
    fwd, dgrad, wgrad = algos
    order_t, segs_t = pass_plan(kmap, "dgrad", dgrad, geom, feats.dtype, False) if feats.requires_grad else (None, [])
    pairs = (wgrad_pair_list(kmap, wgrad, feats.dtype, feats.shape[1], weight.shape[2]) if weight.requires_grad
             else None)
    if pairs is not None and not pairs.built and capturing(feats):
        # A list built inside a CUDA graph capture would only be recorded, not computed, yet the
        # map would keep it for eager calls: the captured wgrad builds its own pairs instead.
        pairs = None
    nbmap = kmap.nbmap
    overlap = nbmap.numel() * feats.shape[1] * weight.shape[2] >= OVERLAP_ENTRIES
    return _C.conv_train(feats, weight, nbmap, kmap.nbmap_t, fwd, dgrad, wgrad, order, segs, order_t, segs_t,
                         pairs, overlap)


def eager_ok(feats, weight):
    """True when eager_conv may serve a call with these operands: plain_operands and no functorch
    transform active.  The caller has checked that no tracer runs."""
    return plain_operands(feats, weight) and not _functorch_active()
