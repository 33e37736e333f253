"""DeepSeek's two call formats.

V3 / V3.1 / R1 (`DeepSeekV3`): special tokens,
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`
(V3.1), where V3 and R1 wrote `function<｜tool▁sep｜>NAME` and the arguments in a json code fence.

V3.2 / V4 (`DeepSeekDsml`): DSML, `<｜DSML｜function_calls>` (V3.2; V4 names it `tool_calls`) around
`<｜DSML｜invoke name="NAME">` elements whose `<｜DSML｜parameter name="KEY" string="true|false">` say whether the
value is text or JSON."""

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
    json_call,
    json_value,
    matches_only,
)
from tokenwing.text.tools.constrain import CallGrammar
from tokenwing.text.tools.minimax import element_param, invokes, partial_invokes

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(CALL_END), re.S)
_FENCED = re.compile(r"\s*(\S+)\s*```(?:json)?\s*(.*?)\s*```\s*", re.S)


class DeepSeekV3(BlockFormat):
    """V3.1's template writes a turn's calls but not the tools: they go into the system message in the layout
    DeepSeek's model card gives V3.1 (each tool's name, description and parameter schema, then the call
    format)."""

    name = "deepseek-v3"
    begins = (CALLS_BEGIN, CALL_BEGIN)  # a lone call without the section's marker is read too ...
    drops = (CALLS_END,)  # ... and a section's end after such calls is no text
    ends = (CALLS_END, CALL_END)

    def end(self, block: str) -> int | None:
        if block.startswith(CALLS_BEGIN):
            return after(block, CALLS_END, len(CALLS_BEGIN))
        return after(block, CALL_END, len(CALL_BEGIN))

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        parts = ["## Tools\nYou have access to the following tools:"]
        for t in tools:
            fn = t.get("function") or {}
            params = json.dumps(fn.get("parameters") or {}, ensure_ascii=False)
            parts.append(f"### {fn.get('name')}\nDescription: {fn.get('description') or ''}\n\nParameters: {params}")
        parts.append(
            "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
            f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}"
            f"{{{{additional_tool_calls}}}}{CALLS_END}\n\n"
            "Where:\n- `tool_call_name` must be an exact match to one of the available tools\n"
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
            "- For multiple tool calls, chain them directly without separators or spaces"
        )
        return "\n\n".join(parts)

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        body = block.removeprefix(CALLS_BEGIN).removesuffix(CALLS_END)
        found = matches_only(_CALL, body)
        if not found:
            return None
        calls = []
        for m in found:
            left, sep, right = m.group(1).partition(SEP)
            if not sep:
                return None
            fenced = _FENCED.fullmatch(right)
            if left.strip() == "function" and fenced:  # V3 / R1
                calls.append(RawCall(fenced.group(1), fenced.group(2)))
            else:  # V3.1
                calls.append(RawCall(left.strip(), right))
        return calls

    def partial(self, block: str, tools: Tools) -> list[PartialCall]:
        # V3.1's form, as the grammar writes it: each whole call, then the one being written, its name whole at
        # <｜tool▁sep｜>, its arguments the JSON text after it as far as its members are fixed
        body = block.removeprefix(CALLS_BEGIN)
        out: list[PartialCall] = []
        i = 0
        while True:
            i = len(body) - len(body[i:].lstrip())
            whole = _CALL.match(body, i)
            if whole is None:
                break
            name, sep, args = whole.group(1).partition(SEP)
            value = json_value(args.strip() or "{}")
            if not sep or name.strip() == "function" or not isinstance(value, dict):
                return out  # V3's fenced form, or no call: it goes out whole, if at all
            out.append(PartialCall(name.strip(), json.dumps(value, ensure_ascii=False)))
            i = whole.end()
        if not body.startswith(CALL_BEGIN, i) or (j := body.find(SEP, i)) < 0:
            return out
        name = body[i + len(CALL_BEGIN) : j].strip()
        if name == "function":  # V3 / R1 write the name after the separator, in a fence
            return out
        return [*out, json_call(name, body, j + len(SEP))]

    def grammar(self, g: CallGrammar) -> str:  # V3.1's form (V3 and R1's fenced one is read, not written)
        call = g.calls(lambda name: " ".join([g.lit(CALL_BEGIN + name + SEP), g.json(g.schema(name)), g.lit(CALL_END)]))
        return f"{g.lit(CALLS_BEGIN)} {call} {g.lit(CALLS_END)}"


DSML = "｜DSML｜"
_DSML_BLOCKS = ("function_calls", "tool_calls")
_INVOKE = re.compile(f'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.S)
_INVOKE_HEAD = re.compile(f'<{DSML}invoke name="([^"]*)">')
_PARAMETER = re.compile(f'<{DSML}parameter name="([^"]*)"(?: string="(true|false)")?>(.*?)</{DSML}parameter>', re.S)
_PARAMETER_HEAD = re.compile(f'<{DSML}parameter name="([^"]*)"(?: string="(true|false)")?>')


class DeepSeekDsml(BlockFormat):
    """`kind`: the block's name constrained calls are written in (the template's: function_calls for V3.2,
    tool_calls for V4); both are read."""

    name = "deepseek-dsml"
    begins = tuple(f"<{DSML}{b}>" for b in _DSML_BLOCKS)
    ends = tuple(f"</{DSML}{b}>" for b in _DSML_BLOCKS)

    def __init__(self, kind: str = "tool_calls") -> None:
        self.kind = kind

    def end(self, block: str) -> int | None:
        kind = next(b for b in _DSML_BLOCKS if block.startswith(f"<{DSML}{b}>"))
        return after(block, f"</{DSML}{kind}>")

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        kind = next(b for b in _DSML_BLOCKS if block.startswith(f"<{DSML}{b}>"))
        body = block[len(f"<{DSML}{kind}>") :].removesuffix(f"</{DSML}{kind}>")
        return invokes(body, _INVOKE, _PARAMETER, tools)

    def partial(self, block: str, tools: Tools) -> list[PartialCall]:
        kind = next(b for b in _DSML_BLOCKS if block.startswith(f"<{DSML}{b}>"))
        body = block[len(f"<{DSML}{kind}>") :]
        return partial_invokes(body, _INVOKE, _INVOKE_HEAD, _PARAMETER, tools, (_PARAMETER_HEAD, f"</{DSML}parameter>"))

    def grammar(self, g: CallGrammar) -> str:
        def param(key: str, schema: Mapping[str, Any], text: bool) -> str:
            head = f'<{DSML}parameter name="{key}" string="{"true" if text else "false"}">'
            tags = (f"</{DSML}invoke>", f"</{DSML}{self.kind}>")
            return element_param(g, head, f"</{DSML}parameter>", schema, text, tags)

        invoke = g.calls(
            lambda name: " ".join(
                [g.lit(f'<{DSML}invoke name="{name}">\n'), g.params(name, param), g.lit(f"</{DSML}invoke>\n")]
            )
        )
        return f"{g.lit(f'<{DSML}{self.kind}>' + chr(10))} {invoke} {g.lit(f'</{DSML}{self.kind}>')}"
