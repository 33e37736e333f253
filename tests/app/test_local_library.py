"""Installed models through the real engine CLI: import with progress, cancel, errors, scan, the bundled demo."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runmyai.engine.info import ask_engine
from runmyai.library import local
from runmyai.library.local import ImportCancelled, LibraryError, LocalLibrary, LocalModel, repacked_name
from tests.app.engine_facts import sized_catalog
from tests.conftest import ModelFactory
from tests.pauses import REPACK_STEPS, Pauses

CATALOG = sized_catalog()


def _visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_repacked_name() -> None:
    assert repacked_name(Path("/x/Model-Q4_K_M.gguf")) == "Model-Q4_K_M.tw.gguf"
    assert repacked_name(Path("Big-Q4_K_M-00001-of-00003.gguf")) == "Big-Q4_K_M.tw.gguf"


def test_progress_json_flag(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The engine's `repack --progress-json`: one JSON object per line on stderr, each pass ending at its total."""
    src, out = model_factory(), tmp_path / "m.tw.gguf"
    r = subprocess.run(
        [sys.executable, "-m", "tokenwing", "repack", str(src), "-o", str(out), "--progress-json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("wrote ")
    records = [json.loads(line) for line in r.stderr.splitlines()]  # every line is JSON
    for stage in ("repacking", "verifying"):
        mine = [x for x in records if x["progress"] == stage]
        assert mine[0]["done"] == 0 and mine[-1]["done"] == mine[-1]["total"] > 0
        assert [x["done"] for x in mine] == sorted(x["done"] for x in mine)
    assert [x["progress"] for x in records].index("verifying") > 0


def test_import_lists_and_matches(model_factory: ModelFactory, tmp_path: Path) -> None:
    src = tmp_path / "src" / "My-Model-Q8_0.gguf"
    src.parent.mkdir()
    shutil.copy(model_factory(type="Q8_0"), src)
    models = tmp_path / "models"
    preset = dataclasses.replace(CATALOG.presets[1], file="My-Model-Q8_0.tw.gguf")
    lib = LocalLibrary(models, presets=[preset])
    events: list[tuple[float, str]] = []

    async def go() -> tuple[LocalModel, list[LocalModel]]:
        model = await lib.import_gguf([src], lambda f, m: events.append((f, m)))
        return model, list(await lib.scan())

    model, listed = asyncio.run(go())
    assert events[0] == (0.0, "Starting the engine") and events[-1] == (1.0, "Done")
    fractions = [f for f, _ in events]
    assert fractions == sorted(fractions)
    assert any(m.startswith("Converting:") for _, m in events)
    assert any(m.startswith("Checking the new file:") for _, m in events)
    dest = models / "My-Model-Q8_0.tw.gguf"
    assert listed == [model]
    assert model.path == dest and model.arch == "qwen3moe" and model.size_bytes == dest.stat().st_size
    assert model.preset_id == preset.id and model.name == preset.name and not model.bundled
    assert _visible(models) == [".library.json", "My-Model-Q8_0.tw.gguf"]
    with pytest.raises(LibraryError, match="already in your library"):
        asyncio.run(lib.import_gguf([src]))


def test_scan_uses_its_cache_and_shows_broken_files(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    good = models / "good.tw.gguf"
    shutil.copy(repacked_factory(), good)
    (models / "broken.tw.gguf").write_bytes(b"GGUF" + b"\0" * 100)
    sha = hashlib.sha256(good.read_bytes()).hexdigest()
    by_hash = dataclasses.replace(CATALOG.presets[1], sha256=sha, size_bytes=good.stat().st_size)
    no_engine = [str(tmp_path / "no-engine")]
    unstarted = asyncio.run(LocalLibrary(models, engine=no_engine).scan())
    assert [m.error for m in unstarted] == ["The engine could not be started: No such file or directory."] * 2
    listed = asyncio.run(LocalLibrary(models, presets=[by_hash]).scan())  # not cached: asks the engine
    assert [m.path.name for m in listed] == ["broken.tw.gguf", "good.tw.gguf"]
    broken, ok = listed
    assert broken.arch is None and broken.error and "\n" not in broken.error and "exit code" in broken.error
    assert ok.arch == "qwen3moe" and ok.error is None and ok.preset_id == by_hash.id  # matched by sha256
    # A second scan answers from the cache: an engine that can't even start is never called.
    again = asyncio.run(LocalLibrary(models, presets=[by_hash], engine=no_engine).scan())
    assert again == listed


@pytest.fixture
def sigint_ignored() -> Iterator[None]:
    """As a shell starts a background job (`runmyai &` in a script): SIGINT ignored, and so in the engine too."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _cancel_at(step: str, how: str, src: Path, folder: Path, pauses: Pauses) -> None:
    """Starts an import, cancels it (the task, or the `cancel` event) once the engine waits at `step`."""
    lib = LocalLibrary(folder)

    async def go() -> None:
        cancel = asyncio.Event()
        task = asyncio.ensure_future(lib.import_gguf([src], cancel=cancel))
        await pauses.wait_async(step, alive=lambda: not task.done())
        if step == "output.renamed":
            assert _visible(folder) == [src.name.replace(".gguf", ".tw.gguf")]  # the output was in place
        if how == "task":
            task.cancel()
        else:
            cancel.set()
        if step == "cli.decided":  # a stop signal no longer counts: let the engine finish
            pauses.release(step)
        if how == "task":
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(ImportCancelled, match="cancelled; nothing was kept"):
                await task

    asyncio.run(asyncio.wait_for(go(), 120))


@pytest.mark.parametrize("how", ["task", "event"])
@pytest.mark.parametrize("step", REPACK_STEPS)
def test_cancel_at_every_step_leaves_nothing(
    model_factory: ModelFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sigint_ignored: None,
    step: str,
    how: str,
) -> None:
    """The engine stops at once on the app's stop signal, even when the app was started with SIGINT ignored:
    with the kill after the grace period out of reach, a cancel that the engine ignored would hang here."""
    monkeypatch.setattr(local, "_STOP_GRACE_S", 3600.0)
    pauses = Pauses(tmp_path / "pauses", step)
    pauses.arm(monkeypatch)
    models = tmp_path / "models"
    _cancel_at(step, how, model_factory(type="Q4_0"), models, pauses)
    assert _visible(models) == []


def test_a_cancel_after_the_engine_finished_keeps_nothing(
    model_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's outcome was decided (the file complete and in place) when the cancel came: the app removes it."""
    pauses = Pauses(tmp_path / "pauses", "cli.decided")
    pauses.arm(monkeypatch)
    models = tmp_path / "models"
    _cancel_at("cli.decided", "task", model_factory(type="Q4_0"), models, pauses)
    assert _visible(models) == []


def test_corrupt_gguf_is_one_plain_line_and_permanent(model_factory: ModelFactory, tmp_path: Path) -> None:
    """Issue 50: the engine's own words ("not a GGUF file (magic b'not ')", the exit code) are the details; the
    sentence says what is wrong with the file, and a corrupt file is permanent (no Retry)."""
    lib = LocalLibrary(tmp_path / "models")
    lib.exit_kind = asyncio.run(ask_engine(tmp_path / "settings")).exit_kind  # the engine's names of its codes
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"not a model at all")
    with pytest.raises(LibraryError) as info:
        asyncio.run(lib.import_gguf([garbage]))
    msg = str(info.value)
    assert msg == "The file broken.gguf is damaged or not a GGUF model, so it cannot be imported.", msg
    assert info.value.permanent and info.value.exit_code == 2
    detail = info.value.detail or ""
    assert "not a GGUF file" in detail and "exit code 2" in detail
    truncated = tmp_path / "cut.gguf"
    data = model_factory().read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(LibraryError) as info:
        asyncio.run(lib.import_gguf([truncated]))
    assert str(info.value).startswith("The file cut.gguf is damaged") and info.value.exit_code not in (None, 0)
    assert info.value.permanent and "\n" not in str(info.value)
    assert _visible(tmp_path / "models") == []


def test_bundled_demo_once(model_factory: ModelFactory, tmp_path: Path) -> None:
    resources = tmp_path / "resources"
    (resources / "demo-model").mkdir(parents=True)
    shipped = resources / "demo-model" / "tokenwing-demo-moe.gguf"
    shutil.copy(model_factory(), shipped)
    models = tmp_path / "models"
    lib = LocalLibrary(models, resources, presets=CATALOG.presets)
    calls: list[float] = []

    first = asyncio.run(lib.ensure_bundled_demo(lambda f, m: calls.append(f)))
    assert first is not None and first.bundled and first.preset_id == "tokenwing-demo-moe"
    assert first.path == models / "tokenwing-demo-moe.tw.gguf" and calls[-1] == 1.0
    mtime = first.path.stat().st_mtime_ns
    calls.clear()
    second = asyncio.run(lib.ensure_bundled_demo(lambda f, m: calls.append(f)))
    assert second == first and calls == [] and first.path.stat().st_mtime_ns == mtime  # already there: skipped
    # The app ships a new demo: repacked again.
    shutil.copy(model_factory(seed=1), shipped)
    third = asyncio.run(lib.ensure_bundled_demo(lambda f, m: calls.append(f)))
    assert third is not None and calls and calls[-1] == 1.0
    assert [m.name for m in asyncio.run(lib.scan())] == ["TokenWing demo (22 M)"]
    assert asyncio.run(LocalLibrary(models, tmp_path / "nothing").ensure_bundled_demo()) is None
