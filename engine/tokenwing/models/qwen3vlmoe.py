"""Qwen3-VL MoE, its text part (`qwen3vlmoe`): Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B.

A layer is Qwen3-MoE's (per-head q/k RMSNorm, GQA, softmax router, top-k renormalised, SwiGLU experts), with
interleaved multi-axis RoPE (IMRoPE: `rope.dimension_sections`, the rotary pairs per axis) rotating the whole head,
as llama.cpp computes it (src/models/qwen3vlmoe.cpp: ggml_rope_multi, LLAMA_ROPE_TYPE_IMROPE). A text token's
position is the same on the three axes and 0 on the fourth, as llama.cpp sets it (llm_graph_input_pos); the pairs
that IMRoPE gives to the fourth axis are then not rotated, so the result is not plain NEOX RoPE.

The deepstack layers (`n_deepstack_layers`) add slices of an image's wider input embedding to the first layers'
outputs; for text llama.cpp pads the token embedding with zeros, so they add zeros. Images are issue 45's: this
family runs text, with the file's vision keys left unread.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tokenwing.compute.ggml_lib import ROPE_IMROPE
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import KV, ValueType
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv
from tokenwing.models.hparams import HParams
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Qwen3-VL MoE's text part: Qwen3-MoE's keys, IMRoPE's sections and the
    deepstack layers' count (the real models: 3; fewer than the layers here, which llama.cpp's graph needs where
    it keeps only the last token's output)."""
    a = "qwen3vlmoe"
    kv = common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_exp)
    kv[f"{a}.rope.dimension_sections"] = KV.array(ValueType.INT32, s.rope_sections)
    kv[f"{a}.n_deepstack_layers"] = KV.u32(min(3, s.n_layer - 1))
    return kv


def _check(s: ModelShape) -> None:
    if len(s.rope_sections) != 4 or 2 * sum(s.rope_sections) > s.head_dim or s.n_rot:
        raise ValueError("qwen3vlmoe rotates whole heads by IMRoPE: four section counts whose pairs fit in the head")


class Qwen3VLMoE(MoEModel):
    arch = "qwen3vlmoe"
    factory = Factory("Qwen3-VL MoE (text): Qwen3-MoE's layers with interleaved multi-axis RoPE (IMRoPE)", _kv, _check)
    qk_norm = True
    rope_mode = ROPE_IMROPE

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.rope = dataclasses.replace(self.rope, sections=hp.rope_sections)

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        # llama.cpp requires the sections (get_key_or_arr ..., required) and asserts that RoPE turns the whole head
        sections = hp.rope_sections
        if len(sections) != 4 or min(sections) < 0 or not any(sections) or sum(sections) * 2 > hp.n_rot:
            raise BadInputError(
                f"{where}: {cls.arch} needs rope.dimension_sections: four counts of rotary pairs within "
                "rope.dimension_count"
            )
        if hp.n_rot != hp.head_dim:
            raise BadInputError(f"{where}: {cls.arch} rotates whole heads: rope.dimension_count must be key_length")
        super().check(hp, shapes, streamed, where)
