"""Which tensors and metadata each generated architecture has, in llama.cpp's names and shapes.

Shapes are in GGUF order (row length first). One function per architecture family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenwing.format.gguf_io import KV
from tokenwing.testmodel.shapes import ModelShape


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: str  # "norm" (F32, ~1.0), "vector" (F32, small), "router" (F32), "embd", "matrix"

    @property
    def fan_in(self) -> int:
        return self.shape[0]


def _attention(s: ModelShape, i: int, qk_norm: bool, bias: bool) -> list[TensorSpec]:
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out = [
        TensorSpec(f"blk.{i}.attn_norm.weight", (s.n_embd,), "norm"),
        TensorSpec(f"blk.{i}.attn_q.weight", (s.n_embd, q), "matrix"),
        TensorSpec(f"blk.{i}.attn_k.weight", (s.n_embd, kv), "matrix"),
        TensorSpec(f"blk.{i}.attn_v.weight", (s.n_embd, kv), "matrix"),
        TensorSpec(f"blk.{i}.attn_output.weight", (q, s.n_embd), "matrix"),
    ]
    if qk_norm:
        out += [
            TensorSpec(f"blk.{i}.attn_q_norm.weight", (s.head_dim,), "norm"),
            TensorSpec(f"blk.{i}.attn_k_norm.weight", (s.head_dim,), "norm"),
        ]
    if bias:
        out += [
            TensorSpec(f"blk.{i}.attn_q.bias", (q,), "vector"),
            TensorSpec(f"blk.{i}.attn_k.bias", (kv,), "vector"),
            TensorSpec(f"blk.{i}.attn_v.bias", (kv,), "vector"),
        ]
    return out


def _routed_experts(s: ModelShape, i: int, norm: str = "ffn_norm") -> list[TensorSpec]:
    return [
        TensorSpec(f"blk.{i}.{norm}.weight", (s.n_embd,), "norm"),
        TensorSpec(f"blk.{i}.ffn_gate_inp.weight", (s.n_embd, s.n_expert), "router"),
        TensorSpec(f"blk.{i}.ffn_gate_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), "matrix"),
        TensorSpec(f"blk.{i}.ffn_up_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), "matrix"),
        TensorSpec(f"blk.{i}.ffn_down_exps.weight", (s.n_ff_exp, s.n_embd, s.n_expert), "matrix"),
    ]


def shared_ff(s: ModelShape) -> int:
    """Total width of the shared expert(s) of a layer."""
    return s.n_ff_shexp * max(1, s.n_shared_exp)


def _shared_expert(s: ModelShape, i: int, gated: bool, ff: int = 0) -> list[TensorSpec]:
    ff = ff or shared_ff(s)
    out = [
        TensorSpec(f"blk.{i}.ffn_gate_shexp.weight", (s.n_embd, ff), "matrix"),
        TensorSpec(f"blk.{i}.ffn_up_shexp.weight", (s.n_embd, ff), "matrix"),
        TensorSpec(f"blk.{i}.ffn_down_shexp.weight", (ff, s.n_embd), "matrix"),
    ]
    if gated:
        out.append(TensorSpec(f"blk.{i}.ffn_gate_inp_shexp.weight", (s.n_embd,), "router"))
    return out


def _dense_ffn(s: ModelShape, i: int, norm: str = "ffn_norm") -> list[TensorSpec]:
    return [
        TensorSpec(f"blk.{i}.{norm}.weight", (s.n_embd,), "norm"),
        TensorSpec(f"blk.{i}.ffn_gate.weight", (s.n_embd, s.n_ff_dense), "matrix"),
        TensorSpec(f"blk.{i}.ffn_up.weight", (s.n_embd, s.n_ff_dense), "matrix"),
        TensorSpec(f"blk.{i}.ffn_down.weight", (s.n_ff_dense, s.n_embd), "matrix"),
    ]


def _head(s: ModelShape) -> tuple[list[TensorSpec], list[TensorSpec]]:
    first = [TensorSpec("token_embd.weight", (s.n_embd, s.vocab_size), "embd")]
    last = [
        TensorSpec("output_norm.weight", (s.n_embd,), "norm"),
        TensorSpec("output.weight", (s.n_embd, s.vocab_size), "matrix"),
    ]
    return first, last


def _qwen3moe(s: ModelShape) -> list[TensorSpec]:
    first, last = _head(s)
    layers: list[TensorSpec] = []
    for i in range(s.n_layer):
        layers += _attention(s, i, qk_norm=True, bias=False) + _routed_experts(s, i)
    return first + layers + last


def _qwen2moe(s: ModelShape) -> list[TensorSpec]:
    first, last = _head(s)
    layers: list[TensorSpec] = []
    for i in range(s.n_layer):
        layers += _attention(s, i, qk_norm=False, bias=True)
        layers += _routed_experts(s, i) + _shared_expert(s, i, gated=True)
    return first + layers + last


def _ernie45moe(s: ModelShape) -> list[TensorSpec]:
    first, last = _head(s)
    layers: list[TensorSpec] = []
    for i in range(s.n_layer):
        layers += _attention(s, i, qk_norm=False, bias=False)
        if i < s.n_dense_lead:
            layers += _dense_ffn(s, i)
            continue
        layers += _routed_experts(s, i)
        if s.n_shared_exp:
            layers += _shared_expert(s, i, gated=False)
    return first + layers + last


def _glm4moe(s: ModelShape) -> list[TensorSpec]:
    """GLM-4.5: q/k/v biases, post-attention norm, leading dense layers, sigmoid router with a selection bias,
    routed experts plus ungated shared experts as wide as n_shared_exp routed ones."""
    first, last = _head(s)
    layers: list[TensorSpec] = []
    norm = "post_attention_norm"
    for i in range(s.n_layer):
        layers += _attention(s, i, qk_norm=False, bias=True)
        if i < s.n_dense_lead:
            layers += _dense_ffn(s, i, norm)
            continue
        layers += [*_routed_experts(s, i, norm), TensorSpec(f"blk.{i}.exp_probs_b.bias", (s.n_expert,), "vector")]
        if s.n_shared_exp:
            layers += _shared_expert(s, i, gated=False, ff=s.n_ff_exp * s.n_shared_exp)
    return first + layers + last


def _common_kv(s: ModelShape, arch: str) -> dict[str, KV]:
    return {
        f"{arch}.context_length": KV.u32(s.context_length),
        f"{arch}.embedding_length": KV.u32(s.n_embd),
        f"{arch}.block_count": KV.u32(s.n_layer),
        f"{arch}.attention.head_count": KV.u32(s.n_head),
        f"{arch}.attention.head_count_kv": KV.u32(s.n_head_kv),
        f"{arch}.attention.key_length": KV.u32(s.head_dim),
        f"{arch}.attention.value_length": KV.u32(s.head_dim),
        f"{arch}.attention.layer_norm_rms_epsilon": KV.f32(s.rms_eps),
        f"{arch}.rope.freq_base": KV.f32(s.rope_base),
        f"{arch}.expert_count": KV.u32(s.n_expert),
        f"{arch}.expert_used_count": KV.u32(s.n_expert_used),
        f"{arch}.expert_feed_forward_length": KV.u32(s.n_ff_exp),
    }


def _qwen3moe_kv(s: ModelShape) -> dict[str, KV]:
    kv = _common_kv(s, "qwen3moe")
    kv["qwen3moe.feed_forward_length"] = KV.u32(s.n_ff_exp)
    return kv


def _qwen2moe_kv(s: ModelShape) -> dict[str, KV]:
    kv = _common_kv(s, "qwen2moe")
    kv["qwen2moe.feed_forward_length"] = KV.u32(s.n_ff_dense)
    kv["qwen2moe.expert_shared_feed_forward_length"] = KV.u32(shared_ff(s))
    return kv


def _ernie45moe_kv(s: ModelShape) -> dict[str, KV]:
    a = "ernie4_5-moe"
    kv = _common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_dense)
    kv[f"{a}.leading_dense_block_count"] = KV.u32(s.n_dense_lead)
    kv[f"{a}.interleave_moe_layer_step"] = KV.u32(1)
    kv[f"{a}.expert_shared_feed_forward_length"] = KV.u32(shared_ff(s) if s.n_shared_exp else 0)
    return kv


def _glm4moe_kv(s: ModelShape) -> dict[str, KV]:
    a = "glm4moe"
    kv = _common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_dense)
    kv[f"{a}.leading_dense_block_count"] = KV.u32(s.n_dense_lead)
    kv[f"{a}.expert_shared_count"] = KV.u32(s.n_shared_exp)
    kv[f"{a}.expert_weights_scale"] = KV.f32(2.5)
    kv[f"{a}.expert_weights_norm"] = KV.boolean(True)
    kv[f"{a}.expert_gating_func"] = KV.u32(2)  # sigmoid
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.head_dim // 2)  # partial rotary, as GLM-4.5
    kv[f"{a}.nextn_predict_layers"] = KV.u32(0)
    return kv


@dataclass(frozen=True)
class Architecture:
    name: str
    tensors: Callable[[ModelShape], list[TensorSpec]]
    metadata: Callable[[ModelShape], dict[str, KV]]
    description: str


ARCHITECTURES: dict[str, Architecture] = {
    "qwen3moe": Architecture(
        "qwen3moe",
        _qwen3moe,
        _qwen3moe_kv,
        "Qwen3-MoE: q/k RMSNorm, GQA, softmax top-k router, SwiGLU experts",
    ),
    "qwen2moe": Architecture(
        "qwen2moe",
        _qwen2moe,
        _qwen2moe_kv,
        "Qwen2-MoE: q/k/v bias, routed experts plus one sigmoid-gated shared expert",
    ),
    "ernie4_5-moe": Architecture(
        "ernie4_5-moe",
        _ernie45moe,
        _ernie45moe_kv,
        "ERNIE-4.5-MoE: leading dense layers, routed plus ungated shared experts",
    ),
    "glm4moe": Architecture(
        "glm4moe",
        _glm4moe,
        _glm4moe_kv,
        "GLM-4.5-MoE: q/k/v bias, partial RoPE, leading dense layers, sigmoid router with selection bias",
    ),
}


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        known = ", ".join(ARCHITECTURES)
        raise ValueError(f"unknown architecture {name!r} (the factory makes: {known})") from None


def tensor_specs(s: ModelShape) -> list[TensorSpec]:
    return architecture(s.arch).tensors(s)


def check_shape(s: ModelShape) -> None:
    """Rejects geometry the architecture cannot express (llama.cpp would refuse or misread it)."""
    if s.n_dense_lead and s.arch not in ("ernie4_5-moe", "glm4moe"):
        raise ValueError(f"{s.arch} has no leading dense layers (use --arch ernie4_5-moe or glm4moe)")
    if s.n_shared_exp and s.arch == "qwen3moe":
        raise ValueError("qwen3moe has no shared experts (use --arch qwen2moe or ernie4_5-moe)")
    if s.n_dense_lead >= s.n_layer:
        raise ValueError("at least one layer must be a MoE layer")
    if not 0 < s.n_expert_used <= s.n_expert:
        raise ValueError("--n-expert-used must be between 1 and --n-expert")
    if s.n_head % s.n_head_kv:
        raise ValueError("--n-head must be a multiple of --n-head-kv")
    small = {
        k: v
        for k, v in vars(s).items()
        if k.startswith("n_") and k != "n_dense_lead" and k != "n_shared_exp" and isinstance(v, int) and v <= 0
    }
    if small:
        raise ValueError(f"sizes must be positive: {', '.join(small)}")
