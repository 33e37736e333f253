"""Model geometry for generated models, with named presets from tiny (tests) to realistic (benchmarks)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    arch: str = "qwen3moe"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_dense_lead: int = 0  # leading dense FFN layers (deepseek2-style archs)
    n_ff_dense: int = 96
    n_shared_exp: int = 0  # shared experts (qwen2moe has one, gated)
    n_ff_shexp: int = 64
    vocab_size: int = 512
    context_length: int = 4096
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    embd_std: float = 1.0  # ~1.0 spreads random routing; real models' 0.02 makes it collapse
    weight_std: float = 0.0  # 0: 1/sqrt(fan_in) per matrix
    router_scale: float = 1.0  # routers' std × this: larger margins between the k-th and (k+1)-th expert

    def with_(self, **changes: object) -> ModelShape:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def n_params(self) -> int:
        from tokenwing.testmodel.architectures import tensor_specs

        total = 0
        for spec in tensor_specs(self):
            n = 1
            for d in spec.shape:
                n *= d
            total += n
        return total


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(),
    # Row lengths that are multiples of 256, so llama.cpp's K-quants apply to every matrix.
    "kquant": ModelShape(
        n_layer=2,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        n_ff_dense=512,
        n_ff_shexp=256,
        vocab_size=512,
    ),
    "small": ModelShape(
        n_layer=4,
        n_embd=512,
        n_head=8,
        n_head_kv=4,
        head_dim=64,
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=256,
        n_ff_dense=1024,
        n_ff_shexp=512,
        vocab_size=2048,
    ),
    # The benchmark geometry of the engine issue: Qwen3-30B-like experts, ~4.5 GB at Q4_K_M.
    "bench": ModelShape(
        n_layer=12,
        n_embd=2048,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=768,
        n_ff_dense=6144,
        n_ff_shexp=768,
        vocab_size=32000,
    ),
}


def preset_shape(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r} (choose from {', '.join(PRESETS)})") from None
