"""The engine's per-token stats stream (`GET /v1/tokenwing/stats/stream`, docs/api.md) as typed events.

`StatsClient.events()` keeps a subscription open, reconnecting with backoff when the engine goes away (a restart
moves it to another port and key: pass `lambda: supervisor.endpoint` to follow it), until the iterator is
closed or its task cancelled. Unknown fields are ignored; an event that cannot be read is skipped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, fields
from typing import Any

import httpx

from runmyai.engine.client import SSEParser
from runmyai.engine.endpoint import EndpointSource, http_client, resolve


@dataclass
class LayerStats:
    layer: int
    hits: int  # selected experts found in RAM
    misses: int  # read from the drive
    vram_hits: int = 0  # computed from VRAM (engines without a GPU path do not send it)
    vram_swaps_in: int = 0  # experts of this layer moved into VRAM before this token (older engines: not sent)
    vram_swaps_out: int = 0  # experts of this layer that left VRAM for them
    vram_bytes_up: int = 0  # bytes copied to the device for them


@dataclass
class TokenStats:
    token: int
    layers: list[LayerStats]
    ssd_wait_ms: float
    bytes_read: int
    vram_swaps: int  # experts moved into VRAM before this token, all layers (the per-layer counts' sum)
    prediction_recall: list[float]
    tokens_per_s: float | None
    prefetch_issued: int = 0
    prefetch_used: int = 0
    vram_bytes_up: int = 0  # bytes copied to the device before this token, all layers
    extra: dict[str, Any] = field(default_factory=dict)  # fields this version does not know, kept as sent

    @property
    def vram_swaps_out(self) -> int:
        """Experts that left VRAM before this token, all layers (0 from an engine that does not send it)."""
        return sum(layer.vram_swaps_out for layer in self.layers)


def _num(v: object, kind: type[int] | type[float], default: float | int = 0) -> Any:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return kind(default)
    return kind(v)


# what this version reads of an event: its dataclasses' fields (every other field is kept in `extra`); a test
# checks them against the fields the engine says it sends (`tokenwing info --json`'s stats_fields)
LAYER_FIELDS = tuple(f.name for f in fields(LayerStats))
TOKEN_FIELDS = tuple(f.name for f in fields(TokenStats) if f.name != "extra")


def parse_token_stats(data: str) -> TokenStats | None:
    """One `event: token` data payload; None when it is not a JSON object with at least `layers`."""
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("layers"), list):
        return None
    layers = [LayerStats(*(_num(e.get(k), int) for k in LAYER_FIELDS)) for e in obj["layers"] if isinstance(e, dict)]
    recall_raw = obj.get("prediction_recall")
    recall = [float(r) for r in recall_raw if isinstance(r, int | float)] if isinstance(recall_raw, list) else []
    tps = obj.get("tokens_per_s")
    return TokenStats(
        token=_num(obj.get("token"), int),
        layers=layers,
        ssd_wait_ms=_num(obj.get("ssd_wait_ms"), float),
        bytes_read=_num(obj.get("bytes_read"), int),
        vram_swaps=_num(obj.get("vram_swaps"), int),
        prediction_recall=recall,
        tokens_per_s=float(tps) if isinstance(tps, int | float) and not isinstance(tps, bool) else None,
        prefetch_issued=_num(obj.get("prefetch_issued"), int),
        prefetch_used=_num(obj.get("prefetch_used"), int),
        vram_bytes_up=_num(obj.get("vram_bytes_up"), int),
        extra={k: v for k, v in obj.items() if k not in TOKEN_FIELDS},
    )


class StatsClient:
    def __init__(
        self,
        endpoint: EndpointSource,
        *,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        on_status: Callable[[bool], None] | None = None,
    ) -> None:
        """`on_status(connected)` is called on each (re)connection and loss, for a "reconnecting…" hint."""
        self._source = endpoint
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.on_status = on_status
        self.connected = False
        self.connections = 0  # successful subscriptions so far

    def _set_connected(self, value: bool) -> None:
        if value != self.connected:
            self.connected = value
            if self.on_status is not None:
                self.on_status(value)

    async def events(self) -> AsyncGenerator[TokenStats, None]:
        delay = self.backoff_s
        timeout = httpx.Timeout(60.0, connect=5.0)  # keep-alives come every 15 s: 60 s of silence is a dead link
        async with await http_client(resolve(self._source), timeout) as client:
            try:
                while True:
                    ep = resolve(self._source)
                    if ep is not None:
                        try:
                            async with client.stream(
                                "GET", ep.url("tokenwing/stats/stream"), headers=ep.headers()
                            ) as r:
                                if r.status_code == 200:
                                    self.connections += 1
                                    self._set_connected(True)
                                    delay = self.backoff_s
                                    parser = SSEParser()
                                    async for line in r.aiter_lines():
                                        ev = parser.feed(line)
                                        if ev is not None and ev[0] == "token":
                                            stats = parse_token_stats(ev[1])
                                            if stats is not None:
                                                yield stats
                        except (httpx.TransportError, httpx.StreamError):
                            pass
                    self._set_connected(False)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.max_backoff_s)
            finally:
                self._set_connected(False)
