"""Tokenizers built from the GGUF's own vocabulary, tokenising as llama.cpp does.

Supported: `tokenizer.ggml.model = gpt2` (byte-level BPE, through the `tokenizers` library) with the
pre-tokenisers llama.cpp names below, and `llama` (SentencePiece, as llama.cpp merges it).
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.format.gguf_io import read_header

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
# A file that names no pre-tokenizer, or "default" (LLAMA_VOCAB_PRE_TYPE_DEFAULT): punctuation runs, GPT-2's
# split, then digit runs cut in threes.
_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
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
# Mistral's tekken (LLAMA_VOCAB_PRE_TYPE_TEKKEN): o200k's word classes as llama.cpp rewrites them (above), without
# the contractions, each digit its own piece.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?(?:(?=\p{L})[^a-z])*(?:(?=\p{L})[^A-Z])+"
    r"|[^\r\n\p{L}\p{N}]?(?:(?=\p{L})[^a-z])+(?:(?=\p{L})[^A-Z])*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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
# Qwen3.5 (LLAMA_VOCAB_PRE_TYPE_QWEN35): Qwen2's, with combining marks part of words and never of punctuation.
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Ling 2.0 / 3.0 (LLAMA_VOCAB_PRE_TYPE_BAILINGMOE): Qwen2's, with each newline its own piece after spaces
# (`\s*[\r\n]`, not `[\r\n]+`); llama.cpp made the original's possessive quantifiers greedy, as here.
_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's pre-tokenizer types (llama-vocab.cpp, by `tokenizer.ggml.pre`)."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token is that token, unmerged (llama.cpp's ignore_merges)
    add_bos: bool = False  # llama.cpp's default where the file does not say
    bos: bool = True  # False: llama.cpp ignores the file's BOS token


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT),
    "gpt-2": PreTokenizer((_GPT2,)),
    "qwen2": PreTokenizer((_QWEN2,)),
    "deepseek-r1-qwen": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,)),
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama-bpe": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    # GLM-4.5 .. GLM-5 (LLAMA_VOCAB_PRE_TYPE_CHATGLM4): Llama 3's split, whole-token pieces unmerged
    "glm4": PreTokenizer((_LLAMA3,), ignore_merges=True, bos=False),
    "glm5": PreTokenizer((_LLAMA3,), ignore_merges=True, bos=False),
    "deepseek-v3": PreTokenizer(_DEEPSEEK_V3),
    # DeepSeek V4's files: its tokenizer hashes as JoyAI-LLM-Flash's, whose type llama.cpp splits as DeepSeek-V3
    "joyai-llm": PreTokenizer(_DEEPSEEK_V3),
    "gpt-4o": PreTokenizer((_GPT4O,)),
    "minimax-m2": PreTokenizer((_GPT4O,)),  # MiniMax M2 shares o200k's split (LLAMA_VOCAB_PRE_TYPE_MINIMAX_M2)
    "kimi-k2": PreTokenizer((_KIMI_K2,)),
    # Mistral Small 3.1+ / 4: whole-token pieces unmerged, a BOS added (llama.cpp's rules for this type)
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "bailingmoe": PreTokenizer((_BAILINGMOE,)),
    "bailingmoe2": PreTokenizer((_BAILINGMOE,)),
    "llada-moe": PreTokenizer((_BAILINGMOE,)),
}

TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_BYTE = 6

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
    """What the engine asks of a vocabulary: text to ids as llama.cpp makes them, and ids back to bytes."""

    def __init__(
        self,
        tokens: list[str],
        types: list[int],
        eos_ids: set[int],
        bos_id: int | None,
        add_bos: bool,
        special_ids: set[int],
        user_ids: set[int] | None = None,
    ) -> None:
        self.tokens = tokens
        self.types = types  # GGUF token types
        self.eos_ids = eos_ids  # every token that ends generation (llama.cpp's EOG set)
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.vocab_size = len(tokens)
        self.special_ids = special_ids  # control tokens: never printed
        self.user_ids = user_ids or set()  # user-defined tokens: matched in any text, printed as their text

    def encode(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """`special`: control-token texts become their ids (what chat templates write); otherwise they are
        ordinary text (llama.cpp's parse_special)."""
        ids = self._encode(text, special)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def _encode(self, text: str, special: bool) -> list[int]:
        raise NotImplementedError

    def encode_exact(self, text: str) -> list[int]:
        """Ids whose token bytes are exactly `text`'s (no special tokens, no BOS, no space put before it): what
        constrained decoding tokenizes continuations with."""
        return self._encode(text, False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (streamed output may split a UTF-8 character across tokens)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of `ids`, each token as llama.cpp's token_to_piece shows it (control tokens by name unless
        skipped)."""
        out = b"".join(self.token_bytes(i) if skip_special else self.piece_bytes(i) for i in ids)
        return out.decode("utf-8", errors="replace")

    def piece_bytes(self, token_id: int) -> bytes:
        """What a token shows as in token lists (logprobs): its bytes, or a control token's own name."""
        if token_id in self.special_ids:
            return self.tokens[token_id].encode("utf-8") if 0 <= token_id < self.vocab_size else b""
        return self.token_bytes(token_id)


class BpeTokenizer(TextTokenizer):
    """Byte-level BPE (`tokenizer.ggml.model = gpt2`), through the `tokenizers` library."""

    def __init__(
        self, tokens: list[str], types: list[int], plain: Tokenizer, with_special: Tokenizer, **roles: Any
    ) -> None:
        super().__init__(tokens, types, **roles)
        self._plain = plain  # control-token texts are ordinary text (llama.cpp's parse_special=false)
        self._special = with_special  # control-token texts become their ids

    def _encode(self, text: str, special: bool) -> list[int]:
        tok = self._special if special else self._plain
        return list(tok.encode(text, add_special_tokens=False).ids)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size or token_id in self.special_ids:
            return b""
        piece = self.tokens[token_id]
        if token_id in self.user_ids:
            return piece.encode()
        if self.types[token_id] != TOKEN_NORMAL:
            return b""  # unused and undefined tokens print nothing (llama.cpp's token_to_piece)
        return bytes(_BYTE_DECODER.get(ch, 0) for ch in piece)


_SPACE = "\u2581"  # SentencePiece's visible space


class SpmTokenizer(TextTokenizer):
    """SentencePiece vocabularies (`tokenizer.ggml.model = llama`: ERNIE 4.5, Llama 2 and kin), tokenised as
    llama.cpp's llm_tokenizer_spm does: spaces become U+2581, a space is put before text that starts the input
    or follows a special token, then adjacent pieces merge, highest-scoring result first (leftmost among
    equals), wherever their concatenation is a token; a character no token covers becomes its byte tokens."""

    def __init__(
        self,
        tokens: list[str],
        scores: list[float],
        types: list[int],
        add_space_prefix: bool,
        **roles: Any,
    ) -> None:
        super().__init__(tokens, types, **roles)
        self._ids = {t: i for i, t in enumerate(tokens)}  # a repeated text maps to its last id, as in llama.cpp
        self._scores = scores
        self._add_space_prefix = add_space_prefix
        self._bytes: dict[int, int] = {}  # byte → its <0xXX> token
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True)):
            if ty == TOKEN_BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                with contextlib.suppress(ValueError):
                    self._bytes.setdefault(int(t[3:5], 16), i)
        # llama.cpp's special-token partition: user-defined tokens always, control and unknown ones only where
        # special tokens are parsed; longer texts first, each cutting the raw text the longer ones left
        by_len = sorted(self.user_ids | self.special_ids, key=lambda i: -len(tokens[i]))
        self._partition_all = [(tokens[i], i) for i in by_len if tokens[i]]
        self._partition_user = [(t, i) for t, i in self._partition_all if i in self.user_ids]

    def encode_exact(self, text: str) -> list[int]:
        out: list[int] = []
        if text:
            self._merge(text.replace(" ", _SPACE), out)
        return out

    def _encode(self, text: str, special: bool) -> list[int]:
        fragments: list[str | int] = [text] if text else []
        for piece, tid in self._partition_all if special else self._partition_user:
            cut: list[str | int] = []
            for f in fragments:
                if isinstance(f, int) or piece not in f:
                    cut.append(f)
                    continue
                parts = f.split(piece)
                for k, part in enumerate(parts):
                    if k:
                        cut.append(tid)
                    if part:
                        cut.append(part)
            fragments = cut
        out: list[int] = []
        prev_special = True  # a space before the input's first text
        for f in fragments:
            if isinstance(f, int):
                out.append(f)
                prev_special = True
                continue
            raw = (" " if self._add_space_prefix and prev_special else "") + f
            self._merge(raw.replace(" ", _SPACE), out)
            prev_special = False
        return out

    def _merge(self, text: str, out: list[int]) -> None:
        syms = list(text)  # one symbol per character
        n = len(syms)
        nxt = [*range(1, n), -1]
        prev = list(range(-1, n - 1))
        queue: list[tuple[float, int, int, int]] = []

        def bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            joined = syms[left] + syms[right]
            tid = self._ids.get(joined)
            if tid is not None:
                heapq.heappush(queue, (-self._scores[tid], left, len(joined), right))

        for i in range(1, n):
            bigram(i - 1, i)
        while queue:
            _, left, size, right = heapq.heappop(queue)
            # a pair one of whose symbols has changed since it was queued is stale
            if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
                continue
            syms[left] += syms[right]
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            bigram(prev[left], left)
            bigram(left, nxt[left])
        i = 0 if n else -1
        while i != -1:
            tid = self._ids.get(syms[i])
            if tid is not None:
                out.append(tid)
            else:
                for byte in syms[i].encode("utf-8"):
                    if byte not in self._bytes:
                        raise BadInputError(f"the vocabulary has no token for byte 0x{byte:02X}")
                    out.append(self._bytes[byte])
            i = nxt[i]

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size or token_id in self.special_ids:
            return b""
        text = self.tokens[token_id]
        if token_id in self.user_ids:
            return text.encode()
        ty = self.types[token_id]
        if ty == TOKEN_BYTE:
            return bytes([int(text[3:5], 16)]) if text.startswith("<0x") and len(text) == 6 else b""
        if ty != TOKEN_NORMAL:
            return b""  # unused and undefined tokens print nothing (llama.cpp's token_to_piece)
        return text.replace(_SPACE, " ").encode()


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
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre].splits
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
    if model not in ("gpt2", "llama"):
        raise UnsupportedError(
            f"{where}: tokenizer model {model!r} is not supported yet (gpt2 BPE and llama SentencePiece are)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default") if model == "gpt2" else "default"
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise UnsupportedError(f"{where}: pre-tokenizer {pre!r} is not supported yet")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not _strings(tokens) or not tokens:
        raise BadInputError(f"{where}: the vocabulary is missing or malformed")
    assert isinstance(tokens, list)
    raw_types = meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))
    if not isinstance(raw_types, list | np.ndarray):
        raise BadInputError(f"{where}: tokenizer.ggml.token_type must be an array")
    types = [int(t) if isinstance(t, int | np.integer) and not isinstance(t, bool) else -1 for t in raw_types]
    if len(types) != len(tokens) or -1 in types:
        raise BadInputError(f"{where}: the vocabulary is inconsistent (its token types do not match its tokens)")
    keys = {k: f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "eom")}
    roles = token_roles(
        tokens, types, {k: _token_id(meta, key, len(tokens), where) for k, key in keys.items() if key in meta}
    )
    bos_key = "tokenizer.ggml.bos_token_id"
    bos = _token_id(meta, bos_key, len(tokens), where) if bos_key in meta else None
    spec = PRE_TOKENIZERS[pre]
    if model == "gpt2" and not spec.bos:
        bos = None  # GLM's files name a BOS token that llama.cpp ignores
    # llama.cpp's default, unless the file says: SentencePiece vocabularies and Llama 3's start with BOS
    add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama" or spec.add_bos) is True
    common: dict[str, Any] = dict(
        eos_ids=roles.eog, bos_id=bos, add_bos=add_bos, special_ids=roles.control, user_ids=roles.user
    )
    if model == "llama":
        return _spm(meta, tokens, types, where, common)
    return _bpe(meta, tokens, types, pre, roles, where, common)


def _spm(
    meta: dict[str, Any], tokens: list[str], types: list[int], where: str, common: dict[str, Any]
) -> TextTokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list | np.ndarray) or len(scores) != len(tokens):
        raise BadInputError(f"{where}: a SentencePiece vocabulary needs a score for every token")
    try:
        values = [float(v) for v in scores]
    except (TypeError, ValueError):
        raise BadInputError(f"{where}: tokenizer.ggml.scores must be numbers") from None
    if not all(np.isfinite(values)):
        raise BadInputError(f"{where}: tokenizer.ggml.scores must be finite")
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True) is True
    return SpmTokenizer(tokens, values, types, prefix, **common)


def _bpe(
    meta: dict[str, Any],
    tokens: list[str],
    types: list[int],
    pre: str,
    roles: TokenRoles,
    where: str,
    common: dict[str, Any],
) -> TextTokenizer:
    merges = meta.get("tokenizer.ggml.merges")
    if not _strings(merges):
        raise BadInputError(f"{where}: the vocabulary's merges are missing or malformed")
    assert isinstance(merges, list)
    try:  # (a byte that is not UTF-8 reads as a lone surrogate, which the BPE library refuses with a TypeError)
        "".join(tokens).encode()
        "".join(merges).encode()
    except UnicodeEncodeError:
        raise BadInputError(f"{where}: the vocabulary or its merges hold bytes that are not UTF-8 text") from None
    if len(set(tokens)) != len(tokens):
        raise BadInputError(f"{where}: the vocabulary is inconsistent (duplicate tokens)")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or a not in vocab or b not in vocab or a + b not in vocab:
            raise BadInputError(f"{where}: merge {m!r} does not fit the vocabulary")
        pairs.append((a, b))

    def build() -> Tokenizer:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=PRE_TOKENIZERS[pre].ignore_merges))
        tok.pre_tokenizer = pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        return tok

    plain, with_special = build(), build()
    user = [AddedToken(tokens[i], special=False, normalized=False) for i in sorted(roles.user)]
    plain.add_tokens(user)
    with_special.add_tokens(user)
    with_special.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(roles.control)]
    )
    return BpeTokenizer(tokens, types, plain, with_special, **common)


def tokenizer_from_file(path: str) -> TextTokenizer:
    """The tokenizer of a TokenWing model file or a GGUF (the first shard of a split one), from its header."""
    meta = {k: v.value for k, v in read_header(path).kv.items()}
    return tokenizer_from_metadata(meta, path)
