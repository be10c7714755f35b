"""The examples run end to end on CPU with small sizes (each as `python examples/<name>.py ...`)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--voxel-size", "0.8", "--half-width", "10"]


def run_example(name, *args, timeout=240, folder="examples", **env_extra):
    env = dict(os.environ, OMP_NUM_THREADS="2", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.join(REPO, folder, name), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_train_minkunet_loss_goes_down(amp):
    steps = "8" if amp == "none" else "5"  # bf16 autocast is slow on CPU
    out = run_example("train_minkunet.py", "--steps", steps, "--log-every", "4", "--amp", amp, *SMALL)
    assert "loss went down: True" in out


def test_infer_prints_timings():
    out = run_example("infer.py", "--repeats", "1", "--cr", "0.25", *SMALL)
    assert "minkunet" in out and "resnet21d" in out and "training step" in out


def test_export_reloads_in_fresh_process():
    out = run_example("export.py", "--steps", "2")
    assert "fresh process" in out and "max abs difference" in out


def test_ddp_gradients_match_single_process():
    out = run_example("ddp.py", "--voxel-size", "0.8")
    assert "gradients match: True" in out


def _run_tool(name, *args):
    return run_example(name, *args, timeout=400, folder="tools",
                       TORCHSP_CACHE_DIR=os.path.join(REPO, "build", "tool_test_cache"))


def _needs_scan():
    """Skip unless the tools' scan is there (tools/bench.py find_data's places)."""
    data = [os.path.join(REPO, "..", "shared", "data", "lidar_198k.npz"),
            os.path.join(REPO, "shared", "data", "lidar_198k.npz"),
            os.path.join(REPO, "torchsp", "data", "lidar_198k.npz")]
    if not any(os.path.exists(p) for p in data):
        pytest.skip("needs shared/data/lidar_198k.npz")


def _load_tool(name):
    """tools/<name>.py as a module (tools/ is no package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_tools_run_on_cpu():
    """The benchmark tools' CPU smoke tests (the GPU runs use the same code paths)."""
    _needs_scan()
    out = _run_tool("bench.py", "--device", "cpu", "--dtype", "fp32", "--voxel-scale", "20", "--iters", "1",
                    "--warmup", "0", "--peers", "none", "--layers", "subm3_c32", "--algos", "0", "auto", "--zero-grad",
                    "--autograd-single-thread")
    assert "torchsp auto" in out and "tuned fwd" in out and "# compact" in out
    assert "with .grad set to None before each call" in out and "backward on the calling thread" in out
    out = _run_tool("bench.py", "--device", "cpu", "--dtype", "fp32", "--voxel-scale", "20", "--iters", "1",
                    "--warmup", "0", "--peers", "none", "--layers", "subm3_c32", "down2_c64", "--algos", "0",
                    "--budget", "0")
    compact = out.split("# compact")[1]
    assert "layers not run: down2_c64" in out and "subm3_c32" in compact and "down2_c64" not in compact
    out = _run_tool("bench_models.py", "--device", "cpu", "--dtype", "float32", "--voxel-size", "1.0",
                    "--repeats", "1", "--models", "resnet21d", "--fixed", "os-sorted")
    assert "search: end-to-end forward" in out and "ratio" in out


def test_peer_layer_row_orders():
    """tools/peers.py's PeerLayer puts rows in and out of a peer's own orders outside the timed
    calls: forward() must return torchsp's output order, dy_peer() the peer's."""
    peers = _load_tool("peers")
    g = torch.Generator().manual_seed(3)
    n = 11
    in_perm = torch.randperm(n, generator=g)       # peer input row j = torchsp input row in_perm[j]
    out_order = torch.randperm(n, generator=g)     # peer output row j = torchsp output row out_order[j]
    perm = torch.argsort(out_order)                # theirs[perm] == ours

    def call(feats_peer):                          # a peer computing y = 2x in its own row orders
        ours = torch.empty_like(feats_peer)
        ours[in_perm] = feats_peer
        return (2 * ours)[out_order]
    pl = peers.PeerLayer(call, None, perm, "", in_perm)
    x = torch.randn(n, 4, generator=g)
    assert torch.equal(pl.forward(x), 2 * x)
    dy = torch.randn(n, 4, generator=g)
    assert torch.equal(pl.dy_peer(dy), dy[out_order])
    # a peer whose output rows come in a new order each call (spconv's strided convs on the GPU):
    # forward() takes its `ordered` check, which lines up each call's own rows
    orders = iter([torch.randperm(n, generator=g) for _ in range(2)])

    def shuffled(feats_peer):                      # -> (out feats, torchsp row of each out row)
        ours = torch.empty_like(feats_peer)
        ours[in_perm] = feats_peer
        o = next(orders)
        return (2 * ours)[o], o
    pl = peers.PeerLayer(lambda f: shuffled(f)[0], None, perm, "", in_perm,
                         ordered=lambda f: (lambda y, o: y[torch.argsort(o)])(*shuffled(f)))
    assert torch.equal(pl.forward(x), 2 * x)
    with pytest.raises(peers.PeerUnavailable, match="takes no variant"):
        peers.build("flexgemm:1", {})
    with pytest.raises(peers.PeerUnavailable, match="unknown peer"):
        peers.build("nope", {})


def test_mask_waste_counts_tiles():
    """tools/mask_waste.py: tile products against a direct count, and the CLI on the scan."""
    mw = _load_tool("mask_waste")
    rng = np.random.default_rng(5)
    mask = rng.random((203, 9)) < 0.3
    order = rng.permutation(203)
    cols = rng.random(9) < 0.6
    want = sum(4 * int(mask[order[i:i + 4]][:, cols].any(0).sum()) for i in range(0, 203, 4))
    assert mw.tile_products(mask, order, cols, 4) == want
    # with a tile of one row, an order computes exactly its rows' pairs
    assert mw.tile_products(mask, order, cols, 1) == int(mask[:, cols].sum())
    assert mw.bits([True, False, True]) == 5
    _needs_scan()
    out = _run_tool("mask_waste.py", "--voxel-sizes", "0.4", "--densities", "0.3", "0.2")
    assert "one segment, torchsp's mask order: computed" in out and "sparse seg" in out
