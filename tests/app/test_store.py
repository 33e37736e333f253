"""ConversationStore: conversations, messages and their stats, edit-and-resend, regenerate, and durability."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from runmyai.chat.store import SCHEMA_VERSION, ConversationStore, StoreError
from runmyai.chat.tools import STOPPED, ToolCall, ToolResult, ToolRound
from runmyai.engine.client import ChatSettings


@pytest.fixture
def store(tmp_path: Path) -> ConversationStore:
    return ConversationStore(tmp_path / "home" / "conversations.sqlite3")


def test_conversations_listed_by_last_activity(store: ConversationStore) -> None:
    a = store.create("A")
    b = store.create("B")
    c = store.create()
    assert c.title == "New chat"
    assert [x.id for x in store.list()] == [c.id, b.id, a.id]
    time.sleep(0.01)
    store.add_message(a.id, "user", "hi")
    assert [x.id for x in store.list()] == [a.id, c.id, b.id]
    assert store.rename(b.id, "  Renamed  ").title == "Renamed"
    assert store.list()[0].id == a.id  # renaming is not activity
    assert store.rename(b.id, "   ").title == "New chat"
    store.delete(c.id)
    assert store.get(c.id) is None and [x.id for x in store.list()] == [a.id, b.id]


def test_messages_stats_prompt_and_settings(store: ConversationStore) -> None:
    settings = ChatSettings(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, max_tokens=256, seed=5,
                            repeat_penalty=1.1, stop=["</s>"])  # fmt: skip
    conv = store.create("Chat", system_prompt="Be brief.", settings=settings)
    assert conv.settings == settings and conv.system_prompt == "Be brief."
    u = store.add_message(conv.id, "user", "Hello")
    r = store.add_message(conv.id, "assistant", "", model="m")
    r = store.update_message(r.id, "Hi", ttft_s=0.25)
    r = store.update_message(r.id, "Hi there", tokens_per_s=12.5, tokens=3, finish_reason="stop")
    assert (r.content, r.ttft_s, r.tokens_per_s, r.tokens, r.finish_reason, r.model) == (
        "Hi there", 0.25, 12.5, 3, "stop", "m"
    )  # fmt: skip
    assert [(m.role, m.content) for m in store.messages(conv.id)] == [("user", "Hello"), ("assistant", "Hi there")]
    assert u.created_at <= r.created_at
    assert store.chat_payload(conv.id) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
    ]
    store.set_system_prompt(conv.id, "")
    store.set_settings(conv.id, ChatSettings(temperature=0.1))
    again = store.get(conv.id)
    assert again is not None and again.settings == ChatSettings(temperature=0.1)
    assert store.chat_payload(conv.id)[0] == {"role": "user", "content": "Hello"}
    assert store.set_model(conv.id, "qwen").model == "qwen"


def test_edit_and_resend_and_regenerate(store: ConversationStore) -> None:
    conv = store.create()
    u1 = store.add_message(conv.id, "user", "one")
    store.add_message(conv.id, "assistant", "reply one")
    u2 = store.add_message(conv.id, "user", "two")
    store.add_message(conv.id, "assistant", "reply two")

    # regenerate: the last assistant reply goes, the history to resend stays
    left = store.drop_last_assistant(conv.id)
    assert [m.content for m in left] == ["one", "reply one", "two"]
    assert [m.content for m in store.drop_last_assistant(conv.id)] == ["one", "reply one", "two"]  # nothing to drop
    store.add_message(conv.id, "assistant", "second try")
    new = store.replace_last_assistant(conv.id, "third try", ttft_s=0.1, tokens_per_s=9.0, tokens=2)
    assert [m.content for m in store.messages(conv.id)] == ["one", "reply one", "two", "third try"]
    assert new.ttft_s == 0.1 and new.tokens == 2

    # edit-and-resend: the edited message is the last one
    kept = store.edit_and_truncate(u1.id, "ONE")
    assert [(m.id, m.content) for m in kept] == [(u1.id, "ONE")]
    store.add_message(conv.id, "assistant", "x")
    assert store.truncate_after(u1.id) == 1
    with pytest.raises(StoreError):
        store.edit_and_truncate(u2.id, "gone")  # it was truncated away


def test_errors(store: ConversationStore, tmp_path: Path) -> None:
    conv = store.create()
    with pytest.raises(StoreError, match="not a message role"):
        store.add_message(conv.id, "wizard", "x")
    with pytest.raises(StoreError, match="no conversation"):
        store.add_message(999, "user", "x")
    with pytest.raises(StoreError, match="no conversation"):
        store.rename(999, "x")
    with pytest.raises(StoreError, match="no message"):
        store.update_message(999, "x")
    assert store.messages(conv.id) == []  # the failed calls left nothing behind
    store.close()
    path = tmp_path / "newer.sqlite3"
    ConversationStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version=99")
    with pytest.raises(StoreError, match="newer Run My AI"):
        ConversationStore(path)


def test_delete_removes_messages(store: ConversationStore) -> None:
    conv = store.create()
    store.add_message(conv.id, "user", "x")
    store.delete(conv.id)
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT count(*) FROM messages").fetchone() == (0,)


def test_wal_and_nothing_lost_when_the_app_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    script = textwrap.dedent(
        f"""
        import os, signal
        from runmyai.chat.store import ConversationStore
        s = ConversationStore({str(path)!r})
        c = s.create("kept")
        s.add_message(c.id, "user", "question")
        m = s.add_message(c.id, "assistant", "")
        for i in range(50):
            s.update_message(m.id, "token " * (i + 1))
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no cleanup
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == -9, r.stderr
    s = ConversationStore(path)
    (conv,) = s.list()
    assert conv.title == "kept"
    assert [m.content for m in s.messages(conv.id)] == ["question", "token " * 50]
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    s.close()


def test_usable_from_another_thread(store: ConversationStore) -> None:
    conv = store.create()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for i in range(20):
                store.add_message(conv.id, "user", str(i))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(20):
        store.list()
        store.messages(conv.id)
    for t in threads:
        t.join()
    assert not errors and len(store.messages(conv.id)) == 60


# the schema the app wrote before reasoning was kept (SCHEMA_VERSION 1), frozen here as it was shipped
SCHEMA_1 = """
CREATE TABLE conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, system_prompt TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}', model TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL
);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')), content TEXT NOT NULL,
    created_at REAL NOT NULL, ttft_s REAL, tokens_per_s REAL, tokens INTEGER, finish_reason TEXT, model TEXT
);
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
CREATE INDEX conversations_by_activity ON conversations(updated_at DESC, id DESC);
PRAGMA user_version=1;
"""


def test_an_old_database_is_upgraded_in_place_and_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA_1)
        db.execute(
            "INSERT INTO conversations (title, system_prompt, settings, model, created_at, updated_at) "
            "VALUES ('old chat', 'be brief', '{\"temperature\": 0.2}', 'm', 1.0, 2.0)"
        )
        db.executemany(
            "INSERT INTO messages (conversation_id, role, content, created_at, ttft_s, tokens_per_s, tokens, "
            "finish_reason, model) VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                ("user", "question", 1.5, None, None, None, None, None),
                ("assistant", "answer", 2.0, 0.5, 9.0, 7, "stop", "m"),
            ],
        )
    db.close()

    s = ConversationStore(path)
    (conv,) = s.list()
    assert (conv.title, conv.system_prompt, conv.settings.temperature, conv.model) == ("old chat", "be brief", 0.2, "m")
    old = s.messages(conv.id)
    assert [(m.role, m.content, m.reasoning) for m in old] == [("user", "question", ""), ("assistant", "answer", "")]
    assert (old[1].ttft_s, old[1].tokens_per_s, old[1].tokens, old[1].finish_reason) == (0.5, 9.0, 7, "stop")
    new = s.add_message(conv.id, "assistant", "Hello", reasoning="The user greets.")
    s.update_message(new.id, reasoning="The user greets; answer briefly.")
    s.close()

    s = ConversationStore(path)  # opened again: the upgraded file, as any new one
    assert [m.reasoning for m in s.messages(conv.id)] == ["", "", "The user greets; answer briefly."]
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    s.close()


def test_a_database_from_before_tool_calls_were_kept_opens_and_keeps_them_from_then_on(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    with sqlite3.connect(path) as db:  # schema 2 as shipped: 1 with the reasoning column
        db.executescript(SCHEMA_1.replace("PRAGMA user_version=1;", ""))
        db.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''")
        db.execute("PRAGMA user_version=2")
        db.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('old', 1.0, 2.0)")
        db.executemany(
            "INSERT INTO messages (conversation_id, role, content, created_at, reasoning) VALUES (1, ?, ?, 1.5, ?)",
            [("user", "question", ""), ("assistant", "Let me look.\n\nIt is sunny.", "plan")],
        )
    db.close()
    s = ConversationStore(path)
    old = s.messages(1)
    assert [(m.content, m.reasoning, m.tool_rounds) for m in old] == [
        ("question", "", ()),
        ("Let me look.\n\nIt is sunny.", "plan", ()),
    ]
    assert s.chat_payload(1)[-1] == {"role": "assistant", "content": "Let me look.\n\nIt is sunny."}
    s.update_message(old[1].id, tool_rounds=[ROUND])
    s.close()
    s = ConversationStore(path)
    assert s.messages(1)[1].tool_rounds == (ROUND,)
    s.close()


CALLS = (ToolCall("c1", "weather", '{"city": "Zürich"}'), ToolCall("c2", "time", "{}"))
ROUND = ToolRound(
    len("Let me look."), "Let me look.", CALLS, (ToolResult("ok", "sunny, 21 °C", "weather returned 12"),)
)


def test_a_replys_tool_calls_are_kept_and_sent_back_as_its_turns(store: ConversationStore) -> None:
    conv = store.create()
    store.add_message(conv.id, "user", "Weather?")
    reply = store.add_message(conv.id, "assistant", "Let me look.")
    done = ToolResult("ok", "12:00", "time returned 5")
    later = ToolRound(len("Let me look."), "", (ToolCall("c3", "time", '{"tz": "UTC"}'),), (done,))
    store.update_message(reply.id, "Let me look.\n\nIt is sunny.", tool_rounds=[ROUND, later])
    assert store.messages(conv.id)[-1].tool_rounds == (ROUND, later)
    calls = [c.message() for c in CALLS]
    assert store.chat_payload(conv.id) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 °C"},
        # the second call never finished (Stop): sent back as stopped, since every call needs its result
        {"role": "tool", "tool_call_id": "c2", "content": STOPPED.content},
        {"role": "assistant", "content": "", "tool_calls": [later.calls[0].message()]},
        {"role": "tool", "tool_call_id": "c3", "content": "12:00"},
        {"role": "assistant", "content": "It is sunny."},  # the last turn's text, without the break before it
    ]
    # a reply stopped during its calls has no last turn's text: it ends with the results
    store.update_message(reply.id, "Let me look.", tool_rounds=[ROUND])
    assert store.chat_payload(conv.id)[-1] == {"role": "tool", "tool_call_id": "c2", "content": STOPPED.content}
    # the first turn wrote no text: the reply's text is all the last turn's
    store.update_message(reply.id, "Sunny.", tool_rounds=[ToolRound(0, "", CALLS[1:], (done,))])
    assert store.chat_payload(conv.id)[-1] == {"role": "assistant", "content": "Sunny."}
    # a damaged column does not keep the conversation from opening: the text stays
    with sqlite3.connect(store.path) as db:
        db.execute('UPDATE messages SET tool_rounds = \'[{"at": "x"}, 7\' WHERE id = ?', (reply.id,))
    db.close()
    assert store.messages(conv.id)[-1].tool_rounds == () and store.chat_payload(conv.id)[-1]["content"] == "Sunny."


def test_reasoning_is_kept_but_never_sent_back(store: ConversationStore) -> None:
    conv = store.create(system_prompt="sys")
    store.add_message(conv.id, "user", "Hi")
    store.add_message(conv.id, "assistant", "Hello", reasoning="secret plan")
    again = store.replace_last_assistant(conv.id, "Hello again", reasoning="another plan")
    assert again.reasoning == "another plan" and store.messages(conv.id)[-1].reasoning == "another plan"
    payload = store.chat_payload(conv.id)
    assert payload == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello again"},
    ]


# ------------------------------------------------------------------------------------------------ branches
def contents(store: ConversationStore, cid: int) -> list[str]:
    return [m.content for m in store.messages(cid)]


def test_editing_any_message_keeps_the_old_version_as_a_branch(store: ConversationStore) -> None:
    conv = store.create(system_prompt="sys")
    u1 = store.add_message(conv.id, "user", "one")
    a1 = store.add_message(conv.id, "assistant", "reply one")
    store.add_message(conv.id, "user", "two")
    store.add_message(conv.id, "assistant", "reply two")

    # editing the FIRST message (not the last user one) starts a branch from it: the path ends with the new text
    path = store.edit_as_branch(u1.id, "ONE")
    assert [m.content for m in path] == ["ONE"] and path[0].id != u1.id
    store.add_message(conv.id, "assistant", "reply ONE")
    assert contents(store, conv.id) == ["ONE", "reply ONE"]
    assert store.chat_payload(conv.id) == [  # the request carries the active branch only
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "ONE"},
        {"role": "assistant", "content": "reply ONE"},
    ]
    assert store.branch_position(path[0].id) == (2, 2) and store.branch_position(u1.id) == (1, 2)
    assert store.branch_positions(conv.id) == {path[0].id: (2, 2)}

    # switching back shows the old branch with its own continuation, and on again the new one with its own
    assert [m.content for m in store.switch_branch(path[0].id, -1)] == ["one", "reply one", "two", "reply two"]
    assert store.branch_positions(conv.id) == {u1.id: (1, 2)}
    assert contents(store, conv.id) == ["one", "reply one", "two", "reply two"]
    assert contents(store, conv.id) == [m["content"] for m in store.chat_payload(conv.id)[1:]]
    assert [m.content for m in store.switch_branch(u1.id, +5)] == ["ONE", "reply ONE"]  # clamped to the last

    # an edit in the middle of the old branch: a third version of "two"'s turn there, the first two kept
    store.switch_branch(u1.id, 0)  # (0: nothing changes)
    store.switch_branch(path[0].id, -1)
    a1_edit = store.edit_as_branch(a1.id, "reply one, edited")[-1]  # a reply can be edited too
    assert contents(store, conv.id) == ["one", "reply one, edited"]
    assert store.branch_position(a1_edit.id) == (2, 2) and a1_edit.role == "assistant"
    store.add_message(conv.id, "user", "three")
    assert contents(store, conv.id) == ["one", "reply one, edited", "three"]

    # a new message goes to the end of the active path, whatever was written last elsewhere
    store.switch_branch(a1_edit.id, -1)
    assert contents(store, conv.id) == ["one", "reply one", "two", "reply two"]
    store.add_message(conv.id, "user", "four")
    assert contents(store, conv.id) == ["one", "reply one", "two", "reply two", "four"]

    # the whole tree survives a reopen, with the path as chosen
    store.close()
    again = ConversationStore(store.path)
    assert contents(again, conv.id) == ["one", "reply one", "two", "reply two", "four"]
    assert again.branch_positions(conv.id) == {u1.id: (1, 2), a1.id: (1, 2)}
    again.close()


def test_regenerate_keeps_the_old_reply_as_a_sibling(store: ConversationStore) -> None:
    conv = store.create()
    store.add_message(conv.id, "user", "q")
    old = store.add_message(conv.id, "assistant", "first answer")
    assert contents(store, conv.id) == ["q", "first answer"]
    assert [m.content for m in store.drop_last_assistant(conv.id)] == ["q"]  # set aside, not deleted
    new = store.add_message(conv.id, "assistant", "second answer")
    assert contents(store, conv.id) == ["q", "second answer"]
    assert store.branch_position(new.id) == (2, 2)
    third = store.replace_last_assistant(conv.id, "third answer")
    assert store.branch_position(third.id) == (3, 3)
    assert [m.content for m in store.switch_branch(third.id, -2)] == ["q", "first answer"]
    assert store.branch_positions(conv.id) == {old.id: (1, 3)}


def test_deleting_and_truncating_take_the_branches_below(store: ConversationStore) -> None:
    conv = store.create()
    u = store.add_message(conv.id, "user", "q")
    store.add_message(conv.id, "assistant", "a")
    store.add_message(conv.id, "user", "q2")
    edited = store.edit_as_branch(u.id, "Q")[-1]
    store.add_message(conv.id, "assistant", "A")
    # deleting the chosen version shows the one before it again
    assert [m.content for m in store.delete_message(edited.id)] == ["q", "a", "q2"]
    assert store.branch_positions(conv.id) == {}
    assert store.truncate_after(u.id) == 2
    assert contents(store, conv.id) == ["q"]
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT count(*) FROM messages").fetchone() == (1,)
    db.close()


def test_a_version_3_database_becomes_its_one_branch(tmp_path: Path) -> None:
    """A file the app wrote before branches (schema 3, as shipped): every old message is kept, in order, as the
    one branch, and the conversation can branch from then on."""
    path = tmp_path / "conversations.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA_1.replace("PRAGMA user_version=1;", ""))
        db.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''")
        db.execute("ALTER TABLE messages ADD COLUMN tool_rounds TEXT NOT NULL DEFAULT '[]'")
        db.execute("PRAGMA user_version=3")
        db.executemany(
            "INSERT INTO conversations (title, created_at, updated_at) VALUES (?, 1.0, 2.0)", [("a",), ("b",)]
        )
        # two conversations' messages interleaved, as two chats written at the same time leave them
        db.executemany(
            "INSERT INTO messages (conversation_id, role, content, created_at, tokens) VALUES (?, ?, ?, 1.5, ?)",
            [
                (1, "user", "a1", None),
                (2, "user", "b1", None),
                (1, "assistant", "a2", 5),
                (2, "assistant", "b2", 6),
                (1, "user", "a3", None),
            ],
        )
    db.close()
    s = ConversationStore(path)
    assert contents(s, 1) == ["a1", "a2", "a3"] and contents(s, 2) == ["b1", "b2"]
    assert [m.tokens for m in s.messages(1)] == [None, 5, None]
    assert s.branch_positions(1) == {} and s.branch_positions(2) == {}
    first = s.messages(1)[0]
    s.edit_as_branch(first.id, "A1")
    assert contents(s, 1) == ["A1"] and contents(s, 2) == ["b1", "b2"]
    assert contents(s, 1) == [m.content for m in s.switch_branch(first.id, 1)]
    s.switch_branch(first.id, 0)
    assert contents(s, 1) == ["a1", "a2", "a3"]
    s.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,) == (5,)
    db.close()
