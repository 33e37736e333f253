"""The engine's tokenizer, built from the GGUF vocabulary, tokenises exactly as llama.cpp on tricky strings."""

from __future__ import annotations

import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_llama_loads import probe_models
from tokenwing.format.gguf_io import read_header
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.tokenizer import tokenizer_from_metadata

pytestmark = pytest.mark.oracle

TRICKY = [
    "Hello world",
    " leading space",
    "  two  spaces   three\t\ttabs\n\nnewlines\r\n",
    "it's they'RE WE'LL I'd can't",
    "1234567 3.14159 1e-5 $19.99 100%",
    "café naïve Straße año 日本語 中文 한국어 🙂🚀 Ελληνικά",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "<|im_start|<|im_end|>>",
    "\u200b\u00a0zero width and nbsp",
    "a" * 300,
    "",
    " ",
    "\n",
]


def test_tokenizer_matches_llama_cpp(model_factory: ModelFactory) -> None:
    path = model_factory()
    (r,) = probe_models([path], TRICKY)
    meta = {k: v.value for k, v in read_header(str(path)).kv.items()}
    tok = tokenizer_from_metadata(meta, str(path))
    for text, plain, special in zip(TRICKY, r["tokens"], r["tokens_special"], strict=True):
        assert tok.encode(text, special=False) == plain, text
        assert tok.encode(text, special=True) == special, text
        assert tok.decode(plain, skip_special=False) == text


def test_chat_template_renders_chatml(model_factory: ModelFactory) -> None:
    meta = {k: v.value for k, v in read_header(str(model_factory())).kv.items()}
    t = ChatTemplate(meta["tokenizer.chat_template"])
    out = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
