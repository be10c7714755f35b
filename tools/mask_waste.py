#!/usr/bin/env python3
"""How many MACs an output-stationary pass computes per useful MAC, on the real scan (CPU only).

Why: an output-stationary tile of M consecutive rows (in mask order) multiplies every row by
every offset that any of its rows has, so it computes M * |union of the tile's offsets| row
products where the rows own only their pairs.  On lidar_198k that ratio is ~1.8 at 64-row
tiles (0.1 m and 0.05 m), and no tile size or global sort key has taken it much lower (the
windowed packing of the step plans, below, is the first to); it is the main gap between the
H100 kernels' ~50-80% of peak on computed MACs and the floor.

This tool measures the ratio for the mask order (torchsp.kmap.mask_order), for the order a
CUDA map's step plan walks (the mask order packed into tiles within 4096-row windows:
torch.ops.torchsp.tile_steps, whose CPU twin gives the same plan; since session 67 it takes
lidar_198k from 1.89 to 1.59 at 0.05 m and 1.94 to 1.64 at 0.1 m, 128-row tiles, 1.63 and 1.69
in sessions 32-66; session 30's decision tree reached 1.73 and 1.78), and for a *density split*: the offsets present in at
least a fraction d of the rows form one segment over all rows, the rarer ones a second segment
over only the rows that have any of them, each segment mask-sorted by its own offsets.  The second segment's sums
are added to the first's output: its rows' fp16 read-add-write (bytes printed) is the price.
No kernel runs; this only counts tiles.  That split is now dataflow 5 (torchsp/plan.py), and on
the H100 it is slower than the plain pass despite the products it saves (docs/performance-log.md: a tile's fixed
cost outweighs them), so read these counts as an upper bound on what a plan can remove.

    python tools/mask_waste.py                       # 0.05 m and 0.1 m, 64-row tiles
    python tools/mask_waste.py --voxel-sizes 0.1 --tile 128 --densities 0.3 0.2 0.1
"""

import argparse
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def tile_offsets(sub, tile):
    """bool [tiles, V]: which offset columns any row of each `tile`-row tile of sub [R, V] has
    (the last tile padded with rows that have none)."""
    nt = -(-len(sub) // tile)
    sub = np.concatenate([sub, np.zeros((nt * tile - len(sub), sub.shape[1]), bool)])
    return sub.reshape(nt, tile, -1).any(1)


def tile_products(mask, order, offsets, tile):
    """Row products the tiles of `order` compute over the offset columns `offsets` (bool [V]):
    tile * the number of offsets any row of each tile has, summed over tiles.

    mask: bool [N, V] (nbmap >= 0); order: int64 numpy [R] rows in walk order (R <= N)."""
    sub = mask[order][:, offsets]
    if sub.size == 0:
        return 0
    return int(tile_offsets(sub, tile).sum()) * tile


def pair_unions(mask, order, tile):
    """(offsets the tiles of `order` use, summed over tiles; the same for pairs of consecutive
    tiles 2i, 2i + 1, each pair counting the union of its two tiles' offsets).

    Why: a 2-CTA cluster multicasting B would give each pair of tiles one walk over the union
    of their offsets, each block loading half of B's bytes: B's loads from L2 then scale by
    pairs / (sum over tiles), and each block's steps by 2 pairs / tiles (a block waits on the
    steps only its partner uses).  An odd last tile pairs with none.
    mask: bool [N, V]; order: int64 numpy [R] rows in walk order (R <= N)."""
    sub = mask[order]
    if sub.size == 0:
        return 0, 0
    used = tile_offsets(sub, tile)
    if len(used) % 2:
        used = np.concatenate([used, np.zeros((1, used.shape[1]), bool)])
    return int(used.sum()), int((used[0::2] | used[1::2]).sum())


def bits(cols):
    """int64-range bit mask of the True columns (torchsp.kmap.mask_order's `offsets`)."""
    m = sum(1 << k for k, on in enumerate(cols) if on)
    return m - (1 << 64) if m >= 1 << 63 else m


def density_split(nbmap, mask, density, tile):
    """(computed products of both segments, of the dense one, of the sparse one, rows of the sparse
    segment) for the split at `density` (fraction of rows that have an offset); mask = nbmap >= 0
    as a numpy bool array."""
    from torchsp.kmap import mask_order
    dense = mask.mean(0) >= density
    sparse = ~dense
    a = tile_products(mask, mask_order(nbmap, bits(dense)).long().numpy(), dense, tile) if dense.any() else 0
    rows_b = 0
    b = 0
    if sparse.any():
        ob = mask_order(nbmap, bits(sparse)).long().numpy()
        has = mask[ob][:, sparse].any(1)
        # mask_order puts the rows without any of the offsets first (their mask ranks 0)
        z = int((~has).sum())
        if has[:z].any():
            raise RuntimeError("mask_order did not put the rows without the sparse offsets first")
        rows_b = len(ob) - z
        b = tile_products(mask, ob[z:], sparse, tile)
    return a + b, a, b, rows_b


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None)
    ap.add_argument("--voxel-sizes", type=float, nargs="+", default=[0.05, 0.1])
    ap.add_argument("--tile", type=int, default=64, help="rows per output-stationary tile")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.3, 0.25, 0.2, 0.15, 0.12, 0.1])
    ap.add_argument("--channels", type=int, default=128, help="channels for the read-add-write bytes")
    args = ap.parse_args()
    if args.tile < 1:
        sys.exit("mask_waste: --tile must be >= 1")
    import bench
    import torchsp
    from torchsp.kmap import get_kernel_map, mask_order
    path = bench.find_data(args.data)
    for vs in args.voxel_sizes:
        coords = bench.load_coords(path, vs, torch.device("cpu"))
        x = torchsp.SparseTensor(torch.zeros(coords.shape[0], 1), coords)
        nbmap = get_kernel_map(x, 3, stride=1)[0].nbmap
        n, v = nbmap.shape
        mask = (nbmap >= 0).numpy()
        pairs = int(mask.sum())
        one = tile_products(mask, mask_order(nbmap).long().numpy(), np.ones(v, bool), args.tile)
        print(f"\n## {os.path.basename(path)} at {vs:g} m: {n} rows, {pairs} pairs ({pairs / max(n, 1):.2f}/row), "
              f"{args.tile}-row tiles")
        print(f"one segment, torchsp's mask order: computed {one / pairs:.3f} x pairs (useful share {pairs / one:.3f})")
        if v <= 64:
            steps = torch.ops.torchsp.tile_steps(nbmap, mask_order(nbmap))[:n].long().numpy()
            fine = tile_products(mask, steps[steps >= 0], np.ones(v, bool), args.tile)
            print(f"one segment, the step plan's packed order: computed {fine / pairs:.3f} x pairs "
                  f"(useful share {pairs / fine:.3f})")
            own, union = pair_unions(mask, steps[steps >= 0], args.tile)
            print(f"tile pairs of the packed order (a 2-CTA cluster sharing B): B loaded "
                  f"{union / max(own, 1):.3f} x, steps per block {2 * union / max(own, 1):.3f} x the tiles' own")
        density = mask.mean(0)
        print("offset densities (fraction of rows): " + " ".join(f"{d:.3f}" for d in np.sort(density)[::-1]))
        print(f"{'density':>8s} {'dense':>6s} {'computed':>9s} {'dense seg':>10s} {'sparse seg':>11s} "
              f"{'sparse rows':>12s} {'RAW MB':>7s}")
        for d in args.densities:
            tot, a, b, rows_b = density_split(nbmap, mask, d, args.tile)
            raw_mb = rows_b * args.channels * 2 * 2 / 1e6   # fp16 read + write of the sparse rows
            print(f"{d:8.3f} {int((density >= d).sum()):6d} {tot / pairs:9.3f} {a / pairs:10.3f} "
                  f"{b / pairs:11.3f} {rows_b / max(n, 1):12.2f} {raw_mb:7.1f}")


if __name__ == "__main__":
    main()
