"""SparseResNet21D: the CenterPoint / OpenPCDet VoxelResBackBone8x 3D backbone (21 sparse convs).

OpenPCDet (pcdet/models/backbones_3d/spconv_backbone.py) indexes voxels as
(batch, z, y, x); torchsp uses (batch, x, y, z). Every per-axis argument is
therefore reversed here: OpenPCDet's padding (0, 1, 1) of conv4 is torchsp's
(1, 1, 0), and conv_out's kernel (3, 1, 1) / stride (2, 1, 1) are (1, 1, 3) /
(1, 1, 2). A spconv weight [Cout, Kz, Ky, Kx, Cin] converts with
torchsp.convert.from_spconv(w, axis_order="zyx").

    conv_input: subm3(in -> 16) BN ReLU                                      stride 1
    conv1:      2 x SparseBasicBlock(16)                                     stride 1
    conv2:      conv3 stride 2 pad 1 (16 -> 32) BN ReLU, 2 x SparseBasicBlock(32)    stride 2
    conv3:      conv3 stride 2 pad 1 (32 -> 64) BN ReLU, 2 x SparseBasicBlock(64)    stride 4
    conv4:      conv3 stride 2 pad (1,1,0) (64 -> 128) BN ReLU, 2 x SparseBasicBlock(128)  stride 8
    conv_out:   conv (1,1,3) stride (1,1,2) pad 0 (128 -> 128) BN ReLU       stride (8, 8, 16)

BatchNorm eps=1e-3, momentum=0.01; the SparseBasicBlock convs have a bias, the
others do not. Parameters with 4 input channels: 2,694,880 (5 channels: 2,695,312) (tests/test_models.py).

Output coordinates: strided convs keep every active site of the dense conv
(DESIGN.md section 3). spconv additionally drops sites outside the dense
output grid; pass `sparse_shape` (OpenPCDet's grid in (x, y, z) order, e.g.
(1408, 1600, 41) for KITTI) to crop to that grid after every strided conv and
reproduce spconv's coordinate sets exactly (eager mode only).
"""

from torch import nn

from .. import nn as spnn
from .blocks import SparseBasicBlock, conv_bn_relu

BN = {"bn_eps": 1e-3, "bn_momentum": 0.01}


def _down_shape(shape, kernel, stride, padding):
    return tuple((d + 2 * p - k) // s + 1 for d, k, s, p in zip(shape, kernel, stride, padding))


class SparseResNet21D(nn.Module):
    """VoxelResBackBone8x with channels 16-32-64-128.

    Args:
        in_channels: voxel feature channels (4 for mean-VFE x, y, z, intensity; 5 on nuScenes).
        last_pad: padding of conv_out (OpenPCDet's `last_pad`, default 0), int or (x, y, z).
        sparse_shape: optional dense grid (X, Y, Z) of the input voxels; crop like spconv.
    Shapes: forward(SparseTensor feats [N, in_channels], stride 1, coords = voxel indices
        (b, x, y, z)) -> SparseTensor feats [M, 128], stride (8, 8, 16).
    """

    def __init__(self, in_channels=4, last_pad=0, sparse_shape=None):
        super().__init__()
        self.sparse_shape = None if sparse_shape is None else tuple(int(v) for v in sparse_shape)
        self.conv_input = conv_bn_relu(in_channels, 16, 3, padding=1, **BN)
        self.conv1 = spnn.Sequential(SparseBasicBlock(16, 16), SparseBasicBlock(16, 16))
        self.conv2 = spnn.Sequential(conv_bn_relu(16, 32, 3, stride=2, padding=1, **BN),
                                     SparseBasicBlock(32, 32), SparseBasicBlock(32, 32))
        self.conv3 = spnn.Sequential(conv_bn_relu(32, 64, 3, stride=2, padding=1, **BN),
                                     SparseBasicBlock(64, 64), SparseBasicBlock(64, 64))
        self.conv4 = spnn.Sequential(conv_bn_relu(64, 128, 3, stride=2, padding=(1, 1, 0), **BN),
                                     SparseBasicBlock(128, 128), SparseBasicBlock(128, 128))
        self.conv_out = conv_bn_relu(128, 128, (1, 1, 3), stride=(1, 1, 2), padding=last_pad, **BN)

    def _stage(self, stage, x, shape):
        """Run a stage whose first module is a strided conv block; crop after that conv if shapes are known."""
        if shape is None:
            return stage(x), None
        conv = stage[0][0]
        y = stage[0](x)
        shape = _down_shape(shape, conv.kernel_size, conv.stride, conv.padding)
        y = spnn.crop(y, (0, 0, 0), tuple(d * t for d, t in zip(shape, y.stride)))
        for block in list(stage)[1:]:
            y = block(y)
        return y, shape

    def forward_features(self, x):
        """All stages: dict x_conv1..x_conv4 (strides 1, 2, 4, 8) and out (stride (8, 8, 16))."""
        shape = self.sparse_shape
        x = self.conv_input(x)
        x_conv1 = self.conv1(x)
        x_conv2, shape = self._stage(self.conv2, x_conv1, shape)
        x_conv3, shape = self._stage(self.conv3, x_conv2, shape)
        x_conv4, shape = self._stage(self.conv4, x_conv3, shape)
        if shape is None:
            out = self.conv_out(x_conv4)
        else:
            out, shape = self._stage(spnn.Sequential(self.conv_out), x_conv4, shape)
        return {"x_conv1": x_conv1, "x_conv2": x_conv2, "x_conv3": x_conv3, "x_conv4": x_conv4, "out": out}

    def forward(self, x):
        if self.sparse_shape is None:
            x = self.conv_input(x)
            x = self.conv1(x)
            x = self.conv2(x)
            x = self.conv3(x)
            x = self.conv4(x)
            return self.conv_out(x)
        return self.forward_features(x)["out"]


VoxelResBackBone8x = SparseResNet21D
