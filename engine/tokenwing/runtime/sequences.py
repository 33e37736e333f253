"""A session's sequences (the server's slots): each one's KV cache and recurrent states with their checkpoints,
position and history (`SeqState`), built as the memory plan says (`new_sequences`), and what `forward` reads and
writes of the one it computes for (`SequenceState`, which `Session` is): rewinding to a cached prefix, advancing
past a pass's tokens. The memory plan (runtime/memory_plan.py) and the passes (runtime/passes.py) live apart."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenwing.compute.ggml_lib import TensorArena
from tokenwing.models import common
from tokenwing.runtime.kvcache import KVCaches, KVStacks
from tokenwing.runtime.memory_plan import StatePlan
from tokenwing.runtime.recurrent import Checkpoints, StateBuffers
from tokenwing.runtime.scheduler import ExpertScheduler

if TYPE_CHECKING:
    from tokenwing.vision.prompt import MediaPrompt

# A spilled KV cache is written back every this many decode positions: at most this many positions' pages are
# dirty (unreclaimable) at a time, and a write-back walks the whole mapping (cheap when little is dirty).
SPILL_WRITE_BACK = 32


@dataclass
class SeqState:
    """One sequence's state (a server slot): its KV cache and recurrent states with their checkpoints, and the
    tokens in them. The session computes for one at a time (`Session.use`), or for several in one decode step
    (runtime/batch.py)."""

    kv: KVCaches
    checkpoints: Checkpoints
    pos: int = 0
    kv_high: int = 0  # KV positions ever written (their memory is touched, hence charged)
    history: list[int] = field(default_factory=list)  # the tokens whose keys and values are in the cache
    state_dirty: bool = False  # a failed pass left the recurrent state half-updated
    # the images in its history (vision/prompt.py): their rows' inputs and positions, and the text's positions
    # after them, for every pass over this sequence while its history holds them (the server's slots keep theirs)
    media: MediaPrompt | None = None


# The session's counters per streamed layer: the streaming core's (RAM and drive), then the VRAM tier's.


def new_sequences(
    arena: TensorArena,
    specs: list[common.KVSpec],
    state_specs: list[common.StateSpec | None],
    n_ctx: int,
    kv_type: str,
    states: StatePlan,
    interval: int,
    n: int,
    spill: str | None,
) -> list[SeqState]:
    """`n` sequences' caches and states in `arena` (`spill`: the folder their KV caches' files go to)."""

    def sequence(stacks: KVStacks | None) -> SeqState:
        live = StateBuffers(arena, state_specs) if states.per_copy else None
        snapshot = StateBuffers(arena, state_specs) if live is not None and states.checkpoints else None
        kv = KVCaches(arena, specs, n_ctx, kv_type, live, spill, stacks)
        empty = StateBuffers(arena, [])
        return SeqState(kv, Checkpoints(live or empty, snapshot or empty, states.checkpoints, interval))

    # several slots' caches side by side, so that a batch's attention is one product (runtime/batch.py)
    stacks = KVStacks(arena, specs, n_ctx, kv_type, n, spill) if n > 1 else None
    return [sequence(stacks) for _ in range(n)]


class SequenceState:
    """The current sequence's state as the session's own (`Session.use` picks it)."""

    seqs: list[SeqState]
    _seq: SeqState
    scheduler: ExpertScheduler

    # ------------------------------------------------------------------------------------------ sequences
    # What `forward` reads and writes is the current sequence's (`use`): its cache, checkpoints, position and
    # history. One sequence (the CLI, a 1-slot server) is what the session always was.
    @property
    def kv(self) -> KVCaches:
        return self._seq.kv

    @property
    def checkpoints(self) -> Checkpoints:
        return self._seq.checkpoints

    @property
    def pos(self) -> int:
        return self._seq.pos

    @pos.setter
    def pos(self, value: int) -> None:
        self._seq.pos = value

    @property
    def history(self) -> list[int]:
        return self._seq.history

    @history.setter
    def history(self, value: list[int]) -> None:
        self._seq.history = value

    @property
    def media(self) -> MediaPrompt | None:
        return self._seq.media

    @media.setter
    def media(self, value: MediaPrompt | None) -> None:
        self._seq.media = value

    @property
    def _state_dirty(self) -> bool:
        return self._seq.state_dirty

    @_state_dirty.setter
    def _state_dirty(self, value: bool) -> None:
        self._seq.state_dirty = value

    @property
    def n_seq(self) -> int:
        """Sequences this session holds (the server's slots)."""
        return len(self.seqs)

    def reset(self) -> None:
        self._rewind(0)

    def reuse_prefix(self, tokens: list[int]) -> int:
        """Prompt caching: keeps the cached tokens this prompt starts with and forgets the rest. Returns how many
        are kept (at most all but the last token, which must run to give logits); evaluate `tokens[kept:]`.

        A chat's next turn repeats the whole conversation: only the new part is computed. The cache holds
        exactly what a fresh pass would have put there (attention reads positions < pos only). A linear-attention
        layer's state cannot be cut back: the prompt resumes from the live state if it continues the history,
        else from the longest checkpoint it starts with (runtime/recurrent.py).
        """
        limit = min(len(tokens) - 1, len(self.history))
        kept = 0
        while kept < limit and self.history[kept] == tokens[kept]:
            kept += 1
        return self._rewind(kept)

    def _rewind(self, kept: int) -> int:
        """Keeps the first `kept` tokens of the history, or fewer where the recurrent state has no checkpoint;
        returns how many."""
        if self.kv.states is not None and (kept < len(self.history) or self._state_dirty):
            self._state_dirty = False
            cp = self.checkpoints.best(kept)
            if cp is None:
                kept = 0
                self.kv.states.zero()
            else:
                kept = cp.pos
                self.checkpoints.restore(cp)
        self.checkpoints.drop_after(kept)
        self.pos = kept
        del self.history[kept:]
        return kept

    def _advance(self, tokens: list[int]) -> None:
        if self.kv.spilled and self.pos // SPILL_WRITE_BACK != (self.pos + len(tokens)) // SPILL_WRITE_BACK:
            self.kv.write_back()
        self.pos += len(tokens)
        self._seq.kv_high = max(self._seq.kv_high, self.pos)
        self.history.extend(tokens)
        self.scheduler.usage.tokens += len(tokens)
