"""One module per architecture family: how its weights map and how a layer computes (no I/O here)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.format.gguf_io import TensorInfo
from tokenwing.format.layout import ExpertLayer
from tokenwing.models.bailingmoe2 import BailingMoE2
from tokenwing.models.bailingmoe3 import BailingMoE3
from tokenwing.models.base import MoEModel
from tokenwing.models.deepseek2 import DeepSeek2
from tokenwing.models.deepseek4 import DeepSeek4
from tokenwing.models.ernie4_5_moe import Ernie45MoE
from tokenwing.models.gemma4 import Gemma4
from tokenwing.models.glm4moe import Glm4MoE
from tokenwing.models.glm_dsa import GlmDsa
from tokenwing.models.gpt_oss import GptOss
from tokenwing.models.hparams import HParams, read_hparams
from tokenwing.models.hy_v3 import HyV3
from tokenwing.models.kimi_k3 import KimiK3
from tokenwing.models.llama4 import Llama4
from tokenwing.models.mimo2 import Mimo2
from tokenwing.models.minimax_m2 import MiniMaxM2
from tokenwing.models.mistral4 import Mistral4
from tokenwing.models.qwen2moe import Qwen2MoE
from tokenwing.models.qwen3moe import Qwen3MoE
from tokenwing.models.qwen3next import Qwen3Next, Qwen35MoE
from tokenwing.models.qwen3vlmoe import Qwen3VLMoE
from tokenwing.models.qwen4exp import Qwen4Exp
from tokenwing.models.step35 import Step35

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
        Qwen3VLMoE,
        Mistral4,
        BailingMoE2,
        Gemma4,
        Llama4,
        Mimo2,
        HyV3,
        Step35,
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


def check_model(
    meta: dict[str, Any], arch: str, resident: Iterable[TensorInfo], layers: Iterable[ExpertLayer], where: str
) -> tuple[type[MoEModel], HParams]:
    """The family's own checks of a header against the tensors the file holds (`resident`: those that run;
    `layers`: the streamed expert layers), before anything is sized from its numbers: the hyper-parameters
    (read_hparams: ranges, positive head counts, dimensions that divide, each family's keys) and every tensor a
    layer uses with the shape they imply. One line naming the field otherwise. Every start and `verify` run it
    (runtime/preflight.py), and so do `inspect` and `repack` (format/inspect.py, format/repack.py), so that a
    file one of them refuses is refused by all."""
    model_class = family(arch)
    hp = read_hparams(meta, arch, where, model_class.recurrence)
    widths = {el.layer: el.shapes[0][0] for el in layers}
    if any(layer >= hp.n_layer + hp.n_mtp for layer in widths):
        raise BadInputError(f"{where}: experts of a layer beyond block_count")
    # Multi-token-prediction blocks come last: neither their tensors (kept in the file) nor their experts are
    # read (ExpertScheduler streams the layers that run).
    shapes = {t.name: t.shape for t in resident}
    model_class.check(hp, shapes, {k: v for k, v in widths.items() if k < hp.n_layer}, where)
    return model_class, hp
