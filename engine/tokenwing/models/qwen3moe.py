"""Qwen3-MoE (`qwen3moe`) and the MoE transformers built like it.

A layer: RMSNorm → attention (q/k RMSNorm, NEOX RoPE, GQA) → residual → RMSNorm → softmax router → top-k →
renormalised weights → SwiGLU experts → residual. The same module carries what the next families need:
leading dense layers, shared experts (plain or sigmoid-gated, as in qwen2moe) and q/k/v biases; each
family is a `Family` value below.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwing.compute.ggml_lib import ROPE_NEOX, ROPE_NORM
from tokenwing.errors import UnsupportedError
from tokenwing.models.common import AttentionSpec


@dataclass(frozen=True)
class Family:
    arch: str
    attention: AttentionSpec
    normalize_weights: bool  # renormalise the top-k routing weights to sum 1
    shared_gate: bool  # shared expert output scaled by sigmoid(ffn_gate_inp_shexp · x)


FAMILIES = {
    "qwen3moe": Family("qwen3moe", AttentionSpec(qk_norm=True, qkv_bias=False, rope_type=ROPE_NEOX), True, False),
    "qwen2moe": Family("qwen2moe", AttentionSpec(qk_norm=False, qkv_bias=True, rope_type=ROPE_NEOX), False, True),
    "ernie4_5-moe": Family(
        "ernie4_5-moe", AttentionSpec(qk_norm=False, qkv_bias=False, rope_type=ROPE_NORM), True, False
    ),
}


def family(arch: str) -> Family:
    try:
        return FAMILIES[arch]
    except KeyError:
        known = ", ".join(FAMILIES)
        raise UnsupportedError(f"architecture {arch!r} cannot run yet (the engine runs {known})") from None
