#!/usr/bin/env bash
# cross_build.sh: build torchsp._C for another machine's torch and Python on this one.
#
# Why: the GPU machines we are lent have no network and pay device time for every build
# (conv_wgmma.cu alone takes minutes), while this CPU machine has nvcc but a CPU-only torch
# of another version, whose headers lack CUDA's parts.  So the extension is compiled here
# against the target's own torch headers and libraries (from its PyPI wheel) and CPython
# headers, with the flags setup.py would use (torch.utils.cpp_extension's COMMON_NVCC_FLAGS,
# -DTORCH_EXTENSION_NAME=_C, TSP_WGMMA for sm_90a), and the .so is carried to the target.
# A hand-written ninja file keeps the objects, so a second call recompiles only what changed
# (header dependencies included).
#
#   tools/cross_build.sh fetch   [DEPS]           # torch wheel + CPython headers into DEPS
#   tools/cross_build.sh build   DEPS BUILD OUT   # objects in BUILD, OUT.txz = torchsp/_C*.so
#                                                 #   + torchsp/_build_info.py
# On the target, from the repository root: tar xJf OUT.txz -C .   (then import torchsp).
#
# Settings (environment): TORCH_VERSION (2.11.0), TORCH_CUDA (13.0: the wheel's CUDA, checked),
# PY (3.12), PY_DEB (the Ubuntu libpython-dev package with that Python's headers), ARCH
# (compute_90a,code=sm_90a; sm_90a builds the wgmma kernels), JOBS (2), SRC (this checkout).
# Needs: pip, curl, dpkg-deb, unzip, ninja, nvcc of the wheel's CUDA major version, g++.
set -euo pipefail
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
TORCH_CUDA=${TORCH_CUDA:-13.0}
PY=${PY:-3.12}
PY_DEB=${PY_DEB:-http://archive.ubuntu.com/ubuntu/pool/main/p/python3.12/libpython3.12-dev_3.12.3-1ubuntu0.9_amd64.deb}
ARCH=${ARCH:-compute_90a,code=sm_90a}
SRC=$(realpath "${SRC:-$(dirname "$0")/..}")
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

fetch() {
  local deps=$1 tag=cp${PY/./}
  mkdir -p "$deps" && cd "$deps"
  pip download -q --no-deps "torch==$TORCH_VERSION" --python-version "$PY" --only-binary=:all: \
    --platform manylinux_2_28_x86_64 -d .
  local whl; whl=$(ls torch-"$TORCH_VERSION"-"$tag"-*.whl | head -1)
  rm -rf torch && unzip -q "$whl" 'torch/include/*' 'torch/lib/*' 'torch/version.py'
  grep -q "cuda: Optional\[str\] = '$TORCH_CUDA'" torch/version.py ||
    { echo "cross_build: $whl is not a CUDA $TORCH_CUDA build: $(grep '^cuda' torch/version.py)" >&2; exit 1; }
  curl -sf -o python-dev.deb "$PY_DEB" && rm -rf python && dpkg-deb -x python-dev.deb python
  test -f "python/usr/include/python$PY/Python.h"
  echo "cross_build: torch $TORCH_VERSION (CUDA $TORCH_CUDA) and Python $PY headers in $deps"
}

build() {
  local deps; deps=$(realpath "$1"); local b=$2 out=$3
  mkdir -p "$b"; b=$(realpath "$b")
  local t=$deps/torch py=$deps/python/usr/include
  test -f "$t/version.py" || { echo "cross_build: no torch in $deps: run '$0 fetch $deps' first" >&2; exit 1; }
  local version cuda
  version=$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$t/version.py")
  cuda=$(sed -n "s/^cuda: Optional\[str\] = '\(.*\)'/\1/p" "$t/version.py")
  local inc="-I$py -I$SRC/csrc -I$t/include -I$t/include/torch/csrc/api/include -I$CUDA_HOME/include"
  inc="$inc -I$py/python$PY -I$py/x86_64-linux-gnu/python$PY"
  local def="-DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C"
  local wgmma=""; case $ARCH in *90a*) wgmma="-DTSP_WGMMA";; esac
  local objs="" f o
  {
    echo "cxxflags = -fPIC -O3 -std=c++17 -fopenmp $inc $def"
    echo "nvflags = -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr $wgmma -D__CUDA_NO_HALF_OPERATORS__" \
         "-D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__" \
         "--compiler-options -fPIC -gencode=arch=$ARCH $inc $def"
    printf 'rule cc\n  command = gcc -std=c11 -O3 -fPIC -fopenmp -Wall -Wextra -I%s/csrc -MD -MF $out.d -c $in -o $out\n' "$SRC"
    printf '  depfile = $out.d\n  deps = gcc\n'
    printf 'rule cxx\n  command = g++ -MD -MF $out.d $cxxflags -c $in -o $out\n  depfile = $out.d\n  deps = gcc\n'
    printf 'rule nvcc\n  command = %s/bin/nvcc -MD -MF $out.d $nvflags -c $in -o $out\n  depfile = $out.d\n  deps = gcc\n' "$CUDA_HOME"
    printf 'rule link\n  command = g++ -shared $in -L%s/lib -L%s/lib64 -lc10 -ltorch -ltorch_cpu -ltorch_python' "$t" "$CUDA_HOME"
    printf ' -lcudart -lc10_cuda -ltorch_cuda -fopenmp -o $out\n'
    for f in "$SRC"/csrc/cpu/*.c; do o=cpu_$(basename "$f" .c).o; echo "build $o: cc $f"; objs="$objs $o"; done
    for f in "$SRC"/csrc/*.cpp; do o=$(basename "$f" .cpp).o; echo "build $o: cxx $f"; objs="$objs $o"; done
    for f in "$SRC"/csrc/cuda/*.cu; do o=$(basename "$f" .cu).o; echo "build $o: nvcc $f"; objs="$objs $o"; done
    echo "build _C.cpython-${PY/./}-x86_64-linux-gnu.so: link$objs"
  } > "$b/build.ninja"
  (cd "$b" && ninja -j "${JOBS:-2}" > ninja.log 2>&1) || { tail -30 "$b/ninja.log"; exit 1; }
  rm -rf "$b/pkg" && mkdir -p "$b/pkg/torchsp"
  cp "$b/_C.cpython-${PY/./}-x86_64-linux-gnu.so" "$b/pkg/torchsp/"
  local with_wgmma=False; [ -n "$wgmma" ] && with_wgmma=True
  printf '"""Written by tools/cross_build.sh: what this build of torchsp was compiled against."""\n'\
'TORCH_VERSION = %s\nCUDA_VERSION = %s\nWITH_CUDA = True\nWITH_WGMMA = %s\nVERSION = %s\n' \
    "'$version'" "'$cuda'" "$with_wgmma" \
    "$(sed -n 's/^VERSION = \(".*"\)/\1/p' "$SRC/setup.py" | tr '"' "'")" > "$b/pkg/torchsp/_build_info.py"
  tar cJf "$out" -C "$b/pkg" torchsp
  echo "cross_build: $out (torch $version, CUDA $cuda, $ARCH)"
}

case "${1:-}" in
  fetch) fetch "${2:-deps}" ;;
  build) [ $# -eq 4 ] || { echo "usage: $0 build DEPS BUILD OUT.txz" >&2; exit 2; }; build "$2" "$3" "$4" ;;
  *) sed -n '2,21p' "$0"; exit 2 ;;
esac
