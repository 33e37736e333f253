"""A family's own GGUF keys are one table in its family file (issue 42 item 1; models/keys.py): DeepSeek V4's
`KEYS` is what the factory writes and what the family reads, and a file lacking one, or holding one of another
type, is refused in one line naming it."""

from __future__ import annotations

import inspect
import math
import re
import sys
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import ValueType
from tokenwing.models import FAMILIES, bailingmoe3, deepseek4, glm_dsa, hparams, kimi_k3, qwen4exp
from tokenwing.models.deepseek4 import dsv4_compress_ratios
from tokenwing.models.hparams import read_hparams
from tokenwing.models.keys import Key
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


@pytest.mark.parametrize("ple_layer", [2, -1])
def test_qwen4exps_tables_are_written_by_the_factory_and_read_back(ple_layer: int) -> None:
    """Qwen3.8's own keys (models/qwen4exp.py KEYS, PLE_KEYS): each layer's QSA block and, where a layer reads the
    n-gram table, the table's hash as the factory wrote them (uint64 arrays), read back; without a table none of
    its group is written and none is read; a mistyped or negative one refused naming it."""
    s = preset_shape("tiny", "qwen4exp").with_(ple_layer=ple_layer)
    written = architecture("qwen4exp").metadata(s)
    meta = {k: v.value for k, v in written.items()}
    assert all((f"qwen4exp.{key.name}" in meta) == (ple_layer >= 0) for key in qwen4exp.PLE_KEYS.values())
    hp = read_hparams(meta, "qwen4exp", "m.gguf", "interval")
    top_k, ratios = qwen4exp.qsa_keys(hp, "m.gguf")
    assert top_k == s.indexer_top_k
    assert ratios == tuple(0 if qwen4exp.qwen_recurrent(s, i) else s.qsa_ratio for i in range(s.n_layer))
    layer, ple = qwen4exp.ple_keys(hp, "m.gguf")
    assert layer == ple_layer
    if ple_layer < 0:
        assert ple is None
        return
    # (the hash's constants as uint64 arrays, as llama.cpp's converter writes them: a multiplier is up to 2^63)
    for name in ("layer_multipliers", "head_offsets", "head_vocab_sizes"):
        assert written[f"qwen4exp.ple.{name}"].item_type == ValueType.UINT64, name
    sizes = qwen4exp.ple_head_vocab_sizes(s)
    assert ple == qwen4exp.NgramKeys(
        s.ple_ngram,
        s.ple_heads_per_ngram,
        meta["qwen4exp.ple.eos_token_id"],
        tuple(qwen4exp.ple_multipliers(s)),
        tuple(sum(sizes[:h]) for h in range(len(sizes))),
        tuple(sizes),
    )
    bad = read_hparams({**meta, "qwen4exp.ple.head_offsets": [0, -4]}, "qwen4exp", "m.gguf", "interval")
    with pytest.raises(BadInputError, match=re.escape("m.gguf: qwen4exp.ple.head_offsets must list non-negative")):
        qwen4exp.ple_keys(bad, "m.gguf")
    bad = read_hparams({**meta, "qwen4exp.attention.compress_ratios": "4"}, "qwen4exp", "m.gguf", "interval")
    with pytest.raises(BadInputError, match=re.escape("m.gguf: qwen4exp.attention.compress_ratios must list integ")):
        qwen4exp.qsa_keys(bad, "m.gguf")


def _tables(module: ModuleType) -> list[Key]:
    """Every key of a family module's own tables (its module-level dicts of `Key`)."""
    return [
        key
        for table in vars(module).values()
        if isinstance(table, dict) and table and all(isinstance(k, Key) for k in table.values())
        for key in table.values()
    ]


def test_hparams_reads_no_familys_own_key() -> None:
    """The shared reader (models/hparams.py) names no key of any family's own table, nor any family: a family's
    keys are read where they are written, from its table (break-check: qwen4exp's compress_ratios read back in
    read_hparams fails here)."""
    source = inspect.getsource(hparams)
    modules = {sys.modules[cls.__module__] for cls in FAMILIES.values()}
    owned = {key.name for module in modules for key in _tables(module)}
    assert {
        "attention.compress_ratios",
        "ple.layers",
        "kda.head_dim",
        "interleave_moe_layer_step",
    } <= owned  # (the tables found)
    assert [name for name in sorted(owned) if name in source] == []
    assert "indexer" not in source  # (GLM-5.2's attention.indexer.types too, beside glm-dsa's table)
    # (deepseek4's gating function 4 is still let through by name there: the one family the reader names)
    assert [arch for arch in sorted(FAMILIES) if f'"{arch}"' in source] == ["deepseek4"]


@pytest.mark.parametrize(("arch", "floor"), [("bailingmoe3", -5.0), ("kimi-k3", -5.0), ("kimi-k3", -math.inf)])
def test_the_kda_table_is_written_by_both_factories_and_read_back(arch: str, floor: float) -> None:
    """The KDA layers' keys (models/bailingmoe3.py KDA_KEYS), Ling 3.0's and Kimi K3's: the head size and the decay
    gate's floor as written, read back; Kimi's file without safe_gate, and without a floor where it has none (then
    llama.cpp takes kimi-linear's softplus gate), which reads as -inf; a mistyped one refused naming it
    (break-check: Kimi writing the floor always fails the -inf case)."""
    s = preset_shape("tiny", arch).with_(kda_gate_lower_bound=floor)
    meta = {k: v.value for k, v in architecture(arch).metadata(s).items()}
    assert (f"{arch}.kda.gate_lower_bound" in meta) == math.isfinite(floor)
    assert (f"{arch}.kda.safe_gate" in meta) == (arch == "bailingmoe3")
    k = bailingmoe3.kda_keys(read_hparams(meta, arch, "m.gguf", FAMILIES[arch].recurrence), "m.gguf")
    assert (k.head_dim, k.gate_lower_bound, k.safe_gate) == (s.ssm_d_state, floor, arch == "bailingmoe3")
    bad = read_hparams({**meta, f"{arch}.kda.gate_lower_bound": "low"}, arch, "m.gguf", FAMILIES[arch].recurrence)
    with pytest.raises(BadInputError, match=re.escape(f"m.gguf: {arch}.kda.gate_lower_bound must be a number")):
        bailingmoe3.kda_keys(bad, "m.gguf")


@pytest.mark.parametrize(("arch", "types"), [("glm-dsa", (1, 0, 1)), ("glm-dsa", ()), ("qwen4exp", ())])
def test_the_indexers_table_is_written_by_both_factories_and_read_back(arch: str, types: tuple[int, ...]) -> None:
    """DSA's lightning indexer's keys (models/glm_dsa.py INDEXER_KEYS), GLM-5's and Qwen3.8's: the heads, head size
    and top-k as written, read back, and GLM-5.2's per-layer types where the shape has them; a list of another
    length refused in one line (break-check: the factory writing the head size as the top-k fails here)."""
    s = preset_shape("tiny", arch).with_(**({"n_layer": len(types), "indexer_types": types} if types else {}))
    meta = {k: v.value for k, v in architecture(arch).metadata(s).items()}
    k = glm_dsa.indexer_keys(read_hparams(meta, arch, "m.gguf", FAMILIES[arch].recurrence), "m.gguf")
    assert (k.n_head, k.head_size, k.top_k) == (s.indexer_n_head, s.indexer_head_size, s.indexer_top_k)
    assert k.types == tuple(bool(t) for t in types)
    bad = {**meta, f"{arch}.attention.indexer.types": np.ones(s.n_layer + 1, bool)}
    with pytest.raises(BadInputError, match=re.escape(f"m.gguf: {arch}.attention.indexer.types must list one flag")):
        glm_dsa.indexer_keys(read_hparams(bad, arch, "m.gguf", FAMILIES[arch].recurrence), "m.gguf")
