#!/usr/bin/env bash
# Builds ggml from its pinned source (engine/ggml/source.txt) with engine/ggml/CMakeLists.txt and installs it:
#
#   engine/ggml/build.sh PREFIX [--vulkan-include DIR] [--cuda]
#   engine/ggml/build.sh --source      fetch the pinned source distribution only; print its path
#
#   PREFIX/lib/libggml-base.so.0, libggml.so.0      the core (graphs, types, the backend registry)
#   PREFIX/backends/cpu/libggml-cpu-*.so           the CPU backend for each x86-64 level (x64 … sapphirerapids)
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
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PREFIX=${1:?usage: engine/ggml/build.sh PREFIX [--vulkan-include DIR] [--cuda] | --source}
shift
VK_INC="" CUDA=OFF
while [ $# -gt 0 ]; do
  case "$1" in
    --vulkan-include) VK_INC=$2; shift 2 ;;
    --cuda) CUDA=ON; shift ;;
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

VULKAN=OFF
[ -n "$VK_INC" ] && VULKAN=ON
key=$( {
  cat "$HERE/source.txt" "$HERE/CMakeLists.txt"
  echo "recipe=$RECIPE"
  echo "vulkan=$VULKAN cuda=$CUDA ${TW_GGML_CMAKE_ARGS:-}"
  cc --version | head -1; c++ --version | head -1; cmake --version | head -1
  [ "$VULKAN" = OFF ] || { grep -m1 'VK_HEADER_VERSION ' "$VK_INC/vulkan/vulkan_core.h"; glslc --version | head -1; }
  [ "$CUDA" = OFF ] || nvcc --version | tail -1
} | sha256sum | cut -c1-16)

if [ "$(cat "$PREFIX/build.key" 2>/dev/null || true)" = "$key" ]; then
  log "up to date ($PREFIX, key $key)"
  exit 0
fi
DONE=$WORK/$key
if [ ! -f "$DONE/build.key" ]; then
  SRC=${TW_GGML_SOURCE_DIR:-$WORK/src/$VERSION}
  if [ ! -f "$SRC/ggml/CMakeLists.txt" ]; then
    sdist
    rm -rf "$SRC.partial" && mkdir -p "$SRC.partial"
    top=$(basename "$tarball" .tar.gz)
    tar xzf "$tarball" -C "$SRC.partial" --strip-components=3 "$top/vendor/llama.cpp/ggml" "$top/vendor/llama.cpp/LICENSE"
    rm -rf "$SRC" && mv "$SRC.partial" "$SRC"
  fi
  ggml_version=$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$SRC/ggml/CMakeLists.txt" | paste -sd.)

  # ---- configure, build, install aside
  B=$WORK/cmake-$key
  STAGE=$DONE.partial
  rm -rf "$STAGE"
  args=(-DTW_GGML_SOURCE="$SRC/ggml" -DTW_GGML_VULKAN=$VULKAN -DTW_GGML_CUDA=$CUDA)
  [ "$VULKAN" = OFF ] || args+=(-DVulkan_INCLUDE_DIR="$VK_INC")
  [ "$CUDA" = OFF ] || args+=(-DCMAKE_CUDA_ARCHITECTURES="${TOKENWING_CUDA_ARCHITECTURES:-native}")
  read -r -a more <<<"${TW_GGML_CMAKE_ARGS:-}"
  args+=("${more[@]}")
  log "building ggml $ggml_version (every x86-64 CPU level; Vulkan $VULKAN, CUDA $CUDA) in $B"
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
    mkdir -p "$STAGE/backends/$kind" && cp -L "$f" "$STAGE/backends/$kind/"
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
  # earlier builds of this checkout (other keys) are not kept: ~50 MB each
  find "$WORK" -mindepth 1 -maxdepth 1 -type d -regex '.*/[0-9a-f]\{16\}' ! -name "$key" -exec rm -rf {} +
  log "built in $((SECONDS - started)) s"
fi
rm -rf "$PREFIX.partial"
cp -a "$DONE" "$PREFIX.partial"
rm -rf "$PREFIX" && mv "$PREFIX.partial" "$PREFIX"
log "installed into $PREFIX"
