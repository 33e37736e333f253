"""Untrusted inputs the engine parses — HTTP request bodies, chat templates, tokenizer metadata — fuzzed:
only clean errors, never a traceback."""

from __future__ import annotations

from collections import Counter
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
FIELDS = [
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
keys = st.sampled_from(FIELDS)
# Values each field may take, so that many requests are valid; and anything at all, so that many are not.
VALID_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 4096),
    "max_completion_tokens": st.integers(1, 4096),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 1000),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=16),
    "stream": st.booleans(),
    "seed": st.integers(-(1 << 63), (1 << 63) - 1),
    "n": st.just(1),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
}
valid_fields = st.fixed_dictionaries({}, optional=VALID_VALUES)
chat_bodies = valid_fields.map(lambda extra: {"messages": [{"role": "user", "content": "hi"}], **extra})
completion_bodies = valid_fields.map(lambda extra: {"prompt": "hi", **extra})
broken = st.tuples(chat_bodies | completion_bodies, keys, json_values).map(lambda t: {**t[0], t[1]: t[2]})
bodies = st.one_of(
    chat_bodies.map(lambda b: ("chat", b)),
    completion_bodies.map(lambda b: ("completion", b)),
    (broken | st.dictionaries(keys, json_values, max_size=8) | json_values).map(lambda b: ("any", b)),
)
FUZZ = settings(deadline=None, derandomize=True, database=None)  # the same inputs on every machine and run


def one_line(e: Exception) -> None:
    assert str(e).strip() and "\n" not in str(e) and "Traceback" not in str(e)


def test_request_parsing_only_clean_errors() -> None:
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=400)
    @given(kind_body=bodies)
    def check(kind_body: tuple[str, Any]) -> None:
        kind, body = kind_body
        for name, parse in (("chat", parse_chat), ("completion", parse_completion)):
            try:
                req = parse(body)
            except RequestError as e:
                one_line(e)
                assert e.status == 400 and (e.param is None or e.param in FIELDS), (e.param, body)  # names a field
                assert kind != name, body  # a valid request of this kind is never refused
                outcomes[f"{name} refused"] += 1
            else:
                assert req.max_tokens >= 1 and 0 <= req.sampler.temperature <= 2
                assert bool(req.messages) == (name == "chat")
                if kind == name:  # what was asked is what will be done
                    if name == "chat":  # max_completion_tokens is chat's newer name; completions have none
                        assert req.max_tokens == body.get("max_completion_tokens", body.get("max_tokens", 256)), body
                    else:
                        assert req.max_tokens == body.get("max_tokens", 16), body
                    assert req.sampler.temperature == body.get("temperature", 1.0) and req.stream == body.get(
                        "stream", False
                    )
                outcomes[f"{name} accepted"] += 1

    check()
    # both ways out were taken, often: a fuzz that only ever reaches the first check tests nothing else
    assert min(outcomes[f"{n} {w}"] for n in ("chat", "completion") for w in ("accepted", "refused")) >= 40, outcomes


TEMPLATE_PIECES = [
    "{{ messages[0].content }}",
    "{% for m in messages %}",
    "{% endfor %}",
    "{{ m.role }}",
    "{% if add_generation_prompt %}",
    "{% endif %}",
    "{{ bos_token }}",
    "<|im_start|>",
    "{{",
    "}}",
    "{%",
    "%}",
    "{#",
    "#}",
    "|upper",
    "(",
    ")",
    "'",
    "x",
    "\n",
]


def test_chat_templates_only_clean_errors() -> None:
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=300)
    @given(template=st.lists(st.sampled_from(TEMPLATE_PIECES), max_size=12).map("".join))
    def check(template: str) -> None:
        try:
            out = ChatTemplate(template).render([{"role": "user", "content": "hi"}])
        except BadInputError as e:
            one_line(e)
            outcomes["refused"] += 1
        else:
            assert isinstance(out, str)
            outcomes["rendered"] += 1
            outcomes["rendered the message"] += "hi" in out  # through template code, not literal text

    check()
    assert outcomes["refused"] >= 30 and outcomes["rendered"] >= 30 and outcomes["rendered the message"] >= 5, outcomes


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


def test_tokenizer_metadata_only_clean_errors() -> None:
    v = build_vocabulary(300)
    base: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": list(v.tokens),
        "tokenizer.ggml.merges": list(v.merges),
        "tokenizer.ggml.token_type": list(v.token_types),
        "tokenizer.ggml.eos_token_id": v.eos_id,
    }
    outcomes: Counter[str] = Counter()
    text = "hello world, ünïcode 123"

    def plausible_for(key: str) -> st.SearchStrategy[Any]:
        """A change of the kind a real file could carry: the field shortened, reordered, or another valid value."""
        value = base[key]
        if isinstance(value, list):
            return st.integers(0, len(value)).map(lambda n: value[:n]) | st.permutations(value[:40]).map(
                lambda head: head + value[40:]
            )
        return st.sampled_from(
            {"tokenizer.ggml.model": ["gpt2", "llama"], "tokenizer.ggml.pre": ["qwen2", "default"]}.get(
                key, [0, v.eos_id, len(v.tokens) - 1]
            )
        )

    @settings(FUZZ, max_examples=150)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        meta = dict(base)
        key = data.draw(st.sampled_from(sorted(meta)))
        meta[key] = data.draw(plausible_for(key) | json_values | st.lists(st.text(max_size=6), max_size=30))
        try:
            tok = tokenizer_from_metadata(meta, "fuzz")
        except TokenWingError as e:
            one_line(e)
            outcomes["refused"] += 1
        else:
            assert tok.decode(tok.encode(text)) == text  # what is accepted works: byte-level BPE loses nothing
            outcomes["accepted"] += 1
            outcomes[f"accepted a changed {key}"] += meta[key] != base[key]

    check()
    assert outcomes["refused"] >= 30 and outcomes["accepted"] >= 15, outcomes
    assert sum(n for k, n in outcomes.items() if k.startswith("accepted a changed")) >= 10, outcomes


def test_a_token_that_is_not_utf8_is_refused() -> None:
    """Found by the header fuzzer (issue 41): a flipped byte in a token made a lone surrogate, which the BPE
    library refused with a TypeError (a traceback from `verify`)."""
    import pytest

    v = build_vocabulary(300)
    tokens = list(v.tokens)
    tokens[7] = "\udc89" + tokens[7]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": list(v.merges),
        "tokenizer.ggml.token_type": list(v.token_types),
    }
    with pytest.raises(BadInputError, match="hold bytes that are not UTF-8 text"):
        tokenizer_from_metadata(meta, "m.gguf")
