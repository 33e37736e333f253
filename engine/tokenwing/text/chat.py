"""Chat templates from model files, rendered in a sandbox: templates are untrusted input."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenwing.errors import BadInputError

MAX_TEMPLATE = 256 << 10
MAX_OUTPUT = 4 << 20

# What llama.cpp's server and the desktop apps use for a model whose file has no chat template: ChatML.
FALLBACK_NAME = "chatml"
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
FALLBACK_STOP = "<|im_end|>"  # the turn's end, as text when the vocabulary has no such token


def _raise(message: str) -> None:
    raise BadInputError(f"the chat template refused the conversation: {message}")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        if len(source) > MAX_TEMPLATE:
            raise BadInputError("the chat template is too large")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
        env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise BadInputError(f"the chat template does not parse: {e}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.source = source

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        try:
            out = self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
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
        if len(out) > MAX_OUTPUT:
            raise BadInputError("the chat template produced an oversized prompt")
        return out


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
        from tokenwing.text.reasoning import harmony_template

        return ChatFormat(own, reasoning="harmony" if harmony_template(own.source) else None)
    return ChatFormat(ChatTemplate(CHATML), FALLBACK_NAME, (FALLBACK_STOP,))


FALLBACK_NOTICE = "the model has no chat template: chats use the ChatML fallback"
