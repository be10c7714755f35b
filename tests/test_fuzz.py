"""Random convolutions (tools/fuzz_conv.py) against the float64 gather reference, and random
batch norms (tools/fuzz_norm.py) against nn.BatchNorm1d in float64.

Each seed draws a regime, coordinates (random or a crop of the real scan), channel counts,
dtype, bias and three algos (fwd, dgrad, wgrad) from the whole space the ops accept, runs
forward and backward, and checks the output coordinates against the reference's site rules and
y, dx, dw against float64 gather sums on the slow reference map, with CUDA workspaces poisoned
with NaN.  The seeds are fixed, so a failure names a trial that `tools/fuzz_conv.py --seeds S
--verbose` replays; the tool runs thousands more on the GPU.  The compile seeds run the same
trials through torch.compile(fullgraph=True) (`tools/fuzz_conv.py --compile`): the fake kernels,
data-dependent sizes and traced arguments on every geometry; the export seeds through
torch.export with a dynamic row count, the program then run on the input and on half its rows
(`--export`).
"""

import os
import sys

import pytest

from conftest import CUDA

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import fuzz_conv  # noqa: E402
import fuzz_norm  # noqa: E402

CPU_SEEDS = range(0, 48)
CUDA_SEEDS = range(0, 160)
COMPILE_CPU_SEEDS = range(1000, 1016)
COMPILE_CUDA_SEEDS = range(1000, 1040)
EXPORT_CPU_SEEDS = range(2000, 2024)
EXPORT_CUDA_SEEDS = range(2000, 2060)


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_fuzz_cpu(seed):
    why = fuzz_conv.run_trial(seed, "cpu")
    assert why is None, why


def on_cuda(run, seed, **kw):
    """run(seed, "cuda", **kw) with exact float32 matmuls unless the trial's tile asks for tf32."""
    import torch
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return run(seed, "cuda", **kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("seed", CUDA_SEEDS)
def test_fuzz_cuda(seed):
    why = on_cuda(fuzz_conv.run_trial, seed)
    assert why is None, why


@pytest.mark.parametrize("seed", COMPILE_CPU_SEEDS)
def test_fuzz_compile_cpu(seed):
    why = fuzz_conv.run_trial(seed, "cpu", compile=True)
    assert why is None, why


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("seed", COMPILE_CUDA_SEEDS)
def test_fuzz_compile_cuda(seed):
    why = on_cuda(fuzz_conv.run_trial, seed, compile=True)
    assert why is None, why


@pytest.mark.parametrize("seed", EXPORT_CPU_SEEDS)
def test_fuzz_export_cpu(seed):
    why = fuzz_conv.run_export_trial(seed, "cpu")
    assert why is None, why


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("seed", EXPORT_CUDA_SEEDS)
def test_fuzz_export_cuda(seed):
    why = on_cuda(fuzz_conv.run_export_trial, seed)
    assert why is None, why


NORM_CUDA_SEEDS = range(0, 60)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("seed", NORM_CUDA_SEEDS)
def test_fuzz_norm_cuda(seed):
    """tools/fuzz_norm.py: torchsp.nn.BatchNorm's fused CUDA kernels against a float64
    nn.BatchNorm1d (outputs, running statistics, gradients).  On the CPU the layer runs torch's
    own kernels, so only CUDA is swept here."""
    why = fuzz_norm.run_trial(seed, "cuda")
    assert why is None, why
