"""K-quant test models through llama.cpp's own quantizer (llama-cpp-python), run in a subprocess.

The subprocess keeps llama.cpp's copy of ggml out of the caller's process (ours may load another copy).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

from tokenwing.errors import TokenWingError


def quantize_with_llama_cpp(src: str, dst: str, type_name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tokenwing.testmodel.kquant", src, dst, type_name],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise TokenWingError(f"llama.cpp could not quantize to {type_name}: {lines[-1] if lines else '?'}")


def _main(src: str, dst: str, type_name: str) -> int:
    try:
        import llama_cpp
    except ImportError:
        print("K-quants need llama-cpp-python (pip install '.[oracle]')", file=sys.stderr)
        return 2
    # MOSTLY_<type> for quantized types, or a full name such as ALL_F32 (dequantized by ggml itself)
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}", getattr(llama_cpp, f"LLAMA_FTYPE_{type_name}", None))
    if ftype is None:
        print(f"this llama.cpp has no {type_name}", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True  # the source is the factory's Q8_0
    params.nthread = 0
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize returned {rc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(*sys.argv[1:4]))
