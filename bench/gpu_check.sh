#!/usr/bin/env bash
# The GPU checks, in one run on the NVIDIA machine (an H200; Python 3.12 with numpy, jinja2, tokenizers, xxhash,
# scikit-build-core, nanobind, cmake, ninja, pytest, hypothesis; nvcc 13 and cuBLAS; no ggml, no gguf, no internet).
# Prepared here: bench/gpu_carry.sh fills build/gpu-carry/ (carry it: ~12 MB); everything else is the working tree.
#
#   run: bash bench/gpu_check.sh            (carry: ["build/gpu-carry"]; results under $OUT)
#
# Steps, each timed in $OUT/timings.txt: the machine (nvidia-smi, Vulkan drivers); ggml from the carried package
# (CUDA sm_90 + Vulkan + CPU), or — if it does not load there — built from the carried sdist with CUDA only on all
# cores; the native core; `tokenwing info --json`; the device tests (tests/compute) on every CUDA and Vulkan device
# ggml shows; a host→device copy benchmark (pinned and plain memory); the split-graph crash check
# (bench/split_stress.py). Never stops at the first failure: each step's
# exit code is in $OUT/summary.txt. Later steps (the engine's benchmarks) are added by the VRAM tier's issue.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/build/gpu-out}
CARRY=${GPU_CARRY:-$ROOT/build/gpu-carry}
SITE=$ROOT/build/gpu-site  # the ggml package goes here (PYTHONPATH), nothing is installed system-wide
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$SITE"
t0=$SECONDS
: >"$OUT/summary.txt"

step() {  # step NAME COMMAND...: runs it with its output in $OUT/NAME.txt, records time and exit code
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
  ls -la /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>&1
  ls "$CARRY" "$CARRY/vulkan"
}

# Libraries the carried ggml needs at run time: the Vulkan loader (carried) and cuBLAS/cudart (the machine's).
cublas=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/lib/x86_64-linux-gnu -name 'libcublas.so.13*' \
  2>/dev/null | head -1)
cuda_libs=${CUDA_LIBS:-${cublas:+$(dirname "$cublas")}}
export LD_LIBRARY_PATH=$CARRY/vulkan${cuda_libs:+:$cuda_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=$SITE:$ROOT/engine${PYTHONPATH:+:$PYTHONPATH}
export GGML_NO_BACKTRACE=1
export TOKENWING_TEST_VK_DEFAULT=1  # tests/compute: ggml's own Vulkan device choice (GPUs), not lavapipe
export GGML_VK_DISABLE_F16=1

ggml_loads() {
  "$PY" -c "import ggml, ctypes; print('ggml', 'CUDA' if ggml.GGML_USE_CUDA else '-', 'Vulkan' if ggml.GGML_USE_VULKAN else '-'); \
print([ggml.ggml_backend_dev_name(ggml.ggml_backend_dev_get(i)) for i in range(ggml.ggml_backend_dev_count())])"
}

unpack_ggml() {
  rm -rf "$SITE/ggml" && tar xJf "$CARRY/ggml-gpu.tar.xz" -C "$SITE" && ls -la "$SITE/ggml/lib" && ggml_loads
}

build_ggml_cuda() {  # the fallback: CUDA (no Vulkan: no glslc there) from the sdist, every core
  local b=$ROOT/build/ggml-cuda-here
  rm -rf "$b" && mkdir -p "$b" && tar xzf "$CARRY"/ggml_python-*.tar.gz -C "$b" || return 1
  cmake -S "$b"/ggml_python-* -B "$b/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSKBUILD_PROJECT_NAME=ggml_python \
    -DSKBUILD_PROJECT_VERSION=0.0.45 -DSKBUILD_STATE=wheel -DSKBUILD_PLATLIB_DIR="$b/install" -DGGML_NATIVE=ON \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 || return 1
  cmake --build "$b/cmake" -j "$(nproc)" || return 1
  cmake --install "$b/cmake" || return 1
  rm -rf "$SITE/ggml" && cp -r "$b"/ggml_python-*/ggml "$SITE/ggml" && rm -rf "$SITE/ggml/lib" \
    && cp -r "$b/install/ggml/lib" "$SITE/ggml/lib" && ls -la "$SITE/ggml/lib" && ggml_loads
}

python_deps() {  # gguf (carried wheel) into a folder on PYTHONPATH; the rest is on the machine
  "$PY" -m pip install --no-index --no-deps --target "$SITE" "$CARRY"/gguf-*.whl && "$PY" -c "import gguf, numpy, tokenizers"
}

native_core() {  # the engine's C++ core for this Python, put where `import tokenwing._core` finds it
  cmake -S engine/native -B build/core-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v "$PY")" && cmake --build build/core-gpu -j "$(nproc)" \
    && cp build/core-gpu/_core*.so engine/tokenwing/ && "$PY" -c "import tokenwing._core"
}

step machine machine
step unpack_ggml unpack_ggml || step build_ggml_cuda build_ggml_cuda
step python_deps python_deps
step native_core native_core
step info "$PY" -m tokenwing info --json
cp "$OUT/info.txt" "$OUT/info.json" 2>/dev/null
step device_tests timeout 420 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/device_tests.xml" tests/compute
step copy_bench timeout 120 "$PY" bench/device_copy_bench.py --json "$OUT/copy_bench.json"
step split_stress timeout 240 "$PY" bench/split_stress.py --runs 4  # lavapipe crashes in ~half: a real driver?
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
