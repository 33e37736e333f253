"""Several sequences' decode tokens as the rows of one graph: the grouping, their placement and their caches.
Shared by the layer-at-a-time steps (batch.py) and the one-graph step (token_graph.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenwing.compute.ggml_lib import Tensor
from tokenwing.models import common
from tokenwing.runtime.kvcache import KVCaches


def groups_of(items: list[int], size: int) -> list[list[int]]:
    """`items` in consecutive groups of `size` (the last one shorter)."""
    return [items[i : i + size] for i in range(0, len(items), max(size, 1))]


def rows_placement(
    ctx: Any, parts: list[common.Placement], positions: Tensor, caches: list[KVCaches]
) -> common.Placement:
    """Several sequences' decode tokens as the rows of one graph: a placement whose positions are theirs (in
    order; what RoPE reads) and whose parts each attend over their own cache — those of consecutive slots of the
    stacked caches with equal windows in one product (`common.batch_runs`)."""
    slots = [kv.slot for kv in caches]
    runs = common.batch_runs(ctx, parts, [s for s in slots if s is not None]) if None not in slots else ()
    return dataclasses.replace(parts[0], n=len(parts), positions=positions, parts=tuple(parts), runs=runs)


def rows_cache(caches: list[KVCaches], il: int) -> common.BatchKV:
    """The caches of layer il of a batch's sequences (`rows_placement`)."""
    layer = [common.kv_cache(kv[il]) for kv in caches]
    c0 = layer[0]
    return common.BatchKV(c0.k, c0.v, c0.elt, c0.v_width, c0.stack, c0.index, tuple(layer))
