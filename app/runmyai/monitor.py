"""The engine's per-token stats, accumulated for the live graphs (Qt-free; the graphs widget only draws)."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class LayerCounts(Protocol):
    layer: int
    hits: int  # from RAM
    misses: int  # from the drive
    vram_hits: int  # from VRAM
    vram_swaps_in: int  # experts moved into VRAM before this token
    vram_swaps_out: int  # experts that left VRAM for them


class TokenEvent(Protocol):
    """What the stats client yields per token (runmyai.engine.stats.TokenStats has these fields)."""

    token: int
    ssd_wait_ms: float
    bytes_read: int
    vram_swaps: int  # experts moved into VRAM, all layers (sent on its own by engines older than per-layer swaps)
    prediction_recall: list[float]
    tokens_per_s: float | None

    @property
    def layers(self) -> Sequence[LayerCounts]: ...  # a read-only attribute, so list[LayerStats] fits

    @property
    def vram_swaps_out(self) -> int: ...  # experts that left VRAM, all layers


@dataclass
class StatsSeries:
    """Per-layer shares of the selected experts by where they came from — VRAM, RAM, the drive — for the last token,
    and the running share found in memory (VRAM or RAM); rolling per-token series."""

    window: int = 256  # tokens kept for the rolling lines
    paused: bool = False
    tokens: int = 0
    layer_ids: list[int] = field(default_factory=list)
    last_hit_rate: list[float] = field(default_factory=list)  # found in memory: VRAM or RAM
    last_vram: list[float] = field(default_factory=list)  # of the last token's selected experts: from VRAM
    last_ram: list[float] = field(default_factory=list)
    last_drive: list[float] = field(default_factory=list)
    total_vram: list[int] = field(default_factory=list)
    total_hits: list[int] = field(default_factory=list)  # in memory (VRAM or RAM)
    total_lookups: list[int] = field(default_factory=list)
    total_swaps_in: list[int] = field(default_factory=list)  # per layer, since the start (or the last reset)
    total_swaps_out: list[int] = field(default_factory=list)
    ssd_wait_ms: deque[float] = field(default_factory=deque)
    bytes_read: deque[float] = field(default_factory=deque)
    vram_swaps: deque[float] = field(default_factory=deque)  # swaps in per token
    vram_swaps_out: deque[float] = field(default_factory=deque)
    tokens_per_s: deque[float] = field(default_factory=deque)
    token_index: deque[int] = field(default_factory=deque)
    recall: list[float] = field(default_factory=list)

    def add(self, event: TokenEvent) -> bool:
        """Take one token's stats; False (and nothing changes) while paused."""
        if self.paused:
            return False
        layers = sorted(event.layers, key=lambda s: s.layer)
        ids = [s.layer for s in layers]
        if ids != self.layer_ids:  # first event, or another model: start over
            self._reset_layers(ids)
        for i, s in enumerate(layers):
            vram = getattr(s, "vram_hits", 0)
            lookups = vram + s.hits + s.misses
            shares = [n / lookups if lookups else 0.0 for n in (vram, s.hits, s.misses)]
            self.last_vram[i], self.last_ram[i], self.last_drive[i] = shares
            self.last_hit_rate[i] = (vram + s.hits) / lookups if lookups else 0.0
            self.total_vram[i] += vram
            self.total_hits[i] += vram + s.hits
            self.total_lookups[i] += lookups
            self.total_swaps_in[i] += s.vram_swaps_in
            self.total_swaps_out[i] += s.vram_swaps_out
        self.tokens += 1
        for series, value in (
            (self.ssd_wait_ms, event.ssd_wait_ms),
            (self.bytes_read, float(event.bytes_read)),
            (self.vram_swaps, float(event.vram_swaps)),
            (self.vram_swaps_out, float(event.vram_swaps_out)),
            (self.tokens_per_s, event.tokens_per_s or 0.0),
        ):
            series.append(value)
            if len(series) > self.window:
                series.popleft()
        self.token_index.append(self.tokens)
        if len(self.token_index) > self.window:
            self.token_index.popleft()
        self.recall = list(event.prediction_recall)
        return True

    def mean_vram_share(self) -> list[float]:
        return [v / n if n else 0.0 for v, n in zip(self.total_vram, self.total_lookups, strict=True)]

    def mean_hit_rate(self) -> list[float]:
        return [h / n if n else 0.0 for h, n in zip(self.total_hits, self.total_lookups, strict=True)]

    def overall_hit_rate(self) -> float | None:
        lookups = sum(self.total_lookups)
        return sum(self.total_hits) / lookups if lookups else None

    def reset(self) -> None:
        self.tokens = 0
        self._reset_layers([])
        for series in (
            self.ssd_wait_ms,
            self.bytes_read,
            self.vram_swaps,
            self.vram_swaps_out,
            self.tokens_per_s,
            self.token_index,
        ):
            series.clear()
        self.recall = []

    def _reset_layers(self, ids: list[int]) -> None:
        self.layer_ids = ids
        self.last_hit_rate = [0.0] * len(ids)
        self.last_vram = [0.0] * len(ids)
        self.last_ram = [0.0] * len(ids)
        self.last_drive = [0.0] * len(ids)
        self.total_vram = [0] * len(ids)
        self.total_hits = [0] * len(ids)
        self.total_lookups = [0] * len(ids)
        self.total_swaps_in = [0] * len(ids)
        self.total_swaps_out = [0] * len(ids)


_DEVICE_LINES = ("computing on ", "the GPU failed")


def device_note(line: str) -> str | None:
    """The engine's line saying where it computes (the GPU and its share of the model, or the CPU and why), or
    that its GPU failed mid-run: shown beside the graphs. None for any other log line."""
    text = line.strip().removeprefix("tokenwing: ")
    if text.startswith(_DEVICE_LINES):
        return text[0].upper() + text[1:]
    return None


# the engine's reasons for the CPU (compute/devices.py), most specific first, in a newcomer's words
_CPU_WHY = (
    ("too little VRAM", "the GPU has too little free memory"),
    ("failed to start", "the GPU could not be started"),
    ("listing devices failed", "the GPUs could not be listed"),
    ("built for the CPU only", "this engine was built without GPU support"),
    ("built without", "this engine was built without that kind of GPU"),
    ("computes on the CPU", "the only GPU driver here runs on the CPU itself"),
    ("no GPU found", "no GPU was found"),
    ("device found", "no GPU of that kind was found"),
)
_ON_GPU = re.compile(
    r"computing on (?P<name>.+?), VRAM budget (?P<budget>.+?)"
    r"(?: \((?:auto|--device)[^)]*\))?(?:; in VRAM: (?P<plan>.*))?$"
)


def plain_device(note: str) -> str:
    """device_note's line in a newcomer's words for the performance panel: no flags ("--device cpu"), no
    environment variables ("GGML_VK_VISIBLE_DEVICES"), no driver lists. The engine's own line stays its tooltip."""
    text = note[:1].lower() + note[1:]
    if text.startswith("the GPU failed"):
        return "The GPU failed, so the CPU computes from here on."
    if text.startswith("computing on the CPU"):
        if "--device cpu" in text:
            return "Computing on the CPU, as set for this model."
        why = next((words for key, words in _CPU_WHY if key in text), None)
        return f"Computing on the CPU: {why}." if why else "Computing on the CPU."
    m = _ON_GPU.match(text)
    if m is None:
        return note
    budget = m["budget"]
    named = re.fullmatch(r"\S+ \((.+)\)", m["name"])  # "CUDA0 (NVIDIA H200)": the card's own name
    name = named[1] if named else m["name"]
    amount = budget.rsplit(": ", 1)[-1] if budget.startswith("--") else budget.split(" of ")[0]
    line = f"Computing on the GPU {name}, with up to {amount} of its memory for the model"
    return line + (f" (there: {m['plan']})." if m["plan"] else ".")
