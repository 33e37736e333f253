#!/usr/bin/env bash
# ggml-python 0.0.45 binds ggml_backend_cuda_allreduce_tensor whenever ggml has CUDA, but ggml 0.15.3 declares it in
# ggml-cuda.h without defining it: `import ggml` then fails on every CUDA build (AttributeError). Patches the given
# ggml/ggml.py so that a binding whose symbol the library lacks is left disabled (calling it raises), as it is
# for backends that are not built. Usage: bench/ggml_python_fix.sh PATH/ggml/ggml.py
set -euo pipefail
grep -q '            if enabled and hasattr(lib, name):' "$1" && exit 0
grep -q '^            if enabled:$' "$1" || { echo "ggml_python_fix: $1 is not ggml-python 0.0.45's ggml.py" >&2; exit 1; }
sed -i 's/^            if enabled:$/            if enabled and hasattr(lib, name):/' "$1"
