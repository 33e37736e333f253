"""The graphs' data: per-layer hit rates and rolling series from per-token stats."""

from __future__ import annotations

from runmyai.monitor import StatsSeries
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
