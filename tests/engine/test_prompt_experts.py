"""A prompt's experts in ggml's repacked layouts (experts read at start, in RAM): one 2-D product per expert through
ggml's 4-row kernel, every expert's rows padded to a multiple of four (models/common.py `grouped_experts`, used by
runtime/experts.py). The 4-row and the 1-row kernels round differently, so without the padding a row's result
would depend on how many rows its expert had in its graph: on the prompt's other tokens, its chunks, its waves."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.conftest import ModelFactory
from tokenwing.compute import ggml_api as ggml
from tokenwing.compute.ggml_lib import Graph, Repacker, TensorArena, aligned_bytes, quantize, to_numpy
from tokenwing.models import common
from tokenwing.runtime.session import Session, SessionOptions

N_EMBD, N_FF, N_SLOTS = 256, 256, 6


def _pool() -> tuple[TensorArena, tuple[object, object, object], list[list[object] | None], np.ndarray]:
    """A slot pool of Q4_K experts (gate, up, down in each slot's record), repacked slot by slot as the streaming
    core's transform does, with its 3-D views and each projection's per-slot 2-D tensors."""
    rng = np.random.default_rng(5)
    q4k = ggml.GGML_TYPE_Q4_K
    proj = [
        quantize(rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.1, q4k)
        for n_out, n_in in [(N_FF, N_EMBD)] * N_SLOTS * 2 + [(N_EMBD, N_FF)] * N_SLOTS
    ]
    size = proj[0].nbytes
    record = 3 * size
    mem = aligned_bytes(record * N_SLOTS)
    for s in range(N_SLOTS):
        for p, q in enumerate((proj[s], proj[N_SLOTS + s], proj[2 * N_SLOTS + s])):
            mem[s * record + p * size : s * record + (p + 1) * size] = q
    arena, repacker = TensorArena(64), Repacker()
    row = size // N_FF
    views, per_slot = [], []
    for p in range(3):
        view = arena.wrap(mem.ctypes.data + p * size, q4k, (N_EMBD, N_FF, N_SLOTS), mem, (144, row, record))
        assert repacker.prepare(view)  # (mul_mat_id reads the repacked bytes through it, as ExpertPools' views)
        views.append(view)
        slots = [arena.wrap(mem.ctypes.data + s * record + p * size, q4k, (N_EMBD, N_FF), mem) for s in range(N_SLOTS)]
        assert all(repacker.repack(t, size) for t in slots), "this CPU has ggml's repacked Q4_K kernels"
        per_slot.append(slots)
    return arena, (views[0], views[1], views[2]), per_slot, mem


def _outputs(
    views: tuple[object, ...], per_slot: list[list[object] | None], rows: np.ndarray, slots: np.ndarray
) -> np.ndarray:
    g = Graph(64 << 20, 2)
    try:
        g.reset()
        w = np.linspace(0.5, 1.5, 32)[: len(slots)].astype(np.float32)  # (row i's weight whatever the rows)
        out, order = common.grouped_experts(
            g, views, per_slot, rows, np.arange(len(slots)), slots, w, slots, common.SWIGLU
        )  # type: ignore[arg-type]
        g.compute(*order, out)
        picked: np.ndarray = to_numpy(out).reshape(-1, N_EMBD)[common.grouped_rows(slots)]
        return picked
    finally:
        g.close()


def test_a_rows_result_does_not_depend_on_its_experts_other_rows() -> None:
    arena, views, per_slot, _mem = _pool()
    try:
        rng = np.random.default_rng(6)
        rows = rng.standard_normal((23, N_EMBD)).astype(np.float32)
        # expert 0 with 1, 2, 3, 5 and 9 rows, then the same rows among 23 of expert 0 and others
        for n in (1, 2, 3, 5, 9):
            few = _outputs(views, per_slot, rows[:n], np.zeros(n, np.int32))
            more = np.sort(np.r_[np.zeros(n + 6, np.int32), rng.integers(1, N_SLOTS, 23 - n - 6)]).astype(np.int32)
            assert np.array_equal(few, _outputs(views, per_slot, rows, more)[:n]), n
        # and the per-expert 4-row kernel computes what mul_mat_id's 1-row kernel does, up to its rounding
        slots = np.sort(rng.integers(0, N_SLOTS, 23)).astype(np.int32)
        g = Graph(64 << 20, 2)
        g.reset()
        w = np.linspace(0.5, 1.5, 32)[:23].astype(np.float32)
        plain = common.routed_experts(g, views, rows, np.arange(23), slots, w, slots, common.SWIGLU)  # type: ignore[arg-type]
        g.compute(plain)
        want = to_numpy(plain).reshape(-1, N_EMBD).copy()
        g.close()
        np.testing.assert_allclose(_outputs(views, per_slot, rows, slots), want, rtol=0, atol=2e-3 * np.abs(want).max())
    finally:
        arena.close()


def test_the_session_multiplies_repacked_experts_per_expert(repacked_factory: ModelFactory) -> None:
    """The prompt path takes the per-expert products where experts are repacked (read at start, in RAM)."""
    model: Path = repacked_factory(type="Q4_K_M", preset="kquant", n_layer=2)
    s = Session(str(model), SessionOptions(n_ctx=128), log=lambda line: None)
    try:
        assert sum(p is not None for per in s.pools.per_slot.values() for p in per) >= 4  # gate and up of each layer
        logits = s.forward(np.random.default_rng(1).integers(0, 200, 40).tolist(), all_logits=True, prompt=True)
        assert np.isfinite(logits).all()
    finally:
        s.close()


def test_a_tokens_sum_does_not_depend_on_the_order_its_experts_come_in(repacked_factory: ModelFactory) -> None:
    """Each prompt pass orders its own experts (by recency: `ExpertScheduler.prompt_order`), so a token's experts
    come in one order when its pass is the token alone and in the reverse order when later tokens use them more;
    its sum of their outputs is the same bits either way (an F64 running sum: in F32, a Kimi K3 prompt split into
    passes differed from the same prompt in one pass, on an AVX2 machine)."""
    model = repacked_factory(arch="qwen3moe", type="F32", n_expert=16, n_expert_used=4)
    s = Session(str(model), SessionOptions(usage_table=False), log=lambda line: None)
    try:
        block = s.streamed[0]
        token = [1, 5, 9, 13]
        # later tokens use 1, 5, 9 and 13 five, four, three and two times in all: the pass puts them last, reversed
        later = [[1, 5, 9, 13], [1, 5, 9, 0], [1, 5, 2, 3], [1, 4, 6, 7]]
        sel = np.array([token, *later], np.int32)
        order = s.scheduler.prompt_order(sel, s.hp.n_expert)
        assert [e for e in order if e in token] == token[::-1]
        assert s.scheduler.prompt_order(sel[:1], s.hp.n_expert) == token
        rng = np.random.default_rng(11)
        cur = rng.standard_normal((len(sel), s.hp.n_embd)).astype(np.float32)
        weights = rng.uniform(0.1, 1.0, sel.shape).astype(np.float32)
        alone = s.experts.prompt(block, cur[:1], sel[:1], weights[:1])
        together = s.experts.prompt(block, cur, sel, weights)
        assert alone.dtype == together.dtype == np.float32
        assert np.array_equal(alone[0], together[0])
    finally:
        s.close()
