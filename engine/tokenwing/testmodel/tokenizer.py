"""The test models' tokenizer: byte-level BPE with llama.cpp's `qwen2` pre-tokenisation, and a ChatML template.

Trained deterministically on the built-in corpus with the `tokenizers` library, then padded with reserved
control tokens up to the requested vocabulary size (the vocabulary must match the embedding's rows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from tokenwing.testmodel.corpus import CORPUS

# llama.cpp's pre-tokeniser regex for `tokenizer.ggml.pre = qwen2`.
QWEN2_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOKEN_NORMAL = 1
TOKEN_CONTROL = 3

MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


@dataclass
class Vocabulary:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int
    pad_id: int
    trained: Tokenizer  # the `tokenizers` model the vocabulary came from (tests compare llama.cpp with it)
    chat_template: str = CHATML_TEMPLATE


def pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_vocabulary(vocab_size: int) -> Vocabulary:
    """A byte-level BPE vocabulary of exactly `vocab_size` tokens (specials and padding at the end)."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocabulary must have at least {MIN_VOCAB} tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TOKEN_NORMAL] * len(tokens)
    tokens += SPECIAL_TOKENS
    types += [TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    pad = vocab_size - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(pad)]
    types += [TOKEN_CONTROL] * pad
    base = vocab_size - pad - len(SPECIAL_TOKENS)
    return Vocabulary(tokens, types, merges, eos_id=base + 2, pad_id=base, trained=tok)
