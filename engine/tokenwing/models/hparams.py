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


def read_hparams(meta: dict[str, Any], arch: str, where: str) -> HParams:
    def get(key: str, default: Any = None, kind: type = int) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise BadInputError(f"{where}: {arch}.{key} is missing from the metadata")
        if kind is int and not isinstance(v, int):
            raise BadInputError(f"{where}: {arch}.{key} must be an integer")
        return kind(v)

    n_embd = get("embedding_length")
    n_head = get("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    hp = HParams(
        arch=arch,
        n_layer=get("block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=get("attention.head_count_kv", n_head),
        head_dim=get("attention.key_length", n_embd // max(n_head, 1)),
        n_ctx_train=get("context_length"),
        rms_eps=get("attention.layer_norm_rms_epsilon", kind=float),
        rope_base=get("rope.freq_base", 10000.0, kind=float),
        n_expert=get("expert_count"),
        n_expert_used=get("expert_used_count"),
        n_dense_lead=get("leading_dense_block_count", 0),
        vocab_size=len(tokens) if isinstance(tokens, list) else 0,
    )
    if min(hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ctx_train) <= 0:
        raise BadInputError(f"{where}: the model's dimensions must be positive")
    if hp.n_head % hp.n_head_kv:
        raise BadInputError(f"{where}: head_count must be a multiple of head_count_kv")
    return hp
