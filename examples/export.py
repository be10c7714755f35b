"""Train MinkUNet briefly, export it with torch.jit.trace, reload it in a fresh process, compare.

    python examples/export.py [--device cpu] [--steps 20] [--out minkunet_traced.pt]

The traced module takes (feats [N, 4] float32, coords [N, 4] int32) and returns
logits [N, classes]. The check runs it in a new Python process (only `import
torchsp` and torch.jit.load) on a crop of another size than the one traced, and
compares with the eager model's output saved by this process.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch
from torch import nn

import torchsp
from torchsp.models import MinkUNet

from scan_data import load_scan
from train_minkunet import parse_args as train_args
from train_minkunet import train


class FeatsCoordsModel(nn.Module):
    """(feats [N, C], coords int32 [N, 4]) -> model(SparseTensor) for TorchScript export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, feats, coords):
        return self.model(torchsp.SparseTensor(feats, coords))


CHECK = """
import sys, torch, torchsp
module = torch.jit.load(sys.argv[1], map_location=sys.argv[3])
data = torch.load(sys.argv[2])
with torch.no_grad():
    out = module(data["feats"].to(sys.argv[3]), data["coords"].to(sys.argv[3])).cpu()
err = (out - data["expected"]).abs().max().item()
print(f"fresh process: {data['coords'].shape[0]} voxels, max abs difference {err:.2e}")
sys.exit(0 if err < 1e-4 else 1)
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--voxel-size", type=float, default=0.8)
    p.add_argument("--out", default=None, help="where to save the traced module (default: a temp dir)")
    args = p.parse_args(argv)

    targs = train_args(["--device", args.device, "--steps", str(args.steps), "--voxel-size", str(args.voxel_size),
                        "--half-width", "12", "--log-every", str(max(1, args.steps))])
    torch.manual_seed(0)
    model = MinkUNet(4, targs.classes, cr=targs.cr)
    losses = train(targs, model)
    print(f"trained {args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    model.eval()
    wrapper = FeatsCoordsModel(model).eval()
    feats, coords, _ = load_scan(args.voxel_size, 12, device=args.device)
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, (feats, coords), check_trace=False)
    out_dir = tempfile.mkdtemp(prefix="torchsp-export-")
    path = args.out or os.path.join(out_dir, "minkunet_traced.pt")
    traced.save(path)
    # another size: a wider crop of the scan
    feats2, coords2, _ = load_scan(args.voxel_size, 20, device=args.device)
    with torch.no_grad():
        expected = wrapper(feats2, coords2).cpu()
    data_path = os.path.join(out_dir, "check.pt")
    torch.save({"feats": feats2.cpu(), "coords": coords2.cpu(), "expected": expected}, data_path)
    print(f"saved {path}; traced on {coords.shape[0]} voxels, checking on {coords2.shape[0]}")
    result = subprocess.run([sys.executable, "-c", CHECK, path, data_path, args.device])
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
