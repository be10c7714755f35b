"""The examples run end to end on CPU with small sizes (each as `python examples/<name>.py ...`)."""

import os
import subprocess
import sys
import time

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
                    "--autograd-single-thread", "--settle-ms", "1")
    assert "torchsp auto" in out and "tuned fwd" in out and "# compact" in out
    assert "with .grad set to None before each call" in out and "backward on the calling thread" in out
    pipelined = out.split("# pipelined")[1]  # timeit_pipelined's table, after the compact one
    assert "subm3_c32" in pipelined and "fwd pipe" in out and "fb host" in out
    out = _run_tool("bench.py", "--device", "cpu", "--dtype", "fp32", "--voxel-scale", "20", "--iters", "1",
                    "--warmup", "0", "--peers", "none", "--layers", "down2_c64", "subm3_c32", "--algos", "0",
                    "--budget", "0")
    compact = out.split("# compact")[1]  # layers run in the order given: down2 first, then the budget stops
    assert "layers not run: subm3_c32" in out and "down2_c64" in compact and "subm3_c32" not in compact
    with pytest.raises(AssertionError, match=r"unknown --layers \['subm3_c33'\]"):
        _run_tool("bench.py", "--device", "cpu", "--peers", "none", "--layers", "subm3_c33")
    out = _run_tool("bench_models.py", "--device", "cpu", "--dtype", "float32", "--voxel-size", "1.0",
                    "--repeats", "1", "--models", "resnet21d", "--fixed", "os-sorted")
    assert "search: end-to-end forward" in out and "ratio" in out


def test_bench_round_order_groups_phases_and_rotates():
    """bench.round_order: a round times every implementation's fwd, then every fb, ...; the
    implementations' order turns by one each round; an implementation without a phase (a peer's
    fwd op) is skipped there."""
    bench = _load_tool("bench")
    a, b, c = {"n": "a"}, {"n": "b"}, {"n": "c"}
    timers = [(a, "fwd", None, False), (a, "op", None, False), (a, "fb", None, True),
              (b, "fwd", None, False), (b, "op", None, False), (b, "fb", None, True),
              (c, "fwd", None, False), (c, "fb", None, True)]

    def order(rnd):
        return " ".join(t[0]["n"] + ":" + t[1] for t in bench.round_order(timers, rnd))
    assert order(0) == "a:fwd b:fwd c:fwd a:op b:op a:fb b:fb c:fb"
    assert order(1) == "b:fwd c:fwd a:fwd b:op a:op b:fb c:fb a:fb"
    assert order(2) == "c:fwd a:fwd b:fwd a:op b:op c:fb a:fb b:fb"
    assert order(3) == order(0)


def test_bench_floor_counts_a_row_index_per_pair():
    """bench.make_layer's floor bytes: features in and out and the weights once, plus 4 bytes per
    pair, the pairs counted here through the pure-PyTorch reference map on the real scan (not
    the map bench.py built), and not the [N_out, V] map's empty slots: the submanifold map of
    the scan has most of its 27 slots empty.  DESIGN.md section 7's worked case, a 32-channel
    layer at 173k voxels with ~3.5 pairs a row, floors at ~8 us."""
    _needs_scan()
    from argparse import Namespace

    from torchsp.geometry import kernel_offsets
    from torchsp.reference import reference_kernel_map
    bench = _load_tool("bench")
    assert bench.compulsory_bytes(2, 10, 7, 3, 5, 27, 40) == 2 * (30 + 35 + 27 * 15) + 160
    b = bench.compulsory_bytes(2, 173000, 173000, 32, 32, 27, int(3.5 * 173000))
    assert 7.9 < b / bench.BANDWIDTH * 1e6 < 8.6, b
    args = Namespace(data=bench.find_data(None), voxel_scale=8)
    x, kw, w, km, sz, _ = bench.make_layer("subm3_c32", "subm", 3, 32, 32, 0.05, args, torch.device("cpu"),
                                           torch.float32)
    ref = reference_kernel_map(x.coords, x.coords, kernel_offsets((3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)), 1)
    pairs = int((ref >= 0).sum())
    n = x.coords.shape[0]
    assert 0 < pairs < 27 * n // 2  # most slots empty: the two counts differ
    assert sz["pairs"] == pairs and sz["n_in"] == sz["n_out"] == n
    assert sz["B"] == 4 * (n * 32 + n * 32 + 27 * 32 * 32) + 4 * pairs


def test_bench_whole_times_torchsp_beside_a_peer(monkeypatch, capsys):
    """tools/bench_whole.py on CPU: a forward and a training-step row per batch with the peer's
    time beside torchsp's.  No peer imports here, so a stand-in (a second torchsp MinkUNet behind
    peer_nets' interface) takes its place: it must be called in the asked mode, its step must
    reach backward (its parameters get gradients), its rounds must be its own.  An unknown peer
    is reported, not fatal."""
    _needs_scan()
    bw = _load_tool("bench_whole")
    import peer_nets  # tools/ is on sys.path once bench_whole is loaded

    from torchsp import SparseTensor
    from torchsp.models import MinkUNet
    made, modes = [], []

    def stand_in(in_channels, classes, mode, device, dtype):
        net = MinkUNet(in_channels, classes, cr=0.5).to(device, dtype)
        made.append(net)

        def forward(feats, coords):
            modes.append(mode)
            return net(SparseTensor(feats, coords, check=False))
        return peer_nets.PeerNet([net], lambda c: c.clone(), forward, f"stand-in, conv mode {mode}")
    monkeypatch.setitem(peer_nets.NETS, "standin", stand_in)
    rows = bw.main(["--device", "cpu", "--dtype", "float32", "--voxel-size", "1.0", "--batch", "1", "--rounds", "2",
                    "--calls", "1", "--warmup", "0", "--peers", "standin:2", "nosuch"])
    out = capsys.readouterr().out
    assert "peer nosuch: unavailable: no whole-network adapter" in out and "stand-in, conv mode 2" in out
    assert [(r["batch"], r["phase"]) for r in rows] == [(1, "fwd"), (1, "step")]
    for r in rows:
        assert r["torchsp_ms"] > 0 and r["standin:2_ms"] > 0
        assert len(r["rounds"]["torchsp"]) == len(r["rounds"]["standin:2"]) == 2
    assert modes and set(modes) == {2}
    assert any(p.grad is not None for p in made[0].parameters())
    assert "standin:2" in out.split("ratio")[0] and out.count("x\n") >= 2  # the table's ratio column


def test_bench_norm_times_the_fused_norm_beside_torchs(monkeypatch, capsys):
    """tools/bench_norm.py on CPU, with the fused path let in there (on a CPU tensor BatchNorm keeps
    torch's kernels): each phase's row times torchsp's call, which ran the fused kernels (train
    entry for the training phases, eval entry for eval), beside torch's, and their outputs agree;
    the floor counts 2 passes (5 for fwd+bwd) of N C elements."""
    _needs_scan()
    bn = _load_tool("bench_norm")
    import torchsp
    monkeypatch.setattr(torchsp.nn.norm, "_fusable", lambda b, x: True)
    seen = []
    for name in ("batch_norm_train", "batch_norm_eval"):
        real = getattr(torchsp._C, name)
        monkeypatch.setattr(torchsp._C, name, lambda *a, _r=real, _n=name: seen.append(_n) or _r(*a))
    rows = bn.main(["--device", "cpu", "--dtype", "float32", "--voxel-size", "1.0", "--batch", "1", "--channels",
                    "8", "--iters", "2", "--warmup", "0", "--rounds", "2", "--settle-ms", "0"])
    assert [r["phase"] for r in rows] == ["train fwd", "train fb", "eval fwd"]
    assert {"batch_norm_train", "batch_norm_eval"} <= set(seen)
    for r in rows:
        assert r["torch_us"] > 0 and r["torchsp_us"] > 0 and len(r["rounds"]["torchsp"]) == 2
        assert r["err"] < 1e-5  # the C kernels (float64 arithmetic) against torch
        passes = 5 if r["phase"] == "train fb" else 2
        assert abs(r["floor_us"] - passes * r["n"] * 8 * 4 / 3.0e12 * 1e6) < 1e-9
    assert "train fb" in capsys.readouterr().out


def test_bench_settle_runs_the_call_for_its_time():
    """bench.settle: the call runs back to back for about the time asked (at least once), not at
    all for 0 ms; --settle-ms reaches it and refuses a negative time."""
    bench = _load_tool("bench")
    calls = []
    t = time.perf_counter()
    bench.settle(lambda: calls.append(time.sleep(0.002)), 30, torch.device("cpu"))
    took = time.perf_counter() - t
    assert 0.03 <= took < 1.0 and 2 <= len(calls) <= 16, (took, len(calls))
    calls.clear()
    bench.settle(lambda: calls.append(1), 0, torch.device("cpu"))
    assert calls == []
    bench.settle(lambda: calls.append(1), 1e-6, torch.device("cpu"))
    assert calls == [1]
    with pytest.raises(AssertionError, match="--settle-ms must be >= 0"):
        _run_tool("bench.py", "--device", "cpu", "--peers", "none", "--settle-ms", "-1")


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


class _FakeWcnVoxels:
    """WarpConvNet's Voxels as tools/peers.py's adapter uses it, from its source (1.8.2): compact
    coordinates [N, 3] with row ranges per batch in `offsets` (CPU), a tensor stride, features,
    and a kernel-map cache that replace() hands on."""

    def __init__(self, coords, feats, offsets, tensor_stride, _cache=None):
        assert offsets.device.type == "cpu" and int(offsets[-1]) == coords.shape[0] == feats.shape[0]
        self.coords, self.feature_tensor, self.offsets = coords, feats, offsets
        self.tensor_stride, self._cache = tensor_stride, {} if _cache is None else _cache

    @property
    def batch_indexed_coordinates(self):
        b = torch.repeat_interleave(torch.arange(len(self.offsets) - 1), self.offsets.diff())
        return torch.cat([b[:, None].to(self.coords.dtype), self.coords], 1)

    def replace(self, batched_features):
        return _FakeWcnVoxels(self.coords, batched_features, self.offsets, self.tensor_stride, self._cache)


class _FakeWcnConv(torch.nn.Module):
    """WarpConvNet's SparseConv3d, read from its kernel-map search: offsets on an ij meshgrid (z
    fastest), centred for odd K and from 0 for even K; an input row sits at out * stride + offset
    (compact coordinates); transposed: the same map from the given finer output to the input,
    swapped; weight [V, Cin, Cout].  Brute force, float64."""

    def __init__(self, ci, co, k, stride=1, bias=False, transposed=False):
        super().__init__()
        self.k, self.stride, self.transposed = k, stride, transposed
        self.weight = torch.nn.Parameter(torch.zeros(k ** 3, ci, co))

    def forward(self, x, out=None):
        c = (self.k - 1) // 2 if self.k % 2 else 0
        r = range(self.k)
        offs = [(i - c, j - c, l - c) for i in r for j in r for l in r]
        y_vox = out if out is not None else x
        if self.transposed:   # the map of a strided conv from y (fine) to x (coarse), swapped
            fine, coarse = y_vox.batch_indexed_coordinates.tolist(), x.batch_indexed_coordinates.tolist()
            where = {tuple(q): i for i, q in enumerate(fine)}
            pairs = [(where.get((q[0], *(s * self.stride + o for s, o in zip(q[1:], off)))), i, k)
                     for i, q in enumerate(coarse) for k, off in enumerate(offs)]
        else:
            src, dst = x.batch_indexed_coordinates.tolist(), y_vox.batch_indexed_coordinates.tolist()
            where = {tuple(q): i for i, q in enumerate(src)}
            pairs = [(i, where.get((q[0], *(s * self.stride + o for s, o in zip(q[1:], off)))), k)
                     for i, q in enumerate(dst) for k, off in enumerate(offs)]
        y = torch.zeros(y_vox.coords.shape[0], self.weight.shape[2], dtype=x.feature_tensor.dtype)
        for o, i, k in pairs:
            if o is not None and i is not None:
                y[o] += x.feature_tensor[i] @ self.weight[k]
        return _FakeWcnVoxels(y_vox.coords, y, y_vox.offsets, y_vox.tensor_stride)


def _peer_layer(coords, kind, K, g):
    """(x, y, L) for a peer adapter's CPU test: torchsp's float64 layer of `kind` ("subm", "down",
    "up"), 3 -> 5 channels, on `coords` (for "up", their stride-2 coarsening back to them), its
    output y, and the layer description tools/peers.py's adapters take."""
    import torchsp
    from torchsp.kmap import get_kernel_map
    cin, cout = 3, 5
    w = torch.randn(K ** 3, cin, cout, generator=g, dtype=torch.float64)
    if kind == "up":
        fine = torchsp.SparseTensor(torch.zeros(coords.shape[0], cout, dtype=torch.float64), coords)
        _, coarse, cstride, ckey = get_kernel_map(fine, K, stride=2)
        x = torchsp.SparseTensor(torch.randn(coarse.shape[0], cin, generator=g, dtype=torch.float64), coarse,
                                 cstride, cache=fine.cache, coord_key=ckey, check=False)
        kw, t_in = dict(stride=2, transposed=True), 2
    else:
        x = torchsp.SparseTensor(torch.randn(coords.shape[0], cin, generator=g, dtype=torch.float64), coords)
        kw, t_in = dict(stride=1 if kind == "subm" else 2), 1
    y = torchsp.functional.sparse_conv3d(x, w, K, **kw)
    assert y.feats.abs().sum() > 0
    L = dict(kind=kind, K=K, Cin=cin, Cout=cout, dtype=torch.float64, device=torch.device("cpu"),
             coords_in=x.coords, coords_out=y.coords, t_in=t_in, weight=w)
    return x, y, L


@pytest.mark.parametrize("layer", ["subm3", "down2", "down3", "up2", "subm3_two_batches"])
def test_warpconvnet_adapter_geometry(layer, monkeypatch):
    """tools/peers.py's WarpConvNet adapter turns torchsp's layer (coordinates, stride, weight)
    into WarpConvNet's conventions and back: through a fake WarpConvNet written from its source,
    its output in torchsp's row order matches torchsp's on a real scan (one batch) and on two
    batches whose rows interleave (the adapter groups rows by batch, as WarpConvNet's offsets need).
    The real library runs on the GPU only; the bench checks it there the same way."""
    import types
    peers = _load_tool("peers")
    mods = {"warpconvnet": types.ModuleType("warpconvnet"),
            "warpconvnet.geometry.types.voxels": types.SimpleNamespace(Voxels=_FakeWcnVoxels),
            "warpconvnet.nn.modules.sparse_conv": types.SimpleNamespace(SparseConv3d=_FakeWcnConv)}
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    g = torch.Generator().manual_seed(5)
    kind, K = ("subm", 3) if layer.startswith("subm") else (layer[:-1], int(layer[-1]))
    if layer == "subm3_two_batches":
        xyz = torch.randint(-6, 6, (300, 3), generator=g, dtype=torch.int32)
        coords = torch.unique(torch.cat([torch.randint(0, 2, (300, 1), generator=g, dtype=torch.int32), xyz], 1), dim=0)
        coords = coords[torch.randperm(coords.shape[0], generator=g)]   # batches interleaved
    else:
        _needs_scan()
        bench = _load_tool("bench")
        coords = bench.load_coords(bench.find_data(None), 1.6, torch.device("cpu"))
    x, y, L = _peer_layer(coords, kind, K, g)
    pl, _ = peers.build("warpconvnet", L)
    torch.testing.assert_close(pl.forward(x.feats), y.feats, rtol=1e-12, atol=1e-12)
    dy = torch.randn(y.feats.shape, generator=g, dtype=torch.float64)
    assert torch.equal(pl.dy_peer(dy)[pl.perm], dy)


class _FakeSpconvTensor:
    """spconv's SparseConvTensor as tools/peers.py's spconv adapter uses it (spconv 2.x, and
    spconv-Triton 1.0 whose API is the same): features [N, C], indices [N, 4] (batch, then compact
    coordinates), spatial_shape, batch_size and the indice_dict its layers register pairs in."""

    def __init__(self, features, indices, spatial_shape, batch_size, indice_dict=None):
        self.features, self.indices, self.spatial_shape = features, indices, spatial_shape
        self.batch_size, self.indice_dict = batch_size, {} if indice_dict is None else indice_dict

    def replace_feature(self, features):
        return _FakeSpconvTensor(features, self.indices, self.spatial_shape, self.batch_size, self.indice_dict)


class _FakeSpconvPairs:
    """What an indice key holds: the pairs (out row, in row, k) [P, 3], the input indices and the
    output indices; spconv-Triton's implicit-GEMM fields are the pairs themselves here."""

    def __init__(self, pairs, indices, out_indices, spatial_shape):
        self.indices, self.out_indices, self.spatial_shape = indices, out_indices, spatial_shape
        self.pair_fwd = pairs
        self.pair_bwd = self.pair_mask_fwd_splits = self.pair_mask_bwd_splits = None
        self.mask_argsort_fwd_splits = self.mask_argsort_bwd_splits = self.masks = None


def _fake_implicit_gemm(feats, weight, pair_fwd, *rest):
    """out[o] += feats[i] @ W_k over pairs (o, i, k); weight [Co, Kx, Ky, Kz, Ci] (KRSC),
    k = (kx * Ky + ky) * Kz + kz.  rest[5] is the output row count (num_activate_out), as in spconv-Triton."""
    co, ci = weight.shape[0], weight.shape[-1]
    wk = weight.permute(1, 2, 3, 4, 0).reshape(-1, ci, co)
    o, i, k = pair_fwd.unbind(1)
    out = torch.zeros(rest[5], co, dtype=feats.dtype)
    return out.index_add(0, o, torch.einsum("pc,pcd->pd", feats[i], wk[k]))


class _FakeSpconvConv(torch.nn.Module):
    """spconv's SubMConv3d / SparseConv3d / SparseInverseConv3d, brute force: submanifold
    (padding K // 2) outputs on the input indices, in = out + k - K // 2; regular, in = out *
    stride - padding + k with 0 <= out < (spatial + 2 padding - K) // stride + 1; inverse, the
    pairs its indice key's regular layer registered, swapped, onto that layer's input indices."""

    def __init__(self, ci, co, k, stride=1, padding=0, bias=False, indice_key=None, subm=False, inverse=False):
        super().__init__()
        self.k, self.stride, self.padding, self.key = k, stride, padding, indice_key
        self.subm, self.inverse, self.fp32_accum = subm, inverse, None
        self.weight = torch.nn.Parameter(torch.zeros(co, k, k, k, ci))

    def forward(self, x):
        k3 = [(a, b, c) for a in range(self.k) for b in range(self.k) for c in range(self.k)]
        if self.inverse:
            d = x.indice_dict[self.key]
            pairs, out_idx, spatial = d.pair_fwd[:, [1, 0, 2]], d.indices, d.spatial_shape
        else:
            rows = {tuple(r): n for n, r in enumerate(x.indices.tolist())}
            if self.subm:
                out_idx, spatial = x.indices, x.spatial_shape
                outs = [(n, r) for n, r in enumerate(x.indices.tolist())]
                src = lambda o, off: [o[j] + off[j] - self.k // 2 for j in range(3)]  # noqa: E731
            else:
                spatial = [(s + 2 * self.padding - self.k) // self.stride + 1 for s in x.spatial_shape]
                cand = set()
                for r in x.indices.tolist():
                    for off in k3:
                        q = [r[1 + j] + self.padding - off[j] for j in range(3)]
                        if all(v % self.stride == 0 and 0 <= v // self.stride < spatial[j] for j, v in enumerate(q)):
                            cand.add((r[0], *(v // self.stride for v in q)))
                out_idx = torch.tensor(sorted(cand), dtype=x.indices.dtype).reshape(-1, 4)
                outs = list(enumerate(out_idx.tolist()))
                src = lambda o, off: [o[j] * self.stride - self.padding + off[j] for j in range(3)]  # noqa: E731
            pairs = [(n, rows[(o[0], *src(o[1:], off))], kk) for n, o in outs for kk, off in enumerate(k3)
                     if (o[0], *src(o[1:], off)) in rows]
            pairs = torch.tensor(pairs, dtype=torch.long).reshape(-1, 3)
        y = _FakeSpconvTensor(_fake_implicit_gemm(x.features, self.weight, pairs, *[None] * 5, out_idx.shape[0]),
                              out_idx, spatial, x.batch_size, dict(x.indice_dict))
        if self.key is not None and not self.inverse:
            y.indice_dict[self.key] = _FakeSpconvPairs(pairs, x.indices, out_idx, x.spatial_shape)
        return y


@pytest.mark.parametrize("peer", ["spconv", "spconv-triton"])
@pytest.mark.parametrize("layer", ["subm3", "down2", "down3", "up2"])
def test_spconv_adapters_geometry(peer, layer, monkeypatch):
    """tools/peers.py's spconv and spconv-Triton adapters turn torchsp's layer (coordinates,
    stride, weight) into spconv's conventions and back: through a fake spconv written from its
    geometry, their output in torchsp's row order matches torchsp's on a real scan.  spconv-Triton's
    strided layer runs its implicit-GEMM function on the pairs a first call registered (the map
    cached); the GPU bench checks both libraries themselves the same way."""
    import types
    _needs_scan()
    peers = _load_tool("peers")
    root = "spconv_triton" if peer == "spconv-triton" else "spconv"
    api = types.SimpleNamespace(
        SparseConvTensor=_FakeSpconvTensor,
        SubMConv3d=lambda ci, co, k, **kw: _FakeSpconvConv(ci, co, k, subm=True, **kw),
        SparseConv3d=lambda ci, co, k, **kw: _FakeSpconvConv(ci, co, k, **kw),
        SparseInverseConv3d=lambda ci, co, k, **kw: _FakeSpconvConv(ci, co, k, inverse=True, **kw),
        functional=types.SimpleNamespace(implicit_gemm=_fake_implicit_gemm))
    mods = {root: types.ModuleType(root), f"{root}.pytorch": api, f"{root}.pytorch.functional": api.functional,
            f"{root}.tools": types.SimpleNamespace(CUDAKernelTimer=lambda enabled: None)}
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    g = torch.Generator().manual_seed(7)
    kind, K = ("subm", 3) if layer == "subm3" else (layer[:-1], int(layer[-1]))
    bench = _load_tool("bench")
    coords = bench.load_coords(bench.find_data(None), 3.2, torch.device("cpu"))
    x, y, L = _peer_layer(coords, kind, K, g)
    pl, pw = peers.build(peer, L)
    torch.testing.assert_close(pl.forward(x.feats), y.feats, rtol=1e-12, atol=1e-12)
    dy = torch.randn(y.feats.shape, generator=g, dtype=torch.float64)
    xf = pl.feats_peer(x.feats).clone().requires_grad_(True)
    pl.fwd_bwd(xf, pw.requires_grad_(True), pl.dy_peer(dy))  # the timed training call runs
    assert xf.grad is not None and pw.grad is not None


def test_bench_power_parses_cases_and_samples():
    """tools/bench_power.py: its case syntax, nvidia-smi's sample lines, the window medians; on a
    machine without CUDA the CLI says so and fails."""
    bp = _load_tool("bench_power")
    assert bp.parse_case("fwd:0,15,0,0") == ("fwd", [0, 15, 0, 0])
    assert bp.parse_case("wgrad:1,12,0,0") == ("wgrad", [1, 12, 0, 0])
    for bad in ("fwd", "fwd:0,15,0", "bwd:0,0,0,0", "dgrad:0,x,0,0"):
        with pytest.raises(ValueError, match="PASS:dataflow,tile,split,threshold"):
            bp.parse_case(bad)
    rows = bp.parse_samples(["2026/11/28 16:50:01.250, 1545, 690.25\n", "garbage\n",
                             "2026/11/28 16:50:01.350, 1515, 693.50\n", "2026/11/28 16:50:02.000, 1980, 80.0\n",
                             "[N/A], 1500, 600.0\n"])
    assert [r[1:] for r in rows] == [(1545.0, 690.25), (1515.0, 693.5), (1980.0, 80.0)]
    assert abs(rows[1][0] - rows[0][0] - 0.1) < 1e-6
    clk, pw, n = bp.window_medians(rows, rows[0][0], rows[1][0])
    assert (clk, pw, n) == (1530.0, 691.875, 2)
    clk, pw, n = bp.window_medians(rows, rows[2][0] + 1, rows[2][0] + 2)
    assert n == 0 and clk != clk and pw != pw
    if not torch.cuda.is_available():
        with pytest.raises(subprocess.CalledProcessError) as err:
            subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_power.py")], check=True,
                           capture_output=True, text=True, timeout=120)
        assert "needs a CUDA device" in err.value.stderr
        with pytest.raises(subprocess.CalledProcessError) as err:
            subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_power.py"), "--cases", "fwd:1"],
                           check=True, capture_output=True, text=True, timeout=120)
        assert "PASS:dataflow,tile,split,threshold" in err.value.stderr


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
    # tile pairs: each pair's union counted directly; an odd last tile pairs with none
    tiles = [mask[order[i:i + 4]].any(0) for i in range(0, 203, 4)]
    pairs = [tiles[i] | (tiles[i + 1] if i + 1 < len(tiles) else False) for i in range(0, len(tiles), 2)]
    assert mw.pair_unions(mask, order, 4) == (int(sum(t.sum() for t in tiles)), int(sum(p.sum() for p in pairs)))
    assert mw.pair_unions(mask, order[:0], 4) == (0, 0)
    _needs_scan()
    out = _run_tool("mask_waste.py", "--voxel-sizes", "0.4", "--densities", "0.3", "0.2")
    assert "one segment, torchsp's mask order: computed" in out and "sparse seg" in out
    assert "tile pairs of the packed order" in out


def test_cross_build_matches_setup():
    """tools/cross_build.sh compiles what setup.py compiles, with its flags: torch's
    COMMON_NVCC_FLAGS and setup.py's own nvcc flags, setup.py's C++ sources
    (the script takes every csrc/*.cpp, setup.py lists them), and without arguments it prints its
    usage and exits 2."""
    import re
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
    script = open(os.path.join(REPO, "tools", "cross_build.sh")).read()
    setup = open(os.path.join(REPO, "setup.py")).read()
    own = re.findall(r'"([^"]+)"', re.search(r"nvcc = \[([^\]]*)\]", setup).group(1))
    assert "-lineinfo" in own, own  # the pattern found setup.py's list
    for flag in list(COMMON_NVCC_FLAGS) + own + ["-DTSP_WGMMA", "-DTORCH_EXTENSION_NAME=_C"]:
        assert flag in script, flag
    listed = set(re.findall(r'"(\w+\.cpp)"', setup))
    on_disk = {f for f in os.listdir(os.path.join(REPO, "csrc")) if f.endswith(".cpp")}
    assert listed == on_disk, (listed, on_disk)
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "cross_build.sh")], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "cross_build.sh fetch" in proc.stdout, (proc.returncode, proc.stdout)
