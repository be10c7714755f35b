"""Channel counts that are not multiples of 8 on CUDA (a stem's 3-5 input channels, odd heads).

The tensor-core kernels take channels in multiples of 8 (fp16, bf16; 4 for tf32); since session 71
csrc/cuda/conv.cu runs other counts on zero-padded copies of the operands (conv_pad.cu) instead of
the CUDA-core conv_simple.cu.  Checked here, on a real LiDAR crop against the float64 gather
references on the slow reference kernel map: forward, dgrad and wgrad (the default tiles and the
wgmma wgrad over the map's pair list) for a stem's 4 -> 32, odd 3 -> 5 and 5 -> 3, 1 -> 1, 12 -> 20,
and a wide odd 36 -> 300, submanifold and strided; that those passes run tensor-core kernels and
no conv_simple.cu kernel; that a NaN reaches exactly the outputs that read it; that results are
bitwise the same run to run.  Outputs and workspaces come from a NaN-poisoned allocator cache.
tf32's odd channels: tests/test_tf32.py (test_tf32_worst_cases, odd_c3 / odd_c5 / c6).
"""

import pytest
import torch

import reference as ref
import torchsp
from conftest import CUDA, lidar_crop, poison_cuda_cache, real_scan_layer, rel_err
from torchsp.plan import wgmma_available, wgrad_pairs

ops = torch.ops.torchsp
needs_tc = pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (8, 0),
                              reason="needs a CUDA device with tensor cores (sm_80+)")
TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
DEFAULT = [0, 0, 0, 0]
WGRAD_PIECES = [1, 13, 0, 0]  # wgmma wgrad over the map's pair list (sm_90a builds; else mma.sync)
SHAPES = [(4, 32), (3, 5), (5, 3), (1, 1), (12, 20), (36, 300)]
GEOMS = {"subm3": torchsp.kmap.ConvGeometry(3), "down2": torchsp.kmap.ConvGeometry(2, stride=2)}


def _layer(geom, cin, cout, dtype):
    c = lidar_crop().cuda()
    return real_scan_layer(c, GEOMS[geom], cin, cout, dtype)


@needs_tc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cin,cout", SHAPES)
@pytest.mark.parametrize("geom", list(GEOMS))
def test_odd_channels_against_float64(geom, cin, cout, dtype):
    """All three passes of an odd-channel layer on the real crop, within TOL of float64."""
    x, km, out, w, dy, ref_map, want_y, want_dx = _layer(geom, cin, cout, dtype)
    want_dw = ref.gather_wgrad(x.feats.cpu(), ref_map, dy.cpu())
    poison_cuda_cache()
    y = ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, DEFAULT, DEFAULT, DEFAULT, km.order, km.order_t, [], [])
    assert y.shape == (out.shape[0], cout)
    assert rel_err(y, want_y) <= TOL[dtype]
    poison_cuda_cache()
    dx = ops.conv_dgrad(dy, w, km.nbmap_t, DEFAULT, km.order_t, [])
    assert dx.shape == x.feats.shape
    assert rel_err(dx, want_dx) <= TOL[dtype]
    for algo in (DEFAULT, WGRAD_PIECES):
        pairs, starts = wgrad_pairs(km, algo, dtype, cin, cout)
        poison_cuda_cache()
        dw = ops.conv_wgrad(x.feats, dy, km.nbmap, algo, pairs, starts)
        assert dw.shape == w.shape
        assert rel_err(dw, want_dw) <= TOL[dtype], algo


@needs_tc
@pytest.mark.parametrize("cin,cout", [(4, 32), (3, 5)])
def test_odd_channels_run_on_tensor_cores(cin, cout):
    """The passes of an odd-channel fp16 layer launch tensor-core kernels and no conv_simple.cu
    kernel (which served them before the padding; they still agree with float64 above)."""
    x, km, out, w, dy, *_ = _layer("subm3", cin, cout, torch.float16)
    pairs, starts = wgrad_pairs(km, WGRAD_PIECES, torch.float16, cin, cout)
    if wgmma_available(x.feats.device):
        assert pairs is not None, "the wgmma wgrad gets the map's pair list at padded channel counts"

    def passes():
        ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, DEFAULT, DEFAULT, DEFAULT, km.order, km.order_t, [], [])
        ops.conv_dgrad(dy, w, km.nbmap_t, DEFAULT, km.order_t, [])
        ops.conv_wgrad(x.feats, dy, km.nbmap, DEFAULT)
        ops.conv_wgrad(x.feats, dy, km.nbmap, WGRAD_PIECES, pairs, starts)
        torch.cuda.synchronize()
    passes()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        passes()
    names = [e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not [n for n in names if "simple_" in n], names
    tensor_core = [n for n in names if any(k in n for k in ("wgmma", "igemm", "mma_wgrad"))]
    assert len(tensor_core) >= 2, names


@needs_tc
def test_odd_channels_nan_reaches_only_its_readers():
    """A NaN in one input row's feature reaches exactly the output rows whose map reads that row,
    and no padded channel turns a finite sum into NaN."""
    x, km, *_ = _layer("subm3", 4, 32, torch.float16)
    feats = x.feats.clone()
    feats[17, 2] = float("nan")
    w = torch.randn(27, 4, 32, device="cuda", dtype=torch.float16) * 0.1
    poison_cuda_cache()
    y = ops.conv_fwd(feats, w, km.nbmap, km.nbmap_t, DEFAULT, DEFAULT, DEFAULT, km.order, km.order_t, [], [])
    readers = (km.nbmap == 17).any(1)
    assert readers.sum() >= 2
    assert torch.equal(torch.isnan(y).any(1), readers)


@needs_tc
@pytest.mark.parametrize("cin,cout", [(4, 32), (5, 3)])
def test_odd_channels_bitwise_stable(cin, cout):
    """Two runs of each pass give bitwise equal results (the padded passes are deterministic)."""
    x, km, out, w, dy, *_ = _layer("subm3", cin, cout, torch.bfloat16)
    pairs, starts = wgrad_pairs(km, WGRAD_PIECES, torch.bfloat16, cin, cout)

    def run():
        poison_cuda_cache()
        return (ops.conv_fwd(x.feats, w, km.nbmap, km.nbmap_t, DEFAULT, DEFAULT, DEFAULT, km.order, km.order_t,
                             [], []),
                ops.conv_dgrad(dy, w, km.nbmap_t, DEFAULT, km.order_t, []),
                ops.conv_wgrad(x.feats, dy, km.nbmap, WGRAD_PIECES, pairs, starts))
    for a, b in zip(run(), run()):
        assert torch.equal(a, b)
