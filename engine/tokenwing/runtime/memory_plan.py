"""How much memory each part of a session takes: the KV cache (and the context it allows), the compute graph's
reserve, the expert cache's budget (`plan_memory`: with it, whether the KV cache goes to files), and a prompt
pass's working memory against what is free at that moment; a session's plan under its options (`session_memory`).

Every size comes from the model's geometry and what the machine has free under its memory limit (spec §4, §12),
never from a constant for one machine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenwing.errors import BadInputError
from tokenwing.fsutil import human_bytes
from tokenwing.models import family
from tokenwing.models.common import StateSpec
from tokenwing.models.hparams import HParams
from tokenwing.runtime.kvcache import kv_element
from tokenwing.runtime.recurrent import state_bytes
from tokenwing.streaming.memory import HEADROOM, MemoryInfo, expert_budget, memory_info

if TYPE_CHECKING:  # (the session's options and a family's class: only their fields and class methods are read)
    from tokenwing.models.base import MoEModel
    from tokenwing.runtime.session import SessionOptions


def graph_bytes(hp: HParams, max_batch: int, n_ctx: int, states: list[StateSpec | None] | None = None) -> int:
    """The compute graph context's reserve: a batch of `max_batch` tokens through the largest graph (attention
    scores over `n_ctx` positions, router outputs, k experts' intermediate rows, logits), with room to spare.
    A linear-attention layer adds its convolution's window and the intermediates of its projections (about
    twelve values per channel and token), and the delta rule's result: the new state, twice with a snapshot."""
    per_token = 4 * (
        8 * hp.n_embd
        + 3 * hp.n_head * hp.head_dim
        + 4 * hp.n_expert
        + 4 * hp.n_expert_used * max(hp.n_embd, 1)
        + hp.vocab_size
    )
    # A residual state wider than one vector (Kimi K3's checkpoints): a layer's graph holds about eight copies of
    # the part beyond n_embd a token (its input, the state it returns, the checkpoints' norms and products in its
    # two mixes)
    per_token += 4 * 8 * (family(hp.arch).state_width(hp) - hp.n_embd)
    attn = 4 * hp.n_head * max_batch * n_ctx
    linear = 0
    for spec in states or []:
        if spec is not None:
            channels = math.prod(spec.conv[1:])
            linear = max(linear, 4 * (12 * channels * max_batch + 3 * math.prod(spec.state) + spec.elements))
    extra = family(hp.arch).graph_extra_bytes(hp, max_batch, n_ctx)
    return int(max_batch * per_token * 2 + attn + linear + extra + (64 << 20))


@dataclass(frozen=True)
class StatePlan:
    """The recurrent state of linear-attention layers: the live copy, and for prompt caching a snapshot buffer
    and up to `checkpoints` copies (runtime/recurrent.py)."""

    per_copy: int  # bytes of every layer's state
    checkpoints: int
    note: str | None = None

    @property
    def reserved(self) -> int:
        return self.per_copy * (1 + (1 + self.checkpoints if self.checkpoints else 0))

    @classmethod
    def of(cls, specs: list[StateSpec | None], wanted: int, info: MemoryInfo) -> StatePlan:
        """As many checkpoints as wanted, within a 32nd of usable memory (one at least)."""
        per = state_bytes(specs)
        if per == 0:
            return cls(0, 0)
        fits = max(1, info.usable // 32 // per)
        if wanted > fits:
            note = (
                f"prompt caching keeps {fits} recurrent-state checkpoints, not {wanted}: each takes "
                f"{per >> 20} MiB and they may take a 32nd of memory"
            )
            return cls(per, fits, note)
        return cls(per, max(wanted, 0))


@dataclass(frozen=True)
class ContextPlan:
    n_ctx: int
    kv_per_token: int  # bytes of K and V per position, all layers
    note: str | None  # one line when the context had to be capped

    @property
    def kv_bytes(self) -> int:
        return self.kv_per_token * self.n_ctx


def plan_context(
    requested: int, trained: int, kv_per_token: int, weights_bytes: int, graph_mem: int, info: MemoryInfo
) -> ContextPlan:
    """The context length: the one asked for, else the model's own — which the KV cache may then take at most
    half of what is left after the weights; past that, a shorter context (never under 256), with one line."""
    n_ctx = requested or trained
    room = max(info.usable - HEADROOM - graph_mem - weights_bytes, 0) // 2
    if kv_per_token * n_ctx > room and not requested:
        n_ctx = max(256, min(n_ctx, room // max(kv_per_token, 1)))
        return ContextPlan(n_ctx, kv_per_token, f"context capped at {n_ctx} tokens so the KV cache fits in memory")
    return ContextPlan(n_ctx, kv_per_token, None)


# `--parallel auto`: the slots beyond the first may take this fraction of usable memory (1/16: 4 GiB of 64)
EXTRA_SLOTS_SHARE = 16


@dataclass(frozen=True)
class MemoryPlan:
    """A session's memory (`plan_memory`): its context, the compute graph's reserve, the recurrent state's, and
    the expert cache's budget, with the KV cache in files beside the model (`spill`) or in RAM."""

    n_ctx: int  # each sequence's context
    kv_per_token: int  # bytes of K and V per position, all layers
    graph_mem: int  # the compute graph context's reserve (graph_bytes)
    states: StatePlan  # one sequence's recurrent states
    budget: int  # bytes for the expert cache
    spill: str | None  # the folder the KV cache's files go to; None: the cache is in RAM
    info: MemoryInfo  # the memory it was planned for
    notes: tuple[str, ...] = ()  # lines to say as the session starts, in order (the spill's is `spill_note`)
    n_seq: int = 1  # sequences decoded together (the server's slots), each with its own KV cache and states
    also_held: int = 0  # bytes of what else the process keeps (plan_memory's `also_held`: the image encoder)

    @property
    def kv_bytes(self) -> int:
        """Every sequence's KV cache."""
        return self.kv_per_token * self.n_ctx * self.n_seq

    @property
    def states_bytes(self) -> int:
        return self.states.reserved * self.n_seq

    def slots_that_fit(self, weights_bytes: int, most: int) -> int:
        """The server's slot count when none was asked for: sequences with this plan's context and states, at
        least one and at most `most`, as many as fit where `plan_context` lets the KV cache go (half of what is
        left after the weights) — and whose caches beyond the first take at most EXTRA_SLOTS_SHARE of usable
        memory. Every slot's cache is planned beside the expert cache, which gets that much less: one person
        chatting with a model larger than RAM (the common case) must not lose speed for slots nobody uses. A
        context capped to fit memory leaves room for one."""
        room = max(self.info.usable - HEADROOM - self.graph_mem - weights_bytes, 0) // 2
        one = max(self.kv_per_token * self.n_ctx + self.states.reserved, 1)
        extra = self.info.usable // EXTRA_SLOTS_SHARE // one
        return max(1, min(most, room // one, 1 + extra))

    @property
    def spill_note(self) -> str | None:
        """The line to say once the KV cache's files exist."""
        if self.spill is None:
            return None
        seqs = f" in each of {self.n_seq} sequences" if self.n_seq > 1 else ""
        return (
            f"the KV cache for {self.n_ctx} tokens{seqs} ({human_bytes(self.kv_bytes)}) would leave the expert "
            "cache less than its minimum under the memory limit: it is kept in files beside the model, which "
            "the limit can reclaim (slower: attention then reads them back from the drive)"
        )

    def without_spill(self) -> MemoryPlan:
        """The plan when the KV cache's files cannot be made: the cache stays in RAM, and the expert cache is
        planned beside it again."""
        budget = expert_budget(self.info, HEADROOM, self.kv_bytes + self.graph_mem + self.states_bytes + self.also_held)
        return dataclasses.replace(self, spill=None, budget=budget)


def plan_memory(
    hp: HParams,
    kv_per_token: int,
    state_specs: list[StateSpec | None],
    *,
    n_ctx: int,
    max_batch: int,
    checkpoints: int,
    ram_budget: int | None,
    weights_bytes: int,
    least_expert_bytes: int,
    model_dir: str,
    info: MemoryInfo,
    n_seq: int = 1,
    also_held: tuple[tuple[str, int], ...] = (),
) -> MemoryPlan:
    """The memory of a session whose KV cache takes `kv_per_token` bytes a position (the model family's
    `kv_bytes_per_token`) and whose options ask for context `n_ctx` (0: the model's, capped by memory), prompts
    in graphs of `max_batch` tokens, `checkpoints` recurrent-state checkpoints and `ram_budget` bytes for the
    expert cache (None: what is left of `info` beside the rest). `least_expert_bytes`: the streaming core's
    minimum slots (plan_slots). When the KV cache in RAM would leave the expert cache less than that, it is kept
    in files in `model_dir` (its pages are reclaimable: the expert cache is planned without it). `n_seq`
    sequences (the server's slots) each have a KV cache of the context and their own recurrent states.
    `also_held`: (what, bytes) the process keeps beside the model and plans like the resident weights (the image
    encoder's weights and its compute buffer for the largest image: vision/device.py; Session.describe names
    them)."""
    graph_mem = graph_bytes(hp, max_batch, n_ctx or hp.n_ctx_train, state_specs)
    states = StatePlan.of(state_specs, checkpoints, info)
    other = sum(n for _, n in also_held)
    held = weights_bytes + states.reserved * n_seq + other
    # (the graph's memory cannot go to a file as the KV cache can; where even the least context's graph does not
    # fit, --ctx is not the cause: the model's own fields are named below)
    if n_ctx and graph_mem > info.usable and graph_bytes(hp, max_batch, 256, state_specs) <= info.usable:
        raise BadInputError(
            f"--ctx {n_ctx} needs a compute graph of {human_bytes(graph_mem)}, more than the "
            f"{human_bytes(info.usable)} this machine can use"
        )
    ctx = plan_context(n_ctx, hp.n_ctx_train, kv_per_token * n_seq, held, graph_mem, info)
    if ctx.n_ctx < (n_ctx or hp.n_ctx_train):
        # A context capped to fit: its graph is smaller too (the model's own context_length may be millions of
        # positions, whose attention reserve no machine has: a graph sized from it was asked of the OS and failed)
        n = _context_that_fits(hp, max_batch, state_specs, kv_per_token * n_seq, held, info)
        graph_mem = graph_bytes(hp, max_batch, n, state_specs)
        ctx = plan_context(n, n, kv_per_token * n_seq, held, graph_mem, info)
        ctx = dataclasses.replace(ctx, note=f"context capped at {ctx.n_ctx} tokens so the KV cache fits in memory")
    graph_what = (
        f"the compute graph (batches of {max_batch} tokens; attention.head_count {hp.n_head} over "
        f"{ctx.n_ctx:,} positions, embedding_length {hp.n_embd:,}, expert_used_count {hp.n_expert_used}, "
        f"a vocabulary of {hp.vocab_size:,})"
    )
    refuse_beyond_machine(
        {
            RESIDENT_WEIGHTS: weights_bytes,
            graph_what: graph_mem,
            f"the recurrent state of {n_seq} sequence(s) (its ssm.* and kda.* sizes)": states.reserved * n_seq,
            **dict(also_held),
        },
        info,
    )
    notes = tuple(note for note in (states.note, ctx.note) if note)
    budget, spill = ram_budget, None
    if budget is None:
        # (the resident weights are in `info.used` already, loaded before it was measured; what `also_held`
        # names is not yet: it is taken off here)
        budget = expert_budget(info, HEADROOM, ctx.kv_bytes + graph_mem + states.reserved * n_seq + other)
        if budget < least_expert_bytes and ctx.kv_bytes:  # the context asked for does not fit beside the minimum
            spill = model_dir
            budget = expert_budget(info, HEADROOM, graph_mem + states.reserved * n_seq + other)
    return MemoryPlan(ctx.n_ctx, kv_per_token, graph_mem, states, budget, spill, info, notes, n_seq, other)


RESIDENT_WEIGHTS = "the resident weights (the file's tensors other than its routed experts)"


def refuse_beyond_machine(parts: dict[str, int], info: MemoryInfo) -> None:
    """Refuses in one line, naming the largest part and what sized it, a session whose parts held in RAM
    whatever else is planned (`parts`: what → bytes) need more memory than this machine has at all: its RAM, or
    its memory limit. Asked of the OS, such a size (from a file's header, its numbers checked one by one) was an
    OOM kill or ggml's abort, not a line. What is only not free at the moment is the plan's to fit (a context
    capped, the KV cache in files); this refuses nothing that could run."""
    total = sum(parts.values())
    if total <= info.limit:
        return
    what, most = max(parts.items(), key=lambda item: item[1])
    raise BadInputError(
        f"the model needs {human_bytes(total)} of memory before any expert or KV cache, more than the "
        f"{human_bytes(info.limit)} this machine has: {human_bytes(most)} of it for {what}"
    )


def _context_that_fits(
    hp: HParams, max_batch: int, specs: list[StateSpec | None], kv_per_token: int, held: int, info: MemoryInfo
) -> int:
    """The longest context (256 at least, the model's at most) whose KV cache takes at most half of what is left
    beside the weights and its own compute graph (plan_context's rule, with the graph sized for that context)."""

    def fits(n: int) -> bool:
        room = max(info.usable - HEADROOM - graph_bytes(hp, max_batch, n, specs) - held, 0) // 2
        return kv_per_token * n <= room

    lo, hi = 256, max(hp.n_ctx_train, 256)
    if not fits(lo):
        return lo
    while lo < hi:  # (graph and KV cache grow with the context: the largest n that fits, by bisection)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def prompt_bytes_per_token(hp: HParams, shared: bool, state: int = 0, experts: int = 0) -> int:
    """Working memory of a prompt pass beyond the graph context, per token: the residual state (`state` floats,
    n_embd by default; it becomes the attention output plus residual), the FFN input, the running sum of the
    experts' outputs (in F64: two floats) and its F32 result (at the experts' width, n_embd by default), the
    shared expert's output, router probabilities and their top-k sort, and a wave's (token, expert) index arrays
    (`PromptMemory.bytes` adds a quarter for numpy's temporaries)."""
    state, experts = state or hp.n_embd, experts or hp.n_embd
    floats = state + 4 * experts + (hp.n_embd if shared else 0) + 3 * hp.n_expert + 2 * hp.n_expert_used
    return 4 * floats + 64 * hp.n_expert_used


@dataclass
class PromptMemory:
    """What a prompt pass may take. Memory promised but not yet touched (the KV cache past the positions written
    so far, the graph context) is not charged yet, so it is counted against what is free; without this a long
    first prompt under a cap was OOM-killed (measured: 4,096 tokens at 25 %)."""

    per_token: int  # prompt_bytes_per_token
    reserve: int  # covered by the graph context's reserve: a batch of max_batch tokens
    kv_per_token: int
    n_ctx: int
    graph_mem: int
    cache_capacity: int  # bytes of the expert cache when every slot is filled
    override: int | None = None  # a fixed free memory (tests, benchmarks): SessionOptions.prompt_memory
    states: StatePlan = StatePlan(0, 0)  # recurrent-state checkpoints are copied as prompts take them

    def bytes(self, n: int) -> int:
        return n * self.per_token * 5 // 4  # + a quarter for numpy's temporaries

    def free_room(self, kv_high: int, cache_filled: int, loaned: int, checkpoints_held: int = 0) -> int:
        """Free memory under the limit, less the part of the expert cache not filled yet (it will be as the
        prompt reads experts) and what is promised but not yet touched (KV positions, state checkpoints)."""
        if self.override is not None:
            return self.override
        promised = self.kv_per_token * (self.n_ctx - kv_high) + self.graph_mem
        promised += self.states.per_copy * max(0, self.states.checkpoints - checkpoints_held)
        unfilled = self.cache_capacity - min(self.cache_capacity, cache_filled) - loaned
        return max(0, expert_budget(memory_info(), HEADROOM, promised) - unfilled)

    def span(self, free: int, lendable: int, loaned: int, min_tokens: int) -> int:
        """The longest prompt pass whose working memory fits: free memory plus what the cache can lend."""
        return max(min_tokens, (free + self.reserve + lendable - loaned) // self.bytes(1))

    def to_borrow(self, n: int, free: int) -> int:
        """Bytes a pass of n tokens needs beyond its reserve and the free memory (slots to borrow)."""
        return self.bytes(n) - self.reserve - free


AUTO_PARALLEL = 4  # slots when none are asked for (llama.cpp's server starts 4 too), if memory holds them


def session_memory(
    model_class: type[MoEModel],
    hp: HParams,
    state_specs: list[StateSpec | None],
    weights_bytes: int,
    opts: SessionOptions,
    info: MemoryInfo,
    n_seq: int,
    least_expert_bytes: int = 0,
    model_dir: str = "",
) -> MemoryPlan:
    """A session's memory plan for `n_seq` sequences (0: as many slots as memory holds, each with the context
    one would get, at most AUTO_PARALLEL; `MemoryPlan.slots_that_fit`) under `opts`: Session plans by it, and
    `tokenwing info MODEL` gives the server's slots by it before any weight is loaded."""

    def plan(n: int, n_ctx: int) -> MemoryPlan:
        return plan_memory(
            hp,
            model_class.kv_bytes_per_token(hp, kv_element(opts.kv_type)[1]),
            state_specs,
            n_ctx=n_ctx,
            max_batch=opts.max_batch,
            checkpoints=opts.state_checkpoints if opts.prompt_cache else 0,
            ram_budget=opts.ram_budget,
            weights_bytes=weights_bytes,
            least_expert_bytes=least_expert_bytes,
            model_dir=model_dir,
            info=info,
            n_seq=n,
            also_held=opts.also_held,
        )

    memory = plan(max(n_seq, 1), opts.n_ctx)
    if n_seq == 0:
        n = memory.slots_that_fit(weights_bytes + memory.also_held, AUTO_PARALLEL)
        if n > 1:
            memory = plan(n, memory.n_ctx)
    return memory
