"""A slow, pure-PyTorch sparse convolution: the reference the demo checks against.

Nothing here calls torch.ops.torchsp: output coordinates, kernel maps and the
convolution are computed with sort/searchsorted and dense matmuls in float64,
straight from DESIGN.md sections 2-3.  Use it to check a model on your own data
(`reference_conv3d` mirrors `torchsp.functional.sparse_conv3d`).
"""

import torch

from .geometry import COORD_MAX, COORD_MIN, default_padding, kernel_offsets, pack_keys, triple


def _packable(c):
    return ((c[..., 1:] >= COORD_MIN) & (c[..., 1:] <= COORD_MAX)).all(-1)


def reference_kernel_map(in_coords, out_coords, offsets, sign):
    """int64 [N_out, V]: row of in_coords at out_coords[q] + sign * offsets[k], or -1."""
    keys = pack_keys(in_coords)
    order = torch.argsort(keys)
    sorted_keys = keys[order]
    out = torch.full((out_coords.shape[0], len(offsets)), -1, dtype=torch.long, device=in_coords.device)
    for k, d in enumerate(offsets):
        q = out_coords.long().clone()
        q[:, 1:] += sign * torch.tensor(d, device=q.device)
        ok = _packable(q)
        qk = pack_keys(q.clamp(COORD_MIN, COORD_MAX))
        pos = torch.searchsorted(sorted_keys, qk).clamp(max=max(len(sorted_keys) - 1, 0))
        if len(sorted_keys) == 0:
            continue
        hit = ok & (sorted_keys[pos] == qk)
        out[hit, k] = order[pos[hit]]
    return out


def reference_out_coords(coords, offsets, sign, lattice, floor_rule=False):
    """Sorted unique coordinates q = p - sign*delta_k on `lattice` (or the floor rule)."""
    lat = torch.tensor(lattice, device=coords.device)
    c = coords.long()
    if floor_rule:
        cand = torch.cat([c[:, :1], torch.div(c[:, 1:], lat, rounding_mode="floor") * lat], 1)
    else:
        d = torch.tensor(offsets, device=coords.device)
        cand = c[:, None, :].repeat(1, len(offsets), 1)
        cand[:, :, 1:] -= sign * d[None]
        cand = cand.reshape(-1, 4)
        cand = cand[(torch.remainder(cand[:, 1:], lat) == 0).all(1)]
    keys = torch.unique(pack_keys(cand), sorted=True)
    bias, mask = 1 << 17, (1 << 18) - 1
    return torch.stack([keys >> 54, ((keys >> 36) & mask) - bias, ((keys >> 18) & mask) - bias,
                        (keys & mask) - bias], 1).int()


def reference_conv3d(feats, coords, in_stride, weight, kernel_size, stride=1, padding=None, dilation=1,
                     transposed=False, generative=False, rule="active", finer_coords=None):
    """Float64 sparse conv.  Returns (out_feats [N_out, Cout] float64, out_coords, out_stride).

    finer_coords: the output coordinates of a non-generative transposed conv (the tensor that was
    downsampled); ignored otherwise.
    """
    K, s, d = triple(kernel_size, "kernel_size"), triple(stride, "stride"), triple(dilation, "dilation")
    p = default_padding(K, d) if padding is None else triple(padding, "padding", 0)
    t = triple(in_stride, "in_stride")
    if transposed:
        out_stride = tuple(a // b for a, b in zip(t, s))
        sign, step = -1, out_stride
    else:
        out_stride = tuple(a * b for a, b in zip(t, s))
        sign, step = 1, t
    offsets = kernel_offsets(K, d, p, step)
    if s == (1, 1, 1) and not generative:
        out_coords = coords
    elif transposed and not generative:
        if finer_coords is None:
            raise ValueError("reference_conv3d: transposed conv needs finer_coords")
        out_coords = finer_coords
    else:
        out_coords = reference_out_coords(coords, offsets, sign, out_stride, rule == "floor" and not transposed)
    nbmap = reference_kernel_map(coords, out_coords, offsets, sign)
    x = feats.double()
    w = weight.double()
    y = torch.zeros(out_coords.shape[0], w.shape[2], dtype=torch.float64, device=feats.device)
    for k in range(len(offsets)):
        rows = (nbmap[:, k] >= 0).nonzero().flatten()
        if rows.numel():
            y[rows] += x[nbmap[rows, k]] @ w[k]
    return y, out_coords, out_stride
