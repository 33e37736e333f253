"""A chat's turns: sending (and sending again without tools), editing, branches, regenerating, the reply
streamed into the transcript with its footer, the draft's token count, and each reply's speed recorded."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from runmyai.chat.draft_count import DraftCounter
from runmyai.chat.session import ChatSession, Refused, ReplyCutOff, Sink, footer, overflow_line
from runmyai.chat.store import ConversationStore, Message
from runmyai.engine.client import ChatError
from runmyai.engine.prompt_cache import restore_line
from runmyai.library.estimate import DEFAULT_CALIBRATION, installed_estimate
from runmyai.library.launch import launch_flags
from runmyai.speeds import chat_measurement, load_per_core, record_speed
from runmyai.ui.controllers.base import Room, Shared
from runmyai.ui.controllers.conversations import TOOLS_OFFER, ConversationsRoom
from runmyai.ui.controllers.engine import EngineRoom
from runmyai.ui.controllers.mcp import McpRoom
from runmyai.ui.transcript import failure_line
from runmyai.ui.viewmodels import context_line


class ChatRoom(Room):
    def __init__(
        self, ctx: Shared, store: ConversationStore, engine: EngineRoom, mcp: McpRoom, conversations: ConversationsRoom
    ) -> None:
        super().__init__(ctx)
        self.store = store
        self.engine = engine
        self.mcp = mcp
        self.talks = conversations
        self.session = ChatSession(store, lambda: engine.chat_client, lambda: engine.model_name)
        # the token count under the input while typing: debounced, counted by the engine on the event loop
        self.draft_counter = DraftCounter(lambda: engine.chat_client, self._draft_prompt, self._show_draft_count)
        self.reply_task: asyncio.Task[Any] | None = None
        self._footer_model: Path | None = None  # the model whose reply the chat footer's figures are of
        self.speed_task: asyncio.Task[None] | None = None  # saving the last reply's measured speed
        chat = self.window.chat
        chat.send_requested.connect(self.send)
        chat.stop_requested.connect(self.stop_reply)
        chat.regenerate_requested.connect(self.regenerate)
        chat.edit_last_requested.connect(self._edit_last)
        chat.transcript.edit_requested.connect(self._edit_message)
        chat.transcript.branch_requested.connect(self._switch_branch)
        chat.draft_changed.connect(self.draft_counter.changed)
        engine.lib.deleted.connect(self.forget_footer_of)

    def busy(self) -> bool:
        """A reply streams."""
        return self.reply_task is not None and not self.reply_task.done()

    async def end_reply(self) -> None:
        """A reply in flight ends as stopped, as Stop ends it (and is awaited; not the task that asks)."""
        reply = self.reply_task
        if reply is not None and not reply.done() and reply is not asyncio.current_task():
            reply.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reply

    def send(self, text: str) -> None:
        cid = self.talks.conversation_id
        if cid is None:
            return
        editing = self.session.editing(cid)
        if editing is not None and editing.role == "assistant":  # a reply's new version, the user's own words
            try:
                self.session.save_edit(cid, text)
            except ChatError as e:
                self.ctx.report(str(e), "chat", "Editing a reply")
            self.talks.open_conversation(cid)
            self.window.chat.set_status("Saved as a new version of the reply (< > shows the old one).")
            return

        def show(message: Message) -> None:
            # the message as saved, with its id (its Edit link); an edit: the new branch, up to the edited message
            t = self.window.chat.transcript
            if editing is not None:
                self.talks.open_conversation(cid, while_streaming=True)
            else:
                t.add_message("user", message.content, message_id=message.id, images=[p.png for p in pictures])
            t.begin_reply()

        tools = self.mcp.tools(cid)
        # the composer's pictures go with a new message (an edited one keeps its own: the store's edit_as_branch)
        pictures = self.window.chat.take_pictures() if editing is None else []
        self.reply_task = self.ctx.spawn(
            self._stream(
                lambda text_to, reasoning_to: self.session.send(
                    cid, text, text_to, reasoning_to, tools, saved=show, images=pictures
                ),
                begin=False,
                tools_on=tools is not None,
            )
        )

    def _send_without_tools(self, cid: int, text: str) -> None:
        """The "tools do not fit" offer's button: tools off in that chat, and the same message sent again."""
        if cid != self.talks.conversation_id or self.busy():
            return
        self.talks.set_tools(on=False)
        if self.window.chat.input.toPlainText().strip() == text.strip():
            self.window.chat.input.clear()
        self.send(text)

    def _edit_message(self, message_id: int | None = None) -> None:
        """Edit any message (the transcript's Edit; Edit last: the last question): its text in the input box;
        sending makes a new version of it, a branch, and the old one stays behind "< >"."""
        cid = self.talks.conversation_id
        if cid is None or self.busy():
            return
        text = self.session.begin_edit(cid, message_id)
        if text is None:
            return
        editing = self.session.editing(cid)
        self.window.chat.input.setPlainText(text)
        self.window.chat.input.setFocus()
        if editing is not None and editing.role == "assistant":
            self.window.chat.set_status("Editing a reply: Send saves your version beside the model's.")
        else:
            self.window.chat.set_status("Editing a message: sending starts a new branch from it; the old one stays.")

    def _switch_branch(self, message_id: int, step: int) -> None:
        """A message's "<" or ">": that version of the turn, with its own continuation."""
        cid = self.talks.conversation_id
        if cid is None or self.busy():
            return
        self.session.cancel_edit(cid)
        self.store.switch_branch(message_id, step)
        self.talks.open_conversation(cid)

    def regenerate(self) -> None:
        cid = self.talks.conversation_id
        if cid is None:
            return

        def redraw() -> None:
            # the dropped reply leaves the transcript: this task is the streaming one, so the redraw is its own
            # (issue 29, defect 5: the redraw came before the drop, and open_conversation refused it while a
            # reply streamed, so the old reply stayed on screen above the new one)
            self.talks.open_conversation(cid, while_streaming=True)
            self.window.chat.transcript.begin_reply()

        tools = self.mcp.tools(cid)

        async def again(text_to: Sink, reasoning_to: Sink) -> Any:
            return await self.session.regenerate(cid, text_to, reasoning_to, tools, dropped=redraw)

        self.reply_task = self.ctx.spawn(self._stream(again, begin=False, tools_on=tools is not None))

    def _edit_last(self) -> None:
        self._edit_message(None)

    async def _stream(
        self, turn: Callable[[Sink, Sink], Awaitable[Any]], begin: bool = True, tools_on: bool = False
    ) -> None:
        chat = self.window.chat
        transcript = chat.transcript
        cid = self.talks.conversation_id
        chat.set_busy(True)
        # an earlier turn's failure is not this one's: its banner stayed up during a regenerate that worked
        self.window.notifications.forget("chat")
        self.window.notifications.forget(TOOLS_OFFER)
        if begin:
            transcript.begin_reply()
        chat.set_status("Thinking…")
        try:
            reply = await turn(transcript.append_reply, transcript.append_reasoning)
            mid = reply.message.id  # (the reply's own line; the footer has speed, context)
            notice = overflow_line(reply.overflow) if reply.overflow else ""  # what the model no longer sees
            line = " · ".join(x for x in (footer(reply.message), self._restored()) if x)
            transcript.end_reply(line, message_id=mid, branch=self._branch_of(mid), notice=notice)
            name = self.engine.model_name
            chat.set_status(f"Chatting with {name}." if name else "")
            self._show_footer()
            self._record_chat_speed(reply.message)
            self.window.notifications.succeeded("chat")
        except asyncio.CancelledError:
            for key in self.mcp.tool_keys.values():  # a call (or its question) the stop cut short
                transcript.update_tool_call(key, "stopped")
            transcript.end_reply("stopped")
            chat.set_status("Stopped.")
        except Refused as e:
            # nothing of the turn was kept: it leaves the transcript too, and the message goes back to the input
            if cid is not None and cid == self.talks.conversation_id:
                self.talks.open_conversation(cid, while_streaming=True)
                if not chat.input.toPlainText().strip():
                    chat.input.setPlainText(e.text)
                chat.add_pictures(list(e.images))  # (its pictures back in the composer too)
            chat.set_status(str(e))
            self.window.log_view.append(f"[chat] {e}")
            # the offer only where the tools are what does not fit (a message too long for any context is not)
            tools_too_big = e.code == "tools_do_not_fit" or (e.code == "context_length_exceeded" and "tool" in str(e))
            if tools_on and cid is not None and tools_too_big:
                self.ctx.retry[TOOLS_OFFER] = functools.partial(self._send_without_tools, cid, e.text)
                self.window.notifications.offer(TOOLS_OFFER, "The tools do not fit", str(e), "Chat without tools")
            else:
                self.window.notifications.fail("chat", "The message was not sent", str(e), retry=False)
        except ChatError as e:
            # what arrived before a fault stays, marked cut off as it is in the store; a reply that failed is
            # marked failed, with the reason (it was an empty "Assistant" turn)
            transcript.end_reply(footer(e.message) if isinstance(e, ReplyCutOff) else "", failure=failure_line(str(e)))
            chat.set_status(str(e))
            self.window.log_view.append(f"[chat] {e}")
            self.window.notifications.fail("chat", "The reply failed", str(e), retry=False)
        finally:
            self.mcp.tool_keys.clear()
            chat.set_busy(False)
            if self.talks.conversation_id is not None:
                self.talks.list_conversations()

    def _draft_prompt(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """What the next request would carry before the draft: the current chat's messages and its tools."""
        cid = self.talks.conversation_id
        if cid is None or self.store.get(cid) is None:
            return [], None
        runner = self.mcp.tools(cid)
        return self.store.chat_payload(cid), (runner.openai_tools() or None) if runner is not None else None

    def _show_draft_count(self, line: str) -> None:
        self.window.chat.token_label.setText(line)

    def _branch_of(self, message_id: int) -> tuple[int, int] | None:
        n, of = self.store.branch_position(message_id)
        return (n, of) if of > 1 else None

    def _restored(self) -> str:
        """The reply's line says where its context came from the disk (the chat's footer has no room beside the
        status and the context at 1280 x 800): "context restored from disk (0.2 s)"."""
        client = self.engine.chat_client
        stats = client.last_stats if client is not None else None
        return restore_line(stats.restored_tokens, stats.restore_s) if stats is not None else ""

    def _show_footer(self) -> None:
        """The chat footer: the last reply's speed and how much of the context the conversation now holds."""
        client = self.engine.chat_client
        stats = client.last_stats if client is not None else None
        if stats is None:
            return
        # "last reply": the whole reply as the app received it (the performance panel's is the engine's, live)
        speed = f"last reply {stats.tokens_per_s:.1f} tok/s" if stats.tokens_per_s else ""
        used = (stats.prompt_tokens or 0) + stats.tokens if stats.prompt_tokens is not None else None
        self.window.chat.set_footer(speed, context_line(used, stats.n_ctx))
        self._footer_model = self.engine.in_use()[0]

    def forget_footer_of(self, path: Path) -> None:
        """The footer's speed and context figures go with the model they are of (they stayed after it was deleted)."""
        if self._footer_model == path:
            self.window.chat.set_footer("", context_line(None, None))
            self._footer_model = None

    def _record_chat_speed(self, message: Message) -> None:
        """A finished reply's speed joins this machine's measurements (runmyai.speeds), which calibrate every
        estimate and give the model's card its measured range; then the cards are worked out again. With it, what
        the class defaults predict for this model as launched, which the calibration compares it with."""
        in_use, machine, lib = self.engine.in_use()[0], self.ctx.machine, self.engine.lib
        local, preset = lib.local_of(in_use) if in_use is not None else (None, None)
        if local is None or machine is None:
            return  # (a remote endpoint's speed is not this machine's)
        flags = launch_flags(local.path, local, preset, self.ctx.autotune, self.ctx.engine_info)
        est = installed_estimate(local, preset, machine, self.ctx.engine_info, flags, calibration=DEFAULT_CALIBRATION)
        if est is None:
            return
        m = chat_measurement(
            local.path, message.tokens_per_s, message.tokens, est.compute_seconds, est.io_seconds, load=load_per_core()
        )
        if m is None:
            return

        async def record() -> None:
            try:
                speeds = await asyncio.to_thread(record_speed, self.ctx.paths.settings, m)
            except OSError as e:
                self.window.log_view.append(f"[app] the measured speed could not be saved: {e}")
                return
            if self.ctx.machine is not None:
                self.ctx.machine = replace(self.ctx.machine, speeds=speeds)
                lib.list_entries()
                lib.show_models()

        self.speed_task = self.ctx.spawn(record())  # (tests wait for it)

    def stop_reply(self) -> None:
        if self.reply_task is not None and not self.reply_task.done():
            self.reply_task.cancel()

    async def chat_once(self, text: str, timeout_s: float = 120) -> str:
        """Sends a message in the current conversation and waits for the reply (self-test and tests)."""
        self.send(text)
        task = self.reply_task
        assert task is not None
        await asyncio.wait_for(asyncio.shield(task), timeout_s)
        cid = self.talks.conversation_id
        messages = self.store.messages(cid) if cid is not None else []
        return messages[-1].content if messages and messages[-1].role == "assistant" else ""
