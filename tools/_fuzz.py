"""The command line and trial loop the random-input tools share (tools/fuzz_conv.py, fuzz_norm.py).

Each tool has run_trial(seed, device, verbose, **flags) -> None (passed) or a one-line reason; this
runs a range of seeds (or the ones given) within a time budget, prints each failure as it comes
and a count every 100 trials, and exits 1 when any trial failed.
"""

import argparse
import sys
import time
import traceback

import torch


def main(name, doc, run_trial, default_trials=200, options=None):
    """Parse the tool's arguments and run its trials (see the module docstring).  options: {flag:
    help} of the tool's own on/off switches, passed to run_trial as keyword arguments."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--trials", type=int, default=default_trials)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="*", help="replay these trials instead")
    p.add_argument("--budget", type=float, default=0, help="stop after this many seconds (0: none)")
    p.add_argument("--verbose", action="store_true")
    for flag, text in (options or {}).items():
        p.add_argument("--" + flag.replace("_", "-"), action="store_true", help=text)
    args = p.parse_args()
    flags = {flag: getattr(args, flag) for flag in options or {}}
    seeds = args.seeds if args.seeds else range(args.first_seed, args.first_seed + args.trials)
    t0, done, failures = time.time(), 0, []
    for s in seeds:
        if args.budget and time.time() - t0 > args.budget:
            break
        try:
            why = run_trial(s, args.device, args.verbose, **flags)
        except Exception:  # noqa: BLE001 (the trial's own checks raised: the harness's bug, or memory)
            why = f"seed {s}: harness error {traceback.format_exc().splitlines()[-1][:300]}"
        done += 1
        if why is not None:
            failures.append(why)
            print("FAIL", why, flush=True)
        if done % 100 == 0:
            print(f"{name}: {done} trials, {len(failures)} failed, {time.time() - t0:.0f} s", flush=True)
    switches = "".join(" --" + flag.replace("_", "-") for flag, on in flags.items() if on)
    print(f"{name}: {done} trials on {args.device}{switches} in {time.time() - t0:.0f} s, {len(failures)} failed")
    sys.exit(1 if failures else 0)
