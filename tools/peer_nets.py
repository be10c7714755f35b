"""Whole networks in a peer library, for tools/bench_whole.py.

torchsp.models.MinkUNet is the SPVNAS MinkUNet: a stem of two 3x3x3 convs (32), four encoder
stages (K = 2 stride-2 conv, two residual blocks: 32, 64, 128, 256), four decoder stages (K = 2
stride-2 transposed conv, concatenation with the skip, two residual blocks: 256, 128, 96, 96) and
a Linear(96, classes) head.  TorchSparse++ v2.1 ships the same network as
torchsparse.backbones.unet.SparseResUNet42 (its blocks: Conv3d, BatchNorm, ReLU; a 1x1x1
shortcut where the width changes), 49 convs like torchsp's, returning every level's tensor; the
adapter adds the same Linear head on the last one.  The peer net has its own random weights:
bench_whole.py compares times, not outputs.

A PeerNet holds the module(s), `prepare(coords [N, 4] int32 (batch, x, y, z))` -> the peer's
coordinates (once, outside the timed calls) and `forward(feats [N, C_in], prepared)` -> logits
[N', classes] on the peer's stride-1 rows (bench_whole.py reduces them to a loss, so their order
is not checked).  Raises peers.PeerUnavailable when the peer does not import.  Nothing here builds a peer (see .peers/README_peers.txt).
"""

import torch

from peers import PeerUnavailable, _torchsparse_config


class PeerNet:
    """A peer's network: `modules` (to switch train / eval, and their parameters), `prepare`,
    `forward` (module docstring), `note` (what was built)."""

    def __init__(self, modules, prepare, forward, note):
        self.modules, self.prepare, self.forward, self.note = modules, prepare, forward, note

    def train(self, mode):
        for m in self.modules:
            m.train(mode)

    def parameters(self):
        return [p for m in self.modules for p in m.parameters()]


def torchsparse_unet(in_channels, classes, mode, device, dtype):
    """TorchSparse++'s SparseResUNet42 with a Linear head, every conv in conv mode `mode` (0
    unsorted, 1 mask-sorted, 2 sorted with 3 mask splits: peers._torchsparse_config) through its
    global conv config, set at the start of each call.  `prepare` shifts the coordinates to be
    non-negative (its hash takes non-negative ones)."""
    try:
        import torchsparse
        import torchsparse.nn.functional as F
        from torchsparse.backbones.unet import SparseResUNet42
    except Exception as e:  # noqa: BLE001
        raise PeerUnavailable(f"torchsparse: {type(e).__name__}: {e}")
    cfg = _torchsparse_config(F, mode)
    net = SparseResUNet42(in_channels=in_channels).to(device, dtype)
    head = torch.nn.Linear(net.decoder_channels[-1], classes).to(device, dtype)

    def prepare(coords):
        c = coords.clone()
        c[:, 1:] -= c[:, 1:].amin(0)
        return c

    def forward(feats, coords):
        # the config is global in TorchSparse++: set per call, so nets of two modes can alternate
        F.conv_config.set_global_conv_config(cfg)
        return head(net(torchsparse.SparseTensor(feats, coords))[-1].feats)
    convs = sum(1 for m in net.modules() if isinstance(m, torchsparse.nn.Conv3d))
    return PeerNet([net, head], prepare, forward, f"TorchSparse++ {torchsparse.__version__} SparseResUNet42, "
                   f"{convs} convs, conv mode {mode}")


NETS = {"torchsparse": torchsparse_unet}


def build(peer, in_channels, classes, device, dtype):
    """PeerNet for `peer` ("torchsparse" or "torchsparse:M", M its conv mode, default 1), or raise
    PeerUnavailable."""
    name, _, variant = peer.partition(":")
    if name not in NETS:
        raise PeerUnavailable(f"no whole-network adapter for {peer!r} (one of {', '.join(NETS)})")
    try:
        mode = int(variant) if variant else 1
    except ValueError:
        raise PeerUnavailable(f"{name}: conv mode must be 0, 1 or 2, got {variant!r}")
    return NETS[name](in_channels, classes, mode, device, dtype)
