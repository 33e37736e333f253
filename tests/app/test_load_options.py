"""Context length and GPU offload chosen per model when it loads (the load dialog): what fits here from the real
engine's `tokenwing info MODEL --json`, the choice kept per model, on the engine's command line, and in force in
the engine that runs (its context as the engine reports it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QApplication

from runmyai.engine.autotune import AutotuneRunner
from runmyai.engine.client import ChatClient
from runmyai.engine.load_options import (
    MIN_CONTEXT,
    LoadFacts,
    LoadOptions,
    ask_facts,
    check_options,
    parse_facts,
    save_options,
    saved_options,
)
from runmyai.paths import AppPaths
from runmyai.ui.viewmodels import AppSettings
from tests.app.hubserver import HubServer
from tests.app.test_app_scenario import make_controller
from tests.conftest import ModelFactory
from tests.qtloop import run_qt

GPU_INFO: dict[str, Any] = {  # `tokenwing info --json`'s shape on a machine with an NVIDIA GPU and lavapipe
    "devices": [
        {"kind": "cpu", "name": "CPU", "type": "cpu", "free": 8 << 30, "total": 16 << 30},
        {
            "kind": "cuda",
            "name": "CUDA0",
            "description": "NVIDIA H100",
            "type": "gpu",
            "free": 70 << 30,
            "total": 80 << 30,
            "software": False,
        },
        {
            "kind": "vulkan",
            "name": "Vulkan1",
            "description": "llvmpipe (LLVM 15)",
            "type": "cpu",
            "free": 1 << 30,
            "total": 1 << 30,
            "software": True,
        },
    ],
    "model": {"kv_bytes_per_token": 4096, "parallel_auto": {"slots": 2, "context": 20000}},
}


def test_facts_default_ceiling_and_gpus() -> None:
    facts = parse_facts(GPU_INFO, 16384)
    assert (facts.fits_context, facts.max_context, facts.default_context) == (20000, 16384, 16384)
    assert facts.offload and [g.name for g in facts.gpus] == ["NVIDIA H100"]  # lavapipe is a CPU "device"
    assert facts.gpu_note() == "NVIDIA H100: 75.2 GB free of 85.9 GB."
    assert "20,000 tokens fit in the memory free now; the model's maximum is 16,384" in facts.context_note()
    cpu_only = parse_facts({"devices": GPU_INFO["devices"][:1], "model": GPU_INFO["model"]}, None)
    assert not cpu_only.offload and cpu_only.default_context == 20000
    assert cpu_only.gpu_note() == "No GPU here: the model runs on the CPU (GPU offload is unavailable)."
    with pytest.raises(ValueError):
        parse_facts([1], None)


def test_the_choice_is_made_safe_to_start_with() -> None:
    gpu, cpu = parse_facts(GPU_INFO, 16384), LoadFacts(3000, 8192)
    assert check_options(LoadOptions(context=99999), gpu).context == 16384  # the model's maximum is the ceiling
    assert check_options(LoadOptions(context=10), gpu).context == MIN_CONTEXT
    chosen = LoadOptions(context=4096, device="cuda", vram_budget=" 80% ", vram_layers=12)
    assert check_options(chosen, gpu) == LoadOptions(4096, "cuda", "80%", 12)
    assert check_options(chosen, cpu) == LoadOptions(4096)  # no GPU: no GPU settings on the command line
    for bad in ("lots", "150%", "-2G", "8X"):
        with pytest.raises(ValueError, match="is not a VRAM budget"):
            check_options(LoadOptions(vram_budget=bad), gpu)
    for good in ("8G", "512M", "1.5GiB", "50%", "123456"):
        assert check_options(LoadOptions(vram_budget=good), gpu).vram_budget == good


def test_kept_per_model_beside_its_other_overrides(tmp_path: Path) -> None:
    autotune = AutotuneRunner(AppPaths(tmp_path / "home").ensure())
    a, b = tmp_path / "a.tw.gguf", tmp_path / "b.tw.gguf"
    autotune.set_override(a, "ram_budget", "2G")  # the autotune dialog's: not this dialog's to drop
    save_options(autotune, a, LoadOptions(6144, "cuda", "8G", 10))
    assert saved_options(autotune, a) == LoadOptions(6144, "cuda", "8G", 10)
    assert saved_options(autotune, b) == LoadOptions()  # another model keeps its own (none)
    flags = autotune.serve_flags(a, 32768)
    assert flags[flags.index("--ram-budget") + 1] == "2G" and flags[flags.index("--ctx") + 1] == "6144"
    assert flags[flags.index("--device") + 1] == "cuda" and flags[flags.index("--vram-layers") + 1] == "10"
    save_options(autotune, a, LoadOptions(context=2048))  # GPU settings cleared, the rest kept
    assert saved_options(autotune, a) == LoadOptions(2048) and autotune.overrides(a)["ram_budget"] == "2G"


def test_the_engine_says_what_fits(repacked_factory: ModelFactory) -> None:
    model = repacked_factory(type="Q8_0")
    facts = asyncio.run(ask_facts(model, 4096))
    assert facts.fits_context is not None and facts.fits_context > 0 and facts.kv_bytes_per_token
    assert facts.default_context == min(facts.fits_context, 4096)


def last(flags: list[str], name: str) -> str | None:
    """The value the engine takes for a flag given more than once (argparse: the last)."""
    at = [i for i, f in enumerate(flags) if f == name]
    return flags[at[-1] + 1] if at else None


def test_the_dialog_loads_the_model_with_its_own_context(
    qapp: QApplication, tmp_path: Path, repacked_factory: ModelFactory
) -> None:
    model = tmp_path / "home" / "models" / "local.tw.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(repacked_factory(type="Q8_0").read_bytes())
    key = f"local:{model}"
    with HubServer() as hub:
        _window, c = make_controller(tmp_path, hub, b"")
        c.ctx.settings = AppSettings(**{**c.ctx.settings.__dict__, "context_length": 1024})  # Settings' global length
        seen: dict[str, Any] = {}

        async def n_ctx() -> int:
            client = ChatClient(lambda: c.engine.supervisor.endpoint if c.engine.supervisor else None)
            try:
                return (await client.count([{"role": "user", "content": "Hi"}])).n_ctx
            finally:
                await client.aclose()

        async def scenario() -> None:
            try:
                await c.models.refresh_library()
                assert await c.engine.use_model(key) is not None and c.engine.supervisor is not None
                seen["global"] = (last(c.engine.supervisor.flags, "--ctx"), await n_ctx())
                dialog = c.engine.open_load_options(key)
                assert dialog is not None and c.engine.load_facts_task is not None
                assert not dialog.load_button.isEnabled()  # until the engine said what fits
                await c.engine.load_facts_task
                facts = dialog.facts
                assert facts is not None and facts.fits_context
                seen["default"] = (dialog.context.value(), facts.default_context, dialog.context.maximum())
                seen["gpu"] = (dialog.device.isEnabled(), facts.offload, dialog.gpu_note.text())
                dialog.context.setValue(384)
                dialog.load_button.click()
                assert c.engine.load_task is not None
                assert await c.engine.load_task is not None and c.engine.supervisor is not None
                seen["own"] = (last(c.engine.supervisor.flags, "--ctx"), await n_ctx())
                # and again from the picker (a plain load): the model's own context is still its
                assert await c.engine.use_model(key) is not None and c.engine.supervisor is not None
                seen["again"] = (last(c.engine.supervisor.flags, "--ctx"), await n_ctx())
                reopened = c.engine.open_load_options(key)
                assert reopened is not None and c.engine.load_facts_task is not None
                await c.engine.load_facts_task
                seen["reopened"] = reopened.context.value()
                reopened.reject()
            finally:
                await c.shutdown()

        run_qt(qapp, scenario)
    assert seen["global"] == ("1024", 1024)  # no context of its own: Settings' global one
    value, default, ceiling = seen["default"]
    assert value == default and ceiling >= default
    enabled, offload, note = seen["gpu"]
    assert enabled == offload and (offload or note.startswith("No GPU here"))
    assert seen["own"] == ("384", 384)  # the dialog's choice reached the command line and the engine
    assert seen["again"] == ("384", 384)
    assert seen["reopened"] == 384
