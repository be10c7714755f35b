"""Batch normalisation of feats [N, C] for traced code (torch.compile, torch.export).

Two problems made torch.nn.BatchNorm1d the one layer that kept compiled and exported sparse
models from working, or from paying:
- After a strided or generative conv the row count N is data-dependent (an unbacked size), and
  F.batch_norm decides on it (more than one row when training, an empty input), which tracing
  cannot do: every fullgraph compile and export of a model with a norm after a downsampling
  layer failed with "Could not guard on data-dependent expression".  batch_norm_traced calls the
  ATen kernels below F.batch_norm instead, which decide nothing on N.
- In training, inductor lowers the statistics and their gradients to Triton reductions over N.
  With N unknown when compiling it does not split them, so each runs on C blocks: on an H100,
  MinkUNet's training step compiled took 54 ms against 40 eager, the 49 norms' kernels about 30
  ms of it.  So training calls go through torchsp::batch_norm_train and
  torchsp::batch_norm_train_backward (csrc/batch_norm.cpp; fake kernels in torchsp/_fake.py),
  ops over aten.native_batch_norm and its backward that inductor cannot see into: a compiled
  graph runs the same CUDA kernels as eager.  Their autograd is registered here.
Eval calls stay pointwise ATen (aten._native_batch_norm_legit_no_training), which inductor fuses
with the ReLU after it.
"""

import torch

from .._tracing import compiling


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs[:3]
    mean, invstd = output[1:3]
    ctx.save_for_backward(x, weight, mean, invstd)
    ctx.eps = inputs[6]
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None


def _backward(ctx, grad, *_unused):
    x, weight, mean, invstd = ctx.saved_tensors
    mask = [bool(ctx.needs_input_grad[0]), ctx.has_weight and bool(ctx.needs_input_grad[1]),
            ctx.has_bias and bool(ctx.needs_input_grad[2])]
    gx, gw, gb = torch.ops.torchsp.batch_norm_train_backward(grad, x, weight, mean, invstd, ctx.eps, mask)
    return (gx if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None) + (None,) * 4


torch.library.register_autograd("torchsp::batch_norm_train", _backward, setup_context=_setup_context)


_ONE_ROW = "BatchNorm: expected more than 1 value per channel when training"


def _check_rows(n):
    """Raise RuntimeError, as bn(x) does in training, when x has n == 1 rows: at once where n is a
    known int, else as a runtime assertion in the traced graph (torch._check without a message:
    dynamo before torch 2.7 cannot take the message callable, "NestedUserFunctionVariable()" on
    2.4.1, and compiled graphs on 2.13 raise their own "Runtime assertion failed" anyway).  Under
    dynamo a symbolic n passes isinstance(n, int) and `if n == 1` would guard on it, hence
    compiling() first."""
    if not compiling() and not isinstance(n, torch.SymInt):
        if n == 1:
            raise RuntimeError(_ONE_ROW)
    else:
        torch._check(n != 1)


def batch_norm_traced(bn, x):
    """nn.BatchNorm1d `bn` applied to x [N, C] (float, any N) as bn(x) computes it, for traced
    code: running statistics and num_batches_tracked update as bn(x) updates them, and a
    training call on one row raises, as bn(x) does (a runtime check on N).
    Returns y [N, C], x's dtype."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    if not bn.training and bn.running_mean is not None and bn.running_var is not None:
        return torch.ops.aten._native_batch_norm_legit_no_training.default(
            x, bn.weight, bn.bias, bn.running_mean, bn.running_var, factor, bn.eps)[0]
    _check_rows(x.shape[0])
    stats = bn.training and bn.track_running_stats and bn.running_mean is not None  # F.batch_norm's rule
    y, _, _, rm, rv = torch.ops.torchsp.batch_norm_train(x, bn.weight, bn.bias, bn.running_mean if stats else None,
                                                         bn.running_var if stats else None, factor, bn.eps)
    if stats:
        with torch.no_grad():
            bn.running_mean.copy_(rm)
            bn.running_var.copy_(rv)
    return y
