#!/usr/bin/env python3
"""torch.ops.torchsp.* on malformed arguments: an error with a message, never a crash.

Why: the ops are public (torch.ops.torchsp, torchsp.ops) and take raw maps, row lists and integer
lists that the Python layer normally builds; a wrong one must raise (RuntimeError, ValueError,
TypeError, IndexError) and leave the process and the GPU usable, not read or write out of bounds.
Each trial builds valid arguments for one op from a small random layer, changes one of them
(dtype, dimensions, length, a non-contiguous view, the device, entries out of range or negative,
huge or negative integers in an int[]), calls the op, and synchronises.  A trial fails when
the process dies or stops answering (each batch of trials runs in its own child process, given
--batch-timeout seconds), when CUDA reports an error once the op has returned or raised, or when
the op raises something other than those exceptions.  An op may also accept a change it can
serve (a non-contiguous tensor, a -1 map entry): the trial then only asks that nothing crashed.

    python tools/fuzz_badinput.py --trials 2000                # CUDA when present, else CPU
    python tools/fuzz_badinput.py --device cpu --seeds 17 --verbose
"""

import argparse
import os
import random
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torchsp  # noqa: E402

ops = torch.ops.torchsp
ALLOWED = (RuntimeError, ValueError, TypeError, IndexError)
HUGE = [1 << 31, 1 << 40, -(1 << 31), -1, 0, 3, 1 << 17]


def base_args(rng, device):
    """{op name: list of valid arguments} for one small random submanifold 3x3x3 layer."""
    n = rng.choice([1, 5, 40, 300])
    c = torch.unique(torch.randint(-4, 5, (n, 4), generator=torch.Generator().manual_seed(rng.randint(0, 1 << 30))),
                     dim=0)
    c[:, 0] = c[:, 0].abs() % 2
    c = torch.unique(c, dim=0).int().to(device)
    n = c.shape[0]
    dt = rng.choice([torch.float16, torch.float32]) if device == "cuda" else torch.float32
    cin, cout = rng.choice([3, 8, 32]), rng.choice([4, 16, 64])
    x = torchsp.SparseTensor(torch.randn(n, cin, device=device, dtype=dt), c)
    km = torchsp.kmap.get_kernel_map(x, 3)[0]
    w = torch.randn(27, cin, cout, device=device, dtype=dt)
    dy = torch.randn(n, cout, device=device, dtype=dt)
    a = [0, 0, 0, 0]
    pairs, starts = ops.kernel_map_pairs(km.nbmap)
    return {
        "conv_fwd": [x.feats, w, km.nbmap, km.nbmap_t, a, a, a, None, None, [], []],
        "conv_dgrad": [dy, w, km.nbmap_t, a, None, []],
        "conv_wgrad": [x.feats, dy, km.nbmap, a, pairs, starts],
        "kernel_map": [c, c, [3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, 0],
        "kernel_map_pairs": [km.nbmap, rng.random() < 0.5, False],
        "kernel_map_transpose": [km.nbmap, c],
        "mask_order": [km.nbmap, -1, rng.random() < 0.5],
        "out_coords": [c, [2, 2, 2], [1, 1, 1], [0, 0, 0], [1, 1, 1], 1, [2, 2, 2], False],
    }


def mutate_tensor(rng, t, device):
    """A malformed version of tensor t and the change's name."""
    how = rng.choice(["dtype", "dim", "rows", "cols", "view", "device", "range", "negative", "empty", "nan"])
    if how == "dtype":
        return t.to(rng.choice([torch.int64, torch.float64, torch.bool, torch.int16, torch.float32, torch.int32])), how
    if how == "dim":
        return (t.reshape(-1) if t.dim() > 1 else t.reshape(1, -1)), how
    if how == "rows" and t.dim() >= 1:
        k = rng.choice([1, -1, 7])
        return (t[:max(0, t.shape[0] - 1)] if k == -1 else torch.cat([t] * (1 + k % 3))), how
    if how == "cols" and t.dim() == 2:
        return (torch.cat([t, t[:, :1]], 1) if rng.random() < 0.5 else t[:, : max(0, t.shape[1] - 1)]), how
    if how == "view" and t.dim() == 2 and t.shape[1] > 1:
        wide = torch.cat([t, t], 1)
        return wide[:, 1:1 + t.shape[1]], how
    if how == "device" and device == "cuda":
        return t.cpu(), how
    if how == "range" and not t.is_floating_point():
        u = t.clone()
        if u.numel():
            u.view(-1)[rng.randrange(u.numel())] = rng.choice([1 << 30, 2 ** 31 - 1, 12345, u.numel()])
        return u, how
    if how == "negative" and not t.is_floating_point():
        u = t.clone()
        if u.numel():
            u.view(-1)[rng.randrange(u.numel())] = rng.choice([-2, -(1 << 30), -(2 ** 31)])
        return u, how
    if how == "empty":
        return t[:0], how
    if how == "nan" and t.is_floating_point():
        u = t.clone()
        if u.numel():
            u.view(-1)[rng.randrange(u.numel())] = float("nan")
        return u, how
    return t[:0], "empty"


def mutate(rng, args, device):
    """args with one argument changed, and a description."""
    args = list(args)
    i = rng.randrange(len(args))
    v = args[i]
    if isinstance(v, torch.Tensor):
        args[i], how = mutate_tensor(rng, v, device)
    elif isinstance(v, list):
        how = "int list"
        if v and rng.random() < 0.7:
            v = list(v)
            v[rng.randrange(len(v))] = rng.choice(HUGE)
        else:
            v = [rng.choice(HUGE) for _ in range(rng.choice([0, 1, 2, 5]))]
        args[i] = v
    elif isinstance(v, bool):
        args[i], how = not v, "bool"
    elif isinstance(v, int):
        args[i], how = rng.choice(HUGE + [2, -2]), "int"
    elif v is None:
        args[i], how = torch.zeros(rng.choice([0, 1, 3]), dtype=torch.int32, device=device), "None -> tensor"
    else:
        how = "kept"
    return args, f"arg {i} {how}"


def run_trial(seed, device, verbose=False):
    """None when the trial passes, else a reason (a crash kills the process instead)."""
    rng = random.Random(seed)
    base = base_args(rng, device)
    name = rng.choice(sorted(base))
    args, desc = mutate(rng, base[name], device)
    desc = f"seed {seed}: {name} {desc}"
    if verbose:
        print(desc, flush=True)
    try:
        getattr(ops, name)(*args)
        what = "accepted"
    except ALLOWED as e:
        what = f"raised {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    except Exception as e:  # noqa: BLE001
        return f"{desc}: {type(e).__name__} (not an argument error): {str(e).splitlines()[0][:200]}"
    if device == "cuda":  # the op's kernels must not have faulted, whichever way it returned
        try:
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            return f"{desc}: {what.split(':')[0]}, then CUDA reported {str(e).splitlines()[0][:160]}"
    if verbose:
        print("  ", what)
    return None


def child(seeds, device, verbose):
    """Runs `seeds` in this process; prints FAIL lines and 'DONE k' after each trial."""
    torch.manual_seed(0)
    for s in seeds:
        print("START", s, flush=True)
        try:
            why = run_trial(s, device, verbose)
        except Exception:  # noqa: BLE001 (building the valid arguments failed: the harness's bug)
            why = f"seed {s}: harness error {traceback.format_exc().splitlines()[-1]}"
        if why:
            print("FAIL", why, flush=True)
        print("DONE", s, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--trials", type=int, default=500)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="*")
    p.add_argument("--batch", type=int, default=200, help="trials per child process")
    p.add_argument("--budget", type=float, default=0)
    p.add_argument("--batch-timeout", type=float, default=120, help="seconds a child process may take")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    seeds = list(args.seeds) if args.seeds else list(range(args.first_seed, args.first_seed + args.trials))
    if args.child:
        child(seeds, args.device, args.verbose)
        return
    t0, done, failures = time.time(), 0, []
    while seeds and not (args.budget and time.time() - t0 > args.budget):
        batch = seeds[:args.batch]
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--device", args.device, "--seeds",
               *map(str, batch)] + (["--verbose"] if args.verbose else [])
        try:
            pr = subprocess.run(cmd, capture_output=True, text=True, timeout=args.batch_timeout)
            stdout, stderr, code = pr.stdout, pr.stderr, pr.returncode
        except subprocess.TimeoutExpired as e:  # a trial that never returns is a finding too
            stdout, stderr = e.stdout or "", e.stderr or ""
            stdout, stderr = (v.decode(errors="replace") if isinstance(v, bytes) else v for v in (stdout, stderr))
            code = f"none: no answer within {args.batch_timeout:.0f} s, killed"
        ran = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("DONE ")]
        for line in stdout.splitlines():
            if line.startswith("FAIL"):
                failures.append(line[5:])
                print(line, flush=True)
            elif args.verbose and not line.startswith(("DONE", "START")):
                print(line)
        done += len(ran)
        if code != 0:  # the trial after the last DONE killed the process, or never returned
            dead = batch[len(ran)] if len(ran) < len(batch) else None
            msg = f"seed {dead}: the process died (return code {code}): {stderr.strip()[-300:]}"
            failures.append(msg)
            print("FAIL", msg, flush=True)
            done += 1
            seeds = seeds[len(ran) + 1:]
        else:
            seeds = seeds[len(batch):]
    print(f"fuzz_badinput: {done} trials on {args.device} in {time.time() - t0:.0f} s, {len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
