"""A family's tensors, listed once (issue 42 item 1): names, shapes and roles, from the hyper-parameters.

Each family's `tensors(hp, parts)` (models/base.py `MoEModel.tensors`) lists every tensor of its files as llama.cpp's
loader creates them (the create_tensor calls of `llama-model.cpp` for the architecture): the model check
requires them of a file (`TensorCheck.specs`), the factory (testmodel/) writes them. The pieces below are the
blocks most families share. Shapes are in GGUF order (row length first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (types only: hparams imports numpy and the validators)
    from tokenwing.models.hparams import HParams


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: str  # "norm" (F32, ~1.0), "vector" (F32, small), "router" (F32), "embd", "matrix", "expert",
    # "decay_neg" / "decay_pos" (F32: a linear layer's decay rate, -exp or exp of a small normal),
    # "mixer" (F32 matrix: DeepSeek V4's hyper-connection mixes, F32 in its checkpoints and GGUFs),
    # "expert_ids" (I32: each row `id_range`-bounded distinct ids, a hash layer's experts per token)
    # "rope_freqs" (F32: RoPE's frequency factors, 1 where a pair rotates and 1e30 where it does not: Gemma 4)
    id_range: int = 0
    optional: bool = False  # a file may leave it out (llama.cpp's TENSOR_NOT_REQUIRED); the factory writes it

    @property
    def fan_in(self) -> int:
        return self.shape[0]

    @property
    def block(self) -> int | None:
        """The block (layer) the tensor belongs to; None for the embedding and the head."""
        parts = self.name.split(".", 2)
        return int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else None


@dataclass(frozen=True)
class Parts:
    """What a family's file may have or leave out, and the widths the hyper-parameters do not hold.

    The model check reads them off the file's tensors (llama.cpp checks the tensors against keys the engine does
    not read; a file whose parts are consistent is taken, as before); the factory takes them from its shape. With
    the hyper-parameters they decide the family's whole list (`MoEModel.tensors`).
    """

    moe_layers: frozenset[int]  # layers with routed experts (the others have a dense FFN)
    ff_exp: int = 0  # a routed expert's width (the check: 0; the repack's record checks the experts)
    ff_dense: int = 0  # a dense layer's FFN width
    ff_shexp: int = 0  # the shared expert(s)' width in a layer with experts (0: none)
    qk_norm: bool = False  # per-head q/k RMSNorm, where a family takes it as the file has it
    exp_bias: bool = False  # the router's selection bias (exp_probs_b), likewise
    forms: frozenset[str] = frozenset()  # a family's other forms of some tensors (qwen3next: "ssm_in", older files')


def head(hp: HParams) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The token embedding (first), the output norm and the output matrix (last)."""
    e = hp.n_embd
    first = [TensorSpec("token_embd.weight", (e, hp.vocab_size), "embd")]
    last = [
        TensorSpec("output_norm.weight", (e,), "norm"),
        TensorSpec("output.weight", (e, hp.vocab_size), "matrix", optional=True),  # (absent: tied to the embedding)
    ]
    return first, last


def attention(hp: HParams, il: int, qk_norm: bool, bias: bool) -> list[TensorSpec]:
    """Grouped-query attention from separate q, k, v projections, with per-head q/k norms and biases if said."""
    p, e = f"blk.{il}.", hp.n_embd
    q, kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    out = [
        TensorSpec(p + "attn_norm.weight", (e,), "norm"),
        TensorSpec(p + "attn_q.weight", (e, q), "matrix"),
        TensorSpec(p + "attn_k.weight", (e, kv), "matrix"),
        TensorSpec(p + "attn_v.weight", (e, kv), "matrix"),
        TensorSpec(p + "attn_output.weight", (q, e), "matrix"),
    ]
    if qk_norm:
        out += [
            TensorSpec(p + "attn_q_norm.weight", (hp.head_dim,), "norm"),
            TensorSpec(p + "attn_k_norm.weight", (hp.head_dim,), "norm"),
        ]
    if bias:
        out += [
            TensorSpec(p + "attn_q.bias", (q,), "vector"),
            TensorSpec(p + "attn_k.bias", (kv,), "vector"),
            TensorSpec(p + "attn_v.bias", (kv,), "vector"),
        ]
    return out


def routed(hp: HParams, il: int, parts: Parts, norm: str = "ffn_norm") -> list[TensorSpec]:
    """The FFN norm, the router and the routed SwiGLU experts (role "expert": streamed), and the router's
    selection bias where the parts have it."""
    p, e, ff, n = f"blk.{il}.", hp.n_embd, parts.ff_exp, hp.n_expert
    out = [
        TensorSpec(f"{p}{norm}.weight", (e,), "norm"),
        TensorSpec(p + "ffn_gate_inp.weight", (e, n), "router"),
        TensorSpec(p + "ffn_gate_exps.weight", (e, ff, n), "expert"),
        TensorSpec(p + "ffn_up_exps.weight", (e, ff, n), "expert"),
        TensorSpec(p + "ffn_down_exps.weight", (ff, e, n), "expert"),
    ]
    if parts.exp_bias:
        out.append(TensorSpec(p + "exp_probs_b.bias", (n,), "vector"))
    return out


def shared(hp: HParams, il: int, ff: int, gated: bool) -> list[TensorSpec]:
    """A layer's shared expert(s) as one SwiGLU FFN of width ff, and its sigmoid gate if `gated`."""
    p, e = f"blk.{il}.", hp.n_embd
    out = [
        TensorSpec(p + "ffn_gate_shexp.weight", (e, ff), "matrix"),
        TensorSpec(p + "ffn_up_shexp.weight", (e, ff), "matrix"),
        TensorSpec(p + "ffn_down_shexp.weight", (ff, e), "matrix"),
    ]
    if gated:
        out.append(TensorSpec(p + "ffn_gate_inp_shexp.weight", (e,), "router"))
    return out


def dense(hp: HParams, il: int, ff: int, norm: str = "ffn_norm") -> list[TensorSpec]:
    """The FFN norm and a dense SwiGLU FFN of width ff."""
    p, e = f"blk.{il}.", hp.n_embd
    return [
        TensorSpec(f"{p}{norm}.weight", (e,), "norm"),
        TensorSpec(p + "ffn_gate.weight", (e, ff), "matrix"),
        TensorSpec(p + "ffn_up.weight", (e, ff), "matrix"),
        TensorSpec(p + "ffn_down.weight", (ff, e), "matrix"),
    ]
