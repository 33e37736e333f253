"""`POST /tokenize` and `POST /detokenize`, as llama.cpp's server has them (docs/api.md): the model's own tokenizer
behind the HTTP API, so a client counts tokens and builds prompts exactly as the engine will."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenwing.server.protocol import RequestError
from tokenwing.server.protocol import _text as text_field
from tokenwing.text.tokenizer import TextTokenizer

MAX_TOKENS = 1 << 20  # a /detokenize list longer than any context


@dataclass
class TokenizeRequest:
    content: str
    add_special: bool  # put the BOS token first where the model does (llama.cpp's default: no)
    parse_special: bool  # special tokens' texts are those tokens (llama.cpp's default: yes)
    with_pieces: bool  # each id with the text it stands for


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise RequestError(f"'{key}' must be a boolean", key)
    return v


def parse_tokenize(body: Any) -> TokenizeRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    content = body.get("content")
    if not isinstance(content, str):
        raise RequestError("'content' must be a string", "content")
    return TokenizeRequest(
        text_field(content, "'content'", "content"),
        _flag(body, "add_special", False),
        _flag(body, "parse_special", True),
        _flag(body, "with_pieces", False),
    )


def parse_detokenize(body: Any, vocab_size: int) -> list[int]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS:
        raise RequestError(f"'tokens' must be a list of at most {MAX_TOKENS} token ids", "tokens")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RequestError(f"'tokens' holds {t!r}, which is not a token id below {vocab_size}", "tokens")
    return tokens


def tokenize(tok: TextTokenizer, req: TokenizeRequest) -> dict[str, Any]:
    ids = tok.encode(req.content, special=req.parse_special, add_bos=None if req.add_special else False)
    if not req.with_pieces:
        return {"tokens": ids}
    pieces: list[dict[str, Any]] = []
    for i in ids:
        raw = tok.piece_bytes(i)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: its bytes, as llama.cpp's server gives them
            piece = list(raw)
        pieces.append({"id": i, "piece": piece})
    return {"tokens": pieces}


def detokenize(tok: TextTokenizer, ids: list[int]) -> dict[str, Any]:
    """Each token as it prints, special tokens by name (llama.cpp's server does the same)."""
    return {"content": tok.decode(ids, skip_special=False)}
