"""A loaded model and its state: the forward pass over the layers, with the experts streamed and predicted.

Per layer: one graph for the family's layer (attention, FFN norm, shared expert, router and top-k) and the
lookahead routers of the next streamed layers; the selected experts go to the scheduler (demand reads), the
lookahead's top-k as predictions; then the experts are computed where the core put them (runtime/experts.py),
and their sum, the shared expert and the residual make the layer's output. A prompt passes the whole layer
before the next starts (layer-major), so each layer's experts are read at most once per prompt. With every
expert in RAM a decode step is one graph (runtime/token_graph.py).

The session knows no family by name: `models/<arch>.py` builds the layer graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwing.compute.backend import DeviceError
from tokenwing.compute.devices import DeviceChoice
from tokenwing.compute.ggml_lib import Graph, Tensor, to_numpy
from tokenwing.errors import BadInputError
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import human_bytes
from tokenwing.models import common
from tokenwing.models.base import MoEModel
from tokenwing.models.hparams import HParams
from tokenwing.models.weights import ModelWeights, resident_bytes
from tokenwing.runtime.experts import ExpertCompute, ExpertPools
from tokenwing.runtime.kvcache import KVCaches, KVStacks, kv_element, v_width
from tokenwing.runtime.lookahead import Ahead, Lookahead
from tokenwing.runtime.memory_plan import (
    RESIDENT_WEIGHTS,
    MemoryPlan,
    PromptMemory,
    plan_memory,
    prompt_bytes_per_token,
    refuse_beyond_machine,
)
from tokenwing.runtime.preflight import preflight
from tokenwing.runtime.recurrent import Checkpoints, StateBuffers
from tokenwing.runtime.scheduler import ExpertScheduler
from tokenwing.runtime.token_graph import TokenGraph
from tokenwing.runtime.vram.tier import VramOptions, VramTier
from tokenwing.runtime.vram.weights import Place
from tokenwing.runtime.vram_experts import COUNTERS as VRAM_COUNTERS
from tokenwing.streaming.memory import MemoryInfo, memory_info
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS, plan_slots
from tokenwing.streaming.trace import Trace
from tokenwing.text.tokenizer import TextTokenizer

# A spilled KV cache is written back every this many decode positions: at most this many positions' pages are
# dirty (unreclaimable) at a time, and a write-back walks the whole mapping (cheap when little is dirty).
SPILL_WRITE_BACK = 32


@dataclass
class SessionOptions:
    ram_budget: int | None = None  # bytes for the expert cache; None: from free RAM and the memory limit
    lookahead: int = 2  # router lookahead distance (0: off)
    n_ctx: int = 0  # 0: the model's context length, capped by memory
    kv_type: str = "f16"
    n_threads: int = 0  # 0: the cores this process may use
    max_batch: int = 64  # prompt tokens per graph (longer prompts are split, never refused)
    # sequences decoded together (the server's slots, runtime/batch.py), each with its own KV cache; 0: as many as
    # memory holds with the context one would get, at most AUTO_PARALLEL
    parallel: int = 1
    prompt_memory: int | None = None  # free memory a prompt pass may take beyond the cache (None: measured)
    prompt_cache: bool = True  # the server keeps the previous request's KV cache for a shared prefix
    state_checkpoints: int = 8  # linear-attention models: recurrent-state checkpoints kept for prompt caching
    checkpoint_interval: int = 1024  # ... one every this many prompt tokens (rounded to max_batch), and one per prompt
    usage_table: bool = True  # seed idle fill from MODEL.usage.json and add this session's counts to it
    preload: bool | None = None  # read every expert at start (None: when the cache holds them all)
    cpu_repack: bool = True  # matrix weights and experts in ggml's repacked layouts, as llama.cpp runs them
    token_graph: bool = True  # with every expert in RAM, a decode step is one graph (runtime/token_graph.py)
    # "flash": F32 tiled flash attention for prompts (models/common.attend), or "products": two matrix products
    prompt_attention: str = "flash"
    stream: StreamSettings = field(default_factory=StreamSettings)
    device: DeviceChoice | None = None  # where to compute (compute/devices.py `choose`); None: the CPU
    vram: VramOptions = field(default_factory=VramOptions)


AUTO_PARALLEL = 4  # slots when none are asked for (llama.cpp's server starts 4 too), if memory holds them


def session_memory(
    model_class: type[MoEModel],
    hp: HParams,
    state_specs: list[common.StateSpec | None],
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
        )

    memory = plan(max(n_seq, 1), opts.n_ctx)
    if n_seq == 0:
        n = memory.slots_that_fit(weights_bytes, AUTO_PARALLEL)
        if n > 1:
            memory = plan(n, memory.n_ctx)
    return memory


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


# The session's counters per streamed layer: the streaming core's (RAM and drive), then the VRAM tier's.
SESSION_COUNTERS: list[str] = [*COUNTERS, *VRAM_COUNTERS]

Log = Callable[[str], None]
Parts = dict[str, np.ndarray]  # a layer graph's results by name (common.Routed's fields, "ahead", or "out")


def _put(r: Parts, key: str, v: np.ndarray, h: np.ndarray, c: slice) -> None:
    """A chunk's result into the prompt-long array of its name (the layer output or residual replaces h in place)."""
    if key not in r:
        r[key] = h if key in ("residual", "out") else np.empty((h.shape[0], v.shape[1]), v.dtype)
    r[key][c] = v


def _stderr(line: str) -> None:
    print(f"tokenwing: {line}", file=sys.stderr)


class Session:
    def __init__(self, path: str, options: SessionOptions | None = None, log: Log = _stderr) -> None:
        self.options = opts = options or SessionOptions()
        self.log = log
        self.mf = ModelFile.open(path)
        self.mf.verify()  # sample experts against their checksums: a corrupt file stops here
        pre = preflight(self.mf)  # what `tokenwing verify` checks too (resident tensors: as they load)
        self.meta, model_class, widths = pre.meta, pre.model_class, pre.widths
        hp = pre.hp
        self.hp: HParams = hp
        self.tokenizer: TextTokenizer = pre.tokenizer
        self.chat_template = pre.chat_template
        streamed = sorted(layer for layer in widths if layer < hp.n_layer)
        # KV caches or recurrent states (live and prompt-end snapshot), lookahead routers, slot-pool views
        gpu = opts.device is not None and opts.device.device is not None
        n_seq = max(opts.parallel, 0)
        if gpu and n_seq != 1:
            # (the tier's device-side KV cache and graphs are one sequence's)
            log("one sequence at a time: the VRAM tier keeps one KV cache on the device (--parallel is the CPU's)")
            n_seq = 1
        n_tensors = 5 * hp.n_layer + 3 * len(streamed) + 4 * hp.n_layer * (max(n_seq, AUTO_PARALLEL) - 1)
        n_tensors += 2 * hp.n_layer  # (the slots' stacked K and V)
        lazy = model_class.lazy_tensors(hp)
        # (before they are asked of the OS: resident weights no machine of this size holds are one line, not an
        # OOM kill halfway through loading them; plan_memory checks them again beside the graph and states)
        loaded = resident_bytes(t for t in self.mf.resident if t.name not in lazy)
        refuse_beyond_machine({RESIDENT_WEIGHTS: loaded}, memory_info())
        weights = ModelWeights(self.mf, n_tensors + 64, opts.cpu_repack, lazy)
        self.model: MoEModel = model_class(hp, weights, streamed)

        specs = [self.model.kv_spec(il) for il in range(hp.n_layer)]
        state_specs = [self.model.state_spec(il) for il in range(hp.n_layer)]
        info = memory_info()

        least = plan_slots(self.mf.index, 0, hp.n_expert_used, streamed).bytes
        model_dir = os.path.dirname(os.path.abspath(self.mf.path))
        memory = session_memory(model_class, hp, state_specs, weights.bytes, opts, info, n_seq, least, model_dir)
        for note in memory.notes:
            log(note)
        self.n_ctx = memory.n_ctx
        states = memory.states
        interval = -(-max(opts.checkpoint_interval, 1) // opts.max_batch) * opts.max_batch  # chunks end there

        def sequence(spill: str | None, stacks: KVStacks | None) -> SeqState:
            live = StateBuffers(weights.arena, state_specs) if states.per_copy else None
            snapshot = StateBuffers(weights.arena, state_specs) if live is not None and states.checkpoints else None
            kv = KVCaches(weights.arena, specs, self.n_ctx, opts.kv_type, live, spill, stacks)
            empty = StateBuffers(weights.arena, [])
            return SeqState(kv, Checkpoints(live or empty, snapshot or empty, states.checkpoints, interval))

        def sequences(spill: str | None) -> list[SeqState]:
            # several slots' caches side by side, so that a batch's attention is one product (runtime/batch.py)
            n = memory.n_seq
            stacks = KVStacks(weights.arena, specs, self.n_ctx, opts.kv_type, n, spill) if n > 1 else None
            return [sequence(spill, stacks) for _ in range(n)]

        try:
            self.seqs = sequences(memory.spill)
        except OSError as e:
            log(f"the KV cache stays in RAM: no room for its files in {memory.spill} ({e.strerror or e})")
            memory = memory.without_spill()
            self.seqs = sequences(None)
        self._seq = self.seqs[0]
        self.slot = 0  # the sequence `forward` computes for (`use`)
        if memory.spill_note is not None:
            log(memory.spill_note)
        self._v_width = v_width(specs)
        self.scheduler = ExpertScheduler(
            self.mf,
            streamed,
            hp.n_expert_used,
            self.model.share_expert_budget(memory.budget),
            opts.stream,
            opts.preload,
            opts.usage_table,
            log,
        )
        self.lookahead = Lookahead(self.model, opts.lookahead)
        self.vram: VramTier | None = None
        self.device_line: str | None = None  # where this session computes, when a device was chosen (one line)
        self._vram_final: np.ndarray | None = None  # the tier's counters when it was dropped
        self._specs = specs
        # Experts are repacked only when they are all read at start: repacking each streamed expert as it lands
        # costs ~0.9 ms of CPU per expert, which took 40 % of capped decode speed on a 2-core machine
        # (docs/results.md). (The debug mode that checksums delivered experts needs them as in the file; the
        # VRAM tier copies them from RAM to the GPU as the file has them.)
        repack_experts = opts.cpu_repack and self.scheduler.preloaded and not opts.stream.verify and not gpu
        self.pools = ExpertPools(self.scheduler, weights.arena, repack_experts)
        self._token_graph: TokenGraph | None = None
        self._token_graph_on = opts.token_graph and not model_class.position_graphs
        # several sequences' decode step as one graph (runtime/batch.py), for the slots and windows it was built for
        self.batch_graph: tuple[tuple[object, ...], TokenGraph] | None = None
        self.rows_ok: dict[int, bool] = {}  # n sequences' tokens may share the dense products (batch.rows_batch)
        self.scheduler.on_slot_map_change = self._drop_graphs
        self.scheduler.start()
        if gpu:
            self._start_vram()
        n_threads = opts.n_threads or len(os.sched_getaffinity(0))
        self.graph = Graph(memory.graph_mem, n_threads)
        ffn = {il: self.model.expert_ffn(il) for il in streamed}
        self.experts = ExpertCompute(self.scheduler, self.pools, self.graph, opts.max_batch, ffn)
        shared = any("ffn_gate_shexp" in w for w in self.model.w)
        expert_width = max((self.model.expert_width(hp, il) for il in streamed), default=0)
        per_token = prompt_bytes_per_token(hp, shared, self.model.state_width(hp), expert_width)
        self.prompt_memory = PromptMemory(
            per_token,
            opts.max_batch * per_token * 5 // 4,  # a batch's working memory is covered by the graph reserve
            # every sequence's (a spilled cache's pages are reclaimable, never promised); `_free_room` passes the
            # sequences' mean written positions, so what is promised is the sum of each one's unwritten rest
            0 if self.kv.spilled else memory.kv_per_token * memory.n_seq,
            self.n_ctx,
            memory.graph_mem,
            self.scheduler.capacity,
            opts.prompt_memory,
            states,
        )
        self._cuts: list[int] = []  # a prompt pass's checkpoint positions (where chunks end)
        self._snap_at: int | None = None  # the position a prompt's last chunk also keeps the state of
        self.trace: list[tuple[np.ndarray, np.ndarray, int]] | None = None
        self._warned_prompt = False
        self._prompt_memory_held = False  # a prompt pass ran since the last decode step (`Graph.release`)
        self._known: dict[int, list[int]] = {}  # this decode token's layers whose experts its id decides

    def _start_vram(self) -> None:
        """The VRAM tier on the chosen device; a device that fails or a budget that holds nothing: the CPU path,
        with one line saying why."""
        choice = self.options.device
        assert choice is not None
        try:
            self.vram = VramTier(
                choice,
                self.mf,
                self.model,
                self.model.weights,
                self.lookahead,
                self.scheduler,
                self._specs,
                self.n_ctx,
                self.options.kv_type,
                self.options.max_batch,
                self._layer_graph,
                self.log,
                self.options.vram,
            )
        except DeviceError as e:
            self.device_line = f"computing on the CPU: {e}"
            return
        self.device_line = f"{choice.reason}; in VRAM: {self.vram.plan.describe()}"
        self._token_graph_on = False  # (a decode step as one graph is the CPU's: the tier places its own parts)

    def _drop_vram(self, error: Exception, seen: list[int]) -> None:
        """The device failed mid-run: the CPU computes from here on. Its KV cache positions were on the device,
        so the tokens `seen` before the failed call are computed again on the CPU (the same result, rounding
        aside)."""
        assert self.vram is not None
        self.log(f"the GPU failed ({error}): computing on the CPU from here on")
        got = self.vram.counters()
        self._vram_final = None if got is None else got.copy()
        with contextlib.suppress(Exception):  # a failed device may fail to free too; the CPU needs nothing of it
            self.vram.close()
        self.vram = None
        self._token_graph_on = self.options.token_graph and not self.model.position_graphs
        self._rewind(0)
        if seen:
            self._forward(seen, False, snapshot=True, prompt=True)

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
    def _state_dirty(self) -> bool:
        return self._seq.state_dirty

    @_state_dirty.setter
    def _state_dirty(self, value: bool) -> None:
        self._seq.state_dirty = value

    @property
    def n_seq(self) -> int:
        """Sequences this session holds (the server's slots)."""
        return len(self.seqs)

    def use(self, slot: int) -> None:
        """`forward`, `reuse_prefix` and `reset` act on this sequence from now on."""
        if slot != self.slot:
            self._drop_token_graph()  # (built over one sequence's KV cache)
            self.slot, self._seq = slot, self.seqs[slot]

    # ---------------------------------------------------------------------------------------- what it holds
    @property
    def streamed(self) -> list[int]:
        """The layers whose routed experts are streamed, in order."""
        return self.model.streamed

    @property
    def slots_per_layer(self) -> int:
        return self.scheduler.slots_per_layer

    def counters(self) -> np.ndarray:
        """Cumulative counters, shape (streamed layers, len(SESSION_COUNTERS)): the streaming core's (RAM and
        drive), then the VRAM tier's (zero without one)."""
        core = self.scheduler.counters()
        vram = self.vram.counters() if self.vram is not None else None
        if vram is None:
            vram = self._vram_final if self._vram_final is not None else np.zeros((core.shape[0], len(VRAM_COUNTERS)))
        return np.concatenate([core, vram.astype(core.dtype)], axis=1)

    def save_usage(self) -> None:
        """Adds this session's expert counts to the usage table next to the model (the server: after each request)."""
        self.scheduler.save_usage()

    def close(self) -> None:
        self.save_usage()
        self._drop_graphs()
        if self.vram is not None:
            self.vram.close()
            self.vram = None
        self.scheduler.close()
        self.graph.close()
        self.mf.close()

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

    # ------------------------------------------------------------------------------------------- forward
    def forward(
        self, tokens: list[int], all_logits: bool = False, prompt: bool = False, end: bool = True
    ) -> np.ndarray:
        """Runs `tokens` from the current position; returns logits of the last token (or of every token). One token
        is a decode step unless `prompt` says it is (the rest of a prompt whose start was cached): prompt tokens
        attend the same way however the prompt is split.

        Layer-major: the whole prompt passes one layer before the next, so each layer's experts are read at
        most once per prompt (in waves that fit the slots); attention and expert graphs run in chunks of
        `max_batch` tokens, so a long prompt is split, never refused. A GPU that fails on the way leaves the
        CPU to compute (`_drop_vram`), never the run failing. `end`: False for a part of a prompt that more
        parts follow (the server's, between decode steps of other sequences): no checkpoint at its end.
        """
        if self.vram is None:
            return self._forward_all(tokens, all_logits, prompt, end)
        seen = list(self.history)  # (a long prompt runs in parts: those done already are computed again too)
        try:
            return self._forward_all(tokens, all_logits, prompt, end)
        except DeviceError as e:
            self._drop_vram(e, seen)
            return self._forward_all(tokens, all_logits, prompt, end)

    def _forward_all(self, tokens: list[int], all_logits: bool, prompt: bool, end: bool = True) -> np.ndarray:
        hp, n = self.hp, len(tokens)
        if not tokens:
            raise BadInputError("nothing to evaluate")
        if any(not 0 <= t < hp.vocab_size for t in tokens):
            raise BadInputError("token id outside the vocabulary")
        if self.pos + n > self.n_ctx:
            raise BadInputError(f"the context is full ({self.n_ctx} tokens)")
        # (a pass no longer than one batch always fits its reserve: decode never reads /proc for this)
        span = self._prompt_span() if n > self.options.max_batch else n
        if n > span:
            # The whole prompt's working memory would not fit even with the cache's slots on loan: run it as
            # several layer-major passes (experts may then be read once per pass). Slower, never refused.
            if not self._warned_prompt:
                self._warned_prompt = True
                self.log(f"a {n}-token prompt does not fit in memory in one pass: running it {span} tokens at a time")
            # (chunks end at multiples of max_batch whatever the passes: the numbers are those of one pass)
            outs = [
                self._forward(tokens[i : i + span], all_logits, snapshot=end and i + span >= n, prompt=True)
                for i in range(0, n, span)
            ]
            return np.concatenate(outs, axis=0) if all_logits else outs[-1]
        return self._forward(tokens, all_logits, snapshot=end and (n > 1 or prompt), prompt=prompt)

    def _forward(self, tokens: list[int], all_logits: bool, snapshot: bool, prompt: bool) -> np.ndarray:
        """One pass; `snapshot`: the request's prompt ends with it (its state one token before the end is kept
        as a checkpoint). A pass that fails leaves no half-updated recurrent state behind."""
        try:
            out = self._pass(tokens, all_logits, snapshot, prompt)
        except BaseException:
            if self.kv.states is not None:
                self.checkpoints.abandon()
                self._state_dirty = True
            raise
        self.checkpoints.commit()
        return out

    def _pass(self, tokens: list[int], all_logits: bool, snapshot: bool, prompt: bool) -> np.ndarray:
        n, pos0 = len(tokens), self.pos
        decode = n == 1 and not prompt
        self._open_pass(tokens, snapshot, decode)
        logits = self._token_step(tokens[0]) if decode and self.scheduler.slot_map is not None else None
        if logits is not None:
            self._advance(tokens)
            return logits.reshape(1, -1) if all_logits else logits
        h = self._pass_input(tokens)
        sel_rows: list[np.ndarray] = []
        pred_rows: list[np.ndarray] = []
        carry: Parts | None = None  # layer il's graph results, computed with the layer before's experts
        for il in range(self.hp.n_layer):
            out, sel, preds, carry = self._layer(il, h, decode, carry)
            h = out if out is not None else h  # (None: fused into the next layer's graph)
            if self.kv.spilled and not decode:  # a prompt writes a layer's positions at once: reclaimable now
                self.kv.write_back(il)
            if self.trace is not None and sel is not None and preds is not None:
                sel_rows.append(sel)
                pred_rows.append(preds)
        if self.trace is not None and sel_rows:
            self.trace.append((np.stack(sel_rows, axis=1), np.stack(pred_rows, axis=1), 0 if decode else n))
        self._advance(tokens)
        if not all_logits:
            last: np.ndarray = self._logits(h[-1:])[-1]
            return last
        return np.concatenate([self._logits(h[c]) for c in self._chunks(n, pos0)], axis=0)

    def _open_pass(self, tokens: list[int], snapshot: bool, decode: bool, others: int = 0) -> None:
        """A pass's start for this sequence: its checkpoint positions, the prompt's memory (lent by the cache) or
        the decode's (given back), the core's token clock (`others`: decode tokens of other sequences computed
        in the same pass, runtime/batch.py), and the experts known from the token id alone."""
        n, pos0 = len(tokens), self.pos
        if self.vram is not None:  # (a prompt borrows VRAM here, decode takes it back and moves swaps in)
            self.vram.begin_pass(decode)
        self._cuts = self.checkpoints.boundaries(pos0, n) if not decode else []
        self._snap_at = pos0 + n - 1 if snapshot and self.checkpoints.enabled else None
        if self._snap_at is not None and (self.checkpoints.has(self._snap_at) or self._snap_at == 0):
            self._snap_at = None
        if n == 1 and self._snap_at is not None:  # the last pass of a prompt is one token: the state before it
            for il in self.kv.states.layers if self.kv.states is not None else []:
                self.checkpoints.record(il, self._snap_at)
        if decode and self._prompt_memory_held:
            self.graph.release()  # what the prompt's graphs touched: the reply needs a few MB of it
            self._prompt_memory_held = False
        elif not decode:
            self._prompt_memory_held = True
        if decode:
            self.scheduler.after_prompt()
        else:
            self.scheduler.lend(self.prompt_memory.to_borrow(n, self._free_room()))
        self.scheduler.begin_token(0 if decode and not others else n + others)
        # Layers routed by the token id alone (DeepSeek V4's hash layers): their experts are read from the token's
        # start, in layer order, as demand reads ahead of every prediction (`read_known`), and the lookahead's
        # guesses for them are dropped. As predictions (probability 1) they were read under the prefetch cap, and on
        # ds4-bench at 25 % one or two a token in each hash layer had not started when its layer began: demand reads.
        self._known = self.model.known_experts(tokens[0]) if decode else {}
        for block, experts in sorted(self._known.items()):
            known = Ahead(block, experts, block + 1, [1.0] * len(experts), 1)
            if self.vram is not None:  # (experts in VRAM are never read into RAM)
                known = self.vram.not_held(known)
            self.scheduler.read_known(known.target, known.experts)

    def _pass_input(self, tokens: list[int]) -> np.ndarray:
        """The pass's first state: its tokens' embeddings, chunk by chunk (each reads the few tokens before it
        that the family's embedding needs)."""
        self.lookahead.made.clear()
        k = self.model.token_context  # (the tokens before a chunk its embedding reads: few, never all)
        return np.concatenate(
            [
                self._embed(tokens[c], (self.history[-k:] + tokens[max(0, c.start - k) : c.start])[-k:] if k else [])
                for c in self._chunks(len(tokens), self.pos)
            ],
            axis=0,
        )

    def _advance(self, tokens: list[int]) -> None:
        if self.kv.spilled and self.pos // SPILL_WRITE_BACK != (self.pos + len(tokens)) // SPILL_WRITE_BACK:
            self.kv.write_back()
        self.pos += len(tokens)
        self._seq.kv_high = max(self._seq.kv_high, self.pos)
        self.history.extend(tokens)
        self.scheduler.usage.tokens += len(tokens)

    def _layer(
        self, il: int, h: np.ndarray, decode: bool, carry: Parts | None
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, Parts | None]:
        """One layer. Returns its output (None when a decode step fused it into the next layer's graph), the
        selected experts, the predictions, and the next layer's graph results when fused."""
        n = h.shape[0]
        if not decode:
            self.scheduler.read_ahead(il, n)
        r = carry if carry is not None else self._layer_parts(il, h, decode)
        if "out" in r:  # a dense layer: it predicts the streamed layers after it, as a MoE layer does
            for a in self.lookahead.predict(il, r["ahead"]) if "ahead" in r else []:
                self.scheduler.predict(a.target, a.experts, a.distance, a.probs, a.predictors)
            return r["out"], None, None, None
        sel, weights = r["ids"], r["weights"]
        self.scheduler.observe(il, sel)
        self.lookahead.score(il, sel)
        preds = np.full((n, max(self.options.lookahead, 0), self.hp.n_expert_used), -1, np.int32)
        fused = None
        if decode:
            out, fused = self._decode_experts(il, r, self.lookahead.predict(il, r["ahead"]) if "ahead" in r else [])
        else:
            out = self.experts.prompt(il, r["cur"], sel, weights, self.vram)
        if out is not None:
            out = self._tail(il, out, r)
        preds[-1] = self.lookahead.row(il)
        return out, sel, preds, fused

    def _tail(self, il: int, experts: np.ndarray, r: Parts) -> np.ndarray:
        """The layer's next state from its experts' sum (the family's `tail`): on the arrays where the family has
        a numpy twin, else a graph per chunk, written over the residual (which `_put` made `h`: a chunk reads only
        its own rows)."""
        shared, residual = r.get("shared"), r["residual"]
        out = self.model.tail_array(il, experts, shared, residual)
        if out is not None:
            return out
        g = self.graph
        for c in self._chunks(experts.shape[0], self.pos):
            ctx = g.reset()
            sh = g.input(shared[c]) if shared is not None else None
            x = self.model.tail(ctx, il, g.input(experts[c]), sh, g.input(residual[c]))
            g.compute(x)
            residual[c] = to_numpy(x).reshape(c.stop - c.start, -1)
        return residual

    def _decode_experts(self, il: int, r: Parts, ahead: list[Ahead]) -> tuple[np.ndarray | None, Parts | None]:
        """One token's experts: handed to the scheduler (demand reads), then the lookahead's predictions.

        All in RAM: the experts, their sum, the residual and the next layer's graph in one graph (one graph per
        layer instead of two, no round trip through numpy; the same ggml additions in the same order, so
        bit-identical, tested) — returns (None, the next layer's results). Otherwise the resident experts are
        computed while the others are read — returns (the experts' sum, None).
        """
        sel, weights = r["ids"], r["weights"]
        wave = list(dict.fromkeys(sel[0].tolist()))  # k ≤ the usable slots: a loan keeps k per layer
        vram = self.vram
        held = vram.held(il, wave) if vram is not None else []
        if held:  # in VRAM: computed there, never read into RAM
            wave = [e for e in wave if e not in set(held)]
        ready = self.scheduler.begin_layer(il, wave)
        for a in ahead:  # (experts in VRAM are never read into RAM)
            if a.target in self._known:
                continue
            if vram is not None:
                a = vram.not_held(a)
            self.scheduler.predict(a.target, a.experts, a.distance, a.probs, a.predictors)
        if vram is not None and vram.experts is not None:
            vram.experts.observe(il, [*held, *wave], len(held))
        next_on_cpu = vram is None or not vram.has_layer(il + 1)
        if not held and all(ready) and il + 1 < self.hp.n_layer and next_on_cpu:
            fused = self._fused_step(il, r, wave)
            self.scheduler.end_layer(il)
            return None, fused
        launch = vram.launch(il, r["cur"], sel, weights, held) if vram is not None and held else None
        weighted = self.experts.decode_weighted(il, r["cur"], sel, weights, wave, ready)  # GPU ‖ CPU
        if launch is not None:
            assert vram is not None
            vram.collect(launch, weighted)
        self.scheduler.end_layer(il)
        return common.sum_experts(weighted), None

    def _fused_step(self, il: int, r: Parts, wave: list[int]) -> Parts:
        g, sel = self.graph, r["ids"]
        slot_of = np.zeros(self.hp.n_expert, np.int32)
        slot_of[wave] = self.scheduler.wait_all(il, wave)
        ctx = g.reset()
        slots = g.input(slot_of[sel[0]].reshape(1, -1))  # I32 [k, 1]
        ids = g.input(sel[0].astype(np.int32).reshape(1, -1)) if self.experts.needs_ids(il) else None
        total = self.experts.token(ctx, il, g.input(r["cur"][0]), slots, g.input(r["weights"][0]), ids)
        shared = g.input(r["shared"]) if "shared" in r else None
        x = self.model.tail(ctx, il, total, shared, g.input(r["residual"]))
        out, writes = self._layer_graph(ctx, il + 1, x, self._placement(self.pos, 1, True), True)
        g.compute(*writes, *out.values())
        return {name: to_numpy(t).reshape(1, -1) for name, t in out.items()}

    def _layer_graph(
        self,
        ctx: Any,
        il: int,
        x: Tensor,
        at: common.Placement,
        lookahead: bool,
        place: Place | None = None,
        cache: common.LayerCache | None = None,
    ) -> tuple[dict[str, Tensor], list[Tensor]]:
        """The family's layer graph on x (an input, or the previous layer's output when a decode step computes a
        layer's experts and the next layer in one graph), with the lookahead's router logits in decode; `place`:
        the device's weights and cache (the VRAM tier builds its graphs here too)."""
        model = self.model if place is None else place.model
        if cache is None:
            cache = self.kv[il] if place is None else place.kv[il]
        lo = model.layer(ctx, il, x, at, cache)
        if lo.routed is None:
            assert lo.out is not None
            out = {"out": lo.out}
        else:
            out = lo.routed.outputs()
        routers = place.routers.get(il) if place is not None and place.routers is not None else None
        ahead = self.lookahead.graph(ctx, il, lo, routers) if lookahead else None
        if ahead is not None:
            out["ahead"] = ahead
        return out, lo.writes

    def _layer_parts(self, il: int, h: np.ndarray, decode: bool) -> Parts:
        """The layer's graph over `h` in chunks. A prompt's working memory is what a layer keeps per token
        (`prompt_bytes_per_token`): the layer output or residual replaces `h` in place, chunk by chunk (each
        chunk reads only its own rows), and the other results go straight into arrays of the prompt's length,
        not into per-chunk lists that are then joined."""
        n = h.shape[0]
        r: Parts = {}
        states = self.kv.states
        tracked = not decode and states is not None and il in states.layers and self.checkpoints.enabled
        on_device = self.vram is not None and self.vram.has_layer(il)  # (never a layer with a recurrent state)
        for c in self._chunks(n, self.pos):
            g, m = self.graph, c.stop - c.start
            if on_device:
                assert self.vram is not None
                for key, v in self.vram.layer_chunk(il, h[c], self.pos + c.start, decode).items():
                    _put(r, key, v, h, c)
                continue
            end, cache = self.pos + c.stop, self.kv[il]
            snap = tracked and end - 1 == self._snap_at
            if snap and m == 1:  # the state before this chunk is the one a token before the prompt's end
                self.checkpoints.record(il, end - 1)
            elif snap:  # the graph writes it too
                assert isinstance(cache, common.RecurrentCache)
                cache = dataclasses.replace(cache, snapshot=self.checkpoints.snapshot.layers[il])
            g.reset()
            out, writes = self._layer_graph(
                g.ctx, il, g.input(h[c]), self._placement(self.pos + c.start, m, decode), decode, cache=cache
            )
            g.compute(*writes, *out.values())
            if snap and m > 1:
                self.checkpoints.record_snapshot(il, end - 1)
            if tracked and end in self._cuts:
                self.checkpoints.record(il, end)
            for key, t in out.items():
                _put(r, key, to_numpy(t).reshape(m, -1), h, c)
        return r

    def _placement(self, pos0: int, n: int, decode: bool) -> common.Placement:
        """Where a graph's tokens go and what they attend over: the KV cache rounded up to DECODE_WINDOW positions
        and masked, for decode and prompt chunks alike (as llama.cpp pads its KV view). Every sum over keys then
        has the same length pattern whatever chunk, pass or cached prefix a token came in (masked keys add exact
        zeros): a token's numbers do not depend on how its prompt was split (tested). `--prompt-attention flash`:
        prompt chunks through F32 tiled flash attention."""
        n_kv = common.decode_window(pos0 + n - 1, self.n_ctx)
        flash = not decode and self.options.prompt_attention == "flash"
        axes = self.model.position_axes
        return common.placement(self.graph, pos0, n, n_kv, self.n_ctx, self._v_width, self.model.window, axes, flash)

    # ------------------------------------------------------------------------- a decode step as one graph
    def _token_step(self, token: int) -> np.ndarray | None:
        """A decode step as one graph (every expert resident: nothing to stream or predict); None when that
        graph is off or could not be built (the per-layer path runs instead). The scheduler still sees each
        layer's experts, so hit counts, usage and traces are as in the per-layer path."""
        if not self._token_graph_on or not self.model.one_graph_at(self.pos, self.n_ctx):
            return None
        window = common.decode_window(self.pos, self.n_ctx)
        tg = self._token_graph
        if tg is None or tg.window != window:
            self._drop_token_graph()
            try:
                tg = self._token_graph = self._build_token_graph(window)
            except MemoryError as e:
                self._token_graph_on = False
                self.log(f"decode runs one graph per layer: the one-graph step did not fit in memory ({e})")
                return None
        k = self.model.token_context
        logits, routed = tg.run(token, self.pos, self.history[-k:] if k else [])
        k, d = self.hp.n_expert_used, max(self.options.lookahead, 0)
        sel_rows = []
        for il, experts in routed:
            self.scheduler.touch(il, experts.tolist())
            sel = experts.reshape(1, k)
            self.scheduler.observe(il, sel)
            sel_rows.append(sel)
        if self.trace is not None and sel_rows:
            no_predictions = np.full((1, len(sel_rows), d, k), -1, np.int32)
            self.trace.append((np.stack(sel_rows, axis=1), no_predictions, 0))
        return logits

    def _build_token_graph(self, window: int) -> TokenGraph:
        slot_map = self.scheduler.slot_map
        assert slot_map is not None
        return TokenGraph(self.model, [self.kv], [window], self.experts, slot_map, self.graph)

    def _drop_graphs(self) -> None:
        self._drop_token_graph()
        if self.batch_graph is not None:
            self.batch_graph[1].close()
            self.batch_graph = None

    def _drop_token_graph(self) -> None:
        if self._token_graph is not None:
            self._token_graph.close()
            self._token_graph = None

    # ------------------------------------------------------------------------------------ a prompt's memory
    def _free_room(self) -> int:
        s = self.scheduler
        written = sum(q.kv_high for q in self.seqs) // len(self.seqs)  # (the promise is per position of every one)
        return self.prompt_memory.free_room(written, s.cache_filled(), s.loaned, self.checkpoints.held)

    def _prompt_span(self) -> int:
        """The longest prompt pass whose working memory fits: free memory plus what the cache can lend."""
        s = self.scheduler
        return self.prompt_memory.span(self._free_room(), s.lendable, s.loaned, self.options.max_batch)

    def _chunks(self, n: int, pos0: int) -> list[slice]:
        """A pass of n tokens from pos0 in chunks of at most max_batch that end at multiples of it (checkpoint
        positions are such multiples too): a token lands in the same chunk, so its attention sums over the same
        span and rounds the same, whether the prompt runs in one pass, several, or after a cached prefix."""
        b, out, i = self.options.max_batch, [], 0
        while i < n:
            stop = min(n, (pos0 + i) // b * b + b - pos0)
            out.append(slice(i, stop))
            i = stop
        return out

    # ----------------------------------------------------------------------------------- embedding, head
    def _embed(self, tokens: list[int], before: list[int] | None = None) -> np.ndarray:
        """The state of these tokens, `before` the last `token_context` tokens ahead of them (by default the
        history's)."""
        g = self.graph
        ctx = g.reset()
        if before is None:
            k = self.model.token_context
            before = self.history[-k:] if k else []
        x = self.model.embed(ctx, g.input(self.model.token_input(tokens, before)))
        g.compute(x)
        return to_numpy(x).reshape(len(tokens), self.model.state_width(self.hp))

    def _logits(self, h: np.ndarray) -> np.ndarray:
        if self.vram is not None and self.vram.head:
            return self.vram.logits(h)
        g = self.graph
        ctx = g.reset()
        logits = self.model.head(ctx, g.input(h))
        g.compute(logits)
        return to_numpy(logits).reshape(-1, self.hp.vocab_size)

    # ------------------------------------------------------------------------------------------- stats
    def recorded_trace(self) -> Any:
        """The routing recorded since `self.trace = []` (last token of each batch), as a trace file object."""
        rows = self.trace or []
        k = self.hp.n_expert_used
        d = max(self.options.lookahead, 0)
        n_layers = len(self.streamed)
        sel = np.full((len(rows), n_layers, k), -1, np.int32)
        pred = np.full((len(rows), n_layers, d, k), -1, np.int32)
        prompt = np.zeros(len(rows), np.int64)
        for i, (s_rows, p_rows, n) in enumerate(rows):
            sel[i] = s_rows[-1][-n_layers:]
            if d:
                pred[i] = p_rows[-1][-n_layers:]
            prompt[i] = n
        return Trace(sel, pred, prompt, np.array(self.streamed, np.int32), self.hp.n_expert)

    def stats(self) -> dict[str, Any]:
        c = self.counters()
        per_layer = {name: c[:, i].tolist() for i, name in enumerate(SESSION_COUNTERS)}
        return {
            "per_layer": per_layer,
            "vram": self.vram.describe() if self.vram is not None else None,
            "prediction_recall": self.lookahead.recall(),
            "slots_per_layer": self.slots_per_layer,
            "expert_cache_bytes": self.scheduler.capacity,
            "resident_weight_bytes": self.model.weights.bytes,
            "parallel": self.n_seq,
            "n_ctx": self.n_ctx,
            "lazy_reads": self.model.lazy_reads(),  # (the n-gram table's pages: read apart from the experts)
        }

    def describe(self) -> str:
        hp = self.hp
        return (
            f"{hp.arch}: {hp.n_layer} layers, {hp.n_expert} experts (top-{hp.n_expert_used}); expert cache "
            f"{self.slots_per_layer}/{hp.n_expert} per layer ({human_bytes(self.scheduler.capacity)}), "
            f"context {self.n_ctx}" + (f" in each of {self.n_seq} parallel sequences" if self.n_seq > 1 else "")
        )
