"""Building blocks of the published sparse networks (conv-BN-ReLU, residual blocks).

Module and attribute names follow the published definitions (SPVNAS's
MinkUNet, OpenPCDet's SparseBasicBlock), so a checkpoint maps onto them by name
up to each library's conv and BatchNorm parameter names (see torchsp.convert).
"""

from torch import nn

from .. import nn as spnn
from ..nn.norm import bn_add_relu, bn_relu, hook_free


def conv_bn_relu(in_channels, out_channels, kernel_size, stride=1, padding=None, dilation=1,
                 transposed=False, bn_eps=1e-5, bn_momentum=0.1):
    """Sequential(SparseConv3d(bias=False), BatchNorm, ReLU): feats [N, Cin] -> [N_out, Cout]."""
    return spnn.Sequential(
        spnn.SparseConv3d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                          dilation=dilation, transposed=transposed),
        spnn.BatchNorm(out_channels, eps=bn_eps, momentum=bn_momentum),
        spnn.ReLU(True),
    )


class BasicConvolutionBlock(nn.Module):
    """SPVNAS BasicConvolutionBlock: `net` = conv(ks, stride) -> BN -> ReLU. [N, inc] -> [N_out, outc]."""

    def __init__(self, inc, outc, ks=3, stride=1, dilation=1):
        super().__init__()
        self.net = conv_bn_relu(inc, outc, ks, stride=stride, dilation=dilation)

    def forward(self, x):
        return self.net(x)


class BasicDeconvolutionBlock(nn.Module):
    """SPVNAS BasicDeconvolutionBlock: transposed conv(ks, stride) -> BN -> ReLU, back to the finer coordinates."""

    def __init__(self, inc, outc, ks=3, stride=1):
        super().__init__()
        self.net = conv_bn_relu(inc, outc, ks, stride=stride, transposed=True)

    def forward(self, x):
        return self.net(x)


class ResidualBlock(nn.Module):
    """SPVNAS ResidualBlock: relu(net(x) + downsample(x)).

    net = conv(ks) -> BN -> ReLU -> conv(ks) -> BN; downsample = identity when
    inc == outc and stride == 1, else 1x1x1 conv -> BN. [N, inc] -> [N, outc].
    """

    def __init__(self, inc, outc, ks=3, stride=1, dilation=1):
        super().__init__()
        self.net = spnn.Sequential(
            spnn.SparseConv3d(inc, outc, ks, stride=stride, dilation=dilation),
            spnn.BatchNorm(outc),
            spnn.ReLU(True),
            spnn.SparseConv3d(outc, outc, ks, dilation=dilation),
            spnn.BatchNorm(outc),
        )
        if inc == outc and stride == 1:
            self.downsample = spnn.Sequential()
        else:
            self.downsample = spnn.Sequential(
                spnn.SparseConv3d(inc, outc, 1, stride=stride),
                spnn.BatchNorm(outc),
            )
        self.relu = spnn.ReLU(True)

    def forward(self, x):
        # net's last BatchNorm, the add and the ReLU in one pass (torchsp.nn.Sequential.forward_add_relu,
        # which skips net's __call__: not when that would skip hooks)
        if type(self.net) is spnn.Sequential and hook_free(self.net):
            return self.net.forward_add_relu(x, self.downsample(x), self.relu)
        return self.relu(spnn.add(self.net(x), self.downsample(x)))


class SparseBasicBlock(nn.Module):
    """OpenPCDet SparseBasicBlock: two submanifold 3x3x3 convs with bias, BN, identity shortcut.

    relu(bn2(conv2(relu(bn1(conv1(x))))) + x), channels `planes` -> `planes`.
    The convs carry a bias (OpenPCDet sets bias = norm_fn is not None), BN uses
    eps=1e-3, momentum=0.01.
    """

    def __init__(self, inplanes, planes, bn_eps=1e-3, bn_momentum=0.01):
        super().__init__()
        self.conv1 = spnn.SparseConv3d(inplanes, planes, 3, padding=1, bias=True)
        self.bn1 = spnn.BatchNorm(planes, eps=bn_eps, momentum=bn_momentum)
        self.relu = spnn.ReLU()
        self.conv2 = spnn.SparseConv3d(planes, planes, 3, padding=1, bias=True)
        self.bn2 = spnn.BatchNorm(planes, eps=bn_eps, momentum=bn_momentum)

    def forward(self, x):
        # each BatchNorm with what follows it in one pass where torchsp.nn.norm.fuses_relu allows
        out = bn_relu(self.bn1, self.relu, self.conv1(x))
        return bn_add_relu(self.bn2, self.relu, self.conv2(out), x)
