"""Structured output (`response_format`): the official client against the real server on a random-weight model,
whose replies are valid because the grammar allows nothing else (llguidance's mask on every sampled token)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import Server
from tokenwing.runtime.generate import generate
from tokenwing.runtime.sampler import Sampler, SamplerSettings
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.text.grammar import Constraint, grammar_of

# bounded, so that a reply of random tokens still ends within max_tokens: strings have a maximum length, the
# array a maximum size
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(repacked_factory: ModelFactory) -> Iterator[Server]:
    s = Server(repacked_factory(type="Q8_0", n_layer=2), "--ram-budget", "50%")
    yield s
    s.stop()


def test_json_schema_replies_validate_100_of_100_at_temperature_1(repacked_factory: ModelFactory) -> None:
    """The engine's own loop (what the server runs for each request), 100 seeds at temperature 1: every reply
    parses and validates, and ends where the grammar does."""
    session = Session(str(repacked_factory(type="Q8_0", n_layer=2)), SessionOptions(n_ctx=512), log=lambda _: None)
    grammar = grammar_of(FORMAT)
    assert grammar is not None
    prompt = session.tokenizer.encode("Describe a person as JSON.", special=True)
    try:
        for seed in range(100):
            session.reset()
            sampler = Sampler(SamplerSettings(temperature=1.0, top_k=0, seed=seed))
            gen = generate(session, prompt, 120, sampler, constraint=Constraint(session.tokenizer, grammar.text))
            jsonschema.validate(json.loads(gen.text), SCHEMA)  # raises on an invalid reply
            assert gen.finish_detail in ("grammar", "eos"), (seed, gen.text)
    finally:
        session.close()


def test_the_official_client_gets_valid_json(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in range(3):
        r = c.chat.completions.create(
            model="x", messages=msgs, response_format=FORMAT, temperature=1.0, seed=seed, max_tokens=120
        )
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
        assert r.choices[0].finish_reason == "stop"


def test_streamed_and_json_object(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "JSON please."}]
    whole = c.chat.completions.create(model="x", messages=msgs, response_format=FORMAT, seed=7, max_tokens=120)  # type: ignore[arg-type]
    stream = c.chat.completions.create(
        model="x",
        messages=msgs,
        response_format=FORMAT,
        seed=7,
        max_tokens=120,
        stream=True,  # type: ignore[arg-type]
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    # json_object: any object; a random model has no reason to close it, so only its start is certain
    r = c.chat.completions.create(
        model="x", messages=msgs, response_format={"type": "json_object"}, seed=1, max_tokens=8
    )
    assert (r.choices[0].message.content or "").startswith("{")
    done = c.completions.create(model="x", prompt="x", extra_body={"response_format": FORMAT}, seed=3, max_tokens=120)
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}},
        {"type": "json_schema"},
        {"type": "regex"},
        "json",
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(server: Server, fmt: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model="x", messages=[{"role": "user", "content": "x"}], response_format=fmt, max_tokens=4
        )
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"  # type: ignore[index]
