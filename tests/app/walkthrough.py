"""A new user's walk through the app, with a picture at each step (docs/app-walkthrough.md): a fresh home, the
shipped presets and built-in model, a local hub with a GGUF repository (two quants and a README). First start, a
chat with the built-in model, Discover's search, the model card, a download, a chat with the downloaded model, My
models (re-verify, open folder, delete), the server switch, Settings, the performance panel floated. Not a test
(it asserts nothing and looks at nothing): it drives the widgets as a user's clicks would and saves what a user
would see, for a person to look at.

    QT_QPA_PLATFORM=offscreen .venv/bin/python -m tests.app.walkthrough OUT_DIR [WIDTH HEIGHT]
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import qasync
from PySide6.QtCore import QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QApplication, QMessageBox

from runmyai.paths import AppPaths
from runmyai.ui.controller import AUTOTUNE_OFFER, AppController
from runmyai.ui.main_window import MainWindow
from tests.app.hubserver import HubServer
from tokenwing.testmodel import preset_shape, write_test_model

REPO = "acme/Tiny-MoE-3B-A1B-GGUF"
README = (
    "# Tiny MoE 3B-A1B\n\nA tiny mixture-of-experts test model.\n\n## Usage\n\n"
    "```bash\nrunmyai get acme/Tiny-MoE-3B-A1B-GGUF\n```\n\n## Quants\n\n| Quant | Size | Use |\n|---|---:|:---:|\n"
    "| Q4_K_M | 171 KB | smaller |\n| Q8_0 | 220 KB | best |\n\n## Benchmarks\n\n"
    "| Benchmark | Tiny-MoE | Qwen3-30B-A3B | Qwen3-32B | Llama-3.3-70B-Instruct | GPT-4o-2024 | DeepSeek-V3 |\n"
    "|---|---|---|---|---|---|---|\n| MMLU-Redux | 12.0 | 84.1 | 85.7 | 86.3 | 88.0 | 89.9 |\n"
)


async def until(predicate: Callable[[], bool], timeout: float = 120) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


class Walk:
    def __init__(self, window: MainWindow, c: AppController, out: Path) -> None:
        self.window, self.c, self.out, self.n = window, c, out, 0

    async def shot(self, name: str, settle: float = 0.6) -> None:
        await asyncio.sleep(settle)  # layouts settle, the graphs redraw on their 250 ms timer
        self.n += 1
        self.window.grab().save(str(self.out / f"{self.n:02d}-{name}.png"), "PNG")
        print(f"{self.n:02d}-{name}: {self.window.notice_area.texts()}", flush=True)

    def ready(self) -> bool:
        return self.c.engine.supervisor is not None and self.c.engine.supervisor.state == "ready"

    def replied(self) -> bool:
        return self.c.chat.reply_task is None or self.c.chat.reply_task.done()

    async def run(self) -> None:
        w, c = self.window, self.c
        await c.start()
        await self.shot("first-start")
        offer = next(card for card in w.notice_area.cards if card.notice.key == AUTOTUNE_OFFER)
        offer.retry.click()  # "Measure now"
        await until(lambda: w.notifications.get("autotune") is not None)
        await self.shot("measuring", 0.2)
        await until(lambda: (n := w.notifications.get("autotune")) is not None and n.kind != "job", 300)
        w.show_page("My models")
        await self.shot("measured")
        w.show_page("Chat")
        await c.engine.use_default_model()
        await until(self.ready)
        w.chat.input.setPlainText("Hello! Who are you?")
        w.chat.send_button.click()
        await asyncio.sleep(0.3)
        await until(self.replied)
        await self.shot("built-in-chat", 1.0)

        w.show_page("Discover")
        w.library.search.setText("tiny")
        w.library.search.returnPressed.emit()
        await until(lambda: w.library.search_status.text().startswith("“tiny”"))
        await self.shot("discover-search", 2.0)
        w.library.tabs.setCurrentIndex(1)
        await self.shot("model-card", 1.5)
        w.library.tabs.setCurrentIndex(0)
        w.library.download_button.click()
        await asyncio.sleep(1.0)
        await self.shot("downloading", 0.0)
        await until(lambda: any(not m.bundled for m in c.models.local_models))
        await self.shot("downloaded")
        mine = next(m for m in c.models.local_models if not m.bundled)
        w.library.select(f"local:{mine.path}")
        w.library.use_button.click()
        await asyncio.sleep(0.5)
        await until(self.ready)
        w.show_page("Chat")
        w.chat.new_button.click()
        w.chat.input.setPlainText("Write a Python function that adds two numbers.")
        w.chat.send_button.click()
        await asyncio.sleep(0.3)
        await until(self.replied)
        await self.shot("hub-model-chat", 1.0)

        w.show_page("My models")
        page = w.models_page
        await self.shot("my-models")
        page.table.selectRow(next(i for i, r in enumerate(page._rows) if not r.bundled))
        page.verify_button.click()
        await until(lambda: any("intact" in t or "fail" in t for t in w.notice_area.texts()))
        await self.shot("re-verified")
        opened: list[str] = []

        def open_url(url: QUrl) -> bool:
            opened.append(url.toLocalFile())
            return True

        QDesktopServices.openUrl = open_url  # type: ignore[method-assign, assignment]  # no file manager here
        page.folder_button.click()
        print(f"open folder -> {opened}")
        await c.engine.use_model(
            f"local:{next(m.path for m in c.models.local_models if m.bundled)}"
        )  # free the model to delete it
        await until(self.ready)
        page.table.selectRow(next(i for i, r in enumerate(page._rows) if not r.bundled))
        page.delete_button.click()
        await asyncio.sleep(0.5)
        box = next(b for b in QApplication.topLevelWidgets() if isinstance(b, QMessageBox) and b.isVisible())
        box.grab().save(str(self.out / "delete-question.png"), "PNG")
        next(b for b in box.buttons() if b.text() == "Delete").click()
        await until(lambda: len(page._rows) == 1)
        await self.shot("deleted")

        w.show_page("Server")
        w.server_page.enabled.click()
        await until(lambda: self.ready() and c.engine.supervisor is not None and c.engine.supervisor.fixed_port)
        await self.shot("server-on")
        w.server_page.enabled.click()
        await until(lambda: self.ready() and c.engine.supervisor is not None and not c.engine.supervisor.fixed_port)
        w.show_page("Settings")
        w.settings_page.theme.setCurrentIndex(w.settings_page.theme.findData("dark"))
        await self.shot("settings-dark")
        w.show_page("Chat")
        w.perf_dock.setFloating(True)
        await self.shot("performance-floating")
        w.perf_dock.grab().save(str(self.out / "performance-panel.png"), "PNG")
        await c.shutdown()


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    width, height = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (1280, 800)
    app = QApplication.instance() or QApplication([])
    assert isinstance(app, QApplication)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    with tempfile.TemporaryDirectory() as tmp, HubServer() as hub:
        for quant in ("Q8_0", "Q4_K_M"):
            path = Path(tmp) / f"tiny-moe-{quant}.gguf"
            write_test_model(str(path), preset_shape("tiny", None), quant, 0, 1)
            hub.add_file(REPO, path.name, path.read_bytes(), tags=["gguf"])
        hub.add_file(REPO, "README.md", README.encode())
        window = MainWindow()
        window.resize(width, height)
        controller = AppController(window, AppPaths(Path(tmp) / "home"), hub_endpoint=hub.url)
        window.show()
        with loop:
            loop.run_until_complete(Walk(window, controller, out).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
