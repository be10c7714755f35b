"""Pooling on SparseTensors: local (through kernel maps) and global (per batch item).

Local pooling reuses the convolution's kernel map: output q pools the inputs at
q + delta_k (DESIGN.md section 2) for the offsets k that are occupied, so
`max_pool3d(x, 2, stride=2)` lands on exactly the coordinates (and coord_key)
of `SparseConv3d(C, C', 2, stride=2)(x)`, and a later transposed convolution can
return to x's coordinates. Empty kernel sites are skipped (not zeros), as in
MinkowskiEngine's and spconv's sparse pooling.

Global pooling reduces each batch item's voxels to one row: [N, C] -> [B, C].
"""

import torch
from torch import nn

from ..kmap import get_kernel_map
from ..tensor import SparseTensor
from ._util import check_sparse


def _gather_rows(feats, nbmap, fill):
    """feats [N, C] padded with one row of `fill`, and nbmap [M, V] with -1 pointing at that row."""
    n = feats.shape[0]
    padded = torch.cat([feats, feats.new_full((1, feats.shape[1]), fill)], 0)
    idx = torch.where(nbmap < 0, torch.full_like(nbmap, n), nbmap).long()
    return padded, idx


def _pool(input, kernel_size, stride, padding, dilation, rule, mode, count):
    check_sparse(input, f"torchsp.nn.functional {mode}_pool3d")
    if stride is None:
        stride = kernel_size
    kmap, out_coords, out_stride, out_key = get_kernel_map(input, kernel_size, stride, dilation, padding,
                                                           rule=rule)
    feats = input.feats
    nbmap = kmap.nbmap
    # A cached map may come with freshly recomputed output coordinates; under torch.compile their
    # row counts are distinct unbacked sizes, equal by construction.
    if torch.compiler.is_compiling():
        torch._check(nbmap.shape[0] == out_coords.shape[0])
    v = nbmap.shape[1]
    if mode == "max":
        padded, idx = _gather_rows(feats, nbmap, float("-inf"))
        out = padded[idx[:, 0]]
        for k in range(1, v):
            out = torch.maximum(out, padded[idx[:, k]])
        # A window with no occupied site (a floor-rule output whose dilated offsets miss the
        # inputs floored to it) gives 0, as global_max_pool gives an empty item: not -inf, which
        # a next layer would turn into NaN.
        out = out.masked_fill(~(nbmap >= 0).any(1, keepdim=True), 0)
    else:
        padded, idx = _gather_rows(feats, nbmap, 0.0)
        out = padded[idx[:, 0]]
        for k in range(1, v):
            out = out + padded[idx[:, k]]
        if count == "all":
            out = out / v
        elif count == "present":
            present = (nbmap >= 0).sum(1, keepdim=True).clamp(min=1)
            out = out / present.to(out.dtype)
        elif count != "none":
            raise ValueError(f"avg_pool3d: count must be 'present', 'all' or 'none', got {count!r}")
    return SparseTensor(out, out_coords, out_stride, cache=input.cache, coord_key=out_key, check=False)


def max_pool3d(input, kernel_size, stride=None, padding=None, dilation=1, rule="active"):
    """Max over the occupied sites of each output's kernel window.

    y[q] = max_{k : q + delta_k occupied} x[q + delta_k], or 0 where no site of the window is
    occupied (possible with rule="floor" and a dilated or strided-past kernel).

    Args:
        input: SparseTensor, feats [N, C].
        kernel_size: int or 3-tuple K.
        stride: int or 3-tuple; defaults to kernel_size (as torch.nn.functional.max_pool3d).
            stride 1 keeps the input coordinates (submanifold pooling).
        padding, dilation, rule: as torchsp.functional.sparse_conv3d (padding defaults
            to (K-1)//2*d for odd K, 0 for even K).
    Returns:
        SparseTensor, feats [N_out, C] (input dtype) on the strided conv's output coordinates.
    """
    return _pool(input, kernel_size, stride, padding, dilation, rule, "max", None)


def avg_pool3d(input, kernel_size, stride=None, padding=None, dilation=1, rule="active", count="present"):
    """Average over each output's kernel window.

    Args:
        input, kernel_size, stride, padding, dilation, rule: as max_pool3d.
        count: "present" divides by the number of occupied sites (MinkowskiEngine's
            MinkowskiAvgPooling); "all" divides by the kernel volume V (dense
            F.avg_pool3d of the zero-filled grid, count_include_pad=True);
            "none" returns the sum (MinkowskiSumPooling).
    Returns:
        SparseTensor, feats [N_out, C] (input dtype).
    """
    return _pool(input, kernel_size, stride, padding, dilation, rule, "avg", count)


def _batch_index(input, batch_size):
    batch = input.coords[:, 0].long()
    if batch_size is None:
        counts = torch.bincount(batch)
    else:
        counts = torch.zeros(int(batch_size), dtype=torch.long, device=batch.device)
        counts = counts.index_add(0, batch, torch.ones_like(batch))
    return batch, counts


def global_avg_pool(input, batch_size=None):
    """Mean of each batch item's feats.

    Args:
        input: SparseTensor, feats [N, C]; coords[:, 0] is the batch index.
        batch_size: B. None: max batch index + 1, read from the data (fine in eager mode and
            under torch.jit.trace; pass an int under torch.compile(fullgraph=True)).
    Returns:
        [B, C] dense tensor in input's dtype (sums in float32 for fp16/bf16); zeros for
        items with no voxels.
    """
    check_sparse(input, "global_avg_pool")
    batch, counts = _batch_index(input, batch_size)
    feats = input.feats
    acc = torch.float64 if feats.dtype == torch.float64 else torch.float32
    sums = torch.zeros(counts.shape[0], feats.shape[1], dtype=acc, device=feats.device)
    sums = sums.index_add(0, batch, feats.to(acc))
    return (sums / counts.clamp(min=1).unsqueeze(1).to(acc)).to(feats.dtype)


def global_max_pool(input, batch_size=None):
    """Channel-wise max of each batch item's feats.

    Args: as global_avg_pool.
    Returns:
        [B, C] dense tensor in input's dtype; zeros for items with no voxels.
    """
    check_sparse(input, "global_max_pool")
    batch, counts = _batch_index(input, batch_size)
    feats = input.feats
    out = feats.new_full((counts.shape[0], feats.shape[1]), float("-inf"))
    out = out.scatter_reduce(0, batch.unsqueeze(1).expand(-1, feats.shape[1]), feats, "amax", include_self=True)
    return torch.where((counts > 0).unsqueeze(1), out, torch.zeros_like(out))


class MaxPool3d(nn.Module):
    """Sparse max pooling (see max_pool3d). feats [N, C] -> [N_out, C]."""

    def __init__(self, kernel_size, stride=None, padding=None, dilation=1, rule="active"):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.rule = dilation, rule

    def forward(self, input):
        return max_pool3d(input, self.kernel_size, self.stride, self.padding, self.dilation, self.rule)


class AvgPool3d(nn.Module):
    """Sparse average pooling (see avg_pool3d). feats [N, C] -> [N_out, C]."""

    def __init__(self, kernel_size, stride=None, padding=None, dilation=1, rule="active", count="present"):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.rule, self.count = dilation, rule, count

    def forward(self, input):
        return avg_pool3d(input, self.kernel_size, self.stride, self.padding, self.dilation, self.rule,
                          self.count)


class GlobalAvgPool(nn.Module):
    """Per-batch-item mean: SparseTensor feats [N, C] -> dense [B, C] (see global_avg_pool)."""

    def __init__(self, batch_size=None):
        super().__init__()
        self.batch_size = batch_size

    def forward(self, input):
        return global_avg_pool(input, self.batch_size)


class GlobalMaxPool(nn.Module):
    """Per-batch-item max: SparseTensor feats [N, C] -> dense [B, C] (see global_max_pool)."""

    def __init__(self, batch_size=None):
        super().__init__()
        self.batch_size = batch_size

    def forward(self, input):
        return global_max_pool(input, self.batch_size)
