"""SparseConv3d: the drop-in sparse convolution layer."""

import math

import torch
from torch import nn

from .. import functional as F
from ..geometry import default_padding, triple, volume

_NO_PARAMETERS = {}  # SparseConv3d.forward of a subclass: read every parameter as an attribute


class SparseConv3d(nn.Module):
    """Sparse 3D convolution on SparseTensors (submanifold, strided, generative, transposed).

    Args:
        in_channels, out_channels: Cin, Cout.
        kernel_size, stride, dilation: int or 3-tuple.
        padding: int or 3-tuple; default (K-1)//2*d for odd K, 0 for even K.
        bias: add a learnable [Cout] bias.
        transposed: upsample by `stride` back to the cached finer coordinates.
        generative: output every site reached through the kernel support.
        rule: "active" (default) or "floor" output rule for strided convs.
    Attributes:
        weight: [V, Cin, Cout], V = Kx*Ky*Kz, offsets z fastest (DESIGN.md section 2).
        bias: [Cout] or None.
        algo: None (autotuned) or fixed (fwd, dgrad, wgrad) choices, see torchsp.functional.
    Shapes: input feats [N_in, Cin] -> output feats [N_out, Cout].
    """

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, padding=None, dilation=1,
                 bias=False, transposed=False, generative=False, rule="active", device=None, dtype=None):
        super().__init__()
        self.in_channels = int(in_channels)
        self.out_channels = int(out_channels)
        self.kernel_size = triple(kernel_size, "kernel_size")
        self.stride = triple(stride, "stride")
        self.dilation = triple(dilation, "dilation")
        self.padding = (default_padding(self.kernel_size, self.dilation) if padding is None
                        else triple(padding, "padding", minimum=0))
        self.transposed = bool(transposed)
        self.generative = bool(generative)
        self.rule = rule
        self.algo = None
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(volume(self.kernel_size), self.in_channels, self.out_channels,
                                               **factory))
        self.bias = nn.Parameter(torch.empty(self.out_channels, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        # Same scale as nn.Conv3d's default: uniform(+-1/sqrt(fan_in)), fan_in = Cin * V.
        bound = 1.0 / math.sqrt(max(1, self.in_channels * self.weight.shape[0]))
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input):
        # The parameters from _parameters, where nn.Module.__getattr__ would find them: `self.weight`
        # misses the instance dict and falls through to that Python method, ~0.5 us of the layer's
        # ~4.5 us of Python a call on a 2-core x86 host, 0.2-0.3 of ~9 on the H200 machine's host
        # (session 79, the op stubbed out).  Attribute access wherever it may give something else:
        # on a subclass (a `weight` property of its own wins over _parameters), under a
        # parametrization (torch.nn.utils.parametrize moves weight out of _parameters behind a
        # property), and for a weight or bias that is no registered parameter (FSDP's views, a
        # tensor set later, bias=False's None).
        p = self._parameters if type(self) is SparseConv3d else _NO_PARAMETERS
        weight = p.get("weight")
        if weight is None:
            weight = self.weight
        bias = p["bias"] if "bias" in p else self.bias
        return F.sparse_conv3d(input, weight, self.kernel_size, bias, self.stride, self.padding,
                               self.dilation, self.transposed, self.generative, self.rule, self.algo)

    def extra_repr(self):
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
             f"padding={self.padding}, dilation={self.dilation}")
        if self.bias is None:
            s += ", bias=False"
        if self.transposed:
            s += ", transposed=True"
        if self.generative:
            s += ", generative=True"
        if self.rule != "active":
            s += f", rule={self.rule!r}"
        return s
