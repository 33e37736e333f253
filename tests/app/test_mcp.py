"""MCP servers in the app (issue 28, part 4), against a real MCP server on the official SDK (tests/app/
mcp_server.py): the configuration, the approval policy, the connections over stdio and streamable HTTP, a crash
and a hang in one line each; then the whole app under pytest-qt with the real engine, whose replies are scripted
tool calls (TOKENWING_TEST_TOKENS: random weights never write one): a call approved, its result in the next
prompt the engine renders; a call denied; a server crashing mid-call; a call that never answers, stopped."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PySide6.QtWidgets import QApplication

from runmyai.chat.store import ConversationStore
from runmyai.chat.tools import ToolCall
from runmyai.mcp.approval import ApprovalPolicy, Decision
from runmyai.mcp.config import ConfigError, ConfigFile, parse, set_disabled
from runmyai.mcp.runner import McpToolRunner
from runmyai.mcp.servers import McpManager, ToolInfo
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller, until
from tests.conftest import ModelFactory
from tests.qtloop import run_qt
from tokenwing.format.reader import ModelFile
from tokenwing.text.tokenizer import tokenizer_from_metadata

SERVER = str(Path(__file__).with_name("mcp_server.py"))


def stdio_entry(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    args = [SERVER, "--gate", str(tmp_path / "gate"), "--started", str(tmp_path / "hang-started")]
    return {"command": sys.executable, "args": args, **extra}


# ------------------------------------------------------------------------------------------ Qt-free
def test_config_reads_the_common_format_and_names_what_is_wrong(tmp_path: Path) -> None:
    doc = {
        "mcpServers": {
            "files": {"command": "npx", "args": ["-y", "server"], "env": {"K": "v"}, "timeout": 5},
            "web": {"url": "https://example.test/mcp", "headers": {"Authorization": "Bearer x"}, "disabled": True},
        }
    }
    files, web = parse(json.dumps(doc))
    assert files.transport == "stdio" and files.args == ("-y", "server") and files.timeout_s == 5.0
    assert web.transport == "http" and web.disabled and web.headers["Authorization"] == "Bearer x"
    for bad, words in (
        ("{", "not valid JSON"),
        ('{"mcpServers": {"a": {}}}', 'mcpServers.a needs either "command"'),
        ('{"mcpServers": {"a": {"command": "x", "args": "y"}}}', "mcpServers.a.args must be a list"),
        ('{"mcpServers": {"a": {"url": "ftp://x"}}}', "mcpServers.a.url"),
        ('{"mcpServers": {"a": {"command": "x", "timeout": 0}}}', "mcpServers.a.timeout"),
    ):
        with pytest.raises(ConfigError, match=words):
            parse(bad)
    text = set_disabled(json.dumps(doc), "web", False)
    assert (
        not parse(text)[1].disabled and json.loads(text)["mcpServers"]["web"]["url"] == doc["mcpServers"]["web"]["url"]
    )
    f = ConfigFile(tmp_path / "mcp.json")
    assert f.servers() == []
    with pytest.raises(ConfigError):
        f.save("[]")
    assert not f.path.exists()  # a bad document never replaces the file
    f.save(text)
    assert f.servers()[1].name == "web"


def test_approval_always_is_kept_once_and_deny_are_not(tmp_path: Path) -> None:
    policy = ApprovalPolicy(tmp_path / "approvals.json")
    assert policy.needs_asking("s", "add")
    assert policy.record("s", "add", "once") and policy.needs_asking("s", "add")
    assert not policy.record("s", "add", "deny") and policy.needs_asking("s", "add")
    assert policy.record("s", "add", "always") and not policy.needs_asking("s", "add")
    again = ApprovalPolicy(tmp_path / "approvals.json")
    assert not again.needs_asking("s", "add") and again.needs_asking("s", "echo") and again.needs_asking("t", "add")
    again.forget("s")
    assert ApprovalPolicy(tmp_path / "approvals.json").needs_asking("s", "add")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_servers_over_stdio_and_http_crash_and_hang_in_one_line(tmp_path: Path, http_server: str) -> None:
    doc = {
        "mcpServers": {
            "local": stdio_entry(tmp_path, timeout=1),  # hang: its gate never opens, the timeout ends it
            "remote": {"url": http_server},
            "off": {"command": sys.executable, "args": [SERVER], "disabled": True},
            "broken": {"command": str(tmp_path / "no-such-program")},
        }
    }
    asked: list[str] = []

    async def approve(call: ToolCall, tool: ToolInfo) -> Decision:
        asked.append(f"{tool.server}.{tool.name}")
        return "deny" if tool.name == "echo" else "once"

    async def scenario() -> None:
        manager = McpManager(tmp_path / "logs")
        await manager.apply(parse(json.dumps(doc)))
        await manager.wait_ready()
        try:
            views = {v.name: v for v in manager.views()}
            assert views["local"].state == "ready" and views["local"].line == "ready: 4 tools"
            assert [t.name for t in views["remote"].tools] == ["add", "echo", "crash", "hang"]
            assert views["off"].state == "disabled" and not views["off"].tools
            assert views["broken"].state == "error" and "no-such-program" in views["broken"].line
            assert [p.name for p in views["local"].prompts] == ["review"]
            assert [r.uri for r in views["local"].resources] == ["note://readme", "blob://bytes"]
            # two servers offer the same tools: the model sees them apart
            names = [t["function"]["name"] for t in manager.openai_tools()]
            assert names[:2] == ["local__add", "local__echo"] and "remote__add" in names
            runner = McpToolRunner(manager, ApprovalPolicy(), approve)
            r = await runner.run(ToolCall("c1", "remote__add", '{"a": 2, "b": 40}'))
            assert (r.outcome, r.content) == ("ok", "2 + 40 = 42")
            r = await runner.run(ToolCall("c2", "local__echo", '{"text": "hi"}'))
            assert r.outcome == "denied" and "denied" in r.content
            r = await runner.run(ToolCall("c3", "local__add", '{"a": "x"}'))
            assert r.outcome == "error" and "add reported an error" in r.line  # the tool's own error
            r = await runner.run(ToolCall("c4", "local__hang", "{}"))
            assert (
                r.outcome == "failed" and r.line == "The MCP server 'local' did not answer the call of hang within 1 s."
            )
            assert (tmp_path / "hang-started").exists()  # it was running, not refused
            r = await runner.run(ToolCall("c5", "local__crash", "{}"))
            assert r.outcome == "failed" and "\n" not in r.line and "'local'" in r.line, r.line
            await until(lambda: manager.servers["local"].state == "error", 10)
            assert "crashing on purpose" in manager.servers["local"].line  # what the server said last
            assert manager.views()[1].state == "ready"  # the other server goes on
            assert "echo" in [t["function"]["name"] for t in manager.openai_tools()]  # no longer shared
            r = await runner.run(ToolCall("c6", "echo", '{"text": "x"}'))
            assert r.outcome == "denied"
            text = await manager.servers["remote"].prompt_text("review", {"code": "x = 1"})
            assert text == "Please review this code:\nx = 1"
            assert await manager.servers["remote"].resource_text("note://readme") == "The launch code is 4711."
            assert asked == ["remote.add", "local.echo", "local.add", "local.hang", "local.crash", "remote.echo"]
        finally:
            await manager.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------ the app
def script(model: Path, replies: list[str]) -> str:
    """TOKENWING_TEST_TOKENS for these replies, one per request, each ended by the model's end of generation."""
    with ModelFile.open(str(model)) as mf:
        tok = tokenizer_from_metadata({k: v.value for k, v in mf.header.kv.items()}, str(model))
    end = min(tok.eos_ids)
    out = []
    for text in replies:
        ids = tok.encode(text, special=True, add_bos=False)
        assert tok.decode(ids) == text
        out.append(",".join(str(i) for i in [*ids, end]))
    return ";".join(out)


def call(name: str, args: dict[str, Any]) -> str:
    # the ChatML fallback's form (docs/api.md, Tool calls): the tiny model's template shows no tools
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_app_tool_calls_approve_deny_crash_and_stop(
    qapp: QApplication,
    tiny_hub: tuple[HubServer, bytes],
    tmp_path: Path,
    repacked_factory: ModelFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub, data = tiny_hub
    model = tmp_path / "home" / "models" / "local.tw.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(repacked_factory(type="Q8_0").read_bytes())
    replies = [
        "Let me add. " + call("add", {"a": 2, "b": 3}),  # 1: approved once
        "The sum is five.",
        call("echo", {"text": "secret"}),  # 2: denied
        "I may not echo.",
        call("crash", {}),  # 3: the server dies mid-call
        "The tool crashed.",
        call("hang", {}),  # 4: never answers; Stop
        "unused",
    ]
    monkeypatch.setenv("TOKENWING_TEST_TOKENS", script(model, replies))
    (tmp_path / "home").mkdir(exist_ok=True)
    (tmp_path / "home" / "mcp.json").write_text(json.dumps({"mcpServers": {"tools": stdio_entry(tmp_path)}}))
    window, c = make_controller(tmp_path, hub, data)

    async def answer(button: str) -> None:
        await until(lambda: c.mcp_room.approval is not None, 60, "the approval box")
        assert c.mcp_room.approval is not None
        getattr(c.mcp_room.approval, button).click()

    async def send(text: str) -> None:
        window.chat.input.setPlainText(text)
        window.chat.send_button.click()

    async def done() -> None:
        await until(lambda: c.chat.reply_task is not None and c.chat.reply_task.done(), 120, "the reply")

    async def scenario() -> None:
        await c.start()
        await until(
            lambda: (
                c.mcp_room.mcp.servers.get("tools") is not None and c.mcp_room.mcp.servers["tools"].state == "ready"
            ),
            60,
        )
        assert await c.engine.use_model(f"local:{model}") is not None and c.engine.endpoint is not None
        cid = c.talks.conversation_id or 0
        transcript = window.chat.transcript
        # the window lists the server, its tools, prompts and resources
        c.mcp_room.open_mcp()
        d = c.mcp_room.mcp_dialog
        assert d is not None and "tools (stdio) — ready: 4 tools" in d.server_line("tools")
        assert d.select_detail("tool", "add") and d.select_detail("resource", "note://readme")
        d.attach_button.click()
        await until(lambda: "4711" in window.chat.input.toPlainText(), 30, "the resource attached")
        d.arguments.setText("code=print(1)")
        assert d.select_detail("prompt", "review")
        window.chat.input.clear()
        d.insert_button.click()
        await until(lambda: "print(1)" in window.chat.input.toPlainText(), 30, "the prompt inserted")

        # 1. approved: the result reaches the next turn
        await send("What is 2 + 3?")
        await answer("once")
        await done()
        body = c.engine.chat_client.last_body if c.engine.chat_client else None
        assert body is not None and [t["function"]["name"] for t in body["tools"]] == ["add", "echo", "crash", "hang"]
        tool_msg = body["messages"][-1]
        assert tool_msg["role"] == "tool" and tool_msg["content"] == "2 + 3 = 5"
        assert body["messages"][-2]["tool_calls"][0]["function"]["name"] == "add"
        ep = c.engine.endpoint
        r = httpx.post(
            ep.url("/apply-template").replace("/v1/", "/"),
            json={"messages": body["messages"], "tools": body["tools"]},
            headers=ep.headers(),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        prompt = r.json()["prompt"]
        assert "2 + 3 = 5" in prompt.split("What is 2 + 3?", 1)[1]  # the engine's prompt carries the result
        last = c.store.messages(cid)[-1]
        assert last.content == "Let me add.\n\nThe sum is five." and last.finish_reason == "stop"
        shown = transcript.toPlainText()
        assert "Tool add (tools) — add returned 9 characters" in shown and "2 + 3 = 5" not in shown  # collapsed
        key = next(k for k in transcript._tools if k.startswith("0-"))
        transcript.toggle_tool_call(key)
        assert "Result: 2 + 3 = 5" in transcript.tool_call_text(key)
        # the call and its result are saved with the reply: the conversation reopened (in a store opened anew,
        # as after a restart) shows the call where it was, and sends it back
        asked = {"role": "assistant", "content": "Let me add.", "tool_calls": body["messages"][-2]["tool_calls"]}
        first_round = [
            {"role": "user", "content": "What is 2 + 3?"},
            asked,
            {"role": "tool", "tool_call_id": asked["tool_calls"][0]["id"], "content": "2 + 3 = 5"},
            {"role": "assistant", "content": "The sum is five."},
        ]
        again = ConversationStore(c.store.path)
        assert again.chat_payload(cid)[-4:] == first_round
        (saved_round,) = again.messages(cid)[-1].tool_rounds
        assert saved_round.at == len("Let me add.") and saved_round.results[0].line == "add returned 9 characters"
        again.close()
        c.talks.open_conversation(cid)
        shown = transcript.toPlainText()
        assert "Let me add.\n▸ Tool add — add returned 9 characters\nThe sum is five." in shown, shown
        (key,) = transcript._tools
        transcript.toggle_tool_call(key)
        assert transcript.tool_call_text(key).endswith('Arguments: {"a": 2, "b": 3}\nResult: 2 + 3 = 5')

        # 2. denied: the model hears it and answers
        await send("Echo my secret")
        await answer("deny")
        await done()
        assert c.engine.chat_client is not None and c.engine.chat_client.last_body is not None
        assert "denied" in c.engine.chat_client.last_body["messages"][-1]["content"]
        # the next turn's requests carried the earlier turn's call and result (the engine took them)
        assert c.engine.chat_client.last_body["messages"][-7:-3] == first_round
        assert c.store.messages(cid)[-1].content == "I may not echo."
        assert "You denied the call of echo." in transcript.toPlainText()

        # 3. the server crashes mid-call: one line, the chat goes on
        await send("Crash it")
        await answer("always")
        await done()
        assert c.store.messages(cid)[-1].content == "The tool crashed."
        line = c.engine.chat_client.last_body["messages"][-1]["content"]
        assert line.startswith("Error: The MCP server 'tools' failed during the call of crash") and "\n" not in line
        assert "crashing on purpose" in c.mcp_room.mcp.servers["tools"].line

        # 4. a call that never answers (its gate stays shut), stopped by the user
        await c.mcp_room.mcp.apply([])  # restart the crashed server
        await c.mcp_room.start_mcp()
        await c.mcp_room.mcp.wait_ready()
        await send("Wait forever")
        await answer("once")
        await until(lambda: (tmp_path / "hang-started").exists(), 60, "the hanging call")
        window.chat.stop_button.click()
        await done()
        assert c.store.messages(cid)[-1].finish_reason == "stopped"
        assert "Tool hang (tools) — stopped" in transcript.toPlainText()
        assert window.chat.status.text() == "Stopped."
        assert c.mcp_room.mcp.servers["tools"].state == "ready"  # the server itself lives on
        c.talks.open_conversation(cid)
        assert "Tool hang — stopped" in transcript.toPlainText()  # saved without a result: shown stopped
        # the stopped call goes back with a result that says so (a call without one is refused), and the chat
        # goes on
        await send("Never mind")
        await done()
        sent = c.engine.chat_client.last_body["messages"]
        assert sent[-3]["tool_calls"][0]["function"]["name"] == "hang"
        assert sent[-2] == {
            "role": "tool",
            "tool_call_id": sent[-3]["tool_calls"][0]["id"],
            "content": "Error: the user stopped this call before it finished.",
        }
        assert sent[-1] == {"role": "user", "content": "Never mind"}
        assert c.store.messages(cid)[-1].content == "unused" and c.store.messages(cid)[-1].finish_reason == "stop"
        await c.shutdown()

    run_qt(qapp, scenario, timeout=400)
