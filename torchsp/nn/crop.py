"""Cropping a SparseTensor to a box (spconv-style bounded outputs)."""

import torch

from ..tensor import SparseTensor
from ._util import check_sparse


def crop(input, lower, upper):
    """Keep the voxels with lower <= (x, y, z) < upper (full-resolution coordinates).

    spconv bounds every strided output by the dense grid's spatial_shape, torchsp's
    active-set rule does not (DESIGN.md section 3); cropping after a strided conv to
    [0, out_shape * stride) reproduces spconv's coordinate set exactly.

    Args:
        input: SparseTensor, feats [N, C].
        lower, upper: 3 ints each.
    Returns:
        SparseTensor with the kept rows in their original order (feats [M, C],
        coords [M, 4]), sharing input's cache under a new coord_key. Eager only:
        the row count depends on the data.
    """
    check_sparse(input, "crop")
    lower, upper = tuple(int(v) for v in lower), tuple(int(v) for v in upper)
    xyz = input.coords[:, 1:]
    lo = torch.tensor(lower, dtype=xyz.dtype, device=xyz.device)
    hi = torch.tensor(upper, dtype=xyz.dtype, device=xyz.device)
    keep = ((xyz >= lo) & (xyz < hi)).all(1)
    rows = keep.nonzero().squeeze(1)
    key = ("crop", input.coord_key, lower, upper)
    return SparseTensor(input.feats[rows], input.coords[rows], input.stride, cache=input.cache,
                        coord_key=key, check=False)
