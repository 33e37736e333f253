"""What the VRAM holds, and where (spec §5, §12): planned from the budget, then filled.

Placement (runtime/placement.py sizes it): whole layers' always-used weights and their KV cache first, then the
output head, then a hot-expert cache per streamed layer (runtime/vram/experts.py: seeded from the usage table,
swapped as decode moves on). The family's own layer graph runs on the device through a view of its model whose
weights are the device's copies (`device_view`): no family has GPU code of its own.
"""

from __future__ import annotations

import copy
import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from tokenwing.compute.backend import Backend, DeviceTensors
from tokenwing.compute.ggml_lib import Tensor, ops
from tokenwing.format.layout import ExpertLayer
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import human_bytes
from tokenwing.models import common
from tokenwing.models.base import MoEModel
from tokenwing.models.weights import ModelWeights
from tokenwing.runtime.kvcache import kv_element
from tokenwing.runtime.lookahead import Lookahead
from tokenwing.runtime.placement import (
    WAVE_PLACES,
    LayerCost,
    VramPlan,
    decode_reserve,
    device_reserve,
    padded,
    plan_keeping,
)
from tokenwing.runtime.scheduler import ExpertScheduler
from tokenwing.runtime.vram.experts import ExpertGeometry, ExpertPool, VramExperts
from tokenwing.streaming.usage import load_usage, usage_path

Log = Callable[[str], None]


@dataclass
class Place:
    """Where a layer graph takes its weights from: the family's model (or its device view), the KV caches and
    the lookahead's stacked routers (None: the lookahead's own, in RAM)."""

    model: MoEModel
    kv: Sequence[common.KVCache]
    routers: dict[int, Tensor] | None = None


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


def new_pool(backend: Backend, el: ExpertLayer, n_slots: int, within: tuple[int, int] | None = None) -> ExpertPool:
    """A pool of `n_slots` slots of layer `el`'s geometry in a device buffer of its own, or `within` (buffer,
    offset) another's (`ExpertPool.end`: where it ends there)."""
    tensors = DeviceTensors(backend, 3)
    g = ExpertGeometry.of(el)
    views = tuple(
        tensors.new(g.types[p], (g.shapes[p][0], g.shapes[p][1], n_slots), f"vram.{el.layer}.{p}") for p in range(3)
    )
    end = 0
    if within is not None:
        try:
            end = tensors.place_in(*within)
        except Exception:
            tensors.close()
            raise
    else:
        tensors.allocate()
    pool = ExpertPool(tensors, (views[0], views[1], views[2]), g, end)
    for p in range(3):  # an expert's projection is one slot of its pool: the file's bytes, nothing between
        stride = int(views[p].contents.nb[2])
        if stride != g.proj_size[p]:
            pool.close()
            raise ValueError(f"layer {el.layer}: a projection of {g.proj_size[p]} bytes in a slot of {stride}")
    return pool


def _geometry_key(el: ExpertLayer) -> str:
    g = ExpertGeometry.of(el)
    return f"{g.types}{g.shapes}"


@dataclass
class VramWeights:
    """What the device holds: the layers' always-used weights and KV caches, the output head, the experts' own
    tensors, the prompt waves' places and the hot-expert cache. `plan` sizes them for a budget, `fill` uploads
    the weights (and makes the device view of the model over them), `fill_experts` the cache."""

    backend: Backend
    mf: ModelFile
    model: MoEModel
    ram_weights: ModelWeights  # the family's weights in RAM (uploaded as the file has them)
    lookahead: Lookahead
    scheduler: ExpertScheduler
    kv_specs: list[common.KVSpec]
    n_ctx: int
    kv_type: str
    max_batch: int
    log: Log

    def __post_init__(self) -> None:
        self.hp, self.streamer = self.model.hp, self.scheduler.streamer
        self._buffers: list[DeviceTensors] = []
        # the prompt waves' places, one pool per expert geometry, and by streamed layer (which share them)
        self._wave_pools: dict[str, ExpertPool] = {}
        self.places: dict[int, ExpertPool] = {}
        self.experts: VramExperts | None = None
        # (what tests size budgets by: set by `plan`)
        self.costs: list[LayerCost] = []
        self.head_bytes = 0
        self.expert_row = 0  # one expert of every streamed layer on the device

    # ------------------------------------------------------------------------------------------ planning
    def _layer_names(self) -> dict[int, list[str]]:
        names: dict[int, list[str]] = {il: [] for il in range(self.hp.n_layer)}
        for name in self.ram_weights.tensors:
            parts = name.split(".", 2)
            if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < self.hp.n_layer:
                names[int(parts[1])].append(name)
        return names

    def _nbytes(self, t: Tensor) -> int:
        return int(ops.ggml_nbytes(t))

    def _extra(self, il: int) -> dict[str, Tensor]:
        """Tensors a layer's device graph needs beyond its own: the lookahead's stacked routers (named here; the
        norms of the layers they predict are folded into them)."""
        la = self.lookahead.fused.get(il)
        return {} if la is None else {f"lookahead.{il}": la[0]}

    def _costs(self) -> tuple[list[LayerCost], int]:
        _, elt = kv_element(self.kv_type)
        names = self._layer_names()
        hp, w = self.hp, self.ram_weights
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
        """The head's weights: every resident tensor outside the layers but the embedding (the output norm and
        projection, and a family's own: Kimi K3's final residual score), or the embedding where the output is it."""
        names = [n for n in self.ram_weights.tensors if not n.startswith("blk.") and n != "token_embd.weight"]
        return names if "output.weight" in names else [*names, "token_embd.weight"]

    def plan(self, budget: int, max_layers: int | None, lend: bool, keep: int = 0) -> tuple[VramPlan, bool]:
        """The plan for `budget`, and whether it lends the prompts' compute buffers from the expert cache (`lend`
        asks for it; see lending.py); `keep`: bytes left free for the image encoder (placement.plan_keeping)."""
        costs, head = self._costs()
        geos = {_geometry_key(el): ExpertGeometry.of(el) for el in self.streamer.layers}
        wave = sum(g.device_bytes for g in geos.values())
        reserve = device_reserve(self.hp, self.max_batch, self.n_ctx, wave)
        expert_bytes = [ExpertGeometry.of(el).device_bytes for el in self.streamer.layers]
        self.costs, self.head_bytes, self.expert_row = costs, head, sum(expert_bytes)
        limit = max_layers
        if limit != 0 and any(self.model.state_spec(il) is not None for il in range(self.hp.n_layer)):
            # A linear-attention layer's recurrent state and its checkpoints live in RAM (runtime/recurrent.py):
            # such a model's layers compute on the CPU, the VRAM holds its head and experts.
            self.log(
                "the layers of a linear-attention model compute on the CPU (their state lives in RAM): "
                "the VRAM holds its head and experts"
            )
            limit = 0
        layers = costs[:limit] if limit is not None else costs
        plan = plan_keeping(budget, reserve, layers, head, expert_bytes, self.hp.n_expert, keep)
        if lend:
            decode = decode_reserve(self.hp, self.n_ctx, wave)
            lent = plan_keeping(budget, decode, layers, head, expert_bytes, self.hp.n_expert, keep)
            if lent.expert_slots > 0 and plan.expert_slots < self.hp.n_expert:
                return lent, True
            # (no cache to lend, or every expert fits anyway: the prompt keeps its own VRAM)
        return plan, False

    def too_small(self, budget: int, plan: VramPlan) -> str:
        costs, _ = self._costs()
        smallest = min((c.total for c in costs), default=0)
        return (
            f"the VRAM budget {human_bytes(budget)} holds not even one layer ({human_bytes(smallest)} beside "
            f"{human_bytes(plan.reserve)} of compute buffers) or one expert per layer"
        )

    # ------------------------------------------------------------------------------------------- filling
    def _upload(self, names: Sequence[str], extra: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """One device buffer with these resident weights (and `extra` tensors), as the file has them."""
        extra = extra or {}
        host = {n: self.ram_weights.get(n) for n in names} | extra
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
        for el in self.streamer.layers:
            ffn = self.model.expert_ffn(el.layer)
            for t in ffn.biases or ():
                out[_name_of(self.ram_weights, t)] = t
        return out

    def fill(self, plan: VramPlan) -> None:
        """The planned layers' weights and KV caches, the head and the experts' own tensors on the device, and the
        view of the model (`view`) and the place (`place`) the device's graphs take them from."""
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
        kv = [kv_by_layer.get(il, _NO_KV) for il in range(self.hp.n_layer)]
        self.view = device_view(self.model, tensors)
        self.place = Place(self.view, kv, routers)

    def add_wave_places(self, el: ExpertLayer) -> ExpertPool:
        """The prompt waves' places of streamed layer `el`: two sets of WAVE_PLACES slots, shared by the layers
        of its geometry."""
        key = _geometry_key(el)
        if key not in self._wave_pools:
            self._wave_pools[key] = new_pool(self.backend, el, 2 * WAVE_PLACES)
        self.places[el.layer] = self._wave_pools[key]
        return self.places[el.layer]

    def drop_wave_places(self) -> None:
        for pool in self._wave_pools.values():
            pool.close()
        self._wave_pools.clear()
        self.places.clear()

    def fill_experts(self, n_slots: int, n_lend: int, lend_buffer: int | None) -> None:
        """The hot-expert cache: `n_slots` per streamed layer, its last `n_lend` in `lend_buffer` (the prompts'
        compute buffer), seeded hottest first from the usage table (all of them when every expert fits)."""
        s = self.scheduler
        streamer = self.streamer
        self.experts = VramExperts(
            self.backend,
            list(streamer.layers),
            s.n_expert,
            n_slots,
            self._ram_record,
            lambda row, experts: streamer.ready(streamer.layers[row].layer, experts),
            streamer.checksums,
            functools.partial(new_pool, self.backend),
            n_lend,
        )
        self.experts.allocate(lend_buffer)
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

    def file_record(self, row: int, expert: int) -> np.ndarray:
        """An expert's record as the file has it (`row`: its streamed layer's)."""
        return self._read_file(self.streamer.layers[row].layer, expert)

    def _read_file(self, layer: int, expert: int) -> np.ndarray:
        return np.frombuffer(self.mf.read_expert(layer, expert), np.uint8)

    def _start_record(self, layer: int, expert: int) -> np.ndarray:
        """An expert's record at start: from its RAM slot when every expert was read already, else the file."""
        s = self.scheduler
        if s.slot_map is not None:
            return s.streamer.expert_bytes(layer, int(s.slot_map[layer][expert]))
        return self._read_file(layer, expert)

    def _ram_record(self, row: int, expert: int) -> np.ndarray | None:
        """The RAM slot holding an expert now (the swap helper copies it and checks its checksum)."""
        streamer = self.streamer
        where = streamer.core.resident_experts(row)
        try:
            slot = where.index(expert)
        except ValueError:
            return None
        row_bytes: np.ndarray = streamer.pools[row][slot]
        return row_bytes

    # ------------------------------------------------------------------------------------------- the end
    def close_experts(self) -> None:
        """The hot-expert cache and the prompt waves' places."""
        if self.experts is not None:
            self.experts.close()
            self.experts = None
        self.drop_wave_places()

    def close(self) -> None:
        self.close_experts()
        for dt in self._buffers:
            dt.close()
        self._buffers.clear()


_NO_KV = common.KVCache(cast(Tensor, None), None, 0, 0)  # a layer the device does not hold (never read)


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
