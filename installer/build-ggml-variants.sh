#!/usr/bin/env bash
# Builds ggml (the sources ggml-python 0.0.45 ships, ggml 0.15.3) for portable x86-64 CPU levels, without
# -march=native: build/ggml-variants/VARIANT/lib/{libggml,libggml-base,libggml-cpu}.so
#
#   avx2    AVX, AVX2, FMA, F16C, BMI2, SSE4.2 (Haswell / Zen 1 and later): the portable floor
#   avx512  the above + AVX-512 F/CD/VL/DQ/BW (Skylake-X, Ice Lake, Zen 4 and later)
#   avx2-vulkan, avx512-vulkan   the same CPU code plus ggml's Vulkan backend (+ libggml-vulkan.so, 33 MB): the
#           engine's runtime hook takes one where the user's system has the Vulkan loader (libvulkan.so.1)
#
# Cached: a variant is rebuilt only when its key (sources, flags, compiler) changes. Usage:
#   installer/build-ggml-variants.sh [VARIANT...]      (default: all; the Vulkan ones only where they can be built)
# Needs the project's .venv (cmake, ninja, pip) and a C/C++ compiler; the Vulkan variants need glslc, the loader
# and headers 1.3.261+ (./dev setup installs them as root: build/vulkan/headers). ~3 min a CPU variant on 2 cores,
# ~5 min a Vulkan one.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate

GGML_PY_VERSION=0.0.45
ROOT=build/ggml-variants
SDIST=$ROOT/sdist/ggml_python-$GGML_PY_VERSION.tar.gz
SRC=$ROOT/sdist/ggml_python-$GGML_PY_VERSION
COMMON=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX_VNNI=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)

VK_INC=$PWD/build/vulkan/headers/usr/include
grep -qs VK_EXT_layer_settings /usr/include/vulkan/vulkan_core.h && VK_INC=/usr/include
VULKAN="-DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR=$VK_INC"

flags_for() {
  case "$1" in
    avx2) echo "${COMMON[*]} -DGGML_AVX512=OFF" ;;
    avx512) echo "${COMMON[*]} -DGGML_AVX512=ON" ;;
    avx2-vulkan) echo "${COMMON[*]} -DGGML_AVX512=OFF $VULKAN" ;;
    avx512-vulkan) echo "${COMMON[*]} -DGGML_AVX512=ON $VULKAN" ;;
    *) echo "unknown variant $1 (avx2, avx512, avx2-vulkan, avx512-vulkan)" >&2; exit 2 ;;
  esac
}

vulkan_buildable() {
  command -v glslc >/dev/null && [ -e /usr/lib/x86_64-linux-gnu/libvulkan.so ] && [ -f "$VK_INC/vulkan/vulkan.hpp" ]
}

default_variants() {
  if vulkan_buildable; then echo "avx2 avx512 avx2-vulkan avx512-vulkan"; else
    echo "ggml: no Vulkan variants (glslc, libvulkan-dev or headers 1.3.261+ missing: run ./dev setup as root)" >&2
    echo "avx2 avx512"
  fi
}

if [ ! -d "$SRC" ]; then
  mkdir -p "$ROOT/sdist"
  # --no-binary for ggml-python only: its build tools (cmake, scikit-build-core) come as wheels.
  [ -f "$SDIST" ] || python -m pip download -q "ggml-python==$GGML_PY_VERSION" --no-deps --no-binary ggml-python \
    --no-build-isolation -d "$ROOT/sdist"
  tar xzf "$SDIST" -C "$ROOT/sdist"
fi

for variant in "${@:-$(default_variants)}"; do
  for v in $variant; do
    flags=$(flags_for "$v")
    key=$( (echo "$flags"; sha256sum "$SDIST"; cc --version | head -1; c++ --version | head -1) | sha256sum | cut -c1-16)
    out=$ROOT/$v
    if [ "$(cat "$out/key" 2>/dev/null || true)" = "$key" ] && [ -f "$out/lib/libggml-cpu.so" ]; then
      echo "ggml $v: cached ($out/lib)" >&2
      continue
    fi
    echo "ggml $v: building ($flags)" >&2
    rm -rf "$out"
    started=$SECONDS
    # The same configuration ggml-python's own build uses (its CMakeLists.txt, as scikit-build-core runs it),
    # with the instruction sets fixed instead of -march=native.
    # shellcheck disable=SC2086
    nice cmake -S "$SRC" -B "$out/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
      -DSKBUILD_PROJECT_NAME=ggml_python -DSKBUILD_PROJECT_VERSION=$GGML_PY_VERSION -DSKBUILD_STATE=wheel \
      -DSKBUILD_PLATLIB_DIR="$PWD/$out/install" $flags >"$out.log" 2>&1 || { tail -30 "$out.log" >&2; exit 1; }
    nice cmake --build "$out/cmake" -j "${JOBS:-$(nproc)}" >>"$out.log" 2>&1 || { tail -30 "$out.log" >&2; exit 1; }
    cmake --install "$out/cmake" >>"$out.log" 2>&1 || { tail -30 "$out.log" >&2; exit 1; }
    mkdir -p "$out/lib"
    for lib in libggml.so libggml-base.so libggml-cpu.so libggml-vulkan.so; do
      [ "$lib" != libggml-vulkan.so ] || [ "${v%-vulkan}" != "$v" ] || continue
      cp -L "$out/install/ggml/lib/$lib" "$out/lib/$lib"
    done
    if grep -q -- "-march=native" "$out/cmake/compile_commands.json" 2>/dev/null; then
      echo "ggml $v: built with -march=native; refusing" >&2
      exit 1
    fi
    echo "$key" >"$out/key"
    rm -rf "$out/cmake" "$out/install"
    echo "ggml $v: built in $((SECONDS - started)) s ($out/lib)" >&2
  done
done
