"""Checkpoint converters (torchsp.convert): a weight in another library's layout, converted,
must make a torchsp layer equal to the dense F.conv3d that the source layer computes.

Each test builds a dense weight W [Cout, Cin, Kx, Ky, Kz], writes it in the source
library's layout following that library's published offset rule (encoders below,
written from the rules quoted in torchsp/convert.py), converts it back, and compares
the sparse layer against F.conv3d on the zero-filled grid read at the output sites.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

import torchsp
from torchsp import convert

MARGIN, SPAN = 4, 7
GRID = SPAN + 2 * MARGIN


def make_input(cin=3, n=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    xyz = torch.randint(MARGIN, MARGIN + SPAN, (n, 3), generator=g)
    b = torch.randint(0, 2, (n, 1), generator=g)
    coords = torch.unique(torch.cat([b, xyz], 1), dim=0).int()
    return torchsp.SparseTensor(torch.randn(coords.shape[0], cin, generator=g, dtype=torch.float64), coords)


def dense_reference(x, w, padding, stride=1):
    """F.conv3d of x's zero-filled grid with W, input padded (p, K-1-p) per axis, read at stride-s sites."""
    c = x.coords.long()
    grid = torch.zeros(2, x.feats.shape[1], GRID, GRID, GRID, dtype=x.feats.dtype)
    grid[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]] = x.feats
    ks = w.shape[2:]
    pads = []
    for k, p in reversed(list(zip(ks, padding))):
        pads += [p, k - 1 - p]
    return F.conv3d(F.pad(grid, pads), w, stride=stride)


def run_layer(x, weight, kernel_size, padding=None, stride=1):
    cin, cout = weight.shape[1:]
    layer = torchsp.nn.SparseConv3d(cin, cout, kernel_size, stride=stride, padding=padding).double()
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer(x)


def compare(x, y, w, padding, stride=1):
    dense = dense_reference(x, w, padding, stride)
    c = y.coords.long()
    torch.testing.assert_close(y.feats, dense[c[:, 0], :, c[:, 1] // stride, c[:, 2] // stride, c[:, 3] // stride])


def dense_weight(kernel_size, cin=3, cout=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cout, cin, *kernel_size, generator=g, dtype=torch.float64)


# --- encoders: write W in each library's layout, from its published offset rule

def encode_offsets(w, offsets, padding):
    """[V, Cin, Cout] with row k = W[:, :, offset_k + padding].T (offset in kernel units)."""
    return torch.stack([w[:, :, o[0] + padding[0], o[1] + padding[1], o[2] + padding[2]].t() for o in offsets])


def torchsparse_layout(w):
    ks = w.shape[2:]
    axes = [[i - (k - 1) // 2 for i in range(k)] for k in ks]
    if (ks[0] * ks[1] * ks[2]) % 2 == 1:  # odd volume: x fastest
        offsets = [(x, y, z) for z in axes[2] for y in axes[1] for x in axes[0]]
    else:                                 # even volume: z fastest
        offsets = [(x, y, z) for x in axes[0] for y in axes[1] for z in axes[2]]
    pad = [(k - 1) // 2 for k in ks]
    out = encode_offsets(w, offsets, pad)
    return out[0] if out.shape[0] == 1 else out  # TorchSparse stores 1x1x1 kernels as [Cin, Cout]


def minkowski_layout(w):
    ks = w.shape[2:]
    axes = [[i - k // 2 if k % 2 else i for i in range(k)] for k in ks]
    offsets = [(x, y, z) for z in axes[2] for y in axes[1] for x in axes[0]]  # x fastest
    pad = [k // 2 if k % 2 else 0 for k in ks]
    return encode_offsets(w, offsets, pad)


KERNELS = [(3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 3), (3, 2, 1), (2, 3, 3)]


def default_padding(ks):
    return [(k - 1) // 2 if k % 2 else 0 for k in ks]


def test_dense_roundtrip_and_layer():
    x = make_input()
    w = dense_weight((3, 2, 1))
    ours = convert.from_dense(w)
    assert torch.equal(convert.to_dense(ours, (3, 2, 1)), w)
    compare(x, run_layer(x, ours, (3, 2, 1)), w, default_padding((3, 2, 1)))


@pytest.mark.parametrize("ks", KERNELS)
@pytest.mark.parametrize("version", [1, 2])
def test_spconv_xyz(ks, version):
    x = make_input()
    w = dense_weight(ks)
    src = w.permute(0, 2, 3, 4, 1) if version == 2 else w.permute(2, 3, 4, 1, 0)
    ours = convert.from_spconv(src, version=version)
    assert torch.equal(convert.to_spconv(ours, ks, version=version), src)
    compare(x, run_layer(x, ours, ks), w, default_padding(ks))


def test_spconv_zyx_openpcdet_order():
    """A spconv layer on (b, z, y, x) indices with kernel (Kz, Ky, Kx) = (3, 1, 1), as OpenPCDet's conv_out."""
    x = make_input()
    w_xyz = dense_weight((1, 1, 3))                # the same conv seen in (x, y, z)
    src = w_xyz.permute(0, 4, 3, 2, 1)             # spconv 2.x [Cout, Kz, Ky, Kx, Cin]
    ours = convert.from_spconv(src, axis_order="zyx")
    assert torch.equal(convert.to_spconv(ours, (1, 1, 3), axis_order="zyx"), src)
    compare(x, run_layer(x, ours, (1, 1, 3)), w_xyz, (0, 0, 1))


def test_spconv_strided():
    x = make_input()
    w = dense_weight((3, 3, 3))
    ours = convert.from_spconv(w.permute(0, 2, 3, 4, 1))
    y = run_layer(x, ours, 3, padding=1, stride=2)
    compare(x, y, w, (1, 1, 1), stride=2)


@pytest.mark.parametrize("ks", KERNELS + [(4, 4, 4), (4, 3, 3)])
def test_torchsparse(ks):
    x = make_input()
    w = dense_weight(ks)
    pad = convert.torchsparse_padding(ks)
    compare(x, run_layer(x, convert.from_torchsparse(torchsparse_layout(w), ks), ks, padding=pad), w, pad)


def test_torchsparse_order_by_hand():
    """k = 1 of a 3x3x3 TorchSparse kernel is offset (0, -1, -1) (x fastest); of 2x2x2 it is (0, 0, 1)."""
    w = torch.arange(27.0).reshape(27, 1, 1)
    ours = convert.from_torchsparse(w, 3)
    # torchsp index of offset (0, -1, -1): ix=1, iy=0, iz=0 -> k = 9
    assert ours[9].item() == 1.0
    w2 = torch.arange(8.0).reshape(8, 1, 1)
    assert torch.equal(convert.from_torchsparse(w2, 2), w2)


@pytest.mark.parametrize("ks", KERNELS + [(4, 4, 4)])
def test_minkowski(ks):
    x = make_input()
    w = dense_weight(ks)
    compare(x, run_layer(x, convert.from_minkowski(minkowski_layout(w), ks), ks), w, default_padding(ks))


def test_minkowski_order_by_hand():
    """ME's 2x2x2 kernel: index 1 is offset (1, 0, 0) (x fastest); torchsp's index 4."""
    w = torch.arange(8.0).reshape(8, 1, 1)
    ours = convert.from_minkowski(w, 2)
    for ix, iy, iz in itertools.product(range(2), repeat=3):
        assert ours[(ix * 2 + iy) * 2 + iz].item() == ix + 2 * iy + 4 * iz


def test_bad_shapes():
    with pytest.raises(ValueError, match="kernel_size"):
        convert.from_torchsparse(torch.zeros(26, 2, 2), 3)
    with pytest.raises(ValueError, match="version"):
        convert.from_spconv(torch.zeros(2, 3, 3, 3, 2), version=3)
    with pytest.raises(ValueError, match="axis_order"):
        convert.from_spconv(torch.zeros(2, 3, 3, 3, 2), axis_order="yxz")
