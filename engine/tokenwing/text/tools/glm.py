"""GLM-4.5 .. GLM-5 (and Ling 3.0, which writes the same): one call per `<tool_call>…</tool_call>` block, the
function's name first, then each argument as `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` (newlines
between them or not: GLM-4.6 writes them, GLM-4.7 does not, Ling puts one inside <arg_value>). A value is text
for a string parameter, JSON for any other."""

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
    text_tail,
    typed_value,
)
from tokenwing.text.tools.constrain import CallGrammar

BEGIN, END = "<tool_call>", "</tool_call>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_NAME = re.compile(r"[^\s<>]+")
_HEAD = re.compile(r"\s*([^\s<>]+)(?=[\s<])")  # the name, whole once what follows it is written
_ARG_HEAD = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)


class Glm(BlockFormat):
    """`newlines`: the template puts a newline before each argument and the end (GLM-4.6, Ling), as constrained
    calls are then written; GLM-4.7 writes none."""

    name = "glm"
    begins = (BEGIN,)
    ends = (END,)
    after_think = ""

    def __init__(self, newlines: bool = False) -> None:
        self.newlines = newlines

    def end(self, block: str) -> int | None:
        return after(block, END, len(BEGIN))

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        body = block[len(BEGIN) :].removesuffix(END)
        head = body.partition("<arg_key>")[0]
        name = head.strip()
        if not _NAME.fullmatch(name):
            return None
        rest = body[len(head) :]
        args_found = matches_only(_ARG, rest)
        if args_found is None:
            return None
        args = {m.group(1).strip(): typed_value(m.group(2), tools.types(name, m.group(1).strip())) for m in args_found}
        return [RawCall(name, args)]

    def partial(self, block: str, tools: Tools) -> list[PartialCall]:
        # the name is whole once a newline or a tag follows it; an argument is fixed at its </arg_value>
        body = block[len(BEGIN) :]
        head = _HEAD.match(body)
        if head is None:
            return []
        name, pairs, i = head.group(1), [], head.end()
        while (m := _ARG.match(body, len(body) - len(body[i:].lstrip()))) is not None:
            key = m.group(1).strip()
            pairs.append((key, typed_value(m.group(2), tools.types(name, key))))
            i = m.end()
        tail = ""
        if (m := _ARG_HEAD.match(body, len(body) - len(body[i:].lstrip()))) is not None:
            key = m.group(1).strip()
            tail = text_tail(key, body[m.end() :], "</arg_value>", tools.types(name, key))
        return [PartialCall(name, args_prefix(pairs, closed=False), tail=tail)]

    def grammar(self, g: CallGrammar) -> str:
        nl = "\n" if self.newlines else ""

        def param(key: str, schema: Mapping[str, Any], text: bool) -> str:
            head = g.lit(f"{nl}<arg_key>{key}</arg_key>{nl}<arg_value>")
            if text:
                return f"{head} {g.text(schema, '</arg_value>', edges=False, tags=(END,))}"
            return f"{head} {g.json(schema)} {g.lit('</arg_value>')}"

        return g.calls(lambda name: " ".join([g.lit(BEGIN + name), g.params(name, param), g.lit(nl + END)]), sep="\n")
