"""Train MinkUNet on the bundled real scan with synthetic height-bin labels; the loss goes down.

    python examples/train_minkunet.py                                  # CPU, small voxel count
    python examples/train_minkunet.py --device cuda --voxel-size 0.05 --cr 1.0 --amp bf16 --steps 300

Prints the loss every --log-every steps, the first and last losses and the
time per step; exits with status 1 if the final loss is not below the first.
--amp runs the forward pass under torch.autocast (bf16, or fp16 with a GradScaler).
"""

import argparse
import time

import torch
import torch.nn.functional as F

import torchsp
from torchsp.models import MinkUNet

from scan_data import load_scan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--voxel-size", type=float, default=0.5)
    p.add_argument("--half-width", type=float, default=None, help="crop to |x|,|y| < this many metres")
    p.add_argument("--cr", type=float, default=0.25, help="MinkUNet width multiplier")
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"])
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def train(args, model=None):
    """Train `model` (default: a new MinkUNet(4, classes, cr)) in place; returns the losses, one per step."""
    torch.manual_seed(args.seed)
    feats, coords, labels = load_scan(args.voxel_size, args.half_width, args.classes, args.device)
    print(f"scan: {coords.shape[0]} voxels at {args.voxel_size} m, {args.classes} height classes, "
          f"device {args.device}, amp {args.amp}")
    if model is None:
        model = MinkUNet(4, args.classes, cr=args.cr)
    model = model.to(args.device).train()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    scaler = torch.amp.GradScaler(args.device, enabled=args.amp == "fp16")
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        x = torchsp.SparseTensor(feats, coords)
        with torch.autocast(args.device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            acc = (logits.argmax(1) == labels).float().mean().item()
            print(f"step {step:4d}  loss {losses[-1]:.4f}  acc {acc:.3f}")
    elapsed = time.perf_counter() - start
    print(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}  "
          f"{1000 * elapsed / max(1, args.steps):.1f} ms/step")
    return losses


def main(argv=None):
    losses = train(parse_args(argv))
    went_down = min(losses[-3:]) < losses[0]
    print(f"loss went down: {went_down}")
    return 0 if went_down else 1


if __name__ == "__main__":
    raise SystemExit(main())
