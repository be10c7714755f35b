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
    SparseTensor (convolutions, pooling, torchsp layers, user modules).
    """

    def forward(self, input):
        x = input
        for module in self:
            if type(module) in FEATURE_WISE and isinstance(x, SparseTensor):
                x = x.replace(module(x.feats))
            else:
                x = module(x)
        return x
