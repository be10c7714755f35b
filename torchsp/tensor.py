"""SparseTensor: features on a set of integer voxel coordinates, plus a shared cache.

Every tensor derived from one input (by convolution, pooling, normalisation)
shares that input's SparseCache: coordinate sets per stride, kernel maps per
key, and the autotuner's choices.  So a MinkUNet builds each kernel map once
per forward pass, and its backward pass and its transposed convolutions reuse
them.  `coord_key` names how a coordinate set was derived (a hashable tuple),
which is what kernel maps are keyed by: two tensors with equal keys in one
cache have equal coordinates.
"""

import torch

from ._tracing import tracing as _tracing
from .geometry import BATCH_MAX, COORD_MAX, COORD_MIN, triple


class SparseCache:
    """Per-input cache shared by every SparseTensor derived from it.

    Attributes:
        coords_by_stride: stride (3-tuple) -> (coords [N, 4] int32, coord_key); the first
            coordinate set registered at a stride, which transposed convs return to.
        out_coords: coord_key -> coords [N, 4] int32 of a strided or generative output.
        kmaps: kernel-map key -> KernelMap (see torchsp.kmap).
        tuning: group key -> tuned algorithm choices (see torchsp.tune).
        calls: torchsp.kmap.get_kernel_map's eager memo: (coord_key, stride, ConvGeometry
            key) -> (KernelMap, out coords, out stride, out coord_key); and
            torchsp.functional's repeat memo: sparse_conv3d's arguments -> a settled call's
            plan (torchsp.functional._Repeat).  Clearing it clears both.
    """

    def __init__(self):
        self.coords_by_stride = {}
        self.out_coords = {}
        self.kmaps = {}
        self.tuning = {}
        self.calls = {}


def check_coords_values(coords, stride):
    """Raise ValueError for coordinates that are out of range, off the stride lattice, or duplicated.

    coords: int32 [N, 4], contiguous; stride: 3-tuple.  torch.ops.torchsp.coords_summary does
    every test in one pass (CUDA: one memset, one kernel, one synchronisation here)."""
    if coords.shape[0] == 0:
        return
    s = torch.ops.torchsp.coords_summary(coords, list(stride)).tolist()
    hi, lo = s[0:4], [~v for v in s[4:8]]  # words 4..7 are the maxima of ~c
    if lo[0] < 0 or hi[0] > BATCH_MAX:
        raise ValueError(f"coords: batch index must be in [0, {BATCH_MAX}], got range [{lo[0]}, {hi[0]}]")
    for a, name in ((1, "x"), (2, "y"), (3, "z")):
        if lo[a] < COORD_MIN or hi[a] > COORD_MAX:
            raise ValueError(
                f"coords: {name} must be in [{COORD_MIN}, {COORD_MAX}], got range [{lo[a]}, {hi[a]}]"
            )
    if s[8] > 0:
        raise ValueError(f"coords: coordinates of a tensor with stride {stride} must be multiples of it")
    if s[9] > 0:
        raise ValueError("coords: duplicate coordinates (each (batch, x, y, z) may appear once)")


def _check_feats(feats):
    """The checks on feats that SparseTensor's constructor and replace share: a tensor, [N, C],
    floating point (rows and device are checked against the coordinates by each)."""
    if not isinstance(feats, torch.Tensor):
        raise TypeError(f"feats must be a torch.Tensor, got {type(feats).__name__}")
    if feats.dim() != 2:
        raise ValueError(f"feats must be [N, C], got shape {tuple(feats.shape)}")
    if not feats.is_floating_point():
        raise TypeError(f"feats must be a floating-point tensor, got {feats.dtype}")


class SparseTensor:
    """Features on sparse voxel coordinates.

    Args:
        feats: [N, C] floating-point tensor (fp32, fp16, bf16; fp64 on CPU).
        coords: [N, 4] int32 tensor of (batch, x, y, z) at full resolution; a tensor of
            stride t has coordinates that are multiples of t. Negative x, y, z are allowed.
            Other integer dtypes are converted; floating-point coordinates are an error.
        stride: int or 3-tuple, the tensor stride.
        cache: the SparseCache to share (derived tensors); a new one by default.
        coord_key: hashable name of the coordinate set (derived tensors).
        check: validate values (range, lattice, duplicates). Skipped while tracing or
            compiling; costs one sort and a host sync on CUDA.
    """

    def __init__(self, feats, coords, stride=1, *, cache=None, coord_key=None, check=True):
        _check_feats(feats)
        if not isinstance(coords, torch.Tensor):
            raise TypeError(f"coords must be a torch.Tensor, got {type(coords).__name__}")
        if coords.dim() != 2 or coords.shape[1] != 4:
            raise ValueError(
                f"coords must be [N, 4] (batch, x, y, z), got shape {tuple(coords.shape)}"
                + ("; add a batch column, e.g. with torchsp.sparse_collate" if coords.dim() == 2 and coords.shape[1] == 3 else "")
            )
        if coords.is_floating_point() or coords.dtype == torch.bool or coords.is_complex():
            raise TypeError(f"coords must be an integer tensor (int32), got {coords.dtype}")
        if feats.shape[0] != coords.shape[0]:
            raise ValueError(f"feats has {feats.shape[0]} rows but coords has {coords.shape[0]}")
        if feats.device != coords.device:
            raise ValueError(f"feats is on {feats.device} but coords is on {coords.device}")
        stride = triple(stride, "stride")
        if coords.dtype != torch.int32:
            if check and not _tracing() and coords.shape[0] > 0:
                lo, hi = int(coords.min()), int(coords.max())
                if lo < COORD_MIN or hi > COORD_MAX:
                    raise ValueError(f"coords: values must be in [{COORD_MIN}, {COORD_MAX}], got [{lo}, {hi}]")
            coords = coords.int()
        coords = coords.contiguous()
        if check and not _tracing():
            check_coords_values(coords, stride)
        self.feats = feats
        self.coords = coords
        self.stride = stride
        self.coord_key = coord_key if coord_key is not None else ("input", stride)
        if cache is None:
            cache = SparseCache()
            cache.coords_by_stride[stride] = (coords, self.coord_key)
        self.cache = cache

    @classmethod
    def _derived(cls, feats, coords, stride, cache, coord_key):
        """A tensor from parts torchsp made itself (a conv's or pool's output): [N, C] feats on
        int32 coords [N, 4], a 3-tuple stride, the input's cache.  Skips the argument checks,
        ~3 us of Python a layer call.  Eager code only (traced code takes the constructor)."""
        self = cls.__new__(cls)
        self.feats, self.coords, self.stride, self.coord_key, self.cache = feats, coords, stride, coord_key, cache
        return self

    @property
    def shape(self):
        return self.feats.shape

    @property
    def device(self):
        return self.feats.device

    @property
    def dtype(self):
        return self.feats.dtype

    def replace(self, feats):
        """A SparseTensor with new feats [N, C'] on the same coordinates and cache.

        Checks what can change (type, shape, dtype kind, device) and skips the constructor's
        coordinate and stride handling, a few us of Python that every nonlinearity and
        normalisation layer call paid."""
        _check_feats(feats)
        if feats.shape[0] != self.feats.shape[0]:
            raise ValueError(f"replace: feats must be [{self.feats.shape[0]}, C], got shape {tuple(feats.shape)}")
        if feats.device != self.coords.device:
            raise ValueError(f"feats is on {feats.device} but coords is on {self.coords.device}")
        if _tracing():  # traced code takes the constructor (SparseTensor._derived)
            return SparseTensor(feats, self.coords, self.stride, cache=self.cache, coord_key=self.coord_key,
                                check=False)
        return SparseTensor._derived(feats, self.coords, self.stride, self.cache, self.coord_key)

    def to(self, *args, **kwargs):
        """Move or cast feats like Tensor.to; coords follow the device (a new cache on a new device)."""
        feats = self.feats.to(*args, **kwargs)
        if feats.device == self.coords.device:
            return self.replace(feats)
        return SparseTensor(feats, self.coords.to(feats.device), self.stride,
                            coord_key=self.coord_key, check=False)

    def cuda(self, device=None):
        return self.to(torch.device("cuda") if device is None else device)

    def cpu(self):
        return self.to("cpu")

    def dense(self, spatial_shape=None, origin=None):
        """Scatter into a dense [B, C, X, Y, Z] grid at this tensor's stride.

        origin (3 ints, full resolution) defaults to the per-axis minimum coordinate;
        spatial_shape defaults to the extent of the coordinates.
        """
        c = self.coords.long()
        st = torch.tensor(self.stride, device=c.device)
        org = c[:, 1:].amin(0) if origin is None else torch.tensor(origin, device=c.device)
        idx = torch.div(c[:, 1:] - org, st, rounding_mode="floor")
        if spatial_shape is None:
            spatial_shape = (idx.amax(0) + 1).tolist() if c.shape[0] else [0, 0, 0]
        b = int(c[:, 0].max()) + 1 if c.shape[0] else 0
        out = self.feats.new_zeros((b, self.feats.shape[1], *spatial_shape))
        out[c[:, 0], :, idx[:, 0], idx[:, 1], idx[:, 2]] = self.feats
        return out

    def __repr__(self):
        return (f"SparseTensor(feats={tuple(self.feats.shape)} {self.feats.dtype}, stride={self.stride}, "
                f"device={self.feats.device})")
