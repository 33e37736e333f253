"""The engine killed in the middle of a reply, in the whole app (offscreen, real engine, real supervisor): what
arrived is kept and marked cut off, in the window and in the store; the engine restarts; the next message works;
nothing in the SQLite store is lost. The engine holds the reply at a known point (its test-only pause
serve.pieceN, tokenwing/testpause.py) and is killed there, so the test never races the reply."""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication

from runmyai.chat.store import ConversationStore
from runmyai.engine.client import ChatSettings
from runmyai.paths import AppPaths
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller, until
from tests.conftest import ModelFactory
from tests.pauses import Pauses
from tests.qtloop import run_qt

N = 3  # text pieces that reach the app before the engine dies


def test_engine_killed_mid_reply(
    qapp: QApplication,
    tiny_hub: tuple[HubServer, bytes],
    tmp_path: Path,
    repacked_factory: ModelFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, data = tiny_hub
    model = tmp_path / "home" / "models" / "local.tw.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(repacked_factory(type="Q8_0").read_bytes())
    pauses = Pauses(tmp_path / "pauses", f"serve.piece{N}")
    pauses.arm(monkeypatch)  # the engine inherits it, restarts too (which pass: it holds once)
    window, c = make_controller(tmp_path, server, data)
    received: list[str] = []

    async def scenario() -> None:
        await c.start()
        assert await c.engine.use_model(f"local:{model}") is not None and c.engine.supervisor is not None
        cid = c.talks.conversation_id or 0
        c.store.set_settings(cid, ChatSettings(temperature=0.0, max_tokens=N - 1))  # (too short to be held)
        await c.chat.chat_once("Hello there")  # a whole reply before the fault
        assert c.store.messages(cid)[-1].finish_reason in ("stop", "length")
        c.store.set_settings(cid, ChatSettings(temperature=0.0, max_tokens=400))
        # the second reply stops at N pieces (the engine holds it): kill the engine as the N-th arrives
        transcript = window.chat.transcript
        append = transcript.append_reply
        pid = c.engine.supervisor.pid
        assert pid is not None

        def append_then_kill(delta: str) -> None:
            append(delta)
            received.append(delta)
            if len(received) == N:
                assert pauses.reached(f"serve.piece{N}") == pid  # the engine is really holding there, mid-reply
                os.kill(pid, signal.SIGKILL)

        transcript.append_reply = append_then_kill  # type: ignore[method-assign]
        window.chat.input.setPlainText("Tell me a long story")
        window.chat.send_button.click()
        await until(lambda: c.chat.reply_task is not None and c.chat.reply_task.done(), 60, "the cut-off reply")
        transcript.append_reply = append  # type: ignore[method-assign]
        assert len(received) == N
        status = window.chat.status.text()
        assert "broke off in the middle of the reply" in status, status
        text = transcript.toPlainText()
        assert "cut off by an error" in text, text  # marked in the window ...
        cut = c.store.messages(cid)[-1]
        assert cut.role == "assistant" and cut.finish_reason == "error"  # ... and in the store
        assert cut.content == "".join(received)  # exactly what arrived
        # the supervisor restarts the engine; the next message works
        await until(
            lambda: (
                c.engine.supervisor is not None
                and c.engine.supervisor.state == "ready"
                and c.engine.supervisor.pid not in (None, pid)
            ),
            120,
        )
        await until(c.engine.ready.is_set, 30, "chat ready again")
        assert c.engine.supervisor.last_fault is not None and c.engine.supervisor.last_fault.kind == "crash"
        again = await c.chat.chat_once("And now?")
        assert c.store.messages(cid)[-1].finish_reason in ("stop", "length"), window.chat.status.text()
        assert again == c.store.messages(cid)[-1].content
        await c.shutdown()

    run_qt(qapp, scenario)
    window.close()
    # nothing in the store was lost: a fresh connection reads every message, the cut-off one as it arrived
    path = AppPaths(tmp_path / "home").conversations_db
    with ConversationStore(path) as store:
        [conv] = store.list()
        msgs = store.messages(conv.id)
    assert [m.role for m in msgs] == ["user", "assistant"] * 3
    assert [m.finish_reason for m in msgs[1::2]] == [msgs[1].finish_reason, "error", msgs[5].finish_reason]
    assert msgs[3].content == "".join(received) and msgs[5].finish_reason in ("stop", "length")
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    con.close()
