"""`build.py tokenizer`: the byte-level BPE, and `Codec`, the vocabulary with the special tokens at its end."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import numpy as np
from recipe import (
    CFG,
    ENDOFTEXT,
    SPECIAL_RE,
    SPECIALS,
    WORK,
    read_docs,
)


def _plain(doc: str) -> Iterator[str]:
    for piece in SPECIAL_RE.split(doc):
        if piece and piece not in SPECIALS:
            yield piece


def cmd_tokenizer(_: argparse.Namespace) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tokenwing.testmodel.tokenizer import pre_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=CFG.vocab_size - len(SPECIALS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator((p for d in read_docs("train.jsonl") for p in _plain(d)), trainer=trainer)
    tok.save(str(WORK / "tokenizer.json"))
    for cache in WORK.glob("*.tokens.npy"):
        cache.unlink()  # token streams of an older tokenizer
    print(f"vocabulary: {tok.get_vocab_size()} + {len(SPECIALS)} specials")


class Codec:
    """The trained BPE plus the special tokens at the end of the vocabulary (as llama.cpp parses them)."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders

        self.tok = Tokenizer.from_file(str(WORK / "tokenizer.json"))
        self.tok.decoder = decoders.ByteLevel()
        base = self.tok.get_vocab_size()
        self.special = {s: base + i for i, s in enumerate(SPECIALS)}
        self.base = base

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in SPECIAL_RE.split(text):
            if piece in self.special:
                ids.append(self.special[piece])
            elif piece:
                ids += self.tok.encode(piece, add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        inv = {v: k for k, v in self.special.items()}
        out, run = [], []
        for i in ids:
            if i in inv:
                out.append(self.tok.decode(run))
                out.append(inv[i])
                run = []
            elif i < self.base:
                run.append(i)
        out.append(self.tok.decode(run))
        return "".join(out)

    def stream(self, docs: list[str]) -> np.ndarray:
        eot = self.special[ENDOFTEXT]
        parts = [np.asarray([*self.encode(d), eot], dtype=np.uint16) for d in docs]
        return np.concatenate(parts)
