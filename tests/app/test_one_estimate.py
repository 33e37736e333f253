"""One estimate (issue 29, defect 3): the window, `runmyai list` and a hub repository's quant table work it out
the same way, for the flags the app starts the engine with; every installed model has one, preset or not; it is
worked out again after autotune; its reasoning is written from its numbers; and no quant that cannot run here, or
does not fit, is recommended."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication

from runmyai import cli
from runmyai.engine.autotune import AutotuneRunner
from runmyai.engine.info import EngineInfo, ask_engine
from runmyai.library.acquire import QuantChoice, RepoQuants
from runmyai.library.estimate import HIT_EXPONENT, MEASURED_HITS, estimate, hit_rate, hit_rate_reason
from runmyai.library.hub import HubFile
from runmyai.library.launch import launch_flags
from runmyai.library.local import LocalLibrary
from runmyai.library.quants import Quant
from runmyai.machine import MachineInfo
from runmyai.paths import bundled_dir
from runmyai.ui import render
from tests.app.engine_facts import sized_catalog
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller
from tests.conftest import ModelFactory
from tests.qtloop import run_qt

GIB = 1 << 30
MACHINE = MachineInfo(
    ram_total=32 * GIB,
    ram_available=16 * GIB,
    ram_limit=None,
    cores=8,
    cpu_model="test",
    isa=("avx2",),
    gpus=(),
    disk_free=100 * GIB,
    drive_read_bps=1.2e9,
    mem_bandwidth_bps=13e9,
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EngineInfo:
    info = asyncio.run(ask_engine(tmp_path_factory.mktemp("settings")))
    assert info.known, info.error
    return info


def _window_tokens_per_s(details_html: str) -> float:
    found = re.search(r"about ([0-9.]+) tokens/s \(", details_html)
    assert found is not None, details_html
    return float(found.group(1))


def test_window_and_list_agree_on_the_built_in_model(tmp_path: Path, engine: EngineInfo) -> None:
    """The window said 334.9 tokens/s for the built-in model and `runmyai list` 3,168.9: the list left out the
    preset's 25 % budget (and the window used the preset's facts, the list the file's)."""
    catalog = sized_catalog()
    library = LocalLibrary(tmp_path / "models", bundled_dir("resources"), presets=catalog.presets)
    demo = asyncio.run(library.ensure_bundled_demo())
    assert demo is not None and demo.preset_id == "tokenwing-demo-moe" and demo.facts is not None
    preset = catalog.get("tokenwing-demo-moe")
    autotune = AutotuneRunner(tmp_path / "settings")
    view = render.View(MACHINE, engine, lambda m, p: launch_flags(m.path, m, p, autotune, engine))
    window = _window_tokens_per_s(render.local_entry(demo, preset, view).details_html)
    listed = cli._model_json(demo, catalog, MACHINE, engine, autotune)["estimate"]
    assert listed is not None and listed["tokens_per_s"] == pytest.approx(window, abs=0.051)  # (0.1 shown, 0.01 listed)
    # the preset's quarter of the experts in RAM: the estimate streams, as the engine will
    flags = launch_flags(demo.path, demo, preset, autotune, engine)
    assert flags[:2] == ["--ram-budget", "25%"] and "--ctx" in flags
    assert "Expected cache hit rate" in render.local_entry(demo, preset, view).details_html


def test_a_model_without_a_preset_has_an_estimate(
    repacked_factory: ModelFactory, tmp_path: Path, engine: EngineInfo
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "imported.tw.gguf").write_bytes(repacked_factory(type="Q8_0").read_bytes())
    library = LocalLibrary(models, presets=())
    [m] = asyncio.run(library.scan())
    assert m.preset_id is None and m.error is None
    html = render.local_entry(m, None, render.View(MACHINE, engine)).details_html
    assert "Will it run here?" in html and _window_tokens_per_s(html) > 0
    catalog = sized_catalog()
    listed = cli._model_json(m, catalog, MACHINE, engine, AutotuneRunner(tmp_path / "settings"))["estimate"]
    assert listed is not None and listed["tokens_per_s"] > 0


def test_the_hit_rate_line_is_written_from_its_numbers() -> None:
    """It said "grows as the square root" while the code raised the share to the power 0.3, and "below what the
    engine measured" where its number was above."""
    for share in (0.05, 0.15, 0.25, 0.31, 0.4, 0.6, 0.9):
        line = hit_rate_reason(share)
        assert "square root" not in line
        assert f"{hit_rate(share):.0%}" in line and f"({share:.0%}) to the power {HIT_EXPONENT:g}" in line
        what, m_share, m_hits = min(MEASURED_HITS, key=lambda m: abs(m[1] - share))
        rule = hit_rate(m_share)
        assert f"Measured on {what}: {m_hits:.0%} of requests served with {m_share:.0%}" in line
        if abs(rule - m_hits) >= 0.005:
            assert f"the rule gives {rule:.0%}, {'more' if rule > m_hits else 'less'} than measured" in line
    # and it is the line an estimate gives
    catalog = sized_catalog()
    q235 = catalog.get("qwen3-235b-a22b")
    assert q235 is not None
    e = estimate(q235, MACHINE, EngineInfo("x", {"qwen3moe": ("Q4_K",)}, 512 << 20, ()))
    assert hit_rate_reason(e.cache_share) in e.reasons


def _choice(name: str, est_of: object) -> QuantChoice:
    q = Quant(name, (HubFile("a/b", f"m-{name}.gguf", "main", 1000, None),))
    return QuantChoice(q, est_of, 8.0, 2000, True)  # type: ignore[arg-type]


def test_no_quant_is_recommended_that_cannot_run_here_or_does_not_fit(engine: EngineInfo) -> None:
    catalog = sized_catalog()
    p = catalog.get("qwen3-30b-a3b")
    assert p is not None
    runs = estimate(p, MACHINE, engine)
    unsupported = estimate(p, MACHINE, dataclasses.replace(engine, architectures={}))
    no_disk = estimate(p, dataclasses.replace(MACHINE, disk_free=0), engine)
    assert (runs.verdict, unsupported.verdict, no_disk.verdict) == ("runs_well", "unsupported", "no_disk_space")
    fine = RepoQuants("a/b", "main", (_choice("Q4_K_M", runs), _choice("Q8_0", no_disk)), (), "Q4_K_M")
    assert fine.best() is not None and fine.best().quant.name == "Q4_K_M"  # type: ignore[union-attr]
    for choices in ((unsupported,), (no_disk,), (None,), (unsupported, no_disk)):
        quants = RepoQuants("a/b", "main", tuple(_choice(f"Q{i}", e) for i, e in enumerate(choices)), (), None)
        assert quants.best() is None, choices
        labels = [render.quant_label(c, c is quants.best()) for c in quants.choices]
        assert not any("recommended" in label for label in labels)
        entry_html = render.quant_table_html(quants, quants.best())
        assert "★" not in entry_html
    why = RepoQuants("a/b", "main", (_choice("Q4", unsupported),), (), None).why_none()
    assert why.startswith("a/b cannot run here: Not yet: the installed engine runs")


def test_the_window_works_it_out_again_after_autotune(
    qapp: QApplication, tiny_hub: tuple[HubServer, bytes], tmp_path: Path
) -> None:
    server, data = tiny_hub
    window, c = make_controller(tmp_path, server, data)
    model = tmp_path / "m.tw.gguf"
    model.write_bytes(b"")

    async def fake_run(path: Path, progress: object = None, **_: object) -> None:
        # what autotune saves: here, a decode measured far slower than this machine class's default
        result = {"runmyai": {"decode": {"compute_s": 1.0, "layers": 2, "active_bytes": 1000, "streamed": False,
                                         "model": "slow.tw.gguf"}}}  # fmt: skip
        (c.paths.settings / "autotune-slow.json").write_text(json.dumps(result))

    async def flows() -> tuple[str, str]:
        await c.start()
        before = window.library._entries["preset:tiny"].details_html  # what the window shows
        c.ctx.autotune.run = fake_run  # type: ignore[method-assign,assignment]
        await c.tune.run_autotune(model)
        after = window.library._entries["preset:tiny"].details_html
        await c.shutdown()
        return before, after

    try:
        before, after = run_qt(qapp, flows)
    finally:
        window.close()
    assert "calibrated on autotune here" not in before
    assert "calibrated on autotune here" in after
    assert _window_tokens_per_s(after) < _window_tokens_per_s(before)
