"""What structured output costs per token: llguidance's mask (text/grammar.py, the engine's own path: fill the
bitmask, unpack it, set the forbidden logits to -inf) and consuming the sampled token, at vocabulary sizes from our
test models' to the 2026 flagships' (151k Qwen, 200k MiniMax/gpt-oss), against the time of a decode token.

    python bench/grammar_bench.py [--replies 20] [--vocab 4096 32000 151936 201088]

Each vocabulary is a byte-level BPE trained on the built-in corpus (the test models' tokenizer) and padded to
the size with plain tokens of random words (2-12 letters of a 60-letter alphabet, a quarter with a leading space):
the shape of a real vocabulary's trie, not its exact contents. Each reply samples uniformly among the allowed
tokens (the worst case for the mask: a real model's choices are the grammar's likely ones) until the grammar
ends, under a JSON schema with strings, integers, an enum array and a boolean (the structured-output test's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.engine.test_structured_output import FORMAT  # noqa: E402
from tokenwing.testmodel.tokenizer import _byte_level, build_vocabulary  # noqa: E402
from tokenwing.text.grammar import Constraint, grammar_of, ll_tokenizer  # noqa: E402
from tokenwing.text.tokenizer import tokenizer_from_metadata  # noqa: E402

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZéèàüößçñαβγδεжзиклмн中文模型专家"


def vocabulary(size: int, rng: np.random.Generator) -> dict[str, object]:
    base = build_vocabulary(4096, "qwen2")
    tokens, types = list(base.tokens), list(base.token_types)
    seen = set(tokens)
    while len(tokens) < size:
        word = "".join(rng.choice(list(ALPHABET), int(rng.integers(2, 13))))
        word = _byte_level((" " if rng.random() < 0.25 else "") + word)
        if word not in seen:
            seen.add(word)
            tokens.append(word)
            types.append(1)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": base.merges,
        "tokenizer.ggml.eos_token_id": base.eos_id,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replies", type=int, default=20)
    ap.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000, 151936, 201088])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    grammar = grammar_of(FORMAT)
    assert grammar is not None
    print("| vocabulary | trie build | mask + apply per token (median, p90) | consume per token | tokens a reply |")
    print("|---|---|---|---|---|")
    for size in args.vocab:
        tok = tokenizer_from_metadata(vocabulary(size, rng), f"vocab-{size}")
        t = time.perf_counter()
        ll_tokenizer(tok)
        build = time.perf_counter() - t
        masks: list[float] = []
        consumes: list[float] = []
        lengths: list[int] = []
        for _ in range(args.replies):
            c = Constraint(tok, grammar.text)
            n = 0
            for _ in range(400):
                t0 = time.perf_counter()
                z = c.apply(np.zeros(tok.vocab_size, dtype=np.float32))
                t1 = time.perf_counter()
                allowed = np.flatnonzero(np.isfinite(z))
                pick = int(rng.choice(allowed))
                if pick in tok.eos_ids:
                    break
                t2 = time.perf_counter()
                c.accept(pick)
                consumes.append(time.perf_counter() - t2)
                masks.append(t1 - t0)
                n += 1
                if c.finished:
                    break
            lengths.append(n)
        p90 = float(np.percentile(masks, 90))
        print(
            f"| {size:,} | {build * 1e3:.0f} ms | {statistics.median(masks) * 1e3:.3f} ms, {p90 * 1e3:.3f} ms | "
            f"{statistics.median(consumes) * 1e3:.3f} ms | {statistics.median(lengths):.0f} |"
        )


if __name__ == "__main__":
    main()
