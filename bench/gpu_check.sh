#!/usr/bin/env bash
# The GPU checks, in one run on the NVIDIA machine (an H200; 16 cores; Python 3.12 with numpy, jinja2, tokenizers,
# xxhash, scikit-build-core, nanobind, cmake, ninja, pytest, hypothesis, psutil; nvcc 13 and cuBLAS; no ggml, no gguf,
# no llama.cpp, no internet). Prepared here: bench/gpu_carry.sh fills build/gpu-carry/ (~15 MB: the Vulkan ggml, the
# ggml sdist, gguf, the Vulkan loader, and refs/: llama.cpp's logits of the device tests' models, with the models).
#
#   run: bash bench/gpu_check.sh     carry: ["build/gpu-carry"]     results: $OUT (summary.txt first)
#
# Everything within GPU_CHECK_SECONDS (470 s by default, for an 8-minute slot): a step that would start with less
# time left than it needs is skipped and says so in summary.txt; no step stops the others. Steps, each timed:
#   machine       nvidia-smi, the Vulkan drivers, what was carried
#   ggml_vulkan   the carried `ggml` package with Vulkan (portable AVX2 CPU) → build/gpu-site-vk
#   python_deps, native_core   gguf from its wheel; the engine's C++ core built for this Python
#   bench_model   (in the background from here on) the bench model generated and repacked: `tokenwing testmodel
#                 --preset bench --type Q4_0` (K-quants need llama.cpp's quantizer, absent there)
#   ggml_cuda     ggml with CUDA (sm_90, this CPU, no flash-attention kernels: the engine does not use them) built
#                 from the carried sdist on every core → build/gpu-site-cuda
#   then for CUDA, and for Vulkan (NVIDIA's driver): `tokenwing info --json`, the device tests (tests/compute: the
#   device compute layer against ggml's CPU backend, and the VRAM tier against llama.cpp's carried logits with every
#   family, swaps, faults, stats, autotune), and the decode benchmark: bench/vram_bench.py on the bench model with
#   VRAM budgets of 2, 8, 16 and 24 GB (Vulkan: 2 and 24; the 4.3 GB model fits whole from 8 GB: 2 GB shows a
#   partial expert cache) and a RAM cap of 25 % of the experts, against the same engine
#   on the CPU alone; at the end host↔device copy speeds and the split-graph crash check.
# GPU_CHECK_CUDA=0 skips the CUDA steps (a dry run on a machine without CUDA: GGML_VK_VISIBLE_DEVICES=0 then tests
# lavapipe); BENCH_PRESET, BENCH_BUDGETS_VK and GPU_CHECK_TEST_SECONDS (the device tests, 200 s) change the bench
# model, the Vulkan budgets and the tests' time for such a run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/build/gpu-out}
CARRY=${GPU_CARRY:-$ROOT/build/gpu-carry}
PY=${PYTHON:-python3}
LIMIT=${GPU_CHECK_SECONDS:-470}
BENCH_PRESET=${BENCH_PRESET:-bench}
BENCH_DIR=${BENCH_DIR:-$ROOT/build/gpu-bench}
mkdir -p "$OUT"
t0=$SECONDS
: >"$OUT/summary.txt"

left() { echo $((LIMIT - (SECONDS - t0))); }

step() {  # step NAME COMMAND...: output in $OUT/NAME.txt; time and exit code in summary.txt
  local name=$1 s=$SECONDS rc
  shift
  "$@" >"$OUT/$name.txt" 2>&1
  rc=$?
  echo "$name: rc=$rc, $((SECONDS - s)) s (at $((SECONDS - t0)) s)" | tee -a "$OUT/summary.txt"
  return $rc
}

timed() {  # timed NAME NEED MAX COMMAND...: the step under `timeout`, at most MAX s and never past the deadline
  local name=$1 need=$2 max=$3 budget
  shift 3
  budget=$(($(left) - 5))
  if [ "$budget" -lt "$need" ]; then
    echo "$name: skipped ($(left) s left, it needs about $need s)" | tee -a "$OUT/summary.txt"
    return 1
  fi
  [ "$budget" -gt "$max" ] && budget=$max
  step "$name" timeout -k 5 "$budget" bash -c '"$@"' bash "$@"  # (a child bash: the commands may be functions)
}

machine() {
  nvidia-smi || true
  "$PY" --version
  uname -a
  ldd --version | head -1
  nproc
  free -g
  df -h "$ROOT"
  ls -la /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>&1
  ls -la "$CARRY" "$CARRY/vulkan"
  du -sh "$CARRY/refs"
}

# Run-time libraries: the Vulkan loader (carried) and, for a carried CUDA build, this machine's cuBLAS.
cublas=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/lib/x86_64-linux-gnu -name 'libcublas.so.13*' \
  2>/dev/null | head -1)
cuda_libs=${CUDA_LIBS:-${cublas:+$(dirname "$cublas")}}
export LD_LIBRARY_PATH=$CARRY/vulkan${cuda_libs:+:$cuda_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export GGML_NO_BACKTRACE=1
export TOKENWING_TEST_VK_DEFAULT=1  # tests/compute: ggml's own Vulkan device choice (GPUs), not lavapipe
export GGML_VK_DISABLE_F16=1
export TOKENWING_TEST_REFS=$CARRY/refs  # llama.cpp's logits for the device tests (no llama.cpp here)
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
  # flash-attention kernels off: the engine's graphs never use them, and they are most of the build
  cmake -S "$b"/ggml_python-* -B "$b/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSKBUILD_PROJECT_NAME=ggml_python \
    -DSKBUILD_PROJECT_VERSION=0.0.45 -DSKBUILD_STATE=wheel -DSKBUILD_PLATLIB_DIR="$b/install" -DGGML_NATIVE=ON \
    -DGGML_CUDA=ON -DGGML_CUDA_FA=OFF -DCMAKE_CUDA_ARCHITECTURES=90 "${extra[@]}" || return 1
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

bench_model() {  # the bench model, written and repacked (the CPU ggml of the Vulkan site is enough for this)
  mkdir -p "$BENCH_DIR" && rm -f "$BENCH_DIR"/bench.* \
    && with_ggml "$ROOT/build/gpu-site-vk" "$PY" -m tokenwing testmodel "$BENCH_DIR/bench.gguf" --preset "$BENCH_PRESET" \
      --type Q4_0 -q \
    && with_ggml "$ROOT/build/gpu-site-vk" "$PY" -m tokenwing repack "$BENCH_DIR/bench.gguf" -o "$BENCH_DIR/bench.tw.gguf" -q \
    && rm -f "$BENCH_DIR/bench.gguf" && ls -la "$BENCH_DIR" && touch "$BENCH_DIR/ready"
}

wait_bench_model() {  # the background generation, done (it started before the CUDA build), while time is left
  while [ ! -f "$BENCH_DIR/ready" ] && kill -0 "$bench_pid" 2>/dev/null && [ "$(left)" -gt 70 ]; do sleep 1; done
  [ -f "$BENCH_DIR/ready" ]
}

checks() {  # checks NAME SITE CONFIGS: the device tests and the decode benchmark with that ggml
  local name=$1 site=$2 configs=$3
  timed "info_$name" 10 30 with_ggml "$site" "$PY" -m tokenwing info --json
  timed "device_tests_$name" 60 "${GPU_CHECK_TEST_SECONDS:-200}" with_ggml "$site" "$PY" -m pytest -q -p no:cacheprovider -ra \
    --junitxml="$OUT/device_tests_$name.xml" tests/compute
  if wait_bench_model; then
    timed "vram_bench_$name" 60 170 with_ggml "$site" "$PY" bench/vram_bench.py "$BENCH_DIR/bench.tw.gguf" \
      --configs "$configs" --ram-budget 25% --prompt 32 --decode 64 --timeout 75 --json "$OUT/vram_bench_$name.json"
  else
    echo "vram_bench_$name: skipped (no bench model: see bench_model.txt)" | tee -a "$OUT/summary.txt"
  fi
}

late_checks() {  # checks NAME SITE: what the foundation measured (copy speeds, the split-graph crash)
  local name=$1 site=$2
  timed "copy_bench_$name" 15 40 with_ggml "$site" "$PY" bench/device_copy_bench.py --json "$OUT/copy_bench_$name.json"
  timed "split_stress_$name" 20 60 with_ggml "$site" "$PY" bench/split_stress.py --runs 4
}

export ROOT OUT CARRY PY DEPS BENCH_PRESET BENCH_DIR
export -f with_ggml ggml_loads build_cuda
step machine machine
step ggml_vulkan unpack "$CARRY/ggml-vulkan.tar.xz" "$ROOT/build/gpu-site-vk"
step python_deps python_deps
step native_core native_core
step bench_model_started true
(step bench_model bench_model) &
bench_pid=$!
cuda=${GPU_CHECK_CUDA:-1}
if [ "$cuda" != 0 ]; then
  if [ -f "$CARRY/ggml-cuda.tar.xz" ]; then
    step ggml_cuda unpack "$CARRY/ggml-cuda.tar.xz" "$ROOT/build/gpu-site-cuda" || cuda=0
  else
    timed ggml_cuda 120 330 build_cuda || cuda=0
  fi
fi
[ "$cuda" = 0 ] || checks cuda "$ROOT/build/gpu-site-cuda" "cpu,cuda:2G,cuda:8G,cuda:16G,cuda:24G"
checks vulkan "$ROOT/build/gpu-site-vk" "${BENCH_BUDGETS_VK:-vulkan:2G,vulkan:24G}"
[ "$cuda" = 0 ] || late_checks cuda "$ROOT/build/gpu-site-cuda"
late_checks vulkan "$ROOT/build/gpu-site-vk"
kill "$bench_pid" 2>/dev/null
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
