"""Chat templates from model files, rendered in a sandbox: templates are untrusted input."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenwing.errors import BadInputError

MAX_TEMPLATE = 256 << 10
MAX_OUTPUT = 4 << 20


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
