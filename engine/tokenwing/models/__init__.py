"""One module per architecture family: how its weights map and how a layer computes (no I/O here)."""

from __future__ import annotations

from typing import Any

from tokenwing.errors import UnsupportedError
from tokenwing.models.bailingmoe3 import BailingMoE3
from tokenwing.models.base import MoEModel
from tokenwing.models.deepseek2 import DeepSeek2
from tokenwing.models.deepseek4 import DeepSeek4
from tokenwing.models.ernie4_5_moe import Ernie45MoE
from tokenwing.models.glm4moe import Glm4MoE
from tokenwing.models.glm_dsa import GlmDsa
from tokenwing.models.gpt_oss import GptOss
from tokenwing.models.hparams import read_hparams
from tokenwing.models.kimi_k3 import KimiK3
from tokenwing.models.minimax_m2 import MiniMaxM2
from tokenwing.models.qwen2moe import Qwen2MoE
from tokenwing.models.qwen3moe import Qwen3MoE
from tokenwing.models.qwen3next import Qwen3Next, Qwen35MoE
from tokenwing.models.qwen4exp import Qwen4Exp

FAMILIES: dict[str, type[MoEModel]] = {
    cls.arch: cls
    for cls in (
        Qwen3MoE,
        Qwen2MoE,
        Ernie45MoE,
        Glm4MoE,
        DeepSeek2,
        DeepSeek4,
        GptOss,
        Qwen3Next,
        Qwen35MoE,
        BailingMoE3,
        MiniMaxM2,
        KimiK3,
        Qwen4Exp,
        GlmDsa,
    )
}


def supported_architectures() -> list[str]:
    """The GGUF architecture names this engine runs."""
    return sorted(FAMILIES)


def family(arch: str) -> type[MoEModel]:
    try:
        return FAMILIES[arch]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise UnsupportedError(f"architecture {arch!r} cannot run yet (the engine runs {known})") from None


def kv_bytes_per_token(meta: dict[str, Any], arch: str, where: str, elt: int = 2) -> int:
    """A file's KV cache per token of context (`elt` bytes an element: 2 for F16), by its family's rule, from
    its metadata alone; UnsupportedError for an architecture the engine does not run, BadInputError for
    metadata its family cannot read."""
    cls = family(arch)
    return cls.kv_bytes_per_token(read_hparams(meta, arch, where, cls.recurrence), elt)
