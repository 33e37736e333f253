"""Mistral Small 4 (`mistral4`): 119B parameters, 128 experts, 4 used per token (6.5B active).

llama.cpp runs it as DeepSeek-V2/V3 (src/models/mistral4.cpp: llama_model_deepseek2's keys, tensors and graph under
its own name; the converter is conversion/mistral3.py's Mistral4Model, a DeepseekV2Model): multi-head latent
attention with YaRN, the router the file's keys describe (scoring function, weights normalised and scaled, a
selection bias where the file has one), shared experts, leading dense layers where the file says so. So here it is
`DeepSeek2` under this name, with one difference llama.cpp has: on a GPU it computes the experts' down projection
with F32 accumulation (its input can exceed F16's range), which the CPU does anyway.

llama.cpp would scale the queries by its attention-temperature rule where a file has attention.temperature_scale
(Mistral's own-format converter writes it, for DeepSeek-V2 files; Mistral4Model does not): such a file is refused
here rather than computed without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.format.gguf_io import KV
from tokenwing.models.deepseek2 import DEEPSEEK2_FIELDS, DeepSeek2, check_deepseek2, deepseek2_kv
from tokenwing.models.factory import Factory, gate_up
from tokenwing.models.hparams import HParams
from tokenwing.models.specs import Parts, TensorSpec

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def _tensors(s: ModelShape, hp: HParams, parts: Parts) -> list[TensorSpec]:
    """DeepSeek-V2's tensors (MLA, shared experts), its router without a selection bias, its gate and up experts
    fused where the shape says (`gate_up`)."""
    return gate_up(s, [t for t in Mistral4.tensors(hp, parts) if ".exp_probs_b." not in t.name])


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Mistral Small 4 (Mistral4Model, a DeepseekV2Model): DeepSeek-V2's keys under
    its own name, and the router as Mistral's MoE configs have it: softmax, weights normalised, scaled by 1."""
    a = "mistral4"
    kv = {k.replace("deepseek2.", f"{a}.", 1): v for k, v in deepseek2_kv(s).items()}
    kv[f"{a}.expert_gating_func"] = KV.u32(1)  # softmax
    kv[f"{a}.expert_weights_scale"] = KV.f32(1.0)
    return kv


class Mistral4(DeepSeek2):
    arch = "mistral4"
    factory = Factory(
        "Mistral Small 4: DeepSeek-V2's MLA, YaRN and shared experts with a softmax router",
        _kv,
        check_deepseek2,
        _tensors,
        takes=DEEPSEEK2_FIELDS | {"fused_gate_up"},
    )

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        scale = hp.keys.get("attention.temperature_scale", 0.0)  # (the one key of its own: HParams.keys)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise BadInputError(f"{where}: {cls.arch}.attention.temperature_scale must be a number")
        if scale:
            raise UnsupportedError(
                f"{where}: {cls.arch}.attention.temperature_scale (llama.cpp's position-dependent query scaling) "
                "is not run yet"
            )
        super().check(hp, shapes, streamed, where)
