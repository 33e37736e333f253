"""Qwen3-VL's image encoder (an mmproj GGUF of `clip.projector_type` qwen3vl_merger) in ggml, as llama.cpp's libmtmd
computes it (tools/mtmd/models/qwen3vl.cpp, clip.cpp's positions and tensor names).

Two patch convolutions summed (a still image is both temporal frames) plus a bias; 2×2 neighbouring patches made
adjacent (the merger's order) before anything else; learned positions on an n×n grid resized bilinearly (corners
aligned) to the image's patch grid and put in the same order; LayerNorm ViT blocks with one fused QKV and 2-D M-RoPE
(each patch's row and column on the four vision sections); after the deepstack blocks, a merger of that block's
output; a post-LayerNorm and the main merger (2×2 patches → LayerNorm-free MLP, GELU). The output row of a merged
patch is the main merger's then each deepstack merger's, as llama.cpp concatenates them (the text model adds the
deepstack parts into its first layers).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from tokenwing.compute import ggml_api as ggml
from tokenwing.compute.ggml_lib import Graph, Tensor
from tokenwing.errors import BadInputError
from tokenwing.vision.encoder import MmprojEncoder
from tokenwing.vision.image import ImageLimits, Preprocessed

PROJECTOR = "qwen3vl_merger"


class Qwen3VLEncoder(MmprojEncoder):
    """Qwen3-VL's mmproj: a preprocessed image to the text model's input rows, (n_merged, proj_dim × (1 +
    deepstack layers))."""

    projector = PROJECTOR
    default_merge = 2
    archs = ("qwen3vlmoe",)
    begin, end = "<|vision_start|>", "<|vision_end|>"  # Qwen-VL's (mtmd.cpp, PROJECTOR_TYPE_QWEN3VL)
    mrope = True

    def __init__(self, path: str, n_threads: int = 2) -> None:
        super().__init__(path, n_threads)
        if not self.hp.gelu:
            raise BadInputError(f"{path}: Qwen3-VL's encoder uses GELU (clip.use_gelu); this file says otherwise")
        if self.hp.n_merge != 2:
            raise BadInputError(
                f"{path}: Qwen3-VL merges 2×2 patches; clip.vision.spatial_merge_size is {self.hp.n_merge}"
            )
        self.deepstack = sorted(
            int(n.split(".")[2]) for n in self._w if n.startswith("v.deepstack.") and n.endswith(".fc1.weight")
        )
        self.need("v.patch_embd.weight", "v.patch_embd.weight.1", "v.patch_embd.bias", "v.position_embd.weight")
        self.width = self.hp.proj_dim * (1 + len(self.deepstack))

    def limits(self) -> ImageLimits:
        """llama.cpp's token budget for Qwen-VL encoders: 8 to 4096 merged patches (set_limit_image_tokens)."""
        side = self.hp.patch_size * self.hp.n_merge
        return ImageLimits(align=side, min_pixels=8 * side * side, max_pixels=4096 * side * side)

    def encode(self, image: Preprocessed) -> np.ndarray:
        """The image's embeddings (n_merged, width), rows in llama.cpp's order (2×2 blocks row by row)."""
        p = self.hp.patch_size
        npx, npy = image.width // p, image.height // p
        n = npx * npy // (self.hp.n_merge * self.hp.n_merge)
        return self.run(image, n, lambda g: self._graph(g, image, npx, npy))

    def _merge_order(self, ctx: Any, x: Tensor, npx: int, npy: int) -> Tensor:
        """[n_embd, npx, npy] → [n_embd, n_pos] with each 2×2 block's patches adjacent (the merger's order)."""
        e = self.hp.n_embd
        x = ggml.ggml_reshape_4d(ctx, ggml.ggml_cont(ctx, x), e * 2, npx // 2, 2, npy // 2)
        x = ggml.ggml_permute(ctx, x, 0, 2, 1, 3)
        return ggml.ggml_cont_3d(ctx, x, e, npx * npy, 1)

    def _positions(self, ctx: Any, npx: int, npy: int) -> Tensor:
        w = self._w["v.position_embd.weight"]
        e = self.hp.n_embd
        side = math.isqrt(self._shapes["v.position_embd.weight"][1])
        if npx == side and npy == side:
            return ggml.ggml_reshape_3d(ctx, w, e, npx, npy)
        x = ggml.ggml_reshape_3d(ctx, w, e, side, side)
        x = ggml.ggml_permute(ctx, x, 2, 0, 1, 3)  # (side, side, e)
        mode = ggml.GGML_SCALE_MODE_BILINEAR | ggml.GGML_SCALE_FLAG_ALIGN_CORNERS
        x = ggml.ggml_interpolate(ctx, x, npx, npy, e, 1, mode)
        x = ggml.ggml_permute(ctx, x, 1, 2, 0, 3)  # (e, npx, npy)
        return ggml.ggml_cont(ctx, x)

    def _graph(self, g: Graph, image: Preprocessed, npx: int, npy: int) -> Tensor:
        hp = self.hp
        ctx = g.ctx
        e, n_head, p = hp.n_embd, hp.n_head, hp.patch_size
        d_head = e // n_head
        n_pos = npx * npy
        raw = g.input(image.pixels[None])  # (1, 3, H, W) → ggml [W, H, 3, 1], the channel planes llama.cpp makes
        inp = ggml.ggml_add(
            ctx,
            ggml.ggml_conv_2d(ctx, self._w["v.patch_embd.weight"], raw, p, p, 0, 0, 1, 1),
            ggml.ggml_conv_2d(ctx, self._w["v.patch_embd.weight.1"], raw, p, p, 0, 0, 1, 1),
        )  # [npx, npy, e, 1]
        inp = ggml.ggml_permute(ctx, inp, 1, 2, 0, 3)  # [e, npx, npy]
        x = self._merge_order(ctx, inp, npx, npy)
        x = ggml.ggml_add(ctx, x, self._w["v.patch_embd.bias"])
        x = ggml.ggml_add(ctx, x, self._merge_order(ctx, self._positions(ctx, npx, npy), npx, npy))
        if "v.pre_ln.weight" in self._w:
            x = self.norm(ctx, x, "v.pre_ln")
        positions = g.input(patch_positions(npx, npy, hp.n_merge))
        sections = (ctypes.c_int * 4)(*([d_head // 4] * 4))
        deep: Tensor | None = None
        for il in range(hp.n_layer):
            b = f"v.blk.{il}"
            cur = self.norm(ctx, x, f"{b}.ln1")
            cur = self.linear(ctx, cur, f"{b}.attn_qkv")
            nb1 = cur.contents.nb[1]
            q, k, v = (ggml.ggml_view_3d(ctx, cur, d_head, n_head, n_pos, d_head * 4, nb1, i * e * 4) for i in range(3))
            q, k = (
                ggml.ggml_rope_multi(
                    ctx,
                    t,
                    positions,
                    None,
                    d_head // 2,
                    sections,
                    ggml.GGML_ROPE_TYPE_VISION,
                    32768,
                    10000.0,
                    1.0,
                    0.0,
                    1.0,
                    32.0,
                    1.0,
                )
                for t in (q, k)
            )
            att = self.attention(ctx, q, k, v, n_pos)
            att = self.linear(ctx, att, f"{b}.attn_out")
            x = ggml.ggml_add(ctx, att, x)
            cur = self.ffn(ctx, self.norm(ctx, x, f"{b}.ln2"), f"{b}.ffn_up", f"{b}.ffn_down")
            x = ggml.ggml_add(ctx, x, cur)
            if il in self.deepstack:
                d = f"v.deepstack.{il}"
                feat = ggml.ggml_reshape_3d(ctx, x, e * 4, n_pos // 4, 1)
                feat = self.ffn(ctx, self.norm(ctx, feat, f"{d}.norm"), f"{d}.fc1", f"{d}.fc2")
                deep = feat if deep is None else ggml.ggml_concat(ctx, deep, feat, 0)
        if "v.post_ln.weight" in self._w:
            x = self.norm(ctx, x, "v.post_ln")
        out = self.ffn(ctx, ggml.ggml_reshape_3d(ctx, x, e * 4, n_pos // 4, 1), "mm.0", "mm.2")
        if deep is not None:
            out = ggml.ggml_concat(ctx, out, deep, 0)
        return out


def patch_positions(npx: int, npy: int, merge: int) -> np.ndarray:
    """Each patch's (row, column, row, column) as llama.cpp sets "positions" for Qwen-VL encoders: four blocks of
    n_pos, patches in merger order (2×2 blocks row by row)."""
    ys, xs = [], []
    for y in range(0, npy, merge):
        for x in range(0, npx, merge):
            for dy in range(2):
                for dx in range(2):
                    ys.append(y + dy)
                    xs.append(x + dx)
    return np.array([*ys, *xs, *ys, *xs], dtype=np.int32)
