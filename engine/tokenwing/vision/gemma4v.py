"""Gemma 4's image encoder (an mmproj GGUF of `clip.projector_type` gemma4v) in ggml, as llama.cpp's libmtmd
computes it (tools/mtmd/models/gemma4v.cpp; clip.cpp's build_vit, tensor names and hparams).

The pixels (normalised by the file's mean and std) taken to 2·v − 1; one patch convolution without a bias; two
learned position tables, one by the patch's column and one by its row, added; ViT blocks of RMSNorms: separate Q, K
and V, Q and K normed per head by their weights and V by none, 2-D RoPE in NeoX order (the first half of a head
rotated by the column, the second by the row, base 100), attention unscaled (kq_scale 1), a post-attention norm,
a gated FFN (clip's activation: gelu_quick unless the file says clip.use_gelu / use_silu) and a post-FFN norm, an
optional per-block output scale; then the pooler: the average of n×n patches (n = projector.scale_factor, 3) times
sqrt(width), optionally (x − std_bias) · std_scale, an RMSNorm without weight and the input projection to the text
model's width. Every matrix product may clamp its input and output (Gemma4ClippableLinear: `NAME.input_min`, …
one-value tensors beside `NAME.weight`).

Preprocessing is Qwen-VL's (vision/image.py: bicubic to a size aligned to patch × n, fitted on black) with
Gemma 4's token budget: 70 to 1120 pooled patches. The text model takes the rows one position each, attending to
one another both ways (vision/prompt.py: `GEMMA4`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tokenwing.compute import ggml_api as ggml
from tokenwing.compute.ggml_lib import Graph, Tensor
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import read_header
from tokenwing.vision.encoder import MmprojEncoder
from tokenwing.vision.image import ImageLimits, Preprocessed

PROJECTOR = "gemma4v"
IMAGE_BEGIN, IMAGE_END = "<|image>", "<image|>"  # mtmd.cpp, PROJECTOR_TYPE_GEMMA4V
ROPE_BASE = 100.0  # clip.cpp sets it for gemma4v; the file has no key for it
MIN_TOKENS, MAX_TOKENS = 70, 1120  # clip.cpp's set_limit_image_tokens for gemma4v
_FLT_MAX = float(np.finfo(np.float32).max)


class Gemma4VEncoder(MmprojEncoder):
    """Gemma 4's mmproj: a preprocessed image to the text model's input rows, (n_pooled, proj_dim), the pooled
    patches row by row."""

    projector = PROJECTOR
    archs = ("gemma4",)
    begin, end = IMAGE_BEGIN, IMAGE_END
    default_merge = 3  # the pooler's kernel: clip.vision.projector.scale_factor where the file has it

    def __init__(self, path: str, n_threads: int = 2) -> None:
        super().__init__(path, n_threads)
        merge = read_header(path).get("clip.vision.projector.scale_factor", self.default_merge)
        self.hp = dataclasses.replace(self.hp, n_merge=int(merge))
        self.need("v.patch_embd.weight", "v.position_embd.weight", "mm.input_projection.weight")
        # Gemma4ClippableLinear's bounds: one-value F32 tensors beside a matrix (NAME.input_min, …)
        ends = (".input_min", ".input_max", ".output_min", ".output_max")
        self.bounds = {n: float(self.array(n)[0]) for n in self._shapes if n.endswith(ends)}
        self.pos_size = self._shapes["v.position_embd.weight"][1]

    def bidirectional(self, n_embd_text: int) -> bool:
        """mtmd_decode_use_non_causal: Gemma 4's rows attend both ways but in E2B and E4B (widths 1536, 2560)."""
        return n_embd_text not in (1536, 2560)

    def limits(self) -> ImageLimits:
        side = self.hp.patch_size * self.hp.n_merge
        return ImageLimits(align=side, min_pixels=MIN_TOKENS * side * side, max_pixels=MAX_TOKENS * side * side)

    def encode(self, image: Preprocessed) -> np.ndarray:
        """The image's embeddings (n_pooled, proj_dim), rows in raster order of the pooled grid."""
        p = self.hp.patch_size
        npx, npy = image.width // p, image.height // p
        if max(npx, npy) > self.pos_size:
            # (ggml_get_rows past the table aborts, in llama.cpp too)
            raise BadInputError(
                f"an image {max(npx, npy)} patches across; {self.path}'s position tables hold {self.pos_size}"
            )
        nx, ny = self.grid(image)
        return self.run(image, nx * ny, lambda g: self._graph(g, image, npx, npy))

    def _mm(self, ctx: Any, name: str, x: Tensor) -> Tensor:
        """clip's build_mm for gemma4v: the product, its input and output clamped where the file bounds them."""
        base = name.removesuffix(".weight")
        x = self._clamp(ctx, x, f"{base}.input")
        return self._clamp(ctx, ggml.ggml_mul_mat(ctx, self._w[name], x), f"{base}.output")

    def _clamp(self, ctx: Any, x: Tensor, prefix: str) -> Tensor:
        lo, hi = self.bounds.get(f"{prefix}_min"), self.bounds.get(f"{prefix}_max")
        if lo is None and hi is None:
            return x  # (llama.cpp clamps to ±FLT_MAX then: nothing changes)
        return ggml.ggml_clamp(ctx, x, -_FLT_MAX if lo is None else lo, _FLT_MAX if hi is None else hi)

    def _rms(self, ctx: Any, x: Tensor, name: str | None) -> Tensor:
        x = ggml.ggml_rms_norm(ctx, x, self.hp.eps)
        return x if name is None else ggml.ggml_mul(ctx, x, self._w[name])

    def _rope(self, ctx: Any, x: Tensor, pos_x: Tensor, pos_y: Tensor) -> Tensor:
        """gemma4v.cpp's add_pos: NeoX RoPE of the head's first half by the column, its second half by the row."""
        half = int(x.contents.ne[0]) // 2
        x = ggml.ggml_rope_ext(
            ctx, x, pos_x, None, half, ggml.GGML_ROPE_TYPE_NEOX, 0, ROPE_BASE, 1.0, 0.0, 1.0, 0.0, 0.0
        )
        x = ggml.ggml_rope_ext(
            ctx, x, pos_y, None, half, ggml.GGML_ROPE_TYPE_NEOX, 0, ROPE_BASE, 1.0, 0.0, 1.0, 0.0, 0.0
        )
        return ggml.ggml_rope_set_offset(x, half)

    def _graph(self, g: Graph, image: Preprocessed, npx: int, npy: int) -> Tensor:
        hp, w, ctx = self.hp, self._w, g.ctx
        e, n_head, p = hp.n_embd, hp.n_head, hp.patch_size
        d_head = e // n_head
        n_pos = npx * npy
        raw = g.input(image.pixels[None])  # (1, 3, H, W) → ggml [W, H, 3, 1], the channel planes llama.cpp makes
        raw = ggml.ggml_scale_bias(ctx, raw, 2.0, -1.0)
        x = ggml.ggml_conv_2d(ctx, w["v.patch_embd.weight"], raw, p, p, 0, 0, 1, 1)  # [npx, npy, e, 1]
        x = ggml.ggml_cont(ctx, ggml.ggml_transpose(ctx, ggml.ggml_reshape_2d(ctx, x, n_pos, e)))  # [e, n_pos]
        cols = np.arange(n_pos, dtype=np.int32)
        pos_x, pos_y = g.input(cols % npx), g.input(cols // npx)
        table = w["v.position_embd.weight"]  # [e, pos_size, 2]: the columns' table, then the rows'
        nb1 = int(table.contents.nb[1])
        size = self.pos_size
        for i, at in enumerate((pos_x, pos_y)):
            tbl = ggml.ggml_view_2d(ctx, table, e, size, nb1, i * size * nb1)
            x = ggml.ggml_add(ctx, x, ggml.ggml_get_rows(ctx, tbl, at))
        if "v.pre_ln.weight" in w:
            x = self._rms(ctx, x, "v.pre_ln.weight")
        for il in range(hp.n_layer):
            b = f"v.blk.{il}"
            cur = self._rms(ctx, x, f"{b}.ln1.weight")
            q, k, v = (
                ggml.ggml_reshape_3d(ctx, self._mm(ctx, f"{b}.attn_{n}.weight", cur), d_head, n_head, n_pos)
                for n in "qkv"
            )
            q = self._rope(ctx, self._rms(ctx, q, f"{b}.attn_q_norm.weight"), pos_x, pos_y)
            k = self._rope(ctx, self._rms(ctx, k, f"{b}.attn_k_norm.weight"), pos_x, pos_y)
            v = self._rms(ctx, v, None)
            cur = self._mm(ctx, f"{b}.attn_out.weight", self.attention(ctx, q, k, v, n_pos, scale=1.0))
            cur = self._rms(ctx, cur, f"{b}.attn_post_norm.weight")
            x = ggml.ggml_add(ctx, cur, x)
            cur = self._rms(ctx, x, f"{b}.ln2.weight")
            up = self._mm(ctx, f"{b}.ffn_up.weight", cur)
            gate = self._mm(ctx, f"{b}.ffn_gate.weight", cur)
            cur = self._mm(ctx, f"{b}.ffn_down.weight", self._gated(ctx, gate, up))
            cur = self._rms(ctx, cur, f"{b}.ffn_post_norm.weight")
            x = ggml.ggml_add(ctx, x, cur)
            if f"{b}.out_scale.weight" in w:
                x = ggml.ggml_mul(ctx, x, w[f"{b}.out_scale.weight"])
        if "v.post_ln.weight" in w:
            x = self._rms(ctx, x, "v.post_ln.weight")
        # the pooler: n×n patches averaged, times sqrt(width)
        n = hp.n_merge
        x = ggml.ggml_cont_3d(ctx, ggml.ggml_transpose(ctx, x), npx, npy, e)
        x = ggml.ggml_pool_2d(ctx, x, ggml.GGML_OP_POOL_AVG, n, n, n, n, 0.0, 0.0)
        x = ggml.ggml_reshape_2d(ctx, x, (npx // n) * (npy // n), e)
        x = ggml.ggml_scale(ctx, ggml.ggml_cont(ctx, ggml.ggml_transpose(ctx, x)), float(np.sqrt(np.float32(e))))
        if "v.std_bias" in w and "v.std_scale" in w:
            x = ggml.ggml_mul(ctx, ggml.ggml_sub(ctx, x, w["v.std_bias"]), w["v.std_scale"])
        x = ggml.ggml_rms_norm(ctx, x, hp.eps)
        return self._mm(ctx, "mm.input_projection.weight", x)

    def _gated(self, ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        """build_ffn's gated activation: clip's ffn_op (GELU with clip.use_gelu, SiLU with use_silu, else
        gelu_quick, which published Gemma 4 files get: their converter writes neither) of the gate, times up."""
        if self.hp.gelu:
            return ggml.ggml_geglu_split(ctx, gate, up)
        if self.hp.silu:
            return ggml.ggml_swiglu_split(ctx, gate, up)
        return ggml.ggml_geglu_quick_split(ctx, gate, up)
