"""MiniMax M2: a `<minimax:tool_call>…</minimax:tool_call>` block of one or more
`<invoke name="NAME"><parameter name="KEY">VALUE</parameter>…</invoke>`; a value is text for a string parameter,
JSON for any other."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tokenwing.text.tools.base import BlockFormat, RawCall, Tools, after, only_whitespace_between, typed_value
from tokenwing.text.tools.constrain import CallGrammar

BEGIN, END = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = re.compile(r'<invoke name="([^"]*)">(.*?)</invoke>', re.S)
_PARAMETER = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.S)


class MiniMax(BlockFormat):
    name = "minimax-m2"
    begins = (BEGIN,)

    def end(self, block: str) -> int | None:
        return after(block, END, len(BEGIN))

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        body = block[len(BEGIN) :].removesuffix(END)
        return invokes(body, _INVOKE, _PARAMETER, tools)

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
    found = list(invoke.finditer(body))
    if not found or not only_whitespace_between(body, [m.span() for m in found]):
        return None
    calls = []
    for m in found:
        name, inner = m.group(1), m.group(2)
        params = list(parameter.finditer(inner))
        if not only_whitespace_between(inner, [p.span() for p in params]):
            return None
        args = {}
        for p in params:
            key, *flag, value = p.groups()
            types = tools.types(name, key)
            if flag and flag[0] is not None:  # the format says itself whether the value is a string
                types = frozenset({"string"}) if flag[0] == "true" else frozenset({"object"})
            args[key] = typed_value(value, types)
        calls.append(RawCall(name, args))
    return calls
