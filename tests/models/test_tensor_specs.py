"""A family's tensors are listed once (issue 42 item 1): `tensors` in models/<family>.py is what the factory
writes (testmodel/architectures.py `family_tensors`) and what the model check requires of a file. For each family
that lists its tensors: the factory's list passes the check, and a file lacking any tensor of a layer that runs, or
holding one of another shape, is refused in one line naming it."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tokenwing.errors import BadInputError
from tokenwing.models import FAMILIES
from tokenwing.models.specs import TensorSpec
from tokenwing.testmodel.architectures import check_shape, family_tensors, shape_hparams
from tokenwing.testmodel.shapes import ModelShape, preset_shape

# the families moved to one list so far, each with the parts it may have (dense layers first, shared experts)
LISTED: dict[str, dict[str, Any]] = {
    "qwen3moe": {},
    "qwen3vlmoe": {},
    "qwen2moe": {},
    "ernie4_5-moe": {"n_dense_lead": 1, "n_shared_exp": 1},
    "glm4moe": {"n_dense_lead": 1, "n_shared_exp": 2},
    "minimax-m2": {},
    "gpt-oss": {},
    "bailingmoe2": {"n_dense_lead": 1, "n_mtp": 1},
    "deepseek2": {"n_dense_lead": 1, "n_mtp": 1},
    "mistral4": {"n_dense_lead": 1, "fused_gate_up": False},
    "glm-dsa": {"n_dense_lead": 1, "n_mtp": 1, "indexer_types": (1, 0, 1)},
    "qwen3next": {"n_layer": 4, "legacy_ssm_in": True},
    "qwen35moe": {"n_layer": 4},
    "bailingmoe3": {"n_layer": 4, "n_dense_lead": 1, "n_mtp": 1},
    "kimi-k3": {"n_layer": 4, "n_dense_lead": 1, "n_shared_exp": 1},
    "deepseek4": {"n_layer": 4, "hash_layer_count": 1},
    "mimo2": {"n_layer": 4},
    "step35": {"n_layer": 4},
}


def _shape(arch: str) -> ModelShape:
    s = preset_shape("tiny", arch).with_(n_layer=3).with_(**LISTED[arch])
    check_shape(s)
    return s


def _check(s: ModelShape, listed: list[TensorSpec], drop: str = "", reshape: str = "") -> None:
    """The family's check of a file holding `listed` (less `drop`, `reshape` twice as long), as a repack has it:
    the routed experts streamed, recorded by layer."""
    shapes = {t.name: t.shape for t in listed if t.role != "expert" and t.name != drop}
    if reshape:
        shapes[reshape] = (2 * shapes[reshape][0], *shapes[reshape][1:])
    streamed = {t.block or 0: t.shape[0] for t in listed if t.name.endswith("ffn_gate_exps.weight")}
    hp = shape_hparams(s)  # (the MTP blocks' experts are not streamed: models.check_model leaves them out)
    FAMILIES[s.arch].check(hp, shapes, {il: w for il, w in streamed.items() if il < hp.n_layer}, "m.gguf")


@pytest.mark.parametrize("arch", sorted(LISTED))
def test_the_factory_writes_what_the_check_requires(arch: str) -> None:
    s = _shape(arch)
    listed = family_tensors(s)
    _check(s, listed)
    running = [t for t in listed if t.block is None or t.block < s.n_layer]  # (MTP blocks are neither read nor run)
    required = [t for t in running if t.role != "expert" and not t.optional]
    assert len(required) > 10 * s.n_layer // 3  # (every layer's attention, norms and router at least)
    for t in required:
        with pytest.raises(BadInputError, match=re.escape(f"m.gguf: tensor {t.name} is missing")):
            _check(s, listed, drop=t.name)
        # (named, or where it gives a width the family reads off the file, the next that disagrees with it)
        with pytest.raises(BadInputError, match=r"^m\.gguf: tensor \S+ has shape"):
            _check(s, listed, reshape=t.name)


def test_an_optional_tensor_may_be_left_out_but_not_misshapen() -> None:
    s = _shape("qwen3moe")
    listed = family_tensors(s)
    _check(s, listed, drop="output.weight")  # (tied to the embedding)
    with pytest.raises(BadInputError, match=re.escape("output.weight has shape")):
        _check(s, listed, reshape="output.weight")


def test_shared_experts_and_dense_layers_are_as_the_shape_says() -> None:
    names = {t.name for t in family_tensors(_shape("glm4moe"))}
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_inp.weight" not in names
    assert {"blk.1.ffn_gate_shexp.weight", "blk.1.exp_probs_b.bias", "blk.1.post_attention_norm.weight"} <= names
    glm = {t.name: t.shape for t in family_tensors(_shape("glm4moe"))}
    s = _shape("glm4moe")
    assert glm["blk.1.ffn_gate_shexp.weight"] == (s.n_embd, 2 * s.n_ff_exp)  # (expert_shared_count experts wide)
    assert not any("shexp" in t.name for t in family_tensors(_shape("qwen3moe").with_(n_shared_exp=1)))
