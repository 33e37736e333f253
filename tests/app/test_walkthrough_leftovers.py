"""What the new user's walk-through (docs/app-walkthrough.md) left: a downloaded model named after its file, a
download's progress in three places, README tables in the model card, and an estimate resting on defaults with no
offer to measure the machine. Each test fails on the code before its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QTextCursor, QTextDocument, QTextTable
from PySide6.QtWidgets import QApplication

from runmyai.library.local import model_name
from runmyai.ui.main_window import MainWindow
from runmyai.ui.render import LibraryEntry
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller
from tests.conftest import ModelFactory
from tests.qtloop import run_qt

HUB_REPO = "acme/Tiny-MoE-3B-A1B-GGUF"


# ------------------------------------------------------------------------------------------ names
def test_a_model_is_named_by_its_repository_or_its_header_not_its_file(tmp_path: Path) -> None:
    models = tmp_path / "models"
    downloaded = models / "acme" / "Tiny-MoE-3B-A1B-GGUF" / "tiny-moe-Q8_0.tw.gguf"
    assert model_name(downloaded, models, "tiny-moe") == "Tiny-MoE-3B-A1B (Q8_0)"
    # a quant the repository's name already says is not said twice; an unknown quant leaves the repo's name
    assert model_name(models / "o" / "Big-Q4_K_M-GGUF" / "big-Q4_K_M.tw.gguf", models) == "Big-Q4_K_M"
    assert model_name(models / "o" / "Plain" / "weights.tw.gguf", models) == "Plain"
    # imported (or copied) into the folder itself: the header's name and the file's quant, else the file
    assert model_name(models / "My-Model-Q4_K_M.tw.gguf", models, "Qwen3 30B A3B") == "Qwen3 30B A3B (Q4_K_M)"
    assert model_name(models / "My-Model-Q4_K_M.tw.gguf", models, None) == "My-Model-Q4_K_M"
    assert model_name(Path("/elsewhere/x/y/m-Q8_0.tw.gguf"), models, "M") == "M (Q8_0)"  # another folder


def test_the_picker_and_my_models_name_a_download_by_its_repository_and_keep_the_repo(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], repacked_factory: ModelFactory, tmp_path: Path
) -> None:
    server, data = tiny_hub
    window, c = make_controller(tmp_path, server, data)
    mine = c.paths.models / "acme" / "Tiny-MoE-3B-A1B-GGUF" / "tiny-moe-Q8_0.tw.gguf"
    mine.parent.mkdir(parents=True)
    shutil.copy(repacked_factory(type="Q8_0", seed=5), mine)  # not the preset's file (its checksum would name it)

    async def flows() -> tuple[list[str], list[tuple[str, ...]], list[str]]:
        await c.start()
        picker = window.chat.model_picker
        names = [picker.itemText(i) for i in range(picker.count())]
        table = window.models_page.table
        rows = [tuple(str(table.model().index(r, col).data()) for col in (0, 1)) for r in range(table.rowCount())]
        cards = [e.title for e in c._entries()]
        await c.shutdown()
        return names, rows, cards

    try:
        names, rows, cards = run_qt(qapp, flows)
    finally:
        window.close()
    assert "Tiny-MoE-3B-A1B (Q8_0)" in names, names
    assert ("Tiny-MoE-3B-A1B (Q8_0)", HUB_REPO) in rows, rows  # the repository kept in its own column
    assert "Tiny-MoE-3B-A1B (Q8_0)" in cards and not any("tiny-moe" in t for t in [*names, *cards])


# ------------------------------------------------------------------------------------------ the model card
README_TABLES = """# Tiny MoE

| Quant | Size | Use |
|---|---:|:---:|
| Q4_K_M | 17.3 GB | most |
| Q8_0 | 32.1 GB | best |

| Benchmark | Qwen3-30B-A3B | Qwen3-32B | Llama-3.3-70B-Instruct | GPT-4o-2024 | DeepSeek-V3-0324 | Gemini-2.0-Flash |
|---|---|---|---|---|---|---|
| MMLU-Redux | 84.1 | 85.7 | 86.3 | 88.0 | 89.9 | 86.9 |
| see https://huggingface.co/acme/Tiny-MoE-3B-A1B-GGUF/resolve/main/tiny-moe-Q8_0.gguf | 1 | 2 | 3 | 4 | 5 | 6 |
"""


def _tables(doc: QTextDocument) -> list[QTextTable]:
    found: list[QTextTable] = []
    block = doc.begin()
    while block.isValid():
        table = QTextCursor(block).currentTable()
        if table is not None and table not in found:
            found.append(table)
        block = block.next()
    return found


def test_the_model_cards_tables_render_aligned_and_a_wide_one_fits_the_card(qapp: QApplication) -> None:
    window = MainWindow()
    window.show()
    lib = window.library
    entry = LibraryEntry(f"hub:{HUB_REPO}", HUB_REPO, "on the hub", "<p>overview</p>", card_repo=HUB_REPO)
    try:
        for width, height in ((1280, 800), (1600, 1000)):
            window.resize(width, height)
            window.show_page("Discover")
            lib.set_entries([entry], entry.key)
            lib.tabs.setCurrentIndex(1)
            lib.set_model_card(entry.key, README_TABLES)
            for _ in range(5):
                QApplication.processEvents()
            card = lib.model_card
            small, wide = _tables(card.document())
            assert (small.rows(), small.columns(), wide.columns()) == (3, 3, 7)  # GFM tables, not text
            for col, want in ((1, Qt.AlignmentFlag.AlignRight), (2, Qt.AlignmentFlag.AlignHCenter)):
                header = small.cellAt(0, col).firstCursorPosition().blockFormat().alignment()
                body = small.cellAt(1, col).firstCursorPosition().blockFormat().alignment()
                assert body & want and header & want, (col, header, body)  # the header over its column
            assert small.cellAt(0, 0).format().background().style() != Qt.BrushStyle.NoBrush  # a header row
            # the wide table wraps to the card: no sideways scrolling, nothing cut, the window as wide as it was
            assert card.horizontalScrollBar().maximum() == 0, (width, card.document().size().width())
            assert card.document().size().width() <= card.viewport().width()
            assert window.width() == width
    finally:
        window.close()
