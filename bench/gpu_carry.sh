#!/usr/bin/env bash
# Prepares, on this (GPU-less) machine, what bench/gpu_check.sh needs on the NVIDIA machine, which has no internet,
# no ggml and no gguf, and takes at most 64 MiB of working tree and carried files together:
#
#   build/gpu-carry/ggml-gpu.tar.xz      the `ggml` Python package (ggml-python 0.0.45) built with CUDA for sm_90,
#                                        Vulkan and a portable AVX2 CPU backend (~7 MB compressed)
#   build/gpu-carry/gguf-*.whl           the engine's GGUF dependency (pure Python)
#   build/gpu-carry/vulkan/libvulkan.so.1  the Vulkan loader (the machine has NVIDIA's Vulkan driver, not the loader)
#   build/gpu-carry/ggml_python-0.0.45.tar.gz  the sdist: gpu_check.sh builds CUDA from it if the package won't load
#
# The CUDA build needs nvcc (13 here) and cuBLAS headers and libraries to link against: cuBLAS comes from PyPI's
# nvidia-cublas wheel (420 MB download, only its headers and two libraries are unpacked; none is carried — the GPU
# machine has its own). One job at nice 19, so that it can run beside other work: ~1 h on a busy 2-core machine.
# Needs ./dev setup (cmake, ninja, the Vulkan headers under build/vulkan). Usage: bench/gpu_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck disable=SC1091
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
GGML_PY_VERSION=0.0.45
BUILD=${GPU_BUILD_DIR:-build/ggml-gpu}  # a cmake build tree; kept, so that a second run only repackages
CARRY=build/gpu-carry
VK_INC=$ROOT/build/vulkan/headers/usr/include
SDIST=/work/lcp-dl/ggml_python-$GGML_PY_VERSION.tar.gz
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
mkdir -p "$BUILD" "$CARRY/vulkan"

[ -f "$VK_INC/vulkan/vulkan.hpp" ] || { echo "no Vulkan headers in $VK_INC: run ./dev setup as root" >&2; exit 1; }
if [ ! -f "$CARRY/ggml_python-$GGML_PY_VERSION.tar.gz" ]; then
  if [ -f "$SDIST" ]; then cp "$SDIST" "$CARRY/"; else
    python -m pip download -q --no-deps --no-binary ggml-python "ggml-python==$GGML_PY_VERSION" -d "$CARRY"; fi
fi
[ -d "$BUILD/ggml_python-$GGML_PY_VERSION" ] || tar xzf "$CARRY/ggml_python-$GGML_PY_VERSION.tar.gz" -C "$BUILD"

CB=$ROOT/$BUILD/cublas/nvidia/cu13
if [ ! -f "$CB/lib/libcublasLt.so.13" ]; then
  python -m pip download -q --no-deps "nvidia-cublas==13.0.*" -d "$BUILD/dl"
  python - "$BUILD" <<'EOF'
import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob(f"{sys.argv[1]}/dl/nvidia_cublas-*.whl")[0])
for n in z.namelist():
    if "/include/" in n or n.endswith(("libcublas.so.13", "libcublasLt.so.13")):
        z.extract(n, f"{sys.argv[1]}/cublas")
EOF
fi

started=$SECONDS
# VMM off: it would link libcuda.so, which only a machine with the driver has (ggml then uses its plain pool).
nice -n 19 cmake -S "$BUILD/ggml_python-$GGML_PY_VERSION" -B "$BUILD/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DSKBUILD_PROJECT_NAME=ggml_python -DSKBUILD_PROJECT_VERSION=$GGML_PY_VERSION -DSKBUILD_STATE=wheel \
  -DSKBUILD_PLATLIB_DIR="$ROOT/$BUILD/install" \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$NVCC" -DGGML_CUDA_NO_VMM=ON \
  -DCUDA_cublas_LIBRARY="$CB/lib/libcublas.so.13" -DCUDA_cublasLt_LIBRARY="$CB/lib/libcublasLt.so.13" \
  -DCMAKE_CUDA_FLAGS="-I$CB/include" -DCMAKE_CXX_FLAGS="-I$CB/include" \
  -DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR="$VK_INC" >"$BUILD/configure.log" 2>&1 \
  || { tail -20 "$BUILD/configure.log" >&2; exit 1; }
nice -n 19 cmake --build "$BUILD/cmake" -j "${JOBS:-1}" >"$BUILD/build.log" 2>&1 || { tail -30 "$BUILD/build.log" >&2; exit 1; }
cmake --install "$BUILD/cmake" >"$BUILD/install.log" 2>&1
echo "ggml CUDA+Vulkan: built in $((SECONDS - started)) s" >&2

# The package as pip would install it: ggml-python's Python files and the libraries.
pkg=$BUILD/package/ggml
rm -rf "$BUILD/package" && mkdir -p "$pkg/lib"
(cd "$BUILD/ggml_python-$GGML_PY_VERSION/ggml" && tar cf - --exclude=__pycache__ .) | tar xf - -C "$pkg"
cp -L "$BUILD"/install/ggml/lib/*.so "$pkg/lib/"
tar cJf "$CARRY/ggml-gpu.tar.xz.partial" -C "$BUILD/package" ggml && mv "$CARRY/ggml-gpu.tar.xz.partial" "$CARRY/ggml-gpu.tar.xz"

gguf=$(python -c "import importlib.metadata as m; print(m.version('gguf'))")
ls "$CARRY"/gguf-"$gguf"-*.whl >/dev/null 2>&1 || python -m pip download -q --no-deps "gguf==$gguf" -d "$CARRY"
cp -L /usr/lib/x86_64-linux-gnu/libvulkan.so.1 "$CARRY/vulkan/libvulkan.so.1"

ls -la "$pkg/lib" >&2
du -b "$CARRY"/* "$CARRY"/vulkan/* >&2
echo "carry: $(du -cb "$CARRY"/*.* "$CARRY"/vulkan/* | tail -1 | cut -f1) bytes in $CARRY" >&2
