"""Graph pieces shared by the MoE families: norms, attention over the KV cache, routers, dense and routed FFNs,
and the tail that adds a layer's experts, its shared expert and the residual.

They follow llama.cpp's graphs op for op (same ggml kernels, same order), so results match it to rounding. A
family module (`models/<arch>.py`) builds its layer graph from these, the way llama.cpp's `src/models/*.cpp`
do; nothing here knows a family by name.

Each piece lives in the module of its job, and this one names them all for the families (`common.attention`):
`tensors.py` (RMSNorm, a fused projection's rows), `placement.py` (where a graph's tokens go), `caches.py` (KV
caches and recurrent states), `attention.py` (RoPE, `attend`, `attention`), `routing.py` (routers), `ffn.py`
(dense and shared FFNs, a layer's result and `moe_tail`), `experts.py` (the routed experts).
"""

from __future__ import annotations

from tokenwing.models.attention import Rope, attend, attend_alone, attention, picks_mask, rope, rope_of
from tokenwing.models.caches import (
    BatchKV,
    KVCache,
    KVSpec,
    KVStack,
    LayerCache,
    RecurrentCache,
    StateSpec,
    kv_cache,
    recurrent_cache,
)
from tokenwing.models.experts import (
    GEMM_ROWS,
    SWIGLU,
    ExpertFFN,
    expert_activations,
    grouped_experts,
    grouped_rows,
    routed_experts,
    situ,
    sum_experts,
    token_experts,
    tokens_experts,
    weighted_down,
    weighted_experts,
)
from tokenwing.models.ffn import (
    LayerOut,
    Routed,
    dense_ffn,
    moe_tail,
    moe_tail_array,
    shared_expert,
    swiglu,
    swiglu_ffn,
)
from tokenwing.models.placement import (
    DECODE_WINDOW,
    DEVICE_DECODE_WINDOW,
    FLASH_ALIGN,
    FLASH_ROWS,
    Placement,
    Run,
    batch_runs,
    decode_window,
    placement,
    placement_arrays,
)
from tokenwing.models.routing import Router, route
from tokenwing.models.tensors import rms_norm, split_rows

__all__ = [
    "DECODE_WINDOW",
    "DEVICE_DECODE_WINDOW",
    "FLASH_ALIGN",
    "FLASH_ROWS",
    "GEMM_ROWS",
    "SWIGLU",
    "BatchKV",
    "ExpertFFN",
    "KVCache",
    "KVSpec",
    "KVStack",
    "LayerCache",
    "LayerOut",
    "Placement",
    "RecurrentCache",
    "Rope",
    "Routed",
    "Router",
    "Run",
    "StateSpec",
    "attend",
    "attend_alone",
    "attention",
    "batch_runs",
    "decode_window",
    "dense_ffn",
    "expert_activations",
    "grouped_experts",
    "grouped_rows",
    "kv_cache",
    "moe_tail",
    "moe_tail_array",
    "picks_mask",
    "placement",
    "placement_arrays",
    "recurrent_cache",
    "rms_norm",
    "rope",
    "rope_of",
    "route",
    "routed_experts",
    "shared_expert",
    "situ",
    "split_rows",
    "sum_experts",
    "swiglu",
    "swiglu_ffn",
    "token_experts",
    "tokens_experts",
    "weighted_down",
    "weighted_experts",
]
