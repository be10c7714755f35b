"""Functional sparse convolution.

    torchsp.functional.sparse_conv3d -> torchsp.kmap.get_kernel_map (cached)
        -> torchsp.tune.choose_algo (memoised) -> torchsp.plan.pass_plan (CUDA: the segments of
        the chosen dataflow, cached)
        -> torch.ops.torchsp.conv_fwd -> csrc/shim_{cpu,cuda}.cpp -> tsp_conv_fwd_{cpu,cuda}
    Backward (torchsp._autograd): conv_dgrad and conv_wgrad, the same way down.
    Eager calls reach the same ops through torchsp._C (csrc/eager.cpp, the ops' typed dispatcher
    handles, without torch.ops' argument parsing): conv_fwd without gradients, conv_train (one
    C++ autograd node, torchsp._autograd.eager_conv) in training.  A default call repeated on the
    same tensor (or another layer of its shape there) takes its resolved map and choices from the
    repeat memo (_Repeat) and goes straight to pass_plan and the op.
"""

import operator

import torch

from . import _C
from . import tune as _tune
from ._autograd import _PLAIN, _functorch_active, eager_conv, eager_ok, plain_operands
from ._tracing import capturing, tracing
from .kmap import ConvGeometry, conv_geometry, get_kernel_map
from .plan import pass_plan
from .tensor import SparseTensor
from .tune import CheckedChoice, choose_algo, default_algo

DEFAULT_ALGO = (0, 0, 0, 0)  # float32 CUDA features with tf32 allowed: tune.default_algo
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_HALVES = (torch.float16, torch.bfloat16)


def _gradless(traced, feats, weight):
    """True when an eager call can skip everything only backward needs: no gradient can flow
    (grad mode off, or neither feats nor weight requires grad) and both are plain tensors.

    Then conv_fwd runs below its autograd key, as the op's own autograd (torch.library
    .register_autograd, Python) does in that case, without its Python frames (~7 us a call), and
    the dgrad row order of a fresh map is never sorted.  Tracers and tensor subclasses keep the
    whole dispatch.
    """
    return (not traced and plain_operands(feats, weight)
            and not (torch.is_grad_enabled() and (feats.requires_grad or weight.requires_grad)))


# One call answers the common case, no autocast on any device (~0.3 us of the ~0.5 the
# per-device question costs a layer call); None where torch lacks it.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast_dtype(device_type, traced=False):
    """The autocast dtype active for `device_type`, or None (torch 2.4 .. 2.13 spellings).
    Traced code (traced=True) asks only the per-device question, as before session 52 (how
    dynamo treats the one-call question is not checked on every supported torch); eager code
    asks _any_autocast first."""
    if not traced and _any_autocast is not None and not _any_autocast():
        return None
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type
        enabled = torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()
    if not enabled:
        return None
    if hasattr(torch, "get_autocast_dtype"):
        return torch.get_autocast_dtype(device_type)
    return torch.get_autocast_gpu_dtype() if device_type == "cuda" else torch.get_autocast_cpu_dtype()


def _resolve_algo(algo, feats=None):
    """(fwd, dgrad, wgrad) 4-lists from None (tune.default_algo(feats) for every pass, or
    DEFAULT_ALGO without feats), one 4-sequence for all passes, or three of them.  The three
    may be one list: no caller mutates them.  A torchsp.tune.CheckedChoice (the tuner's memo,
    checked once) is returned as it is."""
    if algo is None:
        a = default_algo(feats) if feats is not None else list(DEFAULT_ALGO)
        return a, a, a
    if algo.__class__ is CheckedChoice:  # the tuner's memo, checked when it was written
        return algo
    if len(algo) == 4 and isinstance(algo[0], int) and isinstance(algo[1], int) and isinstance(algo[2], int) \
            and isinstance(algo[3], int):  # spelled out: a generator costs ~0.3 us a call
        a = list(algo)
        return a, a, a
    try:  # the tuner's choices come this way on every default call: no per-element checks
        out = tuple(list(a) for a in algo)
    except TypeError:  # an element that is no sequence (three ints)
        out = ()
    if len(out) != 3 or len(out[0]) != 4 or len(out[1]) != 4 or len(out[2]) != 4:
        raise ValueError(f"algo must be None, [dataflow, tile, split, threshold] or three of those, got {algo!r}")
    return out


def _check_algo_ints(algo, *passes):
    """ValueError naming algo when an element of the resolved passes is no integer.  Called only
    after an eager entry refused its arguments, so a well-formed call pays nothing for it."""
    for a in passes:
        for v in a:
            try:
                operator.index(v)
            except TypeError:
                raise ValueError(
                    f"algo must hold integers [dataflow, tile, split, threshold], got {algo!r}") from None


def _pointwise(feats, weight, bias):
    """feats [N, Cin] @ weight[0] (+ bias): a 1x1x1 conv at stride 1 without padding.  weight
    [1, Cin, Cout] is squeezed (a view, so its gradient is one too); bias [Cout] or None."""
    w = weight.squeeze(0)
    return torch.mm(feats, w) if bias is None else torch.addmm(bias, feats, w)


class _Repeat:
    """A default call of sparse_conv3d, resolved: kept in SparseCache.calls under its arguments
    and weight shape (_repeat_key) so that its repeats, and other layers of that shape on the
    same tensor, skip the geometry, argument checks, map and tuner lookups (~4-5 us of the ~10 us
    the Python layer took per call on the H200 host, 2026-11-28).

    Made by an eager call with algo=None on 16-bit features (float32 CUDA features also depend
    on torch's tf32 switch), except while torchsp.tune.tune() lists a model's layers (every call
    must reach choose_algo) and under CUDA graph capture (where the tuner measures nothing, so
    the call runs the defaults a later eager call would not).  Served only while the tuner's
    state is the one it was made under (gen: tune._memo.gen, which set_mode, set_fixed, tune()
    and every written choice move on; mode and fixed by identity, for code that sets them
    directly) and for operands like the ones it was made for (plain tensors; weight of the same
    shape, dtype and device; no autocast); anything else takes the full path, which checks and
    raises.  The row plan is read through pass_plan on every call, as the full path reads it, so
    a map's plan is still refined after REFINE_AFTER reads.

    Fields: gen, mode, fixed (tuner state), wshape (torch.Size), dtype, device (torch.device),
    geom, kmap, out_coords, out_stride, out_key, fwd / dgrad / wgrad (the resolved 4-lists).
    """
    __slots__ = ("gen", "mode", "fixed", "wshape", "dtype", "device", "geom", "kmap", "out_coords", "out_stride",
                 "out_key", "fwd", "dgrad", "wgrad")


def _repeat_key(input, weight, kernel_size, stride, padding, dilation, transposed, generative, rule):
    """The repeat memo's key: the conv's arguments, each with its type (as conv_geometry's memo:
    True == 1 but kernel_size=True is an error), the input's coordinate key and stride, and the
    weight's shape (layers of several widths on one tensor each keep their own).  TypeError for
    an unhashable argument, AttributeError for a weight that is no tensor."""
    return (kernel_size, type(kernel_size), stride, type(stride), dilation, type(dilation), padding, type(padding),
            transposed, type(transposed), generative, type(generative), rule, input.coord_key, input.stride,
            weight.shape)


def _run_repeat(rep, input, weight, bias):
    """sparse_conv3d's result through the resolved call `rep`, or None when a guard fails (the
    caller then takes the full path).  The same ops and arguments as the full path.  The weight's
    shape is part of the key (_repeat_key), so it is not compared again here."""
    feats = input.feats
    state = _tune._state
    if (rep.gen != _tune._memo.gen or state["mode"] is not rep.mode or state["fixed"] is not rep.fixed
            or type(weight) not in _PLAIN or type(feats) not in _PLAIN or weight.dtype is not rep.dtype
            or feats.dtype is not rep.dtype or feats.shape[1] != rep.wshape[1]
            or weight.device != rep.device or _any_autocast is None or _any_autocast()):
        return None
    if bias is not None and (type(bias) not in _PLAIN or bias.dim() != 1 or bias.shape[0] != rep.wshape[2]):
        return None
    kmap = rep.kmap
    order, segs = pass_plan(kmap, "fwd", rep.fwd, rep.geom, rep.dtype, False)
    if not (torch.is_grad_enabled() and (feats.requires_grad or weight.requires_grad)):
        y = _C.conv_fwd(feats, weight, kmap.nbmap, kmap.nbmap_t, rep.fwd, rep.dgrad, rep.wgrad, order, None, segs, [])
    elif not _functorch_active():  # eager_ok: the operands' types were checked above
        y = eager_conv(feats, weight, kmap, (rep.fwd, rep.dgrad, rep.wgrad), order, segs, rep.geom)
    else:
        return None
    if bias is not None:
        y = y + bias
    return SparseTensor._derived(y, rep.out_coords, rep.out_stride, input.cache, rep.out_key)


def _remember(key, input, feats, weight, geom, kmap, out, algos):
    """Keep a _Repeat of this call under `key` when it qualifies (see _Repeat)."""
    state = _tune._state
    if feats.dtype not in _HALVES or state["seen"] is not None or feats is not input.feats or capturing(feats):
        return
    rep = _Repeat()
    rep.gen, rep.mode, rep.fixed = _tune._memo.gen, state["mode"], state["fixed"]
    rep.wshape, rep.dtype, rep.device = weight.shape, feats.dtype, feats.device
    rep.geom, rep.kmap = geom, kmap
    rep.out_coords, rep.out_stride, rep.out_key = out
    rep.fwd, rep.dgrad, rep.wgrad = algos
    input.cache.calls[key] = rep


def sparse_conv3d(input, weight, kernel_size, bias=None, stride=1, padding=None, dilation=1,
                  transposed=False, generative=False, rule="active", algo=None):
    """Sparse 3D convolution of a SparseTensor.

    y[q] = bias + sum_k x[q + delta_k] @ weight[k]  (transposed: x[q - delta_k]),
    delta_k = (i * dilation - padding) * t per axis, k = (ix * Ky + iy) * Kz + iz.

    Args:
        input: SparseTensor with feats [N_in, Cin].
        weight: [V, Cin, Cout], V = Kx * Ky * Kz, same dtype and device as input.feats.
        kernel_size: int or 3-tuple.
        bias: optional [Cout].
        stride, padding, dilation: int or 3-tuple; padding defaults to (K-1)//2*d for odd K, 0 for even.
        transposed: upsample by `stride` back to the cached finer coordinates.
        generative: stride 1: output every site reached from an input; transposed: every finer site.
        rule: "active" (dense-equivalent active sites, default) or "floor" (MinkowskiEngine) for strided output.
        algo: None (default or tuned), [dataflow, tile, split, threshold], or (fwd, dgrad, wgrad) of those.
            A 1x1x1 kernel at stride 1 without padding (and not generative) ignores it: its map
            would be the identity, so it runs as one dense GEMM (torch.mm / addmm) with no kernel
            map, except on CUDA under torch.use_deterministic_algorithms(True).
            The default is [0, 0, 0, 0], or for float32 CUDA features with
            torch.backends.cuda.matmul.allow_tf32 set [0, 11, 0, 0] (tf32 tensor cores); tile 11
            on float32 asks for tf32 in any pass, any other tile is exact fp32.
    Returns:
        SparseTensor with feats [N_out, Cout] on the output coordinates of DESIGN.md section 3.
    """
    if not isinstance(input, SparseTensor):
        raise TypeError(f"sparse_conv3d: input must be a SparseTensor, got {type(input).__name__}")
    # Eager calls take memos and shortcuts (a few us each, H100 layers of 30-60 us): traced
    # calls keep the plain, traceable path.
    traced = tracing()
    key = None
    if algo is None and not traced:  # a repeat of a resolved default call: _Repeat
        try:
            key = _repeat_key(input, weight, kernel_size, stride, padding, dilation, transposed, generative, rule)
            rep = input.cache.calls.get(key)
        except (TypeError, AttributeError):  # an unhashable argument (a list), a weight that is no tensor
            rep = key = None
        if rep is not None:
            out = _run_repeat(rep, input, weight, bias)
            if out is not None:
                return out
    geom = (ConvGeometry if traced else conv_geometry)(kernel_size, stride, dilation, padding, transposed,
                                                       generative, rule)
    feats = input.feats
    # Under torch.autocast a sparse conv runs in the autocast dtype, as F.conv3d does.
    amp = _autocast_dtype("cuda" if feats.is_cuda else feats.device.type, traced)
    if amp is not None and feats.dtype in _FLOATS and isinstance(weight, torch.Tensor) and weight.dtype in _FLOATS:
        feats, weight = feats.to(amp), weight.to(amp)
        bias = bias.to(amp) if bias is not None else None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"sparse_conv3d: weight must be a [V, Cin, Cout] tensor, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    w_shape = weight.shape  # read once: each .shape builds a torch.Size
    if w_shape[0] != geom.volume:
        raise ValueError(f"sparse_conv3d: weight has {w_shape[0]} offsets but kernel_size "
                         f"{geom.kernel_size} has {geom.volume}")
    if w_shape[1] != feats.shape[1]:
        raise ValueError(f"sparse_conv3d: input has {feats.shape[1]} channels but weight expects {w_shape[1]}")
    if weight.dtype != feats.dtype:
        raise TypeError(f"sparse_conv3d: weight dtype {weight.dtype} does not match input feats dtype {feats.dtype}")
    if weight.device != feats.device:
        raise ValueError(f"sparse_conv3d: weight is on {weight.device} but input is on {feats.device}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w_shape[2]):
        raise ValueError(f"sparse_conv3d: bias must be [{w_shape[2]}], got {tuple(bias.shape)}")
    if geom.pointwise and not (feats.is_cuda and torch.are_deterministic_algorithms_enabled()):
        # The map would be the identity: no map, plan or tuning, one GEMM (its autograd gives
        # dgrad and wgrad).  Under torch.use_deterministic_algorithms cuBLAS may refuse (it wants
        # CUBLAS_WORKSPACE_CONFIG), so CUDA keeps the sparse path, whose sums are fixed.
        return _output(_pointwise(feats, weight, bias), input, input.coords, input.stride, input.coord_key, traced)
    kmap, out_coords, out_stride, out_key = get_kernel_map(input, geom, traced=traced)
    if algo is None:
        algo = choose_algo(input if feats is input.feats else input.replace(feats), kmap, geom, weight,
                           traced=traced)
    fwd, dgrad, wgrad = _resolve_algo(algo, feats)
    order, segs = pass_plan(kmap, "fwd", fwd, geom, feats.dtype, traced)
    if _gradless(traced, feats, weight):  # _C.conv_fwd runs below the autograd key
        try:
            y = _C.conv_fwd(feats, weight, kmap.nbmap, kmap.nbmap_t, fwd, dgrad, wgrad, order, None, segs, [])
        except TypeError:  # the entry names its own argument (fwd_algo[3]), not algo: an element no int?
            _check_algo_ints(algo, fwd, dgrad, wgrad)
            raise
    elif not traced and eager_ok(feats, weight):  # eager training call: torchsp._autograd's lean route
        try:
            y = eager_conv(feats, weight, kmap, (fwd, dgrad, wgrad), order, segs, geom)
        except TypeError:
            _check_algo_ints(algo, fwd, dgrad, wgrad)
            raise
    else:
        order_t, segs_t = pass_plan(kmap, "dgrad", dgrad, geom, feats.dtype, traced)
        y = torch.ops.torchsp.conv_fwd(feats, weight, kmap.nbmap, kmap.nbmap_t, fwd, dgrad, wgrad, order, order_t,
                                       segs, segs_t)
    if key is not None:  # after the op took the arguments: a repeat passes them unchecked
        _remember(key, input, feats, weight, geom, kmap, (out_coords, out_stride, out_key), (fwd, dgrad, wgrad))
    if bias is not None:
        y = y + bias
    return _output(y, input, out_coords, out_stride, out_key, traced)


def _output(y, input, coords, stride, coord_key, traced):
    """The conv's output SparseTensor: feats y [N_out, Cout] on coords [N_out, 4], in input's cache.
    Traced code takes the constructor (without value checks), eager code SparseTensor._derived."""
    if traced:
        return SparseTensor(y, coords, stride, cache=input.cache, coord_key=coord_key, check=False)
    return SparseTensor._derived(y, coords, stride, input.cache, coord_key)
