"""A tokenizer built from the GGUF's own vocabulary with the `tokenizers` library, tokenising as llama.cpp does.

Supported: `tokenizer.ggml.model = gpt2` (byte-level BPE) with the pre-tokenisers llama.cpp names below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tokenwing.errors import BadInputError, UnsupportedError

# llama.cpp's pre-tokeniser regexes, by `tokenizer.ggml.pre`.
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS: dict[str, str] = {
    "qwen2": _QWEN2,
    "qwen35": _QWEN2,
    "llama3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "gpt-2": _GPT2,
    "default": _GPT2,
}

TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4


class TextTokenizer:
    def __init__(
        self,
        plain: Tokenizer,
        with_special: Tokenizer,
        eos_ids: set[int],
        bos_id: int | None,
        add_bos: bool,
        vocab_size: int,
        special_ids: set[int],
    ) -> None:
        self._plain = plain  # control-token texts are ordinary text (llama.cpp's parse_special=false)
        self._special = with_special  # control-token texts become their ids (what chat templates write)
        self.eos_ids = eos_ids
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.vocab_size = vocab_size
        self.special_ids = special_ids

    def encode(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        tok = self._special if special else self._plain
        ids: list[int] = tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return str(self._special.decode(list(ids), skip_special_tokens=skip_special))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (streamed output may split a UTF-8 character across tokens)."""
        piece = self._plain.id_to_token(token_id)
        if piece is None or token_id in self.special_ids:
            return b""
        return bytes(_BYTE_DECODER.get(ch, 0) for ch in piece)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _token_id(meta: dict[str, Any], key: str, n_vocab: int, where: str) -> int:
    v = meta[key]
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or not 0 <= int(v) < n_vocab:
        raise BadInputError(f"{where}: {key} is not a token of the vocabulary")
    return int(v)


def tokenizer_from_metadata(meta: dict[str, Any], where: str) -> TextTokenizer:
    """Builds the tokenizer from GGUF metadata values (plain Python/numpy values, keyed by GGUF key)."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedError(f"{where}: tokenizer model {model!r} is not supported yet (only gpt2 BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise UnsupportedError(f"{where}: pre-tokenizer {pre!r} is not supported yet")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not _strings(tokens) or not _strings(merges) or not tokens:
        raise BadInputError(f"{where}: the vocabulary or its merges are missing or malformed")
    assert isinstance(tokens, list) and isinstance(merges, list)
    raw_types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if not isinstance(raw_types, list | np.ndarray):
        raise BadInputError(f"{where}: tokenizer.ggml.token_type must be an array")
    types = list(raw_types)
    if (
        len(types) != len(tokens)
        or len(set(tokens)) != len(tokens)
        or not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in types)
    ):
        raise BadInputError(f"{where}: the vocabulary is inconsistent (duplicate tokens or token types)")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or a not in vocab or b not in vocab or a + b not in vocab:
            raise BadInputError(f"{where}: merge {m!r} does not fit the vocabulary")
        pairs.append((a, b))

    def build() -> Tokenizer:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        return tok

    special_ids = {i for i, ty in enumerate(types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)}
    plain, with_special = build(), build()
    with_special.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)]
    )
    id_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    eos = {_token_id(meta, k, len(tokens), where) for k in id_keys if k in meta}
    bos_key = "tokenizer.ggml.bos_token_id"
    bos = _token_id(meta, bos_key, len(tokens), where) if bos_key in meta else None
    add_bos = meta.get("tokenizer.ggml.add_bos_token") is True
    return TextTokenizer(plain, with_special, eos, bos, add_bos, len(tokens), special_ids)
