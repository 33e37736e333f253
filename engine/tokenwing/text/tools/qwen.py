"""Qwen3 / Qwen3.5 (and Hermes-style models, and the engine's own fallback): one call per
`<tool_call>…</tool_call>` block, whose body is either JSON, `{"name": NAME, "arguments": {…}}` (Qwen3), or
XML, `<function=NAME>` then `<parameter=KEY>\\nVALUE\\n</parameter>` per argument and `</function>`
(Qwen3-Coder, Qwen3.5). Both are read whichever the template shows: models trained on one write the other."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenwing.text.tools.base import (
    BlockFormat,
    PartialCall,
    RawCall,
    Tools,
    after,
    args_prefix,
    json_call,
    json_members,
    matches_only,
    text_tail,
    typed_value,
)
from tokenwing.text.tools.constrain import CallGrammar

BEGIN, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_FUNCTION_HEAD = re.compile(r"<function=([^>\n]+)>")
_PARAMETER_HEAD = re.compile(r"<parameter=([^>\n]+)>")

# the engine's own words for a template that shows no tools (the ChatML fallback): Qwen's JSON form
TOOL_PROMPT = (
    "# Tools\n\nYou can call the functions below (JSON Schema definitions):\n<tools>\n{tools}\n</tools>\n\n"
    "To call one, answer with its name and arguments as a JSON object inside <tool_call></tool_call> tags, one "
    'call per pair of tags:\n<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n'
    "</tool_call>\nEach result comes back inside <tool_response></tool_response> tags."
)


class Qwen(BlockFormat):
    """`xml`: the template shows the XML form (Qwen3-Coder, Qwen3.5), which constrained calls are written in;
    else the JSON form (Qwen3, the engine's own)."""

    name = "qwen"
    begins = (BEGIN,)
    ends = (END,)

    def __init__(self, xml: bool = False) -> None:
        self.xml = xml

    def end(self, block: str) -> int | None:
        return after(block, END, len(BEGIN))

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        body = block[len(BEGIN) :].removesuffix(END).strip()
        if body.startswith("<function="):
            return _xml(body, tools)
        try:
            obj, n = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return None
        if body[n:].strip() or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return [RawCall(obj["name"], args)]

    def partial(self, block: str, tools: Tools) -> list[PartialCall]:
        # the first call of the block (the grammar writes one a block): the XML form's parameters as each one's
        # </parameter> ends it, the JSON form's arguments as each member's value is followed by , or }
        body = block[len(BEGIN) :].lstrip()
        head = _FUNCTION_HEAD.match(body)
        if head is not None:
            name = head.group(1).strip()
            pairs, i = [], head.end()
            while (p := _PARAMETER.match(body, _skip(body, i))) is not None:
                key = p.group(1).strip()
                pairs.append((key, typed_value(p.group(2), tools.types(name, key))))
                i = p.end()
            closed = body.startswith("</function>", _skip(body, i))
            tail = ""
            if not closed and (p := _PARAMETER_HEAD.match(body, _skip(body, i))) is not None:
                key = p.group(1).strip()
                tail = text_tail(key, body[p.end() :], "</parameter>", tools.types(name, key))
            return [PartialCall(name, args_prefix(pairs, closed), tail=tail)]
        outer = json_members(body)
        if outer is None:
            return []
        members, _, writing = outer
        fixed = dict(members)
        name = fixed.get("name")
        if not isinstance(name, str):
            return []
        args = fixed.get("arguments")
        if isinstance(args, dict):
            return [PartialCall(name, json.dumps(args, ensure_ascii=False))]
        if writing is not None and writing[0] == "arguments":
            return [json_call(name, body, writing[1])]
        return [PartialCall(name, "")]

    def grammar(self, g: CallGrammar) -> str:
        if not self.xml:
            return g.calls(
                lambda name: (
                    g.lit(BEGIN + '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
                    + " "
                    + g.json(g.schema(name))
                    + " "
                    + g.lit("}\n" + END)
                ),
                sep="\n",
            )

        def param(key: str, schema: Mapping[str, Any], text: bool) -> str:
            head = g.lit(f"<parameter={key}>\n")
            if text:  # the reader drops the newline on each side as the format's: the value may have its own
                value = g.text(schema, "\n</parameter>", edges=True, tags=("</function>", END))
                return " ".join([head, value, g.lit("\n")])
            return " ".join([head, g.json(schema), g.lit("\n</parameter>\n")])

        return g.calls(
            lambda name: " ".join(
                [g.lit(f"{BEGIN}\n<function={name}>\n"), g.params(name, param), g.lit(f"</function>\n{END}")]
            ),
            sep="\n",
        )


def _xml(body: str, tools: Tools) -> list[RawCall] | None:
    fns = matches_only(_FUNCTION, body)
    if not fns:
        return None
    calls = []
    for fn in fns:
        name, inner = fn.group(1).strip(), fn.group(2)
        params = matches_only(_PARAMETER, inner)
        if params is None:
            return None
        args = {}
        for p in params:
            key = p.group(1).strip()
            args[key] = typed_value(p.group(2), tools.types(name, key))
        calls.append(RawCall(name, args))
    return calls


def _skip(text: str, i: int) -> int:
    """The index of the first character from `i` on that is not whitespace."""
    return len(text) - len(text[i:].lstrip())
