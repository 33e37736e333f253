"""A family's own GGUF keys are one table in its family file (issue 42 item 1; models/keys.py): DeepSeek V4's
`KEYS` is what the factory writes and what the family reads, and a file lacking one, or holding one of another
type, is refused in one line naming it."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tokenwing.errors import BadInputError
from tokenwing.models import deepseek4, kimi_k3
from tokenwing.models.deepseek4 import dsv4_compress_ratios
from tokenwing.models.hparams import read_hparams
from tokenwing.testmodel.architectures import architecture
from tokenwing.testmodel.shapes import preset_shape

SHAPE = preset_shape("tiny", "deepseek4")


def _meta(**changes: Any) -> dict[str, Any]:
    meta = {k: v.value for k, v in architecture("deepseek4").metadata(SHAPE).items()}
    for key, value in changes.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    return meta


def _keys(meta: dict[str, Any]) -> deepseek4.Dsv4Keys:
    return deepseek4.keys(read_hparams(meta, "deepseek4", "m.gguf"), "m.gguf")


def test_the_factory_writes_the_table_and_the_family_reads_it_back() -> None:
    k = _keys(_meta())
    for field in deepseek4.KEYS.keys() - {"compress_ratios"}:
        assert getattr(k, field) == getattr(SHAPE, field) != 0, field
    assert k.compress_ratios == dsv4_compress_ratios(SHAPE) == (0, 0, 4, 128)  # (the MTP block's 0 written, not read)


@pytest.mark.parametrize("field", sorted(deepseek4.KEYS))
def test_a_missing_or_mistyped_key_is_refused_naming_it(field: str) -> None:
    full = "deepseek4." + deepseek4.KEYS[field].name
    with pytest.raises(BadInputError, match=re.escape(f"m.gguf: {full} is missing from the metadata")):
        _keys(_meta(**{full: None}))
    with pytest.raises(BadInputError, match=re.escape(f"m.gguf: {full} must")):
        _keys(_meta(**{full: "four"}))


@pytest.mark.parametrize("latent", [32, 0])
def test_kimi_k3s_table_is_written_by_the_factory_and_read_back(latent: int) -> None:
    """Kimi K3's own keys (models/kimi_k3.py KEYS): the shape's fields as written, read back; the latent width, which
    llama.cpp takes a file without, left out where the shape has none (then the experts run at the hidden width);
    a mistyped key refused naming it."""
    s = preset_shape("tiny", "kimi-k3").with_(n_expert_latent=latent)
    meta = {k: v.value for k, v in architecture("kimi-k3").metadata(s).items()}
    assert ("kimi-k3.expert_latent_length" in meta) == bool(latent)
    k = kimi_k3.keys(read_hparams(meta, "kimi-k3", "m.gguf", "kv_heads"), "m.gguf")
    assert (k.n_expert_latent, k.attn_res_block, k.situ_beta, k.situ_linear_beta) == (
        latent,
        s.attn_res_block,
        s.situ_beta,
        s.situ_linear_beta,
    )
    bad = read_hparams({**meta, "kimi-k3.activation.situ_beta": "two"}, "kimi-k3", "m.gguf", "kv_heads")
    with pytest.raises(BadInputError, match=re.escape("m.gguf: kimi-k3.activation.situ_beta must be a number")):
        kimi_k3.keys(bad, "m.gguf")
