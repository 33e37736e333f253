"""Kimi's two call formats.

K2 (`KimiK2`): `<|tool_calls_section_begin|>` around
`<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`; `functions.NAME:N`
is the call's id (Kimi's templates write it back when the result returns).

K3 (`KimiK3`): XTML tags, `<|open|>TAG attrs<|sep|>` … `<|close|>TAG<|sep|>`: a reply is a think section, a
response section and then a tools section of `<|open|>call tool="NAME" index="N"<|sep|>` elements, each with an
`<|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>` per argument (or one
`<|open|>json …<|sep|>{JSON}<|close|>json<|sep|>`). The response and message tags are structure, neither calls
nor content (`drops`); the think section is split off as reasoning before this (text/reasoning.py)."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping
from typing import Any

from tokenwing.text.tools.base import (
    BlockFormat,
    PartialCall,
    RawCall,
    Tools,
    after,
    args_prefix,
    json_call,
    json_value,
    matches_only,
    text_tail,
    typed_value,
    whole_calls,
)
from tokenwing.text.tools.constrain import CallGrammar

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_K2_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*([^\s<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S
)
_K2_ID = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")
_K2_HEAD = re.compile(r"<\|tool_call_begin\|>\s*([^\s<]+?)\s*<\|tool_call_argument_begin\|>")


class KimiK2(BlockFormat):
    name = "kimi-k2"
    begins = (SECTION_BEGIN,)
    ends = (SECTION_END,)

    def end(self, block: str) -> int | None:
        return after(block, SECTION_END, len(SECTION_BEGIN))

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        body = block[len(SECTION_BEGIN) :].removesuffix(SECTION_END)
        found = matches_only(_K2_CALL, body)
        if not found:
            return None
        return [RawCall(_k2_name(m.group(1)), m.group(2), id=m.group(1)) for m in found]

    def partial(self, block: str, tools: Tools) -> list[PartialCall]:
        # each whole call, then the one being written: its id (so its name) whole at <|tool_call_argument_begin|>,
        # which the grammar writes right after the index's digits; its arguments the JSON text after that
        body = block[len(SECTION_BEGIN) :]

        def read(whole: re.Match[str]) -> PartialCall | None:
            value = json_value(whole.group(2).strip() or "{}")
            if not isinstance(value, dict):
                return None
            return PartialCall(_k2_name(whole.group(1)), json.dumps(value, ensure_ascii=False), whole.group(1))

        out, i = whole_calls(body, _K2_CALL, read)
        if i is None:
            return out
        head = _K2_HEAD.match(body, i)
        if head is None:
            return out
        return [*out, json_call(_k2_name(head.group(1)), body, head.end(), head.group(1))]

    def grammar(self, g: CallGrammar) -> str:
        call = g.calls(
            lambda name: " ".join(
                [
                    g.lit(f"<|tool_call_begin|>functions.{name}:"),
                    g.number(),  # the call's index in the conversation, part of its id
                    g.lit("<|tool_call_argument_begin|>"),
                    g.json(g.schema(name)),
                    g.lit("<|tool_call_end|>"),
                ]
            )
        )
        return f"{g.lit(SECTION_BEGIN)} {call} {g.lit(SECTION_END)}"


def _k2_name(call_id: str) -> str:
    """The function a K2 call id (functions.NAME:N) names."""
    name = _K2_ID.fullmatch(call_id)
    assert name is not None  # the pattern matches any non-empty text
    return name.group(1)


OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
TOOLS_BEGIN, TOOLS_END = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
THINK_BEGIN, THINK_END = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
_Q = re.escape
_K3_CALL = re.compile(_Q(OPEN) + r'call tool="([^"]*)"[^<]*?' + _Q(SEP) + "(.*?)" + _Q(CLOSE + "call" + SEP), re.S)
_K3_ARG = re.compile(
    _Q(OPEN) + r'argument key="([^"]*)"(?: type="([^"]*)")?' + _Q(SEP) + "(.*?)" + _Q(CLOSE + "argument" + SEP),
    re.S,
)
_K3_JSON = re.compile(_Q(OPEN) + r"json[^<]*?" + _Q(SEP) + "(.*?)" + _Q(CLOSE + "json" + SEP), re.S)
_K3_HEAD = re.compile(_Q(OPEN) + r'call tool="([^"]*)"[^<]*?' + _Q(SEP))
_K3_JSON_HEAD = re.compile(_Q(OPEN) + r"json[^<]*?" + _Q(SEP))
_K3_ARG_HEAD = re.compile(_Q(OPEN) + r'argument key="([^"]*)"(?: type="([^"]*)")?' + _Q(SEP))


def _k3_args(call: RawCall) -> str | None:
    """A whole K3 call's arguments as JSON text (None: not an object, so no call)."""
    value = json_value(call.arguments.strip() or "{}") if isinstance(call.arguments, str) else call.arguments
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class KimiK3(BlockFormat):
    name = "kimi-k3"
    begins = (TOOLS_BEGIN,)
    ends = (TOOLS_END,)
    drops = (
        f'{OPEN}message role="assistant"{SEP}',
        f"{OPEN}response{SEP}",
        f"{CLOSE}response{SEP}",
        f"{CLOSE}message{SEP}",
        "<|end_of_msg|>",
    )

    after_think = ""

    def end(self, block: str) -> int | None:
        return after(block, TOOLS_END, len(TOOLS_BEGIN))

    def grammar(self, g: CallGrammar) -> str:
        def param(key: str, schema: Mapping[str, Any], text: bool) -> str:
            t = schema.get("type")
            kind = "string" if text else t if isinstance(t, str) else None  # none: the reader asks the schema
            head = g.lit(f'{OPEN}argument key="{html.escape(key)}"' + (f' type="{kind}"' if kind else "") + SEP)
            close = f"{CLOSE}argument{SEP}"
            if text:
                return f"{head} {g.text(schema, close, edges=False, tags=(CLOSE + 'call' + SEP, TOOLS_END))}"
            return f"{head} {g.json(schema)} {g.lit(close)}"

        call = g.calls(
            lambda name: " ".join(
                [
                    g.lit(f'{OPEN}call tool="{html.escape(name)}" index="'),
                    g.number(),
                    g.lit(f'"{SEP}'),
                    g.params(name, param),
                    g.lit(f"{CLOSE}call{SEP}"),
                ]
            )
        )
        # an empty response section, as the template writes a turn of calls, then the tools section
        return f"{g.lit(f'{OPEN}response{SEP}{CLOSE}response{SEP}{TOOLS_BEGIN}')} {call} {g.lit(TOOLS_END)}"

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        body = block[len(TOOLS_BEGIN) :].removesuffix(TOOLS_END)
        found = matches_only(_K3_CALL, body)
        if not found:
            return None
        calls = []
        for m in found:
            name, inner = html.unescape(m.group(1)), m.group(2)
            whole = _K3_JSON.fullmatch(inner.strip())
            if whole:
                calls.append(RawCall(name, whole.group(1)))
                continue
            found_args = matches_only(_K3_ARG, inner)
            if found_args is None:
                return None
            calls.append(RawCall(name, dict(_k3_arg(name, a, tools) for a in found_args)))
        return calls

    def partial(self, block: str, tools: Tools) -> list[PartialCall]:
        # each whole call element, then the one being written: its name once its head is whole, its arguments as
        # far as its argument elements are closed (or, in the one-JSON form, its JSON's members are fixed)
        body = block[len(TOOLS_BEGIN) :]

        def read(whole: re.Match[str]) -> PartialCall | None:
            (call,) = self.parse(TOOLS_BEGIN + whole.group(0), tools, True) or [RawCall("", None)]
            text = _k3_args(call)
            return None if text is None else PartialCall(call.name, text)

        out, i = whole_calls(body, _K3_CALL, read)
        if i is None:
            return out
        head = _K3_HEAD.match(body, i)
        if head is None:
            return out
        name, j = html.unescape(head.group(1)), len(body) - len(body[head.end() :].lstrip())
        if (one := _K3_JSON_HEAD.match(body, j)) is not None:
            # (its "{" went out with the head, before the json element was whole: it stays sent)
            call = json_call(name, body, one.end())
            return [*out, call._replace(args=call.args or "{")]
        pairs = []
        while (a := _K3_ARG.match(body, j)) is not None:
            pairs.append(_k3_arg(name, a, tools))
            j = len(body) - len(body[a.end() :].lstrip())
        tail = ""
        if (a := _K3_ARG_HEAD.match(body, j)) is not None:
            key, kind = html.unescape(a.group(1)), a.group(2)
            types = frozenset({kind}) if kind else tools.types(name, key)
            tail = text_tail(key, body[a.end() :], f"{CLOSE}argument{SEP}", types)
        return [*out, PartialCall(name, args_prefix(pairs, closed=False), tail=tail)]


def _k3_arg(name: str, a: re.Match[str], tools: Tools) -> tuple[str, Any]:
    """An argument element's key and value, typed by the type it names (else by the function's schema)."""
    key, kind = html.unescape(a.group(1)), a.group(2)
    return key, typed_value(a.group(3), frozenset({kind}) if kind else tools.types(name, key))
