"""Mistral's tekken templates from v11 on (Small 3.2, Devstral, Ministral 3, Small 4): each call is
`[TOOL_CALLS]NAME[ARGS]{JSON}` (Small 3.2's template writes `[CALL_ID]ID` before `[ARGS]`), one after another
and with no end marker: a call ends where its JSON object does (llama.cpp's common/parsers/ministral3.cpp reads
it so). The template writes the results back itself (`[TOOL_RESULTS]…[/TOOL_RESULTS]`). The older form, one
`[TOOL_CALLS]` before a JSON list of {"name", "arguments"} objects (Mistral Nemo's v3 template), is not read
here: such a template has no `[ARGS]`, gets the engine's own format, and a reply in it stays text."""

from __future__ import annotations

import json
import re

from tokenwing.text.tools.base import BlockFormat, PartialCall, RawCall, Tools, json_call, json_value, object_prefix
from tokenwing.text.tools.constrain import CallGrammar

BEGIN, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
THINK = ("[THINK]", "[/THINK]")  # Ministral 3's and Small 4's reasoning tags
_HEAD = re.compile(r"([^\s\[\]{}]+)(?:\[CALL_ID\]([^\s\[\]]*))?\[ARGS\]")
_NAME = re.compile(r"[^\s\[\]{}]*")
_ID = re.compile(r"[^\s\[\]]*")
_DECODER = json.JSONDecoder()


def _open_head(body: str) -> bool:
    """Whether `body` (the text after [TOOL_CALLS]) could still become a call's head: a name so far, or a name and
    the start of [ARGS] (or of [CALL_ID], or [CALL_ID] and an id and the start of [ARGS])."""
    m = _NAME.match(body)
    assert m is not None  # (the pattern matches the empty text)
    i = m.end()
    if body.startswith(CALL_ID, i):
        n = _ID.match(body, i + len(CALL_ID))
        assert n is not None
        return len(body) - n.end() < len(ARGS) and ARGS.startswith(body[n.end() :])
    rest = body[i:]
    return any(len(rest) < len(t) and t.startswith(rest) for t in (ARGS, CALL_ID))


class Mistral(BlockFormat):
    name = "mistral"
    begins = (BEGIN,)
    ends = ()  # a call ends with its JSON
    after_think = ""
    preserved = (BEGIN, ARGS, CALL_ID, *THINK)  # control tokens in tekken vocabularies

    def end(self, block: str) -> int | None:
        body = block[len(BEGIN) :]
        head = _HEAD.match(body)
        if head is None:
            # text that can no longer be a call's head ends the block here: it goes out as the text it was
            return None if _open_head(body) else len(block)
        start = len(BEGIN) + head.end()
        try:
            _, n = _DECODER.raw_decode(block, len(block) - len(block[start:].lstrip()))
        except ValueError:
            return None if object_prefix(block[start:]) else len(block)
        return int(n)

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        body = block[len(BEGIN) :]
        head = _HEAD.match(body)
        if head is None:
            return None
        args = json_value(body[head.end() :].strip())
        if not isinstance(args, dict):
            return None
        return [RawCall(head.group(1), args, id=head.group(2) or None)]

    def partial(self, block: str, tools: Tools) -> list[PartialCall]:
        # one call a block: its name whole at [ARGS], then its JSON's members as each is followed by , or }
        body = block[len(BEGIN) :]
        head = _HEAD.match(body)
        if head is None:
            return []
        return [json_call(head.group(1), body, head.end(), head.group(2) or None)]

    def grammar(self, g: CallGrammar) -> str:
        # as Ministral 3's and Small 4's templates write a turn's calls: no [CALL_ID] (Small 3.2's calls are read,
        # but written constrained without it)
        return g.calls(lambda name: f"{g.lit(BEGIN + name + ARGS)} {g.json(g.schema(name))}")
