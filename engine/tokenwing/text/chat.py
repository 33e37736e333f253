"""Chat templates from model files, rendered in a sandbox: templates are untrusted input.

A template renders exactly as Hugging Face's `apply_chat_template` renders it (transformers'
`utils/chat_template_utils.py`), because that is what the publishers write and test their templates against:
the same Jinja environment (sandboxed, trim_blocks, lstrip_blocks, loop controls, the `{% generation %}` tag),
the same helpers (`tojson` without ASCII escaping or key sorting, `raise_exception`, `strftime_now`, `dict`,
`namespace`), the same variables (`messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens,
extra keyword arguments) and the same preparation of the messages (keys whose value is null dropped, the
reasoning copied under the names templates read). tests/text/test_chat_templates.py checks this against
transformers itself on the publishers' templates."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.parser import Parser
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment, modifies_known_mutable
from jinja2.utils import Namespace

from tokenwing.errors import BadInputError
from tokenwing.text import render_worker
from tokenwing.text.reasoning import harmony_template

MAX_TEMPLATE = 256 << 10
MAX_OUTPUT = 4 << 20
MAX_JSON_FORMAT = 256  # the longest `indent` or separator a template's tojson may ask for (characters)

# What llama.cpp's server and the desktop apps use for a model whose file has no chat template: ChatML.
FALLBACK_NAME = "chatml"
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
FALLBACK_STOP = "<|im_end|>"  # the turn's end, as text when the vocabulary has no such token

# The names a message's reasoning comes under; Hugging Face fills the first (what most templates read) and
# `thinking` (what gpt-oss's reads) from whichever is set.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _raise(message: str) -> None:
    raise BadInputError(f"the chat template refused the conversation: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson sorts keys and escapes <, >, & and ' for HTML: the publishers' templates expect JSON as
    # Python writes it, which is what the model was trained on.
    if (isinstance(indent, int) and indent > MAX_JSON_FORMAT) or len(str(indent)) > MAX_JSON_FORMAT:
        raise BadInputError("the chat template asked tojson for an oversized indent")
    if separators is not None and sum(len(str(s)) for s in separators) > MAX_JSON_FORMAT:
        raise BadInputError("the chat template asked tojson for oversized separators")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict` in templates: a call builds a dict, `dict.fromkeys` too; nothing else of the type is reachable."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace attribute cannot start with an underscore: {name!r}")


class _Namespace(Namespace):
    """`namespace()` whose attribute names may not start with an underscore (Hugging Face's rule: a template
    must not reach the Python internals behind such names)."""

    # The first positional argument is the instance, as in Jinja's own Namespace: `namespace(self=1)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        Namespace.__setitem__(self, name, value)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks the assistant's part for training masks in Hugging Face's
    renderer; rendering a prompt it is only its body, but a template that uses it must parse."""

    tags = {"generation"}  # noqa: RUF012 (Jinja declares it a plain attribute: a ClassVar fails mypy)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        # A call block, as Hugging Face's: its body is a scope of its own (a `set` inside stays inside).
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> Any:
        return caller()


class _Bounded(SandboxedEnvironment):
    """A sandbox with the operators that can build a huge value in one step checked first: `'x' * 10**9` or a
    string doubled in a loop would exhaust memory before the output limit is reached."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                _bound(len(left) + len(right))
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    _bound(len(seq) * n)
        elif isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _bound(right * abs(left).bit_length() // 8)  # bytes of the power
        return self.binop_table[operator](left, right)


class _Sandbox(_Bounded, ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, as Hugging Face renders in."""


class _Mutable(_Bounded):
    """The fallback for a template that changes its own lists or dicts (Kimi K2-Instruct's and K2-Thinking's append
    to a list for each call in the history): Hugging Face's immutable sandbox refuses it — so transformers cannot
    render such a conversation at all — while llama.cpp's own renderer lets it. Here too the template only ever
    sees copies of the request's values (`_plain`), so changing them harms nothing; each change is bounded as the
    operators are."""

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().call(__context, __obj, *args, **kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, list | dict | set) and modifies_known_mutable(owner, getattr(__obj, "__name__", "")):
            _bound(len(owner))
        return out


def _mutation_refused(e: Exception) -> bool:
    """Whether the immutable sandbox refused a template's change to one of its own lists, dicts or sets."""
    m = re.fullmatch(r"access to attribute '(\w+)' of '(list|dict|set)' object is unsafe\.?", str(e))
    return m is not None and modifies_known_mutable({"list": [], "dict": {}, "set": set()}[m[2]], m[1])


def _bound(size: int) -> None:
    if size > MAX_OUTPUT:
        raise BadInputError("the chat template built an oversized value")


def _environment(mutable: bool = False) -> SandboxedEnvironment:
    env = (_Mutable if mutable else _Sandbox)(
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],  # loopcontrols: {% break %} and {% continue %}
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    return env


def _compile(source: str, mutable: bool = False) -> jinja2.Template:
    """The template compiled (in the renderer child: ChatTemplate), or one line saying why it cannot be."""
    try:
        return _environment(mutable).from_string(source)
    except jinja2.TemplateError as e:
        raise BadInputError(f"the chat template does not parse: {e}") from None
    except RecursionError:
        raise BadInputError("the chat template does not parse: it is nested too deeply") from None


def _plain(value: Any) -> Any:
    """A copy of `value` made of plain JSON-like types only: what a template sees cannot be an object with
    methods the sandbox does not know (Hugging Face does the same, and shows other objects as `<TypeName>`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise BadInputError(f"the chat template needs messages as objects: messages[{i}] is not one")
    # Keys whose value is null are dropped: templates test for a missing key, and would print "None" for a null.
    out: dict[str, Any] = _plain({k: v for k, v in m.items() if v is not None})
    reasoning = next((out[k] for k in REASONING_KEYS if out.get(k) is not None), None)
    if reasoning is not None:
        # The same keys in the same order as Hugging Face's: `thinking` first where it was missing, then the
        # message's own, then `reasoning_content` (where the message had it, or last).
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class ChatTemplate:
    """`bos_token` / `eos_token`: the texts of the model's BOS and EOS tokens, as templates see them (None: the
    model has none, the variable is undefined). `drop_leading_bos`: the tokenizer adds the BOS token itself, so a
    rendered prompt that starts with its text loses it (llama.cpp does the same), or the model would see two."""

    def __init__(
        self,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        *,
        drop_leading_bos: bool = False,
    ) -> None:
        if len(source) > MAX_TEMPLATE:
            raise BadInputError("the chat template is too large")
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.drop_leading_bos = drop_leading_bos
        self.source = source
        self._template: jinja2.Template | None = None  # (compiled where it renders)
        self._mutable: jinja2.Template | None = None  # (`_Mutable`'s, compiled when first needed)
        if os.environ.get(render_worker.IN_PROCESS_ENV):
            self._template = _compile(source)
        else:
            # Compiled in the renderer child, within the budget a render has: Jinja evaluates constant expressions
            # as it compiles ("{{ 'a'|center(1500000000) }}" took 1.5 GB of the engine's own memory at load) and
            # a deeply nested one is a RecursionError in its parser. Here the template is only named; the child
            # keeps its compiled form for the renders.
            render_worker.compile_template(self._identity())

    def _identity(self) -> dict[str, Any]:
        """What the renderer child compiles this template from."""
        return {
            "source": self.source,
            "bos": self.bos_token,
            "eos": self.eos_token,
            "drop_leading_bos": self.drop_leading_bos,
        }

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt for `messages`. `tools`: OpenAI function definitions (JSON schemas), `documents`: for
        retrieval templates, `extra`: more template variables (`enable_thinking`, `reasoning_effort`, …), which
        may override the special tokens' texts, as in Hugging Face's renderer."""
        if not messages:
            raise BadInputError("the chat template needs at least one message")
        msgs = [_message(m, i) for i, m in enumerate(messages)]
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise BadInputError("the chat template needs tools as objects (JSON schemas)")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise BadInputError("the chat template needs documents as objects")
        variables: dict[str, Any] = {}
        if self.bos_token is not None:
            variables["bos_token"] = self.bos_token
        if self.eos_token is not None:
            variables["eos_token"] = self.eos_token
        variables.update(_plain(extra))
        tools_plain = _plain(list(tools)) if tools is not None else None
        documents_plain = _plain(list(documents)) if documents is not None else None
        if os.environ.get(render_worker.IN_PROCESS_ENV):
            return self.render_here(msgs, add_generation_prompt, tools_plain, documents_plain, variables)
        # In the renderer child, within its budget (render_worker.py): a template must not take the engine down
        return render_worker.render(
            {
                **self._identity(),
                "messages": msgs,
                "add_generation_prompt": add_generation_prompt,
                "tools": tools_plain,
                "documents": documents_plain,
                "variables": variables,
            }
        )

    def render_here(
        self,
        msgs: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[Any] | None,
        documents: list[Any] | None,
        variables: dict[str, Any],
    ) -> str:
        """`render` in this process, of values `render` prepared: what the renderer child runs."""
        variables = {**variables, "add_generation_prompt": add_generation_prompt}
        try:
            try:
                if self._template is None:
                    self._template = _compile(self.source)
                out = self._generate(self._template, msgs, tools, documents, variables)
            except jinja2.exceptions.SecurityError as e:
                if not _mutation_refused(e):
                    raise
                if self._mutable is None:
                    self._mutable = _compile(self.source, mutable=True)
                out = self._generate(self._mutable, msgs, tools, documents, variables)
        except BadInputError:
            raise
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            AttributeError,
            KeyError,
            IndexError,
            RecursionError,
            OverflowError,
            ZeroDivisionError,
        ) as e:
            raise BadInputError(f"the chat template failed: {type(e).__name__}: {e}") from None
        if self.drop_leading_bos and self.bos_token and out.startswith(self.bos_token):
            out = out[len(self.bos_token) :]
        return out

    @staticmethod
    def _generate(
        template: jinja2.Template,
        msgs: list[dict[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        documents: Sequence[Mapping[str, Any]] | None,
        variables: dict[str, Any],
    ) -> str:
        parts: list[str] = []
        size = 0
        # Chunk by chunk, so a template that writes without end is stopped at the limit, not at memory's end; from
        # fresh copies of the values each time (a template may change its own).
        for part in template.generate(
            messages=_plain(msgs),
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            **_plain(variables),
        ):
            size += len(part)
            if size > MAX_OUTPUT:
                raise BadInputError("the chat template produced an oversized prompt")
            parts.append(part)
        return "".join(parts)


@dataclass(frozen=True)
class ChatFormat:
    """The template a chat is rendered with: the model's own, or the ChatML fallback (`fallback` names it)."""

    template: ChatTemplate
    fallback: str | None = None
    stops: tuple[str, ...] = ()
    reasoning: str | None = None  # "harmony": replies carry an analysis channel (gpt-oss), split into reasoning

    def describe(self) -> str:
        return f"fallback ({self.fallback})" if self.fallback else "model"


def chat_format(own: ChatTemplate | None) -> ChatFormat:
    """The model's template, or ChatML with its end-of-turn text as a stop string, so any chat client works
    with any model."""
    if own is not None:
        return ChatFormat(own, reasoning="harmony" if harmony_template(own.source) else None)
    return ChatFormat(ChatTemplate(CHATML), FALLBACK_NAME, (FALLBACK_STOP,))


FALLBACK_NOTICE = "the model has no chat template: chats use the ChatML fallback"
