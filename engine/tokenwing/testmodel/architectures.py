"""Which tensors and metadata each generated architecture has, in llama.cpp's names and shapes.

Generic: each registered family (`models.FAMILIES`) declares its factory entry in its own file (`MoEModel.factory`,
models/factory.py: its key writer, tensor list, shape checks and description), and this module names no family. A
new family is its file, a shape in testmodel/shapes.py, a preset, docs and tests.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from tokenwing.format.gguf_io import KV
from tokenwing.models import FAMILIES
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import shared_ff
from tokenwing.models.hparams import HParams, read_hparams
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.testmodel.shapes import FEATURES, ModelShape
from tokenwing.testmodel.tokenizer import FAMILIES as tokenizer_families


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


@dataclass(frozen=True)
class Architecture:
    name: str
    tensors: Callable[[ModelShape], list[TensorSpec]]
    metadata: Callable[[ModelShape], dict[str, KV]]
    description: str


def _architecture(cls: type[MoEModel]) -> Architecture:
    """A family's factory entry, as the writer takes it: its tensor list at a shape (its own `tensors(hp, parts)`
    unless the entry has the factory's form of it)."""
    entry = cls.factory

    def tensors(s: ModelShape) -> list[TensorSpec]:
        hp, p = shape_hparams(s), parts(s, cls)
        return entry.tensors(s, hp, p) if entry.tensors else cls.tensors(hp, p)

    return Architecture(cls.arch, tensors, entry.metadata, entry.description)


ARCHITECTURES: dict[str, Architecture] = {arch: _architecture(cls) for arch, cls in FAMILIES.items()}
TOKENIZERS = tuple(tokenizer_families)


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        known = ", ".join(ARCHITECTURES)
        raise ValueError(f"unknown architecture {name!r} (the factory makes: {known})") from None


def tensor_specs(s: ModelShape) -> list[TensorSpec]:
    return architecture(s.arch).tensors(s)


def check_shape(s: ModelShape) -> None:
    """Rejects geometry the architecture cannot express (llama.cpp would refuse, misread or abort on it): the rules
    every family shares, then the family's own (its entry's `check`), then the fields of other families."""
    architecture(s.arch)
    cls = FAMILIES[s.arch]
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
    cls.factory.check(s)
    if not cls.factory.odd_head_dim and s.head_dim % 2:
        raise ValueError("--head-dim must be even (RoPE rotates pairs)")
    _check_fields(s)


def takes(cls: type[MoEModel]) -> frozenset[str]:
    """The shape's family-specific fields a family takes: its entry's, and shared experts where it has them."""
    return cls.factory.takes | ({"n_shared_exp"} if cls.shared_experts != "none" else frozenset())


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelShape)}


def _check_fields(s: ModelShape) -> None:
    """A field some family takes, set (off its default) for a family that does not: one line naming those that do."""
    own = takes(FAMILIES[s.arch])
    taken = {a: takes(c) for a, c in FAMILIES.items()}
    for field in _DEFAULTS:
        if field in own or getattr(s, field) == _DEFAULTS[field]:
            continue
        owners = [a for a, fields in taken.items() if field in fields]
        if owners:
            flag, whose = "--" + field.replace("_", "-"), _listed([f"{a}'s" for a in owners])
            raise ValueError(
                f"{s.arch} has no {FEATURES.get(field, flag)}: {flag} is {whose} (use --arch {_listed(owners)})"
            )


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def n_params(s: ModelShape) -> int:
    """The parameters of a model of this shape: every tensor the family's list has (its MTP blocks too)."""
    return sum(math.prod(spec.shape) for spec in tensor_specs(s))
