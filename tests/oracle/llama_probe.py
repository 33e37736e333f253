"""Runs in a subprocess (llama.cpp's ggml must not share our process): loads GGUFs, reports what it sees.

usage: python llama_probe.py REQUEST.json  → prints one JSON line per model
"""

from __future__ import annotations

import json
import sys

import numpy as np


def render_chats(llm: object, chats: list[dict[str, object]]) -> list[str]:
    """Each conversation through llama_chat_apply_template with the model's own template (llama.cpp's
    built-in handler for the format it recognises in it)."""
    import ctypes

    import llama_cpp

    tmpl = llama_cpp.llama_model_chat_template(llm.model, None)  # type: ignore[attr-defined]
    out = []
    for chat in chats:
        msgs = chat["messages"]
        assert isinstance(msgs, list)
        arr = (llama_cpp.llama_chat_message * len(msgs))(
            *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in msgs]
        )
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_chat_apply_template(tmpl, arr, len(msgs), bool(chat["add_ass"]), buf, len(buf))
        assert 0 <= n <= len(buf), n
        out.append(buf.raw[:n].decode())
    return out


def probe(path: str, texts: list[str], chats: list[dict[str, object]] | None = None) -> dict[str, object]:
    import llama_cpp

    llm = llama_cpp.Llama(path, n_ctx=128, n_threads=2, n_batch=64, logits_all=True, verbose=False)
    tokens = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts]
    tokens_special = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
    detok = [llm.detokenize(t).decode("utf-8", errors="replace") for t in tokens]
    detok_special = [llm.detokenize(t).decode("utf-8", errors="replace") for t in tokens_special]
    prompt = tokens[0][:16] or [1]
    llm.eval(prompt)
    logits = np.asarray(llm.scores[: len(prompt)], dtype=np.float64)
    return {
        "path": path,
        "n_vocab": llm.n_vocab(),
        "tokens": tokens,
        "tokens_special": tokens_special,
        "detokenized": detok,
        "detokenized_special": detok_special,
        "chats": render_chats(llm, chats or []),
        "logits_finite": bool(np.isfinite(logits).all()),
        "logits_std": float(logits.std()),
    }


def main() -> int:
    with open(sys.argv[1]) as f:
        request = json.load(f)
    for path in request["paths"]:
        print(json.dumps(probe(path, request["texts"], request.get("chats"))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
