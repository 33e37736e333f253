"""Subprocess: llama.cpp's logits for a token sequence, F32 KV cache, no flash attention (exact comparisons).

usage: python llama_logits.py MODEL.gguf TOKENS.npy OUT.npy [n_batch] [plain] [flash] [f16kv]

`plain` turns off llama.cpp's repacked weight layouts (use_extra_bufts), so it runs ggml's plain kernels; `flash`
turns on flash attention (llama.cpp's own default on the CPU; the Python binding's is off); `f16kv`: its default
F16 KV cache instead of F32.
"""

from __future__ import annotations

import sys

import numpy as np


def main() -> int:
    import llama_cpp

    model, tokens_path, out_path = sys.argv[1:4]
    n_batch = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    if "plain" in sys.argv[5:]:
        from tokenwing.testmodel.oracle import use_plain_layout

        use_plain_layout(llama_cpp)
    tokens = np.load(tokens_path).astype(np.int64).tolist()
    from tokenwing.testmodel.oracle import oracle_llama

    flash = "flash" in sys.argv[5:]
    f16_kv = "f16kv" in sys.argv[5:]
    llm = oracle_llama(llama_cpp, model, n_ctx=max(256, len(tokens) + 8), n_batch=n_batch, flash=flash, f16_kv=f16_kv)
    llm.eval(tokens)
    np.save(out_path, np.asarray(llm.scores[: len(tokens)], dtype=np.float32))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
