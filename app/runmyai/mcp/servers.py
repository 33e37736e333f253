"""Connections to the configured MCP servers on the official `mcp` SDK (stdio and streamable HTTP), run as
asyncio tasks on the app's loop: each server's tools, prompts and resources, its state and its last error in one
line, and tool calls with a timeout from the configuration. A server that exits or never answers fails the call
it was on, in one line; the others, and the chat, go on."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import httpx2
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import CONNECTION_CLOSED

from runmyai.mcp.config import ServerConfig

State = Literal["disabled", "connecting", "ready", "error", "stopped"]
RESULT_CHARS = 60_000  # a tool's result sent to the model is cut here: a runaway tool must not fill the context


class CallFailed(Exception):
    """A call could not be carried out (the server exited, timed out, refused); str() is one line."""


@dataclass(frozen=True)
class ToolInfo:
    server: str
    name: str
    description: str
    schema: dict[str, Any]


@dataclass(frozen=True)
class PromptInfo:
    server: str
    name: str
    description: str
    arguments: tuple[tuple[str, bool], ...]  # (name, required)


@dataclass(frozen=True)
class ResourceInfo:
    server: str
    uri: str
    name: str
    mime_type: str


@dataclass
class ServerView:
    """What the app shows of one server."""

    name: str
    transport: str
    state: State
    line: str  # its status or its error, one line
    tools: list[ToolInfo] = field(default_factory=list)
    prompts: list[PromptInfo] = field(default_factory=list)
    resources: list[ResourceInfo] = field(default_factory=list)


def one_line(e: BaseException) -> str:
    """The innermost useful message of an exception (anyio wraps a task's failure in exception groups)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    if isinstance(e, MCPError):
        text = e.error.message if hasattr(e, "error") else str(e)
    else:
        text = str(e) or type(e).__name__
    text = " ".join(text.split()).rstrip(".")
    return text if len(text) <= 240 else text[:237] + "..."


def _log_name(name: str) -> str:
    return "mcp-" + (re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "server") + ".log"


def _last_line(path: Path) -> str:
    """The last non-empty line a server wrote to its stderr (where a crashing server says why)."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


class ServerConnection:
    """One server: started by `start()`, its session kept open by a task until `stop()` or until it fails."""

    def __init__(self, config: ServerConfig, log_dir: Path, on_change: Callable[[], None]) -> None:
        self.config = config
        self._log = log_dir / _log_name(config.name)
        self._on_change = on_change
        self.state: State = "disabled" if config.disabled else "stopped"
        self.line = "disabled" if config.disabled else "not started"
        self.tools: list[ToolInfo] = []
        self.prompts: list[PromptInfo] = []
        self.resources: list[ResourceInfo] = []
        self._session: ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()

    def view(self) -> ServerView:
        return ServerView(
            self.config.name,
            self.config.transport,
            self.state,
            self.line,
            list(self.tools),
            list(self.prompts),
            list(self.resources),
        )

    def start(self) -> None:
        if self.config.disabled or (self._task is not None and not self._task.done()):
            return
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self._set("connecting", "connecting…")
        self._task = asyncio.ensure_future(self._run())

    async def wait_ready(self) -> None:
        """Until the server is ready or has failed."""
        task = self._task
        if task is None:
            return
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait({ready, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()

    async def stop(self) -> None:
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()  # the SDK's exits close the pipes and end the process (or the HTTP session)
            with contextlib.suppress(BaseException):
                await task
        self._session = None
        if self.state != "error":
            self._set(
                "disabled" if self.config.disabled else "stopped", "disabled" if self.config.disabled else "stopped"
            )

    def _set(self, state: State, line: str) -> None:
        self.state, self.line = state, line
        self._on_change()

    async def _run(self) -> None:
        cfg = self.config
        try:
            async with contextlib.AsyncExitStack() as stack:
                if cfg.command is not None:
                    self._log.parent.mkdir(parents=True, exist_ok=True)
                    errlog: TextIO = stack.enter_context(self._log.open("a", encoding="utf-8"))
                    params = StdioServerParameters(command=cfg.command, args=list(cfg.args), env=cfg.env or None)
                    read, write = await stack.enter_async_context(stdio_client(params, errlog=errlog))
                else:
                    assert cfg.url is not None
                    http = httpx2.AsyncClient(
                        headers=cfg.headers, timeout=httpx2.Timeout(300.0, connect=cfg.connect_timeout_s)
                    )
                    await stack.enter_async_context(http)
                    read, write = await stack.enter_async_context(streamable_http_client(cfg.url, http_client=http))
                session = await stack.enter_async_context(ClientSession(read, write))
                async with asyncio.timeout(cfg.connect_timeout_s):
                    init = await session.initialize()
                    caps = init.capabilities
                    tools = (await session.list_tools()).tools if caps.tools is not None else []
                    prompts = (await session.list_prompts()).prompts if caps.prompts is not None else []
                    resources = (await session.list_resources()).resources if caps.resources is not None else []
                self.tools = [ToolInfo(cfg.name, t.name, t.description or "", dict(t.input_schema)) for t in tools]
                self.prompts = [
                    PromptInfo(
                        cfg.name,
                        p.name,
                        p.description or "",
                        tuple((a.name, bool(a.required)) for a in p.arguments or []),
                    )
                    for p in prompts
                ]
                self.resources = [ResourceInfo(cfg.name, str(r.uri), r.name, r.mime_type or "") for r in resources]
                self._session = session
                n = len(self.tools)
                self._set("ready", f"ready: {n} tool{'' if n == 1 else 's'}")
                self._ready.set()
                await self._stop.wait()
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self._fail(f"no answer within {cfg.connect_timeout_s:g} s while starting")
        except Exception as e:  # one line, whatever the SDK or the transport raised (groups included)
            self._fail(one_line(e))
        finally:
            self._session = None

    def _fail(self, why: str) -> None:
        said = _last_line(self._log) if self.config.command is not None else ""
        self.tools, self.prompts, self.resources = [], [], []
        self._set("error", f"{why}" + (f" (it said: {said})" if said and said not in why else ""))

    def _live(self) -> ClientSession:
        if self._session is None or self.state != "ready":
            raise CallFailed(f"The MCP server '{self.config.name}' is not running ({self.line}).")
        return self._session

    async def _guard(self, what: str, make: Callable[[ClientSession], Any]) -> Any:
        """Runs one request, failing in one line when the server exits first or passes its timeout."""
        session, task = self._live(), self._task
        assert task is not None
        request = asyncio.ensure_future(make(session))
        try:
            async with asyncio.timeout(self.config.timeout_s):
                await asyncio.wait({request, task}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise CallFailed(
                f"The MCP server '{self.config.name}' did not answer {what} within {self.config.timeout_s:g} s."
            ) from None
        finally:
            if not request.done():
                request.cancel()
                with contextlib.suppress(BaseException):
                    await request
        if not request.done() or request.cancelled():
            raise CallFailed(f"The MCP server '{self.config.name}' stopped during {what}: {self.line}.")
        e = request.exception()
        if isinstance(e, MCPError) and e.error.code == CONNECTION_CLOSED and not task.done():
            # the SDK fails the request when the server's end closes (a process that exited) but keeps the
            # session open: end it here, so the server shows as failed, with what it said last
            self._fail("it exited or closed the connection")
            self._stop.set()
            with contextlib.suppress(BaseException):
                await task
        if e is not None:
            if task.done():  # the connection ended under the request: say why it ended
                raise CallFailed(f"The MCP server '{self.config.name}' failed during {what}: {self.line}.")
            raise CallFailed(f"The MCP server '{self.config.name}' failed {what}: {one_line(e)}.")
        return request.result()

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """(text, is_error) of a tool call; CallFailed when it could not be carried out."""
        result = await self._guard(f"the call of {name}", lambda s: s.call_tool(name, arguments))
        parts = []
        for block in getattr(result, "content", []) or []:
            text = getattr(block, "text", None)
            parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')} not shown]")
        text = "\n".join(parts)
        if not parts and getattr(result, "structured_content", None) is not None:
            text = str(result.structured_content)
        if len(text) > RESULT_CHARS:
            text = text[:RESULT_CHARS] + f"\n[cut at {RESULT_CHARS} characters]"
        return text, bool(getattr(result, "is_error", False))

    async def prompt_text(self, name: str, arguments: dict[str, str]) -> str:
        result = await self._guard(f"the prompt {name}", lambda s: s.get_prompt(name, arguments))
        texts = [getattr(m.content, "text", "") for m in result.messages]
        return "\n\n".join(t for t in texts if t)

    async def resource_text(self, uri: str) -> str:
        result = await self._guard(f"the resource {uri}", lambda s: s.read_resource(uri))
        texts = [c.text for c in result.contents if isinstance(getattr(c, "text", None), str)]
        if not texts:
            raise CallFailed(f"The resource {uri} has no text to attach (it is binary).")
        return "\n".join(texts)


class McpManager:
    """Every configured server: started, stopped and restarted as the configuration changes, and the tools they
    offer under the names the model is shown (a tool's own name, `server__tool` where two servers share it)."""

    def __init__(self, log_dir: Path, on_change: Callable[[], None] = lambda: None) -> None:
        self._log_dir = log_dir
        self.on_change = on_change
        self.servers: dict[str, ServerConnection] = {}

    def _changed(self) -> None:
        self.on_change()

    async def apply(self, configs: list[ServerConfig]) -> None:
        """Brings the connections in line with `configs`: a server whose entry changed is restarted."""
        wanted = {c.name: c for c in configs}
        for name, conn in list(self.servers.items()):
            if wanted.get(name) != conn.config:
                del self.servers[name]
                await conn.stop()
        for name, cfg in wanted.items():
            if name not in self.servers:
                conn = ServerConnection(cfg, self._log_dir, self._changed)
                self.servers[name] = conn
                conn.start()
        self._changed()

    async def wait_ready(self) -> None:
        await asyncio.gather(*(c.wait_ready() for c in self.servers.values()))

    async def close(self) -> None:
        for conn in list(self.servers.values()):
            await conn.stop()

    def views(self) -> list[ServerView]:
        return [c.view() for c in self.servers.values()]

    def exposed(self) -> dict[str, ToolInfo]:
        """The model's name for each tool of the ready servers."""
        tools = [t for c in self.servers.values() if c.state == "ready" for t in c.tools]
        counts: dict[str, int] = {}
        for t in tools:
            counts[t.name] = counts.get(t.name, 0) + 1
        out = {}
        for t in tools:
            name = t.name if counts[t.name] == 1 else f"{t.server}__{t.name}"
            out[re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:128]] = t  # the engine's rule for a function's name
        return out

    def openai_tools(self, skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
        """The tools as OpenAI's function definitions, but those of the servers in `skip`."""
        return [
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": t.description or f"{t.name} (MCP server {t.server})",
                    "parameters": t.schema or {"type": "object", "properties": {}},
                },
            }
            for name, t in self.exposed().items()
            if t.server not in skip
        ]

    def connection(self, server: str) -> ServerConnection | None:
        return self.servers.get(server)
