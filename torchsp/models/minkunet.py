"""MinkUNet, the SemanticKITTI configuration of SPVNAS / TorchSparse (Tang et al., ECCV 2020).

    stem:    conv3(in -> 32) BN ReLU, conv3(32 -> 32) BN ReLU                    stride 1
    stage i: conv2 stride 2 (c -> c) BN ReLU, ResidualBlock(c -> c'), ResidualBlock(c')
             widths 32, 64, 128, 256                                               stride 2, 4, 8, 16
    up i:    transposed conv2 stride 2 -> 256, 128, 96, 96, BN ReLU, cat(skip),
             ResidualBlock(c + skip -> c), ResidualBlock(c)                        stride 8, 4, 2, 1
    classifier: Linear(96 -> num_classes) on the stride-1 feats

Channel list cs = [32, 32, 64, 128, 256, 256, 128, 96, 96] scaled by `cr`
(int(cr * c)), as in SPVNAS's core/models/semantic_kitti/minkunet.py. Offsets of
the K=2 downsampling are {0, 1}^3 * t (padding 0), where the active-set and
floor rules agree, so the output coordinates are those of TorchSparse and
MinkowskiEngine. The transposed convs return to the encoder's coordinates,
so every skip concatenation is on identical coordinates.

Parameters at cr=1.0, 4 input channels, 19 classes: 21,723,315 (21.7M, as SPVNAS
reports; checked in tests/test_models.py from the dense layer shapes), 21,778,003
with the unused point_transforms. SPVNAS's MinkUNet also
registers three `point_transforms` (Linear+BatchNorm1d) that its forward never
uses; `spvnas_state_dict_compat=True` adds them (unused) so a SPVNAS checkpoint
loads with strict=True.
"""

from torch import nn

from .. import nn as spnn
from .blocks import BasicConvolutionBlock, BasicDeconvolutionBlock, ResidualBlock

CHANNELS = (32, 32, 64, 128, 256, 256, 128, 96, 96)


class MinkUNet(nn.Module):
    """MinkUNet for LiDAR semantic segmentation.

    Args:
        in_channels: input feature channels (4 for SemanticKITTI: x, y, z, intensity).
        num_classes: output classes (19 for SemanticKITTI).
        cr: channel ratio (width multiplier); cs = int(cr * c).
        spvnas_state_dict_compat: also create SPVNAS's unused `point_transforms`.
    Shapes: forward(SparseTensor feats [N, in_channels], stride 1) -> logits [N, num_classes],
        row i belonging to input voxel i (same coordinates and order).
    """

    def __init__(self, in_channels=4, num_classes=19, cr=1.0, spvnas_state_dict_compat=False):
        super().__init__()
        cs = [int(cr * c) for c in CHANNELS]
        self.channels = cs
        self.stem = spnn.Sequential(
            spnn.SparseConv3d(in_channels, cs[0], 3), spnn.BatchNorm(cs[0]), spnn.ReLU(True),
            spnn.SparseConv3d(cs[0], cs[0], 3), spnn.BatchNorm(cs[0]), spnn.ReLU(True),
        )
        for i in range(4):
            setattr(self, f"stage{i + 1}", spnn.Sequential(
                BasicConvolutionBlock(cs[i], cs[i], ks=2, stride=2),
                ResidualBlock(cs[i], cs[i + 1], ks=3),
                ResidualBlock(cs[i + 1], cs[i + 1], ks=3),
            ))
        for i in range(4):
            skip = cs[3 - i]
            setattr(self, f"up{i + 1}", nn.ModuleList([
                BasicDeconvolutionBlock(cs[4 + i], cs[5 + i], ks=2, stride=2),
                spnn.Sequential(
                    ResidualBlock(cs[5 + i] + skip, cs[5 + i], ks=3),
                    ResidualBlock(cs[5 + i], cs[5 + i], ks=3),
                ),
            ]))
        self.classifier = nn.Sequential(nn.Linear(cs[8], num_classes))
        if spvnas_state_dict_compat:
            self.point_transforms = nn.ModuleList([
                nn.Sequential(nn.Linear(a, b), nn.BatchNorm1d(b), nn.ReLU(True))
                for a, b in ((cs[0], cs[4]), (cs[4], cs[6]), (cs[6], cs[8]))
            ])

    def forward(self, x):
        x0 = self.stem(x)
        x1 = self.stage1(x0)
        x2 = self.stage2(x1)
        x3 = self.stage3(x2)
        x4 = self.stage4(x3)
        y = x4
        for up, skip in ((self.up1, x3), (self.up2, x2), (self.up3, x1), (self.up4, x0)):
            y = up[0](y)
            y = up[1](spnn.cat([y, skip]))
        return self.classifier(y.feats)
