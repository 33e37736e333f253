"""The graphs' data: per-layer hit rates and rolling series from per-token stats."""

from __future__ import annotations

from runmyai.monitor import StatsSeries, device_note
from tests.app.stats_events import Event, Layer


def test_hit_rates_last_and_mean() -> None:
    s = StatsSeries()
    s.add(Event(1, [Layer(3, 8, 0), Layer(2, 4, 4)]))
    assert s.layer_ids == [2, 3]
    assert s.last_hit_rate == [0.5, 1.0]
    s.add(Event(2, [Layer(2, 0, 8), Layer(3, 8, 0)]))
    assert s.last_hit_rate == [0.0, 1.0]
    assert s.mean_hit_rate() == [0.25, 1.0]
    assert s.overall_hit_rate() == 20 / 32
    assert s.recall == [0.7, 0.5]


def test_rolling_window_pause_and_reset() -> None:
    s = StatsSeries(window=4)
    for t in range(10):
        s.add(Event(t, [Layer(0, 1, 1)], ssd_wait_ms=float(t)))
    assert list(s.ssd_wait_ms) == [6.0, 7.0, 8.0, 9.0]
    assert list(s.token_index) == [7, 8, 9, 10]
    s.paused = True
    assert not s.add(Event(11, [Layer(0, 1, 1)]))
    assert s.tokens == 10
    s.reset()
    assert s.tokens == 0 and s.layer_ids == [] and not s.ssd_wait_ms and s.overall_hit_rate() is None


def test_zero_vram_swaps_are_recorded_as_zero() -> None:
    s = StatsSeries()
    s.add(Event(1, [Layer(0, 0, 0)]))
    assert list(s.vram_swaps) == [0.0]
    assert s.last_hit_rate == [0.0]  # no lookups: drawn as 0, not a division error


def test_another_model_starts_over() -> None:
    s = StatsSeries()
    s.add(Event(1, [Layer(0, 1, 0)]))
    s.add(Event(1, [Layer(0, 1, 0), Layer(1, 0, 1)]))
    assert s.total_lookups == [1, 1]


def test_three_tiers_per_layer() -> None:
    """Every selected expert came from VRAM, RAM or the drive: the shares per layer, and memory = VRAM + RAM."""
    s = StatsSeries()
    s.add(Event(1, [Layer(0, 2, 1, vram_hits=5), Layer(1, 0, 0, vram_hits=8)]))
    assert s.last_vram == [5 / 8, 1.0] and s.last_ram == [2 / 8, 0.0] and s.last_drive == [1 / 8, 0.0]
    assert s.last_hit_rate == [7 / 8, 1.0]
    s.add(Event(2, [Layer(0, 4, 4, vram_hits=0), Layer(1, 0, 8, vram_hits=0)]))
    assert s.mean_vram_share() == [5 / 16, 0.5] and s.mean_hit_rate() == [11 / 16, 0.5]


def test_vram_swaps_in_and_out_per_token_and_layer() -> None:
    """Swaps in and out per token (the VRAM graph's two lines) and per layer so far (its bars' hover); an older
    engine's event with only the total of swaps in counts that total in and none out."""
    s = StatsSeries()
    # the cache filling: experts come in, none leave
    s.add(Event(1, [Layer(0, 2, 0, vram_swaps_in=3), Layer(1, 2, 0, vram_swaps_in=1)]))
    # the text moved on: newcomers replace residents
    s.add(
        Event(2, [Layer(0, 2, 0, vram_swaps_in=2, vram_swaps_out=2), Layer(1, 2, 0, vram_swaps_in=1, vram_swaps_out=1)])
    )
    s.add(Event(3, [Layer(0, 2, 0), Layer(1, 2, 0)], vram_swaps=2))  # older engine: the total only
    assert list(s.vram_swaps) == [4.0, 3.0, 2.0] and list(s.vram_swaps_out) == [0.0, 3.0, 0.0]
    assert s.total_swaps_in == [5, 2] and s.total_swaps_out == [2, 1]
    s.reset()
    assert not s.vram_swaps_out and s.total_swaps_in == []


def test_device_note_picks_the_engines_device_line() -> None:
    gpu = "tokenwing: computing on CUDA0 (NVIDIA H200), VRAM budget 130 GiB; in VRAM: 48 layers' attention"
    assert device_note(gpu) == gpu.removeprefix("tokenwing: c").join(["C", ""])
    assert device_note("tokenwing: computing on the CPU: no GPU found") == "Computing on the CPU: no GPU found"
    assert device_note("tokenwing: the GPU failed (x): computing on the CPU from here on") is not None
    assert device_note("tokenwing: ready: qwen3moe: 48 layers") is None
