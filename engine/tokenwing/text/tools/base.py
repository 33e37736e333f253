"""What every tool-call format shares: the calls, the declared tools they are checked against, and the streaming
reader that finds call blocks in a reply's text.

A family's format is a `BlockFormat`: the markers a block of calls begins with, where such a block ends, and
how a whole block reads as calls. `CallReader` consumes the reply's text in any pieces: text outside blocks is
content, passed on at once except a tail that could still become a block's opening marker (held back until it
is whole or proven not to be one, so a marker never goes out as content); a block is kept until it ends, then
read. A block whose calls are all valid (a declared function, arguments that are a JSON object) goes out as
calls; any other block goes out as the text it was, so a reply the format cannot read is never lost, and never
an error."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:
    from tokenwing.text.tools.constrain import CallGrammar

MAX_BLOCK = 1 << 20  # characters: a block still open past this is not a block, and goes out as content


@dataclass(frozen=True)
class ToolCall:
    """A call as OpenAI returns it: `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class RawCall:
    """A call as a format reads it: `id` where the format writes one itself (Kimi K2's functions.NAME:N)."""

    name: str
    arguments: Any
    id: str | None = None


@dataclass(frozen=True)
class Event:
    """One step of a reply, in order: text of `kind` "content" or "reasoning", or a "call". A reader that
    streams calls (`CallReader(stream=True)`, calls under a grammar) also sends a call's pieces before it:
    "call_head" (its id and name, `call.arguments` empty), then "call_args" (`text`: the next piece of its
    arguments); the "call" that follows holds the whole of them. `streamed`: content that was a call block whose
    pieces already went out (it never became a call: a reply cut off inside it)."""

    kind: str
    text: str = ""
    call: ToolCall | None = None
    index: int = 0  # a call's place among the reply's calls
    streamed: bool = False


class PartialCall(NamedTuple):
    """A call of a block still being written, as far as it is fixed (`BlockFormat.partial`): its function's name,
    the start of its arguments' JSON text (`args_prefix`), and its id where the format writes one itself (Kimi
    K2's functions.NAME:N, known once the call's head is whole; the reader makes one up otherwise). `tail`: the
    member being written after those, as far as it is (its key, ": " and its value's text so far, as JSON text):
    not fixed, so never streamed, but a call the reply's end cuts off goes out with it (`so_far`)."""

    name: str
    args: str
    id: str | None = None
    tail: str = ""


def so_far(call: PartialCall) -> str:
    """The arguments of a call cut off where its block's text ends: its fixed start and the member being written,
    a prefix of the JSON text the whole call would have had (as OpenAI returns a call that max_tokens cut)."""
    if not call.tail or not call.args:
        return call.args
    return call.args + ("" if call.args == "{" else ", ") + call.tail


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})


class Tools:
    """The functions a request declares (OpenAI's `tools`), as the readers check calls against them: a call must
    name one of them (`only`: the one `tool_choice` names), and a parameter written as text is typed by its
    schema."""

    def __init__(self, definitions: Sequence[Mapping[str, Any]], only: str | None = None) -> None:
        self.schemas: dict[str, Mapping[str, Any]] = {}
        self.strict: set[str] = set()  # functions whose `strict` asks that every keyword be enforced (or a 400)
        for d in definitions:
            fn = d.get("function") or {}
            params = fn.get("parameters")
            self.schemas[str(fn.get("name"))] = params if isinstance(params, Mapping) else {}
            if fn.get("strict") is True:
                self.strict.add(str(fn.get("name")))
        self.only = only

    def accepts(self, name: str) -> bool:
        return name in self.schemas and (self.only is None or name == self.only)

    def types(self, name: str, key: str) -> frozenset[str] | None:
        """The JSON types a parameter may have by its schema; None where the schema does not say."""
        props = self.schemas.get(name, {}).get("properties")
        return schema_types(props.get(key) if isinstance(props, Mapping) else None)


def schema_types(prop: Any) -> frozenset[str] | None:
    """The JSON types a value may have by its schema (its own, anyOf's and oneOf's; string for an enum of
    strings); None where the schema does not say."""
    if not isinstance(prop, Mapping):
        return None
    found: set[str] = set()
    for schema in [prop, *(s for k in ("anyOf", "oneOf") for s in prop.get(k) or () if isinstance(s, Mapping))]:
        t = schema.get("type")
        found.update(x for x in ([t] if isinstance(t, str) else t or ()) if x in _JSON_TYPES)
        if "enum" in schema and all(isinstance(v, str) for v in schema["enum"] or ()):
            found.add("string")
    return frozenset(found) or None


def typed_value(text: str, types: frozenset[str] | None) -> Any:
    """A parameter's value as the XML-like formats write it (the text itself for a string, JSON for anything
    else): a string where the schema says so or says nothing, else the JSON it reads as, else the text (a model
    that wrote something else gets its text passed on, not an error). One newline on each side is the format's,
    not the value's."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    if types is None or "string" in types:
        return text
    word = text.strip()
    if "boolean" in types and word in ("True", "False"):  # a template that wrote Python's str() of a bool
        return word == "True"
    try:
        return json.loads(word)
    except ValueError:
        return text


def json_value(text: str) -> Any:
    """JSON text as a value; a marker-free sentinel where it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_JSON


_NOT_JSON = object()


def args_prefix(pairs: Sequence[tuple[str, Any]], closed: bool) -> str:
    """The start of the arguments' JSON text as `_checked` writes it (json.dumps of the object) that `pairs`,
    an object's first members in order, already fix; the whole text where the object is `closed`. A member
    goes in whole: a value is written as its canonical JSON, never as its pieces (a number's next digit, a
    string's escapes would change what was sent)."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):  # a key written twice: json.loads keeps its first place, its last value
        return ""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in pairs)
    return "{" + body + ("}" if closed else "")


_DECODER = json.JSONDecoder()


def json_members(text: str, pos: int = 0) -> tuple[list[tuple[str, Any]], bool, tuple[str, int] | None] | None:
    """The members of the JSON object that starts at `text[pos]` (after whitespace) and may still be being
    written: those whose value is followed by `,` or `}` (so cannot change any more), whether the object is
    closed, and the member being written (its key and where its value starts), if any. None where no object
    starts there."""
    n = len(text)

    def skip(i: int) -> int:
        while i < n and text[i] in _WS:
            i += 1
        return i

    i = skip(pos)
    if i >= n or text[i] != "{":
        return None
    pairs: list[tuple[str, Any]] = []
    i += 1
    while True:
        i = skip(i)
        if i < n and text[i] == "}" and not pairs:
            return pairs, True, None
        if i >= n or text[i] != '"':
            return pairs, False, None
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return pairs, False, None
        i = skip(i)
        if i >= n or text[i] != ":":
            return pairs, False, None
        i = skip(i + 1)
        if i >= n:
            return pairs, False, None
        try:
            value, j = _DECODER.raw_decode(text, i)
        except ValueError:
            return pairs, False, (key, i)
        j = skip(j)
        if j >= n:  # a number may go on ("1" of "12"): only what follows a value closes it
            return pairs, False, (key, i)
        if text[j] not in ",}":
            return pairs, False, None
        pairs.append((key, value))
        if text[j] == "}":
            return pairs, True, None
        i = j + 1


def whole_calls(
    body: str, element: re.Pattern[str], read: Callable[[re.Match[str]], PartialCall | None]
) -> tuple[list[PartialCall], int | None]:
    """The whole call elements that start a block's `body` (the block less its opening marker), each made a call
    by `read` (None: it reads as no call): the calls, and where the element being written starts — None after a
    whole element that is no call (nothing after it goes out as one)."""
    out: list[PartialCall] = []
    i = 0
    while True:
        i = len(body) - len(body[i:].lstrip())
        whole = element.match(body, i)
        if whole is None:
            return out, i
        call = read(whole)
        if call is None:
            return out, None
        out.append(call)
        i = whole.end()


def json_args_prefix(text: str, pos: int = 0) -> str:
    """The fixed start of the arguments whose JSON object text starts at `text[pos]` (after whitespace) and may
    still be being written: `args_prefix` of its members so far ("" before the object's `{`)."""
    found = json_members(text, pos)
    return "" if found is None else args_prefix(found[0], found[1])


def json_call(name: str, text: str, pos: int = 0, call_id: str | None = None) -> PartialCall:
    """A call whose arguments are the JSON object text that starts at `text[pos]` (after whitespace), still being
    written: `json_args_prefix`, and as its tail the member being written as far as the text goes (its value's
    JSON text as the model wrote it)."""
    found = json_members(text, pos)
    if found is None:
        return PartialCall(name, "", call_id)
    pairs, closed, writing = found
    prefix = args_prefix(pairs, closed)
    tail = ""
    if writing is not None and prefix:
        tail = json.dumps(writing[0], ensure_ascii=False) + ": " + canonical_prefix(text[writing[1] :])
    return PartialCall(name, prefix, call_id, tail)


_SCALAR = re.compile(r"[^\s,:\[\]{}\"]+")


def canonical_prefix(text: str) -> str:
    """JSON text still being written, as `args_prefix` writes JSON (json.dumps: one space after `,` and `:`,
    strings and numbers re-serialised): the start of the text its whole value will be written as, where the
    model wrote it otherwise (the calls' grammar writes compact JSON). A string still open is written as far as
    its characters are whole; a word at the end (`tr`) as it is."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _WS:
            i += 1
        elif c in "{}[]":
            out.append(c)
            i += 1
        elif c in ",:":
            out.append(c + " ")
            i += 1
        elif c == '"':
            try:
                value, i = _DECODER.raw_decode(text, i)
            except ValueError:  # still open: up to an escape not yet whole
                for end in range(n, max(i, n - 6), -1):
                    if (part := json_value(text[i:end] + '"')) is not _NOT_JSON:
                        return "".join(out) + json.dumps(part, ensure_ascii=False)[:-1]
                return "".join(out) + text[i:]
            out.append(json.dumps(value, ensure_ascii=False))
        else:
            m = _SCALAR.match(text, i)
            assert m is not None  # (c is none of the characters it stops at)
            word, value = m.group(), json_value(m.group())
            # (a number at the end as json.dumps writes it where more digits cannot change that start: 7.50 is
            # 7.5 whether or not a 1 follows; not an exponent's, nor -0's, which json.dumps writes as 0)
            keep = value is _NOT_JSON or (m.end() == n and ("e" in word.lower() or word.startswith("-0")))
            out.append(word if keep else json.dumps(value, ensure_ascii=False))
            i = m.end()
    return "".join(out)


def cut_arguments(text: str) -> dict[str, Any] | None:
    """The arguments a call cut off by max_tokens stands for when a client sends it back in the conversation
    (as an agent does: the call, then its tool's error): `text` is the start of an object's JSON text (what the
    engine, like OpenAI, returns for such a call), read as the members written whole. None where `text` is not
    the start of any object's JSON text: that is an error, not a cut."""
    if not object_prefix(text):
        return None
    found = json_members(text)
    return dict(found[0]) if found is not None else {}


class _Ended(Exception):
    """The text ended where JSON could still go on: it is a prefix."""


_NUMBER_START = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_ESCAPES = set('"\\/bfnrt')
_HEX = set("0123456789abcdefABCDEF")


def object_prefix(text: str) -> bool:
    """Whether `text` is the start, and only the start, of some JSON object's text (not a whole one)."""
    n = len(text)

    def ws(i: int) -> int:
        while i < n and text[i] in _WS:
            i += 1
        if i == n:
            raise _Ended
        return i

    def string(i: int) -> int:  # text[i] is its opening quote
        i += 1
        while i < n:
            c = text[i]
            if c == '"':
                return i + 1
            if c == "\\":
                if i + 1 < n and text[i + 1] == "u":
                    digits = text[i + 2 : i + 6]
                    if not set(digits) <= _HEX:
                        raise ValueError
                    i += 6
                    continue
                if i + 1 < n and text[i + 1] not in _ESCAPES:
                    raise ValueError
                i += 2
                continue
            if ord(c) < 0x20:
                raise ValueError
            i += 1
        raise _Ended

    def value(i: int) -> int:
        i = ws(i)
        c = text[i]
        if c in "{[":
            close = "}" if c == "{" else "]"
            i = ws(i + 1)
            if text[i] == close:
                return i + 1
            while True:
                if close == "}":
                    if text[i] != '"':
                        raise ValueError
                    i = ws(string(i))
                    if text[i] != ":":
                        raise ValueError
                    i += 1
                i = ws(value(i))
                if text[i] == close:
                    return i + 1
                if text[i] != ",":
                    raise ValueError
                i = ws(i + 1)
        if c == '"':
            return string(i)
        for word in ("true", "false", "null"):
            if text.startswith(word, i):
                return i + len(word)
            if word.startswith(text[i:]):
                raise _Ended
        m = _NUMBER_START.match(text, i)
        assert m is not None  # (every part of the pattern may be empty)
        if m.end() == n and m.end() > i:
            raise _Ended  # (a number may go on)
        if not _NUMBER.fullmatch(text, i, m.end()):
            raise ValueError
        return m.end()

    try:
        if text[ws(0)] != "{":
            return False
        value(0)
        return False  # a whole object (and maybe more): no prefix
    except _Ended:
        return True
    except ValueError:
        return False


def text_tail(key: str, raw: str, close: str, types: frozenset[str] | None) -> str:
    """The tail (`PartialCall.tail`) of a parameter the XML-like formats write as raw text up to its closing tag
    `close`, cut off after `raw`: a string (by its schema, as `typed_value` reads it) as an open JSON string, any
    other value as the JSON text written so far; without a start of the closing tag at its end, or the newline
    on each side that is the format's. "" while no value is written."""
    raw = raw[: len(raw) - _held(raw, (close,))]
    raw = raw.removeprefix("\n").removesuffix("\n")
    if types is None or "string" in types:
        return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(raw, ensure_ascii=False)[:-1]}" if raw else ""
    word = canonical_prefix(raw.strip())
    return f"{json.dumps(key, ensure_ascii=False)}: {word}" if word else ""


def after(block: str, marker: str, start: int = 0) -> int | None:
    """The index just after the first `marker` in `block` from `start`; None if it is not there yet."""
    i = block.find(marker, start)
    return None if i < 0 else i + len(marker)


def matches_only(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """The matches of `pattern` in `text` (the elements of a block), or None where anything but whitespace lies
    around them: a block with stray text in it is not read."""
    found = list(pattern.finditer(text))
    return found if only_whitespace_between(text, [m.span() for m in found]) else None


def only_whitespace_between(text: str, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether `text` outside the (sorted) spans is whitespace: a block with stray text in it is not read."""
    pos = 0
    for a, b in spans:
        if text[pos:a].strip():
            return False
        pos = b
    return not text[pos:].strip()


class BlockFormat:
    """A family's call syntax. `begins`: the markers a block starts with; `ends`: the markers a block ends with;
    `drops`: structural markers that are neither calls nor content (removed from the content); `end(block)`: the
    length of the block that starts `block` once its end marker is there, else None; `parse(block, tools,
    complete)`: its calls, or None when it does not read as calls (`complete` is False for a block that
    generation stopped inside)."""

    name: ClassVar[str]
    begins: ClassVar[tuple[str, ...]]
    ends: ClassVar[tuple[str, ...]]
    drops: ClassVar[tuple[str, ...]] = ()
    after_think: ClassVar[str] = "\n\n"  # what the format writes between a closed reasoning block and the calls
    # markers the reply must show though the vocabulary makes them control tokens, never printed (Mistral's
    # [TOOL_CALLS]): llama.cpp's preserved_tokens, printed for a chat in this format
    preserved: ClassVar[tuple[str, ...]] = ()

    def end(self, block: str) -> int | None:
        raise NotImplementedError

    def tool_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """What tells the model the tools where its template does not (a format overrides it with the words its
        family was trained on)."""
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return f"# Tools\n\nYou can call the functions below (JSON Schema definitions):\n{lines}"

    def parse(self, block: str, tools: Tools, complete: bool) -> list[RawCall] | None:
        raise NotImplementedError

    def partial(self, block: str, tools: Tools) -> list[PartialCall]:
        """The calls of a block still being written, as far as they are fixed: for each call begun, in order,
        its function's name and the start of its arguments' JSON text (`args_prefix`) that no later text can
        change — what the block's calls will have once `parse` reads it whole, when it is written as the format's
        grammar writes it — and its id where the format writes one. A call whose name is not whole yet is not in
        the list. By default nothing: the calls go out whole when the block ends."""
        return []

    def grammar(self, g: CallGrammar) -> str:
        """The Lark expression of a reply that is nothing but calls in this format, to the functions `g` allows,
        with arguments matching their schemas (tool_choice required or a named function): what `parse` reads."""
        raise NotImplementedError


_WS = " \t\r\n"


def _held(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start of a marker (and could still become it)."""
    longest = max((len(m) for m in markers), default=0)
    for n in range(min(len(text), longest - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


class CallReader:
    """Finds a format's call blocks in a reply's content as it streams (see the module's docstring).

    `tools` None: no calls are read (tool_choice none, or no tools), only the format's structural markers are
    removed. `parallel` False: calls after the first are dropped (OpenAI's parallel_tool_calls).

    `stream` True: a call goes out in pieces while its block is being written (its head, then its arguments as
    far as `fmt.partial` says they are fixed). Only for a reply under the calls' grammar (tool_choice required
    or a named function): there the block cannot turn out not to be a call, which with tool_choice auto it can
    (and must then go out as text), so auto sends each call whole once its block ends.

    A call the reply's end cuts off (max_tokens, or the model stopped inside its block) is never text: it goes
    out as a call with its arguments so far (`so_far`) once its function's name is whole and one the request
    allows; before that (a marker's start at the reply's very end, a block cut inside the call's head) nothing
    of it goes out. `cut` says which happened: "arguments" or "dropped" (None: neither)."""

    def __init__(self, fmt: BlockFormat, tools: Tools | None, parallel: bool = True, stream: bool = False) -> None:
        self.fmt = fmt
        self.tools = tools
        self.parallel = parallel
        self.stream = stream and tools is not None
        self.calls: list[ToolCall] = []
        self._open: list[list[str]] = []  # the current block's streamed calls: [id, name, arguments sent]
        self._stalled = False  # the block's pieces stopped (what partial said no longer extends what was sent)
        self._buf = ""
        self._in_block = False
        self._after_calls = False
        self._ws = ""  # the whitespace before the current block
        self._markers = (*fmt.begins, *fmt.drops) if tools is not None else fmt.drops
        self.cut: str | None = None

    def push(self, text: str) -> list[Event]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            if not self._in_block:
                if self._after_calls:  # whitespace after a call block is the format's
                    self._buf = self._buf.lstrip(_WS)
                    if not self._buf:
                        break
                    self._after_calls = False
                found = [(i, m) for m in self._markers if (i := self._buf.find(m)) >= 0]
                if not found:
                    if final:
                        _content(out, self._buf[: self._content_end()])
                        self._buf = ""
                        break
                    keep = self._tail()
                    _content(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                i, marker = min(found, key=lambda f: (f[0], -len(f[1])))
                before = self._buf[:i]
                if marker in self.fmt.begins:  # whitespace before a call block is the format's (kept if it is not)
                    stripped = before.rstrip(_WS)
                    self._ws = before[len(stripped) :]
                    before = stripped
                _content(out, before)
                if marker in self.fmt.drops and marker not in self.fmt.begins:
                    self._buf = self._buf[i + len(marker) :]
                    continue
                self._buf = self._buf[i:]
                self._in_block = True
            n = self.fmt.end(self._buf)
            if n is None and not final and len(self._buf) <= MAX_BLOCK:
                if self.stream:
                    self._pieces(out, self._buf)
                break  # the block is still being written
            block = self._buf if n is None else self._buf[:n]
            if self.stream and n is not None and self._open:
                # its last pieces before the call: a format whose call ends with its JSON (Mistral's) has no end
                # marker after the closing brace, so the last member was fixed only by the text that ended it
                self._pieces(out, block)
            self._buf = "" if n is None else self._buf[n:]
            self._in_block = False
            self._block(out, block, complete=n is not None, cut=n is None and final)
        return out

    def _content_end(self) -> int:
        """At the reply's end, where the content held back ends: before a call block's opening marker that the end
        cut off (and the whitespace before it, the format's), or a structural marker's, which are no text; any
        other held start of a marker was text after all."""
        held = _held(self._buf, self._markers)
        if not held:
            return len(self._buf)
        if self.tools is not None and any(m.startswith(self._buf[-held:]) for m in self.fmt.begins):
            self.cut = "dropped"
            return len(self._buf[:-held].rstrip(_WS))
        if any(m.startswith(self._buf[-held:]) for m in self.fmt.drops):
            return len(self._buf) - held  # the format's structure cut off (Kimi K3's <|open|>respo): no text
        return len(self._buf)

    def _tail(self) -> int:
        """What content must wait: a possible start of a marker, and the whitespace before it (dropped if a call
        block follows)."""
        held = _held(self._buf, self._markers)
        body = self._buf[: len(self._buf) - held]
        return held + len(body) - len(body.rstrip(_WS))

    def _pieces(self, out: list[Event], block: str) -> None:
        """The pieces of the block's calls that are newly fixed (see the class's docstring)."""
        assert self.tools is not None
        if self._stalled:
            return
        for k, (name, args, call_id, _) in enumerate(self.fmt.partial(block, self.tools)):
            index = len(self.calls) + k
            if index > 0 and not self.parallel:
                return  # a call that will be dropped
            if k == len(self._open):
                if not self.tools.accepts(name):
                    self._stalled = True  # the block will not be calls: nothing more goes out as a call
                    return
                self._open.append([call_id or new_call_id(), name, ""])
                out.append(Event("call_head", call=ToolCall(self._open[k][0], name, ""), index=index))
            _, was, sent = self._open[k]
            if name != was or not args.startswith(sent):
                self._stalled = True  # cannot be (the grammar's text only grows): stop, the call goes out whole
                return
            if len(args) > len(sent):
                out.append(Event("call_args", args[len(sent) :], index=index))
                self._open[k][2] = args

    def _block(self, out: list[Event], block: str, complete: bool, cut: bool) -> None:
        assert self.tools is not None
        opened, self._open, self._stalled = self._open, [], False
        if cut:
            # cut inside its end marker ("</" at least: a lone "<" may start another of its tags), the block's
            # calls are whole where they read so; else they are as far as they were written (`partial`): a block
            # that does not close its calls' arguments itself (GLM's) may have had more of them to come
            end = _held(block, self.fmt.ends)
            raw = self.fmt.parse(block[:-end], self.tools, complete) if end >= 2 else None
            calls = _checked(raw, self.tools) if raw else None
            if calls is None:
                self._cut(out, block, opened)
                return
        else:
            raw = self.fmt.parse(block, self.tools, complete)
            calls = _checked(raw, self.tools) if raw else None
        if calls is None:
            # not calls after all: the text as the model wrote it (under a grammar only a reply cut off inside
            # the block, whose streamed call then stays as far as it went)
            if self._ws + block:
                out.append(Event("content", self._ws + block, streamed=bool(opened)))
            return
        for k, call in enumerate(calls):
            if k < len(opened):  # its head went out: the same id
                calls[k] = ToolCall(opened[k][0], call.name, call.arguments)
        self._calls(out, calls)

    def _calls(self, out: list[Event], calls: list[ToolCall]) -> None:
        self._after_calls = True
        for call in calls:
            if self.calls and not self.parallel:
                continue  # one call only: the rest are dropped, not shown as text
            out.append(Event("call", call=call, index=len(self.calls)))
            self.calls.append(call)

    def _cut(self, out: list[Event], block: str, opened: list[list[str]]) -> None:
        """A block the reply's end cut off that does not read as whole calls: its calls as far as they were
        written (see the class's docstring); those that streamed keep their ids and what they sent."""
        assert self.tools is not None
        found = self.fmt.partial(block, self.tools)
        calls: list[ToolCall] = []
        for k, c in enumerate(found):
            if not self.tools.accepts(c.name):
                break
            args = so_far(c)
            if k < len(opened):
                call_id, name, sent = opened[k]
                if name != c.name or not args.startswith(sent):
                    break  # (cannot be: a streamed call's text only grew) what went out stays, below
                calls.append(ToolCall(call_id, name, args))
            else:
                calls.append(ToolCall(c.id or new_call_id(), c.name, args))
        calls += [ToolCall(i, name, sent) for i, name, sent in opened[len(calls) :]]
        if not calls and found:  # a function the request does not allow: the text, as a whole block's would be
            out.append(Event("content", self._ws + block))
            return
        if not calls:
            self.cut = "dropped"
        elif any(not isinstance(json_value(c.arguments), dict) for c in calls):
            self.cut = "arguments"  # (calls whose arguments were all written, their block's end not: whole calls)
        self._calls(out, calls)


def _content(out: list[Event], text: str) -> None:
    if text:
        out.append(Event("content", text))


def _checked(raw: list[RawCall], tools: Tools) -> list[ToolCall] | None:
    """The calls with their arguments as JSON text, or None if any names an undeclared function or has
    arguments that are not an object (a JSON text of one is read)."""
    calls = []
    for c in raw:
        args = c.arguments
        if isinstance(args, str):
            args = json_value(args.strip() or "{}")
        if not isinstance(args, dict) or not tools.accepts(c.name):
            return None
        calls.append(ToolCall(c.id or new_call_id(), c.name, json.dumps(args, ensure_ascii=False)))
    return calls
