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

from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.models.deepseek2 import DeepSeek2
from tokenwing.models.hparams import HParams


class Mistral4(DeepSeek2):
    arch = "mistral4"

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
