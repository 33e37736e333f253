"""The Server page's local-network switch (the engine bound to every address, only with the key) and its request
log (one line per API request from the engine's log: time, route, status, tokens, duration), with the real engine
and the official `openai` client. Only loopback is ever called: the LAN binding is checked where it shows (the
engine's command line and its handshake), never by reaching another address."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
from PySide6.QtWidgets import QApplication

from runmyai.engine.request_log import LAN_HOST, RequestEntry, RequestLog, parse_line
from runmyai.ui.pages import LAN_WARNING
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller, until
from tests.app.test_shell_actions import free_port
from tests.conftest import ModelFactory
from tests.qtloop import run_qt


def test_request_lines_read_and_others_ignored() -> None:
    line = 'tokenwing: request {"time":1700000000.5,"method":"POST","path":"/v1/chat/completions","status":200,' \
        '"ms":812.4,"prompt_tokens":41,"completion_tokens":1234}'  # fmt: skip
    entry = parse_line(line)
    assert entry == RequestEntry(1700000000.5, "POST", "/v1/chat/completions", 200, 812.4, 41, 1234)
    assert entry.row()[1:] == ("POST /v1/chat/completions", "200", "41 in · 1,234 out", "812 ms")
    slow = parse_line('request {"time":1,"method":"GET","path":"/v1/models","status":401,"ms":12500}')
    assert slow is not None and slow.row()[2:] == ("401", "—", "12.5 s")
    for other in ("tokenwing: loading the model", "request {not json", 'request {"path": 3}', "request [1]", ""):
        assert parse_line(other) is None, other
    log = RequestLog(keep=2)
    for n in range(3):
        log.add_line(f'request {{"time":{n},"method":"GET","path":"/v1/models","status":200,"ms":1}}')
    assert [e.time for e in log.entries()] == [2.0, 1.0]  # newest first, the oldest let go


def test_lan_switch_reaches_the_command_line_and_requests_are_listed(
    qapp: QApplication, tmp_path: Path, repacked_factory: ModelFactory
) -> None:
    model = tmp_path / "home" / "models" / "local.tw.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(repacked_factory(type="Q8_0").read_bytes())
    key, port = f"local:{model}", free_port()
    with HubServer() as hub:
        window, c = make_controller(tmp_path, hub, b"")
        page = window.server_page
        seen: dict[str, Any] = {}

        def ask(api_key: str, stream: bool = False) -> Any:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0)
            try:
                if stream:  # (no usage asked for: the request log reads the last chunk's own)
                    chunks = client.chat.completions.create(
                        model="local", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True
                    )
                    return sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
                return client.chat.completions.create(
                    model="local", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
                )
            except openai.AuthenticationError as e:
                return e.status_code
            finally:
                client.close()

        async def scenario() -> None:
            try:
                await c.models.refresh_library()
                assert await c.engine.use_model(key) is not None and c.engine.supervisor is not None
                seen["private"] = c.engine.supervisor.host
                # the switch, as the page sends it: the server on, on the local network, with its key (one change)
                page.port.setValue(port)
                page.enabled.blockSignals(True)
                page.enabled.setChecked(True)
                page.enabled.blockSignals(False)
                seen["warning hidden"] = not page.lan_warning.isVisibleTo(page)
                before = set(c.ctx.tasks)
                page.lan.setChecked(True)
                restart = [
                    t for t in c.ctx.tasks - before if getattr(t.get_coro(), "__qualname__", "").endswith("set_server")
                ]
                assert len(restart) == 1
                await restart[0]  # the restart the switch started, to its end
                seen["warning"] = page.lan_warning.isVisibleTo(page) and page.lan_warning.text().endswith(LAN_WARNING)
                s = c.ctx.settings.server
                assert s.enabled and s.lan and s.port == port and s.api_key
                sup = c.engine.supervisor
                assert sup is not None and sup.state == "ready"
                seen["host"] = (sup.host, (sup.handshake or {}).get("host"))
                seen["argv"] = next(ln for ln in sup.log if "starting the engine:" in ln)
                seen["state"] = page.state.text()
                reply = await asyncio.to_thread(ask, s.api_key)
                seen["usage"] = (reply.usage.prompt_tokens, reply.usage.completion_tokens)
                seen["pieces"] = await asyncio.to_thread(ask, s.api_key, True)
                seen["no key"] = await asyncio.to_thread(ask, "wrong-key")

                # the client's three requests (the app's own, such as its look at /v1/models for the model's
                # modalities at each engine start, may land among them in any order)
                def chats() -> list[Any]:
                    return [r for r in page.request_rows() if r[1] == "POST /v1/chat/completions"]

                await until(lambda: len(chats()) >= 3, 60, "the three requests listed")
                seen["rows"] = chats()
                # off again: back on loopback
                await c.server.set_server(replace(c.ctx.settings.server, lan=False))
                assert c.engine.supervisor is not None
                seen["off"] = c.engine.supervisor.host
            finally:
                await c.shutdown()

        run_qt(qapp, scenario)
    assert seen["private"] == "127.0.0.1"
    assert seen["warning hidden"] and seen["warning"]
    assert seen["host"] == (LAN_HOST, LAN_HOST)  # the engine said it listens on every address
    assert f"--host {LAN_HOST} --port {port}" in seen["argv"]
    assert "Other devices on this network" in seen["state"]
    prompt, completion = seen["usage"]
    assert seen["no key"] == 401
    refused, streamed, answered = seen["rows"][:3]  # newest first
    assert answered[1:4] == ("POST /v1/chat/completions", "200", f"{prompt:,} in · {completion:,} out")
    assert streamed[1:3] == ("POST /v1/chat/completions", "200") and seen["pieces"] >= 1
    assert streamed[3].startswith(f"{prompt:,} in · ") and streamed[3] != "—"  # a stream's tokens, from its end
    assert refused[1:4] == ("POST /v1/chat/completions", "401", "—")
    assert answered[4].endswith(("ms", "s"))
    assert seen["off"] == "127.0.0.1"
    assert json.loads(json.dumps(seen["rows"]))  # (plain text cells)


def test_the_chats_token_counts_and_the_prompt_cache_look_are_not_listed() -> None:
    log = RequestLog()
    count = 'request {"time":1,"method":"POST","path":"/v1/chat/count","status":200,"ms":3}'
    assert log.add_line(count) is not None and log.entries() == []
    look = 'request {"time":2,"method":"GET","path":"/v1/tokenwing/prompt-cache","status":200,"ms":1}'
    assert log.add_line(look) is not None and log.entries() == []
    forget = 'request {"time":3,"method":"POST","path":"/v1/tokenwing/prompt-cache/forget","status":200,"ms":1}'
    assert log.add_line(forget) is not None and [e.path for e in log.entries()] == ["/v1/tokenwing/prompt-cache/forget"]
