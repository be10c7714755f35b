#!/usr/bin/env python3
"""Run one bench.py layer's forward (or dgrad, or wgrad) a few times, for a profiler to attach to.

Why: ncu (Nsight Compute) and compute-sanitizer want a short program that launches the
kernel of interest a known number of times.  The layer, voxels and weights are
bench.py's, so a profile explains a number of the benchmark table.

    ncu --clock-control none --kernel-name regex:igemm --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python tools/profile_conv.py subm3_c256 --algo 0,0,0,0
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("layer", choices=[l[0] for l in bench.LAYERS])
    ap.add_argument("--algo", default="0,0,0,0", help="dataflow,tile,split,threshold")
    ap.add_argument("--pass", dest="pass_name", default="fwd", choices=["fwd", "dgrad", "wgrad"])
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", default=None)
    args = ap.parse_args()
    args.data = bench.find_data(args.data)
    args.voxel_scale = 1.0
    import torchsp
    spec = [l for l in bench.LAYERS if l[0] == args.layer][0]
    device, dtype = torch.device("cuda"), bench.DTYPES[args.dtype]
    x, kw, w, km, sz, _ = bench.make_layer(*spec, args, device, dtype)
    algo = [int(v) for v in args.algo.split(",")]
    dy = torch.randn(sz["n_out"], spec[4], device=device, dtype=dtype)
    with torch.no_grad():
        for _ in range(args.repeats):
            if args.pass_name == "fwd":
                torchsp.functional.sparse_conv3d(x, w, spec[2], algo=algo, **kw)
            elif args.pass_name == "dgrad":
                torch.ops.torchsp.conv_dgrad(dy, w, km.nbmap_t, algo, km.order_t)
            else:
                torch.ops.torchsp.conv_wgrad(x.feats, dy, km.nbmap, algo)
    torch.cuda.synchronize()
    print(f"{args.layer} {args.pass_name} {algo}: N_out {sz['n_out']}, pairs {sz['pairs']}, done")


if __name__ == "__main__":
    main()
