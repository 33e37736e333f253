"""Calls under a grammar: with tool_choice `required` or a named function, the reply is generated under an
llguidance grammar (Lark syntax) that allows nothing but the family's own call format, the function names the
request allows and arguments that match each function's `parameters` schema (docs/api.md, "Tool calls").

Each format writes its grammar next to its reader (`BlockFormat.grammar`, in text/tools/<family>.py) with the
pieces here: a marker as the model's tokens (a control token by its id, since llguidance never matches a control
token against text), an argument as embedded JSON (`%json`), or as the raw text the XML-like formats give a
string parameter, one lexeme that runs up to its closing tag so that the value can hold anything but that tag."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from tokenwing.text.grammar import json_options, without_bad_patterns
from tokenwing.text.tokenizer import TextTokenizer
from tokenwing.text.tools.base import Tools

_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")
# an object's keywords that constrain it as a whole, which one element per declared property cannot enforce
_OBJECT_ONLY_AS_JSON: tuple[str, ...] = (
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "minProperties",
    "maxProperties",
)
_OBJECT_ONLY_AS_JSON += ("not", "allOf", "anyOf", "oneOf", "if", "then", "else", "propertyNames", "enum", "const")


def regex_escape(text: str) -> str:
    """`text` as a literal inside Lark's /…/ (Rust regex syntax: only its metacharacters are escaped)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in _REGEX_META else c for c in text)


class CallGrammar:
    """The grammar of one reply of calls, built by a format's `grammar(g)`: `names` the functions allowed (all of
    `tools` for required, the named one), `parallel` whether more than one call may follow."""

    def __init__(self, tok: TextTokenizer, tools: Tools, names: list[str], parallel: bool) -> None:
        self.tok = tok
        self.tools = tools
        self.names = names
        self.parallel = parallel
        self._defs: list[str] = []
        self._n = 0
        self._root: Mapping[str, Any] = {}  # the parameters whose arguments are being written (their $defs)
        self._strict = False  # whether that function said `strict` (its schema's every keyword enforced, or a 400)
        # what the grammar does not enforce of the schemas, beside what llguidance's warnings say (`checked`)
        self.unenforced: list[str] = []

    # ------------------------------------------------------------------------------------------------ pieces
    def lit(self, text: str) -> str:
        """`text` as the model writes it: its control tokens by id (`<[id]>`), the rest as string literals."""
        if not text:
            return '""'
        parts: list[str] = []
        plain: list[int] = []
        for i in self.tok.encode(text, special=True, add_bos=False):
            if i in self.tok.special_ids:
                if plain:
                    parts.append(_string(self.tok.decode(plain)))
                    plain = []
                parts.append(f"<[{i}]>")
            else:
                plain.append(i)
        if plain:
            parts.append(_string(self.tok.decode(plain)))
        return " ".join(parts)

    def plain(self, text: str) -> bool:
        """Whether `text` is written without control tokens (it can end a text lexeme)."""
        return not any(i in self.tok.special_ids for i in self.tok.encode(text, special=True, add_bos=False))

    def schema(self, name: str) -> dict[str, Any]:
        """A function's parameters (an object with any properties where it declares none)."""
        s = self.tools.schemas.get(name) or {}
        self._strict = name in self.tools.strict
        return dict(s) if s else {"type": "object"}

    def json(self, schema: Mapping[str, Any]) -> str:
        """A JSON value matching `schema` (with the $defs of the parameters it sits in, which its $refs name)."""
        s = dict(schema)
        for key in ("$defs", "definitions"):
            if key in self._root and key not in s:
                s[key] = self._root[key]
        if not self._strict:  # lenient (text/grammar.py): what cannot be enforced is dropped, and named
            s, dropped = without_bad_patterns(s)
            self._note(dropped)
        s["x-guidance"] = json_options(self._strict)
        return "%json " + json.dumps(s, ensure_ascii=False)

    def _note(self, keywords: list[str]) -> None:
        self.unenforced += [k for k in keywords if k not in self.unenforced]

    def is_text(self, name: str, key: str) -> bool:
        """Whether the XML-like readers take this parameter's value as text (a string, or a schema that does not
        say), not as JSON: the value is written as they read it."""
        types = self.tools.types(name, key)
        return types is None or "string" in types

    def text(self, schema: Mapping[str, Any], close: str, edges: bool, tags: tuple[str, ...] = ()) -> str:
        """A string parameter's raw text then `close` (its closing tag): an enum's or a const's words, else text
        of the schema's minLength..maxLength characters. The text holds neither `close` nor any of `tags` (the
        format's enclosing end tags, which its reader finds first). `edges` False: no newline first or last (the
        readers drop one there as the format's own). A schema's `pattern` and `format` are not enforced on raw
        text."""
        words = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(words, list) and words and all(isinstance(w, str) for w in words):
            return "(" + " | ".join(_string(w) for w in words) + ") " + self.lit(close)
        self._note(["pattern"] if "pattern" in schema else [])
        self._note([f"format:{schema['format']}"] if isinstance(schema.get("format"), str) else [])
        lo = _count(schema.get("minLength"), 0)
        hi = _count(schema.get("maxLength"), None)
        body = f"(?s:.{{{lo},{'' if hi is None else hi}}})"
        name = self._token()
        ends = [t for t in (close.lstrip("\n"), *tags) if self.plain(t)]
        if self.plain(close):  # one lexeme up to the first closing tag: the value may hold anything else
            c = regex_escape(close)
            rx = f"/{body}{c}/"
            tail = "(?s:.+)"
        else:  # a closing tag that starts with a control token: text can never run into it
            c, rx, tail = "", f"/{body}/", "(?s:.*)"
        if ends:
            rx += f" & ~/(?s:.*)({'|'.join(regex_escape(t) for t in ends)}){tail}/"
        if not edges:
            rx += f" & ~/\\n(?s:.*)/ & ~/(?s:.*)\\n{c}/"
        self._defs.append(f"{name}: {rx}")
        return name if c else f"{name} {self.lit(close)}"

    def number(self) -> str:
        """A call's index where a format writes one (Kimi's functions.NAME:N)."""
        name = self._token()
        self._defs.append(f"{name}: /[0-9]{{1,3}}/")
        return name

    def params(self, name: str, one: Callable[[str, Mapping[str, Any], bool], str]) -> str:
        """A function's arguments written one element each (the XML-like formats), in the schema's order: the
        required ones always, the others optionally. `one(key, schema, text)` is the element's expression."""
        root = self._root = self.schema(name)
        props = root.get("properties")
        if not isinstance(props, Mapping):
            return '""'
        required = set(root.get("required") or ())
        # what of the object itself its elements do not write (reported, not refused: these formats' limit, even
        # for a strict function, whose other keywords are enforced; only its declared properties are written)
        self._note([k for k in root if k in _OBJECT_ONLY_AS_JSON])
        parts = []
        for key, schema in props.items():
            expr = one(key, schema if isinstance(schema, Mapping) else {}, self.is_text(name, key))
            parts.append(f"({expr})" if key in required else f"({expr})?")
        return " ".join(parts) or '""'

    def calls(self, call: Callable[[str], str], sep: str = "") -> str:
        """One call to an allowed function, or several (`sep` between them) where parallel calls are allowed."""
        one = self.rule(" | ".join(f"({call(n)})" for n in self.names))
        if not self.parallel:
            return one
        return f"{one} ({self.lit(sep)} {one})*" if sep else f"{one}+"

    def rule(self, body: str) -> str:
        self._n += 1
        name = f"r{self._n}"
        self._defs.append(f"{name}: {body}")
        return name

    def _token(self) -> str:
        self._n += 1
        return f"T{self._n}"

    def build(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self._defs]) + "\n"


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _count(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default
