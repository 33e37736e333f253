"""A reply split, while it streams, into reasoning and content.

gpt-oss's harmony output (`HarmonyParser`): the analysis channel is reasoning, the final channel and commentary
preambles content, and a message to `functions.NAME` a tool call when the request declared tools, as
llama.cpp's server fills `reasoning_content`, `content` and `tool_calls` for gpt-oss
(common/parsers/gpt-oss.cpp: the output after the prompt's `<|start|>assistant` is messages
`[<|start|>assistant]<|channel|>NAME[ to=RECIPIENT][<|constrain|>TYPE]<|message|>BODY<|end|>`, the last one
unterminated: <|return|> and <|call|> end generation and are not printed).

Text may arrive in any pieces: a marker split across pieces is held back until it is whole, and the
concatenated deltas never depend on how the text was cut. Where llama.cpp's server reports an error (output that
is not in the harmony format), this parser keeps the text as content instead.

    parser = HarmonyParser()
    for piece in pieces:
        delta = parser.push(piece)       # delta.reasoning, delta.content: new text of each
    delta = parser.finish()              # what was held back

The families that think inside tags (`ThinkParser`: `<think>…</think>` for Qwen3, DeepSeek, GLM, MiniMax M2,
Ling and Kimi K2-Thinking; Kimi K3's think section): the thinking is reasoning, the rest content, where the
model's chat template has such tags (text/tools/__init__.py chooses).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenwing.text.tools.base import Event, ToolCall, Tools, json_args_prefix, json_call, new_call_id, so_far

if TYPE_CHECKING:
    from tokenwing.text.tools.constrain import CallGrammar

CHANNEL, MESSAGE, START, END, RETURN, CALL, CONSTRAIN = (
    "<|channel|>",
    "<|message|>",
    "<|start|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
)
# what a message's header may begin with (at the start of the output, or after <|end|>)
_HEADER_STARTS = (CHANNEL, START, MESSAGE, CONSTRAIN, " to=", "to=")
_TERMINATORS = (END, RETURN, CALL)
# A header longer than this without <|message|> is not a header (real ones: "<|channel|>commentary
# to=functions.get_weather <|constrain|>json", ~60 characters): the text is kept as content.
MAX_HEADER = 256
_CHANNEL_RE = re.compile(r"<\|channel\|>([^\s<]*)")
_RECIPIENT_RE = re.compile(r"to=([^\s<]*)")
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCall, ...] = ()  # harmony's function calls, when the request declared tools
    # a streamed harmony call's pieces before it (call_head, call_args), or the text of one cut off (`streamed`
    # content): they come after the content and before the calls (`HarmonyParser(stream=True)`)
    pieces: tuple[Event, ...] = ()

    def __add__(self, other: Delta) -> Delta:
        return Delta(
            self.reasoning + other.reasoning,
            self.content + other.content,
            self.calls + other.calls,
            self.pieces + other.pieces,
        )


def harmony_template(template: str) -> bool:
    """Whether a chat template is gpt-oss's harmony format, recognised as llama.cpp does (src/llama-chat.cpp)."""
    return START in template and CHANNEL in template


def route(header: str) -> str:
    """Where a message's body goes: "reasoning" (analysis channel), "content" (final channel, a commentary
    preamble, or no channel), or "drop" (a message to a tool, which needs tool-call parsing)."""
    recipients = _RECIPIENT_RE.findall(header)
    if recipients and not recipients[-1].startswith("assistant"):
        return "drop"
    channels = _CHANNEL_RE.findall(header)  # the last one: gpt-oss may prefix a stray "<|channel|>commentary"
    return "reasoning" if channels and channels[-1] == "analysis" else "content"


def recipient(header: str) -> str | None:
    """The function a message's header addresses (`to=functions.NAME`), if any."""
    recipients = _RECIPIENT_RE.findall(header)
    if recipients and recipients[-1].startswith(FUNCTIONS):
        return str(recipients[-1][len(FUNCTIONS) :])
    return None


FUNCTIONS = "functions."


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a marker could still complete."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


def harmony_grammar(g: CallGrammar) -> str:
    """A reply that is one harmony call, what HarmonyParser reads: a commentary message to functions.NAME whose
    body is the arguments' JSON under the function's schema. Its <|call|> ends generation, so one call only; the
    grammar ends with the JSON, where the model's <|call|> (an end token) may follow."""
    return g.calls(
        lambda name: " ".join(
            [
                g.lit(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"),
                g.json(g.schema(name)),
            ]
        )
    )


class _StreamParser:
    """Text in as it streams, split into a Delta of reasoning and content; what could still be a marker is held
    back in `_buf` until `_drain` can tell, or the generation ends (`finish`)."""

    _buf = ""

    def push(self, text: str) -> Delta:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> Delta:
        """End of generation: flushes what was held back."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> Delta:
        raise NotImplementedError


class HarmonyParser(_StreamParser):
    """`tools`: the request's declared functions; a message to one of them is a call (its body the arguments'
    JSON, ended by <|call|>, which ends generation), one to anything else is dropped as before. Without tools
    every message to a recipient is dropped. `parallel` False: calls after the first are dropped.

    `stream` True (a reply under the calls' grammar, as `CallReader(stream=True)`): a call goes out in pieces as
    its message is written — its head once the header names an allowed function (at <|message|>), then its
    arguments as far as their JSON's members are fixed (`json_args_prefix`: the body is the arguments' JSON
    text itself, so it streams as DeepSeek V3.1's and Kimi K2's do). Otherwise a call goes out whole at its
    end.

    A call the reply's end cuts off (its arguments' JSON unfinished: <|call|> would have ended it) goes out with
    its arguments so far, as `CallReader` sends one; a header cut off before its <|message|> is dropped. `cut`
    says which happened to a call: "arguments" or "dropped" (None: neither)."""

    def __init__(self, tools: Tools | None = None, parallel: bool = True, stream: bool = False) -> None:
        self.tools = tools
        self.parallel = parallel
        self.stream = stream and tools is not None
        self.calls: list[ToolCall] = []
        self._call: str | None = None  # the function the current message calls
        self._call_body = ""
        self._streamed: list[str] | None = None  # the current call's id and arguments sent, once its head went out
        self._buf = ""
        self._state = "header_start"  # header_start, header, body, raw, done
        self._route = "content"
        self._started = False  # reasoning with more than whitespace was emitted
        self._pending_ws = ""  # whitespace-only reasoning so far (llama.cpp drops it when that is all there is)
        self.reasoning = ""
        self.content = ""
        self.cut: str | None = None

    def _drain(self, final: bool) -> Delta:
        out = Delta()
        while self._buf:
            if self._state == "header_start":
                if any(h.startswith(self._buf) and h != self._buf for h in _HEADER_STARTS):
                    if final:  # generation stopped inside a header's first marker: no message text to keep
                        self._buf = ""
                    break  # (else not enough text to tell yet)
                self._state = "header" if self._buf.startswith(_HEADER_STARTS) else "raw"
            elif self._state == "header":
                i = self._buf.find(MESSAGE, 0, MAX_HEADER + len(MESSAGE))
                if i >= 0:
                    self._route = route(self._buf[:i])
                    self._call = recipient(self._buf[:i]) if self.tools is not None else None
                    self._buf = self._buf[i + len(MESSAGE) :]
                    self._state = "body"
                    out += self._head()
                elif len(self._buf) >= MAX_HEADER + len(MESSAGE):
                    self._state = "raw"
                elif final:
                    # generation stopped inside a header: no message text to keep (a call's head: dropped)
                    to = _RECIPIENT_RE.findall(self._buf)
                    if self.tools is not None and to and (to[-1].startswith(FUNCTIONS) or FUNCTIONS.startswith(to[-1])):
                        self.cut = "dropped"
                    self._buf = ""
                else:
                    break
            elif self._state == "body":
                found = [(i, m) for m in _TERMINATORS if (i := self._buf.find(m)) >= 0]
                if found:
                    i, marker = min(found)
                    out += self._emit(self._buf[:i])
                    out += self._end_call()
                    self._buf = self._buf[i + len(marker) :]
                    self._state = "header_start" if marker == END else "done"
                    continue
                keep = 0 if final else _held(self._buf, _TERMINATORS)
                out += self._emit(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            elif self._state == "raw":
                out += Delta(content=self._buf)
                self._buf = ""
            else:  # done: nothing follows <|return|> or <|call|>
                self._buf = ""
        if final:
            out += self._end_call(at_end=True)  # <|call|> ends generation, so it is not in the text
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def _head(self) -> Delta:
        """A streamed call's head, where its message's header addresses a function it may call."""
        assert self._streamed is None
        if not self.stream or self._call is None or (self.calls and not self.parallel):
            return Delta()
        assert self.tools is not None
        if not self.tools.accepts(self._call):
            return Delta()  # not a call this request allows: its text goes out at its end
        self._streamed = [new_call_id(), ""]
        head = Event("call_head", call=ToolCall(self._streamed[0], self._call, ""), index=len(self.calls))
        return Delta(pieces=(head,))

    def _emit(self, text: str) -> Delta:
        if self._call is not None:
            self._call_body += text  # a call goes out whole once its arguments are complete, or streamed in pieces
            if self._streamed is None:
                return Delta()
            args, sent = json_args_prefix(self._call_body), self._streamed[1]
            if len(args) <= len(sent) or not args.startswith(sent):
                return Delta()  # (the grammar's text only grows its fixed start: anything else waits for the end)
            self._streamed[1] = args
            return Delta(pieces=(Event("call_args", args[len(sent) :], index=len(self.calls)),))
        if self._route == "content":
            return Delta(content=text)
        if self._route == "drop" or not text:
            return Delta()
        if not self._started:
            self._pending_ws += text
            if self._pending_ws.strip(_WHITESPACE) == "":
                return Delta()
            text, self._pending_ws, self._started = self._pending_ws, "", True
        return Delta(reasoning=text)

    def _end_call(self, at_end: bool = False) -> Delta:
        """The current message's call, at its terminator or (`at_end`) where the reply ends."""
        name, body, streamed = self._call, self._call_body, self._streamed
        self._call, self._call_body, self._streamed = None, "", None
        if name is None:
            return Delta()
        assert self.tools is not None
        try:
            args = json.loads(body or "{}") if body.strip() or not at_end else None  # (at the end: cut at once)
        except ValueError:
            args = None
        if args is None and at_end and self.tools.accepts(name):
            return self._cut_call(name, body, streamed)
        if not isinstance(args, dict) or not self.tools.accepts(name):
            if streamed is not None:  # a streamed call cut off: it stays as far as it went, its text not sent again
                return Delta(pieces=(Event("content", body, streamed=True),))
            return Delta(content=body)  # not a call this request allows: the text as the model wrote it
        if self.calls and not self.parallel:
            return Delta()
        call = ToolCall(streamed[0] if streamed else new_call_id(), name, json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        return Delta(calls=(call,))

    def _cut_call(self, name: str, body: str, streamed: list[str] | None) -> Delta:
        """A call whose arguments the reply's end cut off: with its arguments so far, after what streamed."""
        if self.calls and not self.parallel:
            return Delta()
        text = so_far(json_call(name, body))
        if streamed is not None and not text.startswith(streamed[1]):
            text = streamed[1]  # (cannot be: the text only grew) what went out stays
        self.cut = "arguments"
        call = ToolCall(streamed[0] if streamed else new_call_id(), name, text)
        self.calls.append(call)
        return Delta(calls=(call,))


def parse_harmony(text: str) -> Delta:
    """The whole output at once (what the streamed deltas add up to)."""
    parser = HarmonyParser()
    return parser.push(text) + parser.finish()


_WS = " \t\r\n"


class ThinkParser(_StreamParser):
    """Reasoning inside `open`…`close` tags, then content. `thinking`: the prompt already opened the tags (its
    generation prompt ends with `open`), so the reply starts inside them; else it is reasoning only if the reply
    starts with `open` (a reply that starts with `close` has none: the tag is the format's). Whitespace around
    the reasoning and before the content is the format's, not text. Thinking that never closes is all reasoning
    (generation stopped while the model thought)."""

    def __init__(self, thinking: bool, open: str = "<think>", close: str = "</think>") -> None:
        self._open, self._close = open, close
        self._state = "think" if thinking else "start"  # start, think, after, content
        self._started = False  # reasoning text other than whitespace went out
        self._buf = ""

    def _drain(self, final: bool) -> Delta:
        out = Delta()
        while self._buf:
            if self._state == "start":
                head = self._buf.lstrip(_WS)
                tags = (self._open, self._close)
                if not final and (not head or any(t.startswith(head) and head != t for t in tags)):
                    break  # not enough text to tell yet
                if head.startswith(self._open):
                    self._buf, self._state = head[len(self._open) :], "think"
                elif head.startswith(self._close):
                    # no reasoning, said with the closing tag alone (MiniMax M3 starts a reply without thinking so)
                    self._buf, self._state = head[len(self._close) :], "after"
                else:
                    self._state = "content"
            elif self._state == "think":
                if not self._started:
                    self._buf = self._buf.lstrip(_WS)
                    if not self._buf:
                        break
                i = self._buf.find(self._close)
                if i >= 0:
                    out += self._reasoning(self._buf[:i].rstrip(_WS))
                    self._buf, self._state = self._buf[i + len(self._close) :], "after"
                    continue
                keep = 0 if final else self._tail()
                out += self._reasoning(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            elif self._state == "after":
                self._buf = self._buf.lstrip(_WS)
                if self._buf:
                    self._state = "content"
            else:
                out += Delta(content=self._buf)
                self._buf = ""
        return out

    def _tail(self) -> int:
        """What reasoning text must wait: a possible start of the closing tag and the whitespace before it
        (trimmed if the tag follows)."""
        held = _held(self._buf, (self._close,))
        body = self._buf[: len(self._buf) - held]
        return held + len(body) - len(body.rstrip(_WS))

    def _reasoning(self, text: str) -> Delta:
        if text:
            self._started = True
        return Delta(reasoning=text)
