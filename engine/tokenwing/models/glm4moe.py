"""GLM-4.5 / GLM-4.5-Air (`glm4moe`).

q/k/v biases (q/k norms where the file has them), partial RoPE, leading dense layers, a post-attention norm
before the FFN, a sigmoid router whose top-k adds a per-expert selection bias with weights renormalised and
scaled by expert_weights_scale, shared experts; the multi-token-prediction blocks after the last layer are
neither loaded nor run (llama.cpp: src/models/glm4-moe.cpp).
"""

from __future__ import annotations

from tokenwing.models.base import MoEModel


class Glm4MoE(MoEModel):
    arch = "glm4moe"
    shared_experts = "required"
    shared_as_experts = True
    normalize_weights = False  # llama.cpp's default where the file has no expert_weights_norm
    routing_keys = True
    qk_norm = None
    qkv_bias = True
    ffn_norm = "post_attention_norm"
    sigmoid_router = True
    selection_bias = True
