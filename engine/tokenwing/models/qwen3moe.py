"""Qwen3-MoE (`qwen3moe`) and the MoE transformers built like it.

A layer: RMSNorm → attention (q/k RMSNorm, NEOX RoPE, GQA) → residual → RMSNorm → softmax router → top-k →
renormalised weights → SwiGLU experts → residual. The same module carries what the next families need:
leading dense layers, shared experts (plain or sigmoid-gated, as in qwen2moe), q/k/v biases, partial RoPE,
and sigmoid routers whose selection adds a per-expert bias with scaled weights (glm4moe, as DeepSeek-V3);
each family is a `Family` value below.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwing.compute.ggml_lib import ROPE_NEOX, ROPE_NORM
from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.models.common import AttentionSpec
from tokenwing.models.hparams import HParams


@dataclass(frozen=True)
class Family:
    arch: str
    attention: AttentionSpec
    normalize_weights: bool  # renormalise the top-k routing weights to sum 1 (a file may say otherwise)
    shared_gate: bool  # shared expert output scaled by sigmoid(ffn_gate_inp_shexp · x)
    sigmoid_router: bool = False  # router probabilities by sigmoid, not softmax (a file may say otherwise)
    selection_bias: bool = False  # top-k on probabilities + exp_probs_b; weights from the probabilities alone
    ffn_norm: str = "ffn_norm"  # the norm before the FFN (glm4moe: post_attention_norm)


FAMILIES = {
    "qwen3moe": Family("qwen3moe", AttentionSpec(qk_norm=True, qkv_bias=False, rope_type=ROPE_NEOX), True, False),
    "qwen2moe": Family("qwen2moe", AttentionSpec(qk_norm=False, qkv_bias=True, rope_type=ROPE_NEOX), False, True),
    "ernie4_5-moe": Family(
        "ernie4_5-moe", AttentionSpec(qk_norm=False, qkv_bias=False, rope_type=ROPE_NORM), True, False
    ),
    "glm4moe": Family(
        "glm4moe",
        AttentionSpec(qk_norm=None, qkv_bias=True, rope_type=ROPE_NEOX),
        True,
        False,
        sigmoid_router=True,
        selection_bias=True,
        ffn_norm="post_attention_norm",
    ),
}


@dataclass(frozen=True)
class Routing:
    """How a model's router turns logits into experts and weights (the family's defaults, or the file's)."""

    sigmoid: bool
    normalize: bool
    scale: float
    bias: bool


def routing(fam: Family, hp: HParams) -> Routing:
    sigmoid = fam.sigmoid_router if hp.gating == 0 else hp.gating == 2
    normalize = fam.normalize_weights if hp.expert_weights_norm is None else hp.expert_weights_norm
    return Routing(sigmoid, normalize, hp.expert_weights_scale, fam.selection_bias)


def family(arch: str) -> Family:
    try:
        return FAMILIES[arch]
    except KeyError:
        known = ", ".join(FAMILIES)
        raise UnsupportedError(f"architecture {arch!r} cannot run yet (the engine runs {known})") from None


def check_tensors(
    fam: Family, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, tuple[int, int]], where: str
) -> None:
    """Every tensor a layer will use exists with the shape the hyper-parameters imply.

    ggml aborts the process on a shape mismatch, so a crafted or inconsistent file must stop here, with one line.
    streamed: block → (n_embd, n_ff) of its streamed experts.
    """
    e, q, kv = hp.n_embd, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim

    def need(name: str, shape: tuple[int, ...]) -> None:
        got = shapes.get(name)
        if got is None:
            raise BadInputError(f"{where}: tensor {name} is missing")
        if tuple(got) != shape:
            raise BadInputError(f"{where}: tensor {name} has shape {tuple(got)}, the metadata implies {shape}")

    need("token_embd.weight", (e, hp.vocab_size))
    need("output_norm.weight", (e,))
    if "output.weight" in shapes:
        need("output.weight", (e, hp.vocab_size))
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        need(p + "attn_norm.weight", (e,))
        need(p + "attn_q.weight", (e, q))
        need(p + "attn_k.weight", (e, kv))
        need(p + "attn_v.weight", (e, kv))
        need(p + "attn_output.weight", (q, e))
        need(p + fam.ffn_norm + ".weight", (e,))
        if fam.attention.qk_norm or (fam.attention.qk_norm is None and p + "attn_q_norm.weight" in shapes):
            need(p + "attn_q_norm.weight", (hp.head_dim,))
            need(p + "attn_k_norm.weight", (hp.head_dim,))
        if fam.attention.qkv_bias:
            need(p + "attn_q.bias", (q,))
            need(p + "attn_k.bias", (kv,))
            need(p + "attn_v.bias", (kv,))
        if il not in streamed:
            ff = shapes.get(p + "ffn_gate.weight", (e, 0))[1]
            need(p + "ffn_gate.weight", (e, ff))
            need(p + "ffn_up.weight", (e, ff))
            need(p + "ffn_down.weight", (ff, e))
            continue
        need(p + "ffn_gate_inp.weight", (e, hp.n_expert))
        if fam.selection_bias:
            need(p + "exp_probs_b.bias", (hp.n_expert,))
        if streamed[il][0] != e:
            raise BadInputError(f"{where}: the experts of layer {il} have width {streamed[il][0]}, not {e}")
        if p + "ffn_gate_shexp.weight" in shapes:
            sh = shapes[p + "ffn_gate_shexp.weight"][1]
            need(p + "ffn_gate_shexp.weight", (e, sh))
            need(p + "ffn_up_shexp.weight", (e, sh))
            need(p + "ffn_down_shexp.weight", (sh, e))
            if fam.shared_gate:
                need(p + "ffn_gate_inp_shexp.weight", (e,))
