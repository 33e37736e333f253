"""Which tensors and metadata each generated architecture has, in llama.cpp's names and shapes.

Shapes are in GGUF order (row length first). One function per architecture family.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from tokenwing.format.gguf_io import KV, ValueType
from tokenwing.models import FAMILIES, deepseek4, gemma4, llama4, mla, qwen3next
from tokenwing.models.bailingmoe2 import BailingMoE2
from tokenwing.models.base import MoEModel
from tokenwing.models.deepseek2 import DeepSeek2
from tokenwing.models.hparams import HParams, read_hparams
from tokenwing.models.keys import write_keys
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.testmodel.shapes import ModelShape
from tokenwing.testmodel.tokenizer import FAMILIES as tokenizer_families
from tokenwing.testmodel.tokenizer import build_vocabulary


def family_tensors(s: ModelShape) -> list[TensorSpec]:
    """The family's own list (`tensors` in models/<family>.py) at this shape: its hyper-parameters as the engine
    reads them from the metadata the factory writes (so keys and tensors cannot disagree), its parts as the shape
    has them (`parts`)."""
    cls = FAMILIES[s.arch]
    return cls.tensors(shape_hparams(s), parts(s, cls))


def shape_hparams(s: ModelShape) -> HParams:
    """The hyper-parameters the engine reads from the metadata the factory writes for this shape."""
    meta = {k: v.value for k, v in architecture(s.arch).metadata(s).items()}
    hp = read_hparams(meta, s.arch, f"the factory's {s.arch} shape", FAMILIES[s.arch].recurrence)
    return dataclasses.replace(hp, vocab_size=s.vocab_size)  # (the vocabulary is written apart from these keys)


def parts(s: ModelShape, cls: type[MoEModel]) -> Parts:
    """What the shape's file has of what a family may leave out: experts after the leading dense layers, shared
    experts where the family requires them or takes them and the shape has them (as wide as n_shared_exp routed
    experts where its keys say so, `shared_as_experts`), q/k norms and the selection bias where the family takes
    them."""
    shexp = s.n_ff_exp * s.n_shared_exp if cls.shared_as_experts else shared_ff(s)
    return Parts(
        moe_layers=frozenset(range(s.n_dense_lead, s.n_block)),
        ff_exp=s.n_ff_exp,
        ff_dense=s.n_ff_dense,
        ff_shexp={"required": shexp, "optional": shexp if s.n_shared_exp else 0}.get(cls.shared_experts, 0),
        qk_norm=bool(cls.qk_norm),
        exp_bias=cls.selection_bias is not False,  # (where a family takes it as the file has it: written)
        forms=frozenset({"ssm_in"} if s.legacy_ssm_in else ()),
    )


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
        TensorSpec(f"blk.{i}.ffn_gate_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), "expert"),
        TensorSpec(f"blk.{i}.ffn_up_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), "expert"),
        TensorSpec(f"blk.{i}.ffn_down_exps.weight", (s.n_ff_exp, s.n_embd, s.n_expert), "expert"),
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


def _mla_attention(s: ModelShape, i: int) -> list[TensorSpec]:
    """Multi-head latent attention's tensors of layer i (models/mla.py's list, at this shape's keys)."""
    return mla.tensors(shape_hparams(s), i)


def _nextn(s: ModelShape, i: int) -> list[TensorSpec]:
    """A DeepSeek-style next-token-prediction block's own tensors (llama.cpp's `blk.N.nextn.*`: deepseek2's)."""
    return DeepSeek2.mtp_tensors(shape_hparams(s), i)


def _qwen_linear(s: ModelShape, i: int, separate_alpha_beta: bool) -> list[TensorSpec]:
    """A gated DeltaNet layer's tensors (models/qwen3next.py's list, at this shape's keys)."""
    return qwen3next.linear_tensors(shape_hparams(s), i, separate_alpha_beta, s.legacy_ssm_in)


def _qwen_gated_attention(s: ModelShape, i: int) -> list[TensorSpec]:
    """Qwen3-Next's gated full attention's tensors (models/qwen3next.py's list)."""
    return qwen3next.gated_attention_tensors(shape_hparams(s), i)


def qwen_recurrent(s: ModelShape, i: int) -> bool:
    """Qwen3-Next / Qwen3.5: every layer but each full_attention_interval-th is linear attention."""
    return (i + 1) % s.full_attention_interval != 0


def ling_full_attention(s: ModelShape, i: int) -> bool:
    """Ling 3.0's layer pattern (llama.cpp's converter): MLA in each layer_group_size-th layer, in the layers after
    the last whole group, and in the next-token-prediction blocks; KDA in the others."""
    g = s.full_attention_interval
    return i >= s.n_layer or (i + 1) % g == 0 or i >= s.n_layer // g * g


def _kda(s: ModelShape, i: int) -> list[TensorSpec]:
    """A Kimi Delta Attention layer of Ling 3.0: q, k, v each with its own short convolution (4-D, as converted),
    a per-channel decay gate (ssm_f_a, dt bias, ssm_a = exp(A_log)), β, and a sigmoid output gate (ssm_g_a)."""
    e, d_inner = s.n_embd, s.ssm_d_state * s.n_head
    out = [TensorSpec(f"blk.{i}.attn_norm.weight", (e,), "norm")]
    for x in "qkv":
        out.append(TensorSpec(f"blk.{i}.attn_{x}.weight", (e, d_inner), "matrix"))
    for x in "qkv":
        out.append(TensorSpec(f"blk.{i}.ssm_conv1d_{x}.weight", (s.ssm_d_conv, 1, d_inner, 1), "vector"))
    return [
        *out,
        TensorSpec(f"blk.{i}.ssm_f_a.weight", (e, d_inner), "matrix"),
        TensorSpec(f"blk.{i}.ssm_beta.weight", (e, s.n_head), "matrix"),
        TensorSpec(f"blk.{i}.ssm_a", (1, s.n_head), "decay_pos"),
        TensorSpec(f"blk.{i}.ssm_dt.bias", (d_inner,), "vector"),
        TensorSpec(f"blk.{i}.ssm_g_a.weight", (e, d_inner), "matrix"),
        TensorSpec(f"blk.{i}.ssm_norm.weight", (s.ssm_d_state,), "norm"),
        TensorSpec(f"blk.{i}.attn_output.weight", (d_inner, e), "matrix"),
    ]


def _bailingmoe3(s: ModelShape) -> list[TensorSpec]:
    """Ling 3.0: KDA and gated MLA layers, leading dense layers, a sigmoid router with a selection bias, routed
    experts plus a shared expert; a next-token-prediction block (MLA + MoE) last."""
    first, last = _head(s)
    layers: list[TensorSpec] = []
    for i in range(s.n_block):
        if ling_full_attention(s, i):
            layers += [*_mla_attention(s, i), TensorSpec(f"blk.{i}.attn_gate.weight", (s.n_embd, s.n_head), "matrix")]
        else:
            layers += _kda(s, i)
        if i < s.n_dense_lead:
            layers += _dense_ffn(s, i)
        else:
            layers += [*_routed_experts(s, i), TensorSpec(f"blk.{i}.exp_probs_b.bias", (s.n_expert,), "vector")]
            layers += _shared_expert(s, i, gated=False)
        if i >= s.n_layer:
            layers += _ling_nextn(s, i)
    return first + layers + last


def _ling_nextn(s: ModelShape, i: int) -> list[TensorSpec]:
    """The extra tensors of a Ling 2.0 / 3.0 next-token-prediction block (Ling 2.0's family file lists them)."""
    return BailingMoE2.mtp_tensors(shape_hparams(s), i)


def _kimi_k3_kda(s: ModelShape, i: int) -> list[TensorSpec]:
    """A KDA layer of Kimi K3: Ling's projections and convolutions, the decay gate through a low-rank pair
    (ssm_f_a → ssm_f_b), ssm_a as -exp(A_log) over the heads (1-D), and a full-rank output gate (ssm_g)."""
    e, hd = s.n_embd, s.ssm_d_state
    d_inner = hd * s.n_head
    kda = [t for t in _kda(s, i) if t.name.split(".")[2] not in ("ssm_f_a", "ssm_a", "ssm_g_a")]
    return [
        *kda,
        TensorSpec(f"blk.{i}.ssm_f_a.weight", (e, hd), "matrix"),
        TensorSpec(f"blk.{i}.ssm_f_b.weight", (hd, d_inner), "matrix"),
        TensorSpec(f"blk.{i}.ssm_a", (s.n_head,), "decay_neg"),
        TensorSpec(f"blk.{i}.ssm_g.weight", (e, d_inner), "matrix"),
    ]


def _kimi_k3(s: ModelShape) -> list[TensorSpec]:
    """Kimi K3: KDA and gated nope-only MLA, the residual's score vectors, leading dense layers, a latent MoE
    (routed experts at n_expert_latent between ffn_routed_down and ffn_routed_norm/ffn_routed_up) with a sigmoid
    router and selection bias on the full width, a shared expert, an output head of its own."""
    first, last = _head(s)
    e, latent = s.n_embd, s.n_expert_latent or s.n_embd
    layers: list[TensorSpec] = []
    for i in range(s.n_layer):
        if ling_full_attention(s, i):
            gate = TensorSpec(f"blk.{i}.attn_gate.weight", (e, s.n_head * s.v_dim), "matrix")
            layers += [*_mla_attention(s, i), gate]
        else:
            layers += _kimi_k3_kda(s, i)
        if s.attn_res_block:
            layers += [
                TensorSpec(f"blk.{i}.attn_res_score.weight", (e,), "vector"),
                TensorSpec(f"blk.{i}.ffn_res_score.weight", (e,), "vector"),
            ]
        if i < s.n_dense_lead:
            layers += _dense_ffn(s, i)
            continue
        layers += [
            TensorSpec(f"blk.{i}.ffn_norm.weight", (e,), "norm"),
            TensorSpec(f"blk.{i}.ffn_gate_inp.weight", (e, s.n_expert), "router"),
            TensorSpec(f"blk.{i}.exp_probs_b.bias", (s.n_expert,), "vector"),
            TensorSpec(f"blk.{i}.ffn_gate_exps.weight", (latent, s.n_ff_exp, s.n_expert), "expert"),
            TensorSpec(f"blk.{i}.ffn_up_exps.weight", (latent, s.n_ff_exp, s.n_expert), "expert"),
            TensorSpec(f"blk.{i}.ffn_down_exps.weight", (s.n_ff_exp, latent, s.n_expert), "expert"),
        ]
        if s.n_expert_latent:
            layers += [
                TensorSpec(f"blk.{i}.ffn_routed_down.weight", (e, latent), "matrix"),
                TensorSpec(f"blk.{i}.ffn_routed_norm.weight", (latent,), "norm"),
                TensorSpec(f"blk.{i}.ffn_routed_up.weight", (latent, e), "matrix"),
            ]
        if s.n_shared_exp:
            layers += _shared_expert(s, i, gated=False, ff=s.n_ff_exp * s.n_shared_exp)
    if s.attn_res_block:
        last.append(TensorSpec("output_res_score.weight", (e,), "vector"))
    return first + layers + last


def dsv4_compress_ratios(s: ModelShape) -> tuple[int, ...]:
    """Each layer's KV compression: `s.compress_ratios`, or DeepSeek V4's pattern (two window-only layers, then CSA
    (4) and HCA (128) in turn; fewer window-only layers in a model too short for all three kinds)."""
    if s.compress_ratios:
        return s.compress_ratios
    lead = 2 if s.n_layer >= 4 else 1 if s.n_layer == 3 else 0
    return tuple(0 if i < lead else (4, 128)[(i - lead) % 2] for i in range(s.n_layer))


def _dsv4_attention(s: ModelShape, i: int, ratio: int) -> list[TensorSpec]:
    """DeepSeek V4's attention (llama.cpp's names): a low-rank query, one shared key/value head, per-head sinks, an
    output projection in o_group_count groups of rank o_lora_rank (attn_output_a as converted: 2-D, llama.cpp
    makes it 3-D); a compressing layer adds its compressor (the CSA layers' (ratio 4) state is twice as wide: two
    overlapping windows) and a CSA layer the lightning indexer with its own compressor."""
    e, hd, q_rank = s.n_embd, s.head_dim, s.q_lora_rank
    out = [
        TensorSpec(f"blk.{i}.attn_norm.weight", (e,), "norm"),
        TensorSpec(f"blk.{i}.attn_sinks.weight", (s.n_head,), "vector"),
        TensorSpec(f"blk.{i}.attn_q_a.weight", (e, q_rank), "matrix"),
        TensorSpec(f"blk.{i}.attn_q_a_norm.weight", (q_rank,), "norm"),
        TensorSpec(f"blk.{i}.attn_q_b.weight", (q_rank, s.n_head * hd), "matrix"),
        TensorSpec(f"blk.{i}.attn_kv.weight", (e, hd), "matrix"),
        TensorSpec(f"blk.{i}.attn_kv_a_norm.weight", (hd,), "norm"),
        TensorSpec(
            f"blk.{i}.attn_output_a.weight",
            (s.n_head * hd // s.o_group_count, s.o_lora_rank * s.o_group_count),
            "matrix",
        ),
        TensorSpec(f"blk.{i}.attn_output_b.weight", (s.o_group_count * s.o_lora_rank, e), "matrix"),
    ]
    if ratio:
        width = (2 if ratio == 4 else 1) * hd
        out += [
            TensorSpec(f"blk.{i}.attn_compressor_kv.weight", (e, width), "matrix"),
            TensorSpec(f"blk.{i}.attn_compressor_gate.weight", (e, width), "matrix"),
            TensorSpec(f"blk.{i}.attn_compressor_ape.weight", (width, ratio), "vector"),
            TensorSpec(f"blk.{i}.attn_compressor_norm.weight", (hd,), "norm"),
        ]
    if ratio == 4:
        idx = s.indexer_head_size
        out += [
            TensorSpec(f"blk.{i}.indexer.proj.weight", (e, s.indexer_n_head), "matrix"),
            TensorSpec(f"blk.{i}.indexer.attn_q_b.weight", (q_rank, s.indexer_n_head * idx), "matrix"),
            TensorSpec(f"blk.{i}.indexer_compressor_kv.weight", (e, 2 * idx), "matrix"),
            TensorSpec(f"blk.{i}.indexer_compressor_gate.weight", (e, 2 * idx), "matrix"),
            TensorSpec(f"blk.{i}.indexer_compressor_ape.weight", (2 * idx, ratio), "vector"),
            TensorSpec(f"blk.{i}.indexer_compressor_norm.weight", (idx,), "norm"),
        ]
    return out


def _hyper_connections(s: ModelShape, prefix: str, n_mix: int, n_scale: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{prefix}_fn.weight", (s.hc_mult * s.n_embd, n_mix), "mixer"),
        TensorSpec(f"{prefix}_base.weight", (n_mix,), "vector"),
        TensorSpec(f"{prefix}_scale.weight", (n_scale,), "vector"),
    ]


def _deepseek4(s: ModelShape) -> list[TensorSpec]:
    """DeepSeek V4: hc_mult residual streams mixed around each attention and FFN (per sublayer: a pre weight per
    stream, a post weight per stream and a stream-to-stream matrix, (2 + hc) * hc mixes), compressed sparse
    attention, a sqrt-softplus router with a selection bias (the hash layers: a token-id table instead), routed
    plus shared experts; the streams are merged for the head by their own mixes. No MTP block: the converter
    writes it to a file of its own."""
    first, last = _head(s)
    hc = s.hc_mult
    layers: list[TensorSpec] = []
    for i, ratio in enumerate(dsv4_compress_ratios(s)):
        layers += _dsv4_attention(s, i, ratio)
        layers += _hyper_connections(s, f"blk.{i}.hc_attn", (2 + hc) * hc, 3)
        layers += _hyper_connections(s, f"blk.{i}.hc_ffn", (2 + hc) * hc, 3)
        layers += _routed_experts(s, i)
        if i < s.hash_layer_count:
            ids = TensorSpec(f"blk.{i}.ffn_gate_tid2eid.weight", (s.n_expert_used, s.vocab_size), "expert_ids")
            layers.append(dataclasses.replace(ids, id_range=s.n_expert))
        else:
            layers.append(TensorSpec(f"blk.{i}.exp_probs_b.bias", (s.n_expert,), "vector"))
        layers += _shared_expert(s, i, gated=False, ff=s.n_ff_exp * s.n_shared_exp)
    return first + layers + last + _hyper_connections(s, "output_hc", hc, 1)


def _common_kv(s: ModelShape, arch: str) -> dict[str, KV]:
    return {
        f"{arch}.context_length": KV.u32(s.context_length),
        f"{arch}.embedding_length": KV.u32(s.n_embd),
        f"{arch}.block_count": KV.u32(s.n_block),
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


def _qwen3vlmoe_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Qwen3-VL MoE's text part: Qwen3-MoE's keys, IMRoPE's sections and the
    deepstack layers' count (the real models: 3; fewer than the layers here, which llama.cpp's graph needs where
    it keeps only the last token's output)."""
    a = "qwen3vlmoe"
    kv = _common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_exp)
    kv[f"{a}.rope.dimension_sections"] = KV.array(ValueType.INT32, s.rope_sections)
    kv[f"{a}.n_deepstack_layers"] = KV.u32(min(3, s.n_layer - 1))
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


def _sigmoid_routed_kv(s: ModelShape, a: str) -> dict[str, KV]:
    """The keys GLM-4.5 and DeepSeek-V3 share: dense layers first, shared experts, a sigmoid router whose top-k
    weights are normalised and scaled."""
    return {
        f"{a}.feed_forward_length": KV.u32(s.n_ff_dense),
        f"{a}.leading_dense_block_count": KV.u32(s.n_dense_lead),
        f"{a}.expert_shared_count": KV.u32(s.n_shared_exp),
        f"{a}.expert_weights_scale": KV.f32(s.expert_weights_scale),
        f"{a}.expert_weights_norm": KV.boolean(True),
        f"{a}.expert_gating_func": KV.u32(2),  # sigmoid
    }


def _glm4moe_kv(s: ModelShape) -> dict[str, KV]:
    a = "glm4moe"
    kv = _common_kv(s, a)
    kv.update(_sigmoid_routed_kv(s, a))
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.head_dim // 2)  # partial rotary, as GLM-4.5
    kv[f"{a}.nextn_predict_layers"] = KV.u32(0)
    return kv


def _yarn_kv(s: ModelShape, a: str) -> dict[str, KV]:
    """Rope scaling keys as the converter writes a config's `rope_scaling` of type yarn."""
    if not s.yarn_factor:
        return {}
    return {
        f"{a}.rope.scaling.type": KV.string("yarn"),
        f"{a}.rope.scaling.factor": KV.f32(s.yarn_factor),
        f"{a}.rope.scaling.original_context_length": KV.u32(s.yarn_orig_ctx),
        f"{a}.rope.scaling.yarn_beta_fast": KV.f32(s.yarn_beta_fast),
        f"{a}.rope.scaling.yarn_beta_slow": KV.f32(s.yarn_beta_slow),
    }


def _mla_kv(s: ModelShape, a: str) -> dict[str, KV]:
    """MLA's keys (deepseek2, bailingmoe3), expert groups and the vocabulary size, as the converter writes them."""
    kv = {f"{a}.vocab_size": KV.u32(s.vocab_size), f"{a}.rope.dimension_count": KV.u32(s.rot)}
    if s.q_lora_rank:
        kv[f"{a}.attention.q_lora_rank"] = KV.u32(s.q_lora_rank)
    kv[f"{a}.attention.kv_lora_rank"] = KV.u32(s.kv_lora_rank)
    if not s.legacy_kv_b:
        kv[f"{a}.attention.key_length"] = KV.u32(s.kv_lora_rank + s.rot)
        kv[f"{a}.attention.value_length"] = KV.u32(s.kv_lora_rank)
        kv[f"{a}.attention.key_length_mla"] = KV.u32(s.head_dim)
        kv[f"{a}.attention.value_length_mla"] = KV.u32(s.v_dim)
    if s.n_expert_group:
        kv[f"{a}.expert_group_count"] = KV.u32(s.n_expert_group)
        kv[f"{a}.expert_group_used_count"] = KV.u32(s.n_group_used)
    return kv


def _deepseek2_kv(s: ModelShape) -> dict[str, KV]:
    """DeepSeek-V3's keys: with the split attn_k_b/attn_v_b, MLA is MQA over the latent (one KV head of
    kv_lora_rank + rope dims) and the per-head sizes move to *_mla; older files describe the MHA form."""
    a = "deepseek2"
    kv = _common_kv(s, a)
    if s.legacy_kv_b:
        kv[f"{a}.attention.head_count_kv"] = KV.u32(s.n_head)
        kv[f"{a}.attention.value_length"] = KV.u32(s.v_dim)
    else:
        kv[f"{a}.attention.head_count_kv"] = KV.u32(1)
    kv.update(_mla_kv(s, a))
    kv.update(_sigmoid_routed_kv(s, a))
    kv.update(_yarn_kv(s, a))
    if s.yarn_factor:
        kv[f"{a}.rope.scaling.yarn_log_multiplier"] = KV.f32(s.yarn_log_mul)
    if s.n_mtp:
        kv[f"{a}.nextn_predict_layers"] = KV.u32(s.n_mtp)
    return kv


def _mistral4(s: ModelShape) -> list[TensorSpec]:
    """Mistral Small 4: DeepSeek-V2's tensors (MLA, shared experts), its router without a selection bias, its gate
    and up experts fused where the shape says (`_gate_up`)."""
    return _gate_up(s, [t for t in family_tensors(s) if ".exp_probs_b." not in t.name])


def _gemma4(s: ModelShape) -> list[TensorSpec]:
    """Gemma 4: the family's list, its gate and up experts fused where the shape says (`_gate_up`)."""
    return _gate_up(s, family_tensors(s))


def _gate_up(s: ModelShape, specs: list[TensorSpec]) -> list[TensorSpec]:
    """With `fused_gate_up`, each layer's gate and up experts as one ffn_gate_up_exps (each expert's gate rows, then
    its up rows), as Mistral Small 4's and Gemma 4's converters write their checkpoints' gate_up_proj."""
    out: list[TensorSpec] = []
    for t in specs:
        if s.fused_gate_up and t.name.endswith("ffn_up_exps.weight"):
            continue
        if s.fused_gate_up and t.name.endswith("ffn_gate_exps.weight"):
            t = TensorSpec(
                t.name.replace("ffn_gate_exps", "ffn_gate_up_exps"), (s.n_embd, 2 * s.n_ff_exp, s.n_expert), "expert"
            )
        out.append(t)
    return out


def _mistral4_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Mistral Small 4 (Mistral4Model, a DeepseekV2Model): DeepSeek-V2's keys under
    its own name, and the router as Mistral's MoE configs have it: softmax, weights normalised, scaled by 1."""
    a = "mistral4"
    kv = {k.replace("deepseek2.", f"{a}.", 1): v for k, v in _deepseek2_kv(s).items()}
    kv[f"{a}.expert_gating_func"] = KV.u32(1)  # softmax
    kv[f"{a}.expert_weights_scale"] = KV.f32(1.0)
    return kv


def _gpt_oss_kv(s: ModelShape) -> dict[str, KV]:
    a = "gpt-oss"
    kv = _common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_exp)
    kv[f"{a}.attention.sliding_window"] = KV.u32(s.sliding_window)
    kv.update(_yarn_kv(s, a))
    return kv


def _qwen_next_kv(s: ModelShape, a: str) -> dict[str, KV]:
    kv = _common_kv(s, a)
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.rot)
    kv[f"{a}.expert_shared_feed_forward_length"] = KV.u32(shared_ff(s))
    kv[f"{a}.ssm.conv_kernel"] = KV.u32(s.ssm_d_conv)
    kv[f"{a}.ssm.state_size"] = KV.u32(s.ssm_d_state)
    kv[f"{a}.ssm.group_count"] = KV.u32(s.ssm_n_group)
    kv[f"{a}.ssm.time_step_rank"] = KV.u32(s.ssm_dt_rank)
    kv[f"{a}.ssm.inner_size"] = KV.u32(s.ssm_d_state * s.ssm_dt_rank)
    kv[f"{a}.full_attention_interval"] = KV.u32(s.full_attention_interval)
    if s.rope_sections:
        kv[f"{a}.rope.dimension_sections"] = KV.array(ValueType.INT32, s.rope_sections)
    return kv


def _qwen3next_kv(s: ModelShape) -> dict[str, KV]:
    return _qwen_next_kv(s, "qwen3next")


def _qwen35moe_kv(s: ModelShape) -> dict[str, KV]:
    return _qwen_next_kv(s, "qwen35moe")


def _bailingmoe3_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Ling 3.0: head_count_kv per block (0 in KDA layers), MLA's sizes, the KDA
    keys, routing and, where set, SwiGLU limits per layer."""
    a = "bailingmoe3"
    kv = _common_kv(s, a)
    kv.update(_sigmoid_routed_kv(s, a))
    kv[f"{a}.expert_shared_feed_forward_length"] = KV.u32(shared_ff(s))
    heads_kv = [1 if ling_full_attention(s, i) else 0 for i in range(s.n_block)]
    kv[f"{a}.attention.head_count_kv"] = KV.array(ValueType.UINT32, heads_kv)
    kv.update(_mla_kv(s, a))
    kv[f"{a}.ssm.conv_kernel"] = KV.u32(s.ssm_d_conv)
    kv[f"{a}.kda.head_dim"] = KV.u32(s.ssm_d_state)
    kv[f"{a}.kda.safe_gate"] = KV.boolean(True)
    kv[f"{a}.kda.gate_lower_bound"] = KV.f32(s.kda_gate_lower_bound)
    if s.swiglu_limit:
        limits = [s.swiglu_limit if i == s.n_layer - 1 else 0.0 for i in range(s.n_block)]
        kv[f"{a}.swiglu_clamp_exp"] = KV.array(ValueType.FLOAT32, limits)
        kv[f"{a}.swiglu_clamp_shexp"] = KV.array(ValueType.FLOAT32, limits)
    kv.update(_yarn_kv(s, a))
    if s.n_mtp:
        kv[f"{a}.nextn_predict_layers"] = KV.u32(s.n_mtp)
    return kv


def _kimi_k3_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Kimi K3: head_count_kv per block (1 in MLA layers, 0 in KDA ones), MLA's
    sizes, the KDA keys (a lower bound only where set), routing, the latent width, the residual's block size and
    SiTU's betas."""
    a = "kimi-k3"
    kv = _common_kv(s, a)
    kv.update(_sigmoid_routed_kv(s, a))
    kv[f"{a}.attention.head_count_kv"] = KV.array(
        ValueType.UINT32, [1 if ling_full_attention(s, i) else 0 for i in range(s.n_layer)]
    )
    kv.update(_mla_kv(s, a))
    kv[f"{a}.ssm.conv_kernel"] = KV.u32(s.ssm_d_conv)
    kv[f"{a}.kda.head_dim"] = KV.u32(s.ssm_d_state)
    if math.isfinite(s.kda_gate_lower_bound):
        kv[f"{a}.kda.gate_lower_bound"] = KV.f32(s.kda_gate_lower_bound)
    if s.n_expert_latent:
        kv[f"{a}.expert_latent_length"] = KV.u32(s.n_expert_latent)
    kv[f"{a}.attn_res.block_size"] = KV.u32(s.attn_res_block)
    kv[f"{a}.activation.situ_beta"] = KV.f32(s.situ_beta)
    kv[f"{a}.activation.situ_linear_beta"] = KV.f32(s.situ_linear_beta)
    return kv


def _deepseek4_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes DeepSeek V4: MQA over one KV head of head_dim, sqrt-softplus routing
    (gating func 4), SwiGLU limits per layer, the compression ratios (one more than the blocks: the config lists
    its MTP block's too, written here as 0), the indexer, output groups, hyper-connections and hash layers."""
    a = "deepseek4"
    kv = _common_kv(s, a)
    kv[f"{a}.vocab_size"] = KV.u32(s.vocab_size)
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.rot)
    kv[f"{a}.attention.q_lora_rank"] = KV.u32(s.q_lora_rank)
    kv[f"{a}.attention.sliding_window"] = KV.u32(s.sliding_window)
    kv[f"{a}.expert_gating_func"] = KV.u32(4)  # sqrtsoftplus
    kv[f"{a}.expert_shared_count"] = KV.u32(s.n_shared_exp)
    kv[f"{a}.expert_weights_scale"] = KV.f32(s.expert_weights_scale)
    kv[f"{a}.expert_weights_norm"] = KV.boolean(True)
    kv[f"{a}.swiglu_clamp_exp"] = KV.array(ValueType.FLOAT32, [s.swiglu_limit] * s.n_layer)
    kv[f"{a}.swiglu_clamp_shexp"] = KV.array(ValueType.FLOAT32, [s.swiglu_limit] * s.n_layer)
    # the family's own keys (models/deepseek4.py KEYS), from the shape's fields of the same names
    own = {field: getattr(s, field) for field in deepseek4.KEYS}
    kv.update(write_keys(deepseek4.KEYS, a, {**own, "compress_ratios": [*dsv4_compress_ratios(s), 0]}))
    kv[f"{a}.embedding_length_out"] = KV.u32(s.hc_mult * s.n_embd)
    kv.update(_yarn_kv(s, a))
    return kv


def _glm_dsa_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes GLM-5: DeepSeek-V2's keys (MLA as MQA over the latent, the sigmoid router,
    dense layers first), no rope scaling, the indexer's heads, head size and top-k, and GLM-5.2's per-layer
    indexer types (BOOL, one per block that runs) where the shape has them."""
    a = "glm-dsa"
    kv = _common_kv(s, a)
    kv[f"{a}.attention.head_count_kv"] = KV.u32(1)
    kv.update(_mla_kv(s, a))
    kv.update(_sigmoid_routed_kv(s, a))
    kv[f"{a}.attention.indexer.head_count"] = KV.u32(s.indexer_n_head)
    kv[f"{a}.attention.indexer.key_length"] = KV.u32(s.indexer_head_size)
    kv[f"{a}.attention.indexer.top_k"] = KV.u32(s.indexer_top_k)
    if s.indexer_types:
        kv[f"{a}.attention.indexer.types"] = KV.array(ValueType.BOOL, [bool(t) for t in s.indexer_types])
    if s.n_mtp:
        kv[f"{a}.nextn_predict_layers"] = KV.u32(s.n_mtp)
    return kv


def _minimax_m2_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes MiniMax M2: partial rotary dims, the sigmoid scoring function; llama.cpp
    reads no weights-norm or scale key for it (it always renormalises and never scales)."""
    a = "minimax-m2"
    kv = _common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_exp)
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.rot)
    kv[f"{a}.expert_gating_func"] = KV.u32(2)  # sigmoid
    return kv


def _bailingmoe2_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Ling 2.0 (BailingMoeV2Model): rotary dims, dense layers first, the shared
    expert's width, routing (scale, norm, sigmoid, groups where set), the vocabulary size, the MTP block count."""
    a = "bailingmoe2"
    kv = _common_kv(s, a)
    kv.update(_sigmoid_routed_kv(s, a))
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.rot)
    kv[f"{a}.vocab_size"] = KV.u32(s.vocab_size)
    # (per shared expert: llama.cpp multiplies it by expert_shared_count)
    kv[f"{a}.expert_shared_feed_forward_length"] = KV.u32(s.n_ff_shexp)
    if s.n_expert_group:
        kv[f"{a}.expert_group_count"] = KV.u32(s.n_expert_group)
        kv[f"{a}.expert_group_used_count"] = KV.u32(s.n_group_used)
    kv[f"{a}.nextn_predict_layers"] = KV.u32(s.n_mtp)
    return kv


def _gemma4_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Gemma 4 (Gemma4Model): the full layers' head size as key_length and the
    sliding-window layers' as key_length_swa, KV heads and the window pattern per layer, both rotary counts (the
    full layers' whole head: rope_freqs leaves pairs unrotated), both rope bases, the soft-cap, the dense FFN's
    width, and no per-layer embeddings or shared KV layers (26B-A4B)."""
    a = "gemma4"
    kv = _common_kv(s, a)
    full = [(i + 1) % s.full_attention_interval == 0 for i in range(s.n_block)]
    hd_full, kv_full = s.head_dim_full or 2 * s.head_dim, s.head_kv_full or max(1, s.n_head_kv // 2)
    kv[f"{a}.attention.key_length"] = KV.u32(hd_full)
    kv[f"{a}.attention.value_length"] = KV.u32(hd_full)
    kv[f"{a}.attention.head_count_kv"] = KV.array(ValueType.UINT32, [kv_full if f else s.n_head_kv for f in full])
    kv[f"{a}.attention.sliding_window_pattern"] = KV.array(ValueType.BOOL, [not f for f in full])
    kv[f"{a}.attention.sliding_window"] = KV.u32(s.sliding_window)
    kv[f"{a}.rope.dimension_count"] = KV.u32(hd_full)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_dense)
    own = {"head_dim_swa": s.head_dim, "head_dim_v_swa": s.head_dim, "n_rot_swa": s.rot, "rope_base_swa": 10000.0}
    own |= {"softcap": 30.0, "n_embd_per_layer": 0, "shared_kv_layers": 0}
    return kv | write_keys(gemma4.KEYS, a, own)


def _llama4_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Llama 4 (Llama4Model): the dense layers' FFN width, the experts' (the shared
    expert's too), the MoE layers' interleave step, whole heads rotated; no sliding_window (llama.cpp then chunks
    attention at 8,192 positions whatever it would say)."""
    a = "llama4"
    kv = _common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_dense)
    kv.update(write_keys(llama4.KEYS, a, {"moe_layer_step": s.moe_layer_step}))
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.head_dim)
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
        family_tensors,
        _qwen3moe_kv,
        "Qwen3-MoE: q/k RMSNorm, GQA, softmax top-k router, SwiGLU experts",
    ),
    "qwen3vlmoe": Architecture(
        "qwen3vlmoe",
        family_tensors,
        _qwen3vlmoe_kv,
        "Qwen3-VL MoE (text): Qwen3-MoE's layers with interleaved multi-axis RoPE (IMRoPE)",
    ),
    "qwen2moe": Architecture(
        "qwen2moe",
        family_tensors,
        _qwen2moe_kv,
        "Qwen2-MoE: q/k/v bias, routed experts plus one sigmoid-gated shared expert",
    ),
    "ernie4_5-moe": Architecture(
        "ernie4_5-moe",
        family_tensors,
        _ernie45moe_kv,
        "ERNIE-4.5-MoE: leading dense layers, routed plus ungated shared experts",
    ),
    "glm4moe": Architecture(
        "glm4moe",
        family_tensors,
        _glm4moe_kv,
        "GLM-4.5-MoE: q/k/v bias, partial RoPE, leading dense layers, sigmoid router with selection bias",
    ),
    "deepseek2": Architecture(
        "deepseek2",
        family_tensors,
        _deepseek2_kv,
        "DeepSeek-V3 / Kimi K2: MLA, YaRN, group-limited sigmoid router with selection bias, shared expert",
    ),
    "mistral4": Architecture(
        "mistral4",
        _mistral4,
        _mistral4_kv,
        "Mistral Small 4: DeepSeek-V2's MLA, YaRN and shared experts with a softmax router",
    ),
    "gpt-oss": Architecture(
        "gpt-oss",
        family_tensors,
        _gpt_oss_kv,
        "gpt-oss: attention sinks, alternating sliding-window layers, YaRN, biases, swiglu_oai experts",
    ),
    "qwen3next": Architecture(
        "qwen3next",
        family_tensors,
        _qwen3next_kv,
        "Qwen3-Next: gated DeltaNet in 3 of 4 layers, gated attention, partial RoPE, gated shared expert",
    ),
    "qwen35moe": Architecture(
        "qwen35moe",
        family_tensors,
        _qwen35moe_kv,
        "Qwen3.5 MoE: Qwen3-Next's layers with separate alpha/beta projections and IMRoPE",
    ),
    "bailingmoe3": Architecture(
        "bailingmoe3",
        _bailingmoe3,
        _bailingmoe3_kv,
        "Ling 3.0: KDA linear attention and gated MLA, sigmoid router with selection bias, shared expert",
    ),
    "minimax-m2": Architecture(
        "minimax-m2",
        family_tensors,
        _minimax_m2_kv,
        "MiniMax M2: GQA with whole-vector q/k RMSNorm, partial RoPE, sigmoid router with selection bias",
    ),
    "bailingmoe2": Architecture(
        "bailingmoe2",
        family_tensors,
        _bailingmoe2_kv,
        "Ling 2.0: GQA from a fused QKV with q/k RMSNorm, partial RoPE, group-limited sigmoid router with "
        "selection bias, shared expert",
    ),
    "kimi-k3": Architecture(
        "kimi-k3",
        _kimi_k3,
        _kimi_k3_kv,
        "Kimi K3: KDA and gated nope-only MLA, cross-layer residual mixing, a latent MoE with a sigmoid router "
        "and selection bias, SiTU",
    ),
    "deepseek4": Architecture(
        "deepseek4",
        _deepseek4,
        _deepseek4_kv,
        "DeepSeek V4: hyper-connections, compressed sparse attention with a lightning indexer, grouped output, "
        "hash-routed first layers, sqrt-softplus router, clamped SwiGLU",
    ),
    "glm-dsa": Architecture(
        "glm-dsa",
        family_tensors,
        _glm_dsa_kv,
        "GLM-5 / GLM-5.2: MLA whose keys a lightning indexer picks (top-k tokens per query, shared across layers "
        "in GLM-5.2), sigmoid router with selection bias, shared expert",
    ),
    "gemma4": Architecture(
        "gemma4",
        _gemma4,
        _gemma4_kv,
        "Gemma 4 (26B-A4B): sliding-window and full layers of their own head sizes, per-layer norms, a dense GELU "
        "FFN beside GELU experts, logit soft-capping",
    ),
    "llama4": Architecture(
        "llama4",
        family_tensors,
        _llama4_kv,
        "Llama 4 (Scout, Maverick): chunked attention with RoPE and L2-normed q/k in 3 of 4 layers, NoPE with "
        "temperature tuning in the 4th, interleaved MoE layers, a top-1 sigmoid router weighting the expert's "
        "input, a shared expert",
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


# Layer counts for which llama.cpp's deepseek2 loader assumes a "lite" model (DeepSeek-V2-Lite and kin) and does
# not read q_lora_rank: with a q_lora_rank it would look for attn_q; without one, other counts fail to load.
_LITE_LAYERS = (26, 27)
TOKENIZERS = tuple(tokenizer_families)


def _is_lite(s: ModelShape) -> bool:
    return s.n_layer in _LITE_LAYERS or (s.n_layer == 48 and s.vocab_size == 128256)


def check_shape(s: ModelShape) -> None:
    """Rejects geometry the architecture cannot express (llama.cpp would refuse, misread or abort on it)."""
    architecture(s.arch)
    if s.arch == "qwen4exp":  # (its own rules: it shares hyper-connections and an indexer with deepseek4)
        check_qwen4exp(s)
        return
    if s.hc_low_rank or s.qsa_ratio or s.ple_layer >= 0:
        raise ValueError("low-rank hyper-connections, QSA and the n-gram table are qwen4exp's (use --arch qwen4exp)")
    dense_lead = (
        "ernie4_5-moe",
        "glm4moe",
        "deepseek2",
        "mistral4",
        "bailingmoe2",
        "bailingmoe3",
        "kimi-k3",
        "glm-dsa",
        "gemma4",
    )
    if s.n_dense_lead and s.arch not in dense_lead:
        raise ValueError(f"{s.arch} has no leading dense layers (use --arch {', '.join(dense_lead)})")
    if s.arch != "kimi-k3" and (s.n_expert_latent or s.attn_res_block or s.situ_beta or s.situ_linear_beta):
        raise ValueError("latent experts, the residual's checkpoints and SiTU are kimi-k3's (use --arch kimi-k3)")
    if s.arch != "llama4" and s.moe_layer_step != 1:
        raise ValueError("an interleave step of MoE layers is llama4's (use --arch llama4)")
    if s.n_shared_exp and s.arch in ("qwen3moe", "gpt-oss"):
        raise ValueError(f"{s.arch} has no shared experts (use --arch qwen2moe, ernie4_5-moe or deepseek2)")
    if s.n_dense_lead >= s.n_layer:
        raise ValueError("at least one layer must be a MoE layer")
    if not 0 < s.n_expert_used <= s.n_expert:
        raise ValueError("--n-expert-used must be between 1 and --n-expert")
    if s.n_head % s.n_head_kv:
        raise ValueError("--n-head must be a multiple of --n-head-kv")
    if s.tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {s.tokenizer!r} (choose from {', '.join(TOKENIZERS)})")
    optional = {"n_dense_lead", "n_shared_exp", "n_rot", "n_expert_group", "n_group_used", "n_mtp", "n_expert_latent"}
    small = [
        k for k, v in vars(s).items() if k.startswith("n_") and k not in optional and isinstance(v, int) and v <= 0
    ]
    if small:
        raise ValueError(f"sizes must be positive: {', '.join(small)}")
    if min(s.q_lora_rank, s.kv_lora_rank, s.n_rot, s.v_head_dim, s.n_expert_group, s.n_group_used, s.n_mtp) < 0:
        raise ValueError("ranks, head sizes and group counts must not be negative")
    if s.yarn_factor and (s.yarn_factor <= 1.0 or s.yarn_orig_ctx <= 0):
        raise ValueError("--yarn-factor must be above 1 (or 0 for none) with a positive --yarn-orig-ctx")
    dsv4_sizes = [s.hc_mult, s.hc_sinkhorn_iters, s.o_group_count, s.o_lora_rank, s.hash_layer_count]
    if s.arch != "deepseek4" and (any(dsv4_sizes) or s.hc_eps or s.compress_ratios or s.compress_rope_base):
        raise ValueError(
            "hyper-connections, compression ratios, output groups and hash layers are deepseek4's "
            "(use --arch deepseek4)"
        )
    indexer = [s.indexer_n_head, s.indexer_head_size, s.indexer_top_k]
    if s.arch not in ("deepseek4", "glm-dsa") and (any(indexer) or s.indexer_types):
        raise ValueError("the lightning indexer is deepseek4's and glm-dsa's (use --arch deepseek4 or glm-dsa)")
    if s.indexer_types and s.arch != "glm-dsa":
        raise ValueError("per-layer indexer types are glm-dsa's (GLM-5.2): use --arch glm-dsa")
    if s.arch in ("deepseek2", "mistral4", "bailingmoe3", "kimi-k3", "glm-dsa"):
        _check_deepseek2(s)
        if s.arch == "glm-dsa":
            _check_glm_dsa(s)
    elif s.arch == "deepseek4":
        _check_deepseek4(s)
    elif s.arch == "bailingmoe2":
        _check_bailingmoe2(s)
    elif s.arch == "llama4":
        _check_llama4(s)
    else:
        partial = s.arch in _QWEN_NEXT or s.arch in ("minimax-m2", "gemma4")
        mla = s.q_lora_rank or s.kv_lora_rank or (s.n_rot and not partial) or s.v_head_dim
        if mla or s.legacy_kv_b or s.n_mtp or s.n_expert_group or s.n_group_used:
            raise ValueError(
                "MLA ranks, head splits, expert groups and next-token-prediction blocks are deepseek2's and "
                "bailingmoe3's (use --arch deepseek2 or bailingmoe3)"
            )
    if s.arch in _QWEN_NEXT or s.arch == "bailingmoe3":
        _check_linear(s)
    if s.arch == "kimi-k3":
        _check_kimi_k3(s)
    if s.arch == "glm4moe" and s.head_dim % 4:
        raise ValueError("glm4moe rotates half of each head: --head-dim must be a multiple of 4")
    if s.arch != "deepseek2" and s.head_dim % 2:
        raise ValueError("--head-dim must be even (RoPE rotates pairs)")
    if s.arch == "minimax-m2" and (s.rot > s.head_dim or s.rot % 2):
        raise ValueError("minimax-m2's --n-rot must be even and at most --head-dim")
    if s.arch == "qwen3vlmoe" and (len(s.rope_sections) != 4 or 2 * sum(s.rope_sections) > s.head_dim or s.n_rot):
        raise ValueError("qwen3vlmoe rotates whole heads by IMRoPE: four section counts whose pairs fit in the head")
    if s.fused_gate_up and s.arch not in ("mistral4", "gemma4"):
        raise ValueError("fused gate_up experts are written for mistral4 and gemma4 only (their converters' form)")
    if s.legacy_kv_b and s.arch not in ("deepseek2", "mistral4"):  # (the engine refuses it of the others)
        raise ValueError("--legacy-kv-b is the older DeepSeek-V2/V3 converter's form: deepseek2 and mistral4 only")
    if s.arch == "gpt-oss" and s.sliding_window <= 0:
        raise ValueError("--sliding-window must be positive")


_QWEN_NEXT = ("qwen3next", "qwen35moe")


def _check_linear(s: ModelShape) -> None:
    """The linear-attention families' sizes (llama.cpp asserts on the others)."""
    if min(s.ssm_d_conv - 1, s.ssm_d_state, s.ssm_n_group, s.ssm_dt_rank, s.full_attention_interval) < 1:
        raise ValueError("linear attention needs a convolution of 2 or more and positive head sizes and counts")
    if s.n_shared_exp < 1:
        raise ValueError(f"{s.arch} runs a shared expert in every MoE layer: --n-shared-exp must be at least 1")
    if s.legacy_ssm_in and s.arch != "qwen3next":
        raise ValueError("the older joint ssm_in projection is qwen3next's")
    if s.arch == "bailingmoe3":
        if not s.kda_gate_lower_bound < 0:
            raise ValueError("bailingmoe3's KDA gate lower bound must be negative")
        return
    if s.ssm_dt_rank % s.ssm_n_group:
        raise ValueError("the linear layers' value heads must be a multiple of their key heads")
    if not 0 < s.rot <= s.head_dim or s.rot % 2:
        raise ValueError("--n-rot must be even, positive and at most --head-dim")
    if s.arch == "qwen35moe" and (len(s.rope_sections) != 4 or 2 * sum(s.rope_sections) > s.rot):
        raise ValueError("qwen35moe's IMRoPE needs four section counts whose pairs fit in --n-rot")


def _check_kimi_k3(s: ModelShape) -> None:
    """What llama.cpp's Kimi K3 loader and graph take."""
    if s.ssm_d_conv < 2 or s.ssm_d_state < 1 or s.full_attention_interval < 1:
        raise ValueError("KDA needs a convolution of 2 or more, a positive head size and a full-attention interval")
    if s.situ_beta <= 0 or s.situ_linear_beta < 0 or s.attn_res_block < 0 or s.n_expert_latent < 0:
        raise ValueError(
            "--situ-beta must be positive; --situ-linear-beta, the block size and latent width not negative"
        )
    if s.kda_gate_lower_bound >= 0:
        raise ValueError("the KDA gate's lower bound must be negative (-inf: none, kimi-linear's softplus gate)")
    if s.n_mtp or s.n_expert_group or s.legacy_kv_b:
        raise ValueError("kimi-k3 has no next-token-prediction block, expert groups or combined attn_kv_b")


def _check_deepseek2(s: ModelShape) -> None:
    if s.kv_lora_rank <= 0:
        raise ValueError(f"{s.arch} needs --kv-lora-rank")
    if not 0 < s.rot < s.head_dim or s.rot % 2:
        raise ValueError(f"{s.arch}'s --n-rot (qk_rope_head_dim) must be even, positive and below --head-dim")
    if s.n_shared_exp < 1 and s.arch != "kimi-k3":  # (kimi-k3's shared expert is optional)
        raise ValueError(f"{s.arch} runs a shared expert in every MoE layer: --n-shared-exp must be at least 1")
    if s.n_mtp > 1:
        raise ValueError("llama.cpp's converter writes one next-token-prediction block: --n-mtp must be 0 or 1")
    if s.arch in ("deepseek2", "mistral4"):  # (llama.cpp loads both by deepseek2's rules)
        _check_lite(s)
    _check_groups(s)


def _check_llama4(s: ModelShape) -> None:
    """What llama.cpp's Llama 4 loader and graph take (and what this engine runs of it: one expert a token)."""
    if s.n_expert_used != 1:
        raise ValueError("llama4 routes one expert a token here: --n-expert-used 1")
    if s.n_shared_exp != 1 or s.n_ff_shexp != s.n_ff_exp:
        raise ValueError(
            "llama4 has one shared expert as wide as a routed one: --n-shared-exp 1, --n-ff-shexp n_ff_exp"
        )
    if s.moe_layer_step < 1 or s.n_layer < s.moe_layer_step:
        raise ValueError("llama4's --moe-layer-step must be at least 1 and at most --n-layer")
    if s.q_lora_rank or s.kv_lora_rank or s.n_rot not in (0, s.head_dim) or s.v_head_dim or s.n_mtp:
        raise ValueError("llama4 rotates whole heads and has no MLA ranks, head splits or MTP blocks")
    if s.n_expert_group or s.n_group_used:
        raise ValueError("llama4's router has no expert groups")


def _check_bailingmoe2(s: ModelShape) -> None:
    """What llama.cpp's Ling 2.0 loader and graph take."""
    if s.n_head * s.head_dim != s.n_embd:
        raise ValueError("bailingmoe2's query heads fill the hidden size: --n-head x --head-dim must be --n-embd")
    if s.q_lora_rank or s.kv_lora_rank or s.v_head_dim or s.legacy_kv_b:
        raise ValueError("bailingmoe2 has no MLA ranks or head splits")
    if not 0 < s.rot <= s.head_dim or s.rot % 2:
        raise ValueError("bailingmoe2's --n-rot must be even, positive and at most --head-dim")
    if s.n_shared_exp < 1:
        raise ValueError("bailingmoe2 runs a shared expert in every MoE layer: --n-shared-exp must be at least 1")
    if s.n_mtp > 1:
        raise ValueError("llama.cpp's converter writes at most one next-token-prediction block: --n-mtp 0 or 1")
    _check_groups(s)


def _check_deepseek4(s: ModelShape) -> None:
    """What llama.cpp's DeepSeek V4 loader and graph take (it throws, asserts or misreads on the rest)."""
    if s.hc_mult != 4:
        raise ValueError("llama.cpp's deepseek4 graph mixes exactly 4 hyper-connection streams: --hc-mult must be 4")
    if s.hc_sinkhorn_iters < 1 or s.hc_eps <= 0:
        raise ValueError("--hc-sinkhorn-iters must be at least 1 and --hc-eps positive")
    if s.n_head_kv != 1:
        raise ValueError("deepseek4 attends with one key/value head shared by all query heads: --n-head-kv 1")
    if s.q_lora_rank <= 0 or s.kv_lora_rank or s.legacy_kv_b or s.v_head_dim not in (0, s.head_dim):
        raise ValueError("deepseek4 needs --q-lora-rank and keeps its keys as values (no kv rank or value head size)")
    if not 0 < s.rot <= min(s.head_dim, s.indexer_head_size) or s.rot % 2:
        raise ValueError("deepseek4's --n-rot must be even, positive and at most --head-dim and --indexer-head-size")
    if s.indexer_n_head < 1 or s.indexer_top_k < 1 or s.indexer_head_size % 64:
        raise ValueError(
            "the indexer needs heads and a top-k, and --indexer-head-size a multiple of 64 (llama.cpp rotates its "
            "keys by a Hadamard matrix of 64 or more)"
        )
    if s.o_group_count < 1 or s.o_lora_rank < 1 or s.n_head % s.o_group_count:
        raise ValueError("--n-head must be a multiple of --o-group-count, and --o-lora-rank positive")
    ratios = dsv4_compress_ratios(s)
    if len(ratios) != s.n_layer or not set(ratios) <= {0, 4, 128}:
        raise ValueError("--compress-ratios needs one ratio per layer, each 0, 4 or 128 (llama.cpp's only ratios)")
    if 4 not in ratios:
        # llama.cpp sizes the indexer's Hadamard rotation from its cache's head size, 0 without a CSA layer, and
        # dies dividing by it (SIGFPE while creating the context)
        raise ValueError("deepseek4 needs at least one CSA layer (compress ratio 4) for llama.cpp to load it")
    if not 0 <= s.hash_layer_count <= s.n_layer:
        raise ValueError("--hash-layer-count must be between 0 and --n-layer")
    if s.n_shared_exp < 1 or s.n_mtp or s.n_expert_group or s.n_group_used:
        raise ValueError(
            "deepseek4 runs one shared expert in every layer (--n-shared-exp 1 or more), routes without expert "
            "groups, and its MTP block is a file of its own (--n-mtp 0)"
        )
    if s.sliding_window < 1 or s.swiglu_limit < 0:
        raise ValueError("deepseek4 needs a positive --sliding-window and a --swiglu-limit of 0 (none) or more")


def _check_glm_dsa(s: ModelShape) -> None:
    """What llama.cpp's GLM-5 loader and graph take (it throws or asserts on the rest)."""
    if s.q_lora_rank <= 0 or s.legacy_kv_b or s.n_head_kv != 1:
        raise ValueError(
            "glm-dsa needs --q-lora-rank (the indexer's query comes from it), MLA's split attn_k_b/"
            "attn_v_b and one KV head (--n-head-kv 1)"
        )
    di = s.indexer_head_size
    if s.indexer_n_head < 1 or s.indexer_top_k < 1 or di < 64 or di & (di - 1):
        raise ValueError(
            "the indexer needs heads, a top-k and --indexer-head-size a power of two of 64 or more (llama.cpp "
            "multiplies its q and k by a Hadamard matrix of that width)"
        )
    if s.rot > di:
        raise ValueError("--n-rot must be at most --indexer-head-size (the indexer's head is [rope | nope])")
    if s.n_expert_group or s.n_group_used or s.yarn_factor:
        raise ValueError("llama.cpp's glm-dsa reads no expert groups and no YaRN keys")
    if s.indexer_types and (len(s.indexer_types) != s.n_layer or not set(s.indexer_types) <= {0, 1}):
        raise ValueError("--indexer-types needs one 0 or 1 per layer (1: the layer runs its own indexer)")
    if s.indexer_types and not s.indexer_types[0]:
        raise ValueError("layer 0 must run its own indexer (a shared layer reuses an earlier layer's top-k)")


def _check_lite(s: ModelShape) -> None:
    if s.q_lora_rank and _is_lite(s):
        raise ValueError(
            f"llama.cpp reads a {s.n_layer}-layer deepseek2 as a lite model without q_lora_rank: "
            "choose another --n-layer or --q-lora-rank 0"
        )
    if not s.q_lora_rank and not _is_lite(s):
        raise ValueError(
            "llama.cpp loads deepseek2 without q_lora_rank (DeepSeek-V2-Lite's plain attn_q) only with "
            f"{' or '.join(map(str, _LITE_LAYERS))} layers: set --n-layer accordingly or give --q-lora-rank"
        )


def _check_groups(s: ModelShape) -> None:
    groups, used = s.n_expert_group, s.n_group_used
    if groups >= s.n_expert:
        raise ValueError("--n-expert-group must be below --n-expert")
    if groups > 1:
        per_group = s.n_expert // groups
        if s.n_expert % groups or per_group < 2:
            raise ValueError("--n-expert must be a multiple of --n-expert-group, with at least 2 experts per group")
        if not 0 < used < groups:
            raise ValueError("--n-group-used must be between 1 and --n-expert-group - 1")
        if used * per_group < s.n_expert_used:
            raise ValueError("the groups used must hold at least --n-expert-used experts")


# ------------------------------------------------------------------------------------------------ qwen4exp
# Qwen3.8 Flash Next (llama.cpp: src/models/qwen4exp.cpp, conversion/qwen4exp.py; docs/families/qwen4exp.md).

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """The SplitMix64 finaliser (the reference derives its n-gram hash multipliers from it)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def ple_multipliers(s: ModelShape, seed: int = 1234) -> list[int]:
    """One odd multiplier per n-gram position, below 2^63 / vocab so that token · multiplier never overflows an
    int64 (the reference's rule for its first PLE module, which is what makes llama.cpp's uint64 hash agree)."""
    half = max(1, (((1 << 63) - 1) // max(s.vocab_size, 1)) // 2)
    return [2 * (_splitmix64((seed + 0x9E3779B97F4A7C15 * (i + 1)) & _MASK64) % half) + 1 for i in range(s.ple_ngram)]


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def ple_head_vocab_sizes(s: ModelShape) -> list[int]:
    """Each head's rows: the consecutive primes from ple_head_rows (the reference: from 20,000,000)."""
    sizes: list[int] = []
    n = s.ple_head_rows - 1
    for _ in range(ple_heads(s)):
        n += 1
        while not _is_prime(n):
            n += 1
        sizes.append(n)
    return sizes


def ple_heads(s: ModelShape) -> int:
    return (s.ple_ngram - 1) * s.ple_heads_per_ngram


def ple_table_rows(s: ModelShape) -> int:
    """All heads' rows, padded to a multiple of 128 as the reference's table is."""
    return -(-sum(ple_head_vocab_sizes(s)) // 128) * 128


def _qwen4exp(s: ModelShape) -> list[TensorSpec]:
    """Qwen3.8 Flash Next: Qwen3.5's gated DeltaNet (sigmoid output gate) and gated attention with the QSA indexer,
    no layer norms but two low-rank hyper-connection mixes a layer (hc_mult streams), the n-gram table and its
    injection on one linear layer, 512-style routed experts and a gated shared expert, the head's own mix."""
    e, hc, r = s.n_embd, s.hc_mult, s.hc_low_rank
    first = [TensorSpec("token_embd.weight", (e, s.vocab_size), "embd")]
    if s.ple_layer >= 0:
        first.append(TensorSpec("per_layer_token_embd.weight", (e // ple_heads(s), ple_table_rows(s)), "embd"))
    layers: list[TensorSpec] = []
    for i in range(s.n_layer):
        for part in ("attn", "ffn"):
            layers += [
                TensorSpec(f"blk.{i}.hc_{part}_norm.weight", (hc * e,), "norm"),
                TensorSpec(f"blk.{i}.hc_{part}_down.weight", (hc * e, r), "matrix"),
                TensorSpec(f"blk.{i}.hc_{part}_up.weight", (r, hc * e), "matrix"),
                TensorSpec(f"blk.{i}.hc_{part}_inject.weight", (hc * e, hc), "matrix"),
            ]
        if qwen_recurrent(s, i):
            layers += [t for t in _qwen_linear(s, i, True) if not t.name.endswith("attn_norm.weight")]
        else:
            di = s.indexer_head_size
            layers += [t for t in _qwen_gated_attention(s, i) if not t.name.endswith("attn_norm.weight")]
            layers += [
                TensorSpec(f"blk.{i}.indexer.q_proj.weight", (e, s.indexer_n_head * di), "matrix"),
                TensorSpec(f"blk.{i}.indexer.k_proj.weight", (e, di), "matrix"),
                TensorSpec(f"blk.{i}.indexer.q_norm.weight", (di,), "norm"),
                TensorSpec(f"blk.{i}.indexer.k_norm.weight", (di,), "norm"),
            ]
        if i == s.ple_layer:
            layers += [
                TensorSpec(f"blk.{i}.ple_key.weight", (e, hc * e), "matrix"),
                TensorSpec(f"blk.{i}.ple_value.weight", (e, e), "matrix"),
                TensorSpec(f"blk.{i}.ple_norm_key.weight", (hc * e,), "norm"),
                TensorSpec(f"blk.{i}.ple_norm_query.weight", (hc * e,), "norm"),
                TensorSpec(f"blk.{i}.ple_norm_conv.weight", (hc * e,), "norm"),
                # (its rows are the kernel's taps: too short for any block type, F32 as the converter falls back)
                TensorSpec(f"blk.{i}.ple_conv1d.weight", (s.ple_conv_kernel, hc * e), "vector"),
            ]
        layers += [t for t in _routed_experts(s, i) if not t.name.endswith("ffn_norm.weight")]
        layers += _shared_expert(s, i, gated=True)
    last = [
        TensorSpec("output.weight", (e, s.vocab_size), "matrix"),
        TensorSpec("output_hc_norm.weight", (hc * e,), "norm"),
        TensorSpec("output_hc_down.weight", (hc * e, r), "matrix"),
        TensorSpec("output_hc_up.weight", (r, hc * e), "matrix"),
    ]
    return first + layers + last


def _qwen4exp_kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Qwen3.8 Flash Next: Qwen3.5's keys, the hyper-connections' count and rank, the
    indexer (its ratio on full-attention layers, 0 on linear ones), and the PLE group where a layer has the table:
    its hash constants as uint64 arrays, the EOS that resets the n-grams, the table's row width."""
    a = "qwen4exp"
    kv = _qwen_next_kv(s, a)
    kv[f"{a}.hyper_connection.count"] = KV.u32(s.hc_mult)
    kv[f"{a}.hyper_connection.low_rank"] = KV.u32(s.hc_low_rank)
    kv[f"{a}.attention.indexer.head_count"] = KV.u32(s.indexer_n_head)
    kv[f"{a}.attention.indexer.key_length"] = KV.u32(s.indexer_head_size)
    kv[f"{a}.attention.indexer.top_k"] = KV.u32(s.indexer_top_k)
    ratios = [0 if qwen_recurrent(s, i) else s.qsa_ratio for i in range(s.n_layer)]
    kv[f"{a}.attention.compress_ratios"] = KV.array(ValueType.INT32, ratios)
    if s.ple_layer >= 0:
        sizes = ple_head_vocab_sizes(s)
        kv[f"{a}.ple.layers"] = KV.array(ValueType.INT32, [s.ple_layer])
        kv[f"{a}.ple.ngram_size"] = KV.u32(s.ple_ngram)
        kv[f"{a}.ple.heads_per_ngram"] = KV.u32(s.ple_heads_per_ngram)
        kv[f"{a}.ple.conv_kernel"] = KV.u32(s.ple_conv_kernel)
        kv[f"{a}.ple.eos_token_id"] = KV.u32(build_vocabulary(s.vocab_size, s.tokenizer).eos_id)
        kv[f"{a}.embedding_length_per_layer_input"] = KV.u32(s.n_embd // ple_heads(s))
        kv[f"{a}.ple.layer_multipliers"] = KV.array(ValueType.UINT64, ple_multipliers(s))
        kv[f"{a}.ple.head_offsets"] = KV.array(ValueType.UINT64, [sum(sizes[:h]) for h in range(len(sizes))])
        kv[f"{a}.ple.head_vocab_sizes"] = KV.array(ValueType.UINT64, sizes)
    return kv


def check_qwen4exp(s: ModelShape) -> None:
    """What llama.cpp's qwen4exp loader and graph take (qwen4exp.cpp:29-151; it throws or asserts on the rest)."""
    if s.n_head % s.n_head_kv or s.n_expert_used > s.n_expert or min(s.n_layer, s.n_expert_used) < 1:
        raise ValueError("--n-head must be a multiple of --n-head-kv, 1 <= --n-expert-used <= --n-expert")
    if s.tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {s.tokenizer!r} (choose from {', '.join(TOKENIZERS)})")
    if s.n_dense_lead or s.n_mtp or s.legacy_ssm_in or s.q_lora_rank or s.kv_lora_rank or s.n_expert_group:
        raise ValueError("qwen4exp has no dense layers, MTP block (the converter drops it), ssm_in or MLA")
    if s.hc_mult < 2 or s.hc_low_rank < 1:
        raise ValueError("qwen4exp needs --hc-mult of 2 or more and a positive --hc-low-rank")
    if min(s.indexer_n_head, s.indexer_head_size, s.indexer_top_k, s.qsa_ratio) < 1:
        raise ValueError("qwen4exp's QSA needs --indexer-n-head, --indexer-head-size, --indexer-top-k, --qsa-ratio")
    if s.indexer_top_k % s.qsa_ratio or s.rot > s.indexer_head_size:
        raise ValueError("--indexer-top-k must be a multiple of --qsa-ratio and --n-rot at most --indexer-head-size")
    if len(s.rope_sections) != 4 or 2 * sum(s.rope_sections) > s.rot:
        raise ValueError("qwen4exp's IMRoPE needs four section counts whose pairs fit in --n-rot")
    if s.n_shared_exp < 1:
        raise ValueError("qwen4exp runs a shared expert in every layer: --n-shared-exp must be at least 1")
    _check_linear(s)
    if s.ple_layer >= 0:
        heads = ple_heads(s)
        if s.ple_layer >= s.n_layer or not qwen_recurrent(s, s.ple_layer):
            raise ValueError("--ple-layer must be a linear-attention layer of the model (-1: no n-gram table)")
        if not 2 <= s.ple_ngram <= 8 or s.ple_heads_per_ngram < 1 or heads > 64:
            raise ValueError("--ple-ngram must be 2..8 and --ple-heads-per-ngram positive (64 heads at most)")
        if s.ple_conv_kernel < 2:  # (llama.cpp takes 1, then crashes on the empty history row: measured)
            raise ValueError("--ple-conv-kernel must be at least 2")
        if s.n_embd % heads:
            raise ValueError("--n-embd must be a multiple of the n-gram heads ((ple_ngram - 1) · heads_per_ngram)")
        if s.ple_head_rows < 2 or len(ple_head_vocab_sizes(s)) * s.ple_head_rows >= 2**31:
            raise ValueError("--ple-head-rows must be at least 2, all heads' rows within int32")


ARCHITECTURES["qwen4exp"] = Architecture(
    "qwen4exp",
    _qwen4exp,
    _qwen4exp_kv,
    "Qwen3.8 Flash Next: gated DeltaNet (sigmoid gate) and QSA-indexed gated attention, low-rank "
    "hyper-connections, an n-gram embedding table on one layer, softmax top-k experts and a gated shared expert",
)


def n_params(s: ModelShape) -> int:
    """The parameters of a model of this shape: every tensor the family's list has (its MTP blocks too)."""
    return sum(math.prod(spec.shape) for spec in tensor_specs(s))
