#!/usr/bin/env bash
# Prepares, on this (GPU-less) machine, what bench/gpu_check.sh needs on the NVIDIA machine, which has no internet,
# no ggml, no gguf and no llama.cpp, and takes at most 64 MiB of working tree (~25 MB, the demo model most of it) and
# carried files together. Into build/gpu-carry/ (~15 MB; carry that folder):
#
#   ggml-vulkan.tar.xz          the `ggml` Python package (ggml-python 0.0.45) with Vulkan and the portable AVX2 CPU
#                               backend: the installer's avx2-vulkan variant (3.5 MB compressed)
#   ggml_python-0.0.45.tar.gz   the sdist: gpu_check.sh builds the CUDA variant from it there, on 16 cores
#   gguf-*.whl                  the engine's GGUF dependency (pure Python)
#   vulkan/libvulkan.so.1       the Vulkan loader (the machine has NVIDIA's Vulkan driver, not the loader)
#   refs/                       llama.cpp's logits of the device tests' models, with the models (bench/gpu_refs.py;
#                               6.4 MB): the GPU machine has no llama.cpp
#
# CUDA=1 also builds ggml with CUDA (sm_90) + Vulkan here (nvcc 13; cuBLAS to link against from PyPI's nvidia-cublas
# wheel, 420 MB download, none of it carried) into ggml-cuda.tar.xz — 42 MB compressed (libggml-cuda.so is 67 MB),
# too much beside the working tree: measured 62 min with 1 job at nice 19 on our busy 2-core machine. gpu_check.sh
# uses it when it is there, else builds CUDA on the GPU machine.
# Needs ./dev setup (the .venv; the Vulkan headers under build/vulkan, as root). Usage: [CUDA=1] bench/gpu_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck disable=SC1091
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
GGML_PY_VERSION=0.0.45
CARRY=build/gpu-carry
VK_INC=$ROOT/build/vulkan/headers/usr/include
mkdir -p "$CARRY/vulkan"

if [ ! -f "$CARRY/ggml_python-$GGML_PY_VERSION.tar.gz" ]; then
  python -m pip download -q --no-deps --no-binary ggml-python "ggml-python==$GGML_PY_VERSION" -d "$CARRY"
fi
src=build/gpu-carry-src
[ -d "$src/ggml_python-$GGML_PY_VERSION" ] || { mkdir -p "$src" && tar xzf "$CARRY/ggml_python-$GGML_PY_VERSION.tar.gz" -C "$src"; }

package() {  # package NAME LIBDIR: the `ggml` package as pip would install it (Python files + LIBDIR's libraries)
  local stage=$src/package-$1
  rm -rf "$stage" && mkdir -p "$stage/ggml/lib"
  (cd "$src/ggml_python-$GGML_PY_VERSION/ggml" && tar cf - --exclude=__pycache__ .) | tar xf - -C "$stage/ggml"
  cp -L "$2"/*.so "$stage/ggml/lib/"
  bench/ggml_python_fix.sh "$stage/ggml/ggml.py"  # `import ggml` fails on CUDA builds otherwise
  tar cJf "$CARRY/$1.tar.xz.partial" -C "$stage" ggml && mv "$CARRY/$1.tar.xz.partial" "$CARRY/$1.tar.xz"
}

installer/build-ggml-variants.sh avx2-vulkan  # cached when built already
package ggml-vulkan build/ggml-variants/avx2-vulkan/lib

if [ "${CUDA:-0}" = 1 ]; then
  BUILD=${GPU_BUILD_DIR:-build/ggml-gpu}
  CB=$ROOT/$BUILD/cublas/nvidia/cu13
  mkdir -p "$BUILD"
  [ -d "$BUILD/ggml_python-$GGML_PY_VERSION" ] || tar xzf "$CARRY/ggml_python-$GGML_PY_VERSION.tar.gz" -C "$BUILD"
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
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="${NVCC:-/usr/local/cuda/bin/nvcc}" \
    -DGGML_CUDA_NO_VMM=ON -DCUDA_cublas_LIBRARY="$CB/lib/libcublas.so.13" \
    -DCUDA_cublasLt_LIBRARY="$CB/lib/libcublasLt.so.13" -DCMAKE_CUDA_FLAGS="-I$CB/include" \
    -DCMAKE_CXX_FLAGS="-I$CB/include" -DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR="$VK_INC" >"$BUILD/configure.log" 2>&1 \
    || { tail -20 "$BUILD/configure.log" >&2; exit 1; }
  nice -n 19 cmake --build "$BUILD/cmake" -j "${JOBS:-1}" >"$BUILD/build.log" 2>&1 || { tail -30 "$BUILD/build.log" >&2; exit 1; }
  cmake --install "$BUILD/cmake" >"$BUILD/install.log" 2>&1
  echo "ggml CUDA+Vulkan: built in $((SECONDS - started)) s" >&2
  package ggml-cuda "$BUILD/install/ggml/lib"
fi

gguf=$(python -c "import importlib.metadata as m; print(m.version('gguf'))")
ls "$CARRY"/gguf-"$gguf"-*.whl >/dev/null 2>&1 || python -m pip download -q --no-deps "gguf==$gguf" -d "$CARRY"
cp -L /usr/lib/x86_64-linux-gnu/libvulkan.so.1 "$CARRY/vulkan/libvulkan.so.1"
rm -rf "$CARRY/refs.partial" && python bench/gpu_refs.py "$CARRY/refs.partial" >/dev/null \
  && rm -rf "$CARRY/refs" && mv "$CARRY/refs.partial" "$CARRY/refs"
du -b "$CARRY"/* "$CARRY"/vulkan/* >&2
echo "carry: $(du -cb "$CARRY"/*.* "$CARRY"/vulkan/* "$CARRY"/refs | tail -1 | cut -f1) bytes in $CARRY" >&2
