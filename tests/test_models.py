"""torchsp.models: parameter counts against the published definitions, layer lists,
forward/backward shapes on a small crop of the bundled real scan."""

import pytest
import torch

import torchsp
import torchsp.nn as spnn
from torchsp.data import load_lidar
from torchsp.models import MinkUNet, SparseResNet21D


# ---- published parameter counts, from the dense layer shapes of the published definitions

def conv(cin, cout, k=(3, 3, 3), bias=False):
    return cin * cout * k[0] * k[1] * k[2] + (cout if bias else 0)


def bn(c):
    return 2 * c  # weight and bias (running stats are buffers)


def spvnas_residual_block(cin, cout):
    n = conv(cin, cout) + bn(cout) + conv(cout, cout) + bn(cout)
    return n + (conv(cin, cout, (1, 1, 1)) + bn(cout) if cin != cout else 0)


def spvnas_minkunet_params(cin=4, num_classes=19, cr=1.0, point_transforms=False):
    """SPVNAS core/models/semantic_kitti/minkunet.py, layer by layer."""
    cs = [int(cr * c) for c in (32, 32, 64, 128, 256, 256, 128, 96, 96)]
    n = conv(cin, cs[0]) + bn(cs[0]) + conv(cs[0], cs[0]) + bn(cs[0])                       # stem
    for i in range(4):                                                                        # stage1-4
        n += conv(cs[i], cs[i], (2, 2, 2)) + bn(cs[i])
        n += spvnas_residual_block(cs[i], cs[i + 1]) + spvnas_residual_block(cs[i + 1], cs[i + 1])
    for i in range(4):                                                                        # up1-4
        c = cs[5 + i]
        n += conv(cs[4 + i], c, (2, 2, 2)) + bn(c)
        n += spvnas_residual_block(c + cs[3 - i], c) + spvnas_residual_block(c, c)
    n += cs[8] * num_classes + num_classes                                                    # classifier
    if point_transforms:  # registered but unused by SPVNAS's MinkUNet.forward
        for a, b in ((cs[0], cs[4]), (cs[4], cs[6]), (cs[6], cs[8])):
            n += a * b + b + bn(b)
    return n


def openpcdet_voxel_res_backbone_8x_params(cin=4):
    """OpenPCDet pcdet/models/backbones_3d/spconv_backbone.py VoxelResBackBone8x."""
    basic_block = lambda c: 2 * (conv(c, c, bias=True) + bn(c))  # noqa: E731  SparseBasicBlock: bias=True
    n = conv(cin, 16) + bn(16) + 2 * basic_block(16)                       # conv_input, conv1
    for a, b in ((16, 32), (32, 64), (64, 128)):                           # conv2-4
        n += conv(a, b) + bn(b) + 2 * basic_block(b)
    return n + conv(128, 128, (3, 1, 1)) + bn(128)                         # conv_out


def count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cr", [1.0, 0.5])
def test_minkunet_parameter_count(cr):
    assert count(MinkUNet(4, 19, cr=cr)) == spvnas_minkunet_params(4, 19, cr)
    assert count(MinkUNet(4, 19, cr=cr, spvnas_state_dict_compat=True)) == \
        spvnas_minkunet_params(4, 19, cr, point_transforms=True)
    if cr == 1.0:
        assert count(MinkUNet()) == 21_723_315  # "21.7M" in the SPVNAS paper


def test_minkunet_layer_list():
    m = MinkUNet()
    convs = [mod for mod in m.modules() if isinstance(mod, spnn.SparseConv3d)]
    strided = [(c.kernel_size, c.stride, c.transposed) for c in convs if c.stride != (1, 1, 1)]
    assert strided == [((2, 2, 2), (2, 2, 2), False)] * 4 + [((2, 2, 2), (2, 2, 2), True)] * 4
    widths = [c.out_channels for c in convs if c.stride != (1, 1, 1)]
    assert widths == [32, 32, 64, 128, 256, 128, 96, 96]
    assert len(convs) == 2 + 4 * (1 + 2 * 2) + 4 * (1 + 2 * 2) + 7  # 1x1 shortcuts: 3 encoder + 4 decoder
    assert m.classifier[0].in_features == 96 and m.classifier[0].out_features == 19


@pytest.mark.parametrize("cin", [4, 5])
def test_resnet21d_parameter_count(cin):
    assert count(SparseResNet21D(cin)) == openpcdet_voxel_res_backbone_8x_params(cin)


def test_resnet21d_layer_list():
    m = SparseResNet21D()
    convs = [mod for mod in m.modules() if isinstance(mod, spnn.SparseConv3d)]
    assert len(convs) == 21
    strided = [(c.kernel_size, c.stride, c.padding, c.out_channels) for c in convs if c.stride != (1, 1, 1)]
    # OpenPCDet (z, y, x): conv4 padding (0, 1, 1), conv_out kernel (3, 1, 1) stride (2, 1, 1) -> reversed here
    assert strided == [((3, 3, 3), (2, 2, 2), (1, 1, 1), 32), ((3, 3, 3), (2, 2, 2), (1, 1, 1), 64),
                       ((3, 3, 3), (2, 2, 2), (1, 1, 0), 128), ((1, 1, 3), (1, 1, 2), (0, 0, 0), 128)]
    bns = [mod.bn for mod in m.modules() if isinstance(mod, spnn.BatchNorm)]
    assert all(b.eps == 1e-3 and b.momentum == 0.01 for b in bns)
    assert sum(c.bias is not None for c in convs) == 16  # the SparseBasicBlock convs


# ---- forward / backward on a real crop

def real_crop(voxel_size=0.3, half_width=8.0):
    """Voxels of the bundled scan within +-half_width metres (x, y): feats [N, 4] (mean x, y, z, 1), coords [N, 4]."""
    pc = torch.from_numpy(load_lidar())
    pc = pc[(pc[:, 0].abs() < half_width) & (pc[:, 1].abs() < half_width)]
    coords, inverse = torchsp.voxelize(pc, voxel_size)
    n = coords.shape[0]
    sums = torch.zeros(n, 3).index_add_(0, inverse, pc)
    cnt = torch.zeros(n).index_add_(0, inverse, torch.ones(pc.shape[0]))
    feats = torch.cat([sums / cnt[:, None], torch.ones(n, 1)], 1)
    return feats, coords


def test_minkunet_forward_backward_real_crop():
    feats, coords = real_crop()
    assert 1000 < coords.shape[0] < 6000
    model = MinkUNet(4, 7, cr=0.25)
    logits = model(torchsp.SparseTensor(feats, coords))
    assert logits.shape == (coords.shape[0], 7)
    logits.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.stem[0].weight.grad.abs().sum() > 0


def test_resnet21d_forward_backward_real_crop():
    feats, coords = real_crop(0.2)
    coords = coords - torch.cat([torch.zeros(1, dtype=torch.int32), coords[:, 1:].amin(0)])  # voxel indices >= 0
    model = SparseResNet21D(4)
    feats_all = model.forward_features(torchsp.SparseTensor(feats, coords))
    strides = {k: v.stride for k, v in feats_all.items()}
    assert strides == {"x_conv1": (1, 1, 1), "x_conv2": (2, 2, 2), "x_conv3": (4, 4, 4), "x_conv4": (8, 8, 8),
                       "out": (8, 8, 16)}
    out = feats_all["out"]
    assert out.feats.shape[1] == 128 and out.coords.shape[0] > 0
    out.feats.sum().backward()
    assert model.conv_input[0].weight.grad.abs().sum() > 0


def test_resnet21d_spconv_crop_bounds_outputs():
    feats, coords = real_crop(0.2)
    coords = coords - torch.cat([torch.zeros(1, dtype=torch.int32), coords[:, 1:].amin(0)])
    shape = [int(v) + 1 for v in coords[:, 1:].amax(0)]
    shape[2] = 41  # KITTI's z extent: 41 -> 21 -> 11 -> 5 -> 2
    free = SparseResNet21D(4).eval()
    cropped = SparseResNet21D(4, sparse_shape=shape).eval()
    cropped.load_state_dict(free.state_dict())
    with torch.no_grad():
        a = free(torchsp.SparseTensor(feats, coords))
        b = cropped(torchsp.SparseTensor(feats, coords))
    assert 0 < b.coords.shape[0] <= a.coords.shape[0]
    # spconv's output grid: z 41-style arithmetic, (D + 2p - K) // s + 1 per strided conv
    z = shape[2]
    for p in (1, 1, 0):
        z = (z + 2 * p - 3) // 2 + 1
    z = (z - 3) // 2 + 1
    assert int(b.coords[:, 3].max()) < z * 16 and int(b.coords[:, 3].min()) >= 0
