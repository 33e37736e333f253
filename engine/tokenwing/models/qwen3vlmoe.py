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

from tokenwing.compute.ggml_lib import ROPE_IMROPE
from tokenwing.errors import BadInputError
from tokenwing.models.base import MoEModel
from tokenwing.models.hparams import HParams
from tokenwing.models.weights import ModelWeights


class Qwen3VLMoE(MoEModel):
    arch = "qwen3vlmoe"
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
