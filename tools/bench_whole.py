#!/usr/bin/env python3
"""A whole network beside a peer's: torchsp.models.MinkUNet against the same network in a peer
library (tools/peer_nets.py: TorchSparse++'s SparseResUNet42 with the same head), forward and
training step, milliseconds per call.

Why: tools/bench.py times one layer with its map cached; a user's step also builds every map,
runs batch norms and ReLUs and pays the host's time for all of it.  This times what a training
loop or an inference server sees, on the real scan (examples/scan_data.py), --batch B
voxelisations of it a batch (examples/scan_data.py load_batch, as tools/bench_models.py).

Each call builds a new SparseTensor (every kernel map rebuilt, as a data loader gives them; no
coordinate validation).  Forward: eval mode under torch.no_grad.  Step: train mode, every
parameter's .grad set to None (as optimizer.zero_grad() does), forward, a mean-square loss of
the logits in float32, backward.  torchsp runs its defaults (the tuner in its default mode,
measured during the warm-up calls); the peer its conv mode (torchsparse:M).  Rounds alternate
which library goes first; each round times --calls calls of each (wall time, CUDA synchronised
around each call) and keeps their median; the table gives the median of the rounds and the
ratio peer / torchsp.  The two networks have their own random weights: times only.

    python tools/bench_whole.py --batch 1 4 --peers torchsparse:1
    python tools/bench_whole.py --device cpu --dtype float32 --voxel-size 1.0 --peers none   # smoke test
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torchsp  # noqa: E402
from infer import timed  # noqa: E402  (examples/infer.py: median wall ms, CUDA synchronised)
from torchsp.models import MinkUNet  # noqa: E402

IN_CHANNELS, CLASSES = 4, 19


def runner(forward, params, phase):
    """A call of `phase` ("fwd" or "step") on forward() -> logits; params: the net's parameters.
    The caller puts the net in eval (fwd) or train (step) mode first, outside the timed calls."""
    if phase == "fwd":
        def fwd():
            with torch.no_grad():
                forward()
        return fwd

    def step():
        for p in params:
            p.grad = None
        forward().float().square().mean().backward()
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--voxel-size", type=float, default=0.05)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="scans a batch, one table row pair each")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=5, help="timed calls per library, phase and round (median)")
    ap.add_argument("--warmup", type=int, default=6, help="untimed calls of each first (tuner, allocator)")
    ap.add_argument("--peers", nargs="+", default=["torchsparse:1"], help="'none', or torchsparse[:mode]")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    assert args.rounds >= 1 and args.calls >= 1 and args.warmup >= 0, "--rounds, --calls >= 1, --warmup >= 0"
    assert all(b >= 1 for b in args.batch), "--batch >= 1"
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_whole: CUDA is not available (use --device cpu for a smoke test)")
    import peer_nets
    from peers import PeerUnavailable
    from scan_data import load_batch

    os.environ.setdefault("TORCHSP_CACHE_DIR", tempfile.mkdtemp(prefix="torchsp_bench_whole_"))
    torch.manual_seed(0)
    model = MinkUNet(IN_CHANNELS, CLASSES, cr=1.0).to(device, dtype)
    convs = sum(1 for m in model.modules() if isinstance(m, torchsp.nn.SparseConv3d))
    peers = {}
    for p in ([] if args.peers == ["none"] else args.peers):
        try:
            peers[p] = peer_nets.build(p, IN_CHANNELS, CLASSES, device, dtype)
        except PeerUnavailable as e:
            print(f"#   peer {p}: unavailable: {str(e).splitlines()[0][:160]}")
    print(f"# bench_whole: torchsp MinkUNet ({convs} convs) on {device.type} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {args.dtype}, "
          f"{args.voxel_size} m voxels, maps rebuilt every call, median of {args.rounds} rounds x {args.calls} calls, ms")
    for p, net in peers.items():
        print(f"#   peer {p}: {net.note}")
    rows = []
    for b in args.batch:
        feats, coords = load_batch(args.voxel_size, b, device, dtype)
        libs = {"torchsp": (lambda: model(torchsp.SparseTensor(feats, coords, check=False)),
                            list(model.parameters()), model.train)}
        for p, net in peers.items():
            pc = net.prepare(coords)
            libs[p] = (lambda net=net, pc=pc: net.forward(feats, pc), net.parameters(), net.train)
        calls = {(lib, ph): runner(libs[lib][0], libs[lib][1], ph) for lib in libs for ph in ("fwd", "step")}
        for (lib, ph), fn in calls.items():
            libs[lib][2](ph == "step")
            for _ in range(args.warmup):
                fn()
        times = {k: [] for k in calls}
        names = list(libs)
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for ph in ("fwd", "step"):
                for lib in order:
                    libs[lib][2](ph == "step")  # train / eval mode, outside the timed calls
                    times[(lib, ph)].append(timed(calls[(lib, ph)], device.type, args.calls))
        for ph in ("fwd", "step"):
            rec = dict(batch=b, voxels=int(coords.shape[0]), phase=ph,
                       **{f"{lib}_ms": statistics.median(times[(lib, ph)]) for lib in libs},
                       rounds={lib: times[(lib, ph)] for lib in libs})
            rows.append(rec)
    print(f"\n{'batch':>5s} {'voxels':>8s} {'phase':>5s} {'torchsp':>9s} " +
          " ".join(f"{p:>14s} {'ratio':>6s}" for p in peers))
    for r in rows:
        t = r["torchsp_ms"]
        print(f"{r['batch']:5d} {r['voxels']:8d} {r['phase']:>5s} {t:9.2f} " +
              " ".join(f"{r[f'{p}_ms']:14.2f} {r[f'{p}_ms'] / t:5.2f}x" for p in peers))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.type, "dtype": args.dtype, "voxel_size": args.voxel_size,
                       "peers": {p: n.note for p, n in peers.items()}, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
