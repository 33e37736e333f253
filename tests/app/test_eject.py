"""Eject: the model's engine process ends (its memory with it) and the app stays usable — the chat says no model is
loaded, a message gets one sentence and is not kept, and the picker loads a model again. The real engine."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from PySide6.QtWidgets import QApplication

from runmyai.engine.client import ChatSettings
from runmyai.ui.chat_panel import NO_MODEL
from runmyai.ui.controller import AppController
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller
from tests.conftest import ModelFactory
from tests.qtloop import run_qt


async def clicked(c: AppController, act: Callable[[], object]) -> None:
    """Does what a click does, then awaits the tasks that click started (not a sleep, not a poll)."""
    before = set(c.ctx.tasks)
    act()
    await asyncio.gather(*(c.ctx.tasks - before))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_eject_ends_the_engine_and_the_app_stays_usable(
    qapp: QApplication, tmp_path: Path, repacked_factory: ModelFactory
) -> None:
    model = tmp_path / "home" / "models" / "local.tw.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(repacked_factory(type="Q8_0").read_bytes())
    key = f"local:{model}"
    with HubServer() as hub:
        window, c = make_controller(tmp_path, hub, b"")
        chat = window.chat
        seen: dict[str, object] = {}

        async def scenario() -> None:
            try:
                await c.start()  # (the machine probed: the picker lists the models that can run here)
                assert not chat.eject_button.isEnabled()  # nothing loaded yet
                assert await c.engine.use_model(key) is not None and c.engine.supervisor is not None
                pid = c.engine.supervisor.pid
                assert pid is not None and alive(pid) and chat.eject_button.isEnabled()
                assert chat.model_picker.currentData() == key

                seen["name"] = c.engine.model_name
                await clicked(c, chat.eject_button.click)
                seen["alive"] = alive(pid)
                seen["state"] = (
                    c.engine.supervisor,
                    c.engine.chat_client,
                    c.engine.model_name,
                    c.engine.ready.is_set(),
                )
                seen["status"] = chat.status.text()
                seen["picker"] = chat.model_picker.currentText()
                seen["eject"] = chat.eject_button.isEnabled()
                seen["engine"] = window.engine_label.text()

                cid = c.talks.conversation_id
                assert cid is not None
                c.store.set_settings(cid, ChatSettings(max_tokens=4))
                seen["reply"] = await c.chat.chat_once("Hello?")
                seen["kept"] = [m.content for m in c.store.messages(cid)]
                seen["after"] = chat.status.text()

                # the picker loads a model again, as it would any time
                await clicked(c, lambda: chat.model_picker.activated.emit(chat.model_picker.findData(key)))
                seen["again"] = c.engine.supervisor is not None and c.engine.supervisor.state == "ready"
                seen["reply2"] = await c.chat.chat_once("Hello again")
            finally:
                await c.shutdown()

        run_qt(qapp, scenario)
    assert seen["alive"] is False  # the engine process is gone: its RAM and VRAM are free
    assert seen["state"] == (None, None, None, False)
    assert seen["status"] == f"{seen['name']} was ejected: no model is loaded. Choose one above."
    assert seen["picker"] == NO_MODEL and seen["eject"] is False
    assert seen["engine"] == "Engine: stopped (no model loaded)"
    assert seen["reply"] == "" and seen["kept"] == []  # refused in one sentence, nothing kept
    assert "No model is running" in str(seen["after"])
    assert seen["again"] is True and isinstance(seen["reply2"], str) and seen["reply2"]
