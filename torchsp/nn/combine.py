"""Combining SparseTensors that share coordinates: channel concatenation and residual add.

Both need the operands on the same coordinate set in the same row order. A
transposed convolution returns exactly the finer tensor's coordinates and
coord_key (DESIGN.md section 3), so a U-Net's skip connection passes the check
for free; tensors built separately are compared element-wise in eager mode.
"""

import torch

from ._util import check_same_coords, check_sparse


def cat(inputs):
    """Concatenate feats along channels.

    Args:
        inputs: sequence of SparseTensors on the same coordinates, feats [N, C_i] of one dtype.
    Returns:
        SparseTensor on the first input's coordinates, feats [N, sum C_i].
    """
    inputs = list(inputs)
    if len(inputs) == 0:
        raise ValueError("torchsp.nn.cat: inputs is empty")
    first = inputs[0]
    check_sparse(first, "torchsp.nn.cat")
    for i, x in enumerate(inputs[1:], 1):
        check_sparse(x, "torchsp.nn.cat")
        check_same_coords(first, x, f"torchsp.nn.cat (input 0 vs input {i})")
    return first.replace(torch.cat([x.feats for x in inputs], dim=1))


def add(a, b):
    """Residual add of two SparseTensors on the same coordinates.

    Args:
        a, b: SparseTensors, feats [N, C] each.
    Returns:
        SparseTensor on a's coordinates, feats a.feats + b.feats [N, C].
    """
    check_sparse(a, "torchsp.nn.add")
    check_sparse(b, "torchsp.nn.add")
    check_same_coords(a, b, "torchsp.nn.add")
    if a.feats.shape != b.feats.shape:
        raise ValueError(f"torchsp.nn.add: feats shapes differ ({tuple(a.feats.shape)} vs {tuple(b.feats.shape)})")
    return a.replace(a.feats + b.feats)
