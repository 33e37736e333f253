"""A graph built once and rerun (compute/ggml_lib.py `StaticGraph`): its inputs written and its outputs read
through numpy arrays over the tensors' own memory, as a decode step does every token (runtime/token_graph.py)."""

from __future__ import annotations

import numpy as np

from tokenwing.compute.ggml_lib import F32, I32, Graph, StaticGraph, ops, to_numpy


def test_arrays_over_a_placed_graph_carry_each_runs_inputs_and_outputs() -> None:
    owner = Graph(1 << 20, 1)
    g = StaticGraph(64, owner)
    try:
        x = g.input(F32, (4, 2))
        ids = g.input(I32, (2,))
        unread = g.input(F32, (3,))  # no node reads it: ggml does not place it
        y = ops.ggml_get_rows(g.ctx, ops.ggml_scale(g.ctx, x, 2.0), ids)
        g.finish(y)

        assert g.array(unread) is None
        xs, got = g.array(x), g.array(y)
        assert xs is not None and got is not None
        assert xs.shape == (2, 4) and xs.dtype == np.float32 and got.shape == (2, 4)
        assert g.array(x) is xs  # (made once per tensor)

        rows = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.copyto(xs, rows)
        ids_in = g.array(ids)
        assert ids_in is not None and ids_in.dtype == np.int32
        np.copyto(ids_in, np.array([1, 0], np.int32))
        assert np.array_equal(to_numpy(ids), [1, 0]) and np.array_equal(to_numpy(x), rows)  # (in ggml's memory)
        g.compute()
        first = got.copy()
        assert np.array_equal(first, 2 * rows[[1, 0]])

        # The same arrays on the next run: the output's is live memory (a caller copies what it keeps)
        np.copyto(xs, -rows)
        g.compute()
        assert np.array_equal(got, -2 * rows[[1, 0]])
        assert np.array_equal(first, 2 * rows[[1, 0]])
    finally:
        g.close()
        owner.close()
