"""Structured output: a response format (OpenAI's `json_object` / `json_schema`) enforced while sampling, token by
token, with llguidance (docs/api.md, "Structured output").

llguidance and not xgrammar: xgrammar 0.2.9 imports torch (and requires triton and transformers), gigabytes in
the installer for a mask; llguidance needs nothing but itself (3 MB) and fills a numpy bitmask. Its cost per token
is measured in bench/grammar_bench.py (docs/results.md).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import llguidance
import llguidance.numpy
import numpy as np

from tokenwing.errors import BadInputError
from tokenwing.text.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # (a TypedDict of its stub only)

MAX_SCHEMA = 256 << 10  # a schema's JSON text: more is not a response format but an attack on the compiler

_LL: weakref.WeakKeyDictionary[TextTokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer: every token's bytes (control tokens by name,
    marked special), the end tokens, and text to ids (without special tokens, as model output is parsed)."""

    def __init__(self, tok: TextTokenizer) -> None:
        self._tok = tok
        self.eos_token_id = min(tok.eos_ids) if tok.eos_ids else tok.vocab_size - 1
        self.bos_token_id = tok.bos_id
        self.tokens = [tok.piece_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(tok.special_ids)

    def __call__(self, text: bytes) -> list[int]:
        return self._tok.encode_exact(text.decode("utf-8", errors="replace"))


def ll_tokenizer(tok: TextTokenizer) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance sees it, built once per tokenizer: its token trie takes seconds for a 200k
    vocabulary (bench/grammar_bench.py), paid by the first request that asks for a response format."""
    with _LL_LOCK:
        ll = _LL.get(tok)
        if ll is None:
            ll = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_Vocabulary(tok)), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_ids)
            )
            _LL[tok] = ll
        return ll


class UnenforceableError(BadInputError):
    """llguidance gave up on a grammar mid-reply: that reply fails with it (the others in its pass go on)."""


class Grammar(NamedTuple):
    """A grammar llguidance accepted, and what of its JSON schemas it does not enforce: keyword names (`format:X`
    for an unknown format), in the order first met, empty when all of it is enforced."""

    text: str
    unenforced: list[str]


def json_options(strict: bool) -> JsonCompileOptions:
    """llguidance's options for a JSON schema. Whitespace as compact JSON writes it: a model may not pad a reply
    with spaces forever. Without `strict` the schema is followed as far as it can be (lenient: keywords llguidance
    does not implement, such as uniqueItems or an unknown format, are dropped and named in its warnings, and oneOf
    is enforced as anyOf), as OpenAI refuses such keywords only in strict mode; with it they are refused."""
    return {"whitespace_flexible": False} if strict else {"whitespace_flexible": False, "lenient": True}


def grammar_of(response_format: Any) -> Grammar | None:
    """The grammar an OpenAI `response_format` asks for (None: plain text); BadInputError names what is wrong.
    `json_schema.strict` true: a keyword the grammar cannot enforce is refused, else it is dropped and named."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise BadInputError("'response_format' must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _compile({"type": "object"}, strict=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadInputError("'response_format.json_schema' must be an object with a 'schema' object")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise BadInputError("'response_format.json_schema.strict' must be a boolean")
        return _compile(spec.get("schema", {}), strict=bool(strict))
    raise BadInputError("'response_format.type' must be 'text', 'json_object' or 'json_schema'")


def schema_grammar(schema: dict[str, Any], strict: bool = False) -> Grammar:
    """The grammar of one JSON value matching `schema` (a tool call's arguments, for example)."""
    return _compile(schema, strict)


def _compile(schema: dict[str, Any], strict: bool) -> Grammar:
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError):
        raise BadInputError("the JSON schema is not JSON") from None
    if len(text) > MAX_SCHEMA:
        raise BadInputError(f"the JSON schema is larger than {MAX_SCHEMA >> 10} KiB")
    if '"dependencies"' in text or '"dependentRequired"' in text:
        conditioned = dependencies_as_conditions(schema)
        if conditioned is not schema:
            try:
                return _compile_text(conditioned, json.dumps(conditioned), strict)
            except BadInputError:
                pass  # (llguidance refused the conditions: the keyword is dropped as any other, or strict's 400)
    return _compile_text(schema, text, strict)


def _compile_text(schema: dict[str, Any], text: str, strict: bool) -> Grammar:
    dropped: list[str] = []
    if not strict and '"pattern"' in text:
        schema, dropped = without_bad_patterns(schema)
        text = json.dumps(schema) if dropped else text
    options = json_options(strict)
    found = checked(
        lambda: llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options), "the JSON schema is not valid"
    )
    return Grammar(found.text, _union(dropped, found.unenforced))


def checked(make: Callable[[], str], what: str) -> Grammar:
    """A grammar `make` builds, validated by llguidance: BadInputError ("WHAT: why") where it cannot be used; its
    warnings name the schema keywords a lenient %json / JSON schema left unenforced."""
    try:
        grammar = make()
    except ValueError as e:
        raise BadInputError(f"{what}: {e}") from None
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise BadInputError(f"{what}: {messages[0] if messages else 'unknown error'}")
    return Grammar(grammar, _union(*(_dropped(m, grammar) for m in messages)))


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
_FORMAT = re.compile(r"Unknown format: (.*?)(?: \(\d+ times\))?$")


def _dropped(message: str, grammar: str) -> list[str]:
    """The keywords one of llguidance's warnings says it dropped (its wording, as of 1.9: tests/engine/
    test_schema_lenient.py holds each case, so that a new wording fails there rather than reads as nothing)."""
    m = _UNIMPLEMENTED.match(message)
    if m:
        try:
            return [str(k) for k in json.loads(m.group(1))]
        except ValueError:
            pass
    m = _FORMAT.match(message)
    if m:
        return [f"format:{m.group(1)}"]
    if message.startswith("min/maxProperties"):  # (it does not say which: those the schema has)
        return [k for k in ("minProperties", "maxProperties") if f'"{k}"' in grammar] or ["minProperties"]
    if message.startswith("oneOf not fully supported"):
        return ["oneOf"]  # enforced as anyOf: a value may match more than one of them
    return [re.sub(r" \(\d+ times\)$", "", message.splitlines()[0])[:200]]  # said as it is


def _union(*lists: list[str]) -> list[str]:
    return list(dict.fromkeys(k for lst in lists for k in lst))


# Where a JSON schema holds schemas (a `pattern` elsewhere, in an enum's or a default's value, is data)
_ONE_SCHEMA: tuple[str, ...] = ("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else")
_ONE_SCHEMA += ("propertyNames", "unevaluatedItems", "unevaluatedProperties", "items")
_SCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def rewritten(schema: dict[str, Any], change: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """`schema` with `change` applied to it and every schema inside it (a copy, bottom up)."""
    out = dict(schema)
    for k in _ONE_SCHEMA:
        if isinstance(out.get(k), dict):
            out[k] = rewritten(out[k], change)
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [rewritten(s, change) if isinstance(s, dict) else s for s in out[k]]
    for k in (*_SCHEMA_MAPS, "dependencies"):
        if isinstance(out.get(k), dict):
            out[k] = {n: rewritten(s, change) if isinstance(s, dict) else s for n, s in out[k].items()}
    return change(out)


@functools.lru_cache(maxsize=1024)
def _regex_ok(pattern: str) -> bool:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "string", "pattern": pattern}))
    except ValueError:
        return False
    return not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]


def dependencies_as_conditions(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with each property dependency (`dependencies` / `dependentRequired`: {"a": ["b"]}, b is required
    where a is there) written as what llguidance enforces: allOf [anyOf [a absent, a and b required]]; `schema`
    itself where it has none. (llguidance does not implement `dependencies`; a reply that broke one was the one
    invalid reply of JSONSchemaBench's sample.) A schema dependency ({"a": {schema}}) stays as it is."""
    changed = False

    def change(s: dict[str, Any]) -> dict[str, Any]:
        nonlocal changed
        conds: list[dict[str, Any]] = []
        out = s
        for key in ("dependencies", "dependentRequired"):
            deps = s.get(key)
            if not isinstance(deps, dict):
                continue
            names = {k: v for k, v in deps.items() if isinstance(v, list) and all(isinstance(n, str) for n in v)}
            if not names:
                continue
            out = {k: v for k, v in out.items() if k != key}
            if len(names) < len(deps):
                out[key] = {k: v for k, v in deps.items() if k not in names}
            conds += [{"anyOf": [{"properties": {k: False}}, {"required": [k, *v]}]} for k, v in names.items() if v]
        if out is s:
            return s
        changed = True
        if conds:
            before = out.get("allOf")
            out["allOf"] = [*(before if isinstance(before, list) else []), *conds]
        return out

    out = rewritten(schema, change)
    return out if changed else schema


def without_bad_patterns(schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`schema` less the `pattern`s llguidance's regex syntax cannot take (look-around, backreferences, \\< ...),
    and ["pattern"]; (the schema, []) where every pattern parses. Such a pattern is a keyword the grammar cannot
    enforce (lenient mode still refuses it): dropped where the request is not strict."""
    bad = False

    def change(s: dict[str, Any]) -> dict[str, Any]:
        nonlocal bad
        p = s.get("pattern")
        if isinstance(p, str) and not _regex_ok(p):
            bad = True
            return {k: v for k, v in s.items() if k != "pattern"}
        return s

    out = rewritten(schema, change)
    return (out, ["pattern"]) if bad else (schema, [])


class Constraint:
    """One reply under a grammar: which tokens may come next, and the tokens that came.

    The next mask is computed on a thread of its own as soon as a token is accepted (`prepare`), while the
    engine computes that token's forward pass: llguidance releases the GIL, so the mask's cost (up to ~10 ms a
    token on a 200k vocabulary, inside a free-form string) hides behind the model's."""

    def __init__(self, tok: TextTokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(ll_tokenizer(tok), grammar, log_level=0)
        if self._matcher.is_error():
            raise BadInputError(f"the response format cannot be enforced: {self._matcher.get_error()}")
        self._n = tok.vocab_size
        self._bits = llguidance.numpy.allocate_token_bitmask(1, self._n)
        self._pool: ThreadPoolExecutor | None = None
        self._next: Future[np.ndarray] | None = None

    def _mask(self) -> np.ndarray:
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bits)
        self._check()  # (where llguidance gives up: computing the mask inside a string)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[: self._n].astype(bool)

    def prepare(self) -> None:
        """Start computing the next mask (after `accept`, before the forward pass)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._next = self._pool.submit(self._mask)

    def allowed(self) -> np.ndarray:
        """A boolean mask over the vocabulary: the tokens the grammar allows next (an end token where it may end)."""
        if self._next is not None:
            mask, self._next = self._next.result(), None
            return mask
        return self._mask()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the grammar forbids at -inf."""
        out = np.array(logits, dtype=np.float32).reshape(-1)
        out[~self.allowed()] = -np.inf
        return out

    def accept(self, token: int) -> None:
        if self._next is not None:  # a mask nobody asked for: let it finish before the matcher moves on
            self._next.result()
            self._next = None
        if not self._matcher.consume_token(token):
            raise BadInputError(f"the response format refused token {token}: {self._matcher.get_error()}")
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            # llguidance gave up mid-reply (its lexer's regex for a string grew past its limits as the string
            # opened, as a `pattern` with {0,99} under a maxLength of 5000 does): its mask then allows only the end
            # token, and the reply ended as a plain "stop" with its JSON unfinished. It fails here instead.
            why = self._matcher.get_error().splitlines()[0]
            raise UnenforceableError(f"the response format cannot be enforced past this point of the reply: {why}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing more may follow (only an end token)."""
        return bool(self._matcher.is_stopped())
