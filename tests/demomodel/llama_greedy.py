"""Subprocess: llama.cpp's greedy continuations of prompts (tokenised by llama.cpp, specials parsed).

usage: python llama_greedy.py MODEL.gguf REQUEST.json OUT.json

REQUEST: {"prompts": [{"text": str, "n": max new tokens}, ...]} ("tokens": [ids] instead of "text": those ids).
OUT: [{"prompt_tokens": [...], "tokens": [...]}, ...];
generation stops after a token llama.cpp itself counts as end of generation (EOG), which is included.
F32 KV cache, no flash attention, as the project's other llama.cpp oracles.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> int:
    import llama_cpp

    model, request_path, out_path = sys.argv[1:4]
    with open(request_path) as f:
        request = json.load(f)
    from tokenwing.testmodel.oracle import oracle_llama

    llm = oracle_llama(llama_cpp, model, n_ctx=512, n_batch=512)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    results = []
    for prompt in request["prompts"]:
        ids = prompt.get("tokens") or llm.tokenize(prompt["text"].encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        out: list[int] = []
        for _ in range(int(prompt["n"])):
            token = int(np.argmax(np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)))
            out.append(token)
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            llm.eval([token])
        results.append({"prompt_tokens": ids, "tokens": out})
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
