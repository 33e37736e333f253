"""MiniMax M2: a `<minimax:tool_call>…</minimax:tool_call>` block of one or more
`<invoke name="NAME"><parameter name="KEY">VALUE</parameter>…</invoke>`; a value is text for a string parameter,
JSON for any other.

MiniMax M3: a `NS<tool_call>` … `NS</tool_call>` block (NS: `]<]minimax[>[`) of one or more
`NS<invoke name="NAME">NS<KEY>VALUE NS</KEY>… NS</invoke>`, where a value is text (a number or a boolean as JSON
writes it) or nested elements: an object's keys, an array's `NS<item>`s."""

from __future__ import annotations

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
    matches_only,
    schema_types,
    text_tail,
    typed_value,
    whole_calls,
)
from tokenwing.text.tools.constrain import CallGrammar

BEGIN, END = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = re.compile(r'<invoke name="([^"]*)">(.*?)</invoke>', re.S)
_PARAMETER = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.S)
_INVOKE_HEAD = re.compile(r'<invoke name="([^"]*)">')
_PARAMETER_HEAD = re.compile(r'<parameter name="([^"]*)">')


class MiniMax(BlockFormat):
    name = "minimax-m2"
    begins = (BEGIN,)
    ends = (END,)

    def end(self, block: str) -> int | None:
        return after(block, END, len(BEGIN))

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        body = block[len(BEGIN) :].removesuffix(END)
        return invokes(body, _INVOKE, _PARAMETER, tools)

    def partial(self, block: str, tools: Tools) -> list[PartialCall]:
        return partial_invokes(
            block[len(BEGIN) :], _INVOKE, _INVOKE_HEAD, _PARAMETER, tools, (_PARAMETER_HEAD, "</parameter>")
        )

    def grammar(self, g: CallGrammar) -> str:
        def param(key: str, schema: Mapping[str, Any], text: bool) -> str:
            return element_param(g, f'<parameter name="{key}">', "</parameter>", schema, text, ("</invoke>", END))

        invoke = g.calls(
            lambda name: " ".join([g.lit(f'<invoke name="{name}">\n'), g.params(name, param), g.lit("</invoke>\n")])
        )
        return f"{g.lit(BEGIN + chr(10))} {invoke} {g.lit(END)}"


def element_param(
    g: CallGrammar, head: str, close: str, schema: Mapping[str, Any], text: bool, tags: tuple[str, ...]
) -> str:
    """One parameter element of the invoke formats (MiniMax's XML, DeepSeek's DSML) and the newline after it:
    a string parameter's raw text, anything else as JSON."""
    if text:
        return " ".join([g.lit(head), g.text(schema, close, edges=False, tags=tags), g.lit("\n")])
    return " ".join([g.lit(head), g.json(schema), g.lit(close + "\n")])


def invokes(body: str, invoke: re.Pattern[str], parameter: re.Pattern[str], tools: Tools) -> list[RawCall] | None:
    """Calls written as invoke elements holding parameter elements (MiniMax's XML, DeepSeek's DSML): the
    parameter pattern's groups are the key, then optionally whether the value is a string ("true"/"false"),
    then the value."""
    found = matches_only(invoke, body)
    if not found:
        return None
    calls = []
    for m in found:
        name, inner = m.group(1), m.group(2)
        params = matches_only(parameter, inner)
        if params is None:
            return None
        calls.append(RawCall(name, dict(_param(name, p, tools) for p in params)))
    return calls


def _param(name: str, p: re.Match[str], tools: Tools) -> tuple[str, Any]:
    """A parameter element's key and typed value (the invoke formats')."""
    key, *flag, value = p.groups()
    return key, typed_value(value, _types(name, key, flag, tools))


def _types(name: str, key: str, flag: list[str | None], tools: Tools) -> frozenset[str] | None:
    """A parameter's types: as the element says (DSML's string="true|false"), else by the function's schema."""
    if flag and flag[0] is not None:  # the format says itself whether the value is a string
        return frozenset({"string"}) if flag[0] == "true" else frozenset({"object"})
    return tools.types(name, key)


def _whole_call(calls: list[RawCall] | None) -> PartialCall | None:
    """A whole invoke element's call as it goes out (None: it reads as no call)."""
    (call,) = calls or [RawCall("", None)]
    a = call.arguments
    return PartialCall(call.name, args_prefix(list(a.items()), closed=True)) if isinstance(a, dict) else None


def partial_invokes(
    body: str,
    invoke: re.Pattern[str],
    head: re.Pattern[str],
    parameter: re.Pattern[str],
    tools: Tools,
    param_head: tuple[re.Pattern[str], str],
) -> list[PartialCall]:
    """`BlockFormat.partial` of the invoke formats (`invokes`): each whole invoke element's call, then the one
    being written: its name once its head is whole, its arguments as far as its parameter elements are whole
    (and as its tail the one being written: `param_head`, the pattern of its opening tag, and its closing tag)."""
    out, i = whole_calls(body, invoke, lambda whole: _whole_call(invokes(whole.group(0), invoke, parameter, tools)))
    if i is None:
        return out
    open_ = head.match(body, i)
    if open_ is None:
        return out
    name, pairs, j = open_.group(1), [], open_.end()
    while (p := parameter.match(body, len(body) - len(body[j:].lstrip()))) is not None:
        pairs.append(_param(name, p, tools))
        j = p.end()
    tail, (pattern, close) = "", param_head
    if (p := pattern.match(body, len(body) - len(body[j:].lstrip()))) is not None:
        key, *flag = p.groups()
        tail = text_tail(key, body[p.end() :], close, _types(name, key, flag, tools))
    return [*out, PartialCall(name, args_prefix(pairs, closed=False), tail=tail)]


# MiniMax M3: every tag of its calls starts with the namespace marker (a token of its own in MiniMax's vocabulary),
# and an argument is an element whose value is text, or nested elements for an object (one per key) or an array
# (one <item> each), as the template's to_xml writes it.
NS = "]<]minimax[>["
M3_BEGIN, M3_END = NS + "<tool_call>", NS + "</tool_call>"
M3_THINK = ("<mm:think>", "</mm:think>")
_M3_INVOKE = re.compile(re.escape(NS) + r'<invoke name="([^"]*)">(.*?)' + re.escape(NS) + "</invoke>", re.S)
_M3_TAG = re.compile(re.escape(NS) + r"<(/?)([^<>/\s]+)>")
_M3_INVOKE_HEAD = re.compile(re.escape(NS) + r'<invoke name="([^"]*)">')
_BAD = object()  # a value that does not read as the format's elements


class MiniMaxM3(BlockFormat):
    name = "minimax-m3"
    begins = (M3_BEGIN,)
    ends = (M3_END,)
    after_think = ""  # the template writes the calls right after </mm:think> and the text

    def end(self, block: str) -> int | None:
        return after(block, M3_END, len(M3_BEGIN))

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        body = block[len(M3_BEGIN) :].removesuffix(M3_END)
        found = matches_only(_M3_INVOKE, body)
        if not found:
            return None
        calls = []
        for m in found:
            name = m.group(1)
            value = _m3_value(m.group(2), tools.schemas.get(name) or {"type": "object"})
            if not isinstance(value, dict):
                return None
            calls.append(RawCall(name, value))
        return calls

    def partial(self, block: str, tools: Tools) -> list[PartialCall]:
        # each whole invoke element's call, then the one being written: its name once its head is whole, its
        # arguments as far as its top-level elements are closed (a nested object or array as a whole), each read
        # as `parse` reads it (`_m3_value`, by the parameter's schema)
        body = block[len(M3_BEGIN) :]

        out, i = whole_calls(
            body, _M3_INVOKE, lambda whole: _whole_call(self.parse(M3_BEGIN + whole.group(0), tools, True))
        )
        if i is None:
            return out
        head = _M3_INVOKE_HEAD.match(body, i)
        if head is None:
            return out
        name = head.group(1)
        schema = tools.schemas.get(name) or {"type": "object"}
        types = schema_types(schema)
        if types is not None and "object" not in types:
            return [*out, PartialCall(name, "")]  # arguments that are no object: no call (parse says so at the end)
        props = schema.get("properties")
        props = props if isinstance(props, Mapping) else {}
        pairs: list[tuple[str, Any]] = []
        closed, _, end = _m3_scan(body, head.end())
        for tag, inner in closed:
            if tag == "item" and (types is None or "array" in types):
                return [*out, PartialCall(name, args_prefix(pairs, closed=False))]  # <item>s: maybe an array
            pairs.append((tag, _m3_value(inner, props.get(tag))))
            if pairs[-1][1] is _BAD:
                pairs.pop()
                return [*out, PartialCall(name, args_prefix(pairs, closed=False))]
        # the element being written, where its value is text so far (nested elements go out whole, or not at all)
        tail = ""
        if (open_ := _M3_TAG.match(body, len(body) - len(body[end:].lstrip()))) is not None and not open_.group(1):
            key, raw = open_.group(2), body[open_.end() :]
            if key != "item" and _M3_TAG.search(raw) is None:
                tail = text_tail(key, raw, f"{NS}</{key}>", schema_types(props.get(key)))
        return [*out, PartialCall(name, args_prefix(pairs, closed=False), tail=tail)]

    def grammar(self, g: CallGrammar) -> str:
        tags = (NS + "</invoke>", M3_END)

        def param(key: str, schema: Mapping[str, Any], text: bool) -> str:
            # a string as its text; anything else as JSON, which the reader takes where the schema says it is no
            # string (the template's nested elements are not generated: a schema's shape is JSON's to enforce)
            head, close = f"{NS}<{key}>", f"{NS}</{key}>"
            if text:
                return f"{g.lit(head)} {g.text(schema, close, edges=False, tags=tags)}"
            return f"{g.lit(head)} {g.json(schema)} {g.lit(close)}"

        invoke = g.calls(
            lambda name: " ".join(
                [g.lit(f'{NS}<invoke name="{name}">'), g.params(name, param), g.lit(f"{NS}</invoke>\n")]
            )
        )
        return f"{g.lit(M3_BEGIN + chr(10))} {invoke} {g.lit(M3_END)}"


def _m3_elements(text: str) -> list[tuple[str, str]] | None:
    """The top-level elements of `text` as (tag, inner text); None where anything else but whitespace lies
    between them or a tag is left open or closed out of turn."""
    out, whole, _ = _m3_scan(text, 0)
    return out if whole else None


def _m3_scan(text: str, pos: int) -> tuple[list[tuple[str, str]], bool, int]:
    """The closed top-level elements of `text` from `pos` on, up to where it stops reading as elements (stray
    text, a tag closed out of turn) or the first one still open (an invoke still being written), whether all of
    it reads as whole elements, and where the last closed one ends."""
    out: list[tuple[str, str]] = []
    stack: list[str] = []
    start = end = pos
    for m in _M3_TAG.finditer(text, pos):
        closing, tag = m.group(1) == "/", m.group(2)
        if not closing:
            if not stack:
                if text[end : m.start()].strip():
                    return out, False, end
                start = m.end()
            stack.append(tag)
        elif not stack or stack.pop() != tag:
            return out, False, end
        elif not stack:
            out.append((tag, text[start : m.start()]))
            end = m.end()
    return out, not stack and not text[end:].strip(), end


def _m3_value(text: str, schema: Any) -> Any:
    """An element's value, typed by its schema: nested elements are an object or (all <item>, or the schema
    says array) an array; text is a leaf (typed_value); empty text is the schema's empty object or array."""
    types = schema_types(schema)
    sub = schema if isinstance(schema, Mapping) else {}
    if types is not None and not types & {"object", "array"}:
        return typed_value(text, types)  # a string that holds the format's tags is still that string
    if _M3_TAG.search(text) is None:
        if not text.strip() and types is not None and "string" not in types:
            if "object" in types:
                return {}
            if "array" in types:
                return []
        return typed_value(text, types)
    children = _m3_elements(text)
    if children is None:
        return _BAD
    array = "array" in types if types is not None and ("array" in types) != ("object" in types) else None
    if array is None:
        array = all(tag == "item" for tag, _ in children)
    if array:
        if any(tag != "item" for tag, _ in children):
            return _BAD
        items = [_m3_value(inner, sub.get("items")) for _, inner in children]
        return _BAD if any(v is _BAD for v in items) else items
    props = sub.get("properties")
    props = props if isinstance(props, Mapping) else {}
    obj = {tag: _m3_value(inner, props.get(tag)) for tag, inner in children}
    return _BAD if any(v is _BAD for v in obj.values()) else obj
