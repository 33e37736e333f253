"""Lending (`--vram-lend`, spec §11): the plan keeps apart only decode's compute buffers and the waves' places, and
gives the rest of a prompt chunk's to expert slots. The prompts' graphs are planned by a GraphAllocator of their
own, reserved once for the largest of them, and the expert cache's lendable segments live in its buffer
(`Lending.reserve_prompts`): each prompt pass starts with `begin_pass`, where the cache gives the segments up
(each layer's coldest experts leave VRAM), and the first decode step after it refills them from RAM (else the
file). The device buffers the tier holds do not change through a prompt (`Backend.held_bytes`).
"""

from __future__ import annotations

from tokenwing.compute.backend import DeviceMemoryError
from tokenwing.compute.ggml_lib import ops
from tokenwing.runtime.vram.experts import ExpertGeometry
from tokenwing.runtime.vram.graphs import DeviceGraphs
from tokenwing.runtime.vram.source import Builder, GraphSource
from tokenwing.runtime.vram.weights import Log, VramWeights


class Lending:
    def __init__(self, source: GraphSource, graphs: DeviceGraphs, weights: VramWeights, on: bool, log: Log) -> None:
        self.source, self.graphs, self.weights, self.log = source, graphs, weights, log
        self.on = on  # `--vram-lend`, while the plan and the cache can lend
        # (device_chunk, the prompt's graph whose buffer is the largest at it, that buffer's bytes)
        self._largest: tuple[int, Builder, int] | None = None

    def reserve_prompts(self, n_slots: int) -> tuple[int, int, int | None]:
        """The prompts' GraphAllocator, reserved for their largest graph (`device_chunk` halved until the cache can
        lend it: every layer keeps a slot), and the slots of the cache around it — (kept slots, lendable slots,
        the allocator's buffer, where the lendable segments live). Allocated once, never freed while the tier
        lives: freeing a graph allocator's buffer (its graphs closed, the device synchronized, another graph
        computed between) left ggml-vulkan on lavapipe corrupting the heap at a later graph, 5 runs in 5 with the
        first decode step after a prompt; expert pools' buffers were freed safely."""
        source, row = self.source, self.weights.expert_row
        while True:
            build, size = self._largest_prompt_graph()
            lent, freed = size // row, -(-size // row)
            if n_slots - freed >= 1 or source.device_chunk == 1:
                break
            source.halve_chunk()
        if n_slots - freed < 1:
            self.on = False
            self.log("the VRAM expert cache is too small to lend a prompt its compute buffer: prompts keep their own")
            return n_slots, 0, None
        try:
            buffer = source.reserve_prompts(build, size)
        except DeviceMemoryError:
            if source.device_chunk == 1:
                raise
            source.halve_chunk()  # (the device refused it: as `GraphSource.reserve_largest` does)
            return self.reserve_prompts(n_slots)
        source.note_chunk()
        if buffer is None:
            return n_slots - freed, 0, None
        align = int(ops.ggml_backend_buffer_get_alignment(buffer))
        room = int(ops.ggml_backend_buffer_get_size(buffer))
        geos = [ExpertGeometry.of(el) for el in self.weights.streamer.layers]
        while lent and sum(-(-lent * n // align) * align for g in geos for n in g.proj_size) > room:
            lent -= 1  # (each tensor starts at the buffer's alignment)
        return n_slots - freed, lent, buffer

    def _largest_prompt_graph(self) -> tuple[Builder, int]:
        """The prompt graph whose buffer is the largest at `device_chunk`, and its bytes (measured, nothing
        allocated): every other fits the buffer reserved for it."""
        chunk = self.source.device_chunk
        if self._largest is None or self._largest[0] != chunk:
            best, size = None, -1
            for build in self.graphs.prompt_graphs(chunk):
                n = self.source.measure(build)
                if n > size:
                    best, size = build, n
            assert best is not None
            self._largest = (chunk, best, size)
        return self._largest[1], self._largest[2]

    def begin_pass(self, decode: bool) -> None:
        """Before each forward pass: a prompt pass takes the cache's lendable segments for its compute buffer
        (`--vram-lend`: the coldest experts leave VRAM); the first decode step after it refills them, then each
        decode step moves staged swaps in (between two steps, never inside one)."""
        cache = self.weights.experts
        if cache is None:
            return
        if not decode:
            cache.lend()
            return
        cache.take_back(self.weights.file_record)
        cache.between_steps()
