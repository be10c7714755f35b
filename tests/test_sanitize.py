"""GPU kernels on small real and random inputs, for compute-sanitizer runs.

tools/gpu_session.sh runs this file under `compute-sanitizer --tool memcheck`
and `--tool racecheck`.  Each case also checks the GPU result against the CPU
kernels (float64 there), so a run is a correctness check as well; sizes are
small because the sanitizers slow kernels down by orders of magnitude.
"""

import pytest
import torch

import torchsp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _coords(n, seed, span=12, batches=2):
    g = torch.Generator().manual_seed(seed)
    c = torch.cat([torch.randint(0, batches, (n, 1), generator=g),
                   torch.randint(-span, span, (n, 3), generator=g)], 1)
    return torch.unique(c, dim=0).int()


@pytest.mark.parametrize("method", [0, 1])
@pytest.mark.parametrize("kernel,stride", [(3, 1), (2, 2), (3, 2), (5, 1)])
def test_maps_and_conv(method, kernel, stride):
    coords = _coords(700, seed=kernel * 10 + stride)
    feats = torch.randn(coords.shape[0], 24, dtype=torch.float64)
    w = torch.randn(kernel ** 3, 24, 40, dtype=torch.float64)
    saved = torchsp.kmap.DEFAULT_METHOD
    torchsp.kmap.DEFAULT_METHOD = method
    try:
        ref = torchsp.functional.sparse_conv3d(torchsp.SparseTensor(feats, coords), w, kernel, stride=stride,
                                               algo=[0, 0, 0, 0])
        for dtype, tol in ((torch.float32, 5e-3), (torch.float16, 2e-2), (torch.bfloat16, 3e-2)):
            x = torchsp.SparseTensor(feats.to("cuda", dtype), coords.cuda())
            y = torchsp.functional.sparse_conv3d(x, w.to("cuda", dtype), kernel, stride=stride, algo=[0, 0, 0, 0])
            torch.cuda.synchronize()
            assert torch.equal(y.coords.cpu(), ref.coords)
            err = (y.feats.double().cpu() - ref.feats).norm() / ref.feats.norm()
            assert err < tol, (dtype, float(err))
    finally:
        torchsp.kmap.DEFAULT_METHOD = saved


def test_backward_passes():
    coords = _coords(600, seed=3)
    feats = torch.randn(coords.shape[0], 16, dtype=torch.float64)
    w = torch.randn(27, 16, 32, dtype=torch.float64)
    outs = []
    for dev in ("cpu", "cuda"):
        # detach: .to() returns feats itself on cpu/float64, which must stay a plain tensor
        f = feats.to(dev, torch.float32 if dev == "cuda" else torch.float64).detach().clone().requires_grad_()
        ww = w.to(dev, f.dtype).detach().clone().requires_grad_()
        y = torchsp.functional.sparse_conv3d(torchsp.SparseTensor(f, coords.to(dev)), ww, 3, algo=[0, 0, 0, 0])
        g = torch.linspace(-1, 1, y.feats.numel(), dtype=torch.float64).reshape(y.feats.shape)
        y.feats.backward(g.to(dev, f.dtype))
        outs.append((f.grad.double().cpu(), ww.grad.double().cpu()))
    for a, b in zip(outs[0], outs[1]):
        assert (a - b).norm() / a.norm() < 5e-3
