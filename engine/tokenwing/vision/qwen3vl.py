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
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.compute import ggml_api as ggml
from tokenwing.compute.ggml_lib import F16, F32, Graph, Tensor, TensorArena
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import GGUFHeader, read_header
from tokenwing.vision.image import ImageLimits, Preprocessed, preprocess

PROJECTOR = "qwen3vl_merger"


@dataclass(frozen=True)
class VisionHParams:
    n_embd: int
    n_head: int
    n_ff: int
    n_layer: int
    patch_size: int
    n_merge: int
    eps: float
    proj_dim: int  # the text model's width
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    gelu: bool  # clip.use_gelu (Qwen3-VL's); else llama.cpp's default gelu_quick, which we do not run


def _hparams(h: GGUFHeader) -> VisionHParams:
    def need(key: str) -> Any:
        v = h.get(key)
        if v is None:
            raise BadInputError(f"{h.path}: mmproj lacks {key}")
        return v

    mean = [float(x) for x in need("clip.vision.image_mean")]
    std = [float(x) for x in need("clip.vision.image_std")]
    return VisionHParams(
        n_embd=int(need("clip.vision.embedding_length")),
        n_head=int(need("clip.vision.attention.head_count")),
        n_ff=int(need("clip.vision.feed_forward_length")),
        n_layer=int(need("clip.vision.block_count")),
        patch_size=int(need("clip.vision.patch_size")),
        n_merge=int(h.get("clip.vision.spatial_merge_size", 2)),
        eps=float(need("clip.vision.attention.layer_norm_epsilon")),
        proj_dim=int(need("clip.vision.projection_dim")),
        mean=(mean[0], mean[1], mean[2]),
        std=(std[0], std[1], std[2]),
        gelu=bool(h.get("clip.use_gelu", False)),
    )


class Qwen3VLEncoder:
    """An mmproj file's weights (mapped, F32 or F16) and the graph that turns a preprocessed image into the text
    model's input rows: (n_merged, proj_dim × (1 + deepstack layers))."""

    def __init__(self, path: str, n_threads: int = 2) -> None:
        h = read_header(path)
        kind = h.get("clip.projector_type") or h.get("clip.vision.projector_type")
        if kind != PROJECTOR:
            raise BadInputError(f"{path}: an mmproj of projector {kind!r}; the engine encodes images for {PROJECTOR}")
        self.hp = _hparams(h)
        if not self.hp.gelu:
            raise BadInputError(f"{path}: Qwen3-VL's encoder uses GELU (clip.use_gelu); this file says otherwise")
        if self.hp.n_merge != 2:
            raise BadInputError(
                f"{path}: Qwen3-VL merges 2×2 patches; clip.vision.spatial_merge_size is {self.hp.n_merge}"
            )
        self.path = path
        self.n_threads = n_threads
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._arena = TensorArena(len(h.tensors) + 8)
        self._w: dict[str, Tensor] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for t in h.tensors:
            if t.type not in (F32, F16):
                raise BadInputError(f"{path}: {t.name} is {t.type_name}; the image encoder reads F32 and F16")
            start = h.data_start + t.offset
            raw = self._map[start : start + t.nbytes]
            self._w[t.name] = self._arena.wrap(np.asarray(raw), t.type, t.shape, owner=self._map)
            self._shapes[t.name] = t.shape
        self.deepstack = sorted(
            int(n.split(".")[2]) for n in self._w if n.startswith("v.deepstack.") and n.endswith(".fc1.weight")
        )
        for name in ("v.patch_embd.weight", "v.patch_embd.weight.1", "v.patch_embd.bias", "v.position_embd.weight"):
            if name not in self._w:
                raise BadInputError(f"{path}: Qwen3-VL's encoder needs {name}")
        self.width = self.hp.proj_dim * (1 + len(self.deepstack))

    def limits(self) -> ImageLimits:
        """llama.cpp's token budget for Qwen-VL encoders: 8 to 4096 merged patches (set_limit_image_tokens)."""
        side = self.hp.patch_size * self.hp.n_merge
        return ImageLimits(align=side, min_pixels=8 * side * side, max_pixels=4096 * side * side)

    def preprocess(self, rgb: np.ndarray) -> Preprocessed:
        return preprocess(rgb, self.limits(), self.hp.mean, self.hp.std)

    def encode(self, image: Preprocessed) -> np.ndarray:
        """The image's embeddings (n_merged, width), rows in llama.cpp's order (2×2 blocks row by row)."""
        hp = self.hp
        p = hp.patch_size
        npx, npy = image.width // p, image.height // p
        n_pos = npx * npy
        per_layer = 40 * max(hp.n_embd * hp.n_merge**2, hp.n_ff, 3 * hp.n_embd) * n_pos * 4
        per_layer += 3 * hp.n_head * n_pos * n_pos * 4
        mem = (64 << 20) + hp.n_layer * per_layer + 8 * image.pixels.nbytes
        g = Graph(mem, self.n_threads)
        try:
            out = self._graph(g, image, npx, npy)
            g.compute(out, n_nodes=64 * (hp.n_layer + 4))
            n = n_pos // (hp.n_merge * hp.n_merge)
            data = ctypes.cast(out.contents.data, ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(data, shape=(n * self.width,)).reshape(n, self.width).copy()
        finally:
            g.close()

    def _norm(self, ctx: Any, x: Tensor, prefix: str) -> Tensor:
        x = ggml.ggml_norm(ctx, x, self.hp.eps)
        x = ggml.ggml_mul(ctx, x, self._w[f"{prefix}.weight"])
        return ggml.ggml_add(ctx, x, self._w[f"{prefix}.bias"])

    def _ffn(self, ctx: Any, x: Tensor, up: str, down: str) -> Tensor:
        x = ggml.ggml_add(ctx, ggml.ggml_mul_mat(ctx, self._w[f"{up}.weight"], x), self._w[f"{up}.bias"])
        x = ggml.ggml_gelu(ctx, x)
        return ggml.ggml_add(ctx, ggml.ggml_mul_mat(ctx, self._w[f"{down}.weight"], x), self._w[f"{down}.bias"])

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
            x = self._norm(ctx, x, "v.pre_ln")
        positions = g.input(patch_positions(npx, npy, hp.n_merge))
        sections = (ctypes.c_int * 4)(*([d_head // 4] * 4))
        scale = 1.0 / math.sqrt(d_head)
        deep: Tensor | None = None
        for il in range(hp.n_layer):
            b = f"v.blk.{il}"
            cur = self._norm(ctx, x, f"{b}.ln1")
            cur = ggml.ggml_add(
                ctx, ggml.ggml_mul_mat(ctx, self._w[f"{b}.attn_qkv.weight"], cur), self._w[f"{b}.attn_qkv.bias"]
            )
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
            q = ggml.ggml_permute(ctx, q, 0, 2, 1, 3)
            k = ggml.ggml_permute(ctx, k, 0, 2, 1, 3)
            v = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, v, 1, 2, 0, 3))
            # no mask: every patch sees every patch (ggml takes NULL, which the binding's type does not say)
            kq = ggml.ggml_soft_max_ext(ctx, ggml.ggml_mul_mat(ctx, k, q), None, scale, 0.0)  # type: ignore[arg-type]
            att = ggml.ggml_permute(ctx, ggml.ggml_mul_mat(ctx, v, kq), 0, 2, 1, 3)
            att = ggml.ggml_cont_2d(ctx, att, e, n_pos)
            att = ggml.ggml_add(
                ctx, ggml.ggml_mul_mat(ctx, self._w[f"{b}.attn_out.weight"], att), self._w[f"{b}.attn_out.bias"]
            )
            x = ggml.ggml_add(ctx, att, x)
            cur = self._ffn(ctx, self._norm(ctx, x, f"{b}.ln2"), f"{b}.ffn_up", f"{b}.ffn_down")
            x = ggml.ggml_add(ctx, x, cur)
            if il in self.deepstack:
                d = f"v.deepstack.{il}"
                feat = ggml.ggml_reshape_3d(ctx, x, e * 4, n_pos // 4, 1)
                feat = self._ffn(ctx, self._norm(ctx, feat, f"{d}.norm"), f"{d}.fc1", f"{d}.fc2")
                deep = feat if deep is None else ggml.ggml_concat(ctx, deep, feat, 0)
        if "v.post_ln.weight" in self._w:
            x = self._norm(ctx, x, "v.post_ln")
        out = self._ffn(ctx, ggml.ggml_reshape_3d(ctx, x, e * 4, n_pos // 4, 1), "mm.0", "mm.2")
        if deep is not None:
            out = ggml.ggml_concat(ctx, out, deep, 0)
        return out

    def close(self) -> None:
        self._arena.close()


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
