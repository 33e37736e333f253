"""The VRAM tier (spec §5, §9, §11, §12): the layers, output head and hot experts a GPU holds, and how a session
computes with them.

Placement (runtime/placement.py sizes it): whole layers' always-used weights and their KV cache first, then the
output head, then a hot-expert cache per streamed layer (runtime/vram_experts.py: seeded from the usage table,
swapped as decode moves on). The family's own layer graph runs on the device through a view of its model whose
weights are the device's copies (`device_view`): no family has GPU code of its own.

Device and CPU graphs never share a graph: ggml's scheduler splits between lavapipe and the CPU crashed
intermittently (docs/results.md), so each device graph runs wholly on the device and the small activations
between the two sides are copied explicitly (a layer's input in, its router outputs and hidden states out).
Per decode layer: the layer graph (attention, router, shared expert, lookahead) where its weights are; then
the selected experts the VRAM holds are queued on the device while the CPU computes the others (from RAM, or as
they land from the drive), and the two sets of weighted outputs are summed on the CPU in rank order, as the CPU
path sums them — which device computed an expert changes its rounding, never the order of the sum.

A prompt runs layer-major: device layers' chunks on the device (a chunk whose tensors cannot be allocated is
split in two), the experts the VRAM holds computed there, and large waves of the others copied from their RAM
slots into two sets of VRAM places and computed on the GPU (one set computes while the next is copied in).

Lending (`--vram-lend`, spec §11): the plan keeps apart only decode's compute buffers and the waves' places, and
gives the rest of a prompt chunk's to expert slots. The prompts' graphs are planned by a GraphAllocator of their
own, reserved once for the largest of them, and the expert cache's lendable segments live in its buffer
(`_fill_lending`): each prompt pass starts with `begin_pass`, where the cache gives the segments up (each layer's
coldest experts leave VRAM), and the first decode step after it refills them from RAM (else the file). The device
buffers the tier holds do not change through a prompt (`Backend.held_bytes`).

A device that fails (`DeviceError`) ends the tier: the session says so in one line and continues on the CPU.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from tokenwing.compute.backend import (
    Backend,
    DeviceError,
    DeviceGraph,
    DeviceMemoryError,
    DeviceTensors,
    GraphAllocator,
    Readback,
    get_tensor,
)
from tokenwing.compute.devices import DeviceChoice
from tokenwing.compute.ggml_lib import F32, I32, I64, Tensor, ops
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import human_bytes
from tokenwing.models import common
from tokenwing.models.base import MoEModel
from tokenwing.models.weights import ModelWeights
from tokenwing.runtime.kvcache import kv_element, v_width
from tokenwing.runtime.lookahead import Ahead, Lookahead
from tokenwing.runtime.placement import (
    WAVE_PLACES,
    LayerCost,
    VramPlan,
    decode_reserve,
    device_reserve,
    padded,
    plan_vram,
)
from tokenwing.runtime.scheduler import ExpertScheduler
from tokenwing.runtime.vram_experts import BYTES_UP, ExpertPool, VramExperts, _Geometry, new_pool
from tokenwing.streaming.usage import load_usage, usage_path

Log = Callable[[str], None]
Parts = dict[str, np.ndarray]
Views = tuple[Tensor, Tensor, Tensor]
# Test-only (a mock: a driver cannot be made to run out of memory at a chosen moment): the N-th device graph
# built after the tier started fails to allocate, as a device that runs out of memory mid-run would.
FAIL_ENV = "TOKENWING_TEST_VRAM_FAIL"
WAVE_MIN_TOKENS = 32  # a prompt wave's experts go to the GPU from this many tokens per expert (ggml's own bar)
MAX_NODES = 4096


@dataclass(frozen=True)
class VramOptions:
    max_layers: int | None = None  # at most this many layers' always-used weights in VRAM (None: all that fit)
    wave_min_tokens: int = WAVE_MIN_TOKENS  # tokens per expert from which a prompt wave runs on the GPU
    # A prompt's compute buffers and GPU waves' places go into memory the VRAM expert cache lends it (refilled
    # after the prompt), instead of VRAM kept apart for them: decode keeps those bytes for experts (spec §11)
    lend: bool = False


@dataclass
class Place:
    """Where a layer graph takes its weights from: the family's model (or its device view), the KV caches and
    the lookahead's stacked routers (None: the lookahead's own, in RAM)."""

    model: MoEModel
    kv: Sequence[common.KVCache]
    routers: dict[int, Tensor] | None = None


# (ctx, layer, input, placement, with the lookahead, place) → (named outputs, cache writes): Session._layer_graph
LayerGraph = Callable[[Any, int, Tensor, common.Placement, bool, Place], tuple[dict[str, Tensor], list[Tensor]]]


class DeviceWeights:
    """`ModelWeights`' lookups over the device's copies (a tensor it does not hold is a KeyError, never RAM)."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.tensors = tensors

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> Tensor:
        return self.tensors[name]


def device_view(model: MoEModel, tensors: dict[str, Tensor]) -> MoEModel:
    """The family's model with the device's tensors in place of its weights: its own `layer`, `head`,
    `expert_ffn` build device graphs. A weight the device lacks is missing from the view (a KeyError while
    building), so a graph can never mix RAM into a device graph silently."""
    view = copy.copy(model)
    view.w = [{} for _ in range(model.hp.n_layer)]
    for name, t in tensors.items():
        parts = name.split(".", 2)
        if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < model.hp.n_layer:
            view.w[int(parts[1])][parts[2].removesuffix(".weight")] = t
    view.weights = DeviceWeights(tensors)  # type: ignore[assignment]
    return view


@dataclass
class _Step:
    """A persistent decode graph (a layer over a window of the KV cache, or the head): inputs set per token."""

    graph: DeviceGraph
    x: Tensor
    at: common.Placement | None
    outputs: dict[str, Tensor]
    n_kv: int


@dataclass
class _ExpertPart:
    """A decode token's experts held in one buffer of their layer's slots (two with a lendable segment)."""

    x: Tensor
    ids: Tensor
    w: Tensor
    eids: Tensor | None
    out: Tensor


@dataclass
class _ExpertStep:
    graph: DeviceGraph
    parts: list[_ExpertPart]


@dataclass
class Launch:
    """Experts queued on the device for one decode token: the graph, and per part their ranks in the selection."""

    step: _ExpertStep
    ranks: list[list[int]]


# A graph a prompt computes, built into a DeviceGraph: its outputs (what `_reserve` and `_lend` place)
Builder = Callable[[DeviceGraph], list[Tensor]]


class VramTier:
    def __init__(
        self,
        choice: DeviceChoice,
        mf: ModelFile,
        model: MoEModel,
        weights: ModelWeights,
        lookahead: Lookahead,
        scheduler: ExpertScheduler,
        kv_specs: list[common.KVSpec],
        n_ctx: int,
        kv_type: str,
        max_batch: int,
        layer_graph: LayerGraph,
        log: Log,
        options: VramOptions | None = None,
    ) -> None:
        """Plans and fills the device; raises DeviceError when nothing could be placed (the reason is the
        message: the caller computes on the CPU and says so)."""
        assert choice.device is not None
        self.options = options or VramOptions()
        self.mf, self.model, self.hp, self.log = mf, model, model.hp, log
        self.scheduler, self.n_ctx, self.max_batch = scheduler, n_ctx, max_batch
        self.layer_graph = layer_graph
        self.kv_type = kv_type
        self.kv_specs = kv_specs
        self._weights = weights
        self._lookahead = lookahead
        self.backend = Backend(choice.device)
        # every device graph of the tier: one compute buffer, reserved for the largest graphs at start (`_reserve`)
        self._alloc = GraphAllocator(self.backend)
        # decode steps' outputs (a layer's, the head's) and the device's share of a token's experts, each read into
        # pinned memory behind its graph; two, as a launch's read is in flight while the CPU computes its share
        self._reads = Readback(self.backend)
        self._expert_reads = Readback(self.backend)
        self._buffers: list[DeviceTensors] = []
        self.layers: set[int] = set()
        self.head = False
        self.experts: VramExperts | None = None
        self._staging: dict[str, ExpertPool] = {}  # the prompt waves' places
        self._lending = self.options.lend
        # lending: the prompts' own compute buffer, which holds the cache's lendable segments between prompts
        self._prompt_alloc: GraphAllocator | None = None
        # (device_chunk, the prompt's graph whose buffer is the largest at it, that buffer's bytes)
        self._largest: tuple[int, Builder, int] | None = None
        self._decode: dict[int, _Step] = {}
        self._head_step: _Step | None = None
        self._expert_steps: dict[tuple[int, int, int], _ExpertStep] = {}  # (layer, experts per buffer)
        self.device_chunk = max_batch  # prompt tokens per device graph
        self._split_note = False
        self._graphs_built = 0
        self._fail_at = int(os.environ.get(FAIL_ENV) or 0)  # (test-only)
        self._started = False
        try:
            self.plan = self._plan(choice.vram_budget)
            if self.plan.empty:
                raise DeviceError(self._too_small(choice.vram_budget))
            self._fill()
        except Exception:
            self.close()
            raise
        self._started = True

    # ------------------------------------------------------------------------------------------ planning
    def _layer_names(self) -> dict[int, list[str]]:
        names: dict[int, list[str]] = {il: [] for il in range(self.hp.n_layer)}
        for name in self._weights.tensors:
            parts = name.split(".", 2)
            if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < self.hp.n_layer:
                names[int(parts[1])].append(name)
        return names

    def _nbytes(self, t: Tensor) -> int:
        return int(ops.ggml_nbytes(t))

    def _extra(self, il: int) -> dict[str, Tensor]:
        """Tensors a layer's device graph needs beyond its own: the lookahead's stacked routers (named here; the
        norms of the layers they predict are folded into them)."""
        la = self._lookahead.fused.get(il)
        return {} if la is None else {f"lookahead.{il}": la[0]}

    def _costs(self) -> tuple[list[LayerCost], int]:
        _, elt = kv_element(self.kv_type)
        names = self._layer_names()
        hp, w = self.hp, self._weights
        # a decode graph's own buffer: attention scores over the context, and a few hidden-state-sized tensors
        decode = 4 * (2 * hp.n_head * self.n_ctx + 16 * hp.n_embd + 4 * hp.n_expert + 4 * hp.n_head * hp.head_dim)
        costs = []
        for il in range(hp.n_layer):
            weights = sum(padded(self._nbytes(w.get(n))) for n in names[il])
            weights += sum(padded(self._nbytes(t)) for n, t in self._extra(il).items() if n not in names[il])
            spec = self.kv_specs[il]
            kv = padded(spec.k * elt * self.n_ctx) + padded(spec.v_stored * elt * self.n_ctx)
            costs.append(LayerCost(weights, kv + decode))
        head = sum(padded(self._nbytes(w.get(n))) for n in self._head_names())
        return costs, head

    def _head_names(self) -> list[str]:
        out = "output.weight" if self._weights.has("output.weight") else "token_embd.weight"
        return ["output_norm.weight", out]

    def _plan(self, budget: int) -> VramPlan:
        costs, head = self._costs()
        geos = {_key(_Geometry.of(el)): _Geometry.of(el) for el in self.scheduler.streamer.layers}
        wave = sum(g.device_bytes for g in geos.values())
        reserve = device_reserve(self.hp, self.max_batch, self.n_ctx, wave)
        expert_bytes = [_Geometry.of(el).device_bytes for el in self.scheduler.streamer.layers]
        self.costs, self.head_bytes, self.expert_row = costs, head, sum(expert_bytes)  # (what tests size budgets by)
        limit = self.options.max_layers
        if limit != 0 and any(self.model.state_spec(il) is not None for il in range(self.hp.n_layer)):
            # A linear-attention layer's recurrent state and its checkpoints live in RAM (runtime/recurrent.py):
            # such a model's layers compute on the CPU, the VRAM holds its head and experts.
            self.log(
                "the layers of a linear-attention model compute on the CPU (their state lives in RAM): "
                "the VRAM holds its head and experts"
            )
            limit = 0
        layers = costs[:limit] if limit is not None else costs
        plan = plan_vram(budget, reserve, layers, head, expert_bytes, self.hp.n_expert)
        if self._lending:
            keep = decode_reserve(self.hp, self.n_ctx, wave)
            lent = plan_vram(budget, keep, layers, head, expert_bytes, self.hp.n_expert)
            if lent.expert_slots > 0 and plan.expert_slots < self.hp.n_expert:
                return lent
            self._lending = False  # no cache to lend, or every expert fits anyway: the prompt keeps its own VRAM
        return plan

    def _too_small(self, budget: int) -> str:
        costs, _ = self._costs()
        smallest = min((c.total for c in costs), default=0)
        return (
            f"the VRAM budget {human_bytes(budget)} holds not even one layer ({human_bytes(smallest)} beside "
            f"{human_bytes(self.plan.reserve)} of compute buffers) or one expert per layer"
        )

    # ------------------------------------------------------------------------------------------- filling
    def _upload(self, names: Sequence[str], extra: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """One device buffer with these resident weights (and `extra` tensors), as the file has them."""
        extra = extra or {}
        host = {n: self._weights.get(n) for n in names} | extra
        dt = DeviceTensors(self.backend, len(host) + 1)
        self._buffers.append(dt)
        placed = {n: dt.new(int(t.contents.type), _shape(t), n) for n, t in host.items()}
        dt.allocate()
        for n, t in host.items():
            if t.contents.buffer and n not in extra:  # repacked in RAM for the CPU: the file's bytes instead
                data = np.frombuffer(self.mf.read_tensor(n), np.uint8)
                dt.set(placed[n], data)
            else:
                dt.set(placed[n], int(t.contents.data), self._nbytes(t))
        return placed

    def _kv(self, il: int) -> common.KVCache:
        gtype, elt = kv_element(self.kv_type)
        spec = self.kv_specs[il]
        dt = DeviceTensors(self.backend, 2, weights=False)
        self._buffers.append(dt)
        k = dt.new(gtype, (spec.k, self.n_ctx), f"cache_k.{il}")
        v = dt.new(gtype, (self.n_ctx, spec.v), f"cache_v.{il}") if spec.v_stored else None
        dt.allocate()
        dt.clear()
        return common.KVCache(k, v, elt, spec.v)

    def _expert_tensors(self) -> dict[str, Tensor]:
        """Per streamed layer, the tensors its experts compute with beyond the pools (gpt-oss's biases)."""
        out = {}
        for el in self.scheduler.streamer.layers:
            ffn = self.model.expert_ffn(el.layer)
            for t in ffn.biases or ():
                out[_name_of(self._weights, t)] = t
        return out

    def _fill(self) -> None:
        plan, hp = self.plan, self.hp
        names = self._layer_names()
        tensors: dict[str, Tensor] = {}
        routers: dict[int, Tensor] = {}
        for il in plan.layers:
            extra = {n: t for n, t in self._extra(il).items() if n not in names[il] and n not in tensors}
            placed = self._upload(names[il], extra)
            la = placed.pop(f"lookahead.{il}", None)
            if la is not None:
                routers[il] = la
            tensors.update(placed)
        if plan.head:
            tensors.update(self._upload(self._head_names()))
        biases = {n: t for n, t in self._expert_tensors().items() if n not in tensors}
        if biases:
            tensors.update(self._upload(list(biases)))
        kv_by_layer = {il: self._kv(il) for il in plan.layers}
        kv = [kv_by_layer.get(il, _NO_KV) for il in range(hp.n_layer)]
        self.view = device_view(self.model, tensors)
        self.place = Place(self.view, kv, routers)
        self.layers = set(plan.layers)
        self.head = plan.head
        for il in sorted(self.layers):  # every op on the device, every weight there (else: the CPU's layer)
            try:
                self._build_step(il, common.decode_window(0, self.n_ctx)).graph.close()
            except (DeviceError, KeyError) as e:
                self.layers.discard(il)
                self.log(f"layer {il} computes on the CPU: {e}")
        self._fill_experts(plan.expert_slots)
        self._reserve()

    def _reserve(self) -> None:
        """Places the largest graph of every kind once, so the compute buffer never grows later (a growth keeps
        the old buffer: see `GraphAllocator`): a decode step over the whole context, the head for one token, a
        token's experts, and without lending a prompt's graphs at `device_chunk` tokens (`_prompt_graphs`; with
        lending those have an allocator of their own: `_fill_lending`). A chunk whose buffer cannot be allocated
        is halved (spec §12: a prompt whose GPU tensors cannot fit is split into calls that do), with one line."""
        k = self.hp.n_expert_used
        while True:
            try:
                for build in [] if self._lending else self._prompt_graphs(self.device_chunk):
                    g = self._graph(MAX_NODES)
                    try:
                        g.finish(*build(g))
                    finally:
                        g.close()
                for il in sorted(self.layers):
                    self._build_step(il, self.n_ctx).graph.close()
                if self.head:
                    self._build_head(1).graph.close()
                for el in self.scheduler.streamer.layers:
                    # (k rows over each pool of the layer's slots: a token's experts split between them fit)
                    segments = self.experts.segments(el.layer) if self.experts is not None else []
                    if not segments:
                        continue
                    g = self._graph(64)
                    try:
                        g.finish(*(self._expert_graph(g, el.layer, pool.views, k)[-1] for pool, _, _ in segments))
                    finally:
                        g.close()
                break
            except DeviceMemoryError:
                if self._lending or self.device_chunk == 1:
                    raise
                self.device_chunk = max(1, self.device_chunk // 2)
        self._note_chunk()

    def _note_chunk(self) -> None:
        if self.device_chunk < self.max_batch and not self._split_note:
            self._split_note = True
            self.log(
                f"a prompt's GPU tensors for {self.max_batch} tokens do not fit in VRAM: prompts run "
                f"{self.device_chunk} tokens at a time on the GPU"
            )

    def _prompt_graphs(self, m: int) -> list[Builder]:
        """The largest graph of every kind a prompt computes at m tokens a chunk: a layer's chunk over the whole
        context, the head's, and a layer's experts over m · k rows."""
        out: list[Builder] = []
        for il in sorted(self.layers):

            def layer(g: DeviceGraph, il: int = il) -> list[Tensor]:
                x = g.input(F32, (self.hp.n_embd, m))
                return list(self._layer(g, il, x, self._placement(g, m, self.n_ctx), False).values())

            out.append(layer)
        if self.head:
            out.append(lambda g: [self.view.head(g.ctx, g.input(F32, (self.hp.n_embd, m)))])
        k = self.hp.n_expert_used
        for el in self.scheduler.streamer.layers if self._staging else []:
            # (over the waves' places: a graph's buffer depends on its pool's geometry only, and they are there
            # before the cache is)
            views = self._staging[_key(_Geometry.of(el))].views

            def experts(g: DeviceGraph, b: int = el.layer, v: Views = views) -> list[Tensor]:
                return [self._expert_graph(g, b, v, m * k)[-1]]

            out.append(experts)
        return out

    def _graph(self, max_nodes: int, prompt: bool = False) -> DeviceGraph:
        """A device graph in the tier's compute buffer; `prompt`: a graph of a prompt pass, which with lending
        goes into the prompts' own allocator."""
        if self._started and self._fail_at:
            self._graphs_built += 1
            if self._graphs_built == self._fail_at:
                raise DeviceMemoryError(f"{self.backend.device.name} could not allocate a graph ({FAIL_ENV})")
        alloc = self._alloc
        if prompt and self._prompt_alloc is not None:
            if self.experts is not None and self.experts.n_lend and not self.experts.lent:
                raise RuntimeError("a prompt's device graph outside a prompt pass (VramTier.begin_pass)")
            alloc = self._prompt_alloc
        return DeviceGraph(self.backend, max_nodes, allocator=alloc)

    # ----------------------------------------------------------------------------- lending to a prompt
    def begin_pass(self, decode: bool) -> None:
        """Before each forward pass: a prompt pass takes the cache's lendable segments for its compute buffer
        (`--vram-lend`: the coldest experts leave VRAM); the first decode step after it refills them, then each
        decode step moves staged swaps in (between two steps, never inside one)."""
        if self.experts is None:
            return
        if not decode:
            self.experts.lend()
            return
        self.experts.take_back(self._file_record)
        self.experts.between_steps()

    def _fill_lending(self, n_slots: int) -> tuple[int, int, int | None]:
        """With lending: the prompts' GraphAllocator, reserved for their largest graph (`device_chunk` halved
        until the cache can lend it: every layer keeps a slot), and the slots of the cache around it — (kept
        slots, lendable slots, the allocator's buffer, where the lendable segments live). Allocated once, never
        freed while the tier lives: freeing a graph allocator's buffer (its graphs closed, the device synchronized,
        another graph computed between) left ggml-vulkan on lavapipe corrupting the heap at a later graph, 5 runs
        in 5 with the first decode step after a prompt; expert pools' buffers were freed safely."""
        while True:
            build, size = self._largest_prompt_graph()
            lent, freed = size // self.expert_row, -(-size // self.expert_row)
            if n_slots - freed >= 1 or self.device_chunk == 1:
                break
            self.device_chunk = max(1, self.device_chunk // 2)
        if n_slots - freed < 1:
            self._lending = False
            self.log("the VRAM expert cache is too small to lend a prompt its compute buffer: prompts keep their own")
            return n_slots, 0, None
        alloc = GraphAllocator(self.backend, limit=size)
        g = DeviceGraph(self.backend, MAX_NODES, allocator=alloc)
        try:
            g.finish(*build(g))
            buffer = g.compute_buffer
        except DeviceMemoryError:
            alloc.close()
            if self.device_chunk == 1:
                raise
            self.device_chunk = max(1, self.device_chunk // 2)  # (the device refused it: as `_reserve` does)
            return self._fill_lending(n_slots)
        except Exception:
            alloc.close()
            raise
        finally:
            g.close()
        self._prompt_alloc = alloc
        self._note_chunk()
        if buffer is None:
            return n_slots - freed, 0, None
        align = int(ops.ggml_backend_buffer_get_alignment(buffer))
        room = int(ops.ggml_backend_buffer_get_size(buffer))
        geos = [_Geometry.of(el) for el in self.scheduler.streamer.layers]
        while lent and sum(-(-lent * n // align) * align for g in geos for n in g.proj_size) > room:
            lent -= 1  # (each tensor starts at the buffer's alignment)
        return n_slots - freed, lent, buffer

    def _largest_prompt_graph(self) -> tuple[Builder, int]:
        """The prompt graph whose buffer is the largest at `device_chunk`, and its bytes (measured, nothing
        allocated): every other fits the buffer reserved for it."""
        if self._largest is None or self._largest[0] != self.device_chunk:
            best, size = None, -1
            for build in self._prompt_graphs(self.device_chunk):
                g = DeviceGraph(self.backend, MAX_NODES)
                try:
                    n = g.measure(self._alloc, *build(g))
                finally:
                    g.close()
                if n > size:
                    best, size = build, n
            assert best is not None
            self._largest = (self.device_chunk, best, size)
        return self._largest[1], self._largest[2]

    def _file_record(self, row: int, expert: int) -> np.ndarray:
        return self._read_file(self.scheduler.streamer.layers[row].layer, expert)

    def _read_file(self, layer: int, expert: int) -> np.ndarray:
        return np.frombuffer(self.mf.read_expert(layer, expert), np.uint8)

    def _fill_experts(self, n_slots: int) -> None:
        """The prompt waves' VRAM places and the hot-expert cache, once the device is known to run the experts'
        ops (else every expert computes on the CPU)."""
        s = self.scheduler
        streamer = s.streamer
        try:
            for el in streamer.layers:
                key = _key(_Geometry.of(el))
                if key not in self._staging:
                    self._staging[key] = new_pool(self.backend, el, 2 * WAVE_PLACES)
                g = self._graph(64)
                try:
                    *_, out = self._expert_graph(g, el.layer, self._staging[key].views, 1)
                    g.finish(out, check=True)
                finally:
                    g.close()
        except (DeviceError, KeyError) as e:
            self.log(f"experts compute on the CPU: {e}")
            for pool in self._staging.values():
                pool.close()
            self._staging.clear()
            return
        n_lend, buffer = 0, None
        if self._lending and n_slots:
            n_slots, n_lend, buffer = self._fill_lending(n_slots)
            n_slots += n_lend
        self.experts = VramExperts(
            self.backend,
            list(streamer.layers),
            s.n_expert,
            n_slots,
            self._ram_record,
            lambda row, experts: streamer.ready(streamer.layers[row].layer, experts),
            streamer.checksums,
            n_lend,
        )
        self.experts.allocate(buffer)
        if not n_slots:
            return
        seed = s.usage_seed
        if seed is None and s.usage_on:
            seed = load_usage(usage_path(self.mf.path), s.layers, s.n_expert, s.usage.model_checksum, lambda _: None)
        for row, el in enumerate(streamer.layers):
            if n_slots >= s.n_expert:
                chosen = list(range(s.n_expert))
            elif seed is not None:
                chosen = seed.ranked(row)[:n_slots]
            else:
                chosen = []  # no usage table yet: the first swaps fill the slots
            self.experts.seed(row, chosen, functools.partial(self._start_record, el.layer))

    def _start_record(self, layer: int, expert: int) -> np.ndarray:
        """An expert's record at start: from its RAM slot when every expert was read already, else the file."""
        s = self.scheduler
        if s.slot_map is not None:
            return s.streamer.expert_bytes(layer, int(s.slot_map[layer][expert]))
        return self._read_file(layer, expert)

    def _ram_record(self, row: int, expert: int) -> np.ndarray | None:
        """The RAM slot holding an expert now (the swap helper copies it and checks its checksum)."""
        streamer = self.scheduler.streamer
        where = streamer.core.resident_experts(row)
        try:
            slot = where.index(expert)
        except ValueError:
            return None
        row_bytes: np.ndarray = streamer.pools[row][slot]
        return row_bytes

    # --------------------------------------------------------------------------------------- layer graphs
    def has_layer(self, il: int) -> bool:
        return il in self.layers

    def _placement(self, g: DeviceGraph, n: int, n_kv: int) -> common.Placement:
        width = v_width(self.kv_specs)
        return common.Placement(
            n=n,
            n_kv=n_kv,
            positions=g.input(I32, (n * self.model.position_axes,)),
            mask=g.input(F32, (n_kv, n)),
            k_rows=g.input(I64, (n,)),
            v_cells=g.input(I64, (n * width,)) if width else None,
            mask_swa=g.input(F32, (n_kv, n)) if self.model.window else None,
        )

    def _set_placement(self, g: DeviceGraph, at: common.Placement, pos0: int) -> None:
        width, axes = v_width(self.kv_specs), self.model.position_axes
        a = common.placement_arrays(pos0, at.n, at.n_kv, self.n_ctx, width, self.model.window, axes)
        for name, values in a.items():
            t = getattr(at, name)
            if t is not None and t.contents.buffer:  # (an input no node of this graph reads is not allocated)
                g.set(t, values)

    def _layer(self, g: DeviceGraph, il: int, x: Tensor, at: common.Placement, decode: bool) -> dict[str, Tensor]:
        out, writes = self.layer_graph(g.ctx, il, x, at, decode, self.place)
        for w in writes:
            g.expand(w)  # before the attention reads of the cache
        return out

    def _build_step(self, il: int, window: int) -> _Step:
        g = self._graph(MAX_NODES)
        try:
            x = g.input(F32, (self.hp.n_embd, 1))
            at = self._placement(g, 1, window)
            out = self._layer(g, il, x, at, True)
            g.finish(*out.values(), check=True)
        except Exception:
            g.close()
            raise
        return _Step(g, x, at, out, window)

    def layer_chunk(self, il: int, rows: np.ndarray, pos0: int, decode: bool) -> Parts:
        """Layer il's graph over `rows` (hidden states at positions pos0…) on the device: its named results."""
        if decode:
            window = common.decode_window(pos0, self.n_ctx)
            st = self._decode.get(il)
            if st is None or st.n_kv != window:
                if st is not None:
                    st.graph.close()
                st = self._decode[il] = self._build_step(il, window)
            st.graph.set(st.x, np.ascontiguousarray(rows, np.float32))
            assert st.at is not None
            self._set_placement(st.graph, st.at, pos0)
            values = st.graph.compute_read(self._reads, list(st.outputs.values()))
            return {k: v.reshape(1, -1) for k, v in zip(st.outputs, values, strict=True)}
        return self._split(rows, pos0, lambda part, p0: self._prompt_chunk(il, part, p0))

    def _split(self, rows: np.ndarray, pos0: int, run: Callable[[np.ndarray, int], Parts]) -> Parts:
        """`run` over rows in device chunks; a chunk whose tensors cannot be allocated is split in two (spec
        §12: a prompt whose GPU tensors cannot fit is split into calls that do), down to one token."""
        out: list[Parts] = []
        start, n = 0, rows.shape[0]
        while start < n:
            m = min(self.device_chunk, n - start)
            try:
                out.append(run(rows[start : start + m], pos0 + start))
            except DeviceMemoryError:
                if m == 1:
                    raise
                self.device_chunk = max(1, m // 2)
                if not self._split_note:
                    self._split_note = True
                    n_tok = self.device_chunk
                    self.log(f"a prompt's GPU tensors do not fit in VRAM: computing it {n_tok} tokens at a time")
                continue
            start += m
        if len(out) == 1:
            return out[0]
        return {k: np.concatenate([p[k] for p in out], axis=0) for k in out[0]}

    def _prompt_chunk(self, il: int, rows: np.ndarray, pos0: int) -> Parts:
        m = rows.shape[0]
        g = self._graph(MAX_NODES, prompt=True)
        try:
            x = g.input(F32, (self.hp.n_embd, m))
            # (over the KV cache rounded up as decode's, masked: the CPU's prompt chunks attend so, Session._placement)
            at = self._placement(g, m, common.decode_window(pos0 + m - 1, self.n_ctx))
            out = self._layer(g, il, x, at, False)
            g.finish(*out.values())
            g.set(x, np.ascontiguousarray(rows, np.float32))
            self._set_placement(g, at, pos0)
            g.compute()
            return {k: get_tensor(t).reshape(m, -1) for k, t in out.items()}
        finally:
            g.close()

    # ---------------------------------------------------------------------------------------------- head
    def logits(self, h: np.ndarray) -> np.ndarray:
        """The output head over hidden states h [n, n_embd] on the device: logits [n, vocab]."""
        if h.shape[0] == 1:
            if self._head_step is None:
                self._head_step = self._build_head(1)
            st = self._head_step
            st.graph.set(st.x, np.ascontiguousarray(h, np.float32))
            return st.graph.compute_read(self._reads, [st.outputs["logits"]])[0].reshape(1, -1)
        return self._split(h, 0, lambda part, _: {"logits": self._head_chunk(part)})["logits"]

    def _build_head(self, n: int, prompt: bool = False) -> _Step:
        g = self._graph(64, prompt)
        try:
            x = g.input(F32, (self.hp.n_embd, n))
            logits = self.view.head(g.ctx, x)
            g.finish(logits, check=True)
        except Exception:
            g.close()
            raise
        return _Step(g, x, None, {"logits": logits}, 0)

    def _head_chunk(self, rows: np.ndarray) -> np.ndarray:
        st = self._build_head(rows.shape[0], prompt=True)
        try:
            st.graph.set(st.x, np.ascontiguousarray(rows, np.float32))
            st.graph.compute()
            return get_tensor(st.outputs["logits"]).reshape(rows.shape[0], -1)
        finally:
            st.graph.close()

    # ------------------------------------------------------------------------------------------- experts
    def held(self, block: int, experts: list[int]) -> list[int]:
        """Which of a layer's experts the VRAM holds."""
        return self.experts.held(block, experts) if self.experts is not None else []

    def not_held(self, a: Ahead) -> Ahead:
        """A prediction without the experts the VRAM holds (they are never read into RAM)."""
        held = set(self.held(a.target, a.experts))
        if not held:
            return a
        keep = [i for i, e in enumerate(a.experts) if e not in held]
        return a._replace(experts=[a.experts[i] for i in keep], probs=[a.probs[i] for i in keep])

    def _expert_graph(
        self, g: DeviceGraph, block: int, views: tuple[Tensor, Tensor, Tensor], m: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
        """m (input row, slot) pairs through the experts of `views`, weighted: out [n_embd, 1, m]."""
        n_embd = self.hp.n_embd
        ffn = self.view.expert_ffn(block)
        x = g.input(F32, (n_embd, 1, m))
        ids = g.input(I32, (1, m))
        w = g.input(F32, (1, 1, m))
        eids = g.input(I32, (1, m)) if ffn.biases is not None else None
        out = common.weighted_experts(g.ctx, views, x, ids, w, ffn, eids)
        return x, ids, w, eids, out

    def _expert_step(self, block: int, counts: tuple[int, int]) -> _ExpertStep:
        """The decode graph over `counts` experts in each buffer of a layer's slots (kept, lendable segment)."""
        key = (block, *counts)
        st = self._expert_steps.get(key)
        if st is None:
            assert self.experts is not None
            g = self._graph(64)
            try:
                segments = self.experts.segments(block)
                parts = [
                    _ExpertPart(*self._expert_graph(g, block, pool.views, m))
                    for (pool, _, _), m in zip(segments, counts, strict=False)
                    if m
                ]
                g.finish(*(p.out for p in parts), check=True)
            except Exception:
                g.close()
                raise
            st = self._expert_steps[key] = _ExpertStep(g, parts)
        return st

    def launch(self, block: int, cur: np.ndarray, sel: np.ndarray, weights: np.ndarray, held: list[int]) -> Launch:
        """Queues one decode token's experts that the VRAM holds on the device (the CPU goes on with the others):
        cur [1, n_embd], sel and weights [1, k]; `collect` waits for them."""
        assert self.experts is not None
        held_set = set(held)
        ranks = [j for j, e in enumerate(sel[0].tolist()) if e in held_set]
        slot_of = dict(zip(ranks, self.experts.slots(block, sel[0, ranks]).tolist(), strict=True))
        segments = self.experts.segments(block)
        groups = [[r for r in ranks if lo <= slot_of[r] < hi] for _, lo, hi in segments]
        st = self._expert_step(block, (len(groups[0]), len(groups[1]) if len(groups) > 1 else 0))
        used = [(grp, lo) for grp, (_, lo, _) in zip(groups, segments, strict=True) if grp]
        g = st.graph
        for part, (grp, lo) in zip(st.parts, used, strict=True):
            experts = sel[0, grp]
            g.set(part.x, np.ascontiguousarray(np.repeat(cur[:1], len(grp), axis=0), np.float32))
            g.set(part.ids, np.array([slot_of[r] - lo for r in grp], np.int32))
            g.set(part.w, np.ascontiguousarray(weights[0, grp], np.float32))
            if part.eids is not None:
                g.set(part.eids, experts.astype(np.int32))
        g.compute(wait=False)
        self._expert_reads.queue([p.out for p in st.parts])  # (copied behind the graph, into pinned memory)
        return Launch(st, [grp for grp, _ in used])

    def collect(self, launch: Launch, weighted: np.ndarray) -> None:
        """Waits for `launch`'s experts and puts their weighted outputs at their ranks of weighted [1, k, n]."""
        for out, ranks in zip(self._expert_reads.wait(), launch.ranks, strict=True):
            weighted[0, ranks] = out.reshape(len(ranks), -1)

    # ------------------------------------------------------------------------ a prompt's experts (ExpertCompute)
    def count_prompt_hits(self, block: int, n: int) -> None:
        if self.experts is not None:
            self.experts.count_prompt_hits(block, n)

    def from_vram(
        self, block: int, cur: np.ndarray, tokens: np.ndarray, experts: np.ndarray, weights: np.ndarray
    ) -> np.ndarray:
        """Weighted outputs [m, n_embd] of m (token, expert) pairs whose experts the VRAM holds."""
        assert self.experts is not None
        slots = self.experts.slots(block, experts)
        out = np.empty((len(tokens), self.hp.n_embd), np.float32)
        for pool, lo, hi in self.experts.segments(block):
            at = np.flatnonzero((slots >= lo) & (slots < hi))
            if at.size:
                args = (cur, tokens[at], slots[at] - lo, experts[at], weights[at])
                out[at] = self._pairs(block, pool.views, *args)
        return out

    def wave_on_gpu(self, n_pairs: int, n_experts: int) -> bool:
        """A prompt wave runs on the GPU when its experts serve enough tokens each to pay for their copies."""
        places = bool(self._staging)
        return self.experts is not None and places and n_pairs >= self.options.wave_min_tokens * max(n_experts, 1)

    def observe_prompt(self, block: int, sel: np.ndarray) -> None:
        if self.experts is not None:
            self.experts.observe_prompt(block, sel)

    def from_ram(
        self,
        block: int,
        cur: np.ndarray,
        tokens: np.ndarray,
        experts: np.ndarray,
        weights: np.ndarray,
        slot_of: np.ndarray,
    ) -> np.ndarray:
        """A prompt wave's pairs (sorted by expert) on the GPU: its experts are copied from their RAM slots into
        VRAM places, WAVE_PLACES at a time in two alternating sets (the next set's copies are queued before the
        current set computes: the host never waits for a copy), and computed there. Weighted outputs [m, n_embd]
        in pair order."""
        assert self.experts is not None
        streamer = self.scheduler.streamer
        row = streamer.li(block)
        n = WAVE_PLACES
        stage = self._staging[_key(_Geometry.of(streamer.layers[row]))]
        bounds = np.r_[0, np.flatnonzero(np.diff(experts)) + 1, len(experts)].tolist()
        groups = [(bounds[i], bounds[min(i + n, len(bounds) - 1)]) for i in range(0, len(bounds) - 1, n)]
        out = np.empty((len(experts), self.hp.n_embd), np.float32)
        places: list[dict[int, int]] = []

        def copy_up(i: int) -> None:
            lo, hi = groups[i]
            distinct = dict.fromkeys(experts[lo:hi].tolist())
            place = {e: (i % 2) * n + p for p, e in enumerate(distinct)}
            for e, p in place.items():
                self.experts_counters_add(block, stage.upload(p, streamer.pools[row][int(slot_of[e])], wait=False))
            places.append(place)

        copy_up(0)
        for i, (lo, hi) in enumerate(groups):
            if i + 1 < len(groups):
                copy_up(i + 1)  # (its set was last read by group i - 1, which is done)
            slots = np.array([places[i][e] for e in experts[lo:hi].tolist()], np.int32)
            out[lo:hi] = self._pairs(block, stage.views, cur, tokens[lo:hi], slots, experts[lo:hi], weights[lo:hi])
        return out

    def experts_counters_add(self, block: int, nbytes: int) -> None:
        assert self.experts is not None
        self.experts.counters[self.experts.row_of[block], BYTES_UP] += nbytes

    def _set_pairs(
        self,
        g: DeviceGraph,
        x: Tensor,
        ids: Tensor,
        w: Tensor,
        eids: Tensor | None,
        cur: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
        experts: np.ndarray,
        weights: np.ndarray,
    ) -> None:
        g.set(x, np.ascontiguousarray(cur[tokens], np.float32))
        g.set(ids, np.ascontiguousarray(slots, np.int32))
        g.set(w, np.ascontiguousarray(weights, np.float32))
        if eids is not None:
            g.set(eids, np.ascontiguousarray(experts, np.int32))

    def _pairs(
        self,
        block: int,
        views: tuple[Tensor, Tensor, Tensor],
        cur: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
        experts: np.ndarray,
        weights: np.ndarray,
    ) -> np.ndarray:
        """Weighted outputs of (token, slot) pairs through `views`, at most a prompt chunk's rows per graph."""
        out = np.empty((len(tokens), self.hp.n_embd), np.float32)
        step = self.device_chunk * self.hp.n_expert_used
        for lo in range(0, len(tokens), step):
            hi = min(lo + step, len(tokens))
            g = self._graph(64, prompt=True)
            try:
                x, ids, w, eids, o = self._expert_graph(g, block, views, hi - lo)
                g.finish(o)
                self._set_pairs(g, x, ids, w, eids, cur, tokens[lo:hi], slots[lo:hi], experts[lo:hi], weights[lo:hi])
                g.compute()
                out[lo:hi] = get_tensor(o).reshape(hi - lo, -1)
            finally:
                g.close()
        return out

    # ---------------------------------------------------------------------------------------- statistics
    def counters(self) -> np.ndarray | None:
        return self.experts.counters if self.experts is not None else None

    def describe(self) -> dict[str, Any]:
        e = self.experts
        return {
            "device": self.backend.device.label(),
            "budget": self.plan.budget,
            "layers": sorted(self.layers),
            "head": self.head,
            "expert_slots": e.n_slots if e is not None else 0,
            "lend_slots": e.n_lend if e is not None and self._lending else 0,  # of them, lent to each prompt
            "bytes": self.plan.used,
            "device_bytes": self.backend.held_bytes,  # in device buffers now, and at most so far
            "device_bytes_peak": self.backend.peak_bytes,
            "swaps_pending": e.pending if e is not None else 0,
            "decisions": e.decisions[:16] if e is not None else [],  # (decode token, swaps decided): the first
            "swaps_dropped": e.dropped if e is not None else 0,
        }

    def close(self) -> None:
        for st in self._decode.values():
            st.graph.close()
        self._decode.clear()
        if self._head_step is not None:
            self._head_step.graph.close()
            self._head_step = None
        for es in self._expert_steps.values():
            es.graph.close()
        self._expert_steps.clear()
        self._reads.close()
        self._expert_reads.close()
        if self.experts is not None:
            self.experts.close()
            self.experts = None
        for pool in self._staging.values():
            pool.close()
        self._staging.clear()
        if self._prompt_alloc is not None:
            self._prompt_alloc.close()
            self._prompt_alloc = None
        self._alloc.close()
        for dt in self._buffers:
            dt.close()
        self._buffers.clear()
        self.backend.close()


_NO_KV = common.KVCache(cast(Tensor, None), None, 0, 0)  # a layer the device does not hold (never read)


def _key(g: _Geometry) -> str:
    return f"{g.types}{g.shapes}"


def _shape(t: Tensor) -> tuple[int, ...]:
    ne = [int(t.contents.ne[i]) for i in range(4)]
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return tuple(ne)


def _name_of(weights: ModelWeights, t: Tensor) -> str:
    addr = ctypes.addressof(t.contents)
    for name, u in weights.tensors.items():
        if ctypes.addressof(u.contents) == addr:
            return name
    raise KeyError("a tensor outside the model's weights")
