#!/usr/bin/env bash
# The GPU checks, in one run on the NVIDIA machine (an H200; Python 3.12 with numpy, jinja2, tokenizers, xxhash,
# scikit-build-core, nanobind, cmake, ninja, pytest, hypothesis; nvcc 13 and cuBLAS; no ggml, no gguf, no internet).
# Prepared here: bench/gpu_carry.sh fills build/gpu-carry/ (~8 MB); everything else is the working tree.
#
#   run: bash bench/gpu_check.sh     carry: ["build/gpu-carry"]     results: $OUT (summary.txt first)
#
# Steps, each timed in $OUT/summary.txt, none stopping the others:
#   machine       nvidia-smi, the Vulkan drivers, what was carried
#   ggml_vulkan   the carried `ggml` package with Vulkan (portable AVX2 CPU) → build/gpu-site-vk
#   ggml_cuda     ggml with CUDA (sm_90, this CPU) built from the carried sdist on every core → build/gpu-site-cuda
#                 (or unpacked from ggml-cuda.tar.xz when that was carried); ~2–3 min estimated on 16 cores
#   python_deps, native_core   gguf from its wheel; the engine's C++ core built for this Python
#   then for each ggml (cuda, vulkan): `tokenwing info --json`, the device tests (tests/compute: every device that
#   ggml shows, against its CPU backend), host→device copy bandwidth, and the split-graph crash check.
# The VRAM tier's issue adds the engine benchmarks here. GPU_CHECK_CUDA=0 skips the CUDA steps (a dry run on a
# machine without CUDA: GGML_VK_VISIBLE_DEVICES=0 then tests lavapipe).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/build/gpu-out}
CARRY=${GPU_CARRY:-$ROOT/build/gpu-carry}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
t0=$SECONDS
: >"$OUT/summary.txt"

step() {  # step NAME COMMAND...: output in $OUT/NAME.txt; time and exit code in summary.txt
  local name=$1 s=$SECONDS rc
  shift
  "$@" >"$OUT/$name.txt" 2>&1
  rc=$?
  echo "$name: rc=$rc, $((SECONDS - s)) s (at $((SECONDS - t0)) s)" | tee -a "$OUT/summary.txt"
  return $rc
}

machine() {
  nvidia-smi || true
  "$PY" --version
  uname -a
  ldd --version | head -1
  nproc
  ls -la /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>&1
  ls -la "$CARRY" "$CARRY/vulkan"
}

# Run-time libraries: the Vulkan loader (carried) and, for a carried CUDA build, this machine's cuBLAS.
cublas=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/lib/x86_64-linux-gnu -name 'libcublas.so.13*' \
  2>/dev/null | head -1)
cuda_libs=${CUDA_LIBS:-${cublas:+$(dirname "$cublas")}}
export LD_LIBRARY_PATH=$CARRY/vulkan${cuda_libs:+:$cuda_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export GGML_NO_BACKTRACE=1
export TOKENWING_TEST_VK_DEFAULT=1  # tests/compute: ggml's own Vulkan device choice (GPUs), not lavapipe
export GGML_VK_DISABLE_F16=1
DEPS=$ROOT/build/gpu-deps

with_ggml() {  # with_ggml SITE COMMAND...: runs COMMAND with that ggml (and gguf, the engine) importable
  local site=$1
  shift
  PYTHONPATH=$site:$DEPS:$ROOT/engine:$ROOT "$@"
}

ggml_loads() {
  with_ggml "$1" "$PY" -c "import ggml; print('CUDA' if ggml.GGML_USE_CUDA else '-', 'Vulkan' if ggml.GGML_USE_VULKAN else '-', \
[ggml.ggml_backend_dev_name(ggml.ggml_backend_dev_get(i)) for i in range(ggml.ggml_backend_dev_count())])"
}

unpack() {  # unpack TARBALL SITE
  rm -rf "$2" && mkdir -p "$2" && tar xJf "$1" -C "$2" && bench/ggml_python_fix.sh "$2/ggml/ggml.py" \
    && ls -la "$2/ggml/lib" && ggml_loads "$2"
}

build_cuda() {  # ggml with CUDA from the sdist, every core; no Vulkan (no glslc here)
  local b=$ROOT/build/ggml-cuda-here site=$ROOT/build/gpu-site-cuda
  local extra=() nv
  rm -rf "$b" && mkdir -p "$b" && tar xzf "$CARRY"/ggml_python-*.tar.gz -C "$b" || return 1
  if ! ls /usr/local/cuda/include/cublas_v2.h /usr/local/cuda/targets/*/include/cublas_v2.h >/dev/null 2>&1; then
    # cuBLAS from pip's nvidia-cublas wheel instead of the toolkit (the toolkit's own dirs are searched otherwise)
    nv=$("$PY" -c "import site, glob; h = [g for p in site.getsitepackages() for g in glob.glob(p + '/nvidia/cu13')]
print(h[0] if h else '')" 2>/dev/null)
    [ -n "$nv" ] && export LD_LIBRARY_PATH=$nv/lib:$LD_LIBRARY_PATH && extra=(-DCUDA_cublas_LIBRARY="$nv/lib/libcublas.so.13" -DCUDA_cublasLt_LIBRARY="$nv/lib/libcublasLt.so.13"
      -DCMAKE_CUDA_FLAGS="-I$nv/include" -DCMAKE_CXX_FLAGS="-I$nv/include")
  fi
  cmake -S "$b"/ggml_python-* -B "$b/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSKBUILD_PROJECT_NAME=ggml_python \
    -DSKBUILD_PROJECT_VERSION=0.0.45 -DSKBUILD_STATE=wheel -DSKBUILD_PLATLIB_DIR="$b/install" -DGGML_NATIVE=ON \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 "${extra[@]}" || return 1
  time cmake --build "$b/cmake" -j "$(nproc)" || return 1
  cmake --install "$b/cmake" >/dev/null || return 1
  rm -rf "$site" && mkdir -p "$site" && cp -r "$b"/ggml_python-*/ggml "$site/ggml" && rm -rf "$site/ggml/lib" \
    && cp -r "$b/install/ggml/lib" "$site/ggml/lib" && bench/ggml_python_fix.sh "$site/ggml/ggml.py" \
    && ls -la "$site/ggml/lib" && ggml_loads "$site"
}

python_deps() {
  rm -rf "$DEPS" && "$PY" -m pip install --no-index --no-deps --target "$DEPS" "$CARRY"/gguf-*.whl \
    && PYTHONPATH=$DEPS "$PY" -c "import gguf, numpy, tokenizers, jinja2, xxhash"
}

native_core() {  # the engine's C++ core for this Python, where `import tokenwing._core` finds it
  cmake -S engine/native -B build/core-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v "$PY")" && cmake --build build/core-gpu -j "$(nproc)" \
    && cp build/core-gpu/_core*.so engine/tokenwing/ && PYTHONPATH=engine "$PY" -c "import tokenwing._core"
}

checks() {  # checks NAME SITE: everything that needs a device, with that ggml
  local name=$1 site=$2
  step "info_$name" with_ggml "$site" "$PY" -m tokenwing info --json
  step "device_tests_$name" with_ggml "$site" timeout 420 "$PY" -m pytest -q -p no:cacheprovider \
    --junitxml="$OUT/device_tests_$name.xml" tests/compute
  step "copy_bench_$name" with_ggml "$site" timeout 120 "$PY" bench/device_copy_bench.py --json "$OUT/copy_bench_$name.json"
  step "split_stress_$name" with_ggml "$site" timeout 240 "$PY" bench/split_stress.py --runs 4
}

step machine machine
step ggml_vulkan unpack "$CARRY/ggml-vulkan.tar.xz" "$ROOT/build/gpu-site-vk"
if [ "${GPU_CHECK_CUDA:-1}" != 0 ]; then
  if [ -f "$CARRY/ggml-cuda.tar.xz" ]; then
    step ggml_cuda unpack "$CARRY/ggml-cuda.tar.xz" "$ROOT/build/gpu-site-cuda"
  else
    step ggml_cuda build_cuda
  fi
fi
step python_deps python_deps
step native_core native_core
[ "${GPU_CHECK_CUDA:-1}" = 0 ] || checks cuda "$ROOT/build/gpu-site-cuda"
checks vulkan "$ROOT/build/gpu-site-vk"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
