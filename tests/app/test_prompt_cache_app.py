"""The app on the engine's prompt cache on disk (issue 44, item 4): the real app, engine and trained built-in demo
model, with one slot (the user's `parallel` override), so that a second chat takes the first one's context out
of RAM. Switching back to the first chat, and reopening the app, continue from the disk: the app sends the same
token prefix again (its history as the template renders it: the engine reuses the whole earlier prompt and
reply but the token the reply ended on), and the line under the reply says "context restored from disk (… s)".
Deleting a chat deletes its snapshots and no other's; Settings shows the cache and Clear empties it. The words
and the pending deletions without an engine are checked Qt-free."""

from __future__ import annotations

import asyncio
from pathlib import Path

from PySide6.QtWidgets import QApplication
from pytestqt.qtbot import QtBot

from runmyai.chat.store import ConversationStore
from runmyai.engine.client import ChatSettings
from runmyai.engine.endpoint import Endpoint
from runmyai.engine.prompt_cache import CacheUse, PendingForgets, conversation_key, restore_line, usage
from runmyai.paths import AppPaths
from runmyai.ui.controller import AppController
from runmyai.ui.main_window import MainWindow
from runmyai.ui.pages import SettingsPage
from tests.qtloop import run_qt

GREEDY = ChatSettings(temperature=0.0, max_tokens=8)


def _app(home: Path) -> tuple[MainWindow, AppController]:
    window = MainWindow()
    c = AppController(window, AppPaths(home), offline=True)  # (the bundled presets and demo model)
    window.show()
    return window, c


async def _start(c: AppController) -> Endpoint:
    await c.start()
    demo = next(m for m in c.models.local_models if m.bundled)
    c.ctx.autotune.set_override(demo.path, "parallel", 1)  # one slot: another chat takes it (the user's override)
    assert await c.engine.use_default_model() is not None
    assert c.engine.supervisor is not None and c.engine.supervisor.endpoint is not None
    return c.engine.supervisor.endpoint


async def _ask(c: AppController, text: str) -> tuple[str, int, int, int | None]:
    """A message sent as the user sends it: (the line under its reply, prompt tokens, reply tokens, restored
    tokens)."""
    await c.chat.chat_once(text)
    client = c.engine.chat_client
    assert client is not None and client.last_stats is not None
    s = client.last_stats
    assert s.prompt_tokens is not None
    lines = [ln for ln in c.window.chat.transcript.toPlainText().splitlines() if ln.startswith("first token ")]
    return lines[-1], s.prompt_tokens, s.tokens, s.restored_tokens


def test_switching_back_and_reopening_continue_from_the_disk_and_deleting_a_chat_deletes_its_contexts(
    qapp: QApplication, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    window, c = _app(home)
    chats: dict[str, int] = {}

    async def first_run() -> tuple[int, int]:
        await _start(c)
        a = c.talks.conversation_id
        assert a is not None
        c.store.set_settings(a, GREEDY)
        line, prompt, reply, restored = await _ask(c, "Tell me about the sea.")
        assert "restored" not in line and restored is None  # (nothing on the disk yet)
        c.talks.new_conversation()
        b = c.talks.conversation_id
        assert b is not None and b != a
        c.store.set_settings(b, GREEDY)
        await _ask(c, "What do birds eat in winter?")  # the one slot is B's now
        c.talks.open_conversation(a)
        line, prompt2, reply2, restored = await _ask(c, "And the rivers?")
        # A's first prompt and reply read back, not computed again: all of it but the token the reply ended on
        # (sampled, never run through the model); a history rendered differently would share less
        assert restored is not None and restored >= prompt + reply - 1, (restored, prompt, reply, prompt2)
        assert " · context restored from disk (" in line, line
        chats.update(a=a, b=b)
        await c.shutdown()
        return prompt2, reply2

    last_prompt, last_reply = run_qt(qapp, first_run)
    window.close()

    window2, c2 = _app(home)

    async def reopened() -> None:
        ep = await _start(c2)
        assert c2.talks.conversation_id == chats["a"]  # the chat used last opens first
        c2.talks.open_conversation(chats["a"])
        line, prompt, reply, restored = await _ask(c2, "And the lakes?")
        # a new engine: A's last turn read from the disk the first one left
        assert restored is not None and restored >= last_prompt + last_reply - 1, (restored, prompt, reply)
        assert "context restored from disk (" in line, line
        before = await usage(ep)
        assert before.count >= 2  # A's and B's

        # Settings shows the cache (asked when the page shows), off the UI thread
        page = c2.window.settings_page
        c2.window.show_page("Settings")
        assert c2.prompt_cache.task is not None
        await c2.prompt_cache.task
        assert page.prompt_cache.text() == before.line() and "used" in page.prompt_cache.text()
        assert page.prompt_cache_clear.isEnabled()

        # deleting A (its Undo time over) deletes A's snapshots, not B's
        c2.talks._delete_conversation(str(chats["a"]))
        c2.talks.finish_delete(chats["a"])
        assert c2.prompt_cache.task is not None
        await c2.prompt_cache.task
        after = await usage(ep)
        assert 0 < after.count < before.count and c2.prompt_cache.pending.keys() == []
        c2.talks.open_conversation(chats["b"])
        _, _, _, restored = await _ask(c2, "And in summer?")
        assert restored  # B's context is still on the disk (A's reply took the slot)

        # Clear: nothing left, and the line says so
        page.prompt_cache_clear.click()
        await c2.prompt_cache.task
        assert (await usage(ep)).count == 0
        assert page.prompt_cache.text().startswith("0 bytes of ") and not page.prompt_cache_clear.isEnabled()
        await c2.shutdown()

    run_qt(qapp, reopened)
    window2.close()


def test_the_words_and_the_keys() -> None:
    assert restore_line(None, None) == "" and restore_line(0, 0.2) == ""
    nbsp = "\u00a0"  # (between the number and its unit: a wrapped line keeps them together)
    assert restore_line(700, 0.24) == f"context restored from disk (0.2{nbsp}s)"
    assert restore_line(700, 0.034) == f"context restored from disk (0.03{nbsp}s)"
    assert restore_line(700, 0.001) == f"context restored from disk (<{nbsp}0.01{nbsp}s)"
    use = CacheUse(True, "/x", 20_000_000_000, 1_234_000_000, 3)
    assert use.line() == "1.2 GB of 20.0 GB used · 3 conversation contexts"
    assert "Off" in CacheUse(False, None, 0, 0, 0).line()
    # a conversation's key: the same for the same chat, another for another chat or another store's chat 1
    store = ConversationStore(":memory:")
    one, two = store.create(), store.create()
    assert conversation_key(one.id, one.created_at) == conversation_key(one.id, one.created_at)
    assert conversation_key(one.id, one.created_at) != conversation_key(two.id, two.created_at)
    assert conversation_key(1, 1765080000.123456) != conversation_key(1, 1765080000.123457)


def test_a_deletion_without_an_engine_waits_for_the_next_one(tmp_path: Path) -> None:
    pending = PendingForgets(tmp_path)
    pending.add("runmyai-1-2")
    pending.add("runmyai-1-2")
    pending.add("runmyai-3-4")
    assert asyncio.run(pending.flush(None)) == 0  # no engine: kept, in order, once each
    closed = Endpoint("http://127.0.0.1:9/v1", "k")  # (port 9, discard: nothing listens)
    assert asyncio.run(pending.flush(closed)) == 0
    assert PendingForgets(tmp_path).keys() == ["runmyai-1-2", "runmyai-3-4"]  # (on disk: a restart keeps them)
    remote = Endpoint.remote("http://127.0.0.1:9")
    assert asyncio.run(pending.flush(remote)) == 0  # a remote server holds none of the app's contexts
    pending.done("runmyai-1-2")
    assert pending.keys() == ["runmyai-3-4"]


def test_the_settings_section(qtbot: QtBot) -> None:
    page = SettingsPage()
    qtbot.addWidget(page)
    assert page.prompt_cache.text() == "Start a model to see what it keeps." and not page.prompt_cache_clear.isEnabled()
    use = CacheUse(True, "/x", 20_000_000_000, 1_234_000_000, 1)
    page.set_prompt_cache(use.line(), can_clear=True)
    assert page.prompt_cache.text() == "1.2 GB of 20.0 GB used · 1 conversation context"
    with qtbot.waitSignal(page.prompt_cache_clear_requested):
        page.prompt_cache_clear.click()
