"""Normalisation layers on SparseTensors.

BatchNorm normalises each channel over all active voxels of the batch (what
spconv, TorchSparse and MinkowskiEngine do: nn.BatchNorm1d on feats [N, C]).
It wraps an nn.BatchNorm1d child named `bn`, so
`torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)` swaps that child for a
SyncBatchNorm and the layer keeps taking SparseTensors.

GroupNorm normalises each (batch item, channel group) over the item's active
voxels: the dense nn.GroupNorm of a [B, C, X, Y, Z] grid restricted to its
active sites (TorchSparse's spnn.GroupNorm semantics, computed here without a
Python loop over batch items). A plain nn.GroupNorm applied to feats [N, C]
would instead normalise each voxel's channels on their own; that is what you
get by putting an nn.GroupNorm in torchsp.nn.Sequential.

Under torch.compile and torch.export, BatchNorm goes through
torchsp.nn._batch_norm (why: there).
"""

import torch
from torch import nn

from .. import _C
from .._autograd import _functorch_active
from .._tracing import compiling
from ._batch_norm import batch_norm_traced
from ._util import NUM_BATCH_SLOTS, check_same_coords, check_sparse
from .activation import ReLU
from .combine import add


_hooks = nn.modules.module
_FUSED_CUDA = (torch.float16, torch.bfloat16, torch.float32)
_RELUS = (ReLU, nn.ReLU)


def _fusable(bn, x):
    """True when `bn` (an nn.BatchNorm1d child) on feats x runs torchsp's fused kernels
    (torchsp._C.batch_norm_train / batch_norm_eval; csrc/eager_norm.cpp): an eager call on a plain
    CUDA tensor, an exact nn.BatchNorm1d without hooks (SyncBatchNorm and subclasses keep their own
    forward), a dtype the kernels take, and per-channel vectors all of one dtype, x's or float32.
    CPU tensors keep torch's kernels: the C kernels behind the ops' CPU implementation (float64
    arithmetic, one thread a chunk of rows) serve as their reference and took 0.5-6x torch's
    time on a 2-core host (tools/bench_norm.py --device cpu, 7560 rows, C = 8 and 32).
    The module's tensors are read from its _parameters and _buffers dicts: nn.Module.__getattr__
    took ~1 us a name on a 2-core x86 host, ~5 us for the four here, on every norm call."""
    if type(bn) is not nn.BatchNorm1d or type(x) is not torch.Tensor or not x.is_cuda:
        return False
    if x.dtype not in _FUSED_CUDA or _functorch_active():
        return False
    if not hook_free(bn):
        return False
    p, s = bn._parameters, bn._buffers
    first = None
    for t in (p.get("weight"), p.get("bias"), s.get("running_mean"), s.get("running_var")):
        if t is None:
            continue
        if first is None:
            first = t.dtype
            if first is not x.dtype and first is not torch.float32:
                return False
        elif t.dtype is not first:
            return False
    return True


def _fused_batch_norm(bn, x, relu, residual=None):
    """relu?(bn(x) + residual) through torchsp's fused kernels, bn(x) as nn.BatchNorm1d.forward
    computes it (its momentum, num_batches_tracked and running-statistics rules), or None where
    that path does not apply: eval with running statistics while a gradient is wanted (the eval
    kernel has no backward).  x [N, C], residual None or [N, C] of x's dtype -> [N, C], x's dtype."""
    p, s = bn._parameters, bn._buffers
    w, b = p.get("weight"), p.get("bias")
    rm, rv = s.get("running_mean"), s.get("running_var")
    if not bn.training and rm is not None and rv is not None:  # eval: the running statistics
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, b, residual)):
            return None
        return _C.batch_norm_eval(x, w, b, residual, rm, rv, float(bn.eps), relu)
    if x.shape[0] == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
    # F.batch_norm's rules: the running statistics are updated in training with track_running_stats only
    stats = bn.training and bn.track_running_stats
    factor = 0.0 if bn.momentum is None else float(bn.momentum)
    batches = s.get("num_batches_tracked") if stats else None
    if batches is not None and bn.momentum is None:
        # cumulative average: the factor needs the count on the host (a sync, as torch's)
        batches.add_(1)
        factor = 1.0 / float(batches)
        batches = None
    # else the statistics kernel increments num_batches_tracked
    return _C.batch_norm_train(x, w, b, residual, rm if stats else None, rv if stats else None, batches, factor,
                               float(bn.eps), relu)


class BatchNorm(nn.Module):
    """Batch normalisation of feats [N, C] over the N active voxels.

    Args: as nn.BatchNorm1d (num_features, eps=1e-5, momentum=0.1, affine=True,
        track_running_stats=True). OpenPCDet backbones use eps=1e-3, momentum=0.01.
    Attributes:
        bn: the nn.BatchNorm1d (or, after convert_sync_batchnorm, nn.SyncBatchNorm) applied to feats.
    Shapes: input feats [N, C] -> output feats [N, C] (same dtype), same coordinates.

    Eager CUDA calls run torchsp's fused kernels (csrc/cuda/batch_norm_act.cu): the statistics in
    one pass over feats, the normalisation in one more, the backward in two, each close to the
    copy rate, where torch's take several times their bytes' time; the results are bn(feats)'s
    up to rounding (statistics in fp32 with fp64 across blocks).  forward_relu adds the ReLU
    after the norm in the same passes; torchsp.nn.Sequential uses it for a BatchNorm followed
    by a ReLU.  The bn child's own kernels run instead for CPU tensors, SyncBatchNorm, a bn with
    hooks, float64, mixed per-channel dtypes, and eval-mode calls that need a gradient.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 device=None, dtype=None):
        super().__init__()
        self.bn = nn.BatchNorm1d(num_features, eps=eps, momentum=momentum, affine=affine,
                                 track_running_stats=track_running_stats, device=device, dtype=dtype)

    def forward(self, input):
        check_sparse(input, "torchsp.nn.BatchNorm")
        return input.replace(self._norm(input.feats, False))

    def forward_relu(self, input):
        """relu(self(input)) in the norm's passes where the fused kernels apply (else the two
        in turn).  SparseTensor feats [N, C] -> feats [N, C], same coordinates."""
        check_sparse(input, "torchsp.nn.BatchNorm")
        return input.replace(self._norm(input.feats, True))

    def forward_add_relu(self, input, residual):
        """relu(self(input) + residual), a residual block's tail, in the norm's passes where the
        fused kernels apply (else in turn, as relu(torchsp.nn.add(self(input), residual))).
        input, residual: SparseTensors on the same coordinates, feats [N, C] of one dtype.
        Returns feats [N, C] on input's coordinates."""
        check_sparse(input, "torchsp.nn.BatchNorm")
        check_sparse(residual, "torchsp.nn.BatchNorm (residual)")
        check_same_coords(input, residual, "torchsp.nn.BatchNorm.forward_add_relu")
        r = residual.feats
        if r.shape != input.feats.shape or r.dtype != input.feats.dtype:
            raise ValueError(f"torchsp.nn.BatchNorm.forward_add_relu: residual feats {tuple(r.shape)} {r.dtype} do "
                             f"not match input feats {tuple(input.feats.shape)} {input.feats.dtype}")
        return input.replace(self._norm(input.feats, True, r))

    def _norm(self, feats, relu, residual=None):
        # Traced (dynamo, or any fake-tensor tracer on a symbolic row count, as non-strict export on
        # a torch whose export does not say it is compiling); SyncBatchNorm (no BatchNorm1d) and
        # subclasses with their own forward keep their path.  Not `type(bn) is nn.BatchNorm1d`:
        # torch 2.4's non-strict export calls submodules through subclasses of their own class.
        # The tracing test first: an eager call (the common one) then skips the module checks.
        if compiling() or isinstance(feats.shape[0], torch.SymInt):
            if isinstance(self.bn, nn.BatchNorm1d) and type(self.bn).forward is nn.BatchNorm1d.forward:
                y = batch_norm_traced(self.bn, feats)
            else:
                y = self.bn(feats)
            return _add_relu(y, residual, relu)
        if _fusable(self.bn, feats):
            y = _fused_batch_norm(self.bn, feats, relu, residual)
            if y is not None:
                return y
        return _add_relu(self.bn(feats), residual, relu)


def _add_relu(y, residual, relu):
    y = y + residual if residual is not None else y
    return torch.relu(y) if relu else y


def hook_free(*modules):
    """True when none of `modules` has forward hooks and no global module hooks are set: then a
    fused call may skip their __call__ (which would run the hooks)."""
    return (not _hooks._global_forward_hooks and not _hooks._global_forward_pre_hooks
            and not any(m._forward_hooks or m._forward_pre_hooks for m in modules))


def fuses_relu(norm, relu):
    """True when relu(norm(x)) may run as norm.forward_relu(x) (or with a residual as
    norm.forward_add_relu): `norm` is a torchsp BatchNorm and `relu` an exact ReLU (torchsp's or
    torch's), and hook_free(norm, relu)."""
    return type(norm) is BatchNorm and type(relu) in _RELUS and hook_free(norm, relu)


def bn_relu(norm, relu, x):
    """relu(norm(x)) for SparseTensor x, fused where fuses_relu allows."""
    return norm.forward_relu(x) if fuses_relu(norm, relu) else relu(norm(x))


def bn_add_relu(norm, relu, x, residual):
    """relu(torchsp.nn.add(norm(x), residual)) for SparseTensors on the same coordinates, fused where
    fuses_relu allows."""
    if fuses_relu(norm, relu):
        return norm.forward_add_relu(x, residual)
    return relu(add(norm(x), residual))


SparseBatchNorm = BatchNorm


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """Per-batch-item group normalisation of a SparseTensor.

    For every batch item b and group g of C // num_groups channels, the mean and
    variance are taken over all active voxels of item b and all channels of g.

    Args:
        input: SparseTensor, feats [N, C] float; coords[:, 0] is the batch index.
        num_groups: G, dividing C.
        weight, bias: optional per-channel affine [C].
        eps: added to the variance.
    Returns:
        SparseTensor on the same coordinates, feats [N, C] in input's dtype
        (statistics in float32 for fp16/bf16 inputs).
    """
    feats = input.feats
    n, c = feats.shape
    if c % num_groups != 0:
        raise ValueError(f"group_norm: {c} channels are not divisible by num_groups={num_groups}")
    acc = torch.float64 if feats.dtype == torch.float64 else torch.float32
    x = feats.to(acc).reshape(n, num_groups, c // num_groups)
    batch = input.coords[:, 0].long()
    group_size = c // num_groups
    count = torch.zeros(NUM_BATCH_SLOTS, dtype=acc, device=feats.device)
    count = count.index_add(0, batch, torch.ones_like(batch, dtype=acc)) * group_size
    count = count.clamp(min=1).unsqueeze(1)
    total = torch.zeros(NUM_BATCH_SLOTS, num_groups, dtype=acc, device=feats.device)
    mean = total.index_add(0, batch, x.sum(2)) / count
    centred = x - mean[batch].unsqueeze(2)
    var = total.index_add(0, batch, (centred * centred).sum(2)) / count
    y = centred * torch.rsqrt(var[batch] + eps).unsqueeze(2)
    y = y.reshape(n, c)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return input.replace(y.to(feats.dtype))


class GroupNorm(nn.GroupNorm):
    """Group normalisation per batch item over its active voxels (see group_norm).

    Args: as nn.GroupNorm (num_groups, num_channels, eps=1e-5, affine=True).
    Shapes: input feats [N, C] -> output feats [N, C], same coordinates.
    """

    def forward(self, input):
        check_sparse(input, "torchsp.nn.GroupNorm")
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)
