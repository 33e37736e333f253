"""Issue 50 through the window with the real engine: a finished reply is a measurement its model's card then shows
("measured: 1 chat"); the chat footer's figures go with a model that is deleted (they stayed); the Autotune dialog's
bar and its "measuring…" end as the measurement's last engine process exits (the bar sat there ~20 s after it, and
the line said "measuring decode speed" for as long as the dialog stayed open)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
from PySide6.QtWidgets import QApplication

from runmyai.library.keys import LocalKey
from runmyai.speeds import read_speeds
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller
from tests.qtloop import run_qt


def test_a_reply_is_measured_and_a_deleted_models_figures_go(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path
) -> None:
    server, data = tiny_hub
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    first, second = models / "first.tw.gguf", models / "second.tw.gguf"
    first.write_bytes(data)
    second.write_bytes(data)
    window, c = make_controller(tmp_path, server, data)
    chat = window.chat

    async def scenario() -> tuple[str, str, str, str, float | None, str]:
        await c.start()
        assert await c.engine.use_model(str(LocalKey(first))) is not None
        cid = c.talks.conversation_id or 0
        c.store.set_settings(cid, c.store.get(cid).settings.__class__(temperature=0.0, max_tokens=200))  # type: ignore[union-attr]
        assert await c.chat.chat_once("Write a long story")
        assert c.chat.speed_task is not None
        await c.chat.speed_task  # the reply's speed saved and the cards worked out again
        reply = c.store.messages(cid)[-1]
        card = next(e for e in c.models.entries() if e.key == str(LocalKey(first)))
        row = next(r for r in window.models_page._rows if r.path == first)
        shown = (chat.speed_label.text(), chat.context_label.text())
        assert await c.engine.use_model(str(LocalKey(second))) is not None
        assert await c.models.delete_model(first)
        after = (chat.speed_label.text(), chat.context_label.text())
        await c.shutdown()
        return card.line, row.estimate, shown[1], after[0] + "|" + after[1], reply.tokens_per_s, card.details_html

    try:
        line, row, context_before, after, tps, details = run_qt(qapp, scenario)
    finally:
        window.close()
    assert line.endswith("· measured: 1 chat") and row == line, line  # the card and My models say it
    assert "Measured on this machine" in details and "not a measurement" not in details.split("</li>")[0]
    [m] = read_speeds(c.paths.settings)
    assert m.source == "chat" and m.model == str(first) and tps is not None and m.tokens_per_s == tps
    assert context_before.startswith("Context ") and "/" in context_before
    assert after == "|Context: —"  # the deleted model's speed and context figures are gone


def test_the_autotune_dialog_ends_when_its_last_process_exits(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path
) -> None:
    server, data = tiny_hub
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    model = models / "m.tw.gguf"
    model.write_bytes(data)
    window, c = make_controller(tmp_path, server, data)
    c.ctx.autotune.probe_bytes = "4M"
    seen: list[tuple[bool, str, int]] = []  # at the measurement's end: bar shown, its line, engine processes alive
    # (this test's processes only: another test's engine can outlive it, a child of this same process)
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    async def scenario() -> None:
        await c.start()
        c.tune.open_autotune(str(LocalKey(model)))
        dialog = c.tune.autotune_dialog
        assert dialog is not None
        estimate_again = c.tune.estimate_again

        async def spy() -> None:  # the point where the estimates are worked out again: the measurement is over
            kids = [
                p
                for p in psutil.Process().children(recursive=True)
                if p.pid not in before and "tokenwing" in " ".join(p.cmdline())
            ]
            seen.append((dialog.progress.isVisibleTo(dialog), dialog.progress_label.text(), len(kids)))
            await estimate_again()

        c.tune.estimate_again = spy  # type: ignore[method-assign]
        dialog.run_button.click()
        assert c.tune.autotune_runs
        await asyncio.wait_for(c.tune.autotune_runs[-1], 300)
        seen.append((dialog.progress.isVisibleTo(dialog), dialog.progress_label.text(), -1))
        dialog.close()
        await c.shutdown()

    try:
        run_qt(qapp, scenario)
    finally:
        window.close()
    [(bar, words, alive), (bar_after, words_after, _)] = seen
    assert alive == 0  # (no engine process left: the measurement is over)
    assert not bar and "measuring" not in words.lower() and words.startswith("Measured"), words
    assert not bar_after and words_after == words
