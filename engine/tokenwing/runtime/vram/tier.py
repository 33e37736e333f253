"""The VRAM tier (spec §5, §9, §11, §12): the layers, output head and hot experts a GPU holds, and how a session
computes with them.

Device and CPU graphs never share a graph: ggml's scheduler splits between lavapipe and the CPU crashed
intermittently (docs/results.md), so each device graph runs wholly on the device and the small activations
between the two sides are copied explicitly (a layer's input in, its router outputs and hidden states out).

`VramTier` creates its parts and hands each what it needs; a part calls the parts listed before it and the layers
below (compute/backend.py, runtime/placement.py, runtime/vram/experts.py), never back up into the tier:
weights.py plans what the VRAM holds and fills it (the only maker of device tensors: weights, KV caches and the
expert pools of experts.py, the hot-expert cache); source.py gives the device graphs their compute buffers and
the prompt chunk size (the only maker of device graphs and graph allocators); graphs.py builds the layer graphs
and the output head; lending.py gives a prompt's graphs memory the expert cache lends; decode_experts.py computes
a decode token's experts, prompt_waves.py a prompt's.

A device that fails (`DeviceError`) ends the tier: the session says so in one line and continues on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.compute.backend import Backend, DeviceError, Readback
from tokenwing.compute.devices import DeviceChoice
from tokenwing.format.reader import ModelFile
from tokenwing.models import common
from tokenwing.models.base import MoEModel
from tokenwing.models.weights import ModelWeights
from tokenwing.runtime.lookahead import Lookahead
from tokenwing.runtime.placement import LayerCost
from tokenwing.runtime.scheduler import ExpertScheduler
from tokenwing.runtime.vram.decode_experts import DecodeExperts
from tokenwing.runtime.vram.experts import VramExperts
from tokenwing.runtime.vram.graphs import DeviceGraphs, LayerGraph
from tokenwing.runtime.vram.lending import Lending
from tokenwing.runtime.vram.prompt_waves import WAVE_MIN_TOKENS, PromptWaves
from tokenwing.runtime.vram.source import GraphSource
from tokenwing.runtime.vram.weights import Log, VramWeights


@dataclass(frozen=True)
class VramOptions:
    max_layers: int | None = None  # at most this many layers' always-used weights in VRAM (None: all that fit)
    wave_min_tokens: int = WAVE_MIN_TOKENS  # tokens per expert from which a prompt wave runs on the GPU
    # A prompt's compute buffers and GPU waves' places go into memory the VRAM expert cache lends it (refilled
    # after the prompt), instead of VRAM kept apart for them: decode keeps those bytes for experts (spec §11)
    lend: bool = False
    # VRAM left free for the image encoder (`--mmproj` with a device: its weights and largest image's compute
    # buffer), out of the expert cache where the layers and head still fit (placement.plan_keeping)
    keep: int = 0


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
        self.log = log
        self.backend = Backend(choice.device)
        # decode steps' outputs (a layer's, the head's) and the device's share of a token's experts, each read into
        # pinned memory behind its graph; two, as a launch's read is in flight while the CPU computes its share
        self._reads = Readback(self.backend)
        self._expert_reads = Readback(self.backend)
        self.weights = VramWeights(
            self.backend, mf, model, weights, lookahead, scheduler, kv_specs, n_ctx, kv_type, max_batch, log
        )
        self.source = GraphSource(self.backend, self.weights, max_batch, log)
        self.graphs = DeviceGraphs(self.source, self.weights, self._reads, layer_graph, log)
        self.lending = Lending(self.source, self.graphs, self.weights, self.options.lend, log)
        self.decode = DecodeExperts(self.source, self.graphs, self.weights, self._expert_reads)
        self.waves = PromptWaves(self.source, self.graphs, self.weights, self.options.wave_min_tokens)
        # What the session and its experts' compute call, straight to the part that does it: each pass's start,
        # the layers and the head, a decode token's experts, a prompt's (runtime/experts.py's DeviceExperts)
        graphs, decode, waves = self.graphs, self.decode, self.waves
        self.begin_pass = self.lending.begin_pass
        self.has_layer, self.layer_chunk, self.logits = graphs.has_layer, graphs.layer_chunk, graphs.logits
        self.held, self.not_held = decode.held, decode.not_held
        self.launch, self.collect = decode.launch, decode.collect
        self.count_prompt_hits, self.observe_prompt = waves.count_prompt_hits, waves.observe_prompt
        self.from_vram, self.from_ram, self.wave_on_gpu = waves.from_vram, waves.from_ram, waves.wave_on_gpu
        try:
            self.plan, self.lending.on = self.weights.plan(
                choice.vram_budget, self.options.max_layers, self.lending.on, self.options.keep
            )
            if self.plan.empty:
                raise DeviceError(self.weights.too_small(choice.vram_budget, self.plan))
            self._fill()
        except Exception:
            self.close()
            raise
        self.source.started = True

    # ------------------------------------------------------------------------------------------- filling
    def _fill(self) -> None:
        self.weights.fill(self.plan)
        self.graphs.check_layers(self.plan)
        self._fill_experts(self.plan.expert_slots)
        self._reserve()

    def _fill_experts(self, n_slots: int) -> None:
        """The prompt waves' VRAM places and the hot-expert cache, once the device is known to run the experts'
        ops (else every expert computes on the CPU)."""
        try:
            for el in self.weights.streamer.layers:
                self.graphs.check_experts(el.layer, self.weights.add_wave_places(el).views)
        except (DeviceError, KeyError) as e:
            self.log(f"experts compute on the CPU: {e}")
            self.weights.drop_wave_places()
            return
        n_lend, buffer = 0, None
        if self.lending.on and n_slots:
            n_slots, n_lend, buffer = self.lending.reserve_prompts(n_slots)
            n_slots += n_lend
        self.weights.fill_experts(n_slots, n_lend, buffer)

    def _reserve(self) -> None:
        """Places the largest graph of every kind once, so the compute buffer never grows later (a growth keeps
        the old buffer: see `GraphAllocator`): a decode step over the whole context, the head for one token, a
        token's experts, and without lending a prompt's graphs at `device_chunk` tokens (`prompt_graphs`; with
        lending those have an allocator of their own: `Lending.reserve_prompts`). A chunk whose buffer cannot be
        allocated is halved (spec §12: a prompt whose GPU tensors cannot fit is split into calls that do), with one
        line."""

        def place() -> None:
            for build in [] if self.lending.on else self.graphs.prompt_graphs(self.source.device_chunk):
                self.source.place_graph(build)
            self.graphs.reserve_decode()
            self.decode.reserve_experts()

        self.source.reserve_largest(place, split=not self.lending.on)

    # ------------------------------------------------------------------------------------ what it holds
    @property
    def experts(self) -> VramExperts | None:
        """The hot-expert cache (None: every expert computes on the CPU)."""
        return self.weights.experts

    @property
    def head(self) -> bool:
        """The output head computes on the device."""
        return self.graphs.head

    @property
    def costs(self) -> list[LayerCost]:  # (these three: what tests size budgets by)
        return self.weights.costs

    @property
    def head_bytes(self) -> int:
        return self.weights.head_bytes

    @property
    def expert_row(self) -> int:
        return self.weights.expert_row

    # ---------------------------------------------------------------------------------------- statistics
    def counters(self) -> np.ndarray | None:
        return self.experts.counters if self.experts is not None else None

    def describe(self) -> dict[str, Any]:
        e = self.experts
        return {
            "device": self.backend.device.label(),
            "budget": self.plan.budget,
            "layers": sorted(self.graphs.layers),
            "head": self.head,
            "expert_slots": e.n_slots if e is not None else 0,
            "lend_slots": e.n_lend if e is not None and self.lending.on else 0,  # of them, lent to each prompt
            "bytes": self.plan.used,
            "device_bytes": self.backend.held_bytes,  # in device buffers now, and at most so far
            "device_bytes_peak": self.backend.peak_bytes,
            "swaps_pending": e.pending if e is not None else 0,
            "decisions": e.decisions[:16] if e is not None else [],  # (decode token, swaps decided): the first
            "swaps_dropped": e.dropped if e is not None else 0,
        }

    def close(self) -> None:
        self.graphs.close()
        self.decode.close()
        self._reads.close()
        self._expert_reads.close()
        self.weights.close_experts()  # (the cache's lendable segments live in the prompts' compute buffer)
        self.source.close()
        self.weights.close()
        self.backend.close()
