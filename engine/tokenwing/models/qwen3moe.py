"""Qwen3-MoE (`qwen3moe`) and the MoE transformers built like it.

A layer: RMSNorm → attention (q/k RMSNorm, NEOX RoPE, GQA) → residual → RMSNorm → softmax router → top-k →
renormalised weights → SwiGLU experts → residual. The same module carries what the next families need:
leading dense layers, shared experts (plain or sigmoid-gated, as in qwen2moe) and q/k/v biases; each
family is a `Family` value below.
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
        need(p + "ffn_norm.weight", (e,))
        if fam.attention.qk_norm:
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
        if streamed[il][0] != e:
            raise BadInputError(f"{where}: the experts of layer {il} have width {streamed[il][0]}, not {e}")
        if p + "ffn_gate_shexp.weight" in shapes:
            sh = shapes[p + "ffn_gate_shexp.weight"][1]
            need(p + "ffn_gate_shexp.weight", (e, sh))
            need(p + "ffn_up_shexp.weight", (e, sh))
            need(p + "ffn_down_shexp.weight", (sh, e))
            if fam.shared_gate:
                need(p + "ffn_gate_inp_shexp.weight", (e,))
