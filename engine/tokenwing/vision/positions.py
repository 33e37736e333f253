"""Where the text model places an image's rows (Qwen-VL's M-RoPE, as llama.cpp's libmtmd and KV cache do it).

An image of nx × ny merged patches is nx·ny rows of the sequence (KV cells) but takes max(nx, ny) positions: every
row's time axis is the position it starts at, p0; its height and width axes are p0 + its row and column (the rows in
raster order); the fourth axis is 0 (mtmd_image_tokens_get_decoder_pos, MTMD_POS_TYPE_MROPE). The text after the
image goes on from p0 + max(nx, ny) (mtmd_image_tokens_get_n_pos). Attention among the image's rows: llama.cpp masks
a key of the same position when its (y, x) comes later (llama_kv_cell_ext::is_2d_gt), which is causal in raster
order — so the rows attend as consecutive tokens do, and only their RoPE positions differ from text's.
"""

from __future__ import annotations

import numpy as np


def image_span(nx: int, ny: int) -> int:
    """The positions an image of nx × ny merged patches takes in the sequence."""
    return max(nx, ny)


def image_positions(p0: int, nx: int, ny: int) -> np.ndarray:
    """The image's rows' RoPE positions as the graph takes them (I32 [4 · n]: the time axis of every row, then the
    height axis, the width axis and the fourth), for an image that starts at position p0."""
    i = np.arange(nx * ny, dtype=np.int64)
    t = np.full(nx * ny, p0, np.int64)
    return np.concatenate([t, p0 + i // nx, p0 + i % nx, np.zeros(nx * ny, np.int64)]).astype(np.int32)
