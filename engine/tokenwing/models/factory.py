"""A family's factory entry (issue 42 item 1): what the test-model factory (testmodel/) makes of a family, declared
by the family's own class (`MoEModel.factory`), next to the keys its loader reads and the tensors its check requires.

The factory's generic code (testmodel/architectures.py) takes every family's entry from the registry
(`models.FAMILIES`) and names none: a new family is its file, a shape in testmodel/shapes.py, a preset, docs and
tests. Here too: the keys every family's file has and the pieces several families' entries share, written from a
`ModelShape` (the factory's geometry; only its fields are read here, so this module imports nothing of testmodel/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenwing.format.gguf_io import KV
from tokenwing.models.specs import Parts, TensorSpec

if TYPE_CHECKING:  # (types only: the factory's shapes import nothing of the engine's, and need not be loaded here)
    from tokenwing.models.hparams import HParams
    from tokenwing.testmodel.shapes import ModelShape


def _no_rules(s: ModelShape) -> None:
    """A family whose geometry llama.cpp takes whenever the shared rules (`check_shape`) hold."""


@dataclass(frozen=True)
class Factory:
    """What the factory makes of one family: its description (`--arch`'s help), the metadata it writes (`metadata`:
    the family's keys, from the same tables its loader reads), its tensor list (`tensors`: None, the family's own
    `MoEModel.tensors(hp, parts)`; else the factory's form of it), the geometry llama.cpp refuses of it (`check`,
    ValueError with one line) and the shape's family-specific fields it takes (`takes`: a field some family takes
    is refused, set, by the families that do not, naming those that do)."""

    description: str
    metadata: Callable[[ModelShape], dict[str, KV]]
    check: Callable[[ModelShape], None] = _no_rules
    tensors: Callable[[ModelShape, HParams, Parts], list[TensorSpec]] | None = None
    takes: frozenset[str] = frozenset()
    odd_head_dim: bool = False  # a head size RoPE need not halve (MLA's: only its rope part rotates)


# The family-specific fields of MLA-style attention, routing groups and next-token-prediction blocks.
MLA_FIELDS = frozenset(
    {"q_lora_rank", "kv_lora_rank", "n_rot", "v_head_dim", "n_mtp", "n_expert_group", "n_group_used"}
)


def shared_ff(s: ModelShape) -> int:
    """Total width of the shared expert(s) of a layer."""
    return s.n_ff_shexp * max(1, s.n_shared_exp)


def common_kv(s: ModelShape, arch: str) -> dict[str, KV]:
    """The keys every family's file has (read by `read_hparams`)."""
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


def sigmoid_routed_kv(s: ModelShape, a: str) -> dict[str, KV]:
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


def yarn_kv(s: ModelShape, a: str) -> dict[str, KV]:
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


def mla_kv(s: ModelShape, a: str) -> dict[str, KV]:
    """MLA's keys (deepseek2 and the families built on it), expert groups and the vocabulary size, as the converter
    writes them."""
    kv = {f"{a}.vocab_size": KV.u32(s.vocab_size), f"{a}.rope.dimension_count": KV.u32(s.rot)}
    if s.q_lora_rank:
        kv[f"{a}.attention.q_lora_rank"] = KV.u32(s.q_lora_rank)
    kv[f"{a}.attention.kv_lora_rank"] = KV.u32(s.kv_lora_rank)
    if not s.legacy_kv_b:
        kv[f"{a}.attention.key_length"] = KV.u32(s.kv_lora_rank + s.rot)
        kv[f"{a}.attention.value_length"] = KV.u32(s.kv_lora_rank)
        kv[f"{a}.attention.key_length_mla"] = KV.u32(s.head_dim)
        kv[f"{a}.attention.value_length_mla"] = KV.u32(s.v_dim)
    return kv | groups_kv(s, a)


def groups_kv(s: ModelShape, a: str) -> dict[str, KV]:
    """Group-limited routing's keys, where the shape has groups."""
    if not s.n_expert_group:
        return {}
    return {f"{a}.expert_group_count": KV.u32(s.n_expert_group), f"{a}.expert_group_used_count": KV.u32(s.n_group_used)}


def gate_up(s: ModelShape, specs: list[TensorSpec]) -> list[TensorSpec]:
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


def check_groups(s: ModelShape) -> None:
    """Group-limited routing's counts (llama.cpp asserts on the others)."""
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


def check_linear(s: ModelShape) -> None:
    """The linear-attention families' sizes (llama.cpp asserts on the others)."""
    if min(s.ssm_d_conv - 1, s.ssm_d_state, s.ssm_n_group, s.ssm_dt_rank, s.full_attention_interval) < 1:
        raise ValueError("linear attention needs a convolution of 2 or more and positive head sizes and counts")
    if s.n_shared_exp < 1:
        raise ValueError(f"{s.arch} runs a shared expert in every MoE layer: --n-shared-exp must be at least 1")
