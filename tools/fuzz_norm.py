#!/usr/bin/env python3
"""Random batch norms through torchsp.nn.BatchNorm against nn.BatchNorm1d in float64.

Why: on CUDA, torchsp.nn.BatchNorm runs its own fused kernels (csrc/cuda/batch_norm_act.cu:
statistics, normalisation with the ReLU and a residual add, backward), in every training step of
every model.  Each trial draws rows (2 to 300k), channels (1 to 512, odd ones too), the data's
dtype, the per-channel vectors' dtype (the data's or float32), affine or not, running statistics
or not, momentum (0.1, 0.01 or None: the cumulative average), train or eval, the tail (norm
alone, + ReLU, + residual + ReLU), non-contiguous feats, and data whose channels sit far from zero
relative to their spread (the statistics' shifted sums), then compares the output, the running
statistics and num_batches_tracked after the call, and in training the gradients of feats,
weight, bias and residual, with a float64 nn.BatchNorm1d holding the same parameters and buffers
(+ ReLU / residual in float64).  A trial fails on an exception, a NaN, or a relative error
(max |a - e| / max |e|) above its dtype's bound; `--seeds` replays failures.

    python tools/fuzz_norm.py --trials 300              # CUDA when present, else CPU
    python tools/fuzz_norm.py --seeds 12 --verbose
"""

import copy
import os
import random
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torchsp  # noqa: E402
import _fuzz  # noqa: E402

# max |a - e| / max |e| of outputs and gradients, by the data's dtype (one rounding of O(1) values,
# and float32 statistics of data up to 1e3 spreads off zero)
TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}
# the running statistics, by the vectors' dtype (they are rounded to it once a call)
STAT_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def draw(seed, device):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 5, 17, 64, 255, 1000, 4097, 30000, 131072, 300001])
    c = rng.choice([1, 2, 3, 4, 7, 8, 16, 24, 31, 32, 33, 64, 96, 100, 128, 255, 256, 384, 512])
    if n * c > 40_000_000:
        c = 64
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32]) if device == "cuda" else torch.float32
    return dict(
        n=n, c=c, dtype=dtype,
        pdtype=rng.choice([dtype, torch.float32]),
        affine=rng.random() < 0.8, track=rng.random() < 0.8,
        momentum=rng.choice([0.1, 0.1, 0.01, None]),
        train=rng.random() < 0.75,
        tail=rng.choice(["norm", "relu", "add_relu"]),
        view=rng.random() < 0.15,
        # channel centres up to `off` spreads from zero: the statistics' shifted sums (csrc/cuda/
        # batch_norm_act.cu) must not cancel; 1e3 spreads put even torch's float32 CPU kernels
        # 2.4e-4-5e-3 off float64, so that is left out
        off=rng.choice([0.0, 1.0, 30.0]),
        scale=rng.choice([1e-2, 1.0, 10.0]),
        calls=rng.choice([1, 1, 2, 3]),
    )


def rel_err(a, e, scale=0.0):
    """max |a - e| / max(max |e|, scale)."""
    a, e = a.detach().double().cpu(), e.detach().double().cpu()
    if e.numel() == 0:
        return 0.0
    return float((a - e).abs().max() / max(float(e.abs().max()), scale, 1e-30))


def run_trial(seed, device, verbose=False):
    """None when trial `seed` passes, else a one-line reason."""
    t = draw(seed, device)
    desc = f"seed {seed}: " + " ".join(f"{k} {v}" for k, v in t.items())
    if verbose:
        print(desc)
    g = torch.Generator().manual_seed(seed)
    n, c, dtype = t["n"], t["c"], t["dtype"]
    centre = (torch.rand(c, generator=g, dtype=torch.float64) * 2 - 1) * t["off"] * t["scale"]
    spread = t["scale"] * (0.5 + torch.rand(c, generator=g, dtype=torch.float64))
    coords = torch.zeros(n, 4, dtype=torch.int32)
    coords[:, 1] = torch.arange(n, dtype=torch.int32) % 1000
    coords[:, 2] = torch.arange(n, dtype=torch.int32) // 1000

    bn = torchsp.nn.BatchNorm(c, momentum=t["momentum"], affine=t["affine"], track_running_stats=t["track"])
    with torch.no_grad():
        if t["affine"]:
            bn.bn.weight.copy_(torch.randn(c, generator=g))
            bn.bn.bias.copy_(torch.randn(c, generator=g))
        if t["track"]:
            bn.bn.running_mean.copy_(centre + torch.randn(c, generator=g, dtype=torch.float64) * spread)
            bn.bn.running_var.copy_(spread ** 2 * (0.5 + torch.rand(c, generator=g, dtype=torch.float64)))
            bn.bn.num_batches_tracked.fill_(3)
    bn = bn.to(device=device, dtype=t["pdtype"])
    want = copy.deepcopy(bn.bn).cpu().double()  # the same values, as the vectors' dtype holds them
    bn.train(t["train"])
    want.train(t["train"])
    out = []
    try:
        for call in range(t["calls"]):
            x64 = centre + torch.randn(n, c, generator=g, dtype=torch.float64) * spread
            r64 = torch.randn(n, c, generator=g, dtype=torch.float64) * t["scale"]
            dy64 = torch.randn(n, c, generator=g, dtype=torch.float64)
            x = x64.to(device=device, dtype=dtype)
            if t["view"]:  # a column slice of a wider tensor
                wide = torch.full((n, c + 5), float("nan"), device=device, dtype=dtype)
                wide[:, 2:2 + c] = x
                x = wide[:, 2:2 + c]
            res = r64.to(device=device, dtype=dtype)
            grad = t["train"]
            x.requires_grad_(grad)
            res.requires_grad_(grad and t["tail"] == "add_relu")
            for p in bn.parameters():
                p.grad = None
            with torch.set_grad_enabled(grad):
                st = torchsp.SparseTensor(x, coords.to(device), check=False)
                if t["tail"] == "norm":
                    y = bn(st).feats
                elif t["tail"] == "relu":
                    y = bn.forward_relu(st).feats
                else:
                    y = bn.forward_add_relu(st, st.replace(res)).feats
                if grad:
                    y.backward(dy64.to(device=device, dtype=dtype))
            if device == "cuda":
                torch.cuda.synchronize()
            # the float64 reference on the values the trial's dtype holds
            xr = x.detach().double().cpu().requires_grad_(grad)
            rr = res.detach().double().cpu().requires_grad_(grad and t["tail"] == "add_relu")
            for p in want.parameters():
                p.grad = None
            dyr = dy64.to(dtype).double()
            with torch.set_grad_enabled(grad):
                pre = want(xr)
                if t["tail"] == "add_relu":
                    pre = pre + rr
                yr = torch.relu(pre) if t["tail"] != "norm" else pre
                if grad:
                    # Through the ReLU on the tested output's mask (y > 0, the kernels' and torch's
                    # rule): where the two pre-activations straddle 0 the float64 mask would differ.
                    gmask = dyr * (y.detach().double().cpu() > 0) if t["tail"] != "norm" else dyr
                    pre.backward(gmask)
            # Error scales where the exact result cancels to ~0 (n = 2 makes dx vanish): the size
            # of what was summed.
            xd = xr.detach()
            if t["train"] or not t["track"]:
                mean, var = xd.mean(0), xd.var(0, unbiased=False)
            else:
                mean, var = want.running_mean, want.running_var
            invstd = (var + want.eps).rsqrt()
            wv = want.weight.detach() if t["affine"] else torch.ones(c, dtype=torch.float64)
            bv = want.bias.detach() if t["affine"] else torch.zeros(c, dtype=torch.float64)
            xhat = (xd - mean) * invstd
            # y: a channel of small weight and negative bias is ~0 after the ReLU
            scales = {"y": float((wv.abs() * xhat.abs().amax(0) + bv.abs()).max()
                                 + (rr.detach().abs().max() if t["tail"] == "add_relu" else 0.0))}
            if grad:
                scales |= {"dx": float(gmask.abs().max() * (wv * invstd).abs().max()) if n else 0.0,
                          "dresidual": float(gmask.abs().max()) if n else 0.0,
                          "dweight": float((gmask * xhat).abs().sum(0).max()),
                          "dbias": float(gmask.abs().sum(0).max())}
            tol = TOL[dtype] * max(1.0, t["off"] / 10)  # x - mean loses off / 10 digits' worth
            checks = [("y", y, yr, tol)]
            if grad:
                checks.append(("dx", x.grad, xr.grad, tol))
                if t["tail"] == "add_relu":
                    checks.append(("dresidual", res.grad, rr.grad, tol))
                if t["affine"]:
                    checks += [("dweight", bn.bn.weight.grad, want.weight.grad, tol),
                               ("dbias", bn.bn.bias.grad, want.bias.grad, tol)]
            if t["track"]:
                st_tol = STAT_TOL[t["pdtype"]]
                checks += [("running_mean", bn.bn.running_mean, want.running_mean, st_tol),
                           ("running_var", bn.bn.running_var, want.running_var, st_tol)]
                if int(bn.bn.num_batches_tracked) != int(want.num_batches_tracked):
                    out.append(f"call {call}: num_batches_tracked {int(bn.bn.num_batches_tracked)} against "
                               f"{int(want.num_batches_tracked)}")
            for name, got, ref, tol in checks:
                if got is None or ref is None:
                    if (got is None) != (ref is None):
                        out.append(f"call {call}: {name} {'missing' if got is None else 'unexpected'}")
                    continue
                if not torch.isfinite(got).all():
                    out.append(f"call {call}: {name} has non-finite values")
                    continue
                err = rel_err(got, ref, scales.get(name, 0.0))
                if verbose:
                    print(f"  call {call} {name}: rel err {err:.2e} (bound {tol:.0e})")
                if err > tol:
                    out.append(f"call {call}: {name} rel err {err:.2e} > {tol:.0e}")
            if out:
                break
    except Exception as e:  # noqa: BLE001 (every exception is a finding here)
        if verbose:
            traceback.print_exc()
        return f"{desc}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return f"{desc}: {'; '.join(out)}" if out else None


def main():
    _fuzz.main("fuzz_norm", __doc__, run_trial)


if __name__ == "__main__":
    main()
