"""The token count under the input box while the user types (Qt-free): debounced, asked of the engine's own
tokenizer and template (`POST /v1/chat/count`) on the event loop, never on the UI's event handling.

The draft's tokens are the prompt with it (the conversation, the draft as the next user message, the tools) less
the prompt without it, so the number is what sending it adds, template tokens included; the room left is the
context less the prompt with it. The prompt without the draft is asked once per conversation state, not per key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from runmyai.engine.client import ChatError, TokenCount

DEBOUNCE_S = 0.3  # typing pauses this long before the engine is asked (a count per key would load a busy engine)


class Counter(Protocol):
    async def count(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> TokenCount: ...


Prompt = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]  # the conversation's messages and its tools


@dataclass(frozen=True)
class DraftCount:
    tokens: int  # what the draft adds to the prompt
    prompt_tokens: int  # the prompt with the draft (and the tools)
    n_ctx: int | None

    def line(self) -> str:
        """ "12 tokens · 1,928 of 2,048 context tokens left" (or over it, or the count alone)."""
        words = f"{self.tokens:,} token{'' if self.tokens == 1 else 's'}"
        if not self.n_ctx:
            return words
        left = self.n_ctx - self.prompt_tokens
        if left < 0:
            return f"{words} · the chat would be {-left:,} over the {self.n_ctx:,}-token context"
        return f"{words} · {left:,} of {self.n_ctx:,} context tokens left"


class DraftCounter:
    """`changed(text)` at every edit of the draft; `shown(line)` gets the line to show ("" when the draft is empty
    or there is nothing to count with). `client()` is the engine's client (None: no model loaded), `prompt()` the
    conversation's messages and tools as the next request would send them."""

    def __init__(
        self,
        client: Callable[[], Counter | None],
        prompt: Callable[[], Prompt],
        shown: Callable[[str], None],
        debounce_s: float = DEBOUNCE_S,
    ) -> None:
        self._client = client
        self._prompt = prompt
        self._shown = shown
        self.debounce_s = debounce_s
        self.task: asyncio.Task[DraftCount | None] | None = None  # the count in wait or in flight (tests await it)
        self._base: tuple[str, int] | None = None  # (the prompt without the draft, as JSON; its tokens)
        self.requests = 0  # counts asked of the engine (a test sees the debounce in it)

    def changed(self, text: str) -> None:
        """A new draft: the count in wait or in flight is dropped, a new one starts after the pause."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if not text.strip():
            self.task = None
            self._shown("")
            return
        self.task = asyncio.ensure_future(self._after_pause(text))

    def forget(self) -> None:
        """The conversation changed (another one, a reply, an edit): its prompt is asked again."""
        self._base = None

    async def _after_pause(self, text: str) -> DraftCount | None:
        await asyncio.sleep(self.debounce_s)
        result = await self.count(text)
        self._shown(result.line() if result is not None else "")
        return result

    async def count(self, text: str) -> DraftCount | None:
        """The draft's count now (no pause); None when there is no engine or it cannot count (another server)."""
        client = self._client()
        if client is None:
            return None
        messages, tools = self._prompt()
        draft = [*messages, {"role": "user", "content": text}]
        key = json.dumps([messages, tools], sort_keys=True)
        try:
            with_draft = await self._ask(client, draft, tools)
            if self._base is None or self._base[0] != key:
                # a first message: the prompt without it would be the tools alone (the engine counts no empty
                # chat), so the rest, the template's tokens around the message included, is the draft's
                base = (await self._ask(client, messages, tools)).prompt_tokens if messages else with_draft.tools_tokens
                self._base = (key, base)
        except ChatError:
            return None
        return DraftCount(max(0, with_draft.prompt_tokens - self._base[1]), with_draft.prompt_tokens, with_draft.n_ctx)

    async def _ask(
        self, client: Counter, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> TokenCount:
        self.requests += 1
        return await client.count(messages, tools)

    async def aclose(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
