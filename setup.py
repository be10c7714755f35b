"""Build torchsp: C11 CPU kernels, CUDA kernels, and the C++ shim.

torch.utils.cpp_extension compiles every source it is given as C++ (or CUDA),
so the C11 files of csrc/cpu are first built here into a static archive with
`cc -std=c11 -fopenmp` and linked into the extension.  CUDA is built when the
installed torch has CUDA and nvcc is found (TORCHSP_CUDA=0/1 overrides).

    pip install --no-build-isolation .      # or -e . for development
"""

import glob
import os
import subprocess
import sys

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _want_cuda():
    env = os.environ.get("TORCHSP_CUDA")
    if env is not None:
        return env == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def _want_wgmma():
    """wgmma kernels (conv_wgmma.cu) are built for sm_90a: TORCH_CUDA_ARCH_LIST=9.0a."""
    return "9.0a" in os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()


def _write_build_info(with_cuda):
    """Record the torch this build is for; torchsp/_loader.py compares at import."""
    path = os.path.join(ROOT, "torchsp", "_build_info.py")
    text = (
        '"""Written by setup.py: what this build of torchsp was compiled against."""\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"CUDA_VERSION = {(torch.version.cuda if with_cuda else None)!r}\n"
        f"WITH_CUDA = {bool(with_cuda)!r}\n"
        f"WITH_WGMMA = {bool(with_cuda and _want_wgmma())!r}\n"
        f"VERSION = {VERSION!r}\n"
    )
    with open(path, "w") as f:
        f.write(text)


class BuildWithC11(BuildExtension):
    """Compile csrc/cpu/*.c as C11 into libtorchsp_cpu.a, then the extension."""

    def build_extensions(self):
        c_sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.c")))
        out_dir = os.path.join(os.path.abspath(self.build_temp), "c11")
        os.makedirs(out_dir, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        objects = []
        for src in c_sources:
            obj = os.path.join(out_dir, os.path.basename(src)[:-2] + ".o")
            cmd = [cc, "-std=c11", "-O3", "-fPIC", "-fopenmp", "-Wall", "-Wextra",
                   "-I", os.path.join(ROOT, "csrc"), "-c", os.path.join(ROOT, src), "-o", obj]
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd)
            objects.append(obj)
        archive = os.path.join(out_dir, "libtorchsp_cpu.a")
        if os.path.exists(archive):
            os.remove(archive)
        if objects:
            subprocess.check_call(["ar", "rcs", archive] + objects)
            for ext in self.extensions:
                ext.extra_objects = list(ext.extra_objects or []) + [archive]
        super().build_extensions()


def _extension():
    with_cuda = _want_cuda()
    _write_build_info(with_cuda)
    sources = _rel([os.path.join(ROOT, "csrc", n) for n in ("ops.cpp", "eager.cpp", "autograd.cpp", "shim_cpu.cpp",
                                                                 "batch_norm.cpp", "eager_norm.cpp",
                                                                 "shim_norm_cpu.cpp")])
    cxx = ["-O3", "-std=c++17", "-fopenmp"]
    kwargs = dict(
        name="torchsp._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_link_args=["-fopenmp"],
        py_limited_api=False,
    )
    if with_cuda:
        sources += _rel([os.path.join(ROOT, "csrc", "shim_cuda.cpp"), os.path.join(ROOT, "csrc", "shim_ggs.cpp"),
                              os.path.join(ROOT, "csrc", "shim_norm_cuda.cpp")])
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
        nvcc = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
        if _want_wgmma():
            nvcc.append("-DTSP_WGMMA")
        return CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)
    return CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)


setup(
    name="torchsp",
    version=VERSION,
    description="Spatially sparse 3D convolution for PyTorch (CPU and CUDA)",
    packages=find_packages(include=["torchsp", "torchsp.*"]),
    package_data={"torchsp": ["data/*.npz", "data/*.md"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildWithC11.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["numpy"],
    zip_safe=False,
)
