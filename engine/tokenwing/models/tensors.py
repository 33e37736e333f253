"""Small graph pieces every other shared piece uses: RMSNorm, and a fused projection's rows apart."""

from __future__ import annotations

from typing import Any

from tokenwing.compute.ggml_lib import Tensor, ops


def rms_norm(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return ops.ggml_mul(ctx, ops.ggml_rms_norm(ctx, x, eps), weight)


def split_rows(ctx: Any, x: Tensor, widths: tuple[int, ...]) -> tuple[Tensor, ...]:
    """x [sum(widths), n] as consecutive parts of each column, each [width, n] and contiguous (a fused
    projection's outputs; copies hold the same values as llama.cpp's views of it)."""
    nb1, elt, start, parts = int(x.contents.nb[1]), int(x.contents.nb[0]), 0, []
    for width in widths:
        parts.append(ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, x, width, int(x.contents.ne[1]), nb1, start * elt)))
        start += width
    return tuple(parts)
