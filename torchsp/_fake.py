"""Fake (meta) kernels for every torchsp op: output shapes only, no data reads.

torch.compile, torch.export and opcheck run these instead of the real kernels
while tracing.  out_coords and kernel_map_pairs (unless bounded) have a
data-dependent length, declared with `ctx.new_dynamic_size()`; every other
shape follows from the inputs.
"""

import torch

from .kmap import step_plan_len


def _volume(kernel):
    return int(kernel[0]) * int(kernel[1]) * int(kernel[2])


@torch.library.register_fake("torchsp::out_coords")
def _out_coords(coords, kernel, dilation, padding, step, sign, lattice, floor_rule):
    ctx = torch.library.get_ctx()
    n = ctx.new_dynamic_size()
    return coords.new_empty((n, 4))


@torch.library.register_fake("torchsp::coords_summary")
def _coords_summary(coords, stride):
    return coords.new_empty((10,))


@torch.library.register_fake("torchsp::kernel_map")
def _kernel_map(in_coords, out_coords, kernel, dilation, padding, step, sign, method):
    return out_coords.new_empty((out_coords.shape[0], _volume(kernel)))


@torch.library.register_fake("torchsp::kernel_map_transpose")
def _kernel_map_transpose(nbmap, in_coords):
    return nbmap.new_empty((in_coords.shape[0], nbmap.shape[1]))


@torch.library.register_fake("torchsp::kernel_map_pairs")
def _kernel_map_pairs(nbmap, bounded=False, rows=False):
    p = nbmap.shape[0] * nbmap.shape[1] if bounded else torch.library.get_ctx().new_dynamic_size()
    return nbmap.new_empty((2, p) if rows else (p,)), nbmap.new_empty((nbmap.shape[1] + 1,), dtype=torch.int64)


@torch.library.register_fake("torchsp::mask_order")
def _mask_order(nbmap, offsets=-1, with_map=False):
    if with_map:
        return nbmap.new_empty((nbmap.shape[0] * (1 + nbmap.shape[1]),))
    return nbmap.new_empty((nbmap.shape[0],))


@torch.library.register_fake("torchsp::tile_steps")
def _tile_steps(nbmap, order, refine=True):
    return nbmap.new_empty((step_plan_len(nbmap.shape[0], nbmap.shape[1]),))


@torch.library.register_fake("torchsp::conv_fwd")
def _conv_fwd(x, weight, nbmap, nbmap_t, fwd_algo, dgrad_algo, wgrad_algo, order=None, order_t=None, segs=(),
              segs_t=()):
    torch._check(x.shape[1] == weight.shape[1], lambda: "torchsp.conv_fwd: channel mismatch")
    return x.new_empty((nbmap.shape[0], weight.shape[2]))


@torch.library.register_fake("torchsp::conv_dgrad")
def _conv_dgrad(dy, weight, nbmap_t, algo, order_t=None, segs_t=()):
    return dy.new_empty((nbmap_t.shape[0], weight.shape[1]))


@torch.library.register_fake("torchsp::conv_wgrad")
def _conv_wgrad(x, dy, nbmap, algo, pairs=None, pair_starts=None):
    return x.new_empty((nbmap.shape[1], x.shape[1], dy.shape[1]))


def _stat_dtype(x):
    """csrc/batch_norm.cpp's dtype of the saved mean and invstd: float32 for fp16 / bf16 on CUDA,
    else x's."""
    if x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return x.dtype


@torch.library.register_fake("torchsp::batch_norm_train")
def _batch_norm_train(x, weight, bias, running_mean, running_var, momentum, eps):
    c, dt = x.shape[1], _stat_dtype(x)
    stats = [torch.empty_like(t) if t is not None else x.new_empty((0,)) for t in (running_mean, running_var)]
    return (torch.empty_like(x), x.new_empty((c,), dtype=dt), x.new_empty((c,), dtype=dt), *stats)


@torch.library.register_fake("torchsp::batch_norm_train_backward")
def _batch_norm_train_backward(grad, x, weight, mean, invstd, eps, mask):
    c = x.shape[1]
    return tuple(x.new_empty(s if m else (0,)) for s, m in zip(((x.shape[0], c), (c,), (c,)), mask))


@torch.library.register_fake("torchsp::batch_norm_stats")
def _batch_norm_stats(x, running_mean, running_var, num_batches_tracked, momentum, eps):
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty((x.shape[1],), dtype=dt), x.new_empty((x.shape[1],), dtype=dt)


@torch.library.register_fake("torchsp::batch_norm_act")
def _batch_norm_act(x, mean, spread, weight, bias, residual, eps, spread_is_var, relu):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("torchsp::batch_norm_act_backward")
def _batch_norm_act_backward(grad, x, mean, invstd, weight, bias, residual, relu, mask):
    """dweight and dbias in the vectors' dtype: weight's, else bias', else x's (csrc/shim_norm_*.cpp)."""
    n, c = x.shape
    pt = weight.dtype if weight is not None else bias.dtype if bias is not None else x.dtype
    return (x.new_empty((n, c) if mask[0] else (0,)), x.new_empty((c,) if mask[1] else (0,), dtype=pt),
            x.new_empty((c,) if mask[2] else (0,), dtype=pt), x.new_empty((n, c) if mask[3] else (0,)))
