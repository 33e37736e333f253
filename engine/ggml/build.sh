#!/usr/bin/env bash
# Builds ggml from its pinned source (engine/ggml/source.txt) with engine/ggml/CMakeLists.txt and installs it:
#
#   engine/ggml/build.sh PREFIX [--vulkan-include DIR] [--cuda] [--cpu-level best]
#   engine/ggml/build.sh --source      fetch the pinned source distribution only; print its path
#   engine/ggml/build.sh --cpu-level   print the CPU level ggml's loader would take here from an all-levels build
#
#   PREFIX/lib/libggml-base.so.0, libggml.so.0      the core (graphs, types, the backend registry)
#   PREFIX/backends/cpu/libggml-cpu-*.so           the CPU backend for each x86-64 level (x64 … sapphirerapids);
#                                                  with --cpu-level best only the level ggml's loader would take
#                                                  here (./dev demo: one level instead of 14, a quarter of the time)
#   PREFIX/backends/vulkan/libggml-vulkan.so       with --vulkan-include (glslc and the loader needed too)
#   PREFIX/backends/cuda/libggml-cuda.so           with --cuda (nvcc)
#   PREFIX/include/*.h                             the headers (the bindings' ABI test compiles against them)
#   PREFIX/build.json                              what was built: ggml's version, the pin, backends, options
#
# The source comes by package name through pip (the machine's configured index), hash-checked; nothing else is
# downloaded. Cached: a build whose key (pin, recipe, options, compilers) matches PREFIX/build.key is kept, and
# build/ggml/KEY/ keeps the finished tree (the latest key's only), so a new venv copies it instead of compiling.
# PREFIX is replaced whole (built aside, then renamed). Needs cmake and ninja (the project's .venv has them).
# TW_GGML_SOURCE_DIR: an extracted source (its ggml/ and LICENSE, as build/ggml/src/VERSION holds them) instead of
# pip, for a machine with no index (bench/gpu_carry.sh carries one); TW_GGML_CMAKE_ARGS: more CMake arguments.
#
# --cpu-level best: the level is chosen by ggml's own score (its cpu-feats.cpp from the pinned source, compiled once
# per level with that level's feature macros and run here): the module the all-levels build's loader would load on
# this CPU, never -march=native (a VM can report AMX in CPUID and not grant it: native code dies with SIGILL).
# The module is built from the same CMake (engine/ggml/one-level.cmake narrows the level list to that one), so its
# compile flags are the all-levels build's for that level. An up-to-date all-levels build in PREFIX is kept.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PREFIX=${1:?usage: engine/ggml/build.sh PREFIX [--vulkan-include DIR] [--cuda] [--cpu-level best] | --source | --cpu-level}
shift
VK_INC="" CUDA=OFF CPU_LEVEL=all
while [ $# -gt 0 ]; do
  case "$1" in
    --vulkan-include) VK_INC=$2; shift 2 ;;
    --cuda) CUDA=ON; shift ;;
    --cpu-level) CPU_LEVEL=$2; shift 2 ;;
    *) echo "ggml: unknown option $1" >&2; exit 2 ;;
  esac
done
log() { echo "ggml: $*" >&2; }
# Bump when a change here changes what is built or installed (the key below: comments and messages do not count)
RECIPE=1

PIN=$(grep -v '^#' "$HERE/source.txt" | grep -m1 .)
PKG=${PIN%%==*}
VERSION=${PIN#*==}; VERSION=${VERSION%% *}
WORK=$ROOT/build/ggml
mkdir -p "$WORK"

sdist() {  # the pinned package's source distribution, through pip, hash-checked: sets $tarball
  SDIST=$WORK/sdist/$VERSION
  tarball=$(ls "$SDIST"/*.tar.gz 2>/dev/null | head -1 || true)
  if [ -z "$tarball" ]; then
    log "fetching $PKG $VERSION's source distribution (pip, hash-checked)"
    rm -rf "$SDIST.partial" && mkdir -p "$SDIST.partial"
    # (--no-build-isolation: pip would otherwise install the package's build tools only to read its metadata)
    python -m pip download -q --no-deps --no-binary "$PKG" --no-build-isolation --require-hashes \
      -r "$HERE/source.txt" -d "$SDIST.partial" >&2
    rm -rf "$SDIST" && mv "$SDIST.partial" "$SDIST"
    tarball=$(ls "$SDIST"/*.tar.gz)
  fi
}
if [ "$PREFIX" = --source ]; then
  sdist
  echo "$tarball"
  exit 0
fi

SRC=${TW_GGML_SOURCE_DIR:-$WORK/src/$VERSION}
source_tree() {  # ggml's source extracted from the pinned source distribution into $SRC
  [ ! -f "$SRC/ggml/CMakeLists.txt" ] || return 0
  sdist
  rm -rf "$SRC.partial" && mkdir -p "$SRC.partial"
  top=$(basename "$tarball" .tar.gz)
  tar xzf "$tarball" -C "$SRC.partial" --strip-components=3 "$top/vendor/llama.cpp/ggml" "$top/vendor/llama.cpp/LICENSE"
  rm -rf "$SRC" && mv "$SRC.partial" "$SRC"
}

x86_levels() {  # "name FEATURE …" a line, for each x86-64 level of ggml's all-levels build, in its order
  awk '/^if *\(GGML_CPU_ALL_VARIANTS\)/ {a = 1} a && /GGML_SYSTEM_ARCH STREQUAL "x86"/ {x = 1; next}
       x && /GGML_SYSTEM_ARCH/ {exit}
       x && match($0, /ggml_add_cpu_backend_variant\([^)]*\)/) {
         v = substr($0, RSTART + 29, RLENGTH - 30); gsub(/ +/, " ", v); print v }' "$SRC/ggml/src/CMakeLists.txt"
}

best_cpu_level() {  # the level ggml's loader takes here: the highest score of ggml's own scorer (cpu-feats.cpp)
  # compiled with each level's feature macros (GGML_AVX2 …), as the level's module carries it; cached per CPU
  local cache probe main name feats defs score best="" best_score=0
  cache=$WORK/cpu-level/$( (echo "$VERSION"; grep -m1 '^flags' /proc/cpuinfo; grep -m1 '^model name' /proc/cpuinfo;
    x86_levels; c++ --version | head -1; sed -n '/^best_cpu_level()/,/^}/p' "$0") | sha256sum | cut -c1-16)
  if [ -s "$cache" ]; then cat "$cache"; return 0; fi
  probe=$(mktemp -d)
  main=$probe/main.cpp
  printf '#include <cstdio>\nextern "C" int ggml_backend_score(void);\nint main() { std::printf("%%d\\n", ggml_backend_score()); }\n' >"$main"
  while read -r name feats; do
    defs=()
    for f in $feats; do defs+=("-DGGML_$f"); done
    c++ -std=c++17 -O1 -DGGML_BACKEND_DL -DGGML_BACKEND_BUILD -DGGML_BACKEND_SHARED "${defs[@]}" \
      -I"$SRC/ggml/include" -I"$SRC/ggml/src" "$SRC/ggml/src/ggml-cpu/arch/x86/cpu-feats.cpp" "$main" \
      -o "$probe/$name" >&2 || { rm -rf "$probe"; log "could not compile ggml's CPU scorer"; return 1; }
    score=$("$probe/$name")
    if [ "$score" -gt "$best_score" ]; then best=$name best_score=$score; fi
  done < <(x86_levels)
  rm -rf "$probe"
  [ -n "$best" ] || { log "this CPU runs none of ggml's x86-64 levels"; return 1; }
  mkdir -p "$(dirname "$cache")" && echo "$best" >"$cache"
  echo "$best"
}

if [ "$PREFIX" = --cpu-level ]; then
  source_tree
  best_cpu_level
  exit 0
fi

VULKAN=OFF
[ -n "$VK_INC" ] && VULKAN=ON
build_key() {  # the build's key for CPU level $1 (all: every level)
  {
  cat "$HERE/source.txt" "$HERE/CMakeLists.txt"
  # (the all-levels key is what it was before one-level builds existed: no rebuild of existing trees)
  [ "$1" = all ] || { cat "$HERE/one-level.cmake"; echo "cpu-level=$1"; }
  echo "recipe=$RECIPE"
  echo "vulkan=$VULKAN cuda=$CUDA ${TW_GGML_CMAKE_ARGS:-}"
  cc --version | head -1; c++ --version | head -1; cmake --version | head -1
  [ "$VULKAN" = OFF ] || { grep -m1 'VK_HEADER_VERSION ' "$VK_INC/vulkan/vulkan_core.h"; glslc --version | head -1; }
  [ "$CUDA" = OFF ] || nvcc --version | tail -1
  } | sha256sum | cut -c1-16
}
key=$(build_key all)
have=$(cat "$PREFIX/build.key" 2>/dev/null || true)
if [ "$have" = "$key" ]; then
  log "up to date ($PREFIX, key $key)"
  exit 0
fi
if [ "$CPU_LEVEL" != all ]; then
  source_tree
  [ "$CPU_LEVEL" != best ] || CPU_LEVEL=$(best_cpu_level)
  x86_levels | grep -q "^$CPU_LEVEL\( \|$\)" || { log "no CPU level $CPU_LEVEL (levels: $(x86_levels | cut -d' ' -f1 | paste -sd' '))"; exit 2; }
  key=$(build_key "$CPU_LEVEL")
  if [ "$have" = "$key" ]; then
    log "up to date ($PREFIX, CPU level $CPU_LEVEL, key $key)"
    exit 0
  fi
fi
# finished trees: build/ggml/KEY for every level, build/ggml/level/KEY for one (the latest of each kept)
if [ "$CPU_LEVEL" = all ]; then DONE=$WORK/$key; else DONE=$WORK/level/$key; fi
if [ ! -f "$DONE/build.key" ]; then
  source_tree
  ggml_version=$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$SRC/ggml/CMakeLists.txt" | paste -sd.)

  # ---- configure, build, install aside
  B=$WORK/cmake-$key
  STAGE=$DONE.partial
  rm -rf "$STAGE"
  args=(-DTW_GGML_SOURCE="$SRC/ggml" -DTW_GGML_VULKAN=$VULKAN -DTW_GGML_CUDA=$CUDA)
  [ "$VULKAN" = OFF ] || args+=(-DVulkan_INCLUDE_DIR="$VK_INC")
  [ "$CUDA" = OFF ] || args+=(-DCMAKE_CUDA_ARCHITECTURES="${TOKENWING_CUDA_ARCHITECTURES:-native}")
  what="every x86-64 CPU level"
  if [ "$CPU_LEVEL" != all ]; then
    feats=$(x86_levels | awk -v l="$CPU_LEVEL" '$1 == l {$1 = ""; sub(/^ /, ""); gsub(/ /, ";"); print}')
    args+=(-DCMAKE_PROJECT_ggml_INCLUDE="$HERE/one-level.cmake" -DTW_GGML_CPU_FEATURES="$feats")
    what="CPU level $CPU_LEVEL only"
  fi
  read -r -a more <<<"${TW_GGML_CMAKE_ARGS:-}"
  args+=("${more[@]}")
  log "building ggml $ggml_version ($what; Vulkan $VULKAN, CUDA $CUDA) in $B"
  started=$SECONDS
  env -u CFLAGS -u CXXFLAGS -u CPPFLAGS -u CMAKE_ARGS cmake -S "$HERE" -B "$B" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DCMAKE_INSTALL_PREFIX="$STAGE/install" \
    "${args[@]}" >"$B.log" 2>&1 || { tail -30 "$B.log" >&2; exit 1; }
  nice cmake --build "$B" -j "${JOBS:-$(nproc)}" >>"$B.log" 2>&1 || { tail -40 "$B.log" >&2; exit 1; }
  cmake --install "$B" >>"$B.log" 2>&1 || { tail -30 "$B.log" >&2; exit 1; }
  if grep -q -- '-march=native' "$B/compile_commands.json"; then
    log "built with -march=native: refusing (the build must run on any x86-64)"; exit 1
  fi
  # ---- the layout the bindings load from: one folder per backend kind, real files named by soname
  I=$STAGE/install
  mkdir -p "$STAGE/lib" "$STAGE/backends/cpu"
  for lib in libggml-base libggml; do cp -L "$I/lib/$lib.so" "$STAGE/lib/$lib.so.0"; done
  for f in "$I"/bin/libggml-*.so; do
    name=$(basename "$f" .so); kind=${name#libggml-}; kind=${kind%%-*}
    # the one level's module is ggml's plain CPU backend (libggml-cpu.so): named as in the all-levels build
    dest=$(basename "$f"); [ "$dest" != libggml-cpu.so ] || dest=libggml-cpu-$CPU_LEVEL.so
    mkdir -p "$STAGE/backends/$kind" && cp -L "$f" "$STAGE/backends/$kind/$dest"
  done
  cp -r "$I/include" "$STAGE/include"
  cp "$SRC/LICENSE" "$STAGE/LICENSE"
  rm -rf "$I"
  backends=$(cd "$STAGE/backends" && ls | paste -sd, | sed 's/,/", "/g')
  printf '{"ggml": "%s", "source": "%s", "backends": ["%s"], "llamafile": false}\n' \
    "$ggml_version" "$PKG==$VERSION vendor/llama.cpp/ggml" "$backends" >"$STAGE/build.json"
  echo "$key" >"$STAGE/build.key"
  rm -rf "$DONE" && mv "$STAGE" "$DONE"
  rm -rf "$B"
  # earlier builds of this checkout (other keys of the same kind) are not kept: ~50 MB each
  find "$(dirname "$DONE")" -mindepth 1 -maxdepth 1 -type d -regex '.*/[0-9a-f]\{16\}' ! -name "$key" -exec rm -rf {} +
  log "built in $((SECONDS - started)) s"
fi
rm -rf "$PREFIX.partial"
cp -a "$DONE" "$PREFIX.partial"
rm -rf "$PREFIX" && mv "$PREFIX.partial" "$PREFIX"
log "installed into $PREFIX"
