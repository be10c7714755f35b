"""Converting convolution weights from spconv, TorchSparse and MinkowskiEngine to torchsp.

torchsp's weight is [V, Cin, Cout] with offset index k = (ix * Ky + iy) * Kz + iz
(z fastest) and offset delta_k = (i * d - p) * t per axis (DESIGN.md section 2);
in dense terms weight[k] = W[:, :, ix, iy, iz].T for an F.conv3d weight
W [Cout, Cin, Kx, Ky, Kz] with the same padding. What each library stores, read
from its source:

spconv (1.x and 2.x; follows the dense convolution):
    2.x: [Cout, K0, K1, K2, Cin]; 1.x: [K0, K1, K2, Cin, Cout]; axis a of the kernel is
    column a + 1 of the indices, and padding is explicit (SubMConv3d: (K-1)//2).
    OpenPCDet / CenterPoint / mmdet3d index (batch, z, y, x): pass axis_order="zyx" and
    use padding and kernel tuples reversed, as torchsp.models.SparseResNet21D does.

TorchSparse (1.4 - 2.1, torchsparse/nn/utils/kernel.py and the hashmap lookup kernel):
    [V, Cin, Cout] ([Cin, Cout] when V == 1). Per axis the offsets are
    (i - (K - 1) // 2) * d, i = 0..K-1, so the matching torchsp padding is
    (K - 1) // 2 * d: the default for odd K and for K = 2, but 1 for K = 4
    (see torchsparse_padding). Offset order depends on the kernel *volume*: odd
    volume enumerates x fastest (k = (iz * Ky + iy) * Kx + ix); even volume
    enumerates z fastest, like torchsp.

MinkowskiEngine (0.5, src/kernel_region.hpp, HYPER_CUBE region):
    [V, Cin, Cout], x fastest for every kernel (axis 0 varies fastest). Offsets are
    (i - K // 2) * d for odd K and i * d for even K: torchsp's default padding.

Every converter returns a contiguous [V, Cin, Cout] tensor in torchsp order with
the input's dtype and device; the layer's kernel_size is that of the source
layer (reversed for axis_order="zyx").
"""

import torch

from .geometry import triple


def _from_axes(w, kernel_size, order):
    """w [V, Cin, Cout] with its V axis enumerating kernel axes `order` (slowest first) -> torchsp order."""
    kx, ky, kz = kernel_size
    sizes = {"x": kx, "y": ky, "z": kz}
    cin, cout = w.shape[-2], w.shape[-1]
    w = w.reshape(*(sizes[a] for a in order), cin, cout)
    perm = [order.index(a) for a in "xyz"] + [3, 4]
    return w.permute(*perm).reshape(kx * ky * kz, cin, cout).contiguous()


def from_dense(weight):
    """F.conv3d weight [Cout, Cin, Kx, Ky, Kz] -> torchsp [V, Cin, Cout].

    With the same padding, dilation and stride, the sparse conv equals the dense one
    read at the output sites. (F.conv_transpose3d weights are [Cin, Cout, K...]:
    use from_dense(w.transpose(0, 1)) for a transposed layer.)
    """
    if weight.dim() != 5:
        raise ValueError(f"from_dense: weight must be [Cout, Cin, Kx, Ky, Kz], got {tuple(weight.shape)}")
    cout, cin = weight.shape[:2]
    return weight.permute(2, 3, 4, 1, 0).reshape(-1, cin, cout).contiguous()


def to_dense(weight, kernel_size):
    """torchsp [V, Cin, Cout] -> F.conv3d weight [Cout, Cin, Kx, Ky, Kz] (inverse of from_dense)."""
    kx, ky, kz = triple(kernel_size, "kernel_size")
    v, cin, cout = weight.shape
    if v != kx * ky * kz:
        raise ValueError(f"to_dense: weight has {v} offsets but kernel_size {(kx, ky, kz)} has {kx * ky * kz}")
    return weight.reshape(kx, ky, kz, cin, cout).permute(4, 3, 0, 1, 2).contiguous()


def from_spconv(weight, version=2, axis_order="xyz"):
    """spconv SubMConv3d / SparseConv3d / SparseInverseConv3d weight -> torchsp [V, Cin, Cout].

    Args:
        weight: spconv 2.x [Cout, K0, K1, K2, Cin] or spconv 1.x [K0, K1, K2, Cin, Cout].
        version: 2 or 1 (the layout above).
        axis_order: "xyz" if the spconv indices were (batch, x, y, z); "zyx" for
            (batch, z, y, x) (OpenPCDet, CenterPoint, mmdet3d): the kernel axes are
            reversed, and the torchsp layer's kernel_size is (K2, K1, K0).
    Returns:
        [V, Cin, Cout], V = K0 * K1 * K2, torchsp offset order.
    """
    if weight.dim() != 5:
        raise ValueError(f"from_spconv: weight must be 5-D, got {tuple(weight.shape)}")
    if version == 2:
        w = weight.permute(1, 2, 3, 4, 0)  # [K0, K1, K2, Cin, Cout]
    elif version == 1:
        w = weight
    else:
        raise ValueError(f"from_spconv: version must be 1 or 2, got {version!r}")
    if axis_order == "zyx":
        w = w.permute(2, 1, 0, 3, 4)
    elif axis_order != "xyz":
        raise ValueError(f"from_spconv: axis_order must be 'xyz' or 'zyx', got {axis_order!r}")
    k0, k1, k2, cin, cout = w.shape
    return w.reshape(k0 * k1 * k2, cin, cout).contiguous()


def to_spconv(weight, kernel_size, version=2, axis_order="xyz"):
    """torchsp [V, Cin, Cout] -> spconv layout (inverse of from_spconv); kernel_size in torchsp (x, y, z) order."""
    kx, ky, kz = triple(kernel_size, "kernel_size")
    v, cin, cout = weight.shape
    w = weight.reshape(kx, ky, kz, cin, cout)
    if axis_order == "zyx":
        w = w.permute(2, 1, 0, 3, 4)
    if version == 2:
        w = w.permute(4, 0, 1, 2, 3)
    return w.contiguous()


def torchsparse_padding(kernel_size, dilation=1):
    """The torchsp padding that reproduces TorchSparse's offsets: (K - 1) // 2 * d per axis."""
    ks = triple(kernel_size, "kernel_size")
    d = triple(dilation, "dilation")
    return tuple((k - 1) // 2 * di for k, di in zip(ks, d))


def from_torchsparse(weight, kernel_size):
    """TorchSparse Conv3d.kernel -> torchsp [V, Cin, Cout].

    Args:
        weight: [V, Cin, Cout], or [Cin, Cout] for a 1x1x1 kernel.
        kernel_size: the TorchSparse layer's kernel_size (int or (Kx, Ky, Kz)).
    Returns:
        [V, Cin, Cout] in torchsp order. Build the torchsp layer with
        padding=torchsparse_padding(kernel_size, dilation) (differs from the default only for even K >= 4).
    """
    ks = triple(kernel_size, "kernel_size")
    v = ks[0] * ks[1] * ks[2]
    if weight.dim() == 2:
        weight = weight.unsqueeze(0)
    if weight.dim() != 3 or weight.shape[0] != v:
        raise ValueError(f"from_torchsparse: weight must be [{v}, Cin, Cout] for kernel_size {ks}, "
                         f"got {tuple(weight.shape)}")
    order = "zyx" if v % 2 == 1 else "xyz"
    return _from_axes(weight, ks, order)


def from_minkowski(weight, kernel_size):
    """MinkowskiEngine MinkowskiConvolution(.kernel) -> torchsp [V, Cin, Cout].

    Args:
        weight: [V, Cin, Cout] (HYPER_CUBE region; x varies fastest).
        kernel_size: the layer's kernel_size (int or (Kx, Ky, Kz)).
    Returns:
        [V, Cin, Cout] in torchsp order; torchsp's default padding matches ME's offsets.
    """
    ks = triple(kernel_size, "kernel_size")
    v = ks[0] * ks[1] * ks[2]
    if weight.dim() == 2 and v == 1:
        weight = weight.unsqueeze(0)
    if weight.dim() != 3 or weight.shape[0] != v:
        raise ValueError(f"from_minkowski: weight must be [{v}, Cin, Cout] for kernel_size {ks}, "
                         f"got {tuple(weight.shape)}")
    return _from_axes(weight, ks, "zyx")
