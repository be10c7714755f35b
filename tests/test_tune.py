"""The autotuner on the CPU: measuring, eligibility, the on-disk cache, compile-time reads.

The CPU backend has two forward/dgrad dataflows (output- and weight-stationary),
so CI exercises the same code path the GPU uses.  Outputs of tuned layers are
checked against the float64 pure-PyTorch reference, not against another dataflow.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import torchsp
from torchsp import tune
from torchsp.reference import reference_conv3d


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHSP_CACHE_DIR", str(tmp_path))
    tune.clear(memory_only=True)
    yield tmp_path
    tune.clear(memory_only=True)
    tune.set_mode("cache")


def _input(n=400, c=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    coords = torch.unique(torch.cat([torch.randint(0, 2, (n, 1), generator=g),
                                     torch.randint(-8, 8, (n, 3), generator=g)], 1), dim=0).int()
    return torchsp.SparseTensor(torch.randn(coords.shape[0], c, generator=g, dtype=torch.float64), coords)


def _net():
    return torch.nn.Sequential(torchsp.nn.SparseConv3d(8, 16, 3), torchsp.nn.SparseConv3d(16, 16, 2, stride=2),
                               torchsp.nn.SparseConv3d(16, 8, 2, stride=2, transposed=True)).double()


def test_tune_caches_every_group_and_matches_reference(cache_dir):
    net, x = _net(), _input()
    tuned = tune.tune(net, (x,), verbose=False)
    assert len(tuned) == 3
    for entry in tuned.values():
        for p in tune.PASSES:
            assert entry[p] in tune.candidates("cpu", p)
            # Every CPU candidate was timed: weight-stationary is a CPU kernel of its own (conv.c),
            # not a CUDA segment plan that float64 would skip.
            timed = sorted(str(a) for a, _ in entry["ranked"][p])
            assert timed == sorted(str(a) for a in tune.candidates("cpu", p)), (p, timed)
    on_disk = json.loads((cache_dir / "tune.json").read_text())["choices"]
    assert set(tuned) <= set(on_disk)
    # Tuned run reads the cache and still matches the float64 reference.
    tune.set_mode("cache")
    y = net[0](x)
    ref, _, _ = reference_conv3d(x.feats, x.coords, (1, 1, 1), net[0].weight.detach(), 3)
    assert torch.allclose(y.feats, ref, atol=1e-9)


def test_cli_prints_cached_choices(cache_dir):
    tune.tune(_net(), (_input(),), verbose=False)
    env = dict(os.environ, TORCHSP_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-m", "torchsp.tune"], env=env, capture_output=True, text=True, check=True)
    assert "3 cached choices" in out.stdout or "cached choices" in out.stdout
    assert "fwd" in out.stdout


def test_off_mode_uses_default(cache_dir):
    tune.set_mode("off")
    x = _input()
    conv = torchsp.nn.SparseConv3d(8, 4, 3).double()
    kmap, *_ = torchsp.kmap.get_kernel_map(x, 3)
    assert tune.choose_algo(x, kmap, torchsp.kmap.ConvGeometry(3), conv.weight) is None


def test_env_mode_read_once_and_set_mode_wins(monkeypatch):
    """$TORCHSP_TUNE gives the mode when set_mode() has not; it is read at the first call only
    (os.environ.get of an unset variable cost ~1.6 us a layer call), and set_mode() overrides it."""
    monkeypatch.setitem(tune._state, "mode", None)
    monkeypatch.setitem(tune._state, "env_mode", tune._ENV_UNREAD)
    monkeypatch.delenv("TORCHSP_TUNE", raising=False)
    assert tune.get_mode("cuda") == "auto" and tune.get_mode("cpu") == "cache"
    monkeypatch.setenv("TORCHSP_TUNE", "off")
    assert tune.get_mode("cuda") == "auto"  # read at the first call: unset then
    monkeypatch.setitem(tune._state, "env_mode", tune._ENV_UNREAD)
    assert tune.get_mode("cuda") == "off" and tune.get_mode("cpu") == "off"
    monkeypatch.setitem(tune._state, "mode", "cache")
    assert tune.get_mode("cuda") == "cache"
    x = _input()
    conv = torchsp.nn.SparseConv3d(8, 4, 3).double()
    kmap, *_ = torchsp.kmap.get_kernel_map(x, 3)
    monkeypatch.setitem(tune._state, "mode", None)
    assert tune.choose_algo(x, kmap, torchsp.kmap.ConvGeometry(3), conv.weight) is None  # "off"


def test_candidate_rejected_when_output_differs(cache_dir, monkeypatch):
    # A candidate that computes something else must never be chosen, however fast.
    real = tune._tune_pass

    def poisoned(pass_name, run, device, dtype, algos, setup_cost=None):
        def bad_run(a):
            out = run(a)
            return out * 2 if a[0] == 1 else out
        return real(pass_name, bad_run, device, dtype, algos, setup_cost)

    monkeypatch.setattr(tune, "_tune_pass", poisoned)
    tuned = tune.tune(torchsp.nn.SparseConv3d(8, 8, 3).double(), (_input(),), verbose=False)
    (entry,) = tuned.values()
    assert entry["fwd"][0] == 0 and entry["dgrad"][0] == 0


def test_deterministic_mode_filters_candidates(monkeypatch):
    """Every CUDA dataflow is atomic-free (segmented plans add in order, split-K's slabs are
    summed in index order), so all stay eligible under deterministic algorithms, gather-GEMM-scatter
    (cuBLAS) only where torch lets cuBLAS run in that mode (CUBLAS_WORKSPACE_CONFIG set); a dataflow
    a backend declares nondeterministic is dropped."""
    every = tune.candidates("cuda", "fwd", (3, 3, 3))
    assert {a[0] for a in every} == {0, 1, 2, 3, 4}
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert tune.candidates("cuda", "fwd", (3, 3, 3), deterministic=True) == [a for a in every if a[0] != 4]
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert tune.candidates("cuda", "fwd", (3, 3, 3), deterministic=True) == every
    tune._NONDETERMINISTIC["cuda"].add(1)
    try:
        kept = tune.candidates("cuda", "fwd", (3, 3, 3), deterministic=True)
        assert kept and all(a[0] != 1 for a in kept)
    finally:
        tune._NONDETERMINISTIC["cuda"].discard(1)


def test_cached_choice_needs_no_map_statistics(cache_dir):
    """With one cached entry for a layer's shape and rows bucket, a fresh KernelMap (a new batch)
    gets its choice without computing the mean-neighbours statistic (a host sync on CUDA)."""
    net, x = _net(), _input()
    tune.tune(net, (x,), verbose=False)
    tune.set_mode("cache")
    fresh = torchsp.SparseTensor(x.feats.clone(), x.coords.clone())  # new coordinate key, new maps
    kmap, *_ = torchsp.kmap.get_kernel_map(fresh, 3)
    assert getattr(kmap, "stats", None) is None
    algo = tune.choose_algo(fresh, kmap, torchsp.kmap.ConvGeometry(3), net[0].weight)
    assert algo is not None and getattr(kmap, "stats", None) is None
    key = tune.signature(fresh.feats, kmap, torchsp.kmap.ConvGeometry(3), net[0].weight)
    assert algo == [tune._choices()[key][p] for p in tune.PASSES]


def test_neighbour_buckets_that_agree_need_no_statistics(cache_dir):
    """Two cached entries for one shape and rows bucket (different neighbour buckets): when they
    chose alike the choice is used without the statistic; when they differ it is computed."""
    net, x = _net(), _input()
    tune.tune(net, (x,), verbose=False)
    tune.set_mode("cache")
    geom = torchsp.kmap.ConvGeometry(3)
    fresh = torchsp.SparseTensor(x.feats.clone(), x.coords.clone())
    kmap, *_ = torchsp.kmap.get_kernel_map(fresh, 3)
    key = tune.signature(fresh.feats, kmap, geom, net[0].weight)
    kmap.stats = None
    other = key.rsplit("|", 1)[0] + "|n99"
    tune._choices()[other] = dict(tune._choices()[key])
    tune._memo.clear()  # written behind the tuner's back
    algo = tune.choose_algo(fresh, kmap, geom, net[0].weight)
    assert algo == [tune._choices()[key][p] for p in tune.PASSES] and kmap.stats is None
    tune._choices()[other] = dict(tune._choices()[key], fwd=[0, 1, 0, 0] if tune._choices()[key]["fwd"] != [0, 1, 0, 0]
                                  else [0, 0, 0, 0])
    tune._memo.clear()
    fresh2 = torchsp.SparseTensor(x.feats.clone(), x.coords.clone())
    kmap2, *_ = torchsp.kmap.get_kernel_map(fresh2, 3)
    algo2 = tune.choose_algo(fresh2, kmap2, geom, net[0].weight)
    assert getattr(kmap2, "stats", None) is not None
    assert algo2 == [tune._choices()[key][p] for p in tune.PASSES]


def _tuned_first_layer():
    """_net() tuned (per-layer phase) and the cache mode set; its first layer on a fresh copy of
    _input() (new coordinate key, new map): (geom, weight, input, KernelMap, signature)."""
    net, x = _net(), _input()
    tune.tune(net, (x,), verbose=False, search=False)
    tune.set_mode("cache")
    geom = torchsp.kmap.conv_geometry(3)
    w = net[0].weight.detach()
    fresh = torchsp.SparseTensor(x.feats.clone(), x.coords.clone())
    kmap, *_ = torchsp.kmap.get_kernel_map(fresh, 3)
    return geom, w, fresh, kmap, tune.signature(fresh.feats, kmap, geom, w)


def test_memo_choice_checked_once(cache_dir):
    """choose_algo's memo hands torchsp.functional a CheckedChoice, which it runs without
    reshaping; the layer's output still matches the float64 reference.  A cache entry that is not
    three lists of four ints (edited by hand) stays a plain list, which sparse_conv3d checks on
    every call: a wrong length raises a ValueError naming algo."""
    geom, w, fresh, kmap, key = _tuned_first_layer()
    algo = tune.choose_algo(fresh, kmap, geom, w)
    assert type(algo) is tune.CheckedChoice and algo == [tune._choices()[key][p] for p in tune.PASSES]
    y = torchsp.functional.sparse_conv3d(fresh, w, 3)
    ref, _, _ = reference_conv3d(fresh.feats, fresh.coords, (1, 1, 1), w, 3)
    assert torch.allclose(y.feats, ref, atol=1e-9)
    for bad in ([0, 0, 0], [0, 0, 0, 0.5], (0, 0, 0, 0)):
        tune._choices()[key] = dict(tune._choices()[key], fwd=bad)
        tune._memo.clear()  # written behind the tuner's back
        algo = tune.choose_algo(fresh, kmap, geom, w)
        assert type(algo) is list, bad
        if len(bad) != 4:
            with pytest.raises(ValueError, match="algo must be"):
                torchsp.functional.sparse_conv3d(fresh, w, 3)


def test_map_memo_follows_the_tuner(cache_dir):
    """A KernelMap's own memo of choose_algo (KernelMap.tune_memo) answers repeat calls, and
    never with a stale choice: a choice written since (the shared memo cleared) is read again, a
    weight of other channel counts on the same map has an entry of its own, and set_mode applies
    at once."""
    geom, w, fresh, kmap, key = _tuned_first_layer()
    first = tune.choose_algo(fresh, kmap, geom, w)
    assert first is not None and tune.choose_algo(fresh, kmap, geom, w) is first
    new_fwd = [1, 0, 0, 0] if first[0] != [1, 0, 0, 0] else [0, 0, 0, 0]
    tune._choices()[key] = dict(tune._choices()[key], fwd=new_fwd)
    tune._memo.clear()  # written behind the tuner's back, as tune() and choose_algo clear it
    again = tune.choose_algo(fresh, kmap, geom, w)
    assert again is not first and again[0] == new_fwd
    wide = torch.zeros(27, 8, 24, dtype=w.dtype)  # no cached choice for 8 -> 24 channels
    assert tune.choose_algo(fresh, kmap, geom, wide) is None
    assert tune.choose_algo(fresh, kmap, geom, w)[0] == new_fwd
    tune.set_mode("off")
    assert tune.choose_algo(fresh, kmap, geom, w) is None


# ------------------------------------------------------------ end-to-end search ---

def _fake_problem():
    """Three units whose per-layer ranking misleads: alone, algo B looks fastest everywhere, but in
    the model B costs an extra 5 per unit that uses it (a sync, say), so only unit u2 gains."""
    A, B, C = [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]
    cost = {("u0", "fwd"): {str(A): 10, str(B): 9, str(C): 12},
            ("u1", "fwd"): {str(A): 20, str(B): 18, str(C): 19},
            ("u2", "fwd"): {str(A): 30, str(B): 20, str(C): 40}}
    penalty = {str(A): 0, str(B): 5, str(C): 0}
    calls = []

    def objective(cfg):
        calls.append(dict(cfg))
        return float(sum(cost[u][str(a)] + penalty[str(a)] for u, a in cfg.items()))

    ranked = {u: sorted((c - (1 if str(a) == str(B) else 0), a) for a, c in ((A, t[str(A)]), (B, t[str(B)]), (C, t[str(C)])))
              for u, t in cost.items()}
    current = {u: list(r[0][1]) for u, r in ranked.items()}  # per-layer winners: B everywhere
    return objective, current, ranked, calls, (A, B, C)


def test_greedy_search_beats_per_layer_and_every_single_dataflow():
    from torchsp.tune_search import greedy
    objective, current, ranked, calls, (A, B, C) = _fake_problem()
    best, best_t, trials = greedy(objective, current, ranked, budget_s=60, spread=10.0, always=[A])
    # Per-layer B,B,B = 9+18+20+15 = 62; single A = 60; single C = 71; optimum A,C,B = 10+19+25 = 54.
    assert trials[0][1] == 62.0
    assert best == {("u0", "fwd"): A, ("u1", "fwd"): C, ("u2", "fwd"): B}
    assert best_t == 54.0 == objective(best)
    singles = [t for name, t, *_ in trials if name.startswith("single")]
    assert singles and best_t <= min(singles)


def test_greedy_search_respects_budget_and_spread():
    from torchsp.tune_search import greedy
    objective, current, ranked, calls, (A, B, C) = _fake_problem()
    ticks = iter(range(1000))
    best, best_t, trials = greedy(objective, current, ranked, budget_s=0.5, clock=lambda: next(ticks))
    assert len(calls) == 1 and best == current  # only the starting point fits in the budget
    calls.clear()
    # spread 1.0: only each unit's per-layer winner is promising, so after the start only the
    # single dataflows run (A and C; B is the start), the likeliest first: A predicts 60, C 71.
    # Then each unit tries its winner B again (heaviest first): u2 gains, u1 and u0 do not.
    best, best_t, trials = greedy(objective, current, ranked, budget_s=60, spread=1.0)
    assert [name for name, *_ in trials][:3] == ["per-layer choices", f"single {A}", f"single {C}"]
    assert len(calls) == 6 and best_t == 55.0
    assert best == {("u0", "fwd"): A, ("u1", "fwd"): A, ("u2", "fwd"): B}


def test_tune_search_on_a_model_restores_state_and_matches_reference(cache_dir):
    x = _input()
    net = torchsp.nn.Sequential(torchsp.nn.SparseConv3d(8, 16, 3), torchsp.nn.BatchNorm(16),
                                torchsp.nn.SparseConv3d(16, 8, 3)).double()
    net.train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    tuned = tune.tune(net, (x,), verbose=False, train=True, budget_s=30, repeat=1)
    assert len(tuned) == 2  # two channel pairs on one map
    res = tune.last_search()
    assert res is not None and "fwd" in res and "dgrad" in res
    assert res["fwd"]["best"] <= res["fwd"]["start"] and res["dgrad"]["best"] <= res["dgrad"]["start"]
    for e in tuned.values():
        assert e["fwd"] in tune.candidates("cpu", "fwd") and e["dgrad"] in tune.candidates("cpu", "dgrad")
        assert [a for a, _ in e["ranked"]["fwd"]], "per-layer ranking kept for later searches"
    # BatchNorm statistics and gradients are as before, training mode kept.
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert net.training and all(p.grad is None for p in net.parameters())
    # The searched choices run and still match the float64 reference.
    tune.set_mode("cache")
    conv = net[0]
    y = conv(x)
    ref, _, _ = reference_conv3d(x.feats, x.coords, (1, 1, 1), conv.weight.detach(), 3)
    assert torch.allclose(y.feats, ref, atol=1e-9)


def test_passes_that_win_keeps_only_clear_wins():
    """The last check of a search: a pass keeps its searched units only when the model, run as
    a user runs it, is more than 1% faster with them than with the default everywhere."""
    from torchsp.tune_search import passes_that_win
    med = {"tuned": (0.90, 2.10), "default": (1.00, 2.00)}
    assert passes_that_win(med, train=True) == ["fwd"]
    assert passes_that_win(med, train=False) == ["fwd"]
    assert passes_that_win({"tuned": (1.00, 1.0), "default": (1.005, 1.2)}, train=True) == ["dgrad"]
    assert passes_that_win({"tuned": (1.2, 3.0), "default": (1.0, 2.0)}, train=True) == []


@pytest.mark.parametrize("default_wins_as_used", [True, False])
def test_search_goes_back_to_default_when_it_loses_as_used(cache_dir, monkeypatch, default_wins_as_used):
    """Timings faked: per layer and in the search weight-stationary wins; in the final
    interleaved forward + training-step check either the default wins (every searched unit
    goes back to it) or weight-stationary still wins (kept)."""
    import torchsp.tune_search as ts
    x = _input()
    net = torchsp.nn.Sequential(torchsp.nn.SparseConv3d(8, 16, 3), torchsp.nn.SparseConv3d(16, 8, 3)).double()
    state = {"confirms": 0}
    real_pass, real_confirm = tune._tune_pass, ts.confirm

    def ws_first(pass_name, run, device, dtype, algos, setup_cost=None):
        _, _, _, ranked = real_pass(pass_name, run, device, dtype, algos, setup_cost)
        ranked = [(2e-3, a) for _, a in ranked]
        if pass_name != "wgrad":  # float64 on CPU lists no weight-stationary candidate: add one
            ranked.insert(0, (1e-3, [1, 0, 0, 0]))
        return ranked[0][1], ranked[0][0], 2e-3, ranked

    def counted_confirm(*args, **kwargs):
        out = real_confirm(*args, **kwargs)
        state["confirms"] += 1
        return out

    def fake_time(fn, device, repeat):
        fn()
        ws = any(e["fwd"][0] == 1 or e["dgrad"][0] == 1 for k, e in tune._choices().items() if "|r" in k)
        as_used = state["confirms"] >= 2  # both passes searched and confirmed
        return 1.0 if ws != (as_used and default_wins_as_used) else 2.0

    monkeypatch.setattr(tune, "_tune_pass", ws_first)
    # per layer weight-stationary wins its confirmation too (the real one would time it)
    monkeypatch.setattr(tune, "_confirm_pass", lambda run, device, default, best, setup_cost=None: (best, 1e-3, 2e-3))
    monkeypatch.setattr(ts, "confirm", counted_confirm)
    monkeypatch.setattr(tune, "_time_model", fake_time)
    net.train()
    tuned = tune.tune(net, (x,), verbose=False, train=True, budget_s=30, repeat=1)
    res = tune.last_search()
    assert state["confirms"] == 2 and "as used" in res
    assert res["as used"]["kept"] == ([] if default_wins_as_used else ["fwd", "dgrad"])
    units = [e[p] for e in tuned.values() for p in ("fwd", "dgrad")]
    if default_wins_as_used:
        assert all(a == [0, 0, 0, 0] for a in units)
    else:  # the searched units stay (the search may keep the default in some of them)
        assert any(a == [1, 0, 0, 0] for a in units)
    assert net.training


def test_confirm_remeasures_finalists_and_prefers_the_default_on_ties():
    from torchsp.tune_search import confirm
    true = {"a": 10.0, "b": 9.0, "c": 9.05}
    noise = iter([3.0, -2.0, 0.0, 0.0, 0.0, 0.0, -0.5, 4.0, 0.0] * 5)
    calls = []

    def once(cfg):
        calls.append(cfg["u"])
        return true[cfg["u"]] + next(noise) * 0.01
    win, med = confirm(once, {"searched": {"u": "b"}, "default": {"u": "c"}, "per-layer": {"u": "a"},
                              "same as searched": {"u": "b"}}, rounds=5, prefer="default", margin=0.01)
    assert set(med) == {"searched", "default", "per-layer"} and len(calls) == 15  # duplicates measured once
    assert win == "default"  # 9.05 is within 1% of 9.0
    win, _ = confirm(once, {"searched": {"u": "b"}, "default": {"u": "a"}}, rounds=3, prefer="default")
    assert win == "searched"  # the default is 11% slower


_RANK_SCRIPT = r"""
import json, os, sys
import torch
import torch.distributed as dist
import torchsp
from torchsp import tune

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
if rank == 0:  # rank 0's measurement: a choice no default would give
    tune._measure = lambda feats, kmap, geom, weight: (
        {"fwd": [1, 0, 0, 0], "dgrad": [1, 0, 0, 0], "wgrad": [0, 0, 0, 0]}, 0.0, {})
else:
    def _measure(*args):
        raise AssertionError("rank 1 measured")
    tune._measure = _measure
tune.set_mode("auto")
g = torch.Generator().manual_seed(0)
c = torch.cat([torch.zeros(300, 1, dtype=torch.long), torch.randint(-6, 6, (300, 3), generator=g)], 1)
coords = torch.unique(c, dim=0).int()
x = torchsp.SparseTensor(torch.randn(coords.shape[0], 8, generator=g, dtype=torch.float64), coords)
w = torch.randn(27, 8, 8, generator=g, dtype=torch.float64)
km = torchsp.kmap.get_kernel_map(x, 3)[0]
got = tune.choose_algo(x, km, torchsp.kmap.ConvGeometry(3), w)
print(json.dumps({"rank": rank, "choice": got}), flush=True)
# Not destroy_process_group(): on torch 2.4 it deadlocks now and then with gloo (its worker
# thread frees a tensor and waits for the GIL the main thread holds while joining it).
dist.barrier()
sys.stderr.flush()
os._exit(0)
"""


def test_ranks_agree_under_distributed(tmp_path):
    """Two gloo ranks tune the same unseen layer in auto mode: only rank 0 measures, and rank 1
    ends up with rank 0's choice (broadcast), so a cold tune cannot make ranks diverge."""
    import socket
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHSP_CACHE_DIR=str(tmp_path / f"cache{rank}"),
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        finally:
            p.kill()
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    want = [[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert [o["choice"] for o in sorted(outs, key=lambda o: o["rank"])] == [want, want]


def test_per_layer_pass_ranks_a_clearly_slow_candidate_on_one_call(monkeypatch):
    """_tune_pass times a candidate once when that first call is over _PRUNE x the best so far;
    every eligible candidate stays ranked, fastest first.  The clock is replaced by each
    candidate's nominal time (sleeps made this flaky on a loaded 15-worker GPU host)."""
    A, B, C = [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]
    delay = {str(A): 0.002, str(B): 0.02, str(C): 0.0025}
    calls = {str(a): 0 for a in (A, B, C)}
    out = torch.ones(3)
    last = []

    def run(a):
        calls[str(a)] += 1
        last.append(str(a))
        return out

    def timings(fn, device, repeat):
        times = []
        for _ in range(repeat):
            fn()
            times.append(delay[last[-1]])
        return sorted(times)

    monkeypatch.setattr(tune, "_timings", timings)
    best, best_t, default_t, ranked = tune._tune_pass("fwd", run, torch.device("cpu"), torch.float32, [A, B, C])
    assert best == A and [a for _, a in ranked] == [A, C, B]
    assert calls[str(B)] == 1 + 1  # the check (the warm-up), then one timed call
    assert calls[str(C)] == 1 + 5  # within _PRUNE of A: all five timed calls
    assert ranked[-1][0] > 5 * best_t


@pytest.mark.parametrize("best_s, setup_s, chosen", [(0.0019, 0.0, "best"), (0.00199, 0.0, "default"),
                                                     (0.001, 0.0015, "default")])
def test_confirm_keeps_the_default_unless_clearly_beaten(monkeypatch, best_s, setup_s, chosen):
    """After the sweep, its fastest candidate and the default are timed one call at a time in
    alternation; the default stays unless beaten by more than _CONFIRM_MARGIN (2%), each charged
    its setup cost.  A nominal clock, as above: best 5% faster wins, 0.5% does not, nor a faster
    kernel whose plan costs more than it saves."""
    D, B = [0, 0, 0, 0], [1, 0, 0, 0]
    delay = {str(D): 0.002, str(B): best_s}
    order = []

    def run(a):
        order.append(str(a))

    def timings(fn, device, repeat):
        fn()
        return [delay[order[-1]]] * repeat

    monkeypatch.setattr(tune, "_timings", timings)
    got, got_t, default_t = tune._confirm_pass(run, torch.device("cpu"), D, B,
                                               lambda a: setup_s if a == B else 0.0)
    assert got == (B if chosen == "best" else D)
    assert default_t == 0.002 and got_t == (best_s + setup_s if chosen == "best" else 0.002)
    assert order == [str(D), str(B)] * tune._CONFIRM_ROUNDS


def test_measure_confirms_the_sweeps_pick(cache_dir, monkeypatch):
    """Every pass whose sweep picked another candidate than the default goes through
    _confirm_pass, and its verdict is what gets cached."""
    real = tune._tune_pass

    def drifted(pass_name, run, device, dtype, algos, setup_cost=None):
        best, best_t, default_t, ranked = real(pass_name, run, device, dtype, algos, setup_cost)
        if len(algos) == 1:
            return best, best_t, default_t, ranked
        return algos[-1], default_t / 2, default_t, ranked  # a drifted clock ranked the last first

    confirmed = []

    def verdict(run, device, default, best, setup_cost=None):
        confirmed.append(list(best))
        return default, 1.0, 1.0

    monkeypatch.setattr(tune, "_tune_pass", drifted)
    monkeypatch.setattr(tune, "_confirm_pass", verdict)
    tuned = tune.tune(torchsp.nn.SparseConv3d(8, 8, 3).double(), (_input(),), verbose=False, search=False)
    (entry,) = tuned.values()
    several = [p for p in tune.PASSES if len(tune.candidates("cpu", p, (3, 3, 3))) > 1]
    assert several and confirmed == [tune.candidates("cpu", p, (3, 3, 3))[-1] for p in several]
    for p in tune.PASSES:
        assert entry[p] == tune.candidates("cpu", p, (3, 3, 3))[0], p


def test_split_k_timed_only_for_few_tiles():
    """The tuner times split-K (dataflow 3) only for passes with no more 128-row tiles than the GPU
    has SMs; never on the CPU, which has no split-K kernel of its own."""
    assert not tune._few_tiles(10, torch.device("cpu"))
    if torch.cuda.is_available():
        d = torch.device("cuda", 0)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert tune._few_tiles(sms * 128, d) and not tune._few_tiles(sms * 128 + 1, d)


def test_measure_times_finite_stand_ins_and_keeps_the_rng(cache_dir, monkeypatch):
    """The sweep's reference output of every pass is finite even where the real features would
    overflow it (a stem's coordinates in metres, summed by wgrad over every row in float16, made
    it inf, and _close then turned every other candidate away), and tuning leaves the caller's
    random stream where it was."""
    real = tune._tune_pass
    refs = {}

    def watched(pass_name, run, device, dtype, algos, setup_cost=None):
        refs[pass_name] = run(algos[0])
        return real(pass_name, run, device, dtype, algos, setup_cost)

    monkeypatch.setattr(tune, "_tune_pass", watched)
    x = _input(n=3000, c=4)
    huge = x.replace(torch.full_like(x.feats, 6.0e4).half())  # every row at float16's edge
    conv = torchsp.nn.SparseConv3d(4, 8, 3).half()
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    tune.tune(conv, (huge,), verbose=False, search=False)
    assert torch.equal(torch.rand(3), before)
    assert set(refs) == set(tune.PASSES)
    for p, out in refs.items():
        assert torch.isfinite(out).all(), p
