"""Untrusted inputs the engine parses — HTTP request bodies, chat templates, tokenizer metadata — fuzzed:
only clean errors, never a traceback."""

from __future__ import annotations

import contextlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenwing.errors import BadInputError, TokenWingError
from tokenwing.server.protocol import RequestError, parse_chat, parse_completion
from tokenwing.testmodel.tokenizer import CHATML_TEMPLATE, build_vocabulary
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.tokenizer import tokenizer_from_metadata

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
keys = st.sampled_from(
    [
        "messages",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stream",
        "seed",
        "n",
        "stream_options",
        "presence_penalty",
        "max_completion_tokens",
    ]
)
bodies = st.dictionaries(keys, json_values, max_size=8) | json_values


@settings(max_examples=400, deadline=None)
@given(body=bodies)
def test_request_parsing_only_clean_errors(body: Any) -> None:
    for parse in (parse_chat, parse_completion):
        with contextlib.suppress(RequestError):
            req = parse(body)
            assert req.max_tokens >= 1 and 0 <= req.sampler.temperature <= 2


@settings(max_examples=300, deadline=None)
@given(template=st.text(alphabet=st.sampled_from(list("{}%#-+*/ ()[]'\"._|~abcmsgerolntx0123456789\n")), max_size=80))
def test_chat_templates_only_clean_errors(template: str) -> None:
    with contextlib.suppress(BadInputError):
        ChatTemplate(template).render([{"role": "user", "content": "hi"}])


def test_sandbox_blocks_escapes() -> None:
    for evil in (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% for i in range(10**9) %}x{% endfor %}",
        "{{ raise_exception('no') }}",
    ):
        try:
            ChatTemplate(evil).render([{"role": "user", "content": "x"}])
        except BadInputError as e:
            assert "\n" not in str(e)
        else:
            raise AssertionError(f"{evil!r} rendered")


def test_chatml_with_odd_content() -> None:
    t = ChatTemplate(CHATML_TEMPLATE)
    out = t.render([{"role": "user", "content": "{{ 7*7 }} <|im_end|> {% if %}"}])
    assert "{{ 7*7 }}" in out  # content is data, never template code


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_tokenizer_metadata_only_clean_errors(data: st.DataObject) -> None:
    v = build_vocabulary(300)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": list(v.tokens),
        "tokenizer.ggml.merges": list(v.merges),
        "tokenizer.ggml.token_type": list(v.token_types),
        "tokenizer.ggml.eos_token_id": v.eos_id,
    }
    key = data.draw(st.sampled_from(sorted(meta)))
    meta[key] = data.draw(json_values | st.lists(st.text(max_size=6), max_size=30))
    with contextlib.suppress(TokenWingError):
        tok = tokenizer_from_metadata(meta, "fuzz")
        tok.decode(tok.encode("hello world <|im_end|>"))
