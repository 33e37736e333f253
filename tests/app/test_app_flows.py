"""More of what a user does in the window: hub search, Import GGUF, a remote endpoint, autotune overrides,
pausing a download from its notification and resuming it from its row (offscreen, real engine, local hub server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from PySide6.QtWidgets import QApplication, QPushButton

from runmyai.ui.autotune_dialog import AutotuneDialog
from tests.app.conftest import FILE, REPO
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller, until
from tests.conftest import ModelFactory
from tests.engine.test_server import Server
from tests.qtloop import run_qt


def test_search_import_endpoint_and_download_buttons(
    qapp: QApplication,
    tiny_hub: tuple[HubServer, bytes],
    tmp_path: Path,
    model_factory: ModelFactory,
    repacked_factory: ModelFactory,
) -> None:
    server, data = tiny_hub
    server.add_file("someone/Other-GGUF", "other-Q8_0.gguf", b"GGUF" + bytes(1000), tags=["gguf"])
    window, c = make_controller(tmp_path, server, data)
    gguf = model_factory(type="Q8_0", seed=3)  # not the preset's file (that one would count as installed)
    engine = Server(repacked_factory(type="Q8_0"), key="remote-key")

    async def flows() -> None:
        await c.start()
        # hub search: repacked models and GGUF repositories, with their files
        window.library.search.setText("tiny")
        window.library.search.returnPressed.emit()
        await until(lambda: any(e.key == f"hub:{REPO}" for e in c.models.entries()), 30, "search")
        hit = next(e for e in c.models.entries() if e.key == f"hub:{REPO}")
        assert FILE in hit.details_html and hit.can_download

        # Import GGUF: repacked with progress into the library
        seen: list[str] = []
        notes = window.notifications
        original = notes.job

        def spy(key: str, title: str, message: str = "", progress: float | None = None, **kw: bool) -> None:
            seen.append(title)
            original(key, title, message, progress, **kw)

        notes.job = spy  # type: ignore[method-assign]
        imported = await c.jobs.import_files([gguf])
        assert imported is not None and imported.error is None
        assert any(m.path == imported.path for m in c.models.local_models)
        assert any(label.startswith("Importing") for label in seen) and notes.get("import") is None  # done: gone

        # a published file's download: its notification's Cancel pauses it, its row resumes it; the hub holds
        # every body until the pause is done, so the download cannot finish before the click, however slow
        # this machine is
        server.faults.hold_after, server.faults.hold_times = 1000, 1000
        window.library.select("preset:tiny")
        window.library.download_button.click()
        table = window.library.downloads
        await until(lambda: bool(c.jobs.downloads.items()) and c.jobs.downloads.items()[0].state == "downloading", 30)
        note = f"download:{c.jobs.downloads.items()[0].id}"
        await until(lambda: notes.get(note) is not None, 30, "its notification")
        shown = next(card for card in window.notice_area.cards if card.notice.key == note)
        assert table.rowCount() == 0  # running: the notification shows it, not the table as well
        shown.cancel.click()
        await until(lambda: c.jobs.downloads.items()[0].state == "paused" and table.rowCount() == 1, 30, "pause")
        assert table.item(0, 4).text() and notes.get(note) is None  # the state is shown; the notification went
        server.faults.hold_after = None
        server.faults.release.set()
        table.cellWidget(0, 5).findChild(QPushButton, "resume").click()
        await until(lambda: any(m.preset_id == "tiny" for m in c.models.local_models), 60, "resume")
        assert table.rowCount() == 0 and not c.jobs.downloads.items()  # done: the finished row cleared itself
        assert notes.get(note) is None

        # a remote OpenAI-compatible endpoint instead of a local engine
        await c.engine.use_endpoint(engine.url, "remote-key")
        assert c.engine.supervisor is None and c.engine.endpoint is not None and not c.engine.endpoint.local
        assert await c.chat.chat_once("Hello, remote")
        await c.engine.use_endpoint("not a url", None)
        assert any("not an endpoint address" in t for t in window.notice_area.texts())
        await c.shutdown()

    try:
        run_qt(qapp, flows)
    finally:
        engine.stop()
        window.close()


def test_autotune_dialog_overrides_reach_the_engine_flags(qapp: QApplication, qtbot: object, tmp_path: Path) -> None:
    from runmyai.engine.autotune import AutotuneRunner

    runner = AutotuneRunner(tmp_path)
    model = tmp_path / "m.tw.gguf"
    model.write_bytes(b"")
    dialog = AutotuneDialog("m")
    dialog.show_result(["Memory: 1 GiB"], {"threads": 2, "ram_budget": 1000}, {"threads": "2 cores"}, {})
    assert dialog.overrides.rowCount() == 2
    dialog.overrides.item(0, 2).setText("1")  # threads: 1
    dialog.overrides_saved.connect(lambda values: runner.set_overrides(model, values))
    dialog.overrides_saved.emit(dialog.override_values())
    assert dialog.override_values() == {"threads": "1"}
    flags = runner.serve_flags(model)
    assert "--threads" in flags and flags[flags.index("--threads") + 1] == "1"
    dialog.close()
    asyncio.set_event_loop(None)
