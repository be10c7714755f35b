"""Autograd of torchsp::conv_fwd: backward calls the dgrad and wgrad ops.

The dataflow choices for the backward passes travel as arguments of conv_fwd
(chosen by the autotuner before the call), so backward reads no global state
and traces cleanly under torch.compile.
"""

import torch


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
