"""The clip keys every factory mmproj writes (testmodel/mmproj.py, mmproj_pixtral.py): the encoder's size, its
projector, the text model's width it projects to, the image's normalisation. A family adds its own
(clip.use_gelu / use_silu, spatial_merge_size, …). And the tensors of an RMSNorm ViT block with separate Q/K/V and
a gated FFN (Pixtral's; Gemma 4's add their norms and scale)."""

from __future__ import annotations

from typing import Protocol

from tokenwing.format.gguf_io import KV, ValueType


class EncoderShape(Protocol):
    @property
    def n_embd(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_ff(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def patch_size(self) -> int: ...
    @property
    def eps(self) -> float: ...
    @property
    def image_mean(self) -> tuple[float, float, float]: ...
    @property
    def image_std(self) -> tuple[float, float, float]: ...


def clip_kv(name: str, projector: str, text_embd: int, v: EncoderShape, image_size: int) -> dict[str, KV]:
    return {
        "general.architecture": KV.string("clip"),
        "general.name": KV.string(name),
        "general.file_type": KV.u32(0),
        "clip.projector_type": KV.string(projector),
        "clip.has_vision_encoder": KV.boolean(True),
        "clip.vision.embedding_length": KV.u32(v.n_embd),
        "clip.vision.feed_forward_length": KV.u32(v.n_ff),
        "clip.vision.block_count": KV.u32(v.n_layer),
        "clip.vision.projection_dim": KV.u32(text_embd),
        "clip.vision.attention.head_count": KV.u32(v.n_head),
        "clip.vision.attention.layer_norm_epsilon": KV.f32(v.eps),
        "clip.vision.image_size": KV.u32(image_size),
        "clip.vision.patch_size": KV.u32(v.patch_size),
        "clip.vision.image_mean": KV.array(ValueType.FLOAT32, v.image_mean),
        "clip.vision.image_std": KV.array(ValueType.FLOAT32, v.image_std),
    }


def gated_block(b: str, e: int, n_ff: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, GGUF shape, kind) of block `b`'s norms (weights only), Q/K/V/out and gate/up/down, without biases."""
    return [
        (f"{b}.ln1.weight", (e,), "n"),
        (f"{b}.attn_q.weight", (e, e), "w"),
        (f"{b}.attn_k.weight", (e, e), "w"),
        (f"{b}.attn_v.weight", (e, e), "w"),
        (f"{b}.attn_out.weight", (e, e), "w"),
        (f"{b}.ln2.weight", (e,), "n"),
        (f"{b}.ffn_gate.weight", (e, n_ff), "w"),
        (f"{b}.ffn_up.weight", (e, n_ff), "w"),
        (f"{b}.ffn_down.weight", (n_ff, e), "w"),
    ]
