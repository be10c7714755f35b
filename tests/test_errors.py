"""Bad input: one test per error, each a clear Python exception naming the argument
(issue 2: never a crash or a silently wrong result)."""

import pytest
import torch

import reference as ref
import torchsp
from conftest import CUDA, random_coords, randn, rel_err

F = torchsp.functional
M = 131071


def _coords(n=30, seed=0):
    return random_coords(n, span=4, seed=seed)


def test_float_coords():
    c = _coords().float()
    with pytest.raises(TypeError, match="coords"):
        torchsp.SparseTensor(randn(c.shape[0], 2), c)


def test_coords_n3():
    c = _coords()[:, 1:].contiguous()
    with pytest.raises(ValueError, match="coords"):
        torchsp.SparseTensor(randn(c.shape[0], 2), c)


@pytest.mark.parametrize("shape", [(10,), (10, 5), (2, 5, 4)])
def test_coords_other_shapes(shape):
    with pytest.raises(ValueError, match="coords"):
        torchsp.SparseTensor(randn(10, 2), torch.zeros(shape, dtype=torch.int32))


def test_feats_not_2d():
    c = _coords()
    with pytest.raises(ValueError, match="feats"):
        torchsp.SparseTensor(randn(c.shape[0]), c)


def test_integer_feats():
    c = _coords()
    with pytest.raises(TypeError, match="feats"):
        torchsp.SparseTensor(torch.ones(c.shape[0], 2, dtype=torch.int64), c)


def test_length_mismatch():
    c = _coords()
    with pytest.raises(ValueError, match=r"feats|coords|rows"):
        torchsp.SparseTensor(randn(c.shape[0] + 1, 2), c)


def test_duplicate_coords():
    c = _coords()
    c = torch.cat([c, c[3:4]], 0)
    with pytest.raises(ValueError, match="duplicate"):
        torchsp.SparseTensor(randn(c.shape[0], 2), c)


def test_duplicate_differs_only_in_batch_is_fine():
    c = torch.tensor([[0, 1, 2, 3], [1, 1, 2, 3]], dtype=torch.int32)
    torchsp.SparseTensor(randn(2, 2), c)


def test_coords_not_multiple_of_stride():
    c = _coords() * 2
    c[0, 2] += 1
    with pytest.raises(ValueError, match="stride|multiple"):
        torchsp.SparseTensor(randn(c.shape[0], 2), c, stride=2)


@pytest.mark.parametrize("row", [[0, M + 1, 0, 0], [0, 0, -M - 2, 0], [0, 0, 0, 1 << 20], [512, 0, 0, 0],
                                 [-1, 0, 0, 0]], ids=["x_high", "y_low", "z_far", "batch_512", "batch_neg"])
def test_coords_out_of_range(row):
    c = torch.cat([_coords(), torch.tensor([row], dtype=torch.int32)], 0)
    with pytest.raises(ValueError, match="coords|batch|range"):
        torchsp.SparseTensor(randn(c.shape[0], 2), c)


def test_int64_coords_beyond_int32_range():
    """An int64 coordinate that would wrap when cast to int32 is an error, not a wrapped value."""
    c = _coords().long()
    c[0, 1] = (1 << 32) + 5
    with pytest.raises(ValueError, match="coords|range"):
        torchsp.SparseTensor(randn(c.shape[0], 2), c)


def test_coords_at_range_edge_accepted():
    c = torch.tensor([[0, M, -M - 1, 0], [511, -M - 1, M, M]], dtype=torch.int32)
    torchsp.SparseTensor(randn(2, 2), c)


@pytest.mark.parametrize("kw", [dict(generative=True), dict(stride=2)], ids=["generative", "strided"])
def test_derived_coords_out_of_range(kw):
    """Output sites beyond the packable range raise (DESIGN.md section 1: never a wrap-around)."""
    c = torch.tensor([[0, M, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    x = torchsp.SparseTensor(randn(2, 2), c)
    with pytest.raises((ValueError, RuntimeError), match="range"):
        F.sparse_conv3d(x, randn(27, 2, 2), 3, **kw)


def test_channel_mismatch_layer():
    c = _coords()
    x = torchsp.SparseTensor(randn(c.shape[0], 3), c)
    conv = torchsp.nn.SparseConv3d(4, 8, 3).double()
    with pytest.raises(ValueError, match="channel"):
        conv(x)


def test_weight_volume_mismatch():
    c = _coords()
    x = torchsp.SparseTensor(randn(c.shape[0], 3), c)
    with pytest.raises(ValueError, match="kernel_size|offsets|weight"):
        F.sparse_conv3d(x, randn(8, 3, 4), 3)


def test_weight_not_3d():
    c = _coords()
    x = torchsp.SparseTensor(randn(c.shape[0], 3), c)
    with pytest.raises(ValueError, match="weight"):
        F.sparse_conv3d(x, randn(27 * 3, 4), 3)


def test_dtype_mismatch_feats_weight():
    c = _coords()
    x = torchsp.SparseTensor(randn(c.shape[0], 3, dtype=torch.float32), c)
    with pytest.raises((TypeError, ValueError, RuntimeError), match="dtype"):
        F.sparse_conv3d(x, randn(27, 3, 4, dtype=torch.float64), 3)


def test_dtype_mismatch_layer():
    c = _coords()
    x = torchsp.SparseTensor(randn(c.shape[0], 3, dtype=torch.float64), c)
    conv = torchsp.nn.SparseConv3d(3, 4, 3)  # float32 parameters
    with pytest.raises((TypeError, ValueError, RuntimeError), match="dtype"):
        conv(x)


def test_bias_shape():
    c = _coords()
    x = torchsp.SparseTensor(randn(c.shape[0], 3), c)
    with pytest.raises(ValueError, match="bias"):
        F.sparse_conv3d(x, randn(27, 3, 4), 3, bias=randn(3))


def test_input_not_sparse_tensor():
    with pytest.raises(TypeError, match="input|SparseTensor"):
        F.sparse_conv3d(randn(10, 3), randn(27, 3, 4), 3)


@pytest.mark.parametrize("bad", [dict(kernel_size=0), dict(stride=0), dict(dilation=0), dict(padding=-1),
                                 dict(kernel_size=(3, 3)), dict(rule="ceil")],
                         ids=["kernel0", "stride0", "dilation0", "padding_neg", "kernel_2tuple", "rule"])
def test_bad_conv_arguments(bad):
    c = _coords()
    x = torchsp.SparseTensor(randn(c.shape[0], 3), c)
    kw = dict(kernel_size=3)
    kw.update(bad)
    name = next(iter(bad))
    with pytest.raises((ValueError, TypeError), match=name):
        F.sparse_conv3d(x, randn(27, 3, 4), **kw)


@pytest.mark.parametrize("what", ["feats", "coords", "weight"])
def test_non_contiguous_inputs(what):
    """Non-contiguous feats, coords or weight: a correct result or an error that says 'contiguous'."""
    c = random_coords(120, span=4, seed=2)
    feats = randn(c.shape[0], 3, seed=1)
    w = randn(27, 3, 4, seed=2)
    want = ref.dense_conv(feats, c, 1, w, (3, 3, 3), c)
    if what == "feats":
        feats = randn(3, c.shape[0], seed=1).T  # a transposed view
        want = ref.dense_conv(feats, c, 1, w, (3, 3, 3), c)
        assert not feats.is_contiguous()
    elif what == "coords":
        c = torch.cat([c, torch.zeros_like(c)], 1)[:, :4]  # row stride 8
        assert not c.is_contiguous()
    else:
        w = randn(4, 3, 27, seed=2).permute(2, 1, 0)
        want = ref.dense_conv(feats, c, 1, w, (3, 3, 3), c)
        assert not w.is_contiguous()
    try:
        y = F.sparse_conv3d(torchsp.SparseTensor(feats, c), w, 3)
    except (ValueError, RuntimeError) as e:
        assert "contiguous" in str(e), f"unclear error: {e}"
        return
    assert rel_err(y.feats, want) < 1e-12


def test_non_contiguous_ops_direct():
    """The raw ops with non-contiguous tensors: correct or an error naming contiguity."""
    ops = torch.ops.torchsp
    c = random_coords(80, span=4, seed=3)
    cc = torch.cat([c, c], 1)[:, :4]
    try:
        nb = ops.kernel_map(cc, cc, [3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, 0)
    except RuntimeError as e:
        assert "contiguous" in str(e)
        return
    assert torch.equal(nb.long(), ref.kernel_map(c, c, 3, 1, 1, 1))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_device_mix_feats_coords():
    c = _coords()
    with pytest.raises((ValueError, RuntimeError), match="device|cuda|cpu"):
        torchsp.SparseTensor(randn(c.shape[0], 3, device="cuda"), c)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_device_mix_weight():
    c = _coords().cuda()
    x = torchsp.SparseTensor(randn(c.shape[0], 3, dtype=torch.float32, device="cuda"), c)
    with pytest.raises((ValueError, RuntimeError), match="device|cuda|cpu"):
        F.sparse_conv3d(x, randn(27, 3, 4, dtype=torch.float32), 3)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_device_mix_layer():
    c = _coords().cuda()
    x = torchsp.SparseTensor(randn(c.shape[0], 3, dtype=torch.float32, device="cuda"), c)
    conv = torchsp.nn.SparseConv3d(3, 4, 3)
    with pytest.raises((ValueError, RuntimeError), match="device|cuda|cpu"):
        conv(x)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_device_mix_ops():
    ops = torch.ops.torchsp
    c = _coords()
    with pytest.raises(RuntimeError, match="device|cuda|cpu|CUDA|CPU"):
        ops.kernel_map(c.cuda(), c, [3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], 1, 0)


def test_ops_reject_bad_maps():
    """conv ops with an nbmap of the wrong width or dtype fail clearly instead of reading out of bounds."""
    ops = torch.ops.torchsp
    x = randn(10, 3)
    w = randn(27, 3, 4)
    nb = torch.full((5, 8), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="nbmap|weight|volume|offset"):
        ops.conv_fwd(x, w, nb, torch.full((10, 8), -1, dtype=torch.int32), [0] * 4, [0] * 4, [0] * 4)
    with pytest.raises(RuntimeError, match="nbmap|int32|dtype"):
        ops.conv_fwd(x, w, nb.long(), torch.full((10, 27), -1), [0] * 4, [0] * 4, [0] * 4)


@pytest.mark.parametrize("n_in", [0, 1, 3])
def test_cpu_transpose_rejects_entries_past_the_inputs(n_in):
    """CPU kernel_map_transpose: an entry naming an input row that in_coords lacks raises, with no
    inputs at all too (it returned an empty map there: tools/fuzz_badinput.py).  The CUDA op
    ignores such entries (csrc/torchsp.h: it never synchronises to report them)."""
    ops = torch.ops.torchsp
    nb = torch.full((4, 27), -1, dtype=torch.int32)
    nb[1, 13] = 3
    c = torch.zeros(n_in, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.kernel_map_transpose(nb, c)
    nb[1, 13] = -1  # no entry: an empty input is fine
    assert bool((ops.kernel_map_transpose(nb, c) == -1).all())


@pytest.mark.parametrize("bad", ["pairs_alone", "starts_alone", "pairs_int64", "pairs_2d", "pairs_3_rows",
                                 "starts_int32", "starts_short", "too_many_pairs", "too_many_rows", "device"])
def test_wgrad_rejects_bad_pair_list(bad, device):
    """conv_wgrad's optional cached pair list (kernel_map_pairs(nbmap)): both or neither, int32
    [P <= N_out * V] or [2, P] (with rows) and int64 [V + 1], on x's device; each mistake names
    the argument."""
    if bad == "device" and not CUDA:
        pytest.skip("needs CUDA")
    ops = torch.ops.torchsp
    dtype = torch.float16 if device == "cuda" else torch.float32
    x = randn(10, 8, dtype=dtype, device=device)
    dy = randn(6, 8, dtype=dtype, device=device, seed=1)
    nb = torch.randint(-1, 10, (6, 27), dtype=torch.int32, device=device)
    pairs, starts = ops.kernel_map_pairs(nb)
    with_rows = ops.kernel_map_pairs(nb, False, True)[0]
    args = {"pairs_alone": (pairs, None), "starts_alone": (None, starts), "pairs_int64": (pairs.long(), starts),
            "pairs_2d": (pairs[None], starts), "pairs_3_rows": (torch.cat([with_rows, pairs[None]]), starts),
            "starts_int32": (pairs, starts.int()), "starts_short": (pairs, starts[:-1]),
            "too_many_pairs": (torch.zeros(6 * 27 + 1, dtype=torch.int32, device=device), starts),
            "too_many_rows": (torch.zeros(2, 6 * 27 + 1, dtype=torch.int32, device=device), starts),
            "device": (pairs.cpu() if device == "cuda" else pairs, starts)}[bad]
    if bad == "device" and device == "cpu":
        pytest.skip("the CUDA half checks the device")
    match = {"pairs_alone": "pair_starts", "starts_alone": "pair_starts", "pairs_int64": "pairs must be int32",
             "pairs_2d": r"pairs must be int32 \[P\] or \[2, P\]", "pairs_3_rows": r"pairs must be int32 \[P\] or \[2, P\]",
             "starts_int32": "pair_starts", "starts_short": "pair_starts", "too_many_pairs": "pairs has 163 entries",
             "too_many_rows": "pairs has 163 entries", "device": "pairs"}[bad]
    with pytest.raises(RuntimeError, match=match):
        ops.conv_wgrad(x, dy, nb, [0, 0, 0, 0], *args)
    # the good lists, with and without rows, are accepted and change nothing
    dw = ops.conv_wgrad(x, dy, nb, [0, 0, 0, 0])
    assert torch.equal(ops.conv_wgrad(x, dy, nb, [0, 0, 0, 0], pairs, starts), dw)
    assert torch.equal(ops.conv_wgrad(x, dy, nb, [0, 0, 0, 0], with_rows, starts), dw)


@pytest.mark.parametrize("algo", [[0, 18, 0], ([0, 0, 0, 0], [0, 0, 0], [0, 0, 0, 0]), (1, 2),
                                  [[0, 0, 0, 0]] * 2, [[0, 0, 0, 0]] * 4])
def test_sparse_conv3d_bad_algo_shape(algo):
    """An algo that is neither four ints nor three lists of four ints is a ValueError naming algo
    (a three-element list of ints failed inside with "'int' object is not iterable")."""
    c = random_coords(40, span=3, seed=5)
    x = torchsp.SparseTensor(randn(c.shape[0], 8, dtype=torch.float64), c)
    w = randn(27, 8, 8, dtype=torch.float64, seed=2)
    with pytest.raises(ValueError, match="algo must be"):
        torchsp.functional.sparse_conv3d(x, w, 3, algo=algo)
    assert torchsp.functional.sparse_conv3d(x, w, 3, algo=([0, 0, 0, 0],) * 3).feats.shape == (c.shape[0], 8)


@pytest.mark.parametrize("bad", [0.5, "1", None])
@pytest.mark.parametrize("grad", [False, True], ids=["gradless", "training"])
def test_sparse_conv3d_algo_element_not_int(bad, grad):
    """Three lists of four whose element is no integer: a ValueError naming algo on both eager
    routes (the entries' TypeError names their own argument, wgrad_algo[3], not the caller's)."""
    c = random_coords(40, span=3, seed=5)
    x = torchsp.SparseTensor(randn(c.shape[0], 8, dtype=torch.float64), c)
    w = randn(27, 8, 8, dtype=torch.float64, seed=2).requires_grad_(grad)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="algo must hold integers"):
        torchsp.functional.sparse_conv3d(x, w, 3, algo=([0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, bad]))


@pytest.mark.parametrize("algo,match", [([5, 0, 0, 0], "dataflow"), ([-1, 0, 0, 0], "dataflow"),
                                        ([3, 0, 1, 0], "split"), ([3, 0, 17, 0], "split"),
                                        ([3, 0, 0, 0], "split"), ([4, 0, 0, -1], "threshold")],
                         ids=["dataflow5", "dataflow_neg", "splitk1", "splitk17", "splitk0", "ggs_neg_padding"])
def test_bad_algo(algo, match, device):
    """An algo list the kernels do not take fails in every pass, naming the element and the op."""
    ops = torch.ops.torchsp
    dtype = torch.float16 if device == "cuda" else torch.float64
    c = random_coords(60, span=3, seed=4).to(device)
    x = randn(c.shape[0], 8, dtype=dtype, device=device)
    km = torchsp.kmap.get_kernel_map(torchsp.SparseTensor(x, c), 3)[0]
    nb, nbt = km.nbmap, km.nbmap_t
    dy = randn(c.shape[0], 8, dtype=dtype, device=device, seed=1)
    w = randn(27, 8, 8, dtype=dtype, device=device, seed=2)
    ok = [0, 0, 0, 0]
    with pytest.raises(RuntimeError, match=f"conv_fwd.*algo.*{match}"):
        ops.conv_fwd(x, w, nb, nbt, algo, ok, ok)
    with pytest.raises(RuntimeError, match=f"conv_dgrad.*{match}"):
        ops.conv_dgrad(dy, w, nbt, algo)
    with pytest.raises(RuntimeError, match=f"conv_wgrad.*{match}"):
        ops.conv_wgrad(x, dy, nb, algo)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "train"])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["fwd", "dgrad", "wgrad"])
def test_eager_entries_report_op_errors(which, grad, device):
    """Eager calls reach the ops through torchsp._C (csrc/eager.cpp: conv_fwd below autograd
    without gradients, the C++ autograd node conv_train in training).  A bad algo for any pass
    still fails in the shim with the op's message naming the argument, before any kernel runs."""
    dtype = torch.float16 if device == "cuda" else torch.float64
    c = random_coords(60, span=3, seed=4).to(device)
    x = torchsp.SparseTensor(randn(c.shape[0], 8, dtype=dtype, device=device).requires_grad_(grad), c)
    w = randn(27, 8, 8, dtype=dtype, device=device, seed=2).requires_grad_(grad)
    algo = [[0, 0, 0, 0] for _ in range(3)]
    algo[which] = [3, 0, 17, 0]
    name = ("fwd_algo", "dgrad_algo", "wgrad_algo")[which]
    with pytest.raises(RuntimeError, match=rf"torchsp.conv_fwd: {name}\[2\] \(split\)"):
        torchsp.functional.sparse_conv3d(x, w, 3, algo=tuple(algo))


def test_eager_entry_argument_types():
    """torchsp._C.conv_fwd / conv_train (METH_FASTCALL entries, csrc/py_args.h) with an argument
    of the wrong Python type raise TypeError naming the entry and the argument, and a wrong tensor
    the shim's RuntimeError naming it, as torch.ops.torchsp does."""
    x, w = randn(10, 3), randn(27, 3, 4)
    nb = torch.full((10, 27), -1, dtype=torch.int32)
    a = [0, 0, 0, 0]
    with pytest.raises(TypeError, match=r"conv_fwd: fwd_algo must be a list of ints, got str"):
        torchsp._C.conv_fwd(x, w, nb, nb, "0000", a, a, None, None, [], [])
    with pytest.raises(TypeError, match=r"conv_fwd: dgrad_algo\[1\] must be an int, got float"):
        torchsp._C.conv_fwd(x, w, nb, nb, a, [0, 1.0, 0, 0], a, None, None, [], [])
    with pytest.raises(OverflowError, match=r"conv_fwd: segs\[0\] does not fit in int64"):
        torchsp._C.conv_fwd(x, w, nb, nb, a, a, a, None, None, [2**70, 1, 1, 1], [])
    with pytest.raises(TypeError, match=r"conv_fwd: takes 11 positional arguments, got 10"):
        torchsp._C.conv_fwd(x, w, nb, nb, a, a, a, None, None, [])
    with pytest.raises(TypeError, match=r"conv_fwd: nbmap_t must be a Tensor, got list"):
        torchsp._C.conv_fwd(x, w, nb, [0], a, a, a, None, None, [], [])
    with pytest.raises(TypeError, match=r"conv_fwd: order_t must be a Tensor, got int"):
        torchsp._C.conv_fwd(x, w, nb, nb, a, a, a, None, 3, [], [])
    with pytest.raises(TypeError):  # keywords: the entries are positional
        torchsp._C.conv_fwd(x, w, nb, nb, a, a, a, None, None, [], segs_t=[])
    with pytest.raises(RuntimeError, match="nbmap.*int32"):
        torchsp._C.conv_fwd(x, w, nb.long(), nb, a, a, a, None, None, [], [])
    with pytest.raises(RuntimeError, match="weight"):
        torchsp._C.conv_fwd(x, w[:, :2], nb, nb, a, a, a, None, None, [], [])
    # tuples read as lists do; the sums are the op's
    y = torchsp._C.conv_fwd(x, w, nb, nb, tuple(a), a, a, None, None, (), [])
    assert torch.equal(y, torch.ops.torchsp.conv_fwd(x, w, nb, nb, a, a, a, None, None, [], []))
    with pytest.raises(TypeError, match=r"conv_train: takes 13 positional arguments, got 12"):
        torchsp._C.conv_train(x, w, nb, nb, a, a, a, None, [], None, [], None)
    with pytest.raises(TypeError, match=r"conv_train: pair_list must be a torchsp._C.PairList or None, got tuple"):
        torchsp._C.conv_train(x, w, nb, nb, a, a, a, None, [], None, [], (nb, nb), False)
    with pytest.raises(TypeError, match=r"conv_train: overlap must be a bool, got int"):
        torchsp._C.conv_train(x, w, nb, nb, a, a, a, None, [], None, [], None, 1)
    with pytest.raises(TypeError, match=r"conv_train: x must be a Tensor, got NoneType"):
        torchsp._C.conv_train(None, w, nb, nb, a, a, a, None, [], None, [], None, False)
    with pytest.raises(TypeError):
        torchsp._C.PairList("nbmap")
    with pytest.raises(RuntimeError, match="nbmap.*int32"):
        torchsp._C.PairList(nb.long()).get()
    blank = torchsp._C.PairList.__new__(torchsp._C.PairList)
    with pytest.raises(ValueError, match="pickled state"):
        blank.__setstate__((nb,))
    with pytest.raises(RuntimeError, match="pairs and starts come together"):
        blank.__setstate__((nb, nb[0], None))


@pytest.mark.parametrize("route", ["eager", "op"])
@pytest.mark.parametrize("wrt", ["feats", "weight"])
def test_double_backward_fails_clearly(route, wrt, device):
    """conv_dgrad and conv_wgrad are not differentiable (csrc/autograd.cpp): a first-order
    gradient taken with create_graph=True is the plain one, and a backward through it raises
    naming the op, instead of autograd's warning and a silently missing second-order term."""
    dtype = torch.float16 if device == "cuda" else torch.float64
    c = random_coords(80, span=4, seed=5).to(device)
    f = randn(c.shape[0], 8, dtype=dtype, device=device).requires_grad_()
    w = randn(27, 8, 8, dtype=dtype, device=device, seed=2, scale=0.2).requires_grad_()
    x = torchsp.SparseTensor(f, c)
    a = [0, 0, 0, 0]
    if route == "eager":
        y = torchsp.functional.sparse_conv3d(x, w, 3, algo=a).feats
    else:
        km = torchsp.kmap.get_kernel_map(x, 3)[0]
        y = torch.ops.torchsp.conv_fwd(f, w, km.nbmap, km.nbmap_t, a, a, a)
    target = f if wrt == "feats" else w
    (g1,) = torch.autograd.grad(y.float().square().sum(), target, create_graph=True)
    (g0,) = torch.autograd.grad(y.float().square().sum(), target)
    assert g1.requires_grad and torch.equal(g1.detach(), g0)
    op = "conv_dgrad" if wrt == "feats" else "conv_wgrad"
    with pytest.raises(RuntimeError, match=rf"torchsp.{op}: a gradient of a sparse convolution's gradient"):
        g1.float().sum().backward()


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, r: (x[None], w, w, r, r.clone()), "x must be \\[N, C\\]"),
    (lambda x, w, r: (x.int(), None, None, None, None), "x must be floating point"),
    (lambda x, w, r: (x, w[:3], w, r, r.clone()), "weight must be \\[5\\]"),
    (lambda x, w, r: (x, w, w[:3], r, r.clone()), "bias must be \\[5\\]"),
    (lambda x, w, r: (x, w, w, r[:3], r.clone()), "running_mean must be \\[5\\]"),
    (lambda x, w, r: (x, w, w, r, None), "running_mean and running_var must both be given"),
], ids=["x_3d", "x_int", "weight", "bias", "running_mean", "stats_half"])
def test_batch_norm_train_rejects_bad_arguments(bad, match, device):
    """torchsp::batch_norm_train (the compiled BatchNorm's training op) names the bad argument."""
    x = randn(20, 5, device=device)
    w, r = torch.ones(5, dtype=x.dtype, device=device), torch.zeros(5, dtype=x.dtype, device=device)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.torchsp.batch_norm_train(*bad(x, w, r), 0.1, 1e-5)
    g = randn(20, 5, device=device)
    with pytest.raises(RuntimeError, match="grad must be"):
        torch.ops.torchsp.batch_norm_train_backward(g[:3], x, w, r, r + 1, 1e-5, [True, True, True])
