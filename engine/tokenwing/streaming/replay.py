"""A decode replayed through the streaming core: the engine's own request pattern without its compute.

Per token and streamed layer, as the engine does: `begin_layer` with the layer's selected experts (demand reads),
the lookahead's predictions for the next layers, a wait for the experts, then `compute_s` of busy CPU on the
calling thread (standing in for the layer's compute, which competes with the I/O threads for the cores). The
autotuner chooses I/O settings by the tokens per second this reaches; the benchmarks count its CPU and wake-ups.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenwing.format.reader import ModelFile
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS, ExpertStreamer
from tokenwing.streaming.trace import Trace


@dataclass(frozen=True)
class ReplayResult:
    tokens: int
    seconds: float
    bytes_read: int
    wait_s: float  # time the caller spent blocked on reads
    reads: int  # demand reads and prefetches
    io_engine: str

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def replay(
    mf: ModelFile,
    slots: int,
    settings: StreamSettings,
    trace: Trace,
    compute_s: float = 0.0,
    lookahead: int = 2,
    warmup: int = 0,
    before_close: Callable[[], None] = lambda: None,
) -> ReplayResult:
    """Replays `trace` (its layers in the order of the file's streamed layers) through a fresh core with `slots`
    per layer; the first `warmup` tokens fill the cache and are not counted. `before_close` runs while the core's
    threads are still there (to read their CPU time)."""
    layers = [el.layer for el in mf.index.layers][: trace.selected.shape[1]]
    n_dist = min(lookahead, trace.predicted.shape[2])
    with ExpertStreamer(mf, slots, settings, layers) as s:
        t0, c0 = 0.0, s.counters()
        for tok in range(trace.n_tokens):
            if tok == warmup:
                t0, c0 = time.perf_counter(), s.counters()
            s.begin_token()
            for row, layer in enumerate(layers):
                sel = [int(e) for e in dict.fromkeys(trace.selected[tok, row].tolist()) if e >= 0]
                s.begin_layer(layer, sel)
                for d in range(n_dist):
                    if row + d + 1 < len(layers):
                        pred = [int(e) for e in trace.predicted[tok, row + d + 1, d] if e >= 0]
                        s.predict(layers[row + d + 1], pred, d + 1)
                s.wait_all(layer, sel)
                _busy(compute_s)
                s.end_layer(layer)
        secs = time.perf_counter() - t0
        c = dict(zip(COUNTERS, (s.counters() - c0).sum(axis=0), strict=True))
        engine = s.core.io_engine
        before_close()
    return ReplayResult(
        trace.n_tokens - warmup,
        secs,
        int(c["bytes_read"]),
        float(c["wait_ns"]) / 1e9,
        int(c["demand_reads"] + c["prefetch_issued"]),
        engine,
    )


def _busy(seconds: float) -> None:
    """Keeps the calling thread on a core for `seconds` (a layer's compute does; a sleep would free the core)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
