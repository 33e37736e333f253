#!/usr/bin/env bash
# The GPU checks, in one run on the NVIDIA machine (an H200; 16 cores; Python 3.12 with numpy, jinja2, tokenizers,
# xxhash, scikit-build-core, nanobind, cmake, ninja, pytest, hypothesis, psutil; nvcc 13 and cuBLAS; no ggml, no gguf,
# no llama.cpp, no internet). Prepared here: bench/gpu_carry.sh fills build/gpu-carry/ (the engine's ggml build with
# Vulkan, ggml's pinned source, gguf, the Vulkan loader, and refs/: llama.cpp's logits of the device tests' models).
#
#   run: bash bench/gpu_check.sh     carry: ["build/gpu-carry"]     results: $OUT (summary.txt first)
#
# Everything within GPU_CHECK_SECONDS (540 s by default: a session has 15 minutes of device time, one command at most
# 10, and the machine's start takes minutes of it): a step that would start with less time left than it needs is
# skipped and says so in summary.txt; no step stops the others. Steps, each timed, most wanted first:
#   machine       nvidia-smi, the Vulkan drivers, what was carried
#   ggml_vulkan   the carried ggml build (every CPU level, Vulkan) → build/gpu-site-vk
#   python_deps, native_core   gguf from its wheel; the engine's C++ core built for this Python
#   bench_model   (in the background from here on) the bench model generated in 8 shards and repacked shard by shard
#                 (`--delete-source`: at the peak the disk holds the repacked file and the shards less one):
#                 `tokenwing testmodel --preset bench --type Q4_0 --n-layer 84` (K-quants need llama.cpp's quantizer,
#                 absent there), ~29.6 GB — 84 of the preset's 0.35 GB layers, so that 8 and 16 GB of VRAM hold only
#                 part of its 28.5 GB of experts (the 12-layer 4.3 GB preset fits whole from 8 GB: every budget
#                 measured the same); ~150 s to write at ~200 MB/s, then the repack; fewer layers where the disk
#                 (64 GB) has no room for it (bench_model.txt says how many)
#   ggml_cuda     (in the background too, while the Vulkan device tests run: neither is timed for speed) ggml with
#                 CUDA (sm_90, no flash-attention kernels: the engine's device graphs do not use them) built from the
#                 carried source by engine/ggml/build.sh on every core → build/gpu-site-cuda
#   info_vulkan, device_tests_vulkan   on NVIDIA's Vulkan driver: `tokenwing info --json`, the device tests
#                 (tests/compute: the device compute layer against ggml's CPU backend, and the VRAM tier against
#                 llama.cpp's carried logits with every family, swaps, faults, stats, autotune)
#   info_cuda, device_tests_cuda   the same on CUDA, once it is built
#   vram_bench_cuda, vram_bench_vulkan   the decode benchmark, with nothing else running: bench/vram_bench.py on the
#                 bench model with VRAM budgets of 8, 16 and 24 GB (~26 %, ~57 % and ~87 % of the experts; the
#                 rest in RAM under a cap of 25 % of the experts, or read from the drive) against the same engine
#                 on the CPU alone (`cpu`: with that ggml's CPU backend); CUDA first, Vulkan where time allows
#                 (its configurations are written one by one: a run stopped at the deadline keeps those it did)
#   copy_bench_*, split_stress_*   where time is left: host↔device copy speeds and the split-graph crash check.
# Expected (not measured: no GPU machine has been lent yet): setup ~30 s, the model ready at ~200–300 s, the CUDA
# build 2–4 min, each bench ~100–200 s — so one run at 540 s likely ends inside vram_bench_vulkan; GPU_CHECK_CUDA=0
# gives a Vulkan-only run (the tests while the model is written, then the whole Vulkan bench: ~450 s).
# GPU_CHECK_CUDA=0 skips the CUDA steps (also a dry run on a machine without CUDA: GGML_VK_VISIBLE_DEVICES=0 then
# tests lavapipe); BENCH_PRESET (its own shape, BENCH_LAYERS applies to `bench` only), BENCH_SHAPE (more testmodel
# shape flags), BENCH_LAYERS (84), BENCH_BUDGETS_CUDA, BENCH_BUDGETS_VK and GPU_CHECK_TEST_SECONDS (the device
# tests, 200 s each) change the bench model, the budgets and the tests' time, e.g. for a dry run:
#   GPU_CHECK_CUDA=0 GGML_VK_VISIBLE_DEVICES=0 BENCH_PRESET=tiny GPU_CHECK_SECONDS=300 bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/build/gpu-out}
CARRY=${GPU_CARRY:-$ROOT/build/gpu-carry}
PY=${PYTHON:-python3}
LIMIT=${GPU_CHECK_SECONDS:-540}
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

with_ggml() {  # with_ggml SITE COMMAND...: runs COMMAND with that ggml build (and gguf, the engine)
  local site=$1
  shift
  TOKENWING_GGML_DIR=$site PYTHONPATH=$DEPS:$ROOT/engine:$ROOT "$@"
}

ggml_loads() {
  with_ggml "$1" "$PY" -c "from tokenwing.compute import ggml_api as g; print(g.build_info(), g.CPU_VARIANT, \
g.load_gpu_backends(), [g.ggml_backend_dev_name(g.ggml_backend_dev_get(i)) for i in range(g.ggml_backend_dev_count())], \
g.LOAD_LOG)"
}

unpack() {  # unpack TARBALL SITE
  rm -rf "$2" && mkdir -p "$2" && tar xJf "$1" -C "$2" && ls -laR "$2/backends" && ggml_loads "$2"
}

build_cuda() {  # ggml with CUDA from the carried source (engine/ggml/build.sh), every core; no Vulkan (no glslc here)
  local src=$ROOT/build/ggml-src-here site=$ROOT/build/gpu-site-cuda
  local extra=() nv
  rm -rf "$src" && mkdir -p "$src" && tar xJf "$CARRY/ggml-src.tar.xz" -C "$src" || return 1
  if ! ls /usr/local/cuda/include/cublas_v2.h /usr/local/cuda/targets/*/include/cublas_v2.h >/dev/null 2>&1; then
    # cuBLAS from pip's nvidia-cublas wheel instead of the toolkit (the toolkit's own dirs are searched otherwise)
    nv=$("$PY" -c "import site, glob; h = [g for p in site.getsitepackages() for g in glob.glob(p + '/nvidia/cu13')]
print(h[0] if h else '')" 2>/dev/null)
    [ -n "$nv" ] && export LD_LIBRARY_PATH=$nv/lib:$LD_LIBRARY_PATH && extra=(-DCUDA_cublas_LIBRARY="$nv/lib/libcublas.so.13"
      -DCUDA_cublasLt_LIBRARY="$nv/lib/libcublasLt.so.13" -DCMAKE_CUDA_FLAGS="-I$nv/include" -DCMAKE_CXX_FLAGS="-I$nv/include")
  fi
  # flash-attention kernels off: the engine's device graphs never use them, and they are most of the build
  time TW_GGML_SOURCE_DIR=$src TOKENWING_CUDA_ARCHITECTURES=90 TW_GGML_CMAKE_ARGS="-DGGML_CUDA_FA=OFF ${extra[*]}" \
    bash engine/ggml/build.sh "$site" --cuda || return 1
  ggml_loads "$site"
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

bench_layers() {  # the bench preset's layers: BENCH_LAYERS, or as many as the disk holds at the repack's peak
  local want=${BENCH_LAYERS:-84} avail fit
  avail=$(df -Pk "$BENCH_DIR" | awk 'NR == 2 { print int($4 / 1048576) }')  # GiB free
  # a layer is 0.327 GiB (128 experts of 3 × 2048 × 768 in Q4_0, its attention and router); at the peak the disk
  # holds every shard and the repacked file but one shard: 9/8 of the model; 8 GiB kept for the CUDA build and logs
  fit=$(((avail - 8) * 1000 / 368))
  if [ "$fit" -lt "$want" ]; then
    echo "bench model: $fit layers, not $want: $avail GiB free on $BENCH_DIR" >&2
    want=$fit
  fi
  echo "$want"
}

bench_model() {  # the bench model in shards, repacked shard by shard (the CPU ggml of the Vulkan site is enough)
  local shards=8 shape=() extra=()
  [ "$BENCH_PRESET" = bench ] && shape=(--n-layer "$(bench_layers)")
  read -r -a extra <<<"${BENCH_SHAPE:-}"
  mkdir -p "$BENCH_DIR" && rm -f "$BENCH_DIR"/bench* \
    && with_ggml "$ROOT/build/gpu-site-vk" "$PY" -m tokenwing testmodel "$BENCH_DIR/bench.gguf" --preset "$BENCH_PRESET" \
      --type Q4_0 --shards "$shards" "${shape[@]}" "${extra[@]}" -q \
    && with_ggml "$ROOT/build/gpu-site-vk" "$PY" -m tokenwing repack "$BENCH_DIR/$(printf 'bench-00001-of-%05d' "$shards").gguf" \
      -o "$BENCH_DIR/bench.tw.gguf" --delete-source -q \
    && ls -la "$BENCH_DIR" && touch "$BENCH_DIR/ready"
}

wait_bench_model() {  # the background generation, done (it started before the CUDA build), while time is left
  while [ ! -f "$BENCH_DIR/ready" ] && kill -0 "$bench_pid" 2>/dev/null && [ "$(left)" -gt 70 ]; do sleep 1; done
  [ -f "$BENCH_DIR/ready" ]
}

device_checks() {  # device_checks NAME SITE: `tokenwing info` and the device tests with that ggml
  local name=$1 site=$2
  timed "info_$name" 10 30 with_ggml "$site" "$PY" -m tokenwing info --json
  timed "device_tests_$name" 60 "${GPU_CHECK_TEST_SECONDS:-200}" with_ggml "$site" "$PY" -m pytest -q -p no:cacheprovider -ra \
    --junitxml="$OUT/device_tests_$name.xml" tests/compute
}

bench() {  # bench NAME SITE CONFIGS: the decode benchmark with that ggml. Each configuration at most 100 s: a 24 GB
  # budget first copies ~22 GB of experts from the drive to the device, and on the CPU under the cap a token reads
  # ~0.9 GB from the drive (hence 16 prompt and 32 decode tokens, not the 4.3 GB model's 32 and 64)
  local name=$1 site=$2 configs=$3
  if wait_bench_model; then
    timed "vram_bench_$name" 60 300 with_ggml "$site" "$PY" bench/vram_bench.py "$BENCH_DIR/bench.tw.gguf" \
      --configs "$configs" --ram-budget 25% --prompt 16 --decode 32 --timeout 100 --json "$OUT/vram_bench_$name.json"
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
cuda_pid=
if [ "$cuda" != 0 ]; then
  if [ -f "$CARRY/ggml-cuda.tar.xz" ]; then
    step ggml_cuda unpack "$CARRY/ggml-cuda.tar.xz" "$ROOT/build/gpu-site-cuda" || cuda=0
  else
    timed ggml_cuda 120 330 build_cuda &  # the build meanwhile: the Vulkan tests below are not timed for speed
    cuda_pid=$!
  fi
fi
device_checks vulkan "$ROOT/build/gpu-site-vk"
if [ -n "$cuda_pid" ]; then
  wait "$cuda_pid" || cuda=0
fi
[ "$cuda" = 0 ] || device_checks cuda "$ROOT/build/gpu-site-cuda"
# the benchmarks with nothing else running (but the bench model's writing, which they wait for)
[ "$cuda" = 0 ] || bench cuda "$ROOT/build/gpu-site-cuda" "${BENCH_BUDGETS_CUDA:-cpu,cuda:8G,cuda:16G,cuda:24G}"
bench vulkan "$ROOT/build/gpu-site-vk" "${BENCH_BUDGETS_VK:-vulkan:8G,vulkan:16G,vulkan:24G,cpu}"
[ "$cuda" = 0 ] || late_checks cuda "$ROOT/build/gpu-site-cuda"
late_checks vulkan "$ROOT/build/gpu-site-vk"
kill "$bench_pid" 2>/dev/null
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
