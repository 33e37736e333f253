"""`POST /tokenize` and `/detokenize` on the real server give llama.cpp's ids and text (llama.cpp's server API)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import KEY, Server
from tests.oracle.test_tokenizer import MARKERS, MIXED, vocab_probe
from tokenwing.format.gguf_io import read_header
from tokenwing.text.tokenizer import tokenizer_from_metadata

pytestmark = pytest.mark.oracle

SHAPE = {"arch": "ernie4_5-moe", "tokenizer": "spm", "vocab_size": 4096, "n_layer": 2, "type": "Q8_0"}
TEXTS = [MIXED[0], MARKERS[3], "emoji 🦜 splits into bytes", ""]


@pytest.fixture(scope="module")
def server(repacked_factory: ModelFactory) -> Iterator[Server]:
    s = Server(repacked_factory(**SHAPE), "--ram-budget", "50%")
    yield s
    s.stop()


def post(server: Server, path: str, body: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: a lone surrogate as \ud800
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=60)


def test_tokenize_and_detokenize_match_llama_cpp(server: Server, model_factory: ModelFactory) -> None:
    gguf = model_factory(**SHAPE)
    (r,) = vocab_probe([gguf], TEXTS)
    tok = tokenizer_from_metadata({k: v.value for k, v in read_header(str(gguf)).kv.items()}, str(gguf))
    for text, special, plain, with_bos in zip(TEXTS, r["special"], r["plain"], r["with_bos"], strict=True):
        assert post(server, "/tokenize", {"content": text}).json() == {"tokens": special}
        got = post(server, "/tokenize", {"content": text, "parse_special": False, "add_special": True}).json()
        assert got["tokens"] == ([tok.bos_id] if tok.add_bos else []) + plain
        assert post(server, "/tokenize", {"content": text, "add_special": True}).json() == {"tokens": with_bos}
        pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == special
        shown = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
        assert shown.hex() == "".join(r["pieces"][i] for i in special)
        back = post(server, "/detokenize", {"tokens": special}).json()["content"]
        assert back == shown.decode("utf-8", errors="replace")
    # an emoji not in the vocabulary is byte tokens: a piece that is part of a character comes as its bytes
    pieces = post(server, "/tokenize", {"content": "🦜", "with_pieces": True}).json()["tokens"]
    assert any(isinstance(p["piece"], list) for p in pieces)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"content": 5}, "content"),
        ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
        ("/tokenize", {"content": "\ud800"}, "content"),
        ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ],
)
def test_bad_requests_name_the_field(server: Server, path: str, body: object, param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
