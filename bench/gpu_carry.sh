#!/usr/bin/env bash
# Prepares, on this (GPU-less) machine, what bench/gpu_check.sh needs on the NVIDIA machine, which has no internet,
# no ggml, no gguf and no llama.cpp, and takes at most 64 MiB of working tree (~25 MB, the demo model most of it) and
# carried files together. Into build/gpu-carry/ (carry that folder):
#
#   ggml-vulkan.tar.xz   the engine's ggml build of this venv (every x86-64 CPU level and Vulkan; no headers):
#                        what ./dev built, as TOKENWING_GGML_DIR takes it
#   ggml-src.tar.xz      ggml's pinned source (engine/ggml: build/ggml/src/VERSION, ggml/ and its LICENSE):
#                        gpu_check.sh builds ggml with CUDA from it there (engine/ggml/build.sh, TW_GGML_SOURCE_DIR)
#   gguf-*.whl           the engine's GGUF dependency (pure Python)
#   vulkan/libvulkan.so.1   the Vulkan loader (the machine has NVIDIA's Vulkan driver, not the loader)
#   refs/                llama.cpp's logits of the device tests' models, with the models (bench/gpu_refs.py): the GPU
#                        machine has no llama.cpp
#
# Needs ./dev setup (the .venv with its ggml build; the Vulkan headers and glslc, as root). Usage: bench/gpu_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
CARRY=build/gpu-carry
GGML=$(python -c 'import sys; print(sys.prefix)')/lib/tokenwing-ggml
mkdir -p "$CARRY/vulkan"
[ -d "$GGML/backends/vulkan" ] || { echo "gpu_carry: the venv's ggml has no Vulkan backend: ./dev setup as root" >&2; exit 1; }

tar cJf "$CARRY/ggml-vulkan.tar.xz.partial" -C "$GGML" --exclude=include . \
  && mv "$CARRY/ggml-vulkan.tar.xz.partial" "$CARRY/ggml-vulkan.tar.xz"
src=$(dirname "$(engine/ggml/build.sh --source)")  # (fetched already: ./dev built from it)
version=$(basename "$src")
tar cJf "$CARRY/ggml-src.tar.xz.partial" -C build/ggml/src/"$version" ggml LICENSE \
  && mv "$CARRY/ggml-src.tar.xz.partial" "$CARRY/ggml-src.tar.xz"

gguf=$(python -c "import importlib.metadata as m; print(m.version('gguf'))")
ls "$CARRY"/gguf-"$gguf"-*.whl >/dev/null 2>&1 || python -m pip download -q --no-deps "gguf==$gguf" -d "$CARRY"
cp -L /usr/lib/x86_64-linux-gnu/libvulkan.so.1 "$CARRY/vulkan/libvulkan.so.1"
rm -rf "$CARRY/refs.partial" && python bench/gpu_refs.py "$CARRY/refs.partial" >/dev/null \
  && rm -rf "$CARRY/refs" && mv "$CARRY/refs.partial" "$CARRY/refs"
du -b "$CARRY"/* "$CARRY"/vulkan/* >&2
echo "carry: $(du -cb "$CARRY"/*.* "$CARRY"/vulkan/* "$CARRY"/refs | tail -1 | cut -f1) bytes in $CARRY" >&2
