"""Pointwise layers on SparseTensors: activations and dropout act on feats only.

Each returns `input.replace(f(input.feats))`: same coordinates, cache and
coord_key, so downstream convolutions reuse the kernel maps already built.
"""

import torch
from torch import nn

from ._util import check_sparse


class ReLU(nn.ReLU):
    """ReLU on feats. input feats [N, C] -> output feats [N, C], same coordinates."""

    def forward(self, input):
        check_sparse(input, "torchsp.nn.ReLU")
        return input.replace(super().forward(input.feats))


class LeakyReLU(nn.LeakyReLU):
    """LeakyReLU(negative_slope) on feats. [N, C] -> [N, C], same coordinates."""

    def forward(self, input):
        check_sparse(input, "torchsp.nn.LeakyReLU")
        return input.replace(super().forward(input.feats))


class SiLU(nn.SiLU):
    """SiLU (swish) on feats. [N, C] -> [N, C], same coordinates."""

    def forward(self, input):
        check_sparse(input, "torchsp.nn.SiLU")
        return input.replace(super().forward(input.feats))


class Dropout(nn.Dropout):
    """Dropout on feats (each feature element independently, as nn.Dropout). [N, C] -> [N, C]."""

    def forward(self, input):
        check_sparse(input, "torchsp.nn.Dropout")
        return input.replace(super().forward(input.feats))


class Linear(nn.Linear):
    """nn.Linear on feats (a 1x1x1 convolution without a kernel map). [N, in_features] -> [N, out_features]."""

    def forward(self, input):
        check_sparse(input, "torchsp.nn.Linear")
        return input.replace(super().forward(input.feats))


def relu(input, inplace=False):
    """Functional ReLU: SparseTensor with feats [N, C] -> same coordinates, relu(feats)."""
    return input.replace(torch.relu_(input.feats) if inplace else torch.relu(input.feats))
