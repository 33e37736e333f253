"""The MCP servers' configuration in the common `mcpServers` JSON format (the one Claude Desktop, LM Studio and
Cursor read), so a user's existing mcp.json can be pasted in as it is:

    {"mcpServers": {"NAME": {"command": "...", "args": [...], "env": {...}}      stdio
                    "NAME": {"url": "https://...", "headers": {...}}}}           streamable HTTP

Our own additions, per server, are keys the other apps ignore: `disabled` (bool, the name Cline uses), `timeout`
(seconds a tool call may take, Cline's name too) and `connectTimeout` (seconds to start and handshake)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 30.0
EMPTY = '{\n  "mcpServers": {}\n}\n'


class ConfigError(ValueError):
    """The configuration cannot be read; str() is one sentence naming where."""


@dataclass(frozen=True)
class ServerConfig:
    name: str
    command: str | None = None  # stdio: the program to start ...
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # ... or streamable HTTP
    headers: dict[str, str] = field(default_factory=dict)
    disabled: bool = False
    timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"


def _strings(value: object, where: str, kind: type) -> Any:
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings.")
        return tuple(value)
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"{where} must be an object of strings.")
    return dict(value)


def _seconds(value: object, where: str, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{where} must be a number of seconds above 0.")
    return float(value)


def parse(text: str) -> list[ServerConfig]:
    """The servers of an mcpServers document, in its order; ConfigError for anything it cannot use."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"The MCP configuration is not valid JSON: {e}.") from None
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers", {}), dict):
        raise ConfigError('The MCP configuration must be an object with "mcpServers": {name: server}.')
    out = []
    for name, entry in data.get("mcpServers", {}).items():
        where = f"mcpServers.{name}"
        if not name.strip():
            raise ConfigError("A server in mcpServers has an empty name.")
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be an object.")
        command, url = entry.get("command"), entry.get("url", entry.get("serverUrl"))
        if (command is None) == (url is None):
            raise ConfigError(f'{where} needs either "command" (stdio) or "url" (streamable HTTP).')
        if command is not None and (not isinstance(command, str) or not command.strip()):
            raise ConfigError(f"{where}.command must be a program name.")
        if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
            raise ConfigError(f"{where}.url must be an http:// or https:// address.")
        disabled = entry.get("disabled", False)
        if not isinstance(disabled, bool):
            raise ConfigError(f"{where}.disabled must be true or false.")
        out.append(
            ServerConfig(
                name=name,
                command=command,
                args=_strings(entry.get("args", []), f"{where}.args", list),
                env=_strings(entry.get("env", {}), f"{where}.env", dict),
                url=url,
                headers=_strings(entry.get("headers", {}), f"{where}.headers", dict),
                disabled=disabled,
                timeout_s=_seconds(entry.get("timeout"), f"{where}.timeout", DEFAULT_CALL_TIMEOUT_S),
                connect_timeout_s=_seconds(
                    entry.get("connectTimeout"), f"{where}.connectTimeout", DEFAULT_CONNECT_TIMEOUT_S
                ),
            )
        )
    return out


def set_disabled(text: str, name: str, disabled: bool) -> str:
    """The document with one server's `disabled` changed, every other key kept as the user wrote it."""
    data = json.loads(text)
    entry = data["mcpServers"][name]
    if disabled:
        entry["disabled"] = True
    else:
        entry.pop("disabled", None)
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


class ConfigFile:
    """mcp.json in the app's home: read as text (the editor shows it as the user wrote it), written whole."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def text(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return EMPTY

    def servers(self) -> list[ServerConfig]:
        return parse(self.text())

    def save(self, text: str) -> list[ServerConfig]:
        """Checks, then writes (atomically: a crash leaves the old file or the new one)."""
        servers = parse(text)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(self.path)
        return servers
