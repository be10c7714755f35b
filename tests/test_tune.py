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


def test_deterministic_mode_filters_candidates():
    """Every CUDA dataflow is atomic-free (segmented plans add in order), so all stay eligible
    under deterministic algorithms; a dataflow a backend declares nondeterministic is dropped."""
    every = tune.candidates("cuda", "fwd", (3, 3, 3))
    assert {a[0] for a in every} == {0, 1, 2}
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
