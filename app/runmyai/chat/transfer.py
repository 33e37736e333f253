"""Export and import of conversations (Qt-free): Markdown to read or share (the active branch), JSON to keep or
move (every branch, every stat: the app imports it back as it was). The JSON format is in docs/app.md.

An import is read defensively: whatever is in the file, the user gets one sentence (TransferError) or a new
conversation, never a traceback, and a file that fails adds nothing (the store takes it in one transaction).
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

from runmyai.chat.images import ImageError, Picture, checked, data_url, from_data_url
from runmyai.chat.store import ROLES, TURN_BREAK, Conversation, ConversationStore, Message, StoreError
from runmyai.chat.tools import ToolRound
from runmyai.engine.client import ChatSettings
from runmyai.jsonfile import write_text_atomic

FORMAT = "runmyai.conversation"
VERSION = 1
MAX_IMPORT_BYTES = 256 * 1024 * 1024  # a conversation is text: a file past this is not one (and would be read whole)
ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System"}


class TransferError(Exception):
    """An export that could not be written or a file that is not a conversation: str() is one sentence."""


# ------------------------------------------------------------------------------------------------ export
def to_json(store: ConversationStore, conversation_id: int) -> dict[str, Any]:
    """The conversation as the JSON export: its settings and every message of every branch, with the active path."""
    conv = _conversation(store, conversation_id)
    return {
        "format": FORMAT,
        "version": VERSION,
        "title": conv.title,
        "system_prompt": conv.system_prompt,
        "settings": conv.settings.to_json(),
        "model": conv.model,
        "created_at": conv.created_at,
        "updated_at": conv.updated_at,
        "messages": [_message_json(m, store.pictures(m) if m.images else []) for m in store.tree(conversation_id)],
        "active_path": [m.id for m in store.messages(conversation_id)],
    }


def _message_json(m: Message, pictures: list[bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": m.id,
        "parent": m.parent_id,
        "role": m.role,
        "content": m.content,
        "reasoning": m.reasoning,
        "tool_rounds": [r.to_json() for r in m.tool_rounds],
        "created_at": m.created_at,
        "model": m.model,
        "ttft_s": m.ttft_s,
        "tokens_per_s": m.tokens_per_s,
        "tokens": m.tokens,
        "finish_reason": m.finish_reason,
    }
    if pictures:  # (its pictures as data URLs: the file moves whole; an older app reads past them)
        out["images"] = [data_url(png) for png in pictures]
    return out


def to_markdown(store: ConversationStore, conversation_id: int) -> str:
    """The conversation as it reads in the window: the active branch, each message under its speaker, a reply's
    reasoning and tool calls as quotes, its speed in italics."""
    conv = _conversation(store, conversation_id)
    when = datetime.datetime.fromtimestamp(conv.created_at).strftime("%Y-%m-%d %H:%M")
    lines = [
        f"# {conv.title}",
        "",
        f"*Run My AI conversation, started {when}" + (f" · {conv.model}*" if conv.model else "*"),
    ]
    if conv.system_prompt.strip():
        lines += ["", "## System prompt", "", conv.system_prompt.strip()]
    for m in store.messages(conversation_id):
        lines += ["", f"## {ROLE_TITLES.get(m.role, m.role)}", ""]
        if m.images:  # (the Markdown is to read: the pictures are in the JSON export)
            lines += [f"*[{len(m.images)} picture{'' if len(m.images) == 1 else 's'}]*", ""]
        if m.reasoning.strip():
            lines += [_quote("Thinking: " + m.reasoning.strip()), ""]
        lines.append(_with_tools(m))
        stats = _stats_line(m)
        if stats:
            lines += ["", f"*{stats}*"]
    return "\n".join(lines).rstrip() + "\n"


def _with_tools(m: Message) -> str:
    """A reply's text with each tool call quoted where it came (its arguments and result's line)."""
    if not m.tool_rounds:
        return m.content.strip()
    parts, start = [], 0
    for r in m.tool_rounds:
        if m.content[start : r.at].strip():
            parts.append(m.content[start : r.at].strip())
        for call, result in zip(r.calls, r.outcomes(), strict=True):
            parts.append(_quote(f"Tool call: {call.name}({call.arguments}) → {result.line}"))
        start = max(start, r.at)
    rest = m.content[start:].removeprefix(TURN_BREAK)
    if rest.strip():
        parts.append(rest.strip())
    return "\n\n".join(parts)


def _stats_line(m: Message) -> str:
    if m.role != "assistant":
        return ""
    parts = []
    if m.model:
        parts.append(m.model)
    if m.tokens_per_s:
        parts.append(f"{m.tokens_per_s:.1f} tok/s")
    if m.tokens:
        parts.append(f"{m.tokens} tokens")
    return " · ".join(parts)


def _quote(text: str) -> str:
    return "\n".join("> " + line if line else ">" for line in text.splitlines())


def export_file(store: ConversationStore, conversation_id: int, path: Path) -> str:
    """Writes the conversation to `path`: Markdown for a .md (or .markdown, .txt) file, else JSON. Atomic: the file
    is the old one or the whole new one, never half. Returns the kind written ("Markdown" or "JSON")."""
    markdown = path.suffix.lower() in (".md", ".markdown", ".txt")
    text = (
        to_markdown(store, conversation_id)
        if markdown
        else json.dumps(to_json(store, conversation_id), ensure_ascii=False, indent=1) + "\n"
    )
    try:
        write_text_atomic(path, text)
    except OSError as e:
        raise TransferError(f"Couldn't write {path}: {e.strerror or e}.") from None
    return "Markdown" if markdown else "JSON"


def suggested_name(title: str, extension: str) -> str:
    """A file name from a conversation's title: its words, no characters a file system refuses."""
    safe = "".join(c if c.isalnum() or c in " -_" else " " for c in title).split()
    return f"{'-'.join(safe)[:60] or 'chat'}.{extension}"


# ------------------------------------------------------------------------------------------------ import
def import_file(store: ConversationStore, path: Path) -> Conversation:
    """A JSON export read back as a new conversation (every branch, the active path as it was, its pictures)."""
    conv, messages, active, pictures = read_export(path)
    try:
        return store.add_conversation(conv, messages, active, pictures)
    except StoreError as e:
        raise TransferError(f"Couldn't import {path.name}: {e}") from None


Imported = tuple[Conversation, list[Message], list[int], dict[int, list[Picture]]]


def read_export(path: Path) -> Imported:
    """Reads and checks a JSON export; TransferError (one sentence naming the file and what is wrong) otherwise."""
    name = path.name
    try:
        size = path.stat().st_size
        if size > MAX_IMPORT_BYTES:
            raise TransferError(f"it is {size / 2**20:.0f} MiB, too large for a conversation export")
        raw = path.read_bytes()
    except OSError as e:
        raise TransferError(f"Couldn't read {name}: {e.strerror or e}.") from None
    except TransferError as e:
        raise TransferError(f"Couldn't import {name}: {e}.") from None
    try:
        return parse_export(_decode(raw))
    except TransferError as e:
        raise TransferError(f"Couldn't import {name}: {e}.") from None


def _decode(raw: bytes) -> object:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise TransferError("it is not a text file (a conversation export is JSON)") from None
    except json.JSONDecodeError as e:
        raise TransferError(f"it is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise TransferError("it is nested too deeply to be a conversation export") from None


def parse_export(data: object) -> Imported:
    """A decoded JSON export, checked: the conversation, its messages, the active path and each message's pictures
    (by its id in the file); TransferError (what is wrong, a sentence's end) otherwise."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TransferError(f'it is not a Run My AI conversation export (it has no "format": "{FORMAT}")')
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TransferError('it has no valid "version"')
    if version > VERSION:
        raise TransferError(f"it was written by a newer Run My AI (export version {version}); update the app")
    title = _text(data, "title", "it", default="Imported chat")
    system_prompt = _text(data, "system_prompt", "it", default="")
    model = data.get("model")
    now = datetime.datetime.now().timestamp()
    conv = Conversation(
        id=0,
        title=title,
        system_prompt=system_prompt,
        settings=ChatSettings.from_json(data.get("settings")),  # unknown or wrong-typed settings are dropped
        model=model if isinstance(model, str) else None,
        created_at=_time(data.get("created_at"), now),
        updated_at=_time(data.get("updated_at"), now),
    )
    items = data.get("messages")
    if not isinstance(items, list):
        raise TransferError('it has no "messages" list')
    messages: list[Message] = []
    pictures: dict[int, list[Picture]] = {}
    seen: set[int] = set()
    previous: int | None = None
    for n, item in enumerate(items, 1):
        where = f"message {n}"
        if not isinstance(item, dict):
            raise TransferError(f"{where} is not an object")
        role = item.get("role")
        if role not in ROLES:
            raise TransferError(f"{where} has the role {role!r}, not user, assistant or system")
        content = _text(item, "content", where)
        mid = item.get("id", n)
        if not isinstance(mid, int) or isinstance(mid, bool) or mid in seen:
            raise TransferError(f'{where} has no id of its own ("id" must be a number no other message has)')
        # no "parent": the message before it (a file written by hand, or by another tool, is one branch)
        parent = item.get("parent", previous)
        if parent is not None and (not isinstance(parent, int) or isinstance(parent, bool) or parent not in seen):
            raise TransferError(f"{where} follows message {parent!r}, which does not come before it in the file")
        rounds = item.get("tool_rounds", [])
        parsed = [ToolRound.from_json(r) for r in rounds] if isinstance(rounds, list) else [None]
        if any(r is None for r in parsed):
            raise TransferError(f"{where} has tool calls that cannot be read")
        urls = item.get("images", [])
        try:
            if not isinstance(urls, list):
                raise ImageError("not a list")
            pictures[mid] = [checked(from_data_url(u), f"picture {i}") for i, u in enumerate(urls, 1)]
        except ImageError as e:
            raise TransferError(f"{where} has a picture that cannot be read ({str(e).rstrip('.')})") from None
        messages.append(
            Message(
                id=mid,
                conversation_id=0,
                role=role,
                content=content,
                created_at=_time(item.get("created_at"), conv.created_at),
                ttft_s=_number(item.get("ttft_s")),
                tokens_per_s=_number(item.get("tokens_per_s")),
                tokens=_count(item.get("tokens")),
                finish_reason=item["finish_reason"] if isinstance(item.get("finish_reason"), str) else None,
                model=item["model"] if isinstance(item.get("model"), str) else None,
                reasoning=item["reasoning"] if isinstance(item.get("reasoning"), str) else "",
                tool_rounds=tuple(r for r in parsed if r is not None),
                parent_id=parent,
            )
        )
        seen.add(mid)
        previous = mid
    path = data.get("active_path", [])
    if not isinstance(path, list) or not all(isinstance(i, int) and i in seen for i in path):
        raise TransferError('its "active_path" names messages it does not have')
    return conv, messages, list(path), {k: v for k, v in pictures.items() if v}


def _text(data: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise TransferError(f'{where} has no text "{key}"')
    return value


def _time(value: object, default: float) -> float:
    n = _number(value)
    return n if n is not None else default


def _number(value: object) -> float | None:
    """A finite number >= 0 (a bool is not one), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _conversation(store: ConversationStore, conversation_id: int) -> Conversation:
    conv = store.get(conversation_id)
    if conv is None:
        raise TransferError(f"There is no conversation {conversation_id} (was it deleted?).")
    return conv
