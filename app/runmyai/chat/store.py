"""Conversations in SQLite: messages with their stats, per-conversation system prompt and sampling settings.

* WAL journal and autocommit: every change is its own committed transaction (several statements that belong
  together, like edit-and-truncate, are one), so a crash of the app loses nothing that a call returned from.
  `synchronous=NORMAL`: a power cut may lose the last few commits, never corrupt the file.
* One connection, meant for the event loop's thread (local I/O of well under a millisecond per call); a lock
  makes a call from another thread safe too.
* Branches: a conversation is a tree. Each message has a parent (the one it answers or follows; none for the
  first) and a `chosen` number: among siblings, the one with the highest is on the active path (0 = set aside).
  `messages(cid)` is the active path, from the first message to the leaf; `add_message` appends to it.
  Edit-and-resend: `edit_as_branch(message_id, text)` adds the edited text as a sibling (the old message and
  everything after it stay, one branch); regenerate: `drop_last_assistant(cid)` sets the last reply aside (it
  stays, a sibling of the new one) before `add_message(...)` (or `replace_last_assistant`, both in one).
  `branch_position` / `switch_branch` are the transcript's "< 2/3 >".
* `list()` orders by last activity: creating a conversation, and adding, editing or removing its messages.
* Schema changes are migrations run on open (`user_version`): a database of an older app is upgraded in place,
  in one transaction, keeping every message. 2 added `messages.reasoning` (a thinking model's reasoning, shown
  folded and never sent back); 3 added `messages.tool_rounds` (a reply's tool calls and their results, JSON:
  shown again on reload and sent back to the model, as OpenAI's API expects a conversation's calls to be); 4 added
  `messages.parent_id` and `messages.chosen` (branches: an older conversation becomes its one branch); 5 added
  `messages.images` (the pictures a message carries, JSON: their file names in the conversation's folder of
  `chat/images.py`'s ImageFolder, which goes with the conversation).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from runmyai.chat.images import ImageError, ImageFolder, Picture, content_parts
from runmyai.chat.tools import ToolRound
from runmyai.engine.client import ChatSettings

Role = Literal["system", "user", "assistant"]
ROLES: frozenset[str] = frozenset({"system", "user", "assistant"})
DEFAULT_TITLE = "New chat"
SCHEMA_VERSION = 5

# the latest schema, for a new file; an older file gets the same through _MIGRATIONS
_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}',
    model TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL,
    created_at REAL NOT NULL,
    ttft_s REAL,
    tokens_per_s REAL,
    tokens INTEGER,
    finish_reason TEXT,
    model TEXT,
    reasoning TEXT NOT NULL DEFAULT '',
    tool_rounds TEXT NOT NULL DEFAULT '[]',
    parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
    chosen INTEGER NOT NULL DEFAULT 0,
    images TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(parent_id);
CREATE INDEX IF NOT EXISTS conversations_by_activity ON conversations(updated_at DESC, id DESC);
"""


# version -> the statements that bring a file of the version before it there (the tables exist at version 1)
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    2: ("ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''",),
    3: ("ALTER TABLE messages ADD COLUMN tool_rounds TEXT NOT NULL DEFAULT '[]'",),
    # every message follows the one before it in its conversation, all chosen: the old list is the one branch
    4: (
        "ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE",
        "ALTER TABLE messages ADD COLUMN chosen INTEGER NOT NULL DEFAULT 0",
        "UPDATE messages SET chosen = id, parent_id = (SELECT max(p.id) FROM messages p "
        "WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id)",
    ),
    5: ("ALTER TABLE messages ADD COLUMN images TEXT NOT NULL DEFAULT '[]'",),
}


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    settings: ChatSettings
    model: str | None  # the model last used, for the UI to offer it again
    created_at: float
    updated_at: float  # last activity


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    role: Role
    content: str
    created_at: float
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    tokens: int | None = None
    finish_reason: str | None = None
    model: str | None = None
    reasoning: str = ""  # the model's thinking before `content`: shown folded, never sent back to it
    tool_rounds: tuple[ToolRound, ...] = ()  # the reply's turns that called tools, in order
    parent_id: int | None = None  # the message it follows (None: the conversation's first, or a sibling of it)
    images: tuple[str, ...] = ()  # its pictures: file names in its conversation's ImageFolder (chat/images.py)

    def openai_messages(self) -> builtins.list[dict[str, Any]]:
        """The message as the API takes it back: a reply that called tools is its turns (each the assistant's
        calls and one `tool` message per call), then its last turn's text, if it has any."""
        if not self.tool_rounds:
            return [{"role": self.role, "content": self.content}]
        out = [m for r in self.tool_rounds for m in r.messages()]
        at = self.tool_rounds[-1].at
        final = self.content[at:]
        if at and final.startswith(TURN_BREAK):  # the session's break between the turns' texts (see ToolRound)
            final = final[len(TURN_BREAK) :]
        if final:
            out.append({"role": "assistant", "content": final})
        return out


TURN_BREAK = "\n\n"  # between the texts of a reply's turns around its tool calls, as saved and shown


class StoreError(Exception):
    """A conversation or message that does not exist, or a bad role; str() is one sentence."""


MISSING_PICTURE = "[a picture that is no longer on this computer]"  # sent in place of a kept file that went


class ConversationStore:
    def __init__(self, path: Path | str, images: Path | None = None) -> None:
        """`path`: the database file (created with its folder), or ":memory:"; `images`: the folder of the
        messages' pictures (default: `chat-images` beside the file; an in-memory store keeps none)."""
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            images = images or Path(path).with_name("chat-images")
        self.path = path
        self.images = ImageFolder(images) if images is not None else None
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=5)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        with self._tx():
            (version,) = self._db.execute("PRAGMA user_version").fetchone()
            if version > SCHEMA_VERSION:
                raise StoreError(f"{path} was written by a newer Run My AI (schema {version}); update the app.")
            fresh = self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages'").fetchone() is None
            if not fresh:  # an older file: its missing steps, in order, in this same transaction
                for step in range(max(version, 1) + 1, SCHEMA_VERSION + 1):
                    for stmt in _MIGRATIONS[step]:
                        self._db.execute(stmt)
            # then the latest schema (a new file's tables; an upgraded one's are there, its indexes may not be)
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    self._db.execute(stmt)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction: all of it is committed, or none (a full disk included: SQLite rolls back, and the
        error becomes one StoreError sentence)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:  # (SQLite may have rolled back by itself, e.g. on a full disk)
                        self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise _store_error(self.path, e) from None

    # ------------------------------------------------------------------------------------------ conversations
    def create(
        self,
        title: str = DEFAULT_TITLE,
        system_prompt: str = "",
        settings: ChatSettings | None = None,
        model: str | None = None,
    ) -> Conversation:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO conversations (title, system_prompt, settings, model, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (title, system_prompt, _settings_json(settings), model, now, now),
            )
            cid = int(cur.lastrowid or 0)
        return self._conversation(cid)

    def get(self, conversation_id: int) -> Conversation | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        return _to_conversation(row) if row is not None else None

    def list(self) -> builtins.list[Conversation]:
        """All conversations, the most recently active first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM conversations ORDER BY updated_at DESC, id DESC").fetchall()
        return [_to_conversation(r) for r in rows]

    def rename(self, conversation_id: int, title: str) -> Conversation:
        self._update_conversation(conversation_id, "title", title.strip() or DEFAULT_TITLE)
        return self._conversation(conversation_id)

    def set_system_prompt(self, conversation_id: int, system_prompt: str) -> Conversation:
        self._update_conversation(conversation_id, "system_prompt", system_prompt)
        return self._conversation(conversation_id)

    def set_settings(self, conversation_id: int, settings: ChatSettings) -> Conversation:
        self._update_conversation(conversation_id, "settings", _settings_json(settings))
        return self._conversation(conversation_id)

    def set_model(self, conversation_id: int, model: str | None) -> Conversation:
        self._update_conversation(conversation_id, "model", model)
        return self._conversation(conversation_id)

    def delete(self, conversation_id: int) -> None:
        """The conversation, its messages and its pictures."""
        with self._tx() as db:
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
        if self.images is not None:
            self.images.delete(conversation_id)

    # ------------------------------------------------------------------------------------------ messages
    def messages(self, conversation_id: int) -> builtins.list[Message]:
        """The active path: the conversation's messages as shown and sent, first to last."""
        with self._lock:
            return [_to_message(r) for r in _path(self._db, conversation_id)]

    def tree(self, conversation_id: int) -> builtins.list[Message]:
        """Every message of the conversation, every branch, in the order written (a parent before its children)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
            ).fetchall()
        return [_to_message(r) for r in rows]

    def add_conversation(
        self,
        conv: Conversation,
        messages: Sequence[Message],
        active: Sequence[int] = (),
        pictures: Mapping[int, Sequence[Picture]] | None = None,
    ) -> Conversation:
        """A whole conversation at once (an import): `conv`'s title, prompt, settings, model and times (its id is
        not used), `messages` in an order where each parent comes before its children, their `id`/`parent_id`
        only naming each other, and `active` the ids on the active path (chosen again in order, so the path is
        as it was; empty: each parent's last child); `pictures`: a message's pictures by its id there, kept as
        files in the new conversation's folder. One transaction: all of it, or nothing (a picture written before a
        failure is left in a folder no conversation has)."""
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO conversations (title, system_prompt, settings, model, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (
                    conv.title.strip() or DEFAULT_TITLE,
                    conv.system_prompt,
                    _settings_json(conv.settings),
                    conv.model,
                    conv.created_at,
                    conv.updated_at,
                ),
            )
            cid = int(cur.lastrowid or 0)
            ids: dict[int, int] = {}
            for n, m in enumerate(messages, 1):
                if m.role not in ROLES:
                    raise StoreError(f"{m.role!r} is not a message role (system, user or assistant).")
                if m.parent_id is not None and m.parent_id not in ids:
                    raise StoreError(f"Message {m.id} follows {m.parent_id}, which does not come before it.")
                cur = db.execute(
                    "INSERT INTO messages (conversation_id, role, content, created_at, ttft_s, tokens_per_s, tokens, "
                    "finish_reason, model, reasoning, tool_rounds, parent_id, chosen, images) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        cid,
                        m.role,
                        m.content,
                        m.created_at,
                        m.ttft_s,
                        m.tokens_per_s,
                        m.tokens,
                        m.finish_reason,
                        m.model,
                        m.reasoning,
                        _rounds_json(builtins.list(m.tool_rounds)),
                        ids[m.parent_id] if m.parent_id is not None else None,
                        n,
                        json.dumps(self._save_images(cid, (pictures or {}).get(m.id, ()))),
                    ),
                )
                ids[m.id] = int(cur.lastrowid or 0)
            for mid in active:
                if mid in ids:
                    self._choose(db, cid, ids[mid])
        return self._conversation(cid)

    def branch_position(self, message_id: int) -> tuple[int, int]:
        """(n, of): the message is the n-th (from 1, in the order they were written) of `of` siblings — versions
        of the same turn. (1, 1) for a message that was never edited or regenerated."""
        with self._lock:
            ids = self._sibling_ids(self._db, message_id)
        return ids.index(message_id) + 1, len(ids)

    def branch_positions(self, conversation_id: int) -> dict[int, tuple[int, int]]:
        """`branch_position` of each message on the active path that has siblings (one query for the transcript)."""
        with self._lock:
            path = _path(self._db, conversation_id)
            rows = self._db.execute(
                "SELECT id, parent_id FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
            ).fetchall()
        siblings: dict[int | None, builtins.list[int]] = {}
        for r in rows:
            siblings.setdefault(r["parent_id"], []).append(int(r["id"]))
        out: dict[int, tuple[int, int]] = {}
        for r in path:
            ids = siblings.get(r["parent_id"], [])
            if len(ids) > 1:
                out[int(r["id"])] = (ids.index(int(r["id"])) + 1, len(ids))
        return out

    def switch_branch(self, message_id: int, step: int) -> builtins.list[Message]:
        """The "< >" of a message with siblings: its sibling `step` places away (clamped) becomes the chosen one,
        and with it that branch's own continuation. Returns the new active path."""
        with self._tx() as db:
            cid = self._message_conversation(db, message_id)
            ids = self._sibling_ids(db, message_id)
            target = ids[max(0, min(len(ids) - 1, ids.index(message_id) + step))]
            self._choose(db, cid, target)
        return self.messages(cid)

    def choose(self, message_id: int) -> builtins.list[Message]:
        """Puts this message on the active path (it and, above it, each message it follows). Returns the path."""
        with self._tx() as db:
            cid = self._message_conversation(db, message_id)
            at: int | None = message_id
            chain: builtins.list[int] = []
            while at is not None:
                chain.append(at)
                row = db.execute("SELECT parent_id FROM messages WHERE id = ?", (at,)).fetchone()
                at = row["parent_id"] if row is not None else None
            for mid in reversed(chain):
                self._choose(db, cid, mid)
        return self.messages(cid)

    def add_message(
        self,
        conversation_id: int,
        role: Role | str,
        content: str,
        *,
        ttft_s: float | None = None,
        tokens_per_s: float | None = None,
        tokens: int | None = None,
        finish_reason: str | None = None,
        model: str | None = None,
        reasoning: str = "",
        images: Sequence[Picture] = (),
    ) -> Message:
        """A message at the end of the active path; `images`: its pictures, kept as files in the conversation's
        folder (written first: a failed insert leaves a file the conversation's deletion removes, never a
        message naming a file that is not there)."""
        if role not in ROLES:
            raise StoreError(f"{role!r} is not a message role (system, user or assistant).")
        names = self._save_images(conversation_id, images)
        with self._tx() as db:
            stats = (ttft_s, tokens_per_s, tokens, finish_reason, model, reasoning)
            mid = self._insert(db, conversation_id, role, content, stats, images=names)
        return self._message(mid)

    def _save_images(self, conversation_id: int, images: Sequence[Picture]) -> tuple[str, ...]:
        if not images:
            return ()
        if self.images is None:
            raise StoreError("This conversation store keeps no pictures (it is in memory).")
        self._conversation(conversation_id)
        try:
            return self.images.save(conversation_id, images)
        except OSError as e:
            raise StoreError(f"The picture could not be saved ({self.images.root}): {e.strerror or e}.") from None

    def _insert(
        self,
        db: sqlite3.Connection,
        conversation_id: int,
        role: str,
        content: str,
        stats: tuple[object, ...],
        parent: int | Literal["leaf"] | None = "leaf",
        images: tuple[str, ...] = (),
    ) -> int:
        """A new chosen message under `parent` (by default the active path's last message)."""
        now = time.time()
        self._touch(db, conversation_id, now)
        if parent == "leaf":
            path = _path(db, conversation_id)
            parent = int(path[-1]["id"]) if path else None
        cur = db.execute(
            "INSERT INTO messages (conversation_id, role, content, created_at, ttft_s, tokens_per_s, tokens, "
            "finish_reason, model, reasoning, parent_id, chosen, images) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                conversation_id,
                role,
                content,
                now,
                *stats,
                parent,
                _next_chosen(db, conversation_id),
                json.dumps(images),
            ),
        )
        return int(cur.lastrowid or 0)

    def update_message(
        self,
        message_id: int,
        content: str | None = None,
        *,
        ttft_s: float | None = None,
        tokens_per_s: float | None = None,
        tokens: int | None = None,
        finish_reason: str | None = None,
        reasoning: str | None = None,
        tool_rounds: builtins.list[ToolRound] | None = None,
    ) -> Message:
        """Changes a message's text, reasoning, tool rounds and/or stats (None keeps a value): a streamed reply can
        be saved as it grows, so a crash mid-reply keeps what had arrived."""
        changes: dict[str, Any] = {
            k: v
            for k, v in (
                ("content", content),
                ("reasoning", reasoning),
                ("ttft_s", ttft_s),
                ("tokens_per_s", tokens_per_s),
                ("tokens", tokens),
                ("finish_reason", finish_reason),
                ("tool_rounds", _rounds_json(tool_rounds) if tool_rounds is not None else None),
            )
            if v is not None
        }
        with self._tx() as db:
            cid = self._message_conversation(db, message_id)
            if changes:
                sets = ", ".join(f"{k} = ?" for k in changes)
                db.execute(f"UPDATE messages SET {sets} WHERE id = ?", (*changes.values(), message_id))
            self._touch(db, cid, time.time())
        return self._message(message_id)

    def truncate_after(self, message_id: int) -> int:
        """Removes everything that follows this message, in every branch; returns how many went."""
        with self._tx() as db:
            cid = self._message_conversation(db, message_id)
            (n,) = db.execute(_DESCENDANTS_COUNT, (message_id,)).fetchone()
            db.execute("DELETE FROM messages WHERE parent_id = ?", (message_id,))  # (their own follow by cascade)
            self._touch(db, cid, time.time())
            return int(n)

    def delete_message(self, message_id: int) -> builtins.list[Message]:
        """Removes a message and everything that follows it (every branch below it); a sibling it hid, if any,
        is shown again. Returns the active path."""
        with self._tx() as db:
            cid = self._message_conversation(db, message_id)
            db.execute("DELETE FROM messages WHERE id = ?", (message_id,))
            self._touch(db, cid, time.time())
        return self.messages(cid)

    def edit_and_truncate(self, message_id: int, content: str) -> builtins.list[Message]:
        """Edit in place: the message gets the new text, everything after it goes (one transaction; no branch is
        kept: `edit_as_branch` keeps them). Returns the active path, ending with the edited one."""
        with self._tx() as db:
            cid = self._message_conversation(db, message_id)
            db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, message_id))
            db.execute("DELETE FROM messages WHERE parent_id = ?", (message_id,))
            self._choose(db, cid, message_id)
            self._touch(db, cid, time.time())
        return self.messages(cid)

    def edit_as_branch(self, message_id: int, content: str) -> builtins.list[Message]:
        """Edit-and-resend, any message: the new text becomes a sibling of the message, chosen, with nothing after
        it yet; the old message and what followed it stay as the other branch ("< 1/2 >"). Returns the active
        path, ending with the new message."""
        with self._tx() as db:
            row = db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                raise StoreError(f"There is no message {message_id} (was it deleted?).")
            cid = int(row["conversation_id"])
            stats = (None, None, None, None, row["model"], "")  # an edited reply is the user's text: no speed
            # an edited question keeps its pictures (the text is what the edit changes)
            self._insert(db, cid, row["role"], content, stats, parent=row["parent_id"], images=_images(row["images"]))
        return self.messages(cid)

    def drop_last_assistant(self, conversation_id: int) -> builtins.list[Message]:
        """Regenerate, step one: the last message, if it is the assistant's, leaves the active path (it is kept,
        set aside: the next reply becomes its sibling, and "< >" shows it again). Returns the active path (the
        history to send again)."""
        with self._tx() as db:
            self._touch(db, conversation_id, time.time())
            path = _path(db, conversation_id)
            if path and path[-1]["role"] == "assistant":
                db.execute("UPDATE messages SET chosen = 0 WHERE id = ?", (path[-1]["id"],))
        return self.messages(conversation_id)

    def replace_last_assistant(
        self,
        conversation_id: int,
        content: str,
        *,
        ttft_s: float | None = None,
        tokens_per_s: float | None = None,
        tokens: int | None = None,
        finish_reason: str | None = None,
        model: str | None = None,
        reasoning: str = "",
    ) -> Message:
        """Regenerate in one step: the last assistant message (if the active path ends with one) is set aside
        for a new one with this text, reasoning and stats (its sibling: both are kept)."""
        with self._tx() as db:
            self._touch(db, conversation_id, time.time())
            path = _path(db, conversation_id)
            if path and path[-1]["role"] == "assistant":
                db.execute("UPDATE messages SET chosen = 0 WHERE id = ?", (path[-1]["id"],))
            stats = (ttft_s, tokens_per_s, tokens, finish_reason, model, reasoning)
            mid = self._insert(db, conversation_id, "assistant", content, stats)
        return self._message(mid)

    def chat_payload(self, conversation_id: int) -> builtins.list[dict[str, Any]]:
        """The messages to send (OpenAI format): the system prompt first when there is one; a reply that called
        tools as its calls and their results (Message.openai_messages). A reply's reasoning is never sent back
        (llama.cpp's server and OpenAI's API expect it dropped from the history)."""
        conv = self._conversation(conversation_id)
        out: builtins.list[dict[str, Any]] = []
        if conv.system_prompt.strip():
            out.append({"role": "system", "content": conv.system_prompt})
        for m in self.messages(conversation_id):
            if m.images and m.role == "user":
                out.append({"role": "user", "content": self._with_pictures(m)})
            else:
                out += m.openai_messages()
        return out

    def pictures(self, m: Message) -> builtins.list[bytes]:
        """A message's pictures (PNG bytes) as kept; one whose file went is left out."""
        out: builtins.list[bytes] = []
        for name in m.images:
            with contextlib.suppress(ImageError):
                out.append(self.images.read(m.conversation_id, name) if self.images is not None else b"")
        return [p for p in out if p]

    def _with_pictures(self, m: Message) -> builtins.list[dict[str, Any]]:
        """A message's content parts: its pictures (chat/images.py), then its text. A picture whose file went (a
        folder cleaned by hand) is a line saying so, not a conversation that can no longer be sent."""
        pictures = self.pictures(m)
        gone = len(m.images) - len(pictures)
        text = "\n".join([MISSING_PICTURE] * gone + ([m.content] if m.content else []))
        return content_parts(text, pictures)

    # ------------------------------------------------------------------------------------------ helpers
    def _conversation(self, conversation_id: int) -> Conversation:
        conv = self.get(conversation_id)
        if conv is None:
            raise StoreError(f"There is no conversation {conversation_id} (was it deleted?).")
        return conv

    def _message(self, message_id: int) -> Message:
        with self._lock:
            row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise StoreError(f"There is no message {message_id} (was it deleted?).")
        return _to_message(row)

    def _update_conversation(self, conversation_id: int, column: str, value: object) -> None:
        with self._tx() as db:
            cur = db.execute(f"UPDATE conversations SET {column} = ? WHERE id = ?", (value, conversation_id))
            if cur.rowcount == 0:
                raise StoreError(f"There is no conversation {conversation_id} (was it deleted?).")

    @staticmethod
    def _touch(db: sqlite3.Connection, conversation_id: int, now: float) -> None:
        cur = db.execute(
            "UPDATE conversations SET updated_at = max(updated_at, ?) WHERE id = ?", (now, conversation_id)
        )
        if cur.rowcount == 0:
            raise StoreError(f"There is no conversation {conversation_id} (was it deleted?).")

    @staticmethod
    def _sibling_ids(db: sqlite3.Connection, message_id: int) -> builtins.list[int]:
        row = db.execute("SELECT conversation_id, parent_id FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise StoreError(f"There is no message {message_id} (was it deleted?).")
        rows = db.execute(
            "SELECT id FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id",
            (row["conversation_id"], row["parent_id"]),
        ).fetchall()
        return [int(r["id"]) for r in rows]

    @staticmethod
    def _choose(db: sqlite3.Connection, conversation_id: int, message_id: int) -> None:
        db.execute("UPDATE messages SET chosen = ? WHERE id = ?", (_next_chosen(db, conversation_id), message_id))

    @staticmethod
    def _message_conversation(db: sqlite3.Connection, message_id: int) -> int:
        row = db.execute("SELECT conversation_id FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise StoreError(f"There is no message {message_id} (was it deleted?).")
        return int(row["conversation_id"])


_DESCENDANTS_COUNT = """
WITH RECURSIVE below(id) AS (
    SELECT id FROM messages WHERE parent_id = ?
    UNION ALL SELECT m.id FROM messages m JOIN below ON m.parent_id = below.id
) SELECT count(*) FROM below
"""


def _path(db: sqlite3.Connection, conversation_id: int) -> builtins.list[sqlite3.Row]:
    """The active path's rows: from the chosen first message, each time the chosen of its children, until a
    message has none chosen (0 is set aside). One read of the conversation; a tree of a few hundred messages."""
    rows = db.execute(
        "SELECT * FROM messages WHERE conversation_id = ? AND chosen > 0 ORDER BY chosen DESC", (conversation_id,)
    ).fetchall()
    best: dict[int | None, sqlite3.Row] = {}
    for r in rows:  # the first seen of each parent's children is its most recently chosen
        best.setdefault(r["parent_id"], r)
    path: builtins.list[sqlite3.Row] = []
    at = best.get(None)
    while at is not None and len(path) <= len(rows):
        path.append(at)
        at = best.get(int(at["id"]))
    return path


def _next_chosen(db: sqlite3.Connection, conversation_id: int) -> int:
    (top,) = db.execute(
        "SELECT coalesce(max(chosen), 0) FROM messages WHERE conversation_id = ?", (conversation_id,)
    ).fetchone()
    return int(top) + 1


def _store_error(path: Path | str, e: sqlite3.Error) -> StoreError:
    if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return StoreError(f"The disk is full: the conversation could not be saved ({path}); free some space.")
    return StoreError(f"The conversation store failed ({path}): {e}.")


def _settings_json(settings: ChatSettings | None) -> str:
    return json.dumps((settings or ChatSettings()).to_json())


def _to_conversation(row: sqlite3.Row) -> Conversation:
    try:
        settings = ChatSettings.from_json(json.loads(row["settings"]))
    except ValueError:
        settings = ChatSettings()
    return Conversation(
        id=int(row["id"]),
        title=str(row["title"]),
        system_prompt=str(row["system_prompt"]),
        settings=settings,
        model=row["model"],
        created_at=float(row["created_at"]),
        updated_at=float(row["updated_at"]),
    )


def _rounds_json(rounds: builtins.list[ToolRound]) -> str:
    return json.dumps([r.to_json() for r in rounds], ensure_ascii=False)


def _rounds(text: str) -> tuple[ToolRound, ...]:
    """The saved rounds; what does not read as one is left out (the message itself still opens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return ()
    rounds = [ToolRound.from_json(v) for v in value] if isinstance(value, builtins.list) else []
    return tuple(r for r in rounds if r is not None)


def _to_message(row: sqlite3.Row) -> Message:
    role: Role = row["role"]
    return Message(
        id=int(row["id"]),
        conversation_id=int(row["conversation_id"]),
        role=role,
        content=str(row["content"]),
        created_at=float(row["created_at"]),
        ttft_s=row["ttft_s"],
        tokens_per_s=row["tokens_per_s"],
        tokens=row["tokens"],
        finish_reason=row["finish_reason"],
        model=row["model"],
        reasoning=str(row["reasoning"]),
        tool_rounds=_rounds(str(row["tool_rounds"])),
        parent_id=row["parent_id"],
        images=_images(row["images"]),
    )


def _images(text: str) -> tuple[str, ...]:
    """A message's saved picture names; what does not read as a list of names is none (the message still opens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return ()
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, builtins.list) else ()
