"""Adapters that build one torchsp benchmark layer in a peer library (tools/bench.py).

Each adapter takes the same voxels and the same weights as torchsp ([V, Cin, Cout],
k = (ix * Ky + iy) * Kz + iz, delta_k = (i * d - p) * t, DESIGN.md section 2), converts
them to the peer's layout, and returns a PeerLayer: the peer's own call (timed in the peer's
row orders) and the row permutations to torchsp's orders, applied outside the timed region, so
bench.py can print the relative error against torchsp before timing.  (Until 2026-11-25 the
timed peer call included that reordering: a row gather of the output, of dy, and for 'up' of the
input, which made the peers' times longer by tens of microseconds.)

Peers (none is vendored; all untracked: until session 50 .peers/BUILD_peers.sh built them on the
GPU machine; since session 51 FlexGEMM and TorchSparse++ are cross-built on the CPU machine for the
device's torch into .peers/peers_so.txz, put on PYTHONPATH by `. .peers/env.sh`, see
.peers/README_peers.txt):
  spconv       spconv 2.x (pip wheel spconv-cu12x): SubMConv3d / SparseConv3d / SparseInverseConv3d,
               weight [Cout, Kx, Ky, Kz, Cin]; regular strided convs cannot reuse their pairs in
               spconv, so their forward includes the pair build (noted in the table).  Besides
               its wheel and cumm's, spconv 2.3.8 imports lark, portalocker and termcolor (pure
               Python; the GPU machine has none of them: session 53).
  spconv-triton  spconv-Triton 1.0 (L. Reichardt; pure Python + Triton, a drop-in for spconv 2.x: its
               pip wheel carried to the GPU machine, untracked): the same layers, weights and
               coordinates as spconv, its default algorithm (MaskImplicitGemm at V <= 32).  Its
               strided layers take their pairs from a first call (its implicit-GEMM autograd
               function, spconv_triton.pytorch.functional.implicit_gemm, with the pairs that call
               registered under an indice key), so every layer runs with its map cached, as
               torchsp's do; its Triton kernels autotune on their first call (set up before timing).
  flexgemm     FlexGEMM (Triton + a small CUDA ext, flex_gemm.kernels.cuda, cross-built into .peers/peers_so.txz):
               sparse_submanifold_conv3d / sparse_conv3d with a cached neighbor map, weight
               [Cout, Kx, Ky, Kz, Cin]; no transposed conv ('up' emulated, see _flexgemm);
               FLEXGEMM_ALGO picks its algorithm (default masked_implicit_gemm_splitk).
  torchsparse  TorchSparse++ v2.1 (CUDA ext, cross-built into .peers/peers_so.txz with google
               sparsehash headers and one include patch for CUDA 13): torchsparse.nn.functional.conv3d,
               weight [V, Cin, Cout] with x-fastest offsets for odd kernels (MinkowskiEngine order),
               z-fastest for even; compact coordinates (divided by the tensor stride); "torchsparse:M"
               runs its conv mode M (0 unsorted, 1 mask-sorted, 2 sorted with 3 mask splits), the
               choices its own group tuner picks from.
  warpconvnet  WarpConvNet (CUDA ext with CUTLASS; no wheel, built from its public sdist, see
               .peers/wcn/HOW.txt, untracked):
               warpconvnet.nn.SparseConv3d with its 'auto' algorithm choice, weight [V, Cin, Cout],
               z-fastest offsets, compact coordinates, rows grouped by batch.

Layer description (dict) given by bench.py:
  kind 'subm' | 'down' | 'up'; K; Cin; Cout; dtype; device;
  coords_in [N_in, 4] int32 (full resolution, input stride t_in), coords_out [N_out, 4] (torchsp's);
  t_in (int); for 'up': coords_fine (= coords_out) and the coarse input is coords_in (stride 2).
"""

import importlib
import os

import torch

PEERS = ("spconv", "spconv-triton", "flexgemm", "torchsparse", "warpconvnet")


class PeerUnavailable(Exception):
    pass


class PeerMismatch(Exception):
    pass


def _key(c):
    """int64 key of [b, x, y, z] rows: 20-bit fields, |x|, |y|, |z| < 2^19, b < 8.  (Biased values must
    stay inside their field: the former (c + 2^20) << 20 fields overlapped and OR'ed into each other.)"""
    c = c.long()
    r, bias = 1 << 20, 1 << 19
    return ((c[:, 0] * r + (c[:, 1] + bias)) * r + (c[:, 2] + bias)) * r + (c[:, 3] + bias)


def row_perm(ours, theirs):
    """perm with theirs[perm] == ours (same coordinate sets), else PeerMismatch."""
    if ours.shape[0] != theirs.shape[0]:
        raise PeerMismatch(f"output sets differ: {theirs.shape[0]} rows vs torchsp {ours.shape[0]}")
    ko, kt = _key(ours), _key(theirs)
    st, order = torch.sort(kt)
    pos = torch.searchsorted(st, ko).clamp_(max=st.numel() - 1)
    if not bool((st[pos] == ko).all()):
        raise PeerMismatch("output coordinate sets differ")
    return order[pos]


def _shift(coords, lattice=32):
    """Shift x, y, z to be non-negative by a multiple of `lattice` (keeps stride lattices aligned)."""
    lo = coords[:, 1:].amin(0)
    sh = (-(torch.div(lo, lattice, rounding_mode="floor")) * lattice).to(torch.int32)
    out = coords.clone()
    out[:, 1:] += sh
    return out, sh


def _extent(coords, margin=8, mult=32):
    hi = coords[:, 1:].amax(0).tolist()
    return [((h + margin) // mult + 1) * mult for h in hi]


def _w_krsc(w, K):
    """ours [V, Ci, Co] -> [Co, Kx, Ky, Kz, Ci]."""
    V, Ci, Co = w.shape
    return w.reshape(K, K, K, Ci, Co).permute(4, 0, 1, 2, 3).contiguous()


class PeerLayer:
    """A peer's layer as bench.py times it.  The timed calls work in the peer's own row orders,
    so the permutations that line its rows up with torchsp's are applied outside the timed
    region: `in_perm` (input rows: feats_peer = feats[in_perm]; None where the peer takes
    torchsp's input order) and `perm` (output rows: theirs[perm] == ours), once to check the
    output and once to put feats and dy in the peer's orders before the timings."""

    def __init__(self, call, fwd_bwd, perm, note="", in_perm=None, ordered=None):
        self.call = call              # feats in the peer's input order -> out feats in its output order (timed)
        self.fwd_bwd = fwd_bwd        # (feats with grad, weight, dy in the peer's output order) -> None (timed)
        self.perm = perm              # [N_out] int64: peer output row of each torchsp output row
        self.in_perm = in_perm        # [N_in] int64 or None: torchsp input row of each peer input row
        self.note = note
        # feats in the peer's input order -> out feats in torchsp's row order, for a peer whose
        # output row order changes from call to call (None: call, then perm)
        self.ordered = ordered

    def feats_peer(self, feats):
        """feats [N_in, Cin] in torchsp's row order -> the peer's input order."""
        return feats if self.in_perm is None else feats[self.in_perm]

    def forward(self, feats):
        """Output in torchsp's row order, from feats in torchsp's order (error check; not timed)."""
        if self.ordered is not None:
            return self.ordered(self.feats_peer(feats))
        return self.call(self.feats_peer(feats))[self.perm]

    def dy_peer(self, dy):
        """dy [N_out, Cout] in torchsp's row order -> the peer's output order."""
        return _scatter_rows(dy, self.perm)


# --------------------------------------------------------------------------- spconv

def _spconv(L, module="spconv.pytorch", label="spconv"):
    """spconv's layer, or spconv-Triton's (module spconv_triton.pytorch, label spconv-triton: the
    same API, its strided pairs cached: _spconv_triton_down)."""
    try:
        spconv = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
        raise PeerUnavailable(f"{label}: {type(e).__name__}: {e}")
    K, Ci, Co, dev, dt = L["K"], L["Cin"], L["Cout"], L["device"], L["dtype"]
    kind = L["kind"]
    cached_down = kind == "down" and label == "spconv-triton"
    cin, sh = _shift(L["coords_out"] if kind == "up" else L["coords_in"])
    if kind == "up":
        cin = L["coords_in"].clone()
        cin[:, 1:] += sh
    t_in = L["t_in"]
    # spconv works on compact (per-stride) indices
    idx_in = cin.clone()
    idx_in[:, 1:] = torch.div(idx_in[:, 1:], t_in, rounding_mode="floor")
    spatial = _extent(idx_in)
    wk = _w_krsc(L["weight"], K)
    if kind == "subm":
        conv = spconv.SubMConv3d(Ci, Co, K, padding=K // 2, bias=False, indice_key="bench").to(dev, dt)
        conv.weight.data.copy_(wk)
        x0 = spconv.SparseConvTensor(torch.zeros(idx_in.shape[0], Ci, device=dev, dtype=dt), idx_in.contiguous(),
                                     spatial, 1)
        y0 = conv(x0)                                       # builds and caches the pairs
        cache = y0.indice_dict
        out_idx = y0.indices
        note = ""

        def make(feats):
            return spconv.SparseConvTensor(feats, idx_in, spatial, 1, indice_dict=cache)
    elif cached_down:
        conv, out_idx, call = _spconv_triton_down(spconv, L, idx_in, spatial, wk)
        note = "pairs cached (its implicit-GEMM function on a first call's pairs)"
    elif kind == "down":
        pad = (K - 1) // 2
        conv = spconv.SparseConv3d(Ci, Co, K, stride=2, padding=pad, bias=False).to(dev, dt)
        conv.weight.data.copy_(wk)
        x0 = spconv.SparseConvTensor(torch.zeros(idx_in.shape[0], Ci, device=dev, dtype=dt), idx_in, spatial, 1)
        out_idx = conv(x0).indices
        note = "pairs rebuilt each call (spconv cannot reuse strided maps)"

        def make(feats):
            return spconv.SparseConvTensor(feats, idx_in, spatial, 1)
    else:  # up: transposed K=2 s=2 from the coarse tensor back to the fine one
        fine, _ = _shift(L["coords_out"])
        fine_idx = fine.clone()
        fine_spatial = _extent(fine_idx)
        down = spconv.SparseConv3d(Co, Ci, K, stride=2, padding=0, bias=False, indice_key="up").to(dev, dt)
        xf = spconv.SparseConvTensor(torch.zeros(fine_idx.shape[0], Co, device=dev, dtype=dt), fine_idx,
                                     fine_spatial, 1)
        yc = down(xf)
        # coarse input must be spconv's own coarse tensor; reorder our coarse rows to it
        coarse_ours = L["coords_in"].clone()
        coarse_ours[:, 1:] += sh
        coarse_ours[:, 1:] = torch.div(coarse_ours[:, 1:], 2, rounding_mode="floor")
        perm_in = row_perm(yc.indices, coarse_ours)      # ours[perm_in] == spconv order
        conv = spconv.SparseInverseConv3d(Ci, Co, K, indice_key="up", bias=False).to(dev, dt)
        conv.weight.data.copy_(wk)
        cache = yc.indice_dict
        out_idx = fine_idx
        note = ""

        def make(feats):                               # feats in spconv's coarse order (in_perm)
            return yc.replace_feature(feats)
        # output of inverse conv = fine indices in xf order
    # row order of the output
    if kind == "up":
        ours_out = L["coords_out"].clone()
        ours_out[:, 1:] += sh
        perm = row_perm(ours_out, out_idx)
    else:
        t_out = t_in * (2 if kind == "down" else 1)
        ours_out = L["coords_out"].clone()
        ours_out[:, 1:] = torch.div(ours_out[:, 1:] + sh, t_out, rounding_mode="floor")
        perm = row_perm(ours_out, out_idx)

    if cached_down:
        def fwd_bwd_cached(feats, weight_unused, dy_peer):
            call(feats).backward(dy_peer)
        return PeerLayer(call, fwd_bwd_cached, perm, note), conv.weight

    def native(feats):
        return conv(make(feats)).features

    def ordered(feats):
        # A strided conv rebuilds its output indices every call.  Against the first call's row
        # order its output had rel err 1.4 on an H100 (spconv-cu126 2.3.8, session 44), against
        # ~1e-2 on the CPU: the GPU's row order is not stable from call to call, so the check
        # lines up each call's own rows (not yet rerun on the GPU).
        out = conv(make(feats))
        return out.features[row_perm(ours_out, out.indices)]

    def fwd_bwd(feats, weight_unused, dy_peer):
        conv(make(feats)).features.backward(dy_peer)
    return (PeerLayer(native, fwd_bwd, perm, note, perm_in if kind == "up" else None,
                      ordered if kind == "down" else None), conv.weight)


def _spconv_triton_down(spconv, L, idx_in, spatial, wk):
    """spconv-Triton's stride-2 layer with its pairs cached: (module, output indices, call).
    Its SparseConv3d rebuilds a strided layer's pairs on every call (an indice key may be reused
    by submanifold and inverse layers only), so a first call registers them under a key and
    call(feats) runs the layer's own path after the pair build: its implicit-GEMM autograd
    function (spconv_triton.pytorch.functional.implicit_gemm) on those pairs, in training mode as
    the module runs by default, so backward works too."""
    from spconv_triton.pytorch import functional as fsp
    from spconv_triton.tools import CUDAKernelTimer
    K, Ci, Co, dev, dt = L["K"], L["Cin"], L["Cout"], L["device"], L["dtype"]
    conv = spconv.SparseConv3d(Ci, Co, K, stride=2, padding=(K - 1) // 2, bias=False,
                               indice_key="bench").to(dev, dt)
    conv.weight.data.copy_(wk)
    x0 = spconv.SparseConvTensor(torch.zeros(idx_in.shape[0], Ci, device=dev, dtype=dt), idx_in, spatial, 1)
    y0 = conv(x0)
    d = y0.indice_dict["bench"]
    n_out, timer = y0.indices.shape[0], CUDAKernelTimer(False)

    def call(feats):
        return fsp.implicit_gemm(feats, conv.weight, d.pair_fwd, d.pair_bwd, d.pair_mask_fwd_splits,
                                 d.pair_mask_bwd_splits, d.mask_argsort_fwd_splits, d.mask_argsort_bwd_splits,
                                 n_out, d.masks, True, False, timer, conv.fp32_accum)
    return conv, y0.indices, call


def _spconv_triton(L):
    return _spconv(L, "spconv_triton.pytorch", "spconv-triton")


def _scatter_rows(dy, perm):
    """dy in torchsp order -> peer order: out_peer[perm[i]] = dy[i]."""
    out = torch.empty_like(dy)
    out[perm] = dy
    return out


# --------------------------------------------------------------------------- FlexGEMM

def _flexgemm_algo(fg):
    """FLEXGEMM_ALGO (any case): explicit_gemm, implicit_gemm, implicit_gemm_splitk, masked_implicit_gemm,
    masked_implicit_gemm_splitk (FlexGEMM's default)."""
    name = os.environ.get("FLEXGEMM_ALGO", "masked_implicit_gemm_splitk").upper()
    if not hasattr(fg.Algorithm, name):
        raise PeerUnavailable(f"flexgemm: unknown FLEXGEMM_ALGO {name!r}")
    fg.set_algorithm(getattr(fg.Algorithm, name))
    return name.lower()


def _flexgemm(L):
    """FlexGEMM (flex_gemm.ops.spconv).  Its geometry, read from its neighbour-map kernels:
    submanifold: input = out + (i - K // 2) * d (odd K); sparse_conv3d: input = out * s + i * d - p, in
    compact (per-tensor) integer coordinates, kernel index v = (ix * Kh + iy) * Kd + iz, weight
    [Co, Kw, Kh, Kd, Ci] reshaped to [Co, V, Ci] -- the same offsets and order as torchsp once the
    coordinates are divided by the tensor stride.  It has no transposed conv: 'up' is computed as a
    stride-1 sparse_conv3d onto the given fine coordinates with padding K-1-p and the kernel flipped
    (x[p - (i - p_t)] == x[p + j - (K - 1 - p_t)], j = K - 1 - i), noted in the table.
    Neighbour caches are built once (as a model reuses them) and passed back in every call."""
    try:
        import flex_gemm  # noqa: F401
        from flex_gemm.ops import spconv as fg
    except Exception as e:  # noqa: BLE001
        raise PeerUnavailable(f"flexgemm: {type(e).__name__}: {e}")
    K, Ci, Co, dev, dt = L["K"], L["Cin"], L["Cout"], L["device"], L["dtype"]
    kind, t_in = L["kind"], L["t_in"]
    algo = _flexgemm_algo(fg)
    # FlexGEMM's backward reads bias.requires_grad unconditionally: pass a zero bias, never None.
    bias = torch.zeros(Co, device=dev, dtype=dt)
    pad = (K - 1) // 2 if K % 2 else 0          # torchsp's default padding (bench uses it)
    note = f"algo {algo}"

    if kind == "subm":
        if K % 2 == 0:
            raise PeerUnavailable("flexgemm: submanifold conv centres odd kernels only")
        c, sh = _shift(L["coords_in"])
        cin = c.clone()
        cin[:, 1:] = torch.div(cin[:, 1:], t_in, rounding_mode="floor")
        cin = cin.contiguous()
        shape = torch.Size([1, Ci] + _extent(cin))
        weight = _w_krsc(L["weight"], K).requires_grad_(True)
        feats0 = torch.zeros(cin.shape[0], Ci, device=dev, dtype=dt, requires_grad=True)
        _, cache = fg.sparse_submanifold_conv3d(feats0, cin, shape, weight, bias)   # builds the cache
        ours = L["coords_out"].clone()
        ours[:, 1:] = torch.div(ours[:, 1:] + sh, t_in, rounding_mode="floor")
        perm = row_perm(ours, cin)                  # FlexGEMM's output rows = its input rows

        def call(feats):
            return fg.sparse_submanifold_conv3d(feats, cin, shape, weight, bias, neighbor_cache=cache)[0]
    else:
        if kind == "down":
            t_out, stride, padding = t_in * 2, (2, 2, 2), (pad,) * 3
            c, sh = _shift(L["coords_in"])
            weight = _w_krsc(L["weight"], K).requires_grad_(True)
            step_in = t_in
        elif kind == "up":
            if t_in % 2:
                raise PeerUnavailable("flexgemm: transposed conv needs an even input stride")
            t_out, stride, padding = t_in // 2, (1, 1, 1), (K - 1 - pad,) * 3
            _, sh = _shift(L["coords_out"])
            c = L["coords_in"].clone()
            c[:, 1:] += sh
            weight = torch.flip(_w_krsc(L["weight"], K), dims=(1, 2, 3)).contiguous().requires_grad_(True)
            step_in = t_out                          # coarse voxels written in fine compact units
            note += "; up emulated: stride-1 sparse_conv3d onto the fine coords, flipped kernel (no transposed conv)"
        else:
            raise PeerUnavailable(f"flexgemm: layer kind {kind!r}")
        cin = c.clone()
        cin[:, 1:] = torch.div(cin[:, 1:], step_in, rounding_mode="floor")
        cin = cin.contiguous()
        out = L["coords_out"].clone()
        out[:, 1:] = torch.div(out[:, 1:] + sh, t_out, rounding_mode="floor")
        out = out.contiguous()
        shape = torch.Size([1, Ci] + _extent(torch.cat([cin, out])))
        ks = (K, K, K)
        # The public sparse_conv3d builds the cache with is_out_coords_given=False, which for a stride-1
        # conv on given out_coords leaves out the backward reordering the masked algorithms need; build it
        # the way FlexGEMM does for given out_coords.
        F = fg.SparseConv3dFunction
        try:
            cache = F._compute_neighbor_cache(cin, out, shape, ks, stride, padding, (1, 1, 1), True,
                                              is_out_coords_given=True)
        except TypeError:
            cache = F._compute_neighbor_cache(cin, out, shape, ks, stride, padding, (1, 1, 1), True)
        perm = torch.arange(out.shape[0], device=dev)  # output rows follow the out_coords given

        def call(feats):
            return fg.sparse_conv3d(feats, cin, shape, weight, bias, neighbor_cache=cache, out_coords=out,
                                    stride=stride, padding=padding)[0]

    def fwd_bwd(feats, _w, dy_peer):
        call(feats).backward(dy_peer)
    return PeerLayer(call, fwd_bwd, perm, note), weight


# --------------------------------------------------------------------------- TorchSparse++

def _w_torchsparse(w, K):
    V, Ci, Co = w.shape
    if (K ** 3) % 2 == 1:   # x fastest: j = (iz * Ky + iy) * Kx + ix
        return w.reshape(K, K, K, Ci, Co).permute(2, 1, 0, 3, 4).reshape(V, Ci, Co).contiguous()
    return w.contiguous()


def _torchsparse_config(F, mode):
    """TorchSparse++'s implicit-GEMM configuration of conv mode 0 (unsorted), 1 (mask-sorted) or
    2 (sorted, 3 mask splits) -- the choices its group tuner picks from.  A fresh dict each time:
    its get_default_conv_config() edits and returns the module's one default."""
    if mode not in (0, 1, 2):
        raise PeerUnavailable(f"torchsparse: conv mode {mode} (0, 1 or 2)")
    cfg = F.conv_config.get_default_conv_config()
    cfg = type(cfg)(list(cfg.items()))
    cfg.dataflow = F.Dataflow.ImplicitGEMM
    cfg.kmap_mode = "hashmap_on_the_fly"
    cfg.ifsort = mode >= 1
    cfg.split_mask_num = 3 if mode == 2 else 1
    return cfg


def _torchsparse(L, variant=None):
    """TorchSparse++ v2.1 (torchsparse.nn.functional.conv3d).  `variant`: its conv mode (0, 1, 2;
    default 1, TORCHSPARSE_MODE), passed as an explicit config; training=True (TORCHSPARSE_TRAINING)
    builds the backward's maps too, as a training call does.  The kernel map is built once and
    handed back through the tensor's caches in every call, as its models reuse it."""
    try:
        import torchsparse
        import torchsparse.nn.functional as F
    except Exception as e:  # noqa: BLE001
        raise PeerUnavailable(f"torchsparse: {type(e).__name__}: {e}")
    mode = int(variant if variant is not None else os.environ.get("TORCHSPARSE_MODE", "1"))
    cfg = _torchsparse_config(F, mode)
    K, Ci, Co, dev, dt = L["K"], L["Cin"], L["Cout"], L["device"], L["dtype"]
    kind = L["kind"]
    cin, sh = _shift(L["coords_out"] if kind == "up" else L["coords_in"])
    if kind == "up":
        cin = L["coords_in"].clone()
        cin[:, 1:] += sh
    weight = _w_torchsparse(L["weight"], K).requires_grad_(True)
    t_in = L["t_in"]
    training = os.environ.get("TORCHSPARSE_TRAINING", "1") == "1"
    in_perm = None

    if kind == "up":
        fine, _ = _shift(L["coords_out"])
        # a spatial range with a margin: without one TorchSparse takes the tight box of the coordinates
        # and, as a dense conv would, drops strided outputs whose window leaves it
        xf = torchsparse.SparseTensor(torch.zeros(fine.shape[0], Co, device=dev, dtype=dt), fine, 1,
                                      spatial_range=(1, *_extent(fine)))
        # its transposed conv reads the finer coordinates from the cache's cmaps, which its convs
        # fill for their outputs (a model's stride-1 layers would have): fill it for the fine tensor
        xf._caches.cmaps.setdefault(xf.stride, (xf.coords, xf.spatial_range))
        wd = torch.zeros(K ** 3, Co, Ci, device=dev, dtype=dt)
        yc = F.conv3d(xf, wd, K, stride=2, padding=0, config=cfg, training=training)
        # TorchSparse v2.1 keeps coordinates compact (divided by the tensor stride)
        coarse = cin.clone()
        coarse[:, 1:] = torch.div(coarse[:, 1:], 2, rounding_mode="floor")
        in_perm = row_perm(yc.coords, coarse)          # coarse[in_perm] == torchsparse coarse order
        caches = yc._caches

        def call(feats):                               # feats in torchsparse's coarse order
            x = torchsparse.SparseTensor(feats, yc.coords, yc.stride, spatial_range=yc.spatial_range)
            x._caches = caches
            return F.conv3d(x, weight, K, stride=2, padding=0, transposed=True, config=cfg,
                            training=training).feats
        perm = torch.arange(fine.shape[0], device=dev)   # transposed output = xf's rows, in xf's order
        y = call(torch.zeros(cin.shape[0], Ci, device=dev, dtype=dt))
        if y.shape[0] != fine.shape[0]:
            raise PeerMismatch(f"transposed output has {y.shape[0]} rows, torchsp {fine.shape[0]}")
    else:
        stride = 1 if kind == "subm" else 2
        pad = (K - 1) // 2 if kind != "subm" or K % 2 else 0
        # TorchSparse v2.1 keeps coordinates compact (divided by the tensor stride)
        cin[:, 1:] = torch.div(cin[:, 1:], t_in, rounding_mode="floor")
        x0 = torchsparse.SparseTensor(torch.zeros(cin.shape[0], Ci, device=dev, dtype=dt), cin, t_in,
                                      spatial_range=None if kind == "subm" else (1, *_extent(cin)))
        y0 = F.conv3d(x0, weight.detach(), K, stride=stride, padding=pad, config=cfg, training=training)
        caches = x0._caches
        ours_out = L["coords_out"].clone()
        ours_out[:, 1:] = torch.div(ours_out[:, 1:] + sh, t_in * stride, rounding_mode="floor")
        perm = row_perm(ours_out, y0.coords)

        def call(feats):
            x = torchsparse.SparseTensor(feats, cin, t_in, spatial_range=x0.spatial_range)
            x._caches = caches
            return F.conv3d(x, weight, K, stride=stride, padding=pad, config=cfg, training=training).feats

    def fwd_bwd(feats, _w, dy_peer):
        call(feats).backward(dy_peer)
    return PeerLayer(call, fwd_bwd, perm, f"mode {mode}, training={training}", in_perm), weight


def _wcn_voxels(Voxels, bcoords, feats, t):
    """WarpConvNet Voxels from batch-indexed compact coordinates [N, 4] (rows grouped by batch, as its
    `offsets` require) and features, at tensor stride t."""
    b = bcoords[:, 0].long()
    counts = torch.bincount(b, minlength=int(b.max()) + 1 if b.numel() else 1)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).cpu()
    return Voxels(bcoords[:, 1:].contiguous(), feats, offsets=offsets, tensor_stride=(t, t, t))


def _wcn_batch_order(c):
    """Row order that groups rows by batch index, keeping their order within a batch."""
    return torch.sort(c[:, 0].long(), stable=True).indices


def _warpconvnet(L):
    """WarpConvNet (warpconvnet.nn.SparseConv3d, its default algorithm choice 'auto': it benchmarks
    its candidate GEMMs for fwd, dgrad and wgrad on the first calls and caches the winners).  Its
    geometry, read from its kernel-map search: compact (per-tensor-stride) integer coordinates;
    offsets on a meshgrid with z fastest, centred for odd kernels and starting at 0 for even ones;
    an input at out * stride + offset; weight [V, Cin, Cout] -- torchsp's offsets and layout once
    the coordinates are divided by the tensor stride.  Its Voxels need rows grouped by batch
    (`offsets`), so the input rows are put in that order (in_perm).  The kernel map is built on the
    first call and found again in the input's cache, which Voxels.replace hands on, as its models
    reuse it; strided and transposed layers are given torchsp's output coordinates.  Checked on an
    H100 (session 45, WarpConvNet 1.8.2): rel err 0 to 5e-4 against torchsp at subm C = 32 to 256
    and down2 C = 64; tests/test_examples.py checks the conversions on the CPU through a fake."""
    try:
        from warpconvnet.geometry.types.voxels import Voxels
        from warpconvnet.nn.modules.sparse_conv import SparseConv3d
    except Exception as e:  # noqa: BLE001
        raise PeerUnavailable(f"warpconvnet: {type(e).__name__}: {e}")
    K, Ci, Co, dev, dt = L["K"], L["Cin"], L["Cout"], L["device"], L["dtype"]
    kind, t_in = L["kind"], L["t_in"]
    _, sh = _shift(L["coords_out"] if kind == "up" else L["coords_in"])
    t_out = t_in * 2 if kind == "down" else (t_in // 2 if kind == "up" else t_in)

    def compact(c, t):
        out = c.clone()
        out[:, 1:] = torch.div(out[:, 1:] + sh, t, rounding_mode="floor")
        return out.to(torch.int32)

    cin = compact(L["coords_in"], t_in)
    in_perm = _wcn_batch_order(cin)
    cin = cin[in_perm]
    ours_out = compact(L["coords_out"], t_out)
    cout = ours_out[_wcn_batch_order(ours_out)]
    conv = SparseConv3d(Ci, Co, K, stride=1 if kind == "subm" else 2, bias=False,
                        transposed=kind == "up").to(dev, dt)
    if tuple(conv.weight.shape) != tuple(L["weight"].shape):
        raise PeerMismatch(f"warpconvnet: weight {tuple(conv.weight.shape)}, torchsp {tuple(L['weight'].shape)}")
    conv.weight.data.copy_(L["weight"])
    x0 = _wcn_voxels(Voxels, cin, torch.zeros(cin.shape[0], Ci, device=dev, dtype=dt), t_in)
    y_given = None if kind == "subm" else _wcn_voxels(
        Voxels, cout, torch.zeros(cout.shape[0], Co, device=dev, dtype=dt), t_out)
    with torch.no_grad():
        y0 = conv(x0, y_given)                       # builds the kernel map into x0's cache
    out_b = y0.batch_indexed_coordinates
    perm = row_perm(ours_out, out_b)

    def call(feats):                                 # feats in in_perm's order
        return conv(x0.replace(batched_features=feats), y_given).feature_tensor

    def fwd_bwd(feats, _w, dy_peer):
        call(feats).backward(dy_peer)
    return PeerLayer(call, fwd_bwd, perm, "algo auto (its autotuner)", in_perm), conv.weight


ADAPTERS = {"spconv": _spconv, "spconv-triton": _spconv_triton, "flexgemm": _flexgemm, "torchsparse": _torchsparse,
            "warpconvnet": _warpconvnet}


def probe():
    """{peer: version string or 'unavailable: why'} (imports only)."""
    mods = {"spconv": "spconv.pytorch", "spconv-triton": "spconv_triton", "flexgemm": "flex_gemm",
            "torchsparse": "torchsparse", "warpconvnet": "warpconvnet"}
    out = {}
    for p, m in mods.items():
        try:
            mod = importlib.import_module(m)
            root = importlib.import_module(m.split(".")[0])
            out[p] = str(getattr(root, "__version__", getattr(mod, "__version__", "?")))
        except Exception as e:  # noqa: BLE001
            out[p] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return out


def build(peer, layer):
    """(PeerLayer, peer weight parameter) or raise PeerUnavailable / PeerMismatch.  `peer` is a
    name of PEERS, or name:variant where the adapter takes one (torchsparse:0/1/2, its conv mode)."""
    name, _, variant = peer.partition(":")
    if name not in ADAPTERS:
        raise PeerUnavailable(f"unknown peer {peer!r} (one of {', '.join(PEERS)})")
    if variant:
        if name != "torchsparse":
            raise PeerUnavailable(f"{name}: takes no variant ({peer!r})")
        return ADAPTERS[name](layer, variant)
    return ADAPTERS[name](layer)
