"""Expert scheduling: the one user of the streaming core in the engine.

It sizes the RAM expert cache, reads every expert at start when they all fit, seeds the idle fill from the usage
table, lends slots to a long prompt's working memory and takes them back, orders a prompt's experts into
waves that fit the slots (and reads the next layers' experts ahead for very long prompts), and passes each
layer's selected experts and the lookahead's predictions to the core. Layers are named by their block index
everywhere; the core's row numbering stays inside `ExpertStreamer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from tokenwing.errors import TokenWingError
from tokenwing.format.layout import K_HEADER_CHECKSUM
from tokenwing.format.reader import ModelFile
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS, ExpertStreamer, plan_slots
from tokenwing.streaming.usage import UsageTable, load_usage, save_usage, usage_path

RECENCY_HALF_LIFE = 128  # tokens: how fast a prompt's early expert uses fade when ordering its waves
READ_AHEAD_TOKENS = 4096  # from this prompt length, the next layers' most used experts are read ahead
READ_AHEAD_LAYERS = 2

Log = Callable[[str], None]


class ExpertScheduler:
    def __init__(
        self,
        mf: ModelFile,
        layers: list[int],
        k: int,
        budget: int,
        settings: StreamSettings,
        preload: bool | None,
        usage_table: bool,
        log: Log,
    ) -> None:
        """layers: the blocks whose experts are streamed (multi-token-prediction blocks left out); k: experts
        per token; budget: bytes for the cache (raised to k slots per layer, with one line, if too small)."""
        self.mf, self.layers, self.k, self.log = mf, layers, k, log
        self.n_expert = mf.index.n_expert
        plan = plan_slots(mf.index, budget, k, layers)
        if plan.note:
            log(plan.note)
        self.slots_per_layer = plan.slots_per_layer
        self.streamer = ExpertStreamer(mf, plan.slots_per_layer, settings, layers)
        if self.streamer.fallback_line:
            log(self.streamer.fallback_line.removeprefix("tokenwing: "))
        if self.streamer.core.io_fallback_reason:
            log(self.streamer.core.io_fallback_reason)
        self.record_sizes = {el.layer: el.record_size for el in self.streamer.layers}
        self.capacity = plan.bytes  # every slot filled
        self.usage_on = usage_table
        self.usage = UsageTable(layers, self.n_expert, int(mf.header.get(K_HEADER_CHECKSUM) or 0))
        self.usage_seed: UsageTable | None = None  # the usage table read at start
        self.preloaded = preload if preload is not None else self.slots_per_layer >= self.n_expert
        self.slot_map: dict[int, np.ndarray] | None = None  # every expert's slot, while all are resident
        self.loaned = 0
        self.on_slot_map_change: Callable[[], None] = lambda: None

    def start(self) -> None:
        """Reads every expert at start when asked (or when they all fit), else seeds the idle fill."""
        if self.preloaded:
            self.preload()
        elif self.usage_on:
            self._seed_idle_fill()

    def close(self) -> None:
        self.streamer.close()

    # --------------------------------------------------------------------------------------- set-up
    def _seed_idle_fill(self) -> None:
        """Empty slots fill with the most used experts (usage table) once the engine is idle."""
        table = load_usage(usage_path(self.mf.path), self.layers, self.n_expert, self.usage.model_checksum, self.log)
        if table is None:
            return
        self.usage_seed = table
        for row, block in enumerate(self.layers):
            self.streamer.set_usage(block, table.ranked(row))

    def preload(self) -> None:
        """Reads every expert that fits into the cache now, as llama.cpp loads its weights before the first
        token: a model that fits in RAM then runs at memory speed from the first token, not after warming."""
        n = min(self.slots_per_layer, self.n_expert)
        slot_map = {}
        for block in self.layers:
            experts = list(range(n))
            self.streamer.begin_layer(block, experts)
            slot_map[block] = np.array(self.streamer.wait_all(block, experts), np.int32)
            self.streamer.end_layer(block)
        self.streamer.token_delta()  # per-token statistics start after the load
        # Nothing evicts a cache that holds every expert, except slots lent to a long prompt (`lend`)
        self.slot_map = slot_map if n == self.n_expert else None
        self.on_slot_map_change()

    # ------------------------------------------------------------------------------------- the usage table
    def observe(self, block: int, sel: np.ndarray) -> None:
        """The experts layer `block` selected (any shape): counted in the usage table."""
        self.usage.add(self.row(block), sel)

    def save_usage(self) -> None:
        """Adds this session's expert counts to the usage table next to the model (the server: after each request)."""
        if not self.usage_on or self.usage.tokens == 0:
            return
        path = usage_path(self.mf.path)
        u = self.usage
        merged = u.merge_into(load_usage(path, self.layers, self.n_expert, u.model_checksum, lambda line: None))
        try:
            save_usage(path, merged)
        except TokenWingError as e:
            self.log(f"the usage table was not saved ({e})")
        self.usage = UsageTable(self.layers, self.n_expert, u.model_checksum)  # saved: start over

    # ------------------------------------------------------------------------------------- per token
    def row(self, block: int) -> int:
        return self.streamer.li(block)

    def begin_token(self, prompt_tokens: int = 0) -> None:
        self.streamer.begin_token(prompt_tokens)

    def begin_layer(self, block: int, experts: Sequence[int], keep: Sequence[int] = ()) -> list[bool]:
        """The layer starts with these experts (reads issued for the missing ones); returns which are ready."""
        return self.streamer.begin_layer(block, experts, keep)

    def end_layer(self, block: int) -> None:
        self.streamer.end_layer(block)

    def wait_all(self, block: int, experts: Sequence[int]) -> list[int]:
        return self.streamer.wait_all(block, experts)

    def wait_gate_up(self, block: int, experts: Sequence[int]) -> list[int]:
        """Blocks until each expert's gate and up projections are in RAM (down may still be on its way)."""
        for e in experts:
            self.streamer.wait(block, e, 0)
        return [self.streamer.wait(block, e, 1) for e in experts]

    def predict(
        self, block: int, experts: Sequence[int], distance: int, probs: Sequence[float] = (), predictors: int = 0
    ) -> None:
        """Predictions for a later layer (rank order), with the router's probability of each where known (the core
        reads the likeliest first) and how many layers predict that layer (the votes a prediction needs are capped
        by it)."""
        self.streamer.predict(block, experts, distance, probs, predictors)

    def read_known(self, block: int, experts: Sequence[int]) -> None:
        """Experts certain to be selected when layer `block` runs in this token (DeepSeek V4's hash layers, from
        the token id): read now, as demand reads, ahead of every prediction; call in layer order. At the layer's
        start they are hits or waits on a known read (`known_late`), never demand reads."""
        self.streamer.read_known(block, experts)

    def touch(self, block: int, experts: Sequence[int]) -> None:
        """A layer computed elsewhere (a whole decode step in one graph): the core still sees its experts."""
        self.streamer.begin_layer(block, experts)
        self.streamer.end_layer(block)

    # ------------------------------------------------------------------------------------------ loans
    def after_prompt(self) -> None:
        """The first decode token: a prompt's working memory is gone, the cache takes its slots back (and reads
        back, when every expert was read at start, what the loan evicted)."""
        if self.loaned:
            self.streamer.unloan()
            self.loaned = 0
            if self.preloaded:
                self.preload()

    def lend(self, need: int) -> None:
        """A prompt's working memory counts against the memory limit: when free memory is short, the cache
        gives back slots for it (empty ones first, then the coldest) until the first decode token."""
        if need > self.loaned:
            self.loaned += self.streamer.loan(need - self.loaned, self.k)
            if self.slot_map is not None:
                self.slot_map = None  # the loan may have evicted experts: per-layer decode until they are back
                self.on_slot_map_change()

    @property
    def lendable(self) -> int:
        return (self.slots_per_layer - self.k) * sum(self.record_sizes.values())

    def cache_filled(self) -> int:
        """Bytes read into the cache so far (capped at its size): how much of it memory already holds."""
        return min(self.capacity, int(self.counters()[:, COUNTERS.index("bytes_read")].sum()))

    # ----------------------------------------------------------------------------------- a prompt's waves
    @staticmethod
    def prompt_order(sel: np.ndarray, n_expert: int) -> list[int]:
        """A prompt's distinct experts, from those it used least recently to those its end used most (uses
        weighted by a 128-token half-life; ties by id): the last wave, which stays in the cache, holds what the
        first reply tokens are likely to need."""
        n = sel.shape[0]
        recency = 0.5 ** ((n - 1 - np.arange(n)) / RECENCY_HALF_LIFE)
        score = np.zeros(n_expert)
        np.add.at(score, sel, np.broadcast_to(recency[:, None], sel.shape))
        used = np.unique(sel)
        order: list[int] = used[np.lexsort((used, score[used]))].tolist()
        return order

    def wave_size(self, block: int) -> int:
        """How many experts one wave of layer `block` may hold (its slots, less those on loan to a prompt)."""
        return self.streamer.usable_slots(block) if self.loaned else self.slots_per_layer

    def waves(self, block: int, order: list[int]) -> Iterator[tuple[list[int], np.ndarray]]:
        """The experts of `order` in waves that fit the layer's slots, each read at most once: yields (the wave,
        every expert's slot as an array indexed by expert) with the wave in RAM, and ends the layer after it."""
        size = self.wave_size(block)
        rest = order
        while rest:
            wave, keep = self.next_wave(block, rest, size)
            rest = rest[len(wave) :]
            self.streamer.begin_layer(block, wave, keep)
            slot_of = np.zeros(self.n_expert, np.int32)
            slot_of[wave] = self.streamer.wait_all(block, wave)
            yield wave, slot_of
            self.streamer.end_layer(block)

    def next_wave(self, block: int, rest: list[int], size: int) -> tuple[list[int], list[int]]:
        """The next wave: the longest run of `rest` (still to compute, in order) whose experts fit in `size`
        slots beside those of later waves already in RAM or on their way (read ahead, or left by an earlier
        pass), which stay where they are (`keep`) instead of being evicted and read again. Waves are runs of one
        order whatever their sizes, so results do not depend on them."""
        if len(rest) <= size:
            return rest, []
        held = self.streamer.holding(block, rest)
        room = max(1, size - sum(held))  # slots not holding an expert still to compute (at least one)
        end = new = 0
        while end < min(len(rest), size) and (held[end] or new < room):
            new += not held[end]
            end += 1
        keep = [e for e, h in zip(rest[end:], held[end:], strict=True) if h]
        return rest[:end], keep[: size - end]  # (none dropped unless every slot held a later expert)

    def read_ahead(self, block: int, prompt_tokens: int) -> None:
        """Read-ahead window (prompts from READ_AHEAD_TOKENS): while layer `block` computes, the most used
        experts of the next streamed layers are read, half of each one's slots (the rest leaves room for its
        waves): at that length nearly all of them are needed. Predictions to the core: read when no demand
        read waits."""
        if prompt_tokens < READ_AHEAD_TOKENS:
            return
        for distance, target in enumerate([b for b in self.layers if b > block][:READ_AHEAD_LAYERS], 1):
            row = self.row(target)
            counts = self.usage.counts[row] + (self.usage_seed.counts[row] if self.usage_seed is not None else 0)
            ranked = np.lexsort((np.arange(self.n_expert), -counts))  # most used first; ties: lower id
            n = self.streamer.usable_slots(target) // 2
            self.streamer.predict(target, ranked[:n].tolist(), distance)

    # ------------------------------------------------------------------------------------------ statistics
    def counters(self) -> np.ndarray:
        """Cumulative counters, shape (streamed layers, len(COUNTERS))."""
        return self.streamer.counters()

    @property
    def loaned_bytes(self) -> int:
        return self.streamer.loaned_bytes

    def holds(self, block: int, experts: Sequence[int]) -> list[bool]:
        """Which of these experts are ready in RAM now."""
        return self.streamer.ready(block, experts)
