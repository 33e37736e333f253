"""Ling 2.0 (`bailingmoe2`): Ling-mini-2.0 (16B, 1.4B active), Ling-flash-2.0 (100B, 6.1B active) and the Ring 2.0
reasoning models of the same shape.

A layer: RMSNorm → attention (GQA from one fused projection, attn_qkv, whose rows are the query's, the key's and
the value's in turn; q and k RMS-normalised per head; NEOX RoPE on the first rope.dimension_count dims of each head,
half of them in Ling 2.0) → residual → RMSNorm → a dense SwiGLU FFN in the leading_dense_block_count first layers,
else routed SwiGLU experts plus the shared expert: the router's scoring function is the file's (sigmoid in Ling
2.0), its top-k adds the per-expert selection bias where the file has one, within the best expert groups where the
file has groups (Ling 2.0: 8, using 4), the weights normalised and scaled as the file says → residual. The
next-token-prediction blocks after the last layer are kept in the file, neither loaded nor run (llama.cpp:
src/models/bailingmoe2.cpp; its keys are the shared ones `read_hparams` reads, none of the family's own).
"""

from __future__ import annotations

from tokenwing.errors import BadInputError
from tokenwing.models.base import MoEModel, TensorCheck
from tokenwing.models.hparams import HParams

Spec = tuple[str, tuple[int, ...], str]  # a tensor's name, shape (GGUF order, row length first) and role


def tensors(
    *,
    n_layer: int,
    n_mtp: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_dense_lead: int,
    n_expert: int,
    ff_exp: int,
    ff_shexp: int,
    ff_dense: int,
    vocab: int,
) -> list[Spec]:
    """Every tensor of a Ling 2.0 file as llama.cpp's loader names and shapes it, in the converter's order, each with
    its role: "embd", "norm", "vector", "router", "matrix", or "expert" (the routed experts, streamed). The one list
    of them: the factory writes it (testmodel/architectures.py), `check` requires it of a file's layers that run.
    The MTP blocks last (n_mtp) are whole layers plus their own tensors (llama.cpp's optional ones left out)."""
    e, q, kv = n_embd, n_head * head_dim, n_head_kv * head_dim
    out: list[Spec] = [("token_embd.weight", (e, vocab), "embd")]
    for i in range(n_layer + n_mtp):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (e,), "norm"),
            (p + "attn_qkv.weight", (e, q + 2 * kv), "matrix"),
            (p + "attn_output.weight", (q, e), "matrix"),
            (p + "attn_q_norm.weight", (head_dim,), "norm"),
            (p + "attn_k_norm.weight", (head_dim,), "norm"),
            (p + "ffn_norm.weight", (e,), "norm"),
        ]
        if i < n_dense_lead:
            out += [
                (p + "ffn_gate.weight", (e, ff_dense), "matrix"),
                (p + "ffn_up.weight", (e, ff_dense), "matrix"),
                (p + "ffn_down.weight", (ff_dense, e), "matrix"),
            ]
        else:
            out += [
                (p + "ffn_gate_inp.weight", (e, n_expert), "router"),
                (p + "ffn_gate_exps.weight", (e, ff_exp, n_expert), "expert"),
                (p + "ffn_up_exps.weight", (e, ff_exp, n_expert), "expert"),
                (p + "ffn_down_exps.weight", (ff_exp, e, n_expert), "expert"),
                (p + "exp_probs_b.bias", (n_expert,), "vector"),  # (optional in llama.cpp's loader)
                (p + "ffn_gate_shexp.weight", (e, ff_shexp), "matrix"),
                (p + "ffn_up_shexp.weight", (e, ff_shexp), "matrix"),
                (p + "ffn_down_shexp.weight", (ff_shexp, e), "matrix"),
            ]
        if i >= n_layer:
            out += [
                (p + "nextn.eh_proj.weight", (2 * e, e), "matrix"),
                (p + "nextn.enorm.weight", (e,), "norm"),
                (p + "nextn.hnorm.weight", (e,), "norm"),
                (p + "layer_output_norm.weight", (e,), "norm"),
            ]
    return [*out, ("output_norm.weight", (e,), "norm"), ("output.weight", (e, vocab), "matrix")]


class BailingMoE2(MoEModel):
    arch = "bailingmoe2"
    qk_norm = True
    shared_experts = "required"  # (llama.cpp reads expert_shared_count as required and loads the shared tensors)
    routing_keys = True
    normalize_weights = False  # llama.cpp's default where the file has no expert_weights_norm
    selection_bias = None  # (exp_probs_b is optional in llama.cpp's loader)

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        """Every tensor `tensors` lists for the layers that run, with its shape; the FFN widths are the file's own
        (llama.cpp takes them from keys it checks the tensors against), the routed experts' the repack recorded."""
        if hp.gating == 0:  # (llama.cpp requires the key: it refuses such a file too)
            raise BadInputError(f"{where}: {cls.arch}.expert_gating_func is missing from the metadata")
        if hp.n_head * hp.head_dim != hp.n_embd:
            # llama.cpp's loader sizes attn_qkv's query part as embedding_length and its graph as the heads'
            raise BadInputError(f"{where}: {cls.arch}'s query heads must fill embedding_length")
        if set(streamed) != set(range(hp.n_dense_lead, hp.n_layer)):
            raise BadInputError(f"{where}: the layers with experts are not those after leading_dense_block_count")
        c = TensorCheck(hp, shapes, where)
        moe = hp.n_dense_lead  # (the first layer with experts)
        specs = tensors(
            n_layer=hp.n_layer,
            n_mtp=0,
            n_embd=hp.n_embd,
            n_head=hp.n_head,
            n_head_kv=hp.n_head_kv,
            head_dim=hp.head_dim,
            n_dense_lead=hp.n_dense_lead,
            n_expert=hp.n_expert,
            ff_exp=0,
            ff_shexp=shapes.get(f"blk.{moe}.ffn_gate_shexp.weight", (0, 0))[-1],
            ff_dense=shapes.get("blk.0.ffn_gate.weight", (0, 0))[-1],
            vocab=hp.vocab_size,
        )
        for name, shape, role in specs:
            if role == "expert" or (name.endswith("exp_probs_b.bias") and not c.has(name)):
                continue
            c.need(name, shape)
        for il, width in streamed.items():
            c.experts(il, width, cls.expert_width(hp, il))
