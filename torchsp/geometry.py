"""Kernel geometry: argument normalisation, default padding, offsets, key packing.

Offsets follow DESIGN.md section 2: k = (ix * Ky + iy) * Kz + iz (z fastest) and
delta_k = (i * dilation - padding) * t per axis.  Coordinates pack into the
64-bit key of csrc/tsp_key.h (9 bits of batch, 18 bits per axis), so the
Python checks here and the kernels agree on what is representable.
"""

import torch

COORD_MIN = -(1 << 17)
COORD_MAX = (1 << 17) - 1
BATCH_MAX = (1 << 9) - 1


def triple(value, name, minimum=1):
    """Normalise an int or a 3-sequence to a tuple of 3 Python ints >= minimum."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or 3 ints, got {value!r}")
    if isinstance(value, int):
        out = (value, value, value)
    else:
        try:
            out = tuple(int(v) for v in value)
        except TypeError:
            raise TypeError(f"{name} must be an int or 3 ints, got {value!r}") from None
        if len(out) != 3:
            raise ValueError(f"{name} must have 3 entries (x, y, z), got {value!r}")
    if any(v < minimum for v in out):
        raise ValueError(f"{name} entries must be >= {minimum}, got {value!r}")
    return out


def default_padding(kernel_size, dilation):
    """(K - 1) // 2 * d for odd K, 0 for even K (DESIGN.md section 2)."""
    return tuple((k - 1) // 2 * d if k % 2 == 1 else 0 for k, d in zip(kernel_size, dilation))


def volume(kernel_size):
    return kernel_size[0] * kernel_size[1] * kernel_size[2]


def kernel_offsets(kernel_size, dilation, padding, step):
    """[V, 3] list of delta_k in DESIGN.md order (for references and tools)."""
    kx, ky, kz = kernel_size
    out = []
    for ix in range(kx):
        for iy in range(ky):
            for iz in range(kz):
                out.append(tuple((i * d - p) * t for i, d, p, t in
                                 zip((ix, iy, iz), dilation, padding, step)))
    return out


def offset_l1(kernel_size, dilation, padding):
    """L1 norm of each offset in kernel-grid units (Spira's hybrid split)."""
    return [sum(abs(v) for v in d) for d in kernel_offsets(kernel_size, dilation, padding, (1, 1, 1))]


def pack_keys(coords):
    """int64 keys of int32 [N, 4] coordinates (same layout as csrc/tsp_key.h)."""
    c = coords.long()
    bias = 1 << 17
    return (c[:, 0] << 54) | ((c[:, 1] + bias) << 36) | ((c[:, 2] + bias) << 18) | (c[:, 3] + bias)


def unpack_keys(keys):
    """int32 [N, 4] coordinates of int64 keys."""
    bias = 1 << 17
    mask = (1 << 18) - 1
    b = keys >> 54
    x = ((keys >> 36) & mask) - bias
    y = ((keys >> 18) & mask) - bias
    z = (keys & mask) - bias
    return torch.stack([b, x, y, z], dim=1).int()
