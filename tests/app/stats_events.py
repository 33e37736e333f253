"""Per-token stats events for the graph tests: the stats client's own types, with test defaults."""

from __future__ import annotations

from runmyai.engine.stats import LayerStats as Layer
from runmyai.engine.stats import TokenStats

__all__ = ["Event", "Layer"]


def Event(  # reads like the type it builds
    token: int,
    layers: list[Layer],
    ssd_wait_ms: float = 1.0,
    bytes_read: int = 1 << 20,
    vram_swaps: int = 0,
    prediction_recall: tuple[float, ...] = (0.7, 0.5),
    tokens_per_s: float | None = 12.0,
) -> TokenStats:
    return TokenStats(token, layers, ssd_wait_ms, bytes_read, vram_swaps, list(prediction_recall), tokens_per_s)
