"""The chat's turns as a user sees them (issue 50): a streamed reply that looks the same when it ends, a failed
reply marked failed, the notice of what the context dropped, the footer and banners of the chat on screen, and the
settings that go with a chat (max tokens a share of the context, the overflow policy, tools on or off)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QFont, QTextCursor
from PySide6.QtWidgets import QApplication
from pytestqt.qtbot import QtBot

from runmyai.chat.markdown_stream import hard_breaks
from runmyai.chat.session import overflow_line, reply_tokens
from runmyai.chat.store import ConversationStore
from runmyai.engine.client import ChatSettings
from runmyai.paths import AppPaths
from runmyai.ui.controller import AppController
from runmyai.ui.main_window import MainWindow
from runmyai.ui.transcript import Transcript, failure_line

VERSE = "**The king rode out**\nInto the night,\nand the stars sang.\n\nThen *morning* came\nover the hill."


def _weights(t: Transcript, words: str) -> set[int]:
    """The font weights of `words` where the transcript shows them."""
    found = t.document().find(words)
    assert not found.isNull(), words
    out = set()
    cursor = QTextCursor(t.document())
    for pos in range(found.selectionStart() + 1, found.selectionEnd() + 1):
        cursor.setPosition(pos)
        out.add(cursor.charFormat().fontWeight())
    return out


def _lines(t: Transcript) -> list[str]:
    return [line.strip() for line in t.toPlainText().replace("\u2028", "\n").splitlines() if line.strip()]


def test_a_streamed_verse_keeps_its_lines_and_weights_when_it_ends(qtbot: QtBot) -> None:
    """Issue 50: "the reply re-renders when streaming ends: bold verse lines become plain paragraphs, line breaks
    gone". The streaming tail took the bold of the "Assistant" title above it, and the final render joined the
    verse's lines into one paragraph."""
    t = Transcript()
    qtbot.addWidget(t)
    t.add_message("user", "Give me a verse.")
    assert _weights(t, "Give me a verse.") == {QFont.Weight.Normal}  # a user's message is not bold either
    t.begin_reply()
    for i in range(0, len(VERSE), 4):
        t.append_reply(VERSE[i : i + 4])
    streaming = _lines(t)
    assert "Into the night," in streaming and "and the stars sang." in streaming  # the plain tail, line by line
    assert _weights(t, "over the hill") == {QFont.Weight.Normal}  # the tail: not bold while it streams
    t.end_reply("5 tok/s")
    ended = _lines(t)
    # each line of the verse is still its own line, and only what the markdown makes bold is bold
    for line in ("The king rode out", "Into the night,", "and the stars sang.", "Then morning came", "over the hill."):
        assert line in ended, (line, ended)
    assert _weights(t, "The king rode out") == {QFont.Weight.Bold}
    assert _weights(t, "Into the night") == {QFont.Weight.Normal}
    assert _weights(t, "over the hill") == {QFont.Weight.Normal}
    # and it is what the same reply looks like when the conversation is opened again
    whole = Transcript()
    qtbot.addWidget(whole)
    whole.add_message("user", "Give me a verse.")
    whole.add_message("assistant", VERSE, "5 tok/s")
    assert _lines(whole) == ended


def test_hard_breaks_leave_code_and_blocks_alone() -> None:
    assert hard_breaks("a\nb\n\nc") == "a  \nb\n\nc"
    code = "```py\nx = 1\ny = 2\n```\n"
    assert hard_breaks(code) == code
    assert hard_breaks("line  \nnext") == "line  \nnext"  # already a break


def test_a_failed_reply_is_marked_failed_with_its_reason(qtbot: QtBot) -> None:
    """Issue 50: a refused reply left an empty "Assistant" turn with no error marker."""
    t = Transcript()
    qtbot.addWidget(t)
    t.add_message("user", "Hello")
    t.begin_reply()
    t.end_reply("", failure=failure_line("The engine failed with HTTP 500: out of memory."))
    lines = _lines(t)
    assert lines[lines.index("Assistant") + 1] == "⚠ The reply failed: The engine failed with HTTP 500: out of memory."
    # a reply cut off after some text: the text, then the marker
    t.begin_reply()
    t.append_reply("Once upon")
    t.end_reply("failed: cut off by an error", failure=failure_line("The connection broke off."))
    lines = _lines(t)
    assert lines[-3:-1] == ["Once upon", "⚠ The reply failed: The connection broke off."]


def test_the_overflow_notice() -> None:
    note = {"policy": "rolling", "dropped_messages": 3, "dropped_tokens": 812}
    assert overflow_line(note) == "3 earlier messages (812 tokens) are out of the model's view: rolling window."
    one = {"policy": "trim-middle", "dropped_messages": 1, "dropped_tokens": 1}
    assert overflow_line(one) == "1 earlier message (1 token) is out of the model's view: trimmed from the middle."


def test_max_tokens_is_a_share_of_the_context_never_all_of_it() -> None:
    """Issue 50: max tokens defaulted to 512, the built-in model's whole context: its first reply filled it."""
    assert reply_tokens(ChatSettings(), 512) == 128
    assert reply_tokens(ChatSettings(max_tokens=512), 512) == 128  # an old chat's 512 of 512: no room
    assert reply_tokens(ChatSettings(max_tokens=64), 512) == 64
    assert reply_tokens(ChatSettings(), None) is None  # a server that does not say: its own default
    assert reply_tokens(ChatSettings(), 32768) == 8192


def test_chat_settings_keep_the_policy_and_tools_but_send_only_the_policy() -> None:
    s = ChatSettings(
        temperature=0.0,
        context_overflow="trim-middle",
        tools=False,
        tools_off=["time"],
        overflow={"policy": "rolling", "dropped_messages": 2, "dropped_tokens": 90, "message_id": 7},
    )
    store = ConversationStore(":memory:")
    conv = store.create(settings=s)
    again = store.get(conv.id)
    assert again is not None and again.settings == s  # through the conversation's settings JSON
    fields = s.request_fields()
    assert fields == {"temperature": 0.0, "context_overflow": "trim-middle"}
    assert ChatSettings.from_json({"context_overflow": "everything", "tools": "yes"}) == ChatSettings()


def test_a_new_chat_shows_its_own_footer_not_the_last_ones(qapp: QApplication, tmp_path: Path) -> None:
    """Issue 50: "a new chat shows the previous chat's error, speed and 512/512"."""
    (tmp_path / "presets").mkdir()
    (tmp_path / "resources").mkdir()
    window = MainWindow()
    c = AppController(
        window, AppPaths(tmp_path / "home"), presets_dir=tmp_path / "presets", resources_dir=tmp_path / "resources"
    )
    try:
        c.talks.show_conversations()
        chat = window.chat
        # what a failed turn in the first chat left on screen
        chat.set_footer("last reply 257.8 tok/s", "Context 512 / 512 tokens (100%)")
        chat.set_status("The engine refused the request: the prompt (527 tokens) does not fit the context.")
        window.notifications.fail("chat", "The reply failed", "The engine refused the request.", retry=False)
        c.talks.new_conversation()
        assert chat.speed_label.text() == ""
        assert chat.context_label.text() == "Context: —"
        assert "refused" not in chat.status.text()
        assert window.notifications.get("chat") is None
        # the max tokens box of a new chat: auto (a share of the context), not 512
        assert chat.settings.max_tokens.value() == 0 and chat.settings.max_tokens.text().startswith("auto")
    finally:
        c.store.close()
        window.close()
