"""Pixtral's image encoder (an mmproj GGUF of `clip.projector_type` pixtral: Mistral Small 3.1 and Small 4, Pixtral
12B) in ggml, as llama.cpp's libmtmd computes it (tools/mtmd/models/pixtral.cpp, clip.cpp's build_vit and
positions, mtmd.cpp's [IMG_END]).

One patch convolution (a bias where the file has one); an RMS pre-norm; RMSNorm ViT blocks with separate Q, K, V
and 2-D RoPE (the first half of each head rotated by the patch's row, the second half by its column at the odd
frequencies: clip_graph::build_rope_2d, base 10,000 whatever the file says), a SwiGLU FFN; where the file has a
patch merger (Mistral Small 3.1 and 4): an RMSNorm and each n_merge × n_merge block of patches unfolded (channel,
then row, then column, as torch's unfold) into one vector projected back to the encoder's width; then the
projector (mm.1, GELU, mm.2) to the text model's width. The image's rows go to the text model row by row, an
[IMG_BREAK] row (v.token_embd.img_break) after every row of merged patches but the last; the text "[IMG_END]"
follows the image. The text model places them as tokens (one position a row, causal): no M-RoPE.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenwing.compute import ggml_api as ggml
from tokenwing.compute.ggml_lib import Graph, Tensor
from tokenwing.errors import BadInputError
from tokenwing.vision.encoder import MmprojEncoder
from tokenwing.vision.image import ImageLimits, Preprocessed

PROJECTOR = "pixtral"
ROPE_BASE = 10000.0  # clip.cpp sets it for pixtral, not read from the file


class PixtralEncoder(MmprojEncoder):
    """Pixtral's mmproj: a preprocessed image to the text model's input rows, (ny · nx + ny − 1, proj_dim)."""

    projector = PROJECTOR
    default_merge = 1  # the original Pixtral has no patch merger
    archs = ("mistral4",)  # Mistral Small 4 (Small 3.1's text model, mistral3, is not a family here)
    begin, end = "", "[IMG_END]"  # mtmd.cpp, PROJECTOR_TYPE_PIXTRAL: nothing before the image

    def __init__(self, path: str, n_threads: int = 2) -> None:
        super().__init__(path, n_threads)
        if not self.hp.silu:
            raise BadInputError(f"{path}: Pixtral's blocks use SiLU (clip.use_silu); this file says otherwise")
        d_head = self.hp.n_embd // self.hp.n_head
        if d_head % 4:
            raise BadInputError(f"{path}: 2-D RoPE needs a head width divisible by 4, not {d_head}")
        self.need("v.patch_embd.weight", "mm.1.weight", "mm.2.weight", "v.token_embd.img_break")
        for il in range(self.hp.n_layer):
            b = f"v.blk.{il}"
            names = ("ln1", "ln2", "attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down")
            self.need(*(f"{b}.{n}.weight" for n in names))
        self.merger = "mm.patch_merger.weight" in self._w
        if self.merger:
            self.need("mm.input_norm.weight")
        elif self.hp.n_merge != 1:
            raise BadInputError(f"{path}: spatial_merge_size {self.hp.n_merge} without mm.patch_merger.weight")

    def limits(self) -> ImageLimits:
        """llama.cpp's token budget for Pixtral: 8 to 1024 merged patches (set_limit_image_tokens(8, 1024)),
        the sides aligned to patch × merge (mtmd_image_preprocessor_dyn_size)."""
        side = self.hp.patch_size * self.hp.n_merge
        return ImageLimits(align=side, min_pixels=8 * side * side, max_pixels=1024 * side * side)

    def n_rows(self, nx: int, ny: int) -> int:
        """The image's rows in the text model: its merged patches and an [IMG_BREAK] after each row but the last."""
        return nx * ny + ny - 1

    def encode(self, image: Preprocessed) -> np.ndarray:
        """The image's rows (n_rows, proj_dim): merged patches row by row, [IMG_BREAK] between rows."""
        nx, ny = self.grid(image)
        p = self.hp.patch_size
        merged = self.run(image, nx * ny, lambda g: self._graph(g, image, image.width // p, image.height // p))
        brk = self._img_break()
        out = np.empty((self.n_rows(nx, ny), self.width), np.float32)
        for r in range(ny):
            at = r * (nx + 1)
            out[at : at + nx] = merged[r * nx : (r + 1) * nx]
            if r + 1 < ny:
                out[at + nx] = brk
        return out

    def _img_break(self) -> np.ndarray:
        brk = self.array("v.token_embd.img_break")
        if brk.size != self.width:
            raise BadInputError(f"{self.path}: v.token_embd.img_break has {brk.size} values, not {self.width}")
        return brk

    def _rope_2d(self, ctx: Any, x: Tensor, pos_h: Tensor, pos_w: Tensor) -> Tensor:
        """build_rope_2d: dims [0, d/2) rotated by the row at the even frequencies, [d/2, d) by the column at the
        odd ones (the same rotation on half the dims with its frequencies scaled by base^(−2/d))."""
        d = self.hp.n_embd // self.hp.n_head
        odd = float(np.float32(ROPE_BASE) ** np.float32(-2.0 / d))
        x = ggml.ggml_rope_ext(ctx, x, pos_h, None, d // 2, 0, 0, ROPE_BASE, 1.0, 0.0, 1.0, 0.0, 0.0)
        x = ggml.ggml_rope_ext(ctx, x, pos_w, None, d // 2, 0, 0, ROPE_BASE, odd, 0.0, 1.0, 0.0, 0.0)
        return ggml.ggml_rope_set_offset(x, d // 2)

    def _unfold(self, ctx: Any, x: Tensor, npx: int, npy: int) -> Tensor:
        """[e, npx, npy] → [e · m · m, (npx / m) · (npy / m)]: each m × m block's values channel by channel, then
        its rows, then its columns (im2col's order, which llama.cpp uses for torch's unfold), blocks row by row.
        Two copies: the block's rows next to its columns, then the channel outside both."""
        e, m = self.hp.n_embd, self.hp.n_merge
        x = ggml.ggml_reshape_4d(ctx, x, e * m, npx // m, m, npy // m)  # (e, kx) X ky Y
        x = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, x, 0, 2, 1, 3))  # (e, kx) ky X Y
        x = ggml.ggml_reshape_4d(ctx, x, e, m, m, (npx // m) * (npy // m))  # e kx ky (X Y)
        x = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, x, 2, 0, 1, 3))  # kx ky e (X Y)
        return ggml.ggml_reshape_2d(ctx, x, e * m * m, (npx // m) * (npy // m))

    def _graph(self, g: Graph, image: Preprocessed, npx: int, npy: int) -> Tensor:
        hp = self.hp
        ctx = g.ctx
        e, n_head, p = hp.n_embd, hp.n_head, hp.patch_size
        d_head = e // n_head
        n_pos = npx * npy
        raw = g.input(image.pixels[None])  # (1, 3, H, W) → ggml [W, H, 3, 1]
        x = ggml.ggml_conv_2d(ctx, self._w["v.patch_embd.weight"], raw, p, p, 0, 0, 1, 1)  # [npx, npy, e, 1]
        x = ggml.ggml_cont(ctx, ggml.ggml_transpose(ctx, ggml.ggml_reshape_2d(ctx, x, n_pos, e)))  # [e, n_pos]
        if "v.patch_embd.bias" in self._w:
            x = ggml.ggml_add(ctx, x, self._w["v.patch_embd.bias"])
        if "v.pre_ln.weight" in self._w:
            x = self.norm(ctx, x, "v.pre_ln", rms=True)
        i = np.arange(n_pos, dtype=np.int32)
        pos_h, pos_w = g.input(i // npx), g.input(i % npx)
        for il in range(hp.n_layer):
            b = f"v.blk.{il}"
            cur = self.norm(ctx, x, f"{b}.ln1", rms=True)
            q, k, v = (
                ggml.ggml_reshape_3d(ctx, self.linear(ctx, cur, f"{b}.attn_{n}"), d_head, n_head, n_pos) for n in "qkv"
            )
            q, k = self._rope_2d(ctx, q, pos_h, pos_w), self._rope_2d(ctx, k, pos_h, pos_w)
            att = self.linear(ctx, self.attention(ctx, q, k, v, n_pos), f"{b}.attn_out")
            x = ggml.ggml_add(ctx, att, x)
            cur = self.norm(ctx, x, f"{b}.ln2", rms=True)
            x = ggml.ggml_add(ctx, x, self.ffn(ctx, cur, f"{b}.ffn_up", f"{b}.ffn_down", gate=f"{b}.ffn_gate"))
        if "v.post_ln.weight" in self._w:
            x = self.norm(ctx, x, "v.post_ln", rms=True)
        if self.merger:
            x = ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, x, hp.eps), self._w["mm.input_norm.weight"])
            x = ggml.ggml_mul_mat(ctx, self._w["mm.patch_merger.weight"], self._unfold(ctx, x, npx, npy))
        return self.ffn(ctx, x, "mm.1", "mm.2")
