"""A tokenizer built from the GGUF's own vocabulary with the `tokenizers` library, tokenising as llama.cpp does.

Supported: `tokenizer.ggml.model = gpt2` (byte-level BPE) with the pre-tokenisers llama.cpp names below.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tokenwing.errors import BadInputError, UnsupportedError

# llama.cpp's pre-tokeniser regexes, by `tokenizer.ggml.pre`: each splits the pieces the previous one left (as
# llama.cpp's unicode_regex_split does), in Oniguruma syntax with the semantics llama.cpp gives them.
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# DeepSeek-V3 (llama-vocab.cpp LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM): digits in threes, CJK/kana runs, then words.
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"""
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# gpt-4o / o200k (LLAMA_VOCAB_PRE_TYPE_GPT4O): llama.cpp's rewrite of the upper/lower-case word classes, which
# it evaluates on text whose non-ASCII letters all look alike: any non-ASCII letter counts as both cases, and
# combining marks (\p{M} in the original) are not part of words.
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?(?:(?=\p{L})[^a-z])*(?:(?=\p{L})[^A-Z])+"
    + _CONTRACTION
    + r"|[^\r\n\p{L}\p{N}]?(?:(?=\p{L})[^a-z])+(?:(?=\p{L})[^A-Z])*"
    + _CONTRACTION
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Kimi K2 (LLAMA_VOCAB_PRE_TYPE_KIMI_K2): llama.cpp's hand-written splitter (unicode.cpp,
# unicode_regex_split_custom_kimi_k2) as a regex: Han runs (its code point ranges), runs of other letters of any
# case with an optional leading non-letter and an English contraction, digits in threes, then as o200k.
_HAN = (
    r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}\x{2B740}-\x{2B81F}"
    r"\x{2B820}-\x{2CEAF}\x{2CEB0}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}"
)
_KIMI_K2 = (
    rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN}]]+(?:'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN2,),
    "llama3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "gpt-2": (_GPT2,),
    "default": (_GPT2,),
    "deepseek-v3": _DEEPSEEK_V3,
    "gpt-4o": (_GPT4O,),
    "kimi-k2": (_KIMI_K2,),
}

TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# Tokens llama.cpp recognises by their text (llama-vocab.cpp, after loading the vocabulary): these end generation
# and are control tokens whatever the file says ...
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
        "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
        "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
        # fill-in-the-middle padding, repository and file separators
        "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
        "<REPO>", "<reponame>", "<|file_sep|>",
    }
)  # fmt: skip
# ... and these are control tokens ...
_CONTROL_TEXTS = frozenset(
    {
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
        "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
        "▁<MID>", "<|code_middle|>", "<|middle|>",
    }
)  # fmt: skip
# ... and these (gpt-oss's harmony markers) are user-defined: split from plain text too, and always printed.
_USER_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


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
        user_ids: set[int] | None = None,
    ) -> None:
        self._plain = plain  # control-token texts are ordinary text (llama.cpp's parse_special=false)
        self._special = with_special  # control-token texts become their ids (what chat templates write)
        self.eos_ids = eos_ids  # every token that ends generation (llama.cpp's EOG set)
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.vocab_size = vocab_size
        self.special_ids = special_ids  # control tokens: never printed
        self.user_ids = user_ids or set()  # user-defined tokens: matched in any text, printed as their text

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
        if token_id in self.user_ids:
            return piece.encode()
        return bytes(_BYTE_DECODER.get(ch, 0) for ch in piece)

    def piece_bytes(self, token_id: int) -> bytes:
        """What a token shows as in token lists (logprobs): its bytes, or a control token's own name."""
        if token_id in self.special_ids:
            piece = self._plain.id_to_token(token_id)
            return piece.encode("utf-8") if piece is not None else b""
        return self.token_bytes(token_id)


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


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's pre-tokenisation for `tokenizer.ggml.pre = pre`, then GPT-2's byte-to-unicode mapping."""
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]
    ]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@dataclass
class TokenRoles:
    """How llama.cpp treats tokens beyond their GGUF type (llama-vocab.cpp, after loading the vocabulary)."""

    control: set[int]  # matched only where special tokens are parsed, never printed
    user: set[int]  # matched in any text, printed as their text
    eog: set[int]  # end generation


def token_roles(tokens: list[str], types: list[int], special: dict[str, int]) -> TokenRoles:
    """`special` holds the ids the file names (eos, eot, eom); the rest llama.cpp recognises by text."""
    control = {i for i, ty in enumerate(types) if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN)}
    user = {i for i, ty in enumerate(types) if ty == TOKEN_USER_DEFINED}
    eog = {special[k] for k in ("eos", "eot", "eom") if k in special}
    by_text = {t: i for i, t in enumerate(tokens)}
    for text in _EOG_TEXTS & by_text.keys():
        eog.add(by_text[text])
    control |= {by_text[t] for t in (_EOG_TEXTS | _CONTROL_TEXTS) & by_text.keys()}
    for text in _USER_TEXTS & by_text.keys():  # llama.cpp sets these to user-defined, dropping other flags
        control.discard(by_text[text])
        user.add(by_text[text])
    texts = {tokens[i] for i in eog}
    # harmony vocabularies: <|end|> ends a message, not the generation, when <|return|> and <|call|> exist
    if {"<|return|>", "<|call|>", "<|end|>"} <= texts:
        end = by_text["<|end|>"]
        eog.discard(end)
        control.discard(end)
        user.add(end)
    # gemma4 / plamo: a plain </s>
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
        eog.discard(by_text["</s>"])
        control.discard(by_text["</s>"])
    return TokenRoles(control, user - control, eog)


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
        tok.pre_tokenizer = pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        return tok

    keys = {k: f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "eom")}
    roles = token_roles(
        tokens, types, {k: _token_id(meta, key, len(tokens), where) for k, key in keys.items() if key in meta}
    )
    plain, with_special = build(), build()
    user = [AddedToken(tokens[i], special=False, normalized=False) for i in sorted(roles.user)]
    plain.add_tokens(user)
    with_special.add_tokens(user)
    with_special.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(roles.control)]
    )
    bos_key = "tokenizer.ggml.bos_token_id"
    bos = _token_id(meta, bos_key, len(tokens), where) if bos_key in meta else None
    add_bos = meta.get("tokenizer.ggml.add_bos_token") is True
    return TextTokenizer(plain, with_special, roles.eog, bos, add_bos, len(tokens), roles.control, roles.user)
