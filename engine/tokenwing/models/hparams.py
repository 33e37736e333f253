"""Hyper-parameters of a model, read from its GGUF metadata (shared by every architecture)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.errors import BadInputError
from tokenwing.format.validate import check_ranges


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
    head_dim_v: int = 0  # attention.value_length (0: head_dim)
    # multi-head latent attention (deepseek2): the ranks, and the per-head sizes once decompressed
    q_lora_rank: int = 0  # 0: a plain attn_q
    kv_lora_rank: int = 0
    head_dim_k_mla: int = 0  # attention.key_length_mla: no-rope + rope dims (0: not MLA)
    head_dim_v_mla: int = 0
    n_expert_groups: int = 1  # expert_group_count: top-k within the best groups (DeepSeek-V3)
    n_group_used: int = 1
    # RoPE scaling (rope.scaling.*), as llama.cpp reads it
    rope_scaling: str = "none"  # none, linear, yarn
    rope_freq_scale: float = 1.0  # 1 / rope.scaling.factor
    n_ctx_orig: int = 0  # rope.scaling.original_context_length (0: the training context)
    rope_yarn_log_mul: float = 0.0  # rope.scaling.yarn_log_multiplier as the file has it
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor
    sliding_window: int = 0  # attention.sliding_window (gpt-oss: the windowed layers' span)
    swa_pattern: tuple[bool, ...] | int = 0  # attention.sliding_window_pattern: per layer, or every n-th dense
    # linear-attention (recurrent) layers: gated DeltaNet (qwen3next, qwen35moe), KDA (bailingmoe3)
    recurrent: tuple[bool, ...] = ()  # per layer that runs: a linear-attention layer (empty: none)
    ssm_d_conv: int = 0  # ssm.conv_kernel: the short convolution's width
    ssm_d_inner: int = 0  # ssm.inner_size: value heads × their size
    ssm_d_state: int = 0  # ssm.state_size: the size of a key (and value) head
    ssm_dt_rank: int = 0  # ssm.time_step_rank: value heads
    ssm_n_group: int = 0  # ssm.group_count: key heads
    rope_sections: tuple[int, ...] = ()  # rope.dimension_sections: multi-axis RoPE (qwen35moe's IMRoPE)
    swiglu_limit_exp: tuple[float, ...] = ()  # swiglu_clamp_exp: per layer, the routed experts' SwiGLU limit
    swiglu_limit_shexp: tuple[float, ...] = ()  # swiglu_clamp_shexp: the shared expert's (and a dense FFN's)
    # Every `<arch>.` key as the file has it (the prefix dropped): a family file reads the keys only it needs from
    # here (models/gemma4.py), so they live in that file, not in this one
    keys: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.head_dim_k_mla > 0 and self.head_dim_v_mla > 0

    def is_recurrent(self, il: int) -> bool:
        return il < len(self.recurrent) and self.recurrent[il]


# How a family marks its linear-attention layers in the metadata (llama.cpp's loaders): not at all; a list
# (attention.recurrent_layers) or else every layer but each full_attention_interval-th (Qwen3-Next, Qwen3.5);
# or a head_count_kv of 0 in the per-layer list (Ling 3.0).
RECURRENCE = ("none", "interval", "kv_heads")


def read_hparams(meta: dict[str, Any], arch: str, where: str, recurrence: str = "none") -> HParams:
    def get(key: str, default: Any = None, kind: type = int) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise BadInputError(f"{where}: {arch}.{key} is missing from the metadata")
        if kind is int and (not isinstance(v, int) or isinstance(v, bool)):
            raise BadInputError(f"{where}: {arch}.{key} must be an integer")
        if kind is float and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise BadInputError(f"{where}: {arch}.{key} must be a number")
        return kind(v)

    check_ranges(meta, arch, where)  # before anything below is built per layer or per head from these numbers
    n_embd = get("embedding_length")
    n_layer = get("block_count") - get("nextn_predict_layers", 0)  # (MTP blocks, last, are not run)
    # Query heads: one count, or one per layer (llama.cpp's get_key_or_arr; Step-3.5's sliding-window layers have
    # more). n_head is the most a layer has (what sizes the graphs); the list stays in `keys` for the family
    listed = meta.get(f"{arch}.attention.head_count")
    q_heads = (
        _ints(listed, f"{where}: {arch}.attention.head_count") if _is_list(listed) else [get("attention.head_count")]
    )
    if len(q_heads) > 1 and len(q_heads) < n_layer:
        raise BadInputError(f"{where}: {arch}.attention.head_count lists fewer layers than block_count")
    n_head = max(q_heads[:n_layer] or [0])
    head_dim = get("attention.key_length", n_embd // max(q_heads[0], 1))  # (llama.cpp: n_embd / the first layer's)
    tokens = meta.get("tokenizer.ggml.tokens")
    kv_heads = _ints(meta.get(f"{arch}.attention.head_count_kv", n_head), f"{where}: {arch}.attention.head_count_kv")
    if len(kv_heads) > 1 and len(kv_heads) < n_layer:
        raise BadInputError(f"{where}: {arch}.attention.head_count_kv lists fewer layers than block_count")
    hp = HParams(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=max(kv_heads[:n_layer] or [0]),  # (a list: the attention layers' count; 0 in linear ones)
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
        head_dim_v=get("attention.value_length", head_dim),
        q_lora_rank=get("attention.q_lora_rank", 0),
        kv_lora_rank=get("attention.kv_lora_rank", 0),
        head_dim_k_mla=get("attention.key_length_mla", 0),
        head_dim_v_mla=get("attention.value_length_mla", 0),
        n_expert_groups=get("expert_group_count", 0) or 1,
        n_group_used=get("expert_group_used_count", 0) or 1,
        rope_scaling=_scaling(meta.get(f"{arch}.rope.scaling.type", "linear"), f"{where}: {arch}.rope.scaling.type"),
        rope_freq_scale=1.0 / factor if (factor := get("rope.scaling.factor", 0.0, kind=float)) else 1.0,
        n_ctx_orig=get("rope.scaling.original_context_length", 0),
        rope_yarn_log_mul=get("rope.scaling.yarn_log_multiplier", 0.0, kind=float),
        rope_attn_factor=get("rope.scaling.attn_factor", 1.0, kind=float),
        sliding_window=get("attention.sliding_window", 0),
        swa_pattern=_pattern(meta.get(f"{arch}.attention.sliding_window_pattern", 0), f"{where}: {arch}"),
        recurrent=_recurrent(meta, arch, where, recurrence, n_layer, kv_heads),
        ssm_d_conv=get("ssm.conv_kernel", 0),
        ssm_d_inner=get("ssm.inner_size", 0),
        ssm_d_state=get("ssm.state_size", 0),
        ssm_dt_rank=get("ssm.time_step_rank", 0),
        ssm_n_group=get("ssm.group_count", 0),
        rope_sections=tuple(_ints(meta.get(f"{arch}.rope.dimension_sections", []), f"{where}: {arch}.rope")),
        swiglu_limit_exp=_floats(
            meta.get(f"{arch}.swiglu_clamp_exp", []), n_layer, f"{where}: {arch}.swiglu_clamp_exp"
        ),
        swiglu_limit_shexp=_floats(
            meta.get(f"{arch}.swiglu_clamp_shexp", []), n_layer, f"{where}: {arch}.swiglu_clamp_shexp"
        ),
        keys={k[len(arch) + 1 :]: v for k, v in meta.items() if k.startswith(f"{arch}.")},
    )
    if hp.n_mtp < 0:
        raise BadInputError(f"{where}: nextn_predict_layers must not be negative")
    if hp.gating not in (0, 1, 2) and not (hp.gating == 4 and arch == "deepseek4"):
        raise BadInputError(f"{where}: expert_gating_func {hp.gating} is not softmax (1) or sigmoid (2)")
    if not 0 < hp.n_rot <= hp.head_dim or hp.n_rot % 2:
        raise BadInputError(f"{where}: rope.dimension_count must be even, positive and at most the head size")
    if min(hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ctx_train) <= 0:
        raise BadInputError(f"{where}: the model's dimensions must be positive")
    if hp.n_head % hp.n_head_kv:
        raise BadInputError(f"{where}: head_count must be a multiple of head_count_kv")
    if hp.n_expert_groups > 1 and (hp.n_expert % hp.n_expert_groups or not 0 < hp.n_group_used <= hp.n_expert_groups):
        raise BadInputError(
            f"{where}: the experts must split evenly into expert_group_count groups, of which "
            "expert_group_used_count are used"
        )
    if hp.n_expert_groups > 1 and hp.n_group_used * (hp.n_expert // hp.n_expert_groups) < hp.n_expert_used:
        raise BadInputError(f"{where}: the groups used hold fewer experts than expert_used_count")
    if hp.rope_freq_scale <= 0 or hp.sliding_window < 0 or min(hp.q_lora_rank, hp.kv_lora_rank) < 0:
        raise BadInputError(f"{where}: rope.scaling.factor, sliding_window and the MLA ranks must be positive")
    return hp


def per_layer(hp: HParams, key: str, default: int) -> tuple[int, ...]:
    """A count for every layer, or one per layer (llama.cpp's get_key_or_arr), as one per layer that runs
    (per-layer head counts)."""
    v = hp.keys.get(key, default)
    v = v.tolist() if hasattr(v, "tolist") else v
    return tuple(int(h) for h in v[: hp.n_layer]) if isinstance(v, list) else (int(v),) * hp.n_layer


def _is_list(v: Any) -> bool:
    return isinstance(v, (list, np.ndarray))


def _ints(v: Any, what: str) -> list[int]:
    """An integer or a list of them (per-layer keys), as a list."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    items = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in items):
        raise BadInputError(f"{what} must be a count or one count per layer")
    return list(items)


def _floats(v: Any, n_layer: int, what: str) -> tuple[float, ...]:
    """A number for every layer, or one per layer (llama.cpp's get_key_or_arr), as one per layer."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    items = v if isinstance(v, list) else [v] * n_layer
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in items):
        raise BadInputError(f"{what} must be a number or one number per layer")
    return tuple(float(x) for x in items[:n_layer]) + (0.0,) * max(0, n_layer - len(items))


def _recurrent(
    meta: dict[str, Any], arch: str, where: str, recurrence: str, n_layer: int, kv_heads: list[int]
) -> tuple[bool, ...]:
    """Which layers are linear attention, as llama.cpp's loader of the family reads it."""
    if recurrence == "kv_heads":
        if len(kv_heads) < n_layer:
            raise BadInputError(f"{where}: {arch}.attention.head_count_kv must list every layer (0: linear attention)")
        return tuple(h == 0 for h in kv_heads[:n_layer])
    if recurrence == "interval":
        listed = meta.get(f"{arch}.attention.recurrent_layers")
        if listed is not None:
            flags = _pattern(listed, f"{where}: {arch}")
            if not isinstance(flags, tuple) or len(flags) < n_layer:
                raise BadInputError(f"{where}: {arch}.attention.recurrent_layers must have one flag per layer")
            return flags[:n_layer]
        interval = meta.get(f"{arch}.full_attention_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise BadInputError(f"{where}: {arch}.full_attention_interval must be a positive integer")
        return tuple((il + 1) % interval != 0 for il in range(n_layer))
    return ()


def _pattern(v: Any, what: str) -> tuple[bool, ...] | int:
    """attention.sliding_window_pattern: a period (int) or one flag per layer."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, list) and all(isinstance(x, (bool, int)) for x in v):
        return tuple(bool(x) for x in v)
    raise BadInputError(f"{what}.attention.sliding_window_pattern must be a count or one flag per layer")


def _scaling(v: Any, what: str) -> str:
    if v not in ("none", "linear", "yarn"):
        raise BadInputError(f"{what} must be none, linear or yarn (this version does not run {v!r})")
    return str(v)


def _flag(v: Any, what: str) -> bool | None:
    if v is None or isinstance(v, bool):
        return v
    raise BadInputError(f"{what} must be a boolean")
