"""Where a graph's tokens go and what they attend over (`Placement`, `placement`): positions, the KV window
rounded up to DECODE_WINDOW and masked, and a batch's sequences (`Run`, `batch_runs`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import Graph, Tensor, ops

# ------------------------------------------------------------------------------------------ where tokens go
# Decode attends over the cache rounded up to this many positions, masked (llama.cpp pads to 256): one graph
# serves that many positions, and the masked keys add exact zeros to sums whose SIMD blocks (32 F16 values) are
# unchanged, so the bits do not depend on it (tested: 384 decode steps of the demo model give identical logits with
# 64 and 256). Why not 256: a query's dot products with masked keys are most of a short context's attention — on
# the demo model at 512 positions of context, one thread, a token took 1.04 ms over 256-position windows and
# 0.69 ms over 64-position ones, and 4 sequences' step 3.26 against 2.06 ms; a graph is rebuilt 4× as often.
DECODE_WINDOW = 64


@dataclass(frozen=True)
class Placement:
    """Where a graph's `n` tokens go: positions pos0…pos0+n-1 of the KV cache, attending over its first `n_kv`
    positions (decode: rounded up to DECODE_WINDOW and masked, so that one graph, and one rounding of the
    attention sums, serves DECODE_WINDOW positions). The tensors are inputs of the graph, shared by its layers."""

    n: int
    n_kv: int
    positions: Tensor  # I32 [n] (multi-axis RoPE: [4 n], the text positions on three axes and 0 on the fourth)
    mask: Tensor  # F32 [n_kv, n]
    k_rows: Tensor  # I64 [n]: the tokens' rows in the K cache
    v_cells: Tensor | None  # I64 [n · v_width]: their elements in the (transposed) V cache; None: no V cache
    mask_swa: Tensor | None = None  # F32 [n_kv, n]: the mask of sliding-window layers (gpt-oss), if any
    # A prompt's chunks attend through F32 tiled flash attention: these masks in F16, padded to FLASH_ROWS queries
    # (see `attend`); None: the two matrix products
    flash_mask: Tensor | None = None
    flash_mask_swa: Tensor | None = None
    # Several sequences' decode tokens in one graph (runtime/batch.py): token i is sequence i's, at its own
    # position of its own cache (`BatchKV`), placed by parts[i]; `attend` attends each over its cache alone
    parts: tuple[Placement, ...] = ()
    # The first position, where the graph is built for its positions (`placement`); None in a graph reused for
    # several (the one-graph decode step): a family whose layer graph depends on it (DeepSeek V4's compressed
    # blocks) is never given one (`MoEModel.position_graphs`)
    pos0: int | None = None
    # ... and which of them attend in one product (`batch_runs`): consecutive tokens of consecutive slots of the
    # caches' stack with equal windows; empty: each apart
    runs: tuple[Run, ...] = ()


@dataclass(frozen=True)
class Run:
    """`count` consecutive tokens of a batch, from `start`, whose sequences' caches are consecutive slots of one
    `KVStack` and whose windows are equal: their attention reads go through one product over the stack (the
    parts' masks stacked, [n_kv, 1, 1, count])."""

    start: int
    count: int
    mask: Tensor
    mask_swa: Tensor | None


def batch_runs(ctx: Any, parts: list[Placement], slots: list[int]) -> tuple[Run, ...]:
    """The runs of a batch whose tokens belong to the caches' stack slots `slots` (in token order): maximal
    stretches of consecutive slots with equal windows; a run of one attends on its own. The stacked masks are
    built here, once per graph (every layer reads them)."""

    def stacked(masks: list[Tensor]) -> Tensor:
        m = ops.ggml_reshape_4d(ctx, masks[0], int(masks[0].contents.ne[0]), 1, 1, 1)
        for other in masks[1:]:
            m = ops.ggml_concat(ctx, m, ops.ggml_reshape_4d(ctx, other, int(other.contents.ne[0]), 1, 1, 1), 3)
        return m

    runs: list[Run] = []
    start = 0
    for i in range(1, len(parts) + 1):
        if i < len(parts) and slots[i] == slots[i - 1] + 1 and parts[i].n_kv == parts[start].n_kv:
            continue
        group = parts[start:i]
        if len(group) > 1:
            swa_masks = [p.mask_swa for p in group if p.mask_swa is not None]
            swa = stacked(swa_masks) if swa_masks else None
            runs.append(Run(start, len(group), stacked([p.mask for p in group]), swa))
        start = i
    return tuple(runs)


class Chunks(int):
    """A window of llama.cpp's chunked kind (LLAMA_SWA_TYPE_CHUNKED, Llama 4): a query at position p sees the keys
    from its chunk's start, p // span · span, not the last `span` positions. An int, the span, so that the runtime
    hands it on as it does a sliding window (`MoEModel.window`); `placement_arrays` masks by its kind."""


FLASH_ROWS = 64  # ggml's CPU flash attention runs its F32 tiled kernel for 64 queries or more (GGML_FA_TILE_Q)
FLASH_ALIGN = 16  # ... and value rows of a multiple of the widest SIMD vector (16 floats)


def placement_arrays(
    pos0: int, n: int, n_kv: int, n_ctx: int, v_width: int, window: int = 0, axes: int = 1, flash: bool = False
) -> dict[str, np.ndarray]:
    """The input data of a `Placement` (numpy order); `window`: the sliding window's span, for its own mask (a
    key is masked when the query is `window` or more positions after it, as llama.cpp's standard SWA; before the
    query's chunk for `Chunks`); `axes`: 4 for multi-axis RoPE (a text token's position on the first three axes,
    0 on the fourth, as llama.cpp); `flash`: the F16 masks of flash attention too, each padded to FLASH_ROWS rows
    with copies of its last (padding queries then need no key tile the real ones do not)."""
    mask = np.zeros((n, n_kv), np.float32)
    for i in range(n):
        mask[i, pos0 + i + 1 :] = -np.inf
    rows = np.arange(pos0, pos0 + n, dtype=np.int64)
    positions = rows.astype(np.int32)
    if axes > 1:
        positions = np.concatenate([np.tile(positions, 3), np.zeros(n * (axes - 3), np.int32)])
    out: dict[str, np.ndarray] = {"positions": positions, "mask": mask, "k_rows": rows}
    if v_width:
        out["v_cells"] = (np.arange(v_width, dtype=np.int64)[None, :] * n_ctx + rows[:, None]).reshape(-1)
    if window:
        swa = mask.copy()
        chunked = isinstance(window, Chunks)
        for i in range(n):
            start = (pos0 + i) // window * window if chunked else pos0 + i - window + 1
            swa[i, : max(0, start)] = -np.inf
        out["mask_swa"] = swa
    if flash:
        for name in ("mask", "mask_swa") if window else ("mask",):
            m = out[name]
            pad = np.repeat(m[-1:], max(0, FLASH_ROWS - n), axis=0)
            out["flash_" + name] = np.concatenate([m, pad], axis=0).astype(np.float16)
    return out


# The VRAM tier's persistent per-layer device graphs are built per window: there a rebuild costs a device
# allocation per layer, so its windows stay llama.cpp's 256 positions.
DEVICE_DECODE_WINDOW = 256


def decode_window(pos: int, n_ctx: int, step: int = DECODE_WINDOW) -> int:
    return min(n_ctx, -(-(pos + 1) // step) * step)


def placement(
    g: Graph,
    pos0: int,
    n: int,
    n_kv: int,
    n_ctx: int,
    v_width: int,
    window: int = 0,
    axes: int = 1,
    flash: bool = False,
    adjust: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> Placement:
    """A `Placement` whose inputs are filled now (a graph built for one use); `flash`: a prompt's, which attends
    through flash attention; `adjust`: changes the arrays first (a prompt's images: vision/prompt.py)."""
    a = placement_arrays(pos0, n, n_kv, n_ctx, v_width, window, axes, flash)
    if adjust is not None:
        adjust(a)
    inputs = {name: g.input(v) for name, v in a.items()}
    return Placement(
        n,
        n_kv,
        inputs["positions"],
        inputs["mask"],
        inputs["k_rows"],
        inputs.get("v_cells"),
        inputs.get("mask_swa"),
        inputs.get("flash_mask"),
        inputs.get("flash_mask_swa"),
        pos0=pos0,
    )
