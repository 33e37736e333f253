"""The app's VRAM graph from a real engine on the device: `tokenwing serve` started by the app's supervisor with a
VRAM budget that holds some of the experts, driven through a routing shift (a chat in words, then chats in
digits), its stats stream read by the app's stats client into the graphs' Qt-free series and the graph widget.
Swaps in must show (the cache fills), then swaps out (the digits' experts replace the words')."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.compute.conftest import DEVICES, device
from tests.compute.test_vram_stats import SHAPE, quarter_of_the_experts
from tests.conftest import ModelFactory

if TYPE_CHECKING:
    from pytestqt.qtbot import QtBot

    from runmyai.engine.stats import TokenStats

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytestmark = [
    pytest.mark.skipif(not DEVICES, reason="no device (ggml built for the CPU only)"),
    pytest.mark.own_process,
]
WORDS = "the cat sat on the mat and the dog ran to the cat " * 3  # two texts of different character
DIGITS = " ".join("0123456789" * 8)
MAX_B_CHATS = 4  # digits' chats until the swaps out show (the first one does, on this model)


async def _wait_for(cond: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout  # a guard: at once when all is well
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_the_vram_graph_shows_a_real_engines_swaps(repacked_factory: ModelFactory, qtbot: QtBot) -> None:
    # (the app's dependencies: absent on the GPU machine, where bench/gpu_check.sh runs tests/compute)
    pytest.importorskip("uvicorn", reason="the server's dependencies are not installed (the GPU machine)")
    pytest.importorskip("runmyai.engine.stats", reason="the app is not installed (the GPU machine)")
    pytest.importorskip("pyqtgraph", reason="the app's graphs are not installed")
    from runmyai.engine.client import ChatClient, ChatSettings
    from runmyai.engine.stats import StatsClient
    from runmyai.engine.supervisor import EngineSupervisor
    from runmyai.monitor import StatsSeries, device_note
    from runmyai.ui.graphs import GraphsPanel

    model: Path = repacked_factory(type="Q8_0", **SHAPE)
    budget = quarter_of_the_experts(model)  # 4 of 16 experts per layer in VRAM, no layer: swaps have work to do
    flags = ["--ctx", "512", "--device", device(DEVICES[0]).kind, "--vram-budget", budget, "--vram-layers", "0",
             "--no-usage-table"]  # fmt: skip
    logs: list[str] = []
    events: list[TokenStats] = []
    series = StatsSeries(window=1024)

    async def main() -> None:
        sup = EngineSupervisor(model, flags, on_log=logs.append, backoff_s=0.2, health_interval_s=0.2)
        await sup.start()
        stats = StatsClient(lambda: sup.endpoint, backoff_s=0.1, max_backoff_s=0.5)

        async def listen() -> None:
            async for ev in stats.events():
                events.append(ev)
                series.add(ev)

        listener = asyncio.create_task(listen())
        client = ChatClient(lambda: sup.endpoint)
        try:
            await _wait_for(lambda: stats.connected)
            settings = ChatSettings(temperature=0, max_tokens=40)

            async def chat(text: str) -> None:
                async for _ in client.stream_chat([{"role": "user", "content": text}], settings):
                    pass

            await chat(WORDS)  # the empty cache fills: swaps in, none out
            # the digits' experts win the slots; swaps move in between steps, in the staging thread's own time:
            # chats go on until they have (a bound, not a wait)
            for _ in range(MAX_B_CHATS):
                await chat(DIGITS)
                if sum(series.vram_swaps_out):
                    break
            await _wait_for(lambda: sum(series.vram_swaps_out) > 0, timeout=10)  # (the last events in flight)
        finally:
            await client.aclose()
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
            await sup.stop()

    asyncio.run(main())

    # the series the graph draws: swaps in and out per token, and the same counts per layer
    assert sum(series.vram_swaps) > 0 and sum(series.vram_swaps_out) > 0
    first_in = next(i for i, n in enumerate(series.vram_swaps) if n)
    first_out = next(i for i, n in enumerate(series.vram_swaps_out) if n)
    assert series.vram_swaps_out[first_in] == 0 and first_in < first_out  # the empty slots fill before any leaves
    assert sum(series.total_swaps_in) == sum(series.vram_swaps) == sum(ev.vram_swaps for ev in events)
    assert sum(series.total_swaps_out) == sum(series.vram_swaps_out)
    for swapped_in, swapped_out in zip(series.total_swaps_in, series.total_swaps_out, strict=True):
        assert swapped_out <= swapped_in  # a resident leaves only for a newcomer
    assert sum(ev.vram_bytes_up for ev in events) > 0  # the swaps' copies to the device
    assert sum(series.total_vram) > 0  # and the experts in VRAM served tokens
    for v, ram, drive in zip(series.last_vram, series.last_ram, series.last_drive, strict=True):
        assert v + ram + drive == pytest.approx(1.0)
    notes = [n for n in map(device_note, logs) if n is not None]
    assert notes and notes[0].startswith(f"Computing on {DEVICES[0]}"), logs[-20:]

    # the graph widget draws those series: the same events give lines with the swaps in and out
    g = GraphsPanel()
    qtbot.addWidget(g)
    for ev in events:
        g.add(ev)
    qtbot.waitUntil(lambda: g.summary.text().startswith(f"{len(events)} tokens"), timeout=60_000)  # redraws: 250 ms
    _x, swapped_in = g.vram_line.getData()
    _x, swapped_out = g.vram_out_line.getData()
    assert sum(swapped_in) == sum(series.vram_swaps) and sum(swapped_out) == sum(series.vram_swaps_out) > 0
