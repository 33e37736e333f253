"""One conversation's turns: send, stop, regenerate, edit-and-resend, saved as they stream (Qt-free)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, cast

from runmyai.chat.images import Picture
from runmyai.chat.store import DEFAULT_TITLE, TURN_BREAK, ConversationStore, Message, StoreError
from runmyai.chat.tools import ToolCall, ToolRound, ToolRunner
from runmyai.engine.client import ChatClient, ChatDelta, ChatError, ChatSettings, ToolCallAccumulator
from runmyai.engine.prompt_cache import conversation_key

Sink = Callable[[str], None]  # receives each new piece of a streaming reply (its text, or its reasoning)

SAVE_EVERY_S = 1.0  # a streaming reply is saved this often, so a crash keeps what had arrived
TITLE_CHARS = 48
# model turns with tool calls in one reply before the model is asked to answer without tools: a model that calls
# tools in a loop must end somewhere
MAX_TOOL_ROUNDS = 8
# the reply's share of the context when the chat sets no max tokens: the rest holds the conversation (the engine's
# own default, docs/api.md). The whole context (the app's old 512 of 512) left no room for a second question.
REPLY_SHARE = 4


class NoEngine(ChatError):
    def __init__(self) -> None:
        super().__init__("No model is running: pick one in the library, or connect to an endpoint.")


class Refused(ChatError):
    """The engine refused the message before any of a reply came (HTTP 4xx: the context, the key, a bad request; or
    no engine): nothing of the turn was kept. `text` is the user's message, to give back to them."""

    def __init__(self, e: ChatError, text: str, images: Sequence[Picture] = ()) -> None:
        super().__init__(str(e), e.status, e.code)
        self.text = text
        self.images = tuple(images)  # its pictures, given back to the composer with the text
        self.cause = e


class ToolsDoNotFit(ChatError):
    """The tool definitions, the message and the reply's room are more than the context: not sent."""

    def __init__(self, servers: list[str], tools_tokens: int, needed: int, n_ctx: int) -> None:
        who = ", ".join(servers) if servers else "the MCP servers"
        super().__init__(
            f"The tools of {who} take {tools_tokens:,} tokens: with your message and the reply's room that is "
            f"{needed:,} tokens, over the model's {n_ctx:,}-token context.",
            code="tools_do_not_fit",
        )
        self.servers = servers
        self.tools_tokens = tools_tokens


def reply_tokens(settings: ChatSettings, n_ctx: int | None) -> int | None:
    """The max tokens a request asks for: the chat's own where it leaves the conversation room, else a share of the
    context (None where the context is not known: the server's default then)."""
    if n_ctx is None:
        return settings.max_tokens
    if settings.max_tokens is None or settings.max_tokens >= n_ctx:
        return max(1, n_ctx // REPLY_SHARE)
    return settings.max_tokens


def overflow_line(note: dict[str, Any]) -> str:
    """The transcript's line about what the engine dropped: "3 earlier messages (812 tokens) are out of the
    model's view: rolling window"."""
    n, tokens = int(note.get("dropped_messages", 0)), int(note.get("dropped_tokens", 0))
    how = {"rolling": "rolling window", "trim-middle": "trimmed from the middle"}.get(str(note.get("policy")), "")
    words = f"{n} earlier message{'' if n == 1 else 's'} ({tokens:,} token{'' if tokens == 1 else 's'})"
    verb = "is" if n == 1 else "are"
    return f"{words} {verb} out of the model's view{': ' + how if how else ''}."


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
    overflow: dict[str, Any] | None = None  # what the engine dropped to fit this reply's prompt


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
        saved: Callable[[Message], None] | None = None,
        images: Sequence[Picture] = (),
    ) -> Reply:
        """Adds the user's message, with `images` its pictures (chat/images.py) (or, while a message is being
        edited, a new version of it: a branch from there, the old version and what followed it kept) and replies;
        `saved` gets the message once it is in the store (the window draws it with its id: its Edit link);
        `on_reasoning` gets the model's thinking as it comes (it is saved either way). With `tools`, the model is
        offered them; its calls are run by `tools` and their results sent back, turn after turn, until it replies
        without calls (the saved reply is the text of all those turns, with its calls and their results: a reloaded
        conversation shows them, and the next request sends them back)."""
        editing = self._editing.pop(conversation_id, None)
        added: Message | None = None
        first = False
        try:
            if editing is not None:
                added = self.store.edit_as_branch(editing, text)[-1]
            else:
                if not self.store.messages(conversation_id):
                    first = True
                    self.store.rename(conversation_id, _title(text or "Picture"))
                added = self.store.add_message(conversation_id, "user", text, images=images)
        except StoreError as e:  # e.g. a full disk: one sentence, like any other failed turn
            raise ChatError(str(e)) from None
        if saved is not None and added is not None:
            saved(added)
        try:
            return await self._reply(conversation_id, on_delta, on_reasoning, tools)
        except ChatError as e:
            if added is None or not refused(e):
                raise
            # refused before any reply: the message leaves the conversation (the user gets it back to change or
            # resend); kept, it was sent again with every later message, and the chat was broken for good
            with contextlib.suppress(StoreError):
                self.store.delete_message(added.id)
                if first:
                    self.store.rename(conversation_id, DEFAULT_TITLE)
            raise Refused(e, text, images) from None

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
            before = self.store.messages(conversation_id)
            history = self.store.drop_last_assistant(conversation_id)
        except StoreError as e:
            raise ChatError(str(e)) from None
        old = before[-1] if len(before) > len(history) else None  # set aside: the new reply's sibling
        if dropped is not None:
            dropped()
        if not history or history[-1].role != "user":
            raise ChatError("There is no question to answer again in this conversation.")
        try:
            return await self._reply(conversation_id, on_delta, on_reasoning, tools)
        except ChatError:
            # nothing of a new reply was kept: the old one is the conversation's again, not a hidden branch
            path = self.store.messages(conversation_id)
            if old is not None and path and path[-1].role == "user":
                with contextlib.suppress(StoreError):
                    self.store.choose(old.id)
            raise

    def begin_edit(self, conversation_id: int, message_id: int | None = None) -> str | None:
        """Edit-and-resend, step one: the text of message `message_id` (any message of the conversation; by
        default the last user message); the next send makes its new version (`save_edit` for a reply)."""
        for m in reversed(self.store.messages(conversation_id)):
            if m.id == message_id or (message_id is None and m.role == "user"):
                self._editing[conversation_id] = m.id
                return m.content
        return None

    def editing(self, conversation_id: int) -> Message | None:
        """The message being edited, if any."""
        mid = self._editing.get(conversation_id)
        return next((m for m in self.store.messages(conversation_id) if m.id == mid), None)

    def save_edit(self, conversation_id: int, text: str) -> list[Message]:
        """Ends the edit of a reply: its new version, a branch kept beside the old (nothing is sent: the user
        wrote it). Returns the active path."""
        mid = self._editing.pop(conversation_id, None)
        if mid is None:
            return self.store.messages(conversation_id)
        try:
            return self.store.edit_as_branch(mid, text)
        except StoreError as e:
            raise ChatError(str(e)) from None

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
        settings = await self._request_settings(client, conv.settings)
        settings = replace(settings, prompt_cache_key=conversation_key(conv.id, conv.created_at))  # (its snapshots)
        if tools is not None and tools.openai_tools():
            await self._check_tools_fit(client, payload, tools, settings)
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
                    client.stream_chat(payload, settings, offered) if offered else client.stream_chat(payload, settings)
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
        overflow = client.last_stats.overflow if client.last_stats is not None else None
        self._keep_overflow(conversation_id, message, overflow)
        return Reply(message, stopped=False, overflow=overflow)

    async def _request_settings(self, client: ChatClient, settings: ChatSettings) -> ChatSettings:
        """The chat's settings as sent: max tokens a share of the context unless the chat sets a smaller one (the
        context asked of the engine once, where no reply has said it yet)."""
        if client.n_ctx is None:
            with contextlib.suppress(ChatError):  # not TokenWing (no count route): the server's default then
                await client.count([{"role": "user", "content": ""}])
        return replace(settings, max_tokens=reply_tokens(settings, client.n_ctx))

    async def _check_tools_fit(
        self, client: ChatClient, payload: list[dict[str, Any]], tools: ToolRunner, settings: ChatSettings
    ) -> None:
        """ToolsDoNotFit where the tool definitions, the system prompt, the last message and the reply's room are
        more than the context (what the engine never drops): said before sending, naming the servers."""
        kept = [m for m in payload if m.get("role") == "system"] + payload[-1:]
        try:
            count = await client.count(kept, tools.openai_tools())
        except ChatError:
            return  # a server that cannot count: the request goes, and its own error says what did not fit
        room = settings.max_tokens or 0
        if count.prompt_tokens + room > count.n_ctx:
            servers = getattr(tools, "servers", None)
            names = list(servers()) if callable(servers) else []
            raise ToolsDoNotFit(names, count.tools_tokens, count.prompt_tokens + room, count.n_ctx)

    def _keep_overflow(self, conversation_id: int, message: Message, overflow: dict[str, Any] | None) -> None:
        """The conversation keeps the last reply's context notice (its settings' JSON: no schema change), so a
        reloaded chat says it again; a reply that needed no dropping clears it."""
        conv = self.store.get(conversation_id)
        if conv is None or (overflow is None and conv.settings.overflow is None):
            return
        note = {**overflow, "message_id": message.id} if overflow is not None else None
        self.store.set_settings(conversation_id, replace(conv.settings, overflow=note))

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


def refused(e: ChatError) -> bool:
    """A refusal before any reply: nothing of the turn is to be kept."""
    if isinstance(e, ReplyCutOff):
        return False
    return isinstance(e, NoEngine | ToolsDoNotFit) or (e.status is not None and 400 <= e.status < 500)


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
        "error": "failed: cut off by an error",
        "length": "max tokens reached",
        "context_full": "the context is full (start a new chat)",
    }
    if message.finish_reason in ends:
        parts.append(ends[message.finish_reason])
    return " · ".join(parts)
