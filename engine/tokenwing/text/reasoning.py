"""gpt-oss's harmony output split, while it streams, into reasoning (the analysis channel) and content (the final
channel and commentary preambles), as llama.cpp's server fills `reasoning_content` and `content` for gpt-oss
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
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.reasoning + other.reasoning, self.content + other.content)


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


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a marker could still complete."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


class HarmonyParser:
    def __init__(self) -> None:
        self._buf = ""
        self._state = "header_start"  # header_start, header, body, raw, done
        self._route = "content"
        self._started = False  # reasoning with more than whitespace was emitted
        self._pending_ws = ""  # whitespace-only reasoning so far (llama.cpp drops it when that is all there is)
        self.reasoning = ""
        self.content = ""

    def push(self, text: str) -> Delta:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> Delta:
        """End of generation: flushes what was held back (an unterminated header is dropped)."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> Delta:
        out = Delta()
        while self._buf:
            if self._state == "header_start":
                if not final and any(h.startswith(self._buf) and h != self._buf for h in _HEADER_STARTS):
                    break  # not enough text to tell yet
                self._state = "header" if self._buf.startswith(_HEADER_STARTS) else "raw"
            elif self._state == "header":
                i = self._buf.find(MESSAGE, 0, MAX_HEADER + len(MESSAGE))
                if i >= 0:
                    self._route = route(self._buf[:i])
                    self._buf = self._buf[i + len(MESSAGE) :]
                    self._state = "body"
                elif len(self._buf) >= MAX_HEADER + len(MESSAGE):
                    self._state = "raw"
                elif final:
                    self._buf = ""  # generation stopped inside a header: no message text to keep
                else:
                    break
            elif self._state == "body":
                found = [(i, m) for m in _TERMINATORS if (i := self._buf.find(m)) >= 0]
                if found:
                    i, marker = min(found)
                    out += self._emit(self._buf[:i])
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
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def _emit(self, text: str) -> Delta:
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


def parse_harmony(text: str) -> Delta:
    """The whole output at once (what the streamed deltas add up to)."""
    parser = HarmonyParser()
    return parser.push(text) + parser.finish()
