"""One conversation's turns: send, stop, regenerate, edit-and-resend, saved as they stream (Qt-free)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, cast

from runmyai.chat.store import TURN_BREAK, ConversationStore, Message, StoreError
from runmyai.chat.tools import ToolCall, ToolRound, ToolRunner
from runmyai.engine.client import ChatClient, ChatDelta, ChatError, ToolCallAccumulator

Sink = Callable[[str], None]  # receives each new piece of a streaming reply (its text, or its reasoning)

SAVE_EVERY_S = 1.0  # a streaming reply is saved this often, so a crash keeps what had arrived
TITLE_CHARS = 48
# model turns with tool calls in one reply before the model is asked to answer without tools: a model that calls
# tools in a loop must end somewhere
MAX_TOOL_ROUNDS = 8


class NoEngine(ChatError):
    def __init__(self) -> None:
        super().__init__("No model is running: pick one in the library, or connect to an endpoint.")


class ReplyCutOff(ChatError):
    """The reply broke off after some of it arrived (the engine died, the connection dropped): `message` is what
    arrived, saved and marked cut off."""

    def __init__(self, sentence: str, message: Message, status: int | None = None) -> None:
        super().__init__(sentence, status)
        self.message = message


@dataclass
class _Partial:
    """What has arrived of a streaming reply."""

    text: str = ""
    reasoning: str = ""
    rounds: list[ToolRound] = field(default_factory=list)  # its turns that called tools


@dataclass
class Reply:
    message: Message
    stopped: bool


class ChatSession:
    def __init__(
        self,
        store: ConversationStore,
        client: Callable[[], ChatClient | None],
        model_name: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.store = store
        self._client = client
        self._model_name = model_name
        self._editing: dict[int, int] = {}  # conversation → the user message being edited

    async def send(
        self,
        conversation_id: int,
        text: str,
        on_delta: Sink,
        on_reasoning: Sink | None = None,
        tools: ToolRunner | None = None,
    ) -> Reply:
        """Adds the user's message (or replaces the one being edited, dropping what followed) and replies;
        `on_reasoning` gets the model's thinking as it comes (it is saved either way). With `tools`, the model is
        offered them; its calls are run by `tools` and their results sent back, turn after turn, until it replies
        without calls (the saved reply is the text of all those turns, with its calls and their results: a reloaded
        conversation shows them, and the next request sends them back)."""
        editing = self._editing.pop(conversation_id, None)
        try:
            if editing is not None:
                self.store.edit_and_truncate(editing, text)
            else:
                if not self.store.messages(conversation_id):
                    self.store.rename(conversation_id, _title(text))
                self.store.add_message(conversation_id, "user", text)
        except StoreError as e:  # e.g. a full disk: one sentence, like any other failed turn
            raise ChatError(str(e)) from None
        return await self._reply(conversation_id, on_delta, on_reasoning, tools)

    async def regenerate(
        self,
        conversation_id: int,
        on_delta: Sink,
        on_reasoning: Sink | None = None,
        tools: ToolRunner | None = None,
        dropped: Callable[[], None] | None = None,
    ) -> Reply:
        """Answers the last question again. `dropped` is called once the old reply has left the store, before the
        new one starts (the window redraws the conversation without it)."""
        try:
            history = self.store.drop_last_assistant(conversation_id)
        except StoreError as e:
            raise ChatError(str(e)) from None
        if dropped is not None:
            dropped()
        if not history or history[-1].role != "user":
            raise ChatError("There is no question to answer again in this conversation.")
        return await self._reply(conversation_id, on_delta, on_reasoning, tools)

    def begin_edit(self, conversation_id: int) -> str | None:
        """Edit-and-resend, step one: the last user message's text (the next send replaces it)."""
        for m in reversed(self.store.messages(conversation_id)):
            if m.role == "user":
                self._editing[conversation_id] = m.id
                return m.content
        return None

    def cancel_edit(self, conversation_id: int) -> None:
        self._editing.pop(conversation_id, None)

    async def _reply(
        self, conversation_id: int, on_delta: Sink, on_reasoning: Sink | None, tools: ToolRunner | None
    ) -> Reply:
        try:
            return await self._stream_reply(conversation_id, on_delta, on_reasoning, tools)
        except StoreError as e:  # the reply could not be saved (a full disk): the stream is closed, one sentence
            raise ChatError(str(e)) from None

    async def _stream_reply(
        self, conversation_id: int, on_delta: Sink, on_reasoning: Sink | None, tools: ToolRunner | None
    ) -> Reply:
        client = self._client()
        if client is None:
            raise NoEngine()
        conv = self.store.get(conversation_id)
        if conv is None:
            raise ChatError("That conversation no longer exists.")
        payload: list[dict[str, Any]] = list(self.store.chat_payload(conversation_id))  # no earlier reasoning
        reply = _Partial()
        saved: Message | None = None
        last_save = time.monotonic()
        finish: str | None = None
        try:
            for round_ in range(MAX_TOOL_ROUNDS + 1):
                offered = tools.openai_tools() if tools is not None and round_ < MAX_TOOL_ROUNDS else []
                calls = ToolCallAccumulator()
                round_text = ""
                # aclosing: a stop closes the HTTP stream at once (the engine cancels on disconnect)
                made = (
                    client.stream_chat(payload, conv.settings, offered)
                    if offered
                    else client.stream_chat(payload, conv.settings)
                )
                stream_gen = cast(AsyncGenerator[ChatDelta, None], made)
                async with aclosing(stream_gen) as stream:
                    async for delta in stream:
                        if delta.reasoning:
                            reply.reasoning += delta.reasoning
                            if on_reasoning is not None:
                                on_reasoning(delta.reasoning)
                        if delta.text:
                            if round_ and not round_text and reply.text:
                                reply.text += TURN_BREAK  # the turns' texts around a tool call, saved as paragraphs
                            reply.text += delta.text
                            round_text += delta.text
                            on_delta(delta.text)
                        calls.add(delta.tool_calls)
                        if delta.text or delta.reasoning:
                            if saved is None:
                                saved = self.store.add_message(
                                    conversation_id,
                                    "assistant",
                                    reply.text,
                                    model=self._model_name(),
                                    reasoning=reply.reasoning,
                                )
                            elif time.monotonic() - last_save > SAVE_EVERY_S:
                                self.store.update_message(saved.id, reply.text, reasoning=reply.reasoning)
                                last_save = time.monotonic()
                        if delta.finish_reason:
                            finish = delta.finish_reason
                asked = [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls.calls()]
                if tools is None or not offered or not asked:
                    break
                # the model's turn with its calls, then one `tool` message per call, in order: the next request.
                # Saved before each call runs and after it ends, so a stop or a crash keeps the calls made so far.
                reply.rounds.append(ToolRound(len(reply.text), round_text, tuple(asked)))
                saved = self._save(conversation_id, saved, reply)
                for call in asked:
                    result = await tools.run(call)
                    reply.rounds[-1] = replace(reply.rounds[-1], results=(*reply.rounds[-1].results, result))
                    saved = self._save(conversation_id, saved, reply)
                payload += reply.rounds[-1].messages()
                finish = None
        except asyncio.CancelledError:
            self._finish(conversation_id, saved, reply, client, "stopped")
            raise
        except ChatError as e:
            if saved is not None:  # keep what arrived, marked as cut off
                cut = self._finish(conversation_id, saved, reply, client, "error")
                raise ReplyCutOff(str(e), cut, e.status) from None
            raise
        message = self._finish(conversation_id, saved, reply, client, finish or "stop")
        return Reply(message, stopped=False)

    def _save(self, conversation_id: int, saved: Message | None, reply: _Partial) -> Message:
        if saved is None:
            saved = self.store.add_message(
                conversation_id, "assistant", reply.text, model=self._model_name(), reasoning=reply.reasoning
            )
        return self.store.update_message(saved.id, reply.text, reasoning=reply.reasoning, tool_rounds=reply.rounds)

    def _finish(
        self, conversation_id: int, saved: Message | None, reply: _Partial, client: ChatClient, finish: str
    ) -> Message:
        stats = client.last_stats
        ttft = stats.ttft_s if stats else None
        rate = stats.tokens_per_s if stats else None
        tokens = stats.tokens if stats else None
        if saved is None:
            return self.store.add_message(
                conversation_id,
                "assistant",
                reply.text,
                model=self._model_name(),
                ttft_s=ttft,
                tokens_per_s=rate,
                tokens=tokens,
                finish_reason=finish,
                reasoning=reply.reasoning,
            )
        return self.store.update_message(
            saved.id,
            reply.text,
            ttft_s=ttft,
            tokens_per_s=rate,
            tokens=tokens,
            finish_reason=finish,
            reasoning=reply.reasoning,
            tool_rounds=reply.rounds,
        )


def _title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


def footer(message: Message) -> str:
    """The line under a reply: time to first token and speed."""
    parts = []
    if message.ttft_s is not None:
        parts.append(f"first token {message.ttft_s:.2f} s")
    if message.tokens_per_s:
        parts.append(f"{message.tokens_per_s:.1f} tok/s")
    if message.tokens:
        parts.append(f"{message.tokens} tokens")
    ends = {
        "stopped": "stopped",
        "error": "cut off by an error",
        "length": "max tokens reached",
        "context_full": "the context is full (start a new chat)",
    }
    if message.finish_reason in ends:
        parts.append(ends[message.finish_reason])
    return " · ".join(parts)
