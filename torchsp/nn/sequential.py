"""Sequential containers that pass SparseTensors.

torch.nn.Sequential already works when every child takes and returns a
SparseTensor. torchsp.nn.Sequential also accepts the plain feature-wise
torch.nn layers that spconv's SparseSequential accepts (BatchNorm1d,
SyncBatchNorm, ReLU, Dropout, Linear, ...): they are applied to feats. So
`torch.nn.SyncBatchNorm.convert_sync_batchnorm` keeps working on a model that
put a bare nn.BatchNorm1d in a torchsp.nn.Sequential.
"""

from torch import nn

from ..tensor import SparseTensor
from .combine import add
from .norm import BatchNorm, fuses_relu

# Exact torch.nn types applied to feats [N, C]. Subclasses (such as torchsp.nn.ReLU or
# torchsp.nn.GroupNorm) are not listed: they receive the SparseTensor itself.
FEATURE_WISE = (
    nn.BatchNorm1d, nn.SyncBatchNorm, nn.GroupNorm, nn.LayerNorm, nn.InstanceNorm1d,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.ELU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Mish,
    nn.PReLU, nn.Dropout, nn.Identity, nn.Linear,
)


class Sequential(nn.Sequential):
    """Run children in order on a SparseTensor.

    Children whose exact type is in FEATURE_WISE get `x.feats` ([N, C] -> [N, C'])
    and their result is put back on x's coordinates; every other child gets the
    SparseTensor (convolutions, pooling, torchsp layers, user modules).  A
    torchsp.nn.BatchNorm followed by a ReLU (torchsp's or torch's, in place or
    not) runs as one call, BatchNorm.forward_relu (the ReLU fused into the
    norm's passes), unless either has hooks.
    """

    def forward(self, input):
        return self._run(input, None, None)

    def forward_add_relu(self, input, residual, relu):
        """relu(torchsp.nn.add(self(input), residual)): a residual block's tail.  When the last child
        is a torchsp BatchNorm that fuses with `relu` (torchsp.nn.norm.fuses_relu), it runs as
        BatchNorm.forward_add_relu: the norm, the add and the ReLU in the norm's passes.
        input: SparseTensor; residual: SparseTensor on the coordinates self(input) has; relu: the
        ReLU module.  Returns a SparseTensor on those coordinates."""
        return self._run(input, residual, relu)

    def _run(self, input, residual, relu):
        x = input
        mods = tuple(self._modules.values())
        last = len(mods) - 1
        i = 0
        while i <= last:
            module = mods[i]
            if type(module) is BatchNorm and isinstance(x, SparseTensor):
                if i < last and fuses_relu(module, mods[i + 1]):
                    x = module.forward_relu(x)  # the BatchNorm and the ReLU after it in one pass
                    i += 2
                    continue
                if i == last and residual is not None and fuses_relu(module, relu):
                    return module.forward_add_relu(x, residual)
            if type(module) in FEATURE_WISE and isinstance(x, SparseTensor):
                x = x.replace(module(x.feats))
            else:
                x = module(x)
            i += 1
        if residual is None:
            return x
        return relu(add(x, residual))
