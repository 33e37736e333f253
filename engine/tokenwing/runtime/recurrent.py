"""The recurrent state of linear-attention layers (beside the KV cache), and its checkpoints for prompt caching.

A linear-attention layer keeps one state per sequence — the last inputs of its short convolution and the delta
rule's matrices — updated in place by every graph that runs the layer: the prompt's chunks in order (layer-major,
so each layer's state runs through the whole prompt before the next layer's), then each decode step.

Unlike a KV cache, the state cannot be cut back to a shorter prefix, so prompt caching keeps checkpoints: copies of
every layer's state at a position. `Session` takes them at chunk ends every `interval` tokens of a prompt, and at
one token before a prompt's end (the graph of the prompt's last chunk writes that state too); a later request
resumes from the longest checkpoint its prompt starts with, or from the live state when the prompt continues the
conversation. A checkpoint is valid while the KV cache holds the tokens before it, so those past a request's
divergence are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenwing.compute.ggml_lib import F32, TensorArena, aligned_bytes
from tokenwing.models.common import RecurrentCache, StateSpec


class StateBuffers:
    """Every linear-attention layer's state (convolution inputs, delta-rule matrices) in memory we own, as
    tensors the layer graphs read and write."""

    def __init__(self, arena: TensorArena, specs: list[StateSpec | None]) -> None:
        self.layers: dict[int, RecurrentCache] = {}
        self.arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # float32 views of the same memory
        self.bytes = 0
        for il, spec in enumerate(specs):
            if spec is None:
                continue
            conv, state = _floats(spec.conv), _floats(spec.state)
            self.arrays[il] = (conv, state)
            self.layers[il] = RecurrentCache(arena.wrap(conv, F32, spec.conv), arena.wrap(state, F32, spec.state))
            self.bytes += conv.nbytes + state.nbytes

    def zero(self) -> None:
        for conv, state in self.arrays.values():
            conv.fill(0.0)
            state.fill(0.0)

    def copy_layer_to(self, il: int, dst: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        conv, state = self.arrays[il]
        if il not in dst:
            dst[il] = (np.empty_like(conv), np.empty_like(state))
        np.copyto(dst[il][0], conv)
        np.copyto(dst[il][1], state)

    def load(self, src: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        for il, (conv, state) in self.arrays.items():
            np.copyto(conv, src[il][0])
            np.copyto(state, src[il][1])


def _floats(shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    return aligned_bytes(4 * n)[: 4 * n].view(np.float32)


def state_bytes(specs: list[StateSpec | None]) -> int:
    """Bytes of one copy of every layer's state (the live one, the prompt-end snapshot, each checkpoint)."""
    return sum(4 * s.elements for s in specs if s is not None)


@dataclass
class Checkpoint:
    pos: int  # the tokens the state has seen (the KV cache positions before it)
    layers: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


class Checkpoints:
    """At most `capacity` copies of the state at positions of the current history, taken during prompts."""

    def __init__(self, live: StateBuffers, snapshot: StateBuffers, capacity: int, interval: int) -> None:
        self.live, self.snapshot = live, snapshot
        self.capacity, self.interval = capacity, interval
        self.saved: list[Checkpoint] = []  # by position
        self._pending: dict[int, Checkpoint] = {}  # being filled, layer by layer, by the prompt under way

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 and bool(self.live.layers)

    def boundaries(self, pos0: int, n: int) -> list[int]:
        """Interval positions strictly inside a pass of n tokens from pos0 (chunks end there)."""
        if not self.enabled or self.interval <= 0:
            return []
        first = (pos0 // self.interval + 1) * self.interval
        return [p for p in range(first, pos0 + n, self.interval) if not self.has(p)]

    @property
    def held(self) -> int:
        """Copies in memory (saved, and being filled)."""
        return len(self.saved) + len(self._pending)

    def has(self, pos: int) -> bool:
        return any(c.pos == pos for c in self.saved)

    def record(self, il: int, pos: int) -> None:
        """Layer il's live state has just seen `pos` tokens: copy it into the checkpoint of that position."""
        cp = self._pending.setdefault(pos, Checkpoint(pos))
        self.live.copy_layer_to(il, cp.layers)

    def record_snapshot(self, il: int, pos: int) -> None:
        """Layer il's snapshot buffer holds the state after `pos` tokens (one before the prompt's end)."""
        cp = self._pending.setdefault(pos, Checkpoint(pos))
        self.snapshot.copy_layer_to(il, cp.layers)

    def commit(self) -> None:
        """The pass finished: its checkpoints (every layer recorded) join the saved ones."""
        for pos, cp in sorted(self._pending.items()):
            if len(cp.layers) == len(self.live.layers) and not self.has(pos):
                self.saved.append(cp)
        self._pending.clear()
        self.saved.sort(key=lambda c: c.pos)
        while len(self.saved) > self.capacity:
            self._thin()

    def abandon(self) -> None:
        self._pending.clear()

    def _thin(self) -> None:
        """Drops the checkpoint closest to the one before it (never the newest): the rest stay spread out."""
        if len(self.saved) == 1:
            self.saved.clear()
            return
        gaps = [self.saved[i].pos - (self.saved[i - 1].pos if i else 0) for i in range(len(self.saved) - 1)]
        del self.saved[int(np.argmin(gaps))]

    def best(self, limit: int) -> Checkpoint | None:
        """The saved checkpoint furthest along at or before `limit`."""
        found = [c for c in self.saved if c.pos <= limit]
        return found[-1] if found else None

    def drop_after(self, pos: int) -> None:
        """Forgets the checkpoints past `pos` (the KV cache no longer holds the tokens before them)."""
        self.saved = [c for c in self.saved if c.pos <= pos]

    def clear(self) -> None:
        self.saved.clear()
        self._pending.clear()

    def restore(self, cp: Checkpoint) -> None:
        self.live.load(cp.layers)
