"""The engine's handle on the native streaming core: slot sizing from a RAM budget, block ↔ streamed-layer
numbering, per-token statistics, and a debug mode that checks every delivered expert against its checksum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import xxhash

from tokenwing import _core
from tokenwing.errors import BadInputError, CorruptModelError
from tokenwing.format.layout import ExpertIndex
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import human_bytes
from tokenwing.streaming.settings import StreamSettings

COUNTERS: list[str] = list(_core.COUNTERS)


@dataclass(frozen=True)
class SlotPlan:
    slots_per_layer: int
    bytes: int
    note: str | None  # one line when the plan had to go above the budget


def plan_slots(index: ExpertIndex, budget: int, min_per_layer: int, layers: Sequence[int] | None = None) -> SlotPlan:
    """Equal slots per streamed layer (`layers`: blocks, default every layer of the index) from a byte budget, at
    least `min_per_layer`, at most every expert.

    Never refuses: a budget below the minimum gets the minimum (slower, more reads) and a note saying so.
    """
    per_slot_row = sum(el.record_size for el in index.layers if layers is None or el.layer in layers)
    n = budget // per_slot_row if per_slot_row else 0
    n = min(n, index.n_expert)
    note = None
    if n < min_per_layer:
        note = (
            f"RAM budget {human_bytes(budget)} holds {n} experts per layer; using the minimum of {min_per_layer} "
            f"({human_bytes(min_per_layer * per_slot_row)}): every token will read more from the drive"
        )
        n = min_per_layer
    return SlotPlan(int(n), int(n * per_slot_row), note)


class ExpertStreamer:
    """Streams one model file's routed experts. Layers are named by their block index; `layers` (blocks) limits
    streaming to those (multi-token-prediction blocks are neither read nor given slots)."""

    def __init__(
        self,
        model: ModelFile,
        slots_per_layer: int,
        settings: StreamSettings | None = None,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.settings = settings or StreamSettings()
        self.index = model.index
        self.layers = [el for el in self.index.layers if layers is None or el.layer in layers]
        rows = [i for i, el in enumerate(self.index.layers) if layers is None or el.layer in layers]
        self.checksums = model.index.checksums[rows]
        self.block_to_li = {el.layer: i for i, el in enumerate(self.layers)}
        geos = []
        for el in self.layers:
            g = _core.LayerGeometry()
            g.offset, g.record_size, g.n_slots = el.offset, el.record_size, slots_per_layer
            g.proj_offset, g.proj_size = list(el.proj_offset), list(el.proj_size)
            geos.append(g)
        try:
            self.core = _core.StreamCore(model.path, self.index.n_expert, geos, self.settings.core_config())
        except (ValueError, IndexError) as e:
            raise BadInputError(str(e)) from None
        self.pools = [self.core.slot_array(li) for li in range(len(geos))]
        self._last = self.core.counters()

    def __enter__(self) -> ExpertStreamer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.core.close()

    @property
    def fallback_line(self) -> str | None:
        return None if self.core.direct else f"tokenwing: {self.core.fallback_reason}: expert reads use the file cache"

    def li(self, block: int) -> int:
        try:
            return self.block_to_li[block]
        except KeyError:
            raise KeyError(f"layer {block} has no streamed experts") from None

    # The hot path: thin pass-throughs (the core releases the GIL).
    def begin_token(self, prompt_tokens: int = 0) -> None:
        self.core.begin_token(prompt_tokens)

    def begin_layer(self, block: int, experts: Sequence[int], keep: Sequence[int] = ()) -> list[bool]:
        """Starts the layer with these selected experts (and `keep`, a later wave's, left in place); returns
        which of `experts` are ready now."""
        return self.core.begin_layer(self.li(block), list(experts), list(keep))

    def holding(self, block: int, experts: Sequence[int]) -> list[bool]:
        return self.core.holding(self.li(block), list(experts))

    def end_layer(self, block: int) -> None:
        self.core.end_layer(self.li(block))

    def predict(
        self, block: int, experts: Sequence[int], distance: int, probs: Sequence[float] = (), max_votes: int = 0
    ) -> None:
        self.core.predict(self.li(block), list(experts), distance, list(probs), max_votes)

    def read_known(self, block: int, experts: Sequence[int]) -> None:
        self.core.read_known(self.li(block), list(experts))

    def ready(self, block: int, experts: Sequence[int]) -> list[bool]:
        return self.core.ready(self.li(block), list(experts))

    def wait(self, block: int, expert: int, proj: int = -1) -> int:
        """Blocks until the expert (or one projection: 0 gate, 1 up, 2 down) is in RAM; returns its slot."""
        li = self.li(block)
        slot = self.core.wait(li, expert, proj)
        if self.settings.verify and proj == -1:
            self._verify(li, expert, slot)
        return slot

    def wait_all(self, block: int, experts: Sequence[int]) -> list[int]:
        """wait(block, e) for every expert, in one call into the core."""
        li = self.li(block)
        slots = self.core.wait_all(li, list(experts))
        if self.settings.verify:
            for e, slot in zip(experts, slots, strict=True):
                self._verify(li, e, slot)
        return slots

    def expert_bytes(self, block: int, slot: int) -> np.ndarray:
        row: np.ndarray = self.pools[self.li(block)][slot]
        return row

    # Slots on loan to a prompt's working memory, and the cache's idle fill.
    def loan(self, nbytes: int, keep_per_layer: int) -> int:
        return int(self.core.loan(nbytes, keep_per_layer))

    def unloan(self) -> None:
        self.core.unloan()

    @property
    def loaned_bytes(self) -> int:
        return int(self.core.loaned_bytes)

    def usable_slots(self, block: int) -> int:
        return int(self.core.usable_slots(self.li(block)))

    def set_usage(self, block: int, ranked: Sequence[int]) -> None:
        self.core.set_usage(self.li(block), list(ranked))

    def set_transform(self, block: int, proj: int, fn: int, ctx: Sequence[int]) -> None:
        """An I/O thread rewrites each landed projection through fn (ggml's repacking), see the core."""
        self.core.set_transform(self.li(block), proj, fn, list(ctx))

    def _verify(self, li: int, expert: int, slot: int) -> None:
        if xxhash.xxh3_64_intdigest(self.pools[li][slot].data) != int(self.checksums[li, expert]):
            layer = self.layers[li].layer
            raise CorruptModelError(f"expert {expert} of layer {layer} was delivered with wrong bytes")

    # Statistics: cheap to read at every token.
    def counters(self) -> np.ndarray:
        """Cumulative counters, shape (streamed layers, len(COUNTERS))."""
        return self.core.counters()

    def token_delta(self) -> np.ndarray:
        """Counters since the previous call (per token when called once per token)."""
        now = self.core.counters()
        delta = now - self._last
        self._last = now
        return delta
