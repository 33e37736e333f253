"""Discover's search (found in the walk-through, docs/app-walkthrough.md): the hub's results first, the models here
filtered by the same words, and a line that says what was found, nothing found included: the rules Qt-free,
then through the window."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from runmyai.library.acquire import QuantChoice, RepoQuants, progress_text
from runmyai.library.hub import HubFile, HubModel
from runmyai.library.quants import Quant
from runmyai.ui.render import (
    LibraryEntry,
    discover_entries,
    hub_entry,
    installed_quants,
    matches,
    search_line,
)
from runmyai.ui.viewmodels import (
    EXPLAIN_IN_MEMORY,
    EXPLAIN_STREAMING,
    ModelRow,
    chosen_row,
    performance_explanation,
)
from tests.app.conftest import REPO
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller, until
from tests.qtloop import run_qt


def entry(key: str, title: str) -> LibraryEntry:
    return LibraryEntry(key, title, "", "")


HERE = [
    entry("local:/m/tokenwing-demo-moe.tw.gguf", "TokenWing demo (22 M)"),
    entry("preset:qwen3-30b-a3b", "Qwen3 30B-A3B"),
    entry("preset:gpt-oss-20b", "gpt-oss 20B"),
]
HUB = [entry("hub:acme/Tiny-MoE-3B-A1B-GGUF", "acme/Tiny-MoE-3B-A1B-GGUF")]


def test_a_search_lists_the_hub_first_then_what_matches_here() -> None:
    assert discover_entries(HERE, HUB, "qwen") == [*HUB, HERE[1]]  # the hub's results were below all 17 cards
    assert discover_entries(HERE, HUB, "tiny moe") == HUB
    assert discover_entries(HERE, [], "30b") == [HERE[1]]
    assert discover_entries(HERE, HUB, "  ") == HERE  # no search: everything here and curated, no hub results


def test_matching_is_by_word_starts_over_title_and_key() -> None:
    assert matches(HUB[0], "tiny moe") and matches(HUB[0], "Tiny-MoE") and matches(HUB[0], "acme")
    assert matches(HERE[0], "demo") and not matches(HERE[0], "emo")
    assert not matches(HERE[2], "qwen")


def test_the_search_line_says_what_was_found_and_when_nothing_was() -> None:
    assert search_line("", 3, 1) == ""
    assert search_line("tiny", None, 0) == "Searching the hub for “tiny”…"
    assert search_line("tiny", 1, 0) == "“tiny”: 1 on the hub, 0 here or curated. Clear the search to see all."
    assert search_line("qwen", 0, 2).startswith("“qwen”: none on the hub, 2 here")
    assert search_line("zzz", 0, 0).startswith("Nothing matches “zzz”")


def test_a_search_filters_discover_but_not_the_picker_nor_my_models(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path
) -> None:
    """Through the window: the results first with their line, a line for no result, the search cleared by its
    box; the model picker and My models keep every installed model and its estimate while a search is on."""
    server, data = tiny_hub
    model = tmp_path / "home" / "models" / "owner" / "local-TW" / "local.tw.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(data)
    window, c = make_controller(tmp_path, server, data)
    lib = window.library

    def keys() -> list[str]:
        return [str(lib.models.item(i).data(Qt.ItemDataRole.UserRole)) for i in range(lib.models.count())]

    async def flow() -> None:
        await c.start()
        everything = keys()
        assert f"local:{model}" in everything and lib.search_status.isHidden()
        lib.search.setText("runmyai")
        lib.search.returnPressed.emit()
        await until(lambda: lib.search_status.text().startswith("“runmyai”"), 30, "search")
        assert keys()[0] == f"hub:{REPO}" and f"local:{model}" not in keys()
        assert lib.current_key() == f"hub:{REPO}"  # the first result is shown
        assert lib.search_status.text().startswith("“runmyai”: 1 on the hub")
        await c.models.refresh_library()  # as after a download, while the search is on
        assert window.chat.model_picker.findData(f"local:{model}") >= 0
        rows = window.models_page._rows
        assert [r.path for r in rows] == [model] and rows[0].estimate != "—"
        # a model is selected on My models, so its buttons work (all were greyed out with none selected)
        page = window.models_page
        assert page.current() is not None and page.folder_button.isEnabled() and page.verify_button.isEnabled()
        lib.search.setText("zzzz")
        lib.search.returnPressed.emit()
        await until(lambda: lib.search_status.text().startswith("Nothing matches"), 30, "no result")
        assert keys() == []
        lib.search.clear()  # its x button: every model again
        await until(lambda: keys() == everything, 30, "cleared")
        assert lib.search_status.isHidden()
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        c.stop_following_desktop()
        window.close()


def test_a_gets_progress_says_what_it_is_doing() -> None:
    """The walk-through read 'Getting OWNER/NAME (Q8_0): Q8_0: 0 of 1 shards repacked; downloading none' at 50 %,
    while it repacked."""
    assert progress_text(0, 1, [], True) == "Preparing it for the engine"
    assert progress_text(0, 1, ["a.gguf"], False) == "Downloading"
    assert progress_text(1, 3, ["b.gguf", "c.gguf"], False) == "1 of 3 parts ready; downloading b.gguf, c.gguf"
    assert progress_text(2, 3, [], True) == "2 of 3 parts ready; preparing it for the engine"


def test_my_models_selects_the_kept_row_else_the_one_in_use_else_the_first() -> None:
    def row(name: str, in_use: bool = False) -> ModelRow:
        return ModelRow(f"local:/m/{name}", name, "", "1 MB", "qwen3moe", "", "", Path(f"/m/{name}"), False, in_use)

    rows = [row("a"), row("b", in_use=True), row("c")]
    assert chosen_row(rows, Path("/m/c")) == 2
    assert chosen_row(rows, None) == 1 and chosen_row(rows, Path("/m/gone")) == 1
    assert chosen_row(rows[:1], None) == 0 and chosen_row([], None) is None


def test_a_hub_card_says_which_of_its_quants_are_installed(tmp_path: Path) -> None:
    """The walk-through's card said 'on the hub' and offered the same download again beside the model it had just
    installed; the installed quant is where the acquirer puts it (`<models>/<owner>/<repo>/<name>.tw.gguf`)."""
    files = {q: HubFile("acme/Tiny-GGUF", f"tiny-{q}.gguf", "main", 1000, None) for q in ("Q4_K_M", "Q8_0")}
    quants = RepoQuants(
        "acme/Tiny-GGUF",
        "main",
        tuple(QuantChoice(Quant(q, (f,)), None, 8.0, 2000, True) for q, f in files.items()),
        (),
        None,
    )
    models = tmp_path / "models"
    have = {models / "acme" / "Tiny-GGUF" / "tiny-Q8_0.tw.gguf", models / "other" / "tiny-Q4_K_M.tw.gguf"}
    assert installed_quants(quants, models, have) == {"Q8_0"}
    assert installed_quants(None, models, have) == frozenset()
    hub = HubModel("acme/Tiny-GGUF", 0, 0, ("gguf",), tuple(files.values()))
    entry = hub_entry(hub, quants, frozenset({"Q8_0"}))
    assert entry.badge == "installed: Q8_0"
    labels = dict(entry.choices)
    assert labels["hub:acme/Tiny-GGUF:Q8_0"].endswith(" — installed")
    assert not labels["hub:acme/Tiny-GGUF:Q4_K_M"].endswith("installed")
    assert hub_entry(hub, quants).badge == "on the hub"


def test_the_performance_panel_says_when_the_model_fits_in_memory() -> None:
    """The walk-through saw 'Only part of the model's experts fit in memory' over a model that fit whole."""
    assert performance_explanation([]) == EXPLAIN_STREAMING
    assert performance_explanation([2e6] * 4 + [0.0] * 16) == EXPLAIN_IN_MEMORY  # warmed up: nothing read lately
    assert performance_explanation([0.0] * 15) == EXPLAIN_STREAMING  # too few tokens to say
    assert performance_explanation([0.0] * 30 + [4096.0]) == EXPLAIN_STREAMING
