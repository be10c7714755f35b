"""DistributedDataParallel training of MinkUNet on two crops of the real scan; gradients match one process.

    python examples/ddp.py                    # 2 CPU processes, gloo
    python examples/ddp.py --device cuda      # 2 GPUs (or 2 processes on 1 GPU), NCCL

The batch is two crops of the bundled scan (batch indices 0 and 1). A single
process computes the gradient of the loss on the whole batch; then two ranks
each take one crop, wrap the same initial model in DDP, and backpropagate
sum(CE) / N_total * world_size, which DDP's gradient averaging turns into the
same total. Rank 0 compares every parameter's gradient with the single-process
one. BatchNorm runs in eval mode (running statistics), since per-rank batch
statistics differ from whole-batch ones by design (use
torch.nn.SyncBatchNorm.convert_sync_batchnorm on GPUs for synchronised statistics).
"""

import argparse
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import torchsp
from torchsp.models import MinkUNet

from scan_data import load_scan

WORLD = 2


def batch_items(voxel_size):
    """Two crops (feats, coords with batch index i, labels)."""
    return [load_scan(voxel_size, 8.0, batch_index=i, shift=6.0 * i) for i in range(WORLD)]


def make_model(cr):
    torch.manual_seed(0)
    return MinkUNet(4, 5, cr=cr).eval()


def loss_of(model, items, total):
    feats = torch.cat([f for f, _, _ in items])
    coords = torch.cat([c for _, c, _ in items])
    labels = torch.cat([y for _, _, y in items])
    logits = model(torchsp.SparseTensor(feats, coords))
    return F.cross_entropy(logits, labels, reduction="sum") / total


def worker(rank, args, init_file, result_file):
    device = torch.device(args.device, rank % torch.cuda.device_count()) if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    items = [tuple(t.to(device) for t in item) for item in batch_items(args.voxel_size)]
    total = sum(item[0].shape[0] for item in items)
    model = make_model(args.cr).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if args.device == "cuda" else None)
    loss = loss_of(ddp, [items[rank]], total) * WORLD
    loss.backward()
    if rank == 0:
        torch.save({n: p.grad.detach().cpu() for n, p in model.named_parameters()}, result_file)
    # Free DDP's reducer while the process group is still registered: if the reducer held the
    # last reference, the Gloo group would be destroyed under the GIL while its worker thread
    # waits for the GIL (a known torch shutdown deadlock, seen here as a rare CI hang).
    del ddp, loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--voxel-size", type=float, default=0.5)
    p.add_argument("--cr", type=float, default=0.25)
    args = p.parse_args(argv)

    device = "cuda" if args.device == "cuda" else "cpu"
    items = [tuple(t.to(device) for t in item) for item in batch_items(args.voxel_size)]
    total = sum(item[0].shape[0] for item in items)
    model = make_model(args.cr).to(device)
    loss_of(model, items, total).backward()
    single = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    print(f"single process: batch of {WORLD} crops, {total} voxels")

    tmp = tempfile.mkdtemp(prefix="torchsp-ddp-")
    result_file = os.path.join(tmp, "grads.pt")
    mp.spawn(worker, args=(args, os.path.join(tmp, "init"), result_file), nprocs=WORLD, join=True)
    ddp = torch.load(result_file)
    worst = max(((ddp[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in single.items())
    print(f"DDP ({WORLD} ranks, {'nccl' if device == 'cuda' else 'gloo'}): max relative gradient difference "
          f"over {len(single)} parameters {worst:.2e}")
    ok = worst < 1e-4
    print(f"gradients match: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
