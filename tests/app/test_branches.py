"""Edit any message, with branches: the session against the real engine (what each request carried), and the
window's Edit and "< n/of >" links clicked for real."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QApplication
from pytestqt.qtbot import QtBot

from runmyai.chat.session import ChatSession
from runmyai.chat.store import ConversationStore
from runmyai.engine.client import ChatError, ChatSettings
from runmyai.ui.transcript import Transcript
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller
from tests.app.test_engine_client import KEY, Engine
from tests.app.test_reasoning import RecordingClient
from tests.conftest import ModelFactory
from tests.qtloop import run_qt

SHORT = ChatSettings(max_tokens=6, seed=1)  # the replies' words do not matter here, only where they go


@pytest.fixture(scope="module")
def engine(repacked_factory: ModelFactory) -> Iterator[Engine]:
    e = Engine(repacked_factory(type="Q8_0", n_layer=3))
    yield e
    e.stop()


def users(sent: list[dict[str, object]]) -> list[object]:
    return [m["content"] for m in sent if m["role"] == "user"]


def test_editing_an_early_message_sends_only_its_branch_and_switching_back_resumes_the_old(
    engine: Engine, tmp_path: Path
) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    client = RecordingClient(engine.endpoint)
    session = ChatSession(store, lambda: client)
    conv = store.create(settings=SHORT)

    async def main() -> None:
        try:
            await session.send(conv.id, "one", lambda _: None)
            await session.send(conv.id, "two", lambda _: None)
            first = store.messages(conv.id)[0]
            saved: list[str] = []
            assert session.begin_edit(conv.id, first.id) == "one"  # the FIRST message, not the last user one
            await session.send(conv.id, "ONE", lambda _: None, saved=lambda m: saved.append(m.content))
            assert saved == ["ONE"]
            assert users(client.sent[-1]) == ["ONE"]  # the new branch alone went to the engine
            path = store.messages(conv.id)
            assert [m.role for m in path] == ["user", "assistant"] and path[0].content == "ONE"
            assert store.branch_positions(conv.id) == {path[0].id: (2, 2)}

            old = store.switch_branch(path[0].id, -1)  # back: the old branch with its own continuation
            assert [m.content for m in old if m.role == "user"] == ["one", "two"]
            await session.send(conv.id, "three", lambda _: None)
            assert users(client.sent[-1]) == ["one", "two", "three"]  # the old branch's path, "ONE" not in it

            # regenerate: the old reply stays as a sibling of the new one
            before = store.messages(conv.id)[-1]
            await session.regenerate(conv.id, lambda _: None)
            assert users(client.sent[-1]) == ["one", "two", "three"]
            assert client.sent[-1][-1] == {"role": "user", "content": "three"}  # the old reply is not sent
            new = store.messages(conv.id)[-1]
            assert new.id != before.id and store.branch_position(new.id) == (2, 2)
            assert store.switch_branch(new.id, -1)[-1].id == before.id
        finally:
            await client.aclose()

    asyncio.run(main())
    store.close()


def click_at(t: Transcript, qtbot: QtBot, position: int) -> None:
    """A real left click in the middle of the character at `position` of the transcript's document."""
    cursor = QTextCursor(t.document())
    cursor.setPosition(position)
    t.setTextCursor(cursor)
    t.ensureCursorVisible()
    left = t.cursorRect(cursor)
    cursor.setPosition(position + 1)
    right = t.cursorRect(cursor)
    qtbot.mouseClick(
        t.viewport(), Qt.MouseButton.LeftButton, pos=QPoint((left.left() + right.left()) // 2, left.center().y())
    )


def click_link(t: Transcript, qtbot: QtBot, text: str) -> None:
    """A real click on the first occurrence of a link's words."""
    found = t.document().find(text)
    assert not found.isNull(), text
    click_at(t, qtbot, found.selectionStart() + len(text) // 2)


def click_arrow(t: Transcript, qtbot: QtBot, shown: str, step: int) -> None:
    """A real click on the "<" (step -1) or ">" (+1) beside a message's "n/of" (the footer reads " < n/of > ")."""
    found = t.document().find(shown)
    assert not found.isNull(), shown
    click_at(t, qtbot, found.selectionStart() - 2 if step < 0 else found.selectionEnd() + 1)


def switcher(text: str) -> str:
    return text.replace("\xa0", " ")


def test_the_window_edits_any_message_and_switches_branches(
    qapp: QApplication, qtbot: QtBot, engine: Engine, tmp_path: Path
) -> None:
    with HubServer() as hub:
        window, c = make_controller(tmp_path, hub, b"")
        t = window.chat.transcript
        shown: list[str] = []

        async def scenario() -> None:
            try:
                await c.engine.use_endpoint(engine.url, KEY)
                c.talks.new_conversation()
                assert c.talks.conversation_id is not None
                c.store.set_settings(c.talks.conversation_id, SHORT)
                await c.chat.chat_once("first question")
                await c.chat.chat_once("second question")
                assert "/2 >" not in switcher(t.toPlainText())  # no versions yet: no switcher
                # the first message's Edit, as it was drawn when sent (not reopened: a message sent has its link)
                click_link(t, qtbot, "Edit")
                assert window.chat.input.toPlainText() == "first question"
                window.chat.input.setPlainText("first question, edited")
                window.chat.send_button.click()
                assert c.chat.reply_task is not None
                await asyncio.shield(c.chat.reply_task)
                shown.append(switcher(t.toPlainText()))
                click_arrow(t, qtbot, "2/2", -1)  # back to version 1 of 2
                shown.append(switcher(t.toPlainText()))
                click_arrow(t, qtbot, "1/2", +1)  # and on to 2 of 2 again
                shown.append(switcher(t.toPlainText()))
            finally:
                await c.shutdown()

        run_qt(qapp, scenario)
    new, old, again = shown
    assert "first question, edited" in new and "second question" not in new and " < 2/2 > " in new
    assert "first question, edited" not in old and "second question" in old and " < 1/2 > " in old
    assert again == new


def test_a_regenerate_that_fails_before_any_reply_shows_the_old_reply_again(tmp_path: Path) -> None:
    """No engine (the model was ejected): nothing of a new reply was kept, so the old one is the chat's again, not
    a hidden branch behind a question without an answer."""
    store = ConversationStore(tmp_path / "c.sqlite3")
    session = ChatSession(store, lambda: None)
    conv = store.create()
    store.add_message(conv.id, "user", "q")
    old = store.add_message(conv.id, "assistant", "the old answer")
    with pytest.raises(ChatError, match="No model is running"):
        asyncio.run(session.regenerate(conv.id, lambda _: None))
    assert [m.content for m in store.messages(conv.id)] == ["q", "the old answer"]
    assert store.messages(conv.id)[-1].id == old.id and store.branch_positions(conv.id) == {}
    store.close()
