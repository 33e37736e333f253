"""The factory's Pixtral mmproj (`tokenwing testmodel OUT.gguf --arch mistral4 --mmproj OUT.mmproj.gguf`): the
tensors and keys of `clip.projector_type` pixtral as llama.cpp's converter writes Mistral Small 3.1's and 4's
encoder (conversion/llava.py, pixtral.py; tools/mtmd/models/pixtral.cpp reads it). One patch convolution without a
bias, an RMS pre-norm, RMSNorm blocks with separate Q/K/V and a SwiGLU FFN, no biases (2-D RoPE, no learned
positions), the 2×2 patch merger (mm.input_norm, mm.patch_merger), the projector mm.1/mm.2 without biases and the
[IMG_BREAK] row (v.token_embd.img_break, the text model's embedding of that token in a real file). testmodel/mmproj.py
writes the file; shapes are in GGUF order (ne0 first), kinds as its `_values` takes them."""

from __future__ import annotations

from dataclasses import dataclass

from tokenwing.format.gguf_io import KV
from tokenwing.testmodel.clip_kv import clip_kv, gated_block
from tokenwing.testmodel.shapes import ModelShape


@dataclass(frozen=True)
class PixtralShape:
    """A small Pixtral encoder: the real one (Mistral Small 3.1/4) is 1024 wide, 16 heads, 24 blocks, patches of
    14, 2×2 merged, CLIP's mean and std. n_merge 1: the original Pixtral 12B's form (no patch merger, no
    spatial_merge_size key, its projector with biases)."""

    n_embd: int = 32
    n_head: int = 2  # heads of 16: 2-D RoPE rotates each half (8 dims) by the row or the column
    n_ff: int = 64
    n_layer: int = 3
    patch_size: int = 8
    n_merge: int = 2
    eps: float = 1e-5
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)


def pixtral_tensors(text: ModelShape, v: PixtralShape) -> list[tuple[str, tuple[int, ...], str]]:
    e, p = v.n_embd, v.patch_size
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("v.patch_embd.weight", (p, p, 3, e), "w"),
        ("v.pre_ln.weight", (e,), "n"),
    ]
    for i in range(v.n_layer):
        out += gated_block(f"v.blk.{i}", e, v.n_ff)
    if v.n_merge > 1:
        out += [("mm.input_norm.weight", (e,), "n"), ("mm.patch_merger.weight", (e * v.n_merge * v.n_merge, e), "w")]
    out += [("mm.1.weight", (e, text.n_embd), "w"), ("mm.2.weight", (text.n_embd, text.n_embd), "w")]
    if v.n_merge == 1:
        out += [("mm.1.bias", (text.n_embd,), "b"), ("mm.2.bias", (text.n_embd,), "b")]
    return [*out, ("v.token_embd.img_break", (text.n_embd,), "w")]  # (of order one, as a token embedding)


def pixtral_metadata(text: ModelShape, v: PixtralShape, name: str) -> dict[str, KV]:
    """As the converter writes it: clip.use_silu, the spatial merge, CLIP's mean and std (no rope key: llama.cpp
    runs Pixtral's 2-D RoPE at base 10,000 whatever a file says)."""
    kv = clip_kv(name, "pixtral", text.n_embd, v, v.patch_size * 64)
    kv["clip.use_silu"] = KV.boolean(True)
    if v.n_merge > 1:
        kv["clip.vision.spatial_merge_size"] = KV.u32(v.n_merge)
    return kv
