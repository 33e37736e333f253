"""File → Connect is safe (issue 50, item 5): the endpoint is asked for its models before anything local stops, a
bad one is refused in one line while the local model keeps running (and answering), the check can be cancelled,
File → Back to local model loads the local model again, and while connected the picker and the chat's status
name the remote model. The "remote" server is a second real engine (`tokenwing serve` with its own key); a bad
address is a port nothing listens on, a server that never answers is a socket that accepts and stays silent."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication, QDialogButtonBox
from pytestqt.qtbot import QtBot

from runmyai.engine.endpoint import Endpoint
from runmyai.engine.supervisor import EngineSupervisor
from runmyai.ui import layout_check
from runmyai.ui.controller import AppController
from runmyai.ui.controllers.library import REMOTE_KEY
from runmyai.ui.main_window import ConnectDialog, MainWindow
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller, until
from tests.qtloop import run_qt


@pytest.fixture
def local(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path
) -> Iterator[tuple[MainWindow, AppController, Path]]:
    server, data = tiny_hub
    model = tmp_path / "home" / "models" / "local.tw.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(data)
    window, c = make_controller(tmp_path, server, data)
    window.resize(1280, 800)
    yield window, c, model
    c.stop_following_desktop()
    window.close()


def answers(endpoint: Endpoint) -> bool:
    """The engine's API answers with its key (the local engine, or the user's API server, is still up)."""
    request = urllib.request.Request(endpoint.url("models"), headers=endpoint.headers())
    with urllib.request.urlopen(request, timeout=30) as r:
        return bool(r.status == 200)


def test_a_bad_endpoint_is_refused_before_anything_local_stops_and_back_to_local_returns(
    qapp: QApplication, local: tuple[MainWindow, AppController, Path]
) -> None:
    window, c, model = local
    with socket.socket() as nothing:  # a port that was free: nothing listens there
        nothing.bind(("127.0.0.1", 0))
        dead_port = nothing.getsockname()[1]
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)

    async def flow() -> None:
        await c.start()
        assert await c.engine.use_model(f"local:{model}") is not None
        sup = c.engine.supervisor
        assert sup is not None and sup.endpoint is not None
        status = window.chat.status.text()
        assert status.startswith("Chatting with ")
        assert not window.back_to_local.isEnabled()  # nothing to go back to

        # a bad address, a bad scheme, a silent server: refused in one sentence; the local engine still answers
        for url, words in (
            (f"http://127.0.0.1:{dead_port}/v1", "Cannot connect"),
            ("ftp://example.com", "not an endpoint address"),
        ):
            why = await c.engine.use_endpoint(url, "some-key")
            assert why is not None and words in why and "\n" not in why, why
            assert c.engine.supervisor is sup and sup.state == "ready" and answers(sup.endpoint)
            assert window.chat.status.text() == status and c.engine.endpoint is not None and c.engine.endpoint.local
        notice = window.notifications.get("endpoint")
        assert notice is not None and "Connect" in notice.title  # (from the command line: a notification)
        c.engine.probe_timeout_s = 0.5
        why = await c.engine.use_endpoint(f"http://127.0.0.1:{silent.getsockname()[1]}/v1", None)
        assert why is not None and why.startswith("No answer from") and "0.5 s" in why, why
        assert c.engine.supervisor is sup and answers(sup.endpoint)

        # a real server with a key: the wrong key is refused, the engine here untouched
        remote = EngineSupervisor(model, [], api_key="rma-remote-key", log_dir=c.paths.logs)
        remote_endpoint = await remote.start()
        try:
            why = await c.engine.use_endpoint(remote_endpoint.base_url, "wrong-key")
            assert why is not None and "refused the API key" in why
            assert c.engine.supervisor is sup and answers(sup.endpoint)

            # the dialog: Connect starts the check, Cancel stops it (a silent server: it would wait), nothing stops
            c.engine.probe_timeout_s = 600
            dialog = c.engine.ask_endpoint()
            dialog.url.setText(f"http://127.0.0.1:{silent.getsockname()[1]}/v1")
            dialog.connect_button.click()
            await until(lambda: dialog.checking, 10, "checking")
            assert dialog.state.text().startswith("Checking ") and not dialog.url.isEnabled()
            dialog.buttons.button(QDialogButtonBox.StandardButton.Cancel).click()
            await until(lambda: not dialog.checking, 10, "cancelled")
            assert not dialog.isVisible() and c.engine.supervisor is sup and answers(sup.endpoint)

            # the dialog again, the right server: connected, the local engine stopped, the remote model named
            c.engine.probe_timeout_s = 30
            dialog = c.engine.ask_endpoint()
            dialog.url.setText(remote_endpoint.base_url)
            dialog.key.setText("wrong-key")
            dialog.connect_button.click()
            await until(lambda: not dialog.checking and dialog.state.text().startswith("The server refused"), 30, "?")
            assert dialog.isVisible() and c.engine.supervisor is sup  # refused in the dialog, in one line; still local
            dialog.key.setText("rma-remote-key")
            dialog.connect_button.click()
            await until(lambda: not dialog.isVisible(), 30, "connected")
            assert c.engine.supervisor is None and sup.state == "stopped"
            assert c.engine.endpoint is not None and not c.engine.endpoint.local and c.engine.endpoint.model
            name = c.engine.endpoint.model
            picker = window.chat.model_picker
            assert picker.currentData() == REMOTE_KEY and picker.currentText().startswith(name), picker.currentText()
            assert "127.0.0.1" in picker.currentText() and "local.tw" not in picker.currentText()
            assert window.chat.status.text() == f"Chatting with {name}."
            assert "tiny" not in window.chat.status.text().lower()
            assert window.back_to_local.isEnabled()
            assert window.graphs.device.text() == ""  # the local engine's device line went with it
            reply = await c.chat.chat_once("Hello")
            assert reply is not None  # the remote engine answered

            # File → Back to local model: the local model again, the picker says so, the action disabled
            window.back_to_local.trigger()
            await until(
                lambda: (
                    c.engine.supervisor is not None and c.engine.supervisor.state == "ready" and c.engine.ready.is_set()
                ),
                120,
            )
            assert (
                c.engine.supervisor is not None and c.engine.supervisor.model == model and c.engine.endpoint is not None
            )
            assert c.engine.endpoint.local and not window.back_to_local.isEnabled()
            assert picker.currentData() == f"local:{model}" and picker.findData(REMOTE_KEY) == -1
            assert (
                answers(c.engine.supervisor.endpoint) and remote.state == "ready"
            )  # (the remote one was never touched)
        finally:
            await remote.stop()
            await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        silent.close()


def test_the_connect_dialog_shows_a_whole_address(
    qapp: QApplication, local: tuple[MainWindow, AppController, Path]
) -> None:
    """The walk-through's URL field cut the address; layout_check sees a cut one."""
    _window, c, _model = local
    dialog = c.engine.ask_endpoint()
    try:
        dialog.url.setText("https://my-gpu-box.example.com:8443/v1")
        qapp.processEvents()
        assert dialog.isVisible()
        assert not layout_check.clipped(dialog), layout_check.clipped(dialog)
        dialog.url.setMinimumWidth(0)
        dialog.url.setFixedWidth(140)
        qapp.processEvents()
        assert any("my-gpu-box" in p for p in layout_check.clipped(dialog)), layout_check.clipped(dialog)
    finally:
        dialog.reject()


def test_the_dialog_grows_for_its_refusal(qtbot: QtBot) -> None:
    """The refusal's line is read whole: on a real desktop (Xvfb, xcb) the dialog kept its size when the sentence
    appeared, cutting it and the note above it in half and squeezing the fields (18 px for 28)."""
    note = "Connecting stops the model running here until File → Back to local model. The address is checked first."
    dialog = ConnectDialog(None, "http://127.0.0.1:9/v1", "", note)
    qtbot.addWidget(dialog)
    dialog.show()
    QApplication.processEvents()
    dialog.show_state("Cannot connect to http://127.0.0.1:9/v1; check the address and that the server is running.")
    QApplication.processEvents()
    assert dialog.state.isVisible() and layout_check.clipped(dialog) == []
