"""Export and import of conversations: Markdown of the active branch, a JSON round trip of the whole tree, and
malformed files refused in one sentence with nothing added."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication

from runmyai.chat.store import ConversationStore
from runmyai.chat.tools import ToolCall, ToolResult, ToolRound
from runmyai.chat.transfer import (
    FORMAT,
    TransferError,
    export_file,
    import_file,
    suggested_name,
    to_json,
)
from runmyai.engine.client import ChatSettings
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller
from tests.qtloop import run_qt

ROUND = ToolRound(len("Let me look."), "Let me look.", (ToolCall("c1", "weather", '{"city": "Zürich"}'),),
                  (ToolResult("ok", "sunny", "weather returned 5 characters"),))  # fmt: skip


@pytest.fixture
def store(tmp_path: Path) -> ConversationStore:
    return ConversationStore(tmp_path / "c.sqlite3")


def branched(store: ConversationStore) -> int:
    """A conversation with two versions of its first question, a regenerated reply, reasoning and a tool call."""
    conv = store.create("Weather — and more: a/b?", system_prompt="Be brief.",
                        settings=ChatSettings(temperature=0.3, max_tokens=128), model="demo")  # fmt: skip
    u = store.add_message(conv.id, "user", "Weather in Zürich?")
    r = store.add_message(conv.id, "assistant", "", model="demo", reasoning="Call the tool.")
    store.update_message(r.id, "Let me look.\n\nIt is sunny.", tool_rounds=[ROUND], tokens=9, tokens_per_s=12.5)
    store.replace_last_assistant(conv.id, "Sunny, 21 °C.", tokens=4)
    store.edit_as_branch(u.id, "Weather in Bern?")
    store.add_message(conv.id, "assistant", "Cloudy.")
    store.switch_branch(u.id, 0)  # the active path: the first question, its second reply
    return conv.id


def test_json_export_and_import_round_trip_keeps_every_branch(store: ConversationStore, tmp_path: Path) -> None:
    cid = branched(store)
    out = tmp_path / "out" / "chat.json"
    assert export_file(store, cid, out) == "JSON"
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["format"] == FORMAT and len(data["messages"]) == 5

    new = import_file(store, out)
    assert new.id != cid
    old_conv, new_conv = store.get(cid), store.get(new.id)
    assert old_conv is not None and new_conv is not None
    for field in ("title", "system_prompt", "settings", "model", "created_at"):
        assert getattr(new_conv, field) == getattr(old_conv, field), field

    def shape(c: int) -> list[tuple[object, ...]]:
        msgs = store.tree(c)
        index = {m.id: i for i, m in enumerate(msgs)}
        return [
            (
                m.role,
                m.content,
                m.reasoning,
                m.tool_rounds,
                m.tokens,
                m.tokens_per_s,
                m.model,
                index.get(m.parent_id) if m.parent_id else None,
                m.created_at,
            )
            for m in msgs
        ]

    assert shape(new.id) == shape(cid)  # every branch, as it was
    assert [m.content for m in store.messages(new.id)] == [m.content for m in store.messages(cid)]
    assert [m.content for m in store.messages(new.id)] == ["Weather in Zürich?", "Sunny, 21 °C."]
    assert store.chat_payload(new.id) == store.chat_payload(cid)
    first = store.messages(new.id)[0]
    assert store.branch_position(first.id) == (1, 2)
    assert [m.content for m in store.switch_branch(first.id, 1)] == ["Weather in Bern?", "Cloudy."]
    # and exported again, the same file but for the new ids
    again = to_json(store, new.id)
    assert {k: v for k, v in again.items() if k not in ("messages", "active_path")} == {
        k: v for k, v in data.items() if k not in ("messages", "active_path")
    }


def test_markdown_export_is_the_active_branch_as_it_reads(store: ConversationStore, tmp_path: Path) -> None:
    cid = branched(store)
    path = tmp_path / suggested_name("Weather — and more: a/b?", "md")
    assert path.name == "Weather-and-more-a-b.md"
    assert export_file(store, cid, path) == "Markdown"
    md = path.read_text(encoding="utf-8")
    assert md.startswith("# Weather — and more: a/b?\n")
    assert "## System prompt\n\nBe brief." in md
    assert md.index("## You\n\nWeather in Zürich?") < md.index("## Assistant\n\nSunny, 21 °C.")
    assert "Bern" not in md and "Cloudy" not in md and "It is sunny" not in md  # the other branches stay out
    store.switch_branch(store.messages(cid)[1].id, -1)  # the first reply: its reasoning and tool call quoted
    md = path.read_text(encoding="utf-8") if export_file(store, cid, path) else ""
    assert "> Thinking: Call the tool." in md
    assert md.index("Let me look.") < md.index("> Tool call: weather") < md.index("It is sunny.")
    assert "*demo · 12.5 tok/s · 9 tokens*" in md


def test_an_export_is_written_whole_or_not_at_all(store: ConversationStore, tmp_path: Path) -> None:
    cid = branched(store)
    path = tmp_path / "chat.json"
    path.write_text("the user's older file", encoding="utf-8")
    folder = tmp_path / "ro"
    folder.mkdir()
    os.chmod(folder, 0o500)
    try:
        if os.access(folder, os.W_OK):  # root ignores the mode: a file in the way of the folder instead
            blocked = tmp_path / "file" / "chat.json"
            (tmp_path / "file").write_text("x")
        else:
            blocked = folder / "chat.json"
        with pytest.raises(TransferError, match=r"^Couldn't write .*\.$"):
            export_file(store, cid, blocked)
    finally:
        os.chmod(folder, 0o700)
    assert export_file(store, cid, path) == "JSON"
    assert json.loads(path.read_text(encoding="utf-8"))["format"] == FORMAT
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


def doc(messages: object = (), **extra: object) -> bytes:
    return json.dumps({"format": FORMAT, "version": 1, "messages": messages, **extra}).encode()


def user(id_: int, parent: int | None = None) -> dict[str, object]:
    return {"id": id_, "parent": parent, "role": "user", "content": "a"}


MALFORMED: list[tuple[str, bytes, str]] = [
    ("empty", b"", "is not valid JSON"),
    ("truncated", b'{"format": "runmyai.conversation", "messages": [', "is not valid JSON (line 1"),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\xff", "is not a text file"),
    ("a list", b"[1, 2]", "is not a Run My AI conversation export"),
    ("another app's", b'{"messages": []}', "is not a Run My AI conversation export"),
    ("newer", doc(version=99), "newer Run My AI"),
    ("bool version", doc(version=True), "no valid"),
    ("no messages", doc(None), 'no "messages" list'),
    ("bad role", doc([{"role": "wizard", "content": "x"}]), "message 1 has the role 'wizard'"),
    ("number content", doc([{"role": "user", "content": 5}]), 'message 1 has no text "content"'),
    ("dangling parent", doc([user(1), user(2, 7)]), "message 2 follows message 7"),
    ("cycle", doc([user(1, 2), user(2, 1)]), "message 1 follows message 2"),
    ("duplicate id", doc([user(1), user(1)]), "message 2 has no id of its own"),
    ("bad tools", doc([{"role": "assistant", "content": "a", "tool_rounds": [{"at": "x"}]}]), "tool calls that"),
    ("bad path", doc([], active_path=[3]), "active_path"),
    ("deep", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
]


@pytest.mark.parametrize(("what", "body", "says"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_file_gets_one_sentence_and_adds_nothing(
    store: ConversationStore, tmp_path: Path, what: str, body: bytes, says: str
) -> None:
    branched(store)
    before = [(c.id, c.title) for c in store.list()]
    path = tmp_path / "bad.json"
    path.write_bytes(body)
    with pytest.raises(TransferError) as e:
        import_file(store, path)
    line = str(e.value)
    assert says in line and "\n" not in line and len(line) < 200, line
    assert line.startswith("Couldn't import bad.json: ") and line.endswith(".") and not line.endswith(".."), line
    assert [(c.id, c.title) for c in store.list()] == before


def test_a_missing_file_and_a_hand_written_one(store: ConversationStore, tmp_path: Path) -> None:
    with pytest.raises(TransferError, match=r"^Couldn't read gone\.json: No such file or directory\.$"):
        import_file(store, tmp_path / "gone.json")
    # the least a file needs: the format and its messages (one branch, in order; unknown fields ignored)
    path = tmp_path / "hand.json"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "tokens": -3, "x": 1}]
    path.write_text(json.dumps({"format": FORMAT, "version": 1, "messages": messages}), encoding="utf-8")
    conv = import_file(store, path)
    assert conv.title == "Imported chat"
    got = store.messages(conv.id)
    assert [(m.role, m.content, m.tokens) for m in got] == [("user", "Hi", None), ("assistant", "Hello!", None)]


def test_the_window_exports_and_imports_through_its_menus(qapp: QApplication, tmp_path: Path) -> None:
    """The conversation's right-click menu and the File menu offer export and import; the controller writes and
    reads off the UI thread; a malformed file is one line in the notification area, and nothing is added."""
    with HubServer() as hub:
        window, c = make_controller(tmp_path, hub, b"")
        cid = branched(c.store)
        c.talks.show_conversations()
        item = window.chat.conversations.currentItem()
        assert item is not None
        menu = [a.text() for a in window.chat.conversation_menu(item).actions() if a.text()]
        assert menu == ["Rename", "Export as Markdown…", "Export as JSON…", "Import chat…", "Delete"]
        file_menu = [a.text() for a in window.menuBar().actions()[0].menu().actions()]  # type: ignore[union-attr]
        assert {"&Export chat as Markdown…", "Export chat as &JSON…", "Import c&hat…"} <= set(file_menu)
        out, bad = tmp_path / "export.json", tmp_path / "broken.json"
        bad.write_text('{"format": "runmyai.conversation", "version": 1, "messages": [{"role": 3}]}')

        async def scenario() -> tuple[bool, int | None, int | None]:
            try:
                wrote = await c.talks.export_conversation(cid, out)
                new = await c.talks.import_conversation(out)
                refused = await c.talks.import_conversation(bad)
                return wrote, new, refused
            finally:
                await c.shutdown()

        wrote, new, refused = run_qt(qapp, scenario)
    assert wrote and new is not None and refused is None
    assert c.talks.conversation_id == new  # the imported chat is opened
    assert "Weather in Zürich?" in window.chat.transcript.toPlainText()
    assert " < 1/2 > " in window.chat.transcript.toPlainText().replace("\xa0", " ")  # with its branches
    notice = window.notifications.get("import-chat")
    assert notice is not None and notice.kind == "error"
    assert notice.reason == "Couldn't import broken.json: message 1 has the role 3, not user, assistant or system."
    assert window.chat.conversations.count() == 2  # the original and the good import; the bad one added nothing
