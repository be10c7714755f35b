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

from .._tracing import compiling
from ._batch_norm import batch_norm_traced
from ._util import NUM_BATCH_SLOTS, check_sparse


class BatchNorm(nn.Module):
    """Batch normalisation of feats [N, C] over the N active voxels.

    Args: as nn.BatchNorm1d (num_features, eps=1e-5, momentum=0.1, affine=True,
        track_running_stats=True). OpenPCDet backbones use eps=1e-3, momentum=0.01.
    Attributes:
        bn: the nn.BatchNorm1d (or, after convert_sync_batchnorm, nn.SyncBatchNorm) applied to feats.
    Shapes: input feats [N, C] -> output feats [N, C] (same dtype), same coordinates.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 device=None, dtype=None):
        super().__init__()
        self.bn = nn.BatchNorm1d(num_features, eps=eps, momentum=momentum, affine=affine,
                                 track_running_stats=track_running_stats, device=device, dtype=dtype)

    def forward(self, input):
        check_sparse(input, "torchsp.nn.BatchNorm")
        # Traced (dynamo, or any fake-tensor tracer on a symbolic row count, as non-strict export on
        # a torch whose export does not say it is compiling); SyncBatchNorm (no BatchNorm1d) and
        # subclasses with their own forward keep their path.  Not `type(bn) is nn.BatchNorm1d`:
        # torch 2.4's non-strict export calls submodules through subclasses of their own class.
        # The tracing test first: an eager call (the common one) then skips the module checks.
        if ((compiling() or isinstance(input.feats.shape[0], torch.SymInt))
                and isinstance(self.bn, nn.BatchNorm1d) and type(self.bn).forward is nn.BatchNorm1d.forward):
            return input.replace(batch_norm_traced(self.bn, input.feats))
        return input.replace(self.bn(input.feats))


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
