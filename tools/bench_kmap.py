#!/usr/bin/env python3
"""Kernel-map benchmark: coordinates in, nbmap (and nbmap_t) out, on a real LiDAR scan.

For each voxel size (default 0.05 m and 0.1 m) and each case
  subm3   submanifold 3x3x3            (output coords = input coords)
  subm5   submanifold 5x5x5
  down2   stride-2 K=2 downsampling     (output coords + map)
  down3   stride-2 K=3 downsampling, padding 1 (active-site rule)
  unet    all maps of a 5-level MinkUNet: submanifold 3x3x3 at strides 1,2,4,8,16 and
          K=2 s=2 downsampling between levels (4 output-coordinate sets + 4 maps);
          transposed convs reuse the downsampling maps (no extra build)
and each method
  zdelta  torch.ops.torchsp.kernel_map(..., method=0)   (Spira's z-delta search)
  hash    torch.ops.torchsp.kernel_map(..., method=1)   (open addressing on packed keys)
  torch   a plain PyTorch sort + searchsorted baseline written here
  api     (unet only) torchsp.kmap.get_kernel_map on a fresh SparseTensor, as a model builds them
it times two things with CUDA events (median of --iters after --warmup):
  map     output coordinates (strided cases) + nbmap [N_out, V]
  map+T   the same + nbmap_t [N_in, V]
and prints each beside its floor: compulsory bytes (read the input coordinates, write the
output coordinates where they are computed, write nbmap (+ nbmap_t)) at 3.0 TB/s, and the
targets of issue 3 (30 us for the 3x3x3 submanifold map at 173k voxels, 150 us for all maps
of a 5-level U-Net). Before timing, the maps of all methods are compared (assert).

    python tools/bench_kmap.py --json out.json                      # H100
    python tools/bench_kmap.py --device cpu --voxel-size 0.5 --iters 3 --warmup 1   # smoke test
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

BANDWIDTH = 3.0e12  # bytes/s, H100 device-to-device copy (DESIGN.md section 7)
TARGETS_US = {("subm3", 0.05): 30.0, ("unet", None): 150.0}
DATA_CANDIDATES = [
    os.path.join(ROOT, "..", "shared", "data", "lidar_198k.npz"),
    "/work/shared/data/lidar_198k.npz",
    os.path.join(ROOT, "shared", "data", "lidar_198k.npz"),
    os.path.join(ROOT, "torchsp", "data", "lidar_198k.npz"),
]


def find_data(path):
    if path:
        return path
    for p in DATA_CANDIDATES:
        if os.path.exists(p):
            return p
    raise FileNotFoundError("lidar_198k.npz not found; pass --data PATH")


def load_coords(path, voxel_size, device):
    """int32 [N, 4] (batch 0, x, y, z) voxel coordinates, sorted, unique (data/README.md recipe)."""
    pc = np.load(path)["pc"][:, :3]
    c = np.unique(np.floor(pc / voxel_size).astype(np.int32), axis=0)
    c = np.concatenate([np.zeros((c.shape[0], 1), np.int32), c], axis=1)
    return torch.from_numpy(c).to(device).contiguous()


# --------------------------------------------------------------------------- timing

def timeit(fn, iters, warmup, device):
    """(median, p10, p90) in microseconds. CUDA: one event pair per call around the Python call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for s, e in events:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) * 1e3 for s, e in events]
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]
    return statistics.median(times), q(0.1), q(0.9)


# --------------------------------------------------------------------------- baseline

def offsets(kernel, dilation, padding, step):
    """[V, 3] int offsets, k = (ix * Ky + iy) * Kz + iz (DESIGN.md section 2)."""
    rng = [torch.arange(kernel[a]) * dilation[a] - padding[a] for a in range(3)]
    g = torch.stack(torch.meshgrid(*rng, indexing="ij"), dim=-1).reshape(-1, 3)
    return g * torch.tensor(step)


class TorchBaseline:
    """Plain PyTorch: pack keys (bounded box), sort, searchsorted per (output, offset)."""

    @staticmethod
    def _pack(c, lo, size):
        c = c.long()
        return ((c[..., 0] * size[0] + (c[..., 1] - lo[0])) * size[1] + (c[..., 2] - lo[1])) * size[2] \
            + (c[..., 3] - lo[2])

    @staticmethod
    def out_coords(coords, kernel, dilation, padding, step, lattice):
        """Active-site rule: q on the lattice with some q + delta_k occupied; sorted by key."""
        d = offsets(kernel, dilation, padding, step).to(coords.device).int()
        cand = coords[:, None, 1:] - d[None]                         # [N, V, 3] q = p - delta
        lat = torch.tensor(lattice, device=coords.device, dtype=torch.int32)
        on = (torch.remainder(cand, lat) == 0).all(-1)
        b = coords[:, None, :1].expand(-1, d.shape[0], 1)
        q = torch.cat([b, cand], dim=-1)[on]                          # [M', 4]
        lo = q[:, 1:].amin(0).long()
        size = (q[:, 1:].amax(0).long() - lo + 1)
        key = TorchBaseline._pack(q, lo, size)
        key = torch.unique(key)                                       # sorted
        z = key % size[2]
        r = key // size[2]
        y = r % size[1]
        r = r // size[1]
        x = r % size[0]
        bb = r // size[0]
        return torch.stack([bb, x + lo[0], y + lo[1], z + lo[2]], 1).int()

    @staticmethod
    def kernel_map(in_coords, out_coords, kernel, dilation, padding, step):
        d = offsets(kernel, dilation, padding, step).to(in_coords.device).int()
        lo = in_coords[:, 1:].amin(0)
        hi = in_coords[:, 1:].amax(0)
        size = (hi - lo + 1).long()
        keys = TorchBaseline._pack(in_coords, lo.long(), size)
        skeys, order = torch.sort(keys)
        nb = out_coords[:, None, 1:] + d[None]                        # [M, V, 3]
        inside = ((nb >= lo) & (nb <= hi)).all(-1)
        b = out_coords[:, None, :1].expand(-1, d.shape[0], 1)
        qk = TorchBaseline._pack(torch.cat([b, nb], -1), lo.long(), size)
        pos = torch.searchsorted(skeys, qk).clamp_(max=skeys.numel() - 1)
        hit = inside & (skeys[pos] == qk)
        return torch.where(hit, order[pos], torch.full_like(pos, -1)).int()

    @staticmethod
    def transpose(nbmap, n_in):
        nbt = torch.full((n_in, nbmap.shape[1]), -1, dtype=torch.int32, device=nbmap.device)
        q, k = (nbmap >= 0).nonzero(as_tuple=True)
        nbt[nbmap[q, k].long(), k] = q.int()
        return nbt


# --------------------------------------------------------------------------- methods

class Method:
    """Builds out coords / nbmap / nbmap_t for one case with one method."""

    def __init__(self, name):
        self.name = name

    def out_coords(self, c, kernel, dilation, padding, step, lattice):
        if self.name == "torch":
            return TorchBaseline.out_coords(c, kernel, dilation, padding, step, lattice)
        return torch.ops.torchsp.out_coords(c, list(kernel), list(dilation), list(padding), list(step), 1,
                                            list(lattice), False)

    def kernel_map(self, cin, cout, kernel, dilation, padding, step):
        if self.name == "torch":
            return TorchBaseline.kernel_map(cin, cout, kernel, dilation, padding, step)
        m = {"zdelta": 0, "hash": 1}[self.name]
        return torch.ops.torchsp.kernel_map(cin, cout, list(kernel), list(dilation), list(padding), list(step),
                                            1, m)

    def transpose(self, nbmap, cin):
        if self.name == "torch":
            return TorchBaseline.transpose(nbmap, cin.shape[0])
        return torch.ops.torchsp.kernel_map_transpose(nbmap, cin)


CASES = {
    # name: (kernel, stride, padding)
    "subm3": (3, 1, 1),
    "subm5": (5, 1, 2),
    "down2": (2, 2, 0),
    "down3": (3, 2, 1),
}


def case_fn(method, coords, case, with_t):
    k, s, p = CASES[case]
    kernel, dil, pad, step = (k,) * 3, (1,) * 3, (p,) * 3, (1,) * 3

    def run():
        out = coords if s == 1 else method.out_coords(coords, kernel, dil, pad, step, (s,) * 3)
        nb = method.kernel_map(coords, out, kernel, dil, pad, step)
        nbt = method.transpose(nb, coords) if with_t else None
        return out, nb, nbt
    return run


def unet_fn(method, coords, with_t, levels=5):
    def run():
        c, t, maps = coords, 1, []
        for lvl in range(levels):
            st = (t,) * 3
            nb = method.kernel_map(c, c, (3,) * 3, (1,) * 3, (1,) * 3, st)
            maps.append((c, c, nb, method.transpose(nb, c) if with_t else None))
            if lvl + 1 < levels:
                out = method.out_coords(c, (2,) * 3, (1,) * 3, (0,) * 3, st, (2 * t,) * 3)
                nb = method.kernel_map(c, out, (2,) * 3, (1,) * 3, (0,) * 3, st)
                maps.append((c, out, nb, method.transpose(nb, c) if with_t else None))
                c, t = out, 2 * t
        return maps
    return run


def unet_api_fn(coords, levels=5):
    """The user path: torchsp.kmap.get_kernel_map on a fresh SparseTensor (fresh cache)."""
    import torchsp
    from torchsp.kmap import get_kernel_map
    feats = torch.empty(coords.shape[0], 1, device=coords.device)

    def run():
        x = torchsp.SparseTensor(feats, coords, check=False)
        maps = []
        for lvl in range(levels):
            km, _, _, _ = get_kernel_map(x, 3)
            maps.append(km)
            if lvl + 1 < levels:
                km, out, ostride, okey = get_kernel_map(x, 2, stride=2)
                maps.append(km)
                x = torchsp.SparseTensor(feats[: out.shape[0]] if out.shape[0] <= feats.shape[0]
                                         else torch.empty(out.shape[0], 1, device=coords.device),
                                         out, ostride, cache=x.cache, coord_key=okey, check=False)
        return maps
    return run


# --------------------------------------------------------------------------- floors

def floor_bytes(n_in, n_out, v, computes_out, with_t):
    b = n_in * 16 + n_out * v * 4
    if computes_out:
        b += n_out * 16
    if with_t:
        b += n_in * v * 4
    return b


def check_equal(ref_name, ref, name, got, what):
    assert ref.shape == got.shape, f"{what}: {name} shape {tuple(got.shape)} != {ref_name} {tuple(ref.shape)}"
    bad = (ref != got).sum().item()
    assert bad == 0, f"{what}: {name} differs from {ref_name} in {bad} entries"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="lidar_198k.npz (default: shared/data or torchsp/data)")
    ap.add_argument("--voxel-size", type=float, nargs="+", default=[0.05, 0.1])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", nargs="+", default=["zdelta", "hash", "torch"])
    ap.add_argument("--cases", nargs="+", default=["subm3", "subm5", "down2", "down3", "unet"])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-api", action="store_true", help="skip the get_kernel_map (user path) U-Net row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_kmap: CUDA is not available (use --device cpu for a smoke test)")
        if args.iters < 50:
            print(f"bench_kmap: raising --iters {args.iters} to 50 on CUDA")
            args.iters = 50
    import torchsp  # noqa: F401  (registers torch.ops.torchsp)

    path = find_data(args.data)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else "cpu", "data": os.path.basename(path), "iters": args.iters, "warmup": args.warmup}
    print(f"# kernel-map build: {env['device']}, torch {env['torch']}, {env['data']}, "
          f"median of {args.iters} ({'CUDA events' if device.type == 'cuda' else 'wall clock'} around the Python call)")
    methods = [Method(m) for m in args.methods]
    rows = []
    for vs in args.voxel_size:
        coords = load_coords(path, vs, device)
        n = coords.shape[0]
        print(f"\n## voxel {vs} m: {n} voxels")
        print(f"{'case':8s} {'method':7s} {'N_in':>8s} {'N_out':>8s} {'V':>4s} {'pairs':>9s} "
              f"{'map us':>9s} {'floor':>7s} {'x':>6s} {'map+T us':>9s} {'floor':>7s} {'x':>6s} {'target':>7s}")
        for case in args.cases:
            # -------- verify all methods agree
            results = {}
            for m in methods:
                fn = unet_fn(m, coords, True) if case == "unet" else case_fn(m, coords, case, True)
                results[m.name] = fn()
            ref_name = methods[0].name
            ref = results[ref_name]
            for name, got in results.items():
                if case == "unet":
                    assert len(got) == len(ref)
                    for i, (a, b) in enumerate(zip(ref, got)):
                        check_equal(ref_name, a[1], name, b[1], f"unet map {i} out coords")
                        check_equal(ref_name, a[2], name, b[2], f"unet map {i} nbmap")
                        check_equal(ref_name, a[3], name, b[3], f"unet map {i} nbmap_t")
                else:
                    check_equal(ref_name, ref[0], name, got[0], f"{case} out coords")
                    check_equal(ref_name, ref[1], name, got[1], f"{case} nbmap")
                    check_equal(ref_name, ref[2], name, got[2], f"{case} nbmap_t")
            if case == "unet":
                n_out = sum(m_[2].shape[0] for m_ in ref)
                v_sum = None
                pairs = sum(int((m_[2] >= 0).sum()) for m_ in ref)
                b_map = sum(floor_bytes(m_[0].shape[0], m_[2].shape[0], m_[2].shape[1],
                                        m_[1] is not m_[0] and m_[1].data_ptr() != m_[0].data_ptr(), False)
                            for m_ in ref)
                b_t = sum(floor_bytes(m_[0].shape[0], m_[2].shape[0], m_[2].shape[1],
                                      m_[1].data_ptr() != m_[0].data_ptr(), True) for m_ in ref)
                v_str = "all"
            else:
                out, nb, _ = ref
                n_out, v_sum = out.shape[0], nb.shape[1]
                pairs = int((nb >= 0).sum())
                strided = CASES[case][1] > 1
                b_map = floor_bytes(n, n_out, v_sum, strided, False)
                b_t = floor_bytes(n, n_out, v_sum, strided, True)
                v_str = str(v_sum)
            del results, ref
            target = TARGETS_US.get((case, vs)) or TARGETS_US.get((case, None))
            # -------- time
            timed = [(m.name, m) for m in methods]
            if case == "unet" and not args.no_api:
                timed.append(("api", None))
            for name, m in timed:
                rec = {"voxel_size": vs, "case": case, "method": name, "n_in": n, "n_out": n_out,
                       "V": v_sum, "pairs": pairs, "floor_map_us": b_map / BANDWIDTH * 1e6,
                       "floor_map_t_us": b_t / BANDWIDTH * 1e6, "target_us": target}
                if name == "api":
                    med, p10, p90 = timeit(unet_api_fn(coords), args.iters, args.warmup, device)
                    rec.update(map_t_us=med, map_t_p10=p10, map_t_p90=p90, map_us=None)
                else:
                    for with_t, key in ((False, "map"), (True, "map_t")):
                        fn = unet_fn(m, coords, with_t) if case == "unet" else case_fn(m, coords, case, with_t)
                        med, p10, p90 = timeit(fn, args.iters, args.warmup, device)
                        rec.update({f"{key}_us": med, f"{key}_p10": p10, f"{key}_p90": p90})
                rows.append(rec)
                fm = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9s}"
                ratio = lambda a, b: f"{a / b:6.1f}" if a is not None and b else f"{'-':>6s}"
                print(f"{case:8s} {name:7s} {n:8d} {n_out:8d} {v_str:>4s} {pairs:9d} "
                      f"{fm(rec['map_us'])} {rec['floor_map_us']:7.1f} {ratio(rec['map_us'], rec['floor_map_us'])} "
                      f"{fm(rec['map_t_us'])} {rec['floor_map_t_us']:7.1f} {ratio(rec['map_t_us'], rec['floor_map_t_us'])} "
                      f"{(f'{target:7.0f}' if target else '-'):>7s}", flush=True)

    # -------- compact summary: best torchsp method per case vs target
    print("\n# summary (best torchsp method; 'x floor' = time / floor; target from issue 3)")
    for vs in args.voxel_size:
        for case in args.cases:
            rs = [r for r in rows if r["voxel_size"] == vs and r["case"] == case
                  and r["method"] in ("zdelta", "hash") and r["map_us"] is not None]
            if not rs:
                continue
            best = min(rs, key=lambda r: r["map_us"])
            base = [r for r in rows if r["voxel_size"] == vs and r["case"] == case and r["method"] == "torch"]
            tgt = best["target_us"]
            verdict = "" if not tgt else ("  MEETS target" if best["map_us"] <= tgt else "  misses target")
            sp = f", {base[0]['map_us'] / best['map_us']:.1f}x faster than torch" if base and base[0]["map_us"] else ""
            print(f"{vs:5.2f} m {case:6s} best {best['method']:6s} map {best['map_us']:8.1f} us "
                  f"(map+T {best['map_t_us']:8.1f} us), floor {best['floor_map_us']:6.1f} us"
                  f"{sp}{(f', target {tgt:.0f} us' if tgt else '')}{verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
