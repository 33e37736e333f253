"""A loaded model and its state: its weights, sequences (runtime/sequences.py), memory plan, expert scheduler,
lookahead and VRAM tier, and the forward pass over them (runtime/passes.py) with the experts streamed and predicted.

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
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwing.compute.backend import DeviceError
from tokenwing.compute.devices import DeviceChoice
from tokenwing.compute.ggml_lib import Graph
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import human_bytes
from tokenwing.models.base import MoEModel
from tokenwing.models.hparams import HParams
from tokenwing.models.weights import ModelWeights, resident_bytes
from tokenwing.runtime.experts import ExpertCompute, ExpertPools
from tokenwing.runtime.kvcache import v_width
from tokenwing.runtime.lookahead import Lookahead
from tokenwing.runtime.memory_plan import (
    AUTO_PARALLEL,
    RESIDENT_WEIGHTS,
    PromptMemory,
    prompt_bytes_per_token,
    refuse_beyond_machine,
    session_memory,
)
from tokenwing.runtime.passes import Passes
from tokenwing.runtime.preflight import preflight
from tokenwing.runtime.scheduler import ExpertScheduler
from tokenwing.runtime.sequences import SeqState, new_sequences
from tokenwing.runtime.token_graph import TokenGraph
from tokenwing.runtime.vram.experts import COUNTERS as VRAM_COUNTERS
from tokenwing.runtime.vram.tier import VramOptions, VramTier
from tokenwing.streaming.memory import memory_info
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS, plan_slots
from tokenwing.streaming.trace import Trace
from tokenwing.text.tokenizer import TextTokenizer

__all__ = ["AUTO_PARALLEL", "SESSION_COUNTERS", "Session", "SessionOptions", "session_memory"]


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
    # what else the process keeps beside the model, counted before the expert cache is sized: the image encoder's
    # weights and compute buffer (`--mmproj`: vision/device.py encoder_bytes), as (what, bytes)
    also_held: tuple[tuple[str, int], ...] = ()


# The session's counters per streamed layer: the streaming core's (RAM and drive), then the VRAM tier's.
SESSION_COUNTERS: list[str] = [*COUNTERS, *VRAM_COUNTERS]

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(f"tokenwing: {line}", file=sys.stderr)


class Session(Passes):
    """A loaded model, its sequences (runtime/sequences.py) and the forward pass over them (runtime/passes.py)."""

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

        def sequences(spill: str | None) -> list[SeqState]:
            return new_sequences(
                weights.arena, specs, state_specs, self.n_ctx, opts.kv_type, states, interval, memory.n_seq, spill
            )

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
            f"context {self.n_ctx}"
            + (f" in each of {self.n_seq} parallel sequences" if self.n_seq > 1 else "")
            # (what the memory plan counted beside the model: the image encoder, SessionOptions.also_held)
            + "".join(f"; the memory plan counts {what}" for what, _ in self.options.also_held)
        )
