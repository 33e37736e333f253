"""Hyper-parameters of a model, read from its GGUF metadata (shared by every architecture)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenwing.errors import BadInputError


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    n_expert: int
    n_expert_used: int
    n_dense_lead: int
    vocab_size: int
    n_rot: int  # dimensions RoPE rotates (partial rotary: fewer than head_dim)
    n_mtp: int = 0  # multi-token-prediction blocks after the n_layer that run (GLM-4.5: 1); kept, never run
    expert_weights_scale: float = 1.0  # routing weights multiplied by this (glm4moe: 2.5)
    expert_weights_norm: bool | None = None  # renormalise the top-k weights (None: the family's default)
    gating: int = 0  # expert_gating_func: 1 softmax, 2 sigmoid (0: the family's default)


def read_hparams(meta: dict[str, Any], arch: str, where: str) -> HParams:
    def get(key: str, default: Any = None, kind: type = int) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise BadInputError(f"{where}: {arch}.{key} is missing from the metadata")
        if kind is int and (not isinstance(v, int) or isinstance(v, bool)):
            raise BadInputError(f"{where}: {arch}.{key} must be an integer")
        if kind is float and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise BadInputError(f"{where}: {arch}.{key} must be a number")
        return kind(v)

    n_embd = get("embedding_length")
    n_head = get("attention.head_count")
    head_dim = get("attention.key_length", n_embd // max(n_head, 1))
    tokens = meta.get("tokenizer.ggml.tokens")
    hp = HParams(
        arch=arch,
        n_layer=get("block_count") - get("nextn_predict_layers", 0),  # (MTP blocks, last, are not run)
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=get("attention.head_count_kv", n_head),
        head_dim=head_dim,
        n_ctx_train=get("context_length"),
        rms_eps=get("attention.layer_norm_rms_epsilon", kind=float),
        rope_base=get("rope.freq_base", 10000.0, kind=float),
        n_expert=get("expert_count"),
        n_expert_used=get("expert_used_count"),
        n_dense_lead=get("leading_dense_block_count", 0),
        vocab_size=len(tokens) if isinstance(tokens, list) else 0,
        n_rot=get("rope.dimension_count", head_dim),
        expert_weights_scale=get("expert_weights_scale", 0.0, kind=float) or 1.0,
        gating=get("expert_gating_func", 0),
        n_mtp=get("nextn_predict_layers", 0),
        expert_weights_norm=_flag(meta.get(f"{arch}.expert_weights_norm"), f"{where}: {arch}.expert_weights_norm"),
    )
    if hp.n_mtp < 0:
        raise BadInputError(f"{where}: nextn_predict_layers must not be negative")
    if hp.gating not in (0, 1, 2):
        raise BadInputError(f"{where}: expert_gating_func {hp.gating} is not softmax (1) or sigmoid (2)")
    if not 0 < hp.n_rot <= hp.head_dim or hp.n_rot % 2:
        raise BadInputError(f"{where}: rope.dimension_count must be even, positive and at most the head size")
    if min(hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ctx_train) <= 0:
        raise BadInputError(f"{where}: the model's dimensions must be positive")
    if hp.n_head % hp.n_head_kv:
        raise BadInputError(f"{where}: head_count must be a multiple of head_count_kv")
    return hp


def _flag(v: Any, what: str) -> bool | None:
    if v is None or isinstance(v, bool):
        return v
    raise BadInputError(f"{what} must be a boolean")
