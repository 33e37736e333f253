"""JSON schemas followed as far as they can be (issue 48 item 4): without `strict: true` a keyword the grammar
cannot enforce is dropped and named (`GenerationRequest.unenforced`: the body's `tokenwing.unenforced`, the
X-TokenWing-Unenforced header); with it the request gets the 400 it always got. In process for each kind of
keyword llguidance drops (text/grammar.py reads its warnings: a new wording fails here), then through the
official client against the real server, and over JSONSchemaBench's sample (tests/data/jsonschemabench/; the
whole sample's replies: bench/jsonschemabench.py, docs/results.md)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.conftest import ModelFactory
from tests.engine.schema_sample import outcome, relaxed, sample
from tests.engine.test_server import Server
from tests.engine.test_server_parallel import _together
from tests.engine.test_tool_choice import FORMATS, USER, _sample, _source
from tests.llama_source import chat_templates
from tests.pauses import Pauses
from tokenwing.errors import BadInputError
from tokenwing.format.reader import ModelFile
from tokenwing.server.jobs import unenforced_headers
from tokenwing.server.protocol import GenerationRequest
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.grammar import Constraint, grammar_of, schema_grammar
from tokenwing.text.tokenizer import TextTokenizer, tokenizer_from_metadata
from tokenwing.text.tools.base import Tools
from tokenwing.text.tools.reply import call_grammar, prepare, syntax

S4: dict[str, Any] = {"type": "string", "maxLength": 4}
PAIR: dict[str, Any] = {"a": S4, "b": {"type": "integer", "minimum": 0, "maximum": 9}}

# each kind of keyword llguidance does not enforce: (schema, what a lenient grammar names, what the strict 400 says)
DROPPED: dict[str, tuple[dict[str, Any], list[str], str]] = {
    "dependencies": (
        {"type": "object", "properties": PAIR, "dependencies": {"a": {"required": ["b"]}}},  # (a schema's)
        ["dependencies"],
        '"dependencies"',
    ),
    "not": ({"type": "object", "properties": {"a": {**S4, "not": {"const": "x"}}}}, ["not"], '"not"'),
    "uniqueItems": (
        {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3, "uniqueItems": True},
        ["uniqueItems"],
        '"uniqueItems"',
    ),
    "format host-name": ({**S4, "format": "host-name"}, ["format:host-name"], "Unknown format: host-name"),
    "format byte": ({**S4, "format": "byte"}, ["format:byte"], "Unknown format: byte"),
    "minProperties, keys optional": (
        {"type": "object", "properties": PAIR, "minProperties": 1},
        ["minProperties"],
        "min/maxProperties",
    ),
    "maxProperties, keys optional": (
        {"type": "object", "properties": PAIR, "maxProperties": 1},
        ["maxProperties"],
        "min/maxProperties",
    ),
    "pattern with look-ahead": ({**S4, "pattern": "^(?=a)[a-z]+$"}, ["pattern"], "look-around"),
    "if/then/else": (
        {"type": "object", "properties": PAIR, "if": {"required": ["a"]}, "then": {"required": ["b"]}, "else": {}},
        ["else", "if", "then"],
        '"if"',
    ),
    "oneOf that may overlap": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["oneOf"], "oneOf"),
}
ENFORCED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "a": {**S4, "pattern": "^[a-z]+$"},
        "n": {"type": "integer"},
        "d": {"type": "string", "format": "date"},
    },
    "required": ["a", "n", "d"],
    "additionalProperties": False,
}
# several at once, bounded so that a random reply ends: what is kept is enforced beside what is dropped
MIXED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "host": {**S4, "format": "host-name"},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3, "uniqueItems": True},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["host", "tags", "n"],
    "additionalProperties": False,
    "dependencies": {"host": {"required": ["n"]}},  # (a schema dependency: not enforced)
}


def fmt(schema: dict[str, Any], strict: bool | None = None) -> Any:
    spec: dict[str, Any] = {"name": "x", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


@pytest.mark.parametrize("case", list(DROPPED))
def test_a_keyword_not_enforced_is_dropped_and_named_and_strict_refuses_it(case: str) -> None:
    schema, named, said = DROPPED[case]
    for lenient in (fmt(schema), fmt(schema, strict=False)):
        g = grammar_of(lenient)
        assert g is not None and sorted(g.unenforced) == named
    with pytest.raises(BadInputError) as e:
        grammar_of(fmt(schema, strict=True))
    assert said in str(e.value)


# property dependencies, which llguidance does not implement, written as conditions it does (text/grammar.py)
DEPENDENT: dict[str, Any] = {
    "type": "object",
    "properties": {**PAIR, "c": {"type": "boolean"}},
    "additionalProperties": False,
    "dependencies": {"a": ["b"]},
    "dependentRequired": {"c": ["a"]},
}


def test_property_dependencies_are_enforced(tokenizer: TextTokenizer) -> None:
    """In either mode nothing is dropped, and 40 random replies all keep them (and take more than one shape)."""
    assert grammar_of(fmt(DEPENDENT, strict=True)) is not None
    g = schema_grammar(DEPENDENT)
    shapes = set()
    for seed in range(40):
        value = json.loads(tokenizer.decode(_sample(tokenizer, g.text, seed)))
        jsonschema.Draft7Validator(DEPENDENT).validate(value)  # dependencies (draft 7's)
        jsonschema.Draft201909Validator(DEPENDENT).validate(value)  # dependentRequired (2019-09's)
        shapes.add(tuple(sorted(value)))
    assert len(shapes) >= 3, shapes
    assert g.unenforced == []


def test_an_enforced_schema_names_nothing_in_either_mode() -> None:
    for strict in (None, False, True):
        g = grammar_of(fmt(ENFORCED, strict))
        assert g is not None and g.unenforced == []
    g = grammar_of({"type": "json_object"})
    assert g is not None and g.unenforced == []
    with pytest.raises(BadInputError, match="strict' must be a boolean"):
        grammar_of({"type": "json_schema", "json_schema": {"schema": ENFORCED, "strict": "yes"}})


def test_the_header_is_one_safe_line() -> None:
    """A format's name comes from the client: no comma or control character of it reaches the header."""
    assert unenforced_headers(GenerationRequest()) == {}
    req = GenerationRequest(unenforced=["not", "format:a,b\r\nX-Evil: 1"])
    assert unenforced_headers(req) == {"X-TokenWing-Unenforced": "not,format:a?b??X-Evil: 1"}


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Any:
    return repacked_factory(type="Q8_0", n_layer=2)


@pytest.fixture(scope="module")
def tokenizer(model: Any) -> TextTokenizer:
    with ModelFile.open(str(model)) as mf:
        return tokenizer_from_metadata({k: v.value for k, v in mf.header.kv.items()}, str(model))


def test_random_replies_keep_every_kept_keyword(tokenizer: TextTokenizer) -> None:
    """30 replies of random tokens at temperature 1 under a lenient grammar that drops three keywords: each is
    JSON that validates against the schema less those (the kept ones: bounds, enums, required, no others)."""
    g = schema_grammar(MIXED)
    assert sorted(g.unenforced) == ["dependencies", "format:host-name", "uniqueItems"]
    kept = relaxed(MIXED, g.unenforced)
    assert "uniqueItems" not in json.dumps(kept) and kept["properties"]["tags"]["maxItems"] == 3
    for seed in range(30):
        value = json.loads(tokenizer.decode(_sample(tokenizer, g.text, seed)))
        jsonschema.validate(value, kept)


def test_the_sample_is_accepted_without_strict_and_refused_with_it() -> None:
    """JSONSchemaBench's sample (300): at least 95 % compile without strict; with strict exactly those that dropped
    nothing (of those that compile at all) do, and each of the others gets the 400."""
    accepted = dropped = 0
    schemas = list(sample())
    for source, schema in schemas:
        try:
            g = schema_grammar(schema)
        except BadInputError:
            continue
        accepted += 1
        try:
            schema_grammar(schema, strict=True)
            assert g.unenforced == [], source
        except BadInputError:
            assert g.unenforced, source
            dropped += 1
    # (297 and 49 of 300 as of llguidance 1.9: fewer dropped would mean lenient mode no longer reached them)
    assert accepted >= 0.95 * len(schemas) and dropped >= len(schemas) // 10, (accepted, dropped)


TOOL: dict[str, Any] = {"type": "function", "function": {"name": "put", "description": "Store it", "parameters": MIXED}}


@pytest.mark.parametrize("template", [*FORMATS, "openai-gpt-oss-120b.jinja"])
def test_every_call_format_names_what_its_grammar_drops(template: str, tokenizer: TextTokenizer) -> None:
    """A forced call's grammar in each family's format: the same three keywords named, whether the arguments are
    one JSON value (llguidance's lenient warnings) or one element per property (the object's `dependencies`, a
    raw-text string's format, are not written by the elements: named by the format's grammar itself)."""
    source = chat_templates()[template] if template.startswith("openai-gpt-oss") else _source(template)
    syn = syntax(source)
    prompt = ChatTemplate(source).render(prepare(syn, USER, [TOOL]), tools=[TOOL])
    g = call_grammar(syn, tokenizer, prompt, Tools([TOOL]), ["put"], True)
    assert sorted(g.unenforced) == ["dependencies", "format:host-name", "uniqueItems"]


# ------------------------------------------------------------------------------------ the official client
@pytest.fixture(scope="module")
def server(model: Any) -> Iterator[Server]:
    s = Server(model, "--ctx", "2048", "--ram-budget", "50%")
    yield s
    s.stop()


MSGS: Any = [{"role": "user", "content": "JSON please."}]


def test_the_reply_names_what_was_not_enforced(server: Server) -> None:
    c = server.client()
    raw = c.chat.completions.with_raw_response.create(
        model="x", messages=MSGS, response_format=fmt(MIXED), temperature=1.0, seed=3, max_tokens=120
    )
    r = raw.parse()
    named = ["dependencies", "format:host-name", "uniqueItems"]
    assert sorted((r.model_extra or {})["tokenwing"]["unenforced"]) == named
    assert sorted(raw.headers["X-TokenWing-Unenforced"].split(",")) == named
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), relaxed(MIXED, named))
    # streamed: the header, and the last chunk's tokenwing
    with c.chat.completions.with_streaming_response.create(
        model="x", messages=MSGS, response_format=fmt(MIXED, False), seed=3, max_tokens=120, stream=True
    ) as s:
        assert sorted(s.headers["X-TokenWing-Unenforced"].split(",")) == named
        chunks = list(s.parse())
    assert sorted((chunks[-1].model_extra or {})["tokenwing"]["unenforced"]) == named
    # all of it enforced: no header, an empty list
    raw = c.chat.completions.with_raw_response.create(
        model="x", messages=MSGS, response_format=fmt(ENFORCED), seed=1, max_tokens=4
    )
    assert "X-TokenWing-Unenforced" not in raw.headers
    assert (raw.parse().model_extra or {})["tokenwing"]["unenforced"] == []


def test_strict_keeps_the_400(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model="x", messages=MSGS, response_format=fmt(MIXED, True), max_tokens=4
        )
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"  # type: ignore[index]
    assert "Unimplemented keys" in e.value.message or "Unknown format" in e.value.message


def test_a_forced_call_names_what_its_schema_does_not_enforce(server: Server) -> None:
    """tool_choice required: the calls' grammar drops what it cannot enforce of a function that is not strict,
    and says so; a strict function's gets the 400."""
    c = server.client()
    raw = c.chat.completions.with_raw_response.create(
        model="x", messages=MSGS, tools=[TOOL], tool_choice="required", seed=2, max_tokens=8
    )
    assert set(raw.headers["X-TokenWing-Unenforced"].split(",")) >= {"dependencies", "uniqueItems"}
    assert "uniqueItems" in (raw.parse().model_extra or {})["tokenwing"]["unenforced"]
    strict = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="x", messages=MSGS, tools=[strict], tool_choice="required", max_tokens=8)
    assert e.value.status_code == 400 and "tools" in e.value.message


def test_a_subset_of_jsonschemabench_through_the_server(server: Server) -> None:
    """The sample's first schema of each of its 10 sets: accepted, the header and the body agree, and no reply
    the ORIGINAL schema refuses (one cut by max_tokens is not JSON yet: nothing to validate)."""
    c = server.client()
    seen: set[str] = set()
    for source, schema in sample():
        group = source.split("/")[1]
        if group in seen:
            continue
        seen.add(group)
        raw = c.chat.completions.with_raw_response.create(
            model="x", messages=MSGS, response_format=fmt(schema), seed=len(seen), max_tokens=32
        )
        r = raw.parse()
        named = (r.model_extra or {})["tokenwing"]["unenforced"]
        assert raw.headers.get("X-TokenWing-Unenforced", "") == ",".join(named), source
        what = outcome(schema, r.choices[0].message.content or "", r.choices[0].finish_reason)
        assert not what.startswith("invalid"), (source, what)
    assert len(seen) == 10


# JSONSchemaBench's Github_easy/o21053 (the 300-schema run's one invalid reply): llguidance compiles it, then gives
# up as the reply opens the string (its lexer's regex for this pattern under maxLength 5000 grows past its limits)
TOO_COMPLEX: dict[str, Any] = next(s for p, s in sample() if p.endswith("/o21053.json"))


def test_a_grammar_that_gives_up_mid_reply_is_an_error_not_an_end(tokenizer: TextTokenizer) -> None:
    """The mask llguidance gives up on, as a reply is decoded (a mask, then its token), is an error: its mask then
    allowed only the end token, which ended the reply as a plain "stop" with '{"question":",' unfinished."""
    c = Constraint(tokenizer, schema_grammar(TOO_COMPLEX).text)
    with pytest.raises(BadInputError, match="cannot be enforced past this point") as e:
        for t in tokenizer.encode('{"question":"ab', special=False):
            assert c.allowed()[t]
            c.accept(t)
        c.allowed()
    assert "\n" not in str(e.value)
    c.close()


def test_a_grammar_that_gives_up_fails_its_reply_alone(model: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """Two requests decoded together: the one whose grammar llguidance gives up on gets a one-line 400 (not a 200
    whose JSON the schema refuses), the other its whole reply (a failure in one reply's grammar is not the pass's)."""
    pauses = Pauses(tmp_path / "pauses", "serve.admit")
    pauses.arm(monkeypatch)
    server = Server(model, "--parallel", "2", "--ctx", "2048", "--ram-budget", "30%")
    bodies: list[dict[str, Any]] = [
        {"response_format": fmt(TOO_COMPLEX), "max_tokens": 32},
        {"max_tokens": 24, "extra_body": {"ignore_eos": True}},
    ]
    got: list[Any] = [None, None]

    def one(i: int) -> None:
        try:
            got[i] = server.client().chat.completions.create(model="x", messages=MSGS, seed=1, **bodies[i])
        except openai.BadRequestError as e:
            got[i] = e

    try:
        _together(server, pauses, [threading.Thread(target=one, args=(i,)) for i in range(2)])
    finally:
        server.stop()
    assert isinstance(got[0], openai.BadRequestError), got[0]
    assert "cannot be enforced past this point" in got[0].message and "\n" not in got[0].message
    assert isinstance(got[1], ChatCompletion), got[1]
    assert got[1].choices[0].finish_reason == "length" and got[1].usage and got[1].usage.completion_tokens == 24
