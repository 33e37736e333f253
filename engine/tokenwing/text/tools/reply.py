"""Which tool-call format a model writes, chosen by what its chat template contains, and the reader of a whole
reply: the reasoning split first, then the calls in what is left.

The formats are told apart by the markers only their templates write, checked in an order where no earlier
test matches a later family's template (llama.cpp's common/chat.cpp does the same; its checks were read, not
copied): harmony's <|channel|>, Kimi K2's tool-call section, Kimi K3's <|open|>/<|close|> tags, MiniMax M3's
namespace token, DeepSeek's DSML (V3.2, V4) and tool-call tokens (V3, V3.1), MiniMax M2's <minimax:tool_call>,
GLM's and Ling's <arg_key>, Mistral's [TOOL_CALLS] with [ARGS], Qwen's <tool_call>. A template with none of them
(the ChatML fallback, a template without tools) gets the engine's own: Qwen's JSON calls, the tools described in
the system message, and a turn's calls and results written into the messages as text, since such a template would
drop them."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import llguidance

from tokenwing.text.grammar import Grammar, checked
from tokenwing.text.reasoning import Delta, HarmonyParser, ThinkParser, harmony_grammar, harmony_template
from tokenwing.text.tokenizer import TextTokenizer
from tokenwing.text.tools import deepseek, glm, kimi, minimax, mistral, qwen
from tokenwing.text.tools.base import BlockFormat, CallReader, Event, ToolCall, Tools
from tokenwing.text.tools.constrain import CallGrammar

HARMONY = "harmony"
GENERIC = "generic"
THINK_TAGS = ("<think>", "</think>")


@dataclass(frozen=True)
class Syntax:
    """How a model's template writes tools and calls. `block`: its call format (None: harmony's messages);
    `think`: the tags its reasoning sits in, where it has them; `describes_tools`: the template shows the
    tools to the model itself; `renders_calls`: it writes a turn's calls and the results (else the engine writes
    them into the messages)."""

    name: str
    block: BlockFormat | None
    think: tuple[str, str] | None = None
    describes_tools: bool = True
    renders_calls: bool = True


def syntax(source: str) -> Syntax:
    """The tool-call syntax of a chat template's source."""
    found = _syntax(source)
    # a template that never names `tools` does not show them (DeepSeek V3.1's), one that never reads `tool_calls`
    # drops a turn's calls (templates without tool support): the engine writes them instead
    return replace(
        found, describes_tools=re.search(r"\btools\b", source) is not None, renders_calls="tool_calls" in source
    )


def _syntax(source: str) -> Syntax:
    think = THINK_TAGS if THINK_TAGS[1] in source else None
    if harmony_template(source):
        return Syntax(HARMONY, None)
    if kimi.SECTION_BEGIN in source and "<|tool_call_begin|>" in source:
        return Syntax("kimi-k2", kimi.KimiK2(), think)
    if kimi.OPEN in source and kimi.CLOSE in source and "<|end_of_msg|>" in source:
        return Syntax("kimi-k3", kimi.KimiK3(), (kimi.THINK_BEGIN, kimi.THINK_END))
    if minimax.NS in source:  # (its template builds the markers from this namespace token)
        return Syntax("minimax-m3", minimax.MiniMaxM3(), minimax.M3_THINK)
    if deepseek.DSML in source:  # V3.2 names its block function_calls, V4 tool_calls
        kind = "function_calls" if "function_calls" in source else "tool_calls"
        return Syntax("deepseek-dsml", deepseek.DeepSeekDsml(kind), think)
    if "tool▁calls▁begin" in source:
        return Syntax("deepseek-v3", deepseek.DeepSeekV3(), think)
    if minimax.BEGIN in source:
        return Syntax("minimax-m2", minimax.MiniMax(), think)
    if "<arg_key>" in source:
        return Syntax("glm", glm.Glm(newlines="\n<arg_key>" in source), think)  # GLM-4.6 and Ling; 4.7 writes none
    if mistral.BEGIN in source and mistral.ARGS in source:  # v11+ tekken: Small 3.2, Ministral 3, Small 4
        return Syntax("mistral", mistral.Mistral(), mistral.THINK if mistral.THINK[1] in source else think)
    if qwen.BEGIN in source:
        return Syntax("qwen", qwen.Qwen(xml="<function=" in source), think)
    return Syntax(GENERIC, qwen.Qwen(), think)


def preserved_ids(syn: Syntax, tok: TextTokenizer) -> frozenset[int]:
    """The control tokens a reply in this syntax prints as their text (its format's `preserved` markers that the
    vocabulary has as one control token each), as llama.cpp prints a chat format's preserved_tokens."""
    ids = (tok.encode(m, special=True, add_bos=False) for m in (syn.block.preserved if syn.block else ()))
    return frozenset(one[0] for one in ids if len(one) == 1 and one[0] in tok.special_ids)


def call_grammar(
    syn: Syntax, tok: TextTokenizer, prompt: str, tools: Tools, names: list[str], parallel: bool
) -> Grammar:
    """The grammar (llguidance's Lark) of a reply that must be calls (tool_choice required: to any of `names`;
    a named function: to that one), in the template's own format, arguments matching their schemas.

    The model does not reason first: where the prompt opened the reasoning tags they are closed at once, empty
    (free reasoning would let a weak model think until max_tokens and never call; a request that wants the
    reasoning asks with tool_choice auto; harmony's analysis channel is skipped the same way). BadInputError
    where a schema cannot be compiled (naming tools); with the keywords of the schemas it does not enforce (those
    of functions that are not `strict`: text/grammar.py)."""
    g = CallGrammar(tok, tools, names, parallel=parallel and syn.block is not None)  # harmony: <|call|> ends it
    start = syn.block.grammar(g) if syn.block is not None else harmony_grammar(g)
    if syn.block is not None and syn.think is not None and prompt.rstrip().endswith(syn.think[0]):
        start = f"{g.lit(syn.think[1] + syn.block.after_think)} {start}"
    found = checked(
        lambda: llguidance.grammar_from("lark", g.build(start)), "tools: the functions' parameters cannot be enforced"
    )
    return Grammar(found.text, list(dict.fromkeys([*g.unenforced, *found.unenforced])))


class ReplyReader:
    """A reply read as it streams into reasoning, content and calls (`Event`s, in order). `prompt`: the rendered
    prompt (whether it opened the reasoning tags); `tools` None: no calls are read (tool_choice none, no
    tools); `parallel` False: one call at most; `stream_calls`: calls go out in pieces as they are written (a
    reply under the calls' grammar only: `CallReader`, harmony's `HarmonyParser`)."""

    def __init__(
        self, syn: Syntax, prompt: str, tools: Tools | None, parallel: bool = True, stream_calls: bool = False
    ) -> None:
        self._harmony = HarmonyParser(tools, parallel, stream_calls) if syn.name == HARMONY else None
        self._think = None
        if syn.think is not None:
            self._think = ThinkParser(prompt.rstrip().endswith(syn.think[0]), *syn.think)
        self._calls = None
        if syn.block is not None and (tools is not None or syn.block.drops):
            self._calls = CallReader(syn.block, tools, parallel, stream_calls)
        self.calls: list[ToolCall] = []

    @property
    def cut(self) -> str | None:
        """What the reply's end did to a call it cut off: "arguments" (the call went out with its arguments so
        far), "dropped" (cut before its function's name was whole: nothing of it went out), or None."""
        if self._harmony is not None:
            return self._harmony.cut
        return self._calls.cut if self._calls is not None else None

    def push(self, text: str) -> list[Event]:
        if self._harmony is not None:
            return self._events(self._harmony.push(text), final=False)
        if self._think is not None:
            return self._events(self._think.push(text), final=False)
        return self._events(Delta(content=text), final=False)

    def finish(self) -> list[Event]:
        if self._harmony is not None:
            return self._events(self._harmony.finish(), final=True)
        if self._think is not None:
            return self._events(self._think.finish(), final=True)
        return self._events(Delta(), final=True)

    def _events(self, d: Delta, final: bool) -> list[Event]:
        out = [Event("reasoning", d.reasoning)] if d.reasoning else []
        if self._calls is not None:
            out += self._calls.push(d.content) if d.content else []
            out += self._calls.finish() if final else []
            for e in out:
                if e.kind == "call" and e.call is not None:
                    self.calls.append(e.call)
        elif d.content:
            out.append(Event("content", d.content))
        out += d.pieces  # (harmony's streamed calls: a block format's come from its CallReader)
        for call in d.calls:
            out.append(Event("call", call=call, index=len(self.calls)))
            self.calls.append(call)
        return out


def prepare(
    syn: Syntax, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """The messages as the template needs them: where it does not show the tools, they are described in the
    system message (in the words of the format the reply is read in); where it knows nothing of calls, a turn's
    calls and the results are written into the messages as text (Qwen's form). Other templates get the
    messages as they are."""
    out = [dict(m) for m in messages]
    if not syn.renders_calls:
        out = _calls_as_text(out)
    if tools and not syn.describes_tools:
        # harmony models address a function by name themselves: they need the definitions, no call format
        prompt = (syn.block or BlockFormat()).tool_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip("\n")}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _calls_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = [
                qwen.BEGIN
                + "\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False
                )
                + "\n"
                + qwen.END
                for c in m["tool_calls"]
            ]
            text = "\n".join([m["content"], *blocks] if m.get("content") else blocks)
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        elif m.get("role") == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_results": True})
        else:
            out.append(m)
    for m in out:
        m.pop("_results", None)
    return out
