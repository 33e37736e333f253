"""What the shell shows, worked out without Qt: notifications, the "will it run here?" badge, the My models
rows, conversation search, the app's settings, the server's URL and the shortcuts. The widgets only draw these,
so each rule here is tested without a window."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from runmyai.jsonfile import read_json, write_json_atomic
from runmyai.library.estimate import Estimate
from runmyai.units import human_bytes

# ------------------------------------------------------------------------------------------ notifications
NoticeKind = Literal["error", "job", "info", "offer"]  # offer: something worth doing, one click (and "Not now")


@dataclass(frozen=True)
class Notice:
    """One entry of the notification area. `key` groups what one action reports (an import, the engine, a
    download), so that its later success clears its failure."""

    key: str
    title: str  # what was being done, a few words ("Importing garbage.gguf")
    reason: str  # why it failed, whole sentences in plain words (never cut)
    details: str = ""  # the technical text behind it (the engine's log lines, an exception)
    kind: NoticeKind = "error"
    retry: bool = False  # a Retry button; never for a permanent failure (trying again cannot change it)
    progress: float | None = None  # a long job's share done (None: not known)
    cancellable: bool = False  # a long job's Cancel: the notification is the one place a job's progress shows
    action: str = ""  # the Retry button's words where it does something else (an offer's "Measure now")


# failures that no retry can change: the engine's own words for them, and the app's
_PERMANENT = (
    "cannot run",
    "not supported",
    "unsupported",
    "corrupt",
    "not a gguf",
    "not a model",
    "will not change",
    "bad input",
    "does not exist",
    "no such file",
)


def is_permanent(reason: str) -> bool:
    """Whether a failure is one that trying again cannot fix (a corrupt file, an architecture the engine does not
    run), so it is offered no Retry."""
    low = reason.lower()
    return any(word in low for word in _PERMANENT)


def plain_reason(text: str) -> tuple[str, str]:
    """(the reason in plain words, the details): an error's text as the app's layers stack it ("Importing x
    failed: Couldn't import x: tokenwing: error: not a GGUF file") loses what the notice's title already says (the
    leading "… failed") and the engine's prefixes ("tokenwing", "error"); the rest is kept whole, capitalised and
    ended. The details are the whole text when anything was dropped."""
    whole = " ".join(text.split())
    parts = [p.strip() for p in re.split(r"(?<!\d): (?=\S)", whole) if p.strip()]
    while len(parts) > 1 and parts[0].lower().endswith(" failed"):
        parts.pop(0)
    kept = [p for p in parts if p.lower() not in ("tokenwing", "error", "runmyai")] or parts
    reason = ": ".join(kept)
    reason = reason[0].upper() + reason[1:] if reason else reason
    if reason and reason[-1] not in ".!?)":
        reason += "."
    return reason, whole if whole.rstrip(".") != reason.rstrip(".") else ""


class Notifications:
    """The notification area's contents. `on_change` is called after each change (the widget redraws)."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._items: dict[str, Notice] = {}
        self.on_change = on_change

    def items(self) -> list[Notice]:
        return list(self._items.values())

    def get(self, key: str) -> Notice | None:
        return self._items.get(key)

    def fail(self, key: str, title: str, error: str, *, retry: bool = True, details: str | None = None) -> Notice:
        """A failure: its reason in plain words, the full text (or `details`) as details; Retry unless it is
        permanent."""
        reason, whole = plain_reason(error)
        details = details if details is not None else whole
        notice = Notice(key, title, reason, details, "error", retry and not is_permanent(error))
        self._set(notice)
        return notice

    def job(
        self, key: str, title: str, message: str = "", progress: float | None = None, *, cancellable: bool = False
    ) -> None:
        """A long job in progress (replaces a failure of the same key: it is being tried again)."""
        self._set(Notice(key, title, message, "", "job", False, progress, cancellable))

    def info(self, key: str, title: str, text: str, action: str = "") -> None:
        """A confirmation; `action` puts a button on it (the area's retry_requested: a deleted chat's "Undo", a
        folder's "Copy path")."""
        self._set(Notice(key, title, text, "", "info", bool(action), action=action))

    def offer(self, key: str, title: str, text: str, action: str) -> None:
        """Something worth doing that the app will not do unasked: `action` on its button (the area's
        retry_requested), "Not now" on the other (forget_requested)."""
        self._set(Notice(key, title, text, "", "offer", True, action=action))

    def succeeded(self, key: str) -> None:
        """The action behind `key` worked: its failure or progress entry goes."""
        self.forget(key)

    def forget(self, key: str) -> None:
        if self._items.pop(key, None) is not None:
            self._changed()

    def _set(self, notice: Notice) -> None:
        if self._items.get(notice.key) != notice:
            self._items.pop(notice.key, None)
            self._items[notice.key] = notice  # the newest last
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


# ------------------------------------------------------------------------------------------ badges
BadgeColour = Literal["green", "yellow", "red", "grey"]
BADGE_RGB: dict[str, str] = {"green": "#2e9e5b", "yellow": "#d69e0b", "red": "#d0453a", "grey": "#8a8f98"}


@dataclass(frozen=True)
class Badge:
    colour: BadgeColour
    line: str  # the estimate in one line: "Runs well here · ~10–14 tok/s · measured: 3 chats"
    basis: str = ""  # where its numbers come from, the line's last part ("measured: 3 chats")


def badge(est: Estimate | None, *, supported: bool = True, error: str | None = None) -> Badge:
    """The "will it run here?" badge of a card, from the one estimate (library.estimate): green runs well,
    yellow runs slowly, red cannot run here (unsupported, no disk space, a broken file)."""
    if error:
        return Badge("red", "Cannot be used")
    if not supported:
        return Badge("red", "Not supported by this engine")
    if est is None:
        return Badge("grey", "No estimate yet")
    # the words follow the numbers: a range with where it came from (a card said "not a measurement" after one)
    if est.verdict == "runs_well":
        return Badge("green", f"Runs well here · {est.speed} · {est.basis}", est.basis)
    if est.verdict == "runs_slowly":
        return Badge("yellow", f"Runs slowly here · {est.speed} · {est.basis}", est.basis)
    if est.verdict == "no_disk_space":
        return Badge("red", "Not enough disk space")
    return Badge("red", "Not supported by this engine")


# ------------------------------------------------------------------------------------------ my models
@dataclass(frozen=True)
class ModelRow:
    key: str
    name: str
    repo: str  # OWNER/NAME it came from ("" for an import or the built-in model)
    size: str
    arch: str
    estimate: str
    last_used: str
    path: Path
    bundled: bool
    in_use: bool


def chosen_row(rows: Sequence[ModelRow], kept: Path | None) -> int | None:
    """The My models row to select: the one selected before, else the model in use, else the first. With none
    selected every button was greyed out and a new user could not tell why."""
    for i, r in enumerate(rows):
        if kept is not None and r.path == kept:
            return i
    for i, r in enumerate(rows):
        if r.in_use:
            return i
    return 0 if rows else None


def repo_of(path: Path, models_dir: Path) -> str:
    """The hub repository a model was downloaded from: downloads land in `<models>/<owner>/<repo>/`."""
    try:
        parts = path.relative_to(models_dir).parts
    except ValueError:
        return ""
    return f"{parts[0]}/{parts[1]}" if len(parts) >= 3 else ""


def ago(then: float | None, now: float | None = None) -> str:
    if then is None:
        return "never"
    s = max(0.0, (time.time() if now is None else now) - then)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= size:
            n = int(s // size)
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return "just now"


# ------------------------------------------------------------------------------------------ conversations
def search_conversations(items: Sequence[tuple[str, str]], query: str) -> list[tuple[str, str]]:
    """(id, title) pairs whose title holds every word of the query, in their order (case-insensitive)."""
    words = query.lower().split()
    return [(i, t) for i, t in items if all(w in (t or "New chat").lower() for w in words)]


def search_messages(
    items: Sequence[tuple[str, str]], texts: Callable[[str], Iterable[str]], query: str
) -> list[tuple[str, str]]:
    """Conversations whose title or any message holds every word of the query."""
    words = query.lower().split()
    if not words:
        return list(items)
    found = []
    for cid, title in items:
        blob = " ".join([title or "", *texts(cid)]).lower()
        if all(w in blob for w in words):
            found.append((cid, title))
    return found


# ------------------------------------------------------------------------------------------ settings
Theme = Literal["system", "light", "dark"]
DEFAULT_SERVER_PORT = 1234  # LM Studio's, which the programs people point at a local server already know


@dataclass(frozen=True)
class ServerSettings:
    enabled: bool = False
    port: int = DEFAULT_SERVER_PORT
    api_key: str = ""  # created at first use: the server never runs without one
    cors_origins: tuple[str, ...] = ()
    lan: bool = False  # listen on every address (the local network), not only this computer's loopback


@dataclass(frozen=True)
class AppSettings:
    theme: Theme = "system"
    model_dirs: tuple[str, ...] = ()  # more folders scanned for models, besides the app's own
    context_length: int = 0  # 0: the model's own, as the engine caps it by memory
    server: ServerSettings = field(default_factory=ServerSettings)
    # model name -> preset name -> sampling values (SamplingValues' fields)
    presets: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    autotune_declined: bool = False  # "Not now" to measuring this machine: not offered again (Autotune… still is)

    def with_server(self, **changes: Any) -> AppSettings:
        return replace(self, server=replace(self.server, **changes))


def new_api_key() -> str:
    return "rma-" + secrets.token_urlsafe(24)


def server_url(port: int) -> str:
    """The base URL OpenAI's clients take (chat completions, completions, Responses: they add /chat/completions…)."""
    return f"http://127.0.0.1:{port}/v1"


def anthropic_url(port: int) -> str:
    """The base URL Anthropic's clients take (its SDK, Claude Code's ANTHROPIC_BASE_URL): they add /v1/messages."""
    return f"http://127.0.0.1:{port}"


class SettingsFile:
    """settings/app.json: the app's settings, written atomically; a missing or unreadable file gives defaults."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> AppSettings:
        raw = read_json(self.path)
        s = AppSettings()
        if not isinstance(raw, dict):
            return s
        theme = raw.get("theme")
        server = raw.get("server") if isinstance(raw.get("server"), dict) else {}
        assert isinstance(server, dict)
        port = server.get("port")
        presets = raw.get("presets")
        return AppSettings(
            theme=theme if theme in ("system", "light", "dark") else s.theme,
            model_dirs=tuple(str(d) for d in raw.get("model_dirs", ()) if isinstance(d, str)),
            context_length=int(raw["context_length"]) if isinstance(raw.get("context_length"), int) else 0,
            server=ServerSettings(
                enabled=bool(server.get("enabled", False)),
                port=port if isinstance(port, int) and 0 < port < 65536 else DEFAULT_SERVER_PORT,
                api_key=str(server.get("api_key") or ""),
                cors_origins=tuple(str(o) for o in server.get("cors_origins", ()) if isinstance(o, str)),
                lan=server.get("lan") is True,
            ),
            presets=presets if isinstance(presets, dict) else {},
            autotune_declined=raw.get("autotune_declined") is True,
        )

    def save(self, s: AppSettings) -> None:
        data = asdict(s)
        data["model_dirs"] = list(s.model_dirs)
        data["server"]["cors_origins"] = list(s.server.cors_origins)
        write_json_atomic(self.path, data)


def context_flags(context_length: int) -> list[str]:
    """The engine flag of the context length setting (after the preset's and autotune's: the last one counts)."""
    return ["--ctx", str(context_length)] if context_length > 0 else []


def context_line(used: int | None, n_ctx: int | None) -> str:
    """The chat footer's context use: "Context 1,234 / 4,096 tokens (30 %)"."""
    if not n_ctx:
        return "Context: —"
    u = used or 0
    return f"Context {u:,} / {n_ctx:,} tokens ({u / n_ctx:.0%})"


def size_text(n: int) -> str:
    return human_bytes(n)


# ------------------------------------------------------------------------------------------ shortcuts
# LM Studio's where it has one (Ctrl+N new chat, Ctrl+L the model picker… here the input, as in ChatGPT,
# Ctrl+Shift+L the picker), the rest as browsers and editors have them. Documented in docs/app.md.
SHORTCUTS: tuple[tuple[str, str], ...] = (
    ("Ctrl+N", "New chat"),
    ("Ctrl+L", "Focus the message box"),
    ("Ctrl+Shift+L", "Choose the model"),
    ("Ctrl+F", "Search conversations"),
    ("F2", "Rename the conversation"),
    ("Ctrl+,", "Settings"),
    ("Ctrl+1 … Ctrl+5", "Chat, Discover, My models, Server, Settings"),
    ("Ctrl+Shift+P", "Show or hide the performance panel"),
    ("Enter / Shift+Enter", "Send / new line"),
    ("Esc", "Stop the reply"),
    ("Ctrl+R", "Regenerate the last reply"),
    ("Ctrl+E", "Edit the last message"),
)


# The performance panel docked beside the chat: its share of the window. At 1280x800 it took 470 px and left the
# transcript 430 px (a code block wrapped every line); the charts read well from 340 px (every layer's tick of the
# built-in model and the legend on one line) and gain little past 520.
PERF_DOCK_SHARE = 0.27
PERF_DOCK_MIN, PERF_DOCK_MAX = 340, 520


def perf_dock_width(window_width: int) -> int:
    """The docked performance panel's width for a window this wide."""
    return max(PERF_DOCK_MIN, min(PERF_DOCK_MAX, round(window_width * PERF_DOCK_SHARE)))


# The performance panel's line for a newcomer. The walk-through saw "Only part of the model's experts fit in
# memory" over a model that fit whole (hit rate 100 %, 0.0 MiB read): the line now follows the last tokens.
EXPLAIN_STREAMING = (
    "Only part of the model's experts fit in memory. For each token, the experts a layer picks come from the "
    "GPU's memory (VRAM), from RAM, or from the drive. Below: the wait for the drive and the bytes it read."
)
EXPLAIN_IN_MEMORY = (
    "Every expert the last tokens picked was already in memory: nothing was read from the drive. For each token, "
    "the experts a layer picks come from the GPU's memory (VRAM), from RAM, or from the drive."
)
IN_MEMORY_TOKENS = 16  # this many tokens in a row without a byte read (a cold cache reads at the start)


def performance_explanation(bytes_read: Sequence[float]) -> str:
    """The panel's explanation for the tokens seen so far (bytes read from the drive per token, oldest first)."""
    recent = list(bytes_read)[-IN_MEMORY_TOKENS:]
    return EXPLAIN_IN_MEMORY if len(recent) == IN_MEMORY_TOKENS and not any(recent) else EXPLAIN_STREAMING
