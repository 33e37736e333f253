"""Runs in a subprocess (llama.cpp's ggml must not share our process): loads each GGUF's vocabulary only
(llama.cpp's vocab_only load, no tensors) and reports how llama.cpp tokenizes texts and shows tokens.

usage: python llama_vocab_probe.py REQUEST.json  → prints one JSON line per model
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any


def probe(path: str, texts: list[str]) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    assert model, f"llama.cpp did not load {path}"
    vocab = llama_cpp.llama_model_get_vocab(model)

    def tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 8))()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
        assert n >= 0, n
        return list(buf[:n])

    def piece(token: int) -> str:
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
        assert 0 <= n <= len(buf), n
        return buf.raw[:n].hex()

    out = {
        "path": path,
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "plain": [tokenize(t, False, False) for t in texts],
        "special": [tokenize(t, False, True) for t in texts],
        "with_bos": [tokenize(t, True, True) for t in texts],
    }
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    out["pieces"] = [piece(i) for i in range(n_vocab)]
    llama_cpp.llama_model_free(model)
    return out


def main() -> int:
    with open(sys.argv[1]) as f:
        request = json.load(f)
    for path in request["paths"]:
        print(json.dumps(probe(path, request["texts"])), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
