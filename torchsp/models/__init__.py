"""Published sparse networks built from torchsp layers."""

from .blocks import BasicConvolutionBlock, BasicDeconvolutionBlock, ResidualBlock, SparseBasicBlock
from .minkunet import MinkUNet
from .resnet import SparseResNet21D, VoxelResBackBone8x

__all__ = ["MinkUNet", "SparseResNet21D", "VoxelResBackBone8x", "BasicConvolutionBlock",
           "BasicDeconvolutionBlock", "ResidualBlock", "SparseBasicBlock"]
