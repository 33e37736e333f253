"""The factory's `mmproj` files: random weights for a family's image encoder in llama.cpp's clip layout
(`tokenwing testmodel OUT.gguf --arch qwen3vlmoe --mmproj OUT.mmproj.gguf`), loadable by libmtmd.

Qwen3-VL's encoder (`clip.projector_type` qwen3vl_merger; llama.cpp tools/mtmd/models/qwen3vl.cpp): two patch
convolutions summed (a still image is its two temporal frames alike) with a bias, learned positions resized to the
patch grid, pre-LayerNorm ViT blocks with one fused QKV and 2-D M-RoPE, a post-LayerNorm and the merger (2×2
patches → an MLP to the text model's width), and deepstack mergers after some blocks whose outputs go beside the
merger's (the text model adds them into its first layers).

Gemma 4's (`gemma4v`; tools/mtmd/models/gemma4v.cpp): one patch convolution, column and row position tables, RMSNorm
ViT blocks (separate Q/K/V, Q/K norms, post-attention and post-FFN norms, a gated FFN, an output scale), the 3×3
pooler, std bias and scale, the input projection; some matrices bounded (Gemma4ClippableLinear's one-value tensors).
Shapes are in GGUF order (ne0 first).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from tokenwing.format.gguf_io import KV, TensorInfo, encode_header, layout_tensors, tensor_nbytes
from tokenwing.fsutil import atomic_output
from tokenwing.testmodel.architectures import architecture
from tokenwing.testmodel.clip_kv import clip_kv, gated_block
from tokenwing.testmodel.mmproj_pixtral import PixtralShape, pixtral_metadata, pixtral_tensors
from tokenwing.testmodel.shapes import ModelShape

ALIGNMENT = 32
_F32, _F16 = 0, 1  # ggml type ids


@dataclass(frozen=True)
class VisionShape:
    """A small Qwen3-VL encoder: the real one is 1152 wide, 16 heads, 27 blocks, patches of 16, 48×48 positions."""

    n_embd: int = 32
    n_head: int = 2  # heads of 16: M-RoPE gives each of its four sections a quarter of the head
    n_ff: int = 64
    n_layer: int = 4
    patch_size: int = 8
    n_per_side: int = 4  # learned positions on a 4×4 grid, resized (bilinear) to the image's patch grid
    n_merge: int = 2
    eps: float = 1e-6
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)


def deepstack_layers(text: ModelShape, v: VisionShape) -> list[int]:
    """The blocks whose outputs feed a deepstack merger: as many as the text model's n_deepstack_layers (llama.cpp
    checks the widths agree), the first ones, so that later blocks still run after them."""
    n = int(architecture(text.arch).metadata(text)[f"{text.arch}.n_deepstack_layers"].value)
    if n >= v.n_layer:
        raise ValueError(f"the encoder needs more than {n} blocks for {n} deepstack layers")
    return list(range(n))


def _tensors(text: ModelShape, v: VisionShape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, GGUF shape, kind) of every tensor; kind picks the random values: w (matrix), n (norm weight), b."""
    e, p, m = v.n_embd, v.patch_size, v.n_embd * v.n_merge * v.n_merge
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("v.patch_embd.weight", (p, p, 3, e), "w"),
        ("v.patch_embd.weight.1", (p, p, 3, e), "w"),
        ("v.patch_embd.bias", (e,), "b"),
        ("v.position_embd.weight", (e, v.n_per_side * v.n_per_side), "w"),
    ]
    for i in range(v.n_layer):
        out += [
            (f"v.blk.{i}.ln1.weight", (e,), "n"),
            (f"v.blk.{i}.ln1.bias", (e,), "b"),
            (f"v.blk.{i}.attn_qkv.weight", (e, 3 * e), "w"),
            (f"v.blk.{i}.attn_qkv.bias", (3 * e,), "b"),
            (f"v.blk.{i}.attn_out.weight", (e, e), "w"),
            (f"v.blk.{i}.attn_out.bias", (e,), "b"),
            (f"v.blk.{i}.ln2.weight", (e,), "n"),
            (f"v.blk.{i}.ln2.bias", (e,), "b"),
            (f"v.blk.{i}.ffn_up.weight", (e, v.n_ff), "w"),
            (f"v.blk.{i}.ffn_up.bias", (v.n_ff,), "b"),
            (f"v.blk.{i}.ffn_down.weight", (v.n_ff, e), "w"),
            (f"v.blk.{i}.ffn_down.bias", (e,), "b"),
        ]
    for i in deepstack_layers(text, v):
        out += [
            (f"v.deepstack.{i}.norm.weight", (m,), "n"),
            (f"v.deepstack.{i}.norm.bias", (m,), "b"),
            (f"v.deepstack.{i}.fc1.weight", (m, m), "w"),
            (f"v.deepstack.{i}.fc1.bias", (m,), "b"),
            (f"v.deepstack.{i}.fc2.weight", (m, text.n_embd), "w"),
            (f"v.deepstack.{i}.fc2.bias", (text.n_embd,), "b"),
        ]
    out += [
        ("v.post_ln.weight", (e,), "n"),
        ("v.post_ln.bias", (e,), "b"),
        ("mm.0.weight", (m, m), "w"),
        ("mm.0.bias", (m,), "b"),
        ("mm.2.weight", (m, text.n_embd), "w"),
        ("mm.2.bias", (text.n_embd,), "b"),
    ]
    return out


def _metadata(text: ModelShape, v: VisionShape, name: str) -> dict[str, KV]:
    kv = clip_kv(name, "qwen3vl_merger", text.n_embd, v, v.patch_size * v.n_per_side)
    kv["clip.use_gelu"] = KV.boolean(True)  # Qwen3-VL's gelu_pytorch_tanh: ggml_gelu
    kv["clip.vision.spatial_merge_size"] = KV.u32(v.n_merge)
    return kv


@dataclass(frozen=True)
class Gemma4VisionShape:
    """A small Gemma 4 encoder: the real one is 768 wide (E2B/E4B) or 1152 (26B-A4B, 31B), 16 heads, 16 or 27
    blocks, patches of 16 pooled 3×3, position tables of 10240."""

    n_embd: int = 32
    n_head: int = 2  # heads of 16: RoPE turns 8 dims by the column, 8 by the row
    n_ff: int = 64
    n_layer: int = 3
    patch_size: int = 8
    pos_size: int = 256  # the position tables' length: a side of at most 256 patches
    eps: float = 1e-6
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the encoder takes 2·v − 1 itself
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)


# Gemma4ClippableLinear's bounds the factory writes (one-value F32 tensors beside a matrix): tight enough that
# some values of a random model are clamped, so that a clamp left out shows
GEMMA4_CLAMPS = {
    "v.blk.0.attn_q": {"input_min": -1.5, "input_max": 1.5, "output_min": -2.0, "output_max": 2.0},
    "v.blk.1.ffn_gate": {"input_min": -1.0, "input_max": 1.25},
    "mm.input_projection": {"output_min": -1.5, "output_max": 1.5},
}


def _gemma4_tensors(text: ModelShape, v: Gemma4VisionShape) -> list[tuple[str, tuple[int, ...], str]]:
    e, p, d = v.n_embd, v.patch_size, v.n_embd // v.n_head
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("v.patch_embd.weight", (p, p, 3, e), "w"),
        ("v.position_embd.weight", (e, v.pos_size, 2), "u"),
    ]
    for i in range(v.n_layer):
        b = f"v.blk.{i}"
        out += gated_block(b, e, v.n_ff)
        out += [
            (f"{b}.attn_q_norm.weight", (d,), "n"),
            (f"{b}.attn_k_norm.weight", (d,), "n"),
            (f"{b}.attn_post_norm.weight", (e,), "n"),
            (f"{b}.ffn_post_norm.weight", (e,), "n"),
            (f"{b}.out_scale.weight", (1,), "n"),
        ]
    out += [
        ("v.std_bias", (e,), "b"),
        ("v.std_scale", (e,), "n"),
        ("mm.input_projection.weight", (e, text.n_embd), "w"),
    ]
    for base, bounds in GEMMA4_CLAMPS.items():
        out += [(f"{base}.{k}", (1,), f"={x}") for k, x in bounds.items()]
    return out


def _gemma4_metadata(text: ModelShape, v: Gemma4VisionShape, name: str) -> dict[str, KV]:
    """As convert_hf_to_gguf's Gemma4VisionAudioModel writes it: no clip.use_gelu (llama.cpp then runs the FFN with
    gelu_quick), no projector.scale_factor (3)."""
    return clip_kv(name, "gemma4v", text.n_embd, v, 224)  # (image_size unused: the converter's placeholder)


def _values(name: str, shape: tuple[int, ...], kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    n = int(np.prod(shape))
    if kind.startswith("="):  # a given value (a clamp bound)
        return np.full(n, float(kind[1:]), np.float32)
    if kind == "n":
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    if kind == "u":  # values of order one (a learned position table: as large as the patches it is added to)
        return (0.5 * rng.standard_normal(n)).astype(np.float32)
    if kind == "b":
        return (0.05 * rng.standard_normal(n)).astype(np.float32)
    fan_in = n // shape[-1]
    return np.asarray(rng.standard_normal(n) / np.sqrt(fan_in), np.float32)


def _type(name: str, shape: tuple[int, ...], f16: bool) -> int:
    """F16 for the matrices and convolutions, as published mmproj files have them; norms, biases and the learned
    positions (which ggml_interpolate resizes in F32) stay F32."""
    return _F16 if f16 and len(shape) > 1 and name != "v.position_embd.weight" else _F32


def write_mmproj(
    path: str, text: ModelShape, seed: int = 0, v: VisionShape | PixtralShape | None = None, type_name: str = "F32"
) -> str:
    """Writes an mmproj GGUF for `text`'s family (qwen3vlmoe, gemma4), F32 or F16 (`type_name`); returns its path."""
    if type_name not in ("F32", "F16"):
        raise ValueError(f"--mmproj: the image encoder is written in F32 or F16, not {type_name}")
    f16 = type_name == "F16"
    if text.arch == "qwen3vlmoe":
        q = v if isinstance(v, VisionShape) else VisionShape()
        specs = _tensors(text, q)
        kv = _metadata(text, q, path.rsplit("/", 1)[-1].removesuffix(".gguf"))
    elif text.arch == "gemma4":
        g = Gemma4VisionShape()
        specs = _gemma4_tensors(text, g)
        kv = _gemma4_metadata(text, g, path.rsplit("/", 1)[-1].removesuffix(".gguf"))
    elif text.arch == "mistral4":  # Pixtral's (testmodel/mmproj_pixtral.py)
        p = v if isinstance(v, PixtralShape) else PixtralShape()
        specs = pixtral_tensors(text, p)
        kv = pixtral_metadata(text, p, path.rsplit("/", 1)[-1].removesuffix(".gguf"))
    else:
        raise ValueError(
            f"--mmproj: the factory writes image encoders for qwen3vlmoe, gemma4 and mistral4, not {text.arch}"
        )
    types = [_type(n, s, f16) for n, s, _ in specs]
    infos = [TensorInfo(n, s, t, 0, tensor_nbytes(s, t)) for (n, s, _), t in zip(specs, types, strict=True)]
    data_size = layout_tensors(infos, ALIGNMENT)
    kv["general.file_type"] = KV.u32(1 if f16 else 0)
    header, _ = encode_header(kv, infos, ALIGNMENT)
    with atomic_output(path, len(header) + data_size) as tmp, open(tmp, "wb") as f:
        f.write(header)
        for (n, s, kind), info in zip(specs, infos, strict=True):
            f.seek(len(header) + info.offset)
            values = _values(n, s, kind, seed)
            f.write((values.astype(np.float16) if info.type == _F16 else values).tobytes())
        f.truncate(len(header) + data_size)
    return path
