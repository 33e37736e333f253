"""Where the tier's device graphs come from: their compute buffers (one GraphAllocator for all of them, and with
lending one of the prompts' own), and how many prompt tokens a device graph takes (`device_chunk`: halved
wherever the device cannot hold a chunk's tensors, spec §12), which the layer graphs, lending and the prompt waves
all read.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from tokenwing.compute.backend import Backend, DeviceGraph, DeviceMemoryError, GraphAllocator
from tokenwing.compute.ggml_lib import Tensor
from tokenwing.runtime.vram.weights import Log, VramWeights

Parts = dict[str, np.ndarray]
# A graph a prompt computes, built into a DeviceGraph: its outputs (what `place_graph` and lending place)
Builder = Callable[[DeviceGraph], list[Tensor]]
# Test-only (a mock: a driver cannot be made to run out of memory at a chosen moment): the N-th device graph
# built after the tier started fails to allocate, as a device that runs out of memory mid-run would.
FAIL_ENV = "TOKENWING_TEST_VRAM_FAIL"
MAX_NODES = 4096


class GraphSource:
    """The one maker of the tier's device graphs and their graph allocators."""

    def __init__(self, backend: Backend, weights: VramWeights, max_batch: int, log: Log) -> None:
        self.backend, self.log, self.max_batch = backend, log, max_batch
        self._weights = weights
        # every device graph of the tier: one compute buffer, reserved for the largest graphs at start
        # (`VramTier._reserve`); closed with the source
        self.alloc = GraphAllocator(backend)
        # lending: the prompts' own compute buffer, which holds the cache's lendable segments between prompts
        self.prompt_alloc: GraphAllocator | None = None
        self.device_chunk = max_batch  # prompt tokens per device graph
        self._split_note = False
        self._graphs_built = 0
        self._fail_at = int(os.environ.get(FAIL_ENV) or 0)  # (test-only)
        self.started = False

    def graph(self, max_nodes: int, prompt: bool = False) -> DeviceGraph:
        """A device graph in the tier's compute buffer; `prompt`: a graph of a prompt pass, which with lending
        goes into the prompts' own allocator."""
        if self.started and self._fail_at:
            self._graphs_built += 1
            if self._graphs_built == self._fail_at:
                raise DeviceMemoryError(f"{self.backend.device.name} could not allocate a graph ({FAIL_ENV})")
        alloc = self.alloc
        if prompt and self.prompt_alloc is not None:
            experts = self._weights.experts
            if experts is not None and experts.n_lend and not experts.lent:
                raise RuntimeError("a prompt's device graph outside a prompt pass (VramTier.begin_pass)")
            alloc = self.prompt_alloc
        return DeviceGraph(self.backend, max_nodes, allocator=alloc)

    def measure(self, build: Builder) -> int:
        """Bytes the tier's compute buffer would need for the graph `build` makes (nothing allocated)."""
        g = DeviceGraph(self.backend, MAX_NODES)
        try:
            return g.measure(self.alloc, *build(g))
        finally:
            g.close()

    def reserve_prompts(self, build: Builder, size: int) -> int | None:
        """Lending: the prompts' own GraphAllocator, of at most `size` bytes, reserved by placing the graph `build`
        makes (`Lending.reserve_prompts`); returns its compute buffer (None: the graph needed none). A device that
        refuses it raises DeviceMemoryError, and nothing is kept."""
        alloc = GraphAllocator(self.backend, limit=size)
        g = DeviceGraph(self.backend, MAX_NODES, allocator=alloc)
        try:
            g.finish(*build(g))
            buffer = g.compute_buffer
        except Exception:
            alloc.close()
            raise
        finally:
            g.close()
        self.prompt_alloc = alloc
        return buffer

    def halve_chunk(self) -> None:
        self.device_chunk = max(1, self.device_chunk // 2)

    def place_graph(self, build: Builder) -> None:
        """Reserves the compute buffer for a graph (built, placed and closed: nothing computed)."""
        g = self.graph(MAX_NODES)
        try:
            g.finish(*build(g))
        finally:
            g.close()

    def reserve_largest(self, place: Callable[[], None], split: bool) -> None:
        """`place` (the largest graphs at `device_chunk`) until their buffer can be allocated: with `split`, the
        chunk halved at each refusal; then one line if it shrank."""
        while True:
            try:
                place()
                break
            except DeviceMemoryError:
                if not split or self.device_chunk == 1:
                    raise
                self.halve_chunk()
        self.note_chunk()

    def note_chunk(self) -> None:
        if self.device_chunk < self.max_batch and not self._split_note:
            self._split_note = True
            self.log(
                f"a prompt's GPU tensors for {self.max_batch} tokens do not fit in VRAM: prompts run "
                f"{self.device_chunk} tokens at a time on the GPU"
            )

    def split(self, rows: np.ndarray, pos0: int, run: Callable[[np.ndarray, int], Parts]) -> Parts:
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

    def close(self) -> None:
        if self.prompt_alloc is not None:
            self.prompt_alloc.close()
            self.prompt_alloc = None
        self.alloc.close()
