"""The regime table shared by the conv, kernel-map, gradient and empty-input tests.

Each Case is one sparse convolution on random coordinates (DESIGN.md section 3):
sub-manifold, strided (active-site or floor rule), generative, transposed (back to the
coordinates a strided conv came from) and transposed generative.  ``build`` makes the
input SparseTensor with fresh random non-zero features; ``expected_coords`` says, from
the independent reference alone, which output coordinates (in which order) the conv
must produce; ``reference`` is the dense float64 result at those coordinates.
"""

import dataclasses

import torch

import reference as ref
from conftest import random_coords, randn


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kernel: object = 3
    stride: object = 1
    dilation: object = 1
    padding: object = None
    in_stride: int = 1          # stride of the conv's input tensor
    transposed: bool = False
    generative: bool = False
    rule: str = "active"
    down: tuple = None          # transposed, not generative: (kernel, rule) of the downsampling conv
    span: int = 5
    n: int = 160
    batch_ids: tuple = (0, 1)
    shift: tuple = (0, 0, 0)

    @property
    def regime(self):
        if self.transposed:
            return "transposed_generative" if self.generative else "transposed"
        if ref.triple(self.stride) == (1, 1, 1):
            return "generative" if self.generative else "submanifold"
        return "floor" if self.rule == "floor" else "strided"

    def conv_kwargs(self):
        return dict(kernel_size=self.kernel, stride=self.stride, padding=self.padding, dilation=self.dilation,
                    transposed=self.transposed, generative=self.generative, rule=self.rule)

    def out_stride(self):
        t, s = ref.triple(self.in_stride), ref.triple(self.stride)
        if self.transposed:
            return tuple(a // b for a, b in zip(t, s))
        return tuple(a * b for a, b in zip(t, s))

    def volume(self):
        k = ref.triple(self.kernel)
        return k[0] * k[1] * k[2]


CASES = [
    # sub-manifold: output = input coordinates, same order
    Case("sub_k1", kernel=1),
    Case("sub_k2", kernel=2),
    Case("sub_k3", kernel=3),
    Case("sub_k5", kernel=5, span=4, n=120),
    Case("sub_k311", kernel=(3, 1, 1)),
    Case("sub_k133", kernel=(1, 3, 3)),
    Case("sub_k3_d2", kernel=3, dilation=2),
    Case("sub_k3_p0", kernel=3, padding=0),
    Case("sub_k3_t2", kernel=3, in_stride=2),
    Case("sub_k3_batch_gap", kernel=3, batch_ids=(0, 2, 3)),
    Case("sub_k3_far", kernel=3, shift=(-131000, 4000, 131000)),
    # strided, active-site rule
    Case("str_k1_s2", kernel=1, stride=2),
    Case("str_k2_s2", kernel=2, stride=2),
    Case("str_k3_s2", kernel=3, stride=2),
    Case("str_k5_s2", kernel=5, stride=2, span=4, n=100),
    Case("str_k3_s2_d2", kernel=3, stride=2, dilation=2),
    Case("str_k3_s212", kernel=3, stride=(2, 1, 2)),
    Case("str_k2_s2_t2", kernel=2, stride=2, in_stride=2),
    Case("str_k3_s2_t2", kernel=3, stride=2, in_stride=2),
    Case("str_k3_s2_far", kernel=3, stride=2, shift=(131000, -131000, 0)),
    # strided, floor rule (MinkowskiEngine)
    Case("floor_k2_s2", kernel=2, stride=2, rule="floor"),
    Case("floor_k3_s2", kernel=3, stride=2, rule="floor"),
    Case("floor_k3_s2_t2", kernel=3, stride=2, in_stride=2, rule="floor"),
    # generative (stride 1)
    Case("gen_k2", kernel=2, generative=True),
    Case("gen_k3", kernel=3, generative=True),
    Case("gen_k311", kernel=(3, 1, 1), generative=True),
    Case("gen_k3_t2", kernel=3, generative=True, in_stride=2),
    # transposed: back to the finer coordinates the input was downsampled from
    Case("tr_k2_s2", kernel=2, stride=2, in_stride=2, transposed=True, down=(2, "active")),
    Case("tr_k3_s2", kernel=3, stride=2, in_stride=2, transposed=True, down=(3, "active")),
    Case("tr_k3_s2_t4", kernel=3, stride=2, in_stride=4, transposed=True, down=(3, "active")),
    Case("tr_k3_after_k2", kernel=3, stride=2, in_stride=2, transposed=True, down=(2, "active")),
    Case("tr_k2_after_floor_k3", kernel=2, stride=2, in_stride=2, transposed=True, down=(3, "floor")),
    # transposed generative: every finer site reached from a coarse input
    Case("trgen_k2_s2", kernel=2, stride=2, in_stride=2, transposed=True, generative=True),
    Case("trgen_k3_s2", kernel=3, stride=2, in_stride=2, transposed=True, generative=True),
    Case("trgen_k3_s2_t4", kernel=3, stride=2, in_stride=4, transposed=True, generative=True),
]

CASE_IDS = [c.name for c in CASES]
BY_NAME = {c.name: c for c in CASES}


def case_coords(case, seed=0, n=None, span=None):
    """Input coordinates at the case's input stride (or, transposed non-generative, the fine ones)."""
    t = case.in_stride
    if case.transposed and not case.generative:
        t = tuple(a // b for a, b in zip(ref.triple(case.in_stride), ref.triple(case.stride)))
    return random_coords(case.n if n is None else n, span=case.span if span is None else span,
                         stride=t, seed=seed, shift=case.shift, batch_ids=case.batch_ids)


def build(case, cin=3, device="cpu", dtype=torch.float64, seed=0, n=None, span=None, coords=None):
    """(input SparseTensor with fresh random features, fine coords or None).

    Transposed, not generative: random fine coordinates are downsampled with a strided torchsp
    conv (the case's `down` kernel and rule), and the coarse result gets fresh features; the
    transposed conv must return to the fine coordinates.
    """
    import torchsp

    if coords is None:
        coords = case_coords(case, seed, n, span)
    coords = coords.to(device)
    if case.transposed and not case.generative:
        t_fine = tuple(a // b for a, b in zip(ref.triple(case.in_stride), ref.triple(case.stride)))
        # Only the coarse coordinates are kept: float32 where the device has no float64 kernels.
        dt = dtype if torch.device(device).type == "cpu" else torch.float32
        fine = torchsp.SparseTensor(randn(coords.shape[0], 1, seed=seed + 1, dtype=dt, device=device),
                                    coords, t_fine)
        kd, rule = case.down
        v = ref.triple(kd)[0] * ref.triple(kd)[1] * ref.triple(kd)[2]
        w = randn(v, 1, cin, seed=seed + 2, dtype=dt, device=device)
        coarse = torchsp.functional.sparse_conv3d(fine, w, kd, stride=case.stride, rule=rule)
        assert coarse.stride == ref.triple(case.in_stride)
        x = coarse.replace(randn(coarse.coords.shape[0], cin, seed=seed + 3, dtype=dtype, device=device))
        return x, coords
    x = torchsp.SparseTensor(randn(coords.shape[0], cin, seed=seed + 3, dtype=dtype, device=device), coords,
                             case.in_stride)
    return x, None


def expected_coords(case, in_coords, fine_coords=None):
    """int32 [M, 4] output coordinates from the reference alone (CPU)."""
    c = in_coords.cpu()
    k, s, d, p = case.kernel, case.stride, case.dilation, case.padding
    regime = case.regime
    if regime == "submanifold":
        return c.int()
    if regime == "strided":
        return ref.active_sites(c, case.in_stride, k, s, d, p)
    if regime == "floor":
        return ref.floor_sites(c, case.in_stride, s)
    if regime == "generative":
        return ref.generative_sites(c, case.in_stride, k, d, p)
    if regime == "transposed":
        return fine_coords.cpu().int()
    return ref.transposed_generative_sites(c, case.in_stride, k, s, d, p)


def reference(case, x_feats, in_coords, weight, out_coords, bias=None):
    """Dense float64 conv of the case, read at out_coords."""
    return ref.dense_conv(x_feats.cpu(), in_coords.cpu(), case.in_stride, weight.cpu(), ref.triple(case.kernel),
                          out_coords.cpu(), stride=case.stride, padding=case.padding, dilation=case.dilation,
                          transposed=case.transposed, bias=None if bias is None else bias.cpu())


_REF_CACHE = {}


def reference_grads(case, x_feats, in_coords, weight, out_coords, grad):
    """(y, dx, dw): the dense float64 reference and its autograd for grad, memoised on the exact
    input values.  Why: the dataflow sweeps (tests/test_dataflows.py, tests/test_tf32.py) ask for
    the same reference once per dataflow, and the fp64 dense conv is most of their time."""
    import hashlib
    h = hashlib.sha1(case.name.encode())
    for t in (x_feats, in_coords, weight, out_coords, grad):
        t = t.detach().cpu()
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update((t.double() if t.is_floating_point() else t.long()).contiguous().numpy().tobytes())
    key = h.hexdigest()
    if key not in _REF_CACHE:
        rf = x_feats.detach().cpu().double().requires_grad_()
        rw = weight.detach().cpu().double().requires_grad_()
        want = reference(case, rf, in_coords, rw, out_coords)
        want.backward(grad.detach().cpu().double())
        _REF_CACHE[key] = (want.detach(), rf.grad, rw.grad)
    return _REF_CACHE[key]


def kmap_args(case):
    """(step, sign) of the case's offsets: forward convs step = t, sign +1; transposed step = t/s, sign -1."""
    if case.transposed:
        return case.out_stride(), -1
    return ref.triple(case.in_stride), 1


def padding_of(case):
    k, d = ref.triple(case.kernel), ref.triple(case.dilation)
    return ref.default_padding(k, d) if case.padding is None else ref.triple(case.padding)
