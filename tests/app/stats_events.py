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
    vram_swaps: int | None = None,
    prediction_recall: tuple[float, ...] = (0.7, 0.5),
    tokens_per_s: float | None = 12.0,
) -> TokenStats:
    """`vram_swaps` (the total the engine sends beside the layers' counts): the layers' swaps in unless given, as
    the engine sends it; given alone, it is an engine older than the per-layer counts."""
    swaps = sum(layer.vram_swaps_in for layer in layers) if vram_swaps is None else vram_swaps
    return TokenStats(token, layers, ssd_wait_ms, bytes_read, swaps, list(prediction_recall), tokens_per_s)
