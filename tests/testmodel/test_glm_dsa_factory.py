"""The factory's GLM-5 / GLM-5.2 (`glm-dsa`): llama.cpp's keys and tensors (MLA plus the DSA indexer, only in the
layers that run their own), the geometry llama.cpp refuses, the CLI flags and the preset."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tokenwing.testmodel import preset_shape
from tokenwing.testmodel.architectures import check_shape, tensor_specs

A = "glm-dsa"
# What llama.cpp's converter writes for GLM-5 (conversion/glm.py GlmMoeDsaModel over conversion/deepseek.py's
# DeepseekV2Model), by key; GLM-5.2 adds attention.indexer.types, a file with its MTP block nextn_predict_layers.
GLM_DSA_KEYS = {
    "block_count", "context_length", "embedding_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "expert_count", "expert_used_count", "expert_feed_forward_length", "vocab_size", "rope.dimension_count",
    "attention.q_lora_rank", "attention.kv_lora_rank", "attention.key_length_mla", "attention.value_length_mla",
    "feed_forward_length", "leading_dense_block_count", "expert_shared_count", "expert_weights_scale",
    "expert_weights_norm", "expert_gating_func", "attention.indexer.head_count", "attention.indexer.key_length",
    "attention.indexer.top_k",
}  # fmt: skip
MLA = {
    "attn_norm.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight", "attn_kv_a_mqa.weight",
    "attn_kv_a_norm.weight", "attn_k_b.weight", "attn_v_b.weight", "attn_output.weight", "ffn_norm.weight",
}  # fmt: skip
INDEXER = {
    "indexer.k_norm.weight", "indexer.k_norm.bias", "indexer.proj.weight", "indexer.attn_k.weight",
    "indexer.attn_q_b.weight",
}  # fmt: skip
MOE = {
    "ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
    "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
}  # fmt: skip
DENSE = {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}


def _read(path: Path) -> tuple[dict[str, object], dict[str, gguf.ReaderTensor]]:
    r = gguf.GGUFReader(str(path))
    return {k: v.contents() for k, v in r.fields.items()}, {t.name: t for t in r.tensors}


def _layer(tensors: dict[str, gguf.ReaderTensor], i: int) -> set[str]:
    return {n.removeprefix(f"blk.{i}.") for n in tensors if n.startswith(f"blk.{i}.")}


def test_glm_dsa_metadata_as_the_converter_writes_it(model_factory: ModelFactory) -> None:
    f, _ = _read(model_factory(arch=A))
    assert {k.removeprefix(A + ".") for k in f if k.startswith(A + ".")} == GLM_DSA_KEYS
    s = preset_shape("tiny", A)
    assert f[f"{A}.attention.head_count_kv"] == 1
    assert f[f"{A}.attention.key_length"] == s.kv_lora_rank + s.n_rot  # MQA over the latent and the rope key
    assert f[f"{A}.attention.key_length_mla"] == s.head_dim
    assert f[f"{A}.expert_gating_func"] == 2  # sigmoid
    assert f[f"{A}.attention.indexer.head_count"] == s.indexer_n_head
    assert f[f"{A}.attention.indexer.key_length"] == s.indexer_head_size == 64
    assert f[f"{A}.attention.indexer.top_k"] == s.indexer_top_k
    assert f["tokenizer.ggml.pre"] == "glm4"  # GLM-5's tokenizer hashes as GLM-4.7's (conversion/base.py)
    assert "rope.scaling.type" not in {k.removeprefix(A + ".") for k in f}


def test_glm_dsa_tensors_and_glm_5_2_shared_indexers(model_factory: ModelFactory) -> None:
    """Every layer of a GLM-5 file has the indexer; a GLM-5.2 file's shared layers have none, and its types are
    one BOOL per layer that runs (not the MTP block)."""
    _, t = _read(model_factory(arch=A, n_layer=3))
    assert _layer(t, 0) == MLA | INDEXER | DENSE
    assert _layer(t, 1) == _layer(t, 2) == MLA | INDEXER | MOE
    assert t["blk.0.indexer.attn_q_b.weight"].shape.tolist() == [96, 4 * 64]
    assert t["blk.0.indexer.k_norm.bias"].tensor_type == gguf.GGMLQuantizationType.F32
    f, t = _read(model_factory(arch=A, n_layer=4, indexer_types=(1, 0, 1, 0), n_mtp=1, type="Q8_0"))
    assert list(f[f"{A}.attention.indexer.types"]) == [True, False, True, False]  # type: ignore[call-overload]
    assert [bool(_layer(t, i) & INDEXER) for i in range(5)] == [True, False, True, False, True]
    assert f[f"{A}.nextn_predict_layers"] == 1 and "blk.4.nextn.eh_proj.weight" in t
    assert t["blk.1.attn_q_b.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0


def test_glm5_bench_preset() -> None:
    """GLM-5 scaled to one machine: 256 experts top-8, GLM-5.2's shared indexers, ~4.3 GB at Q4_K_M."""
    s = preset_shape("glm5-bench")
    check_shape(s)
    assert (s.arch, s.n_expert, s.n_expert_used, s.n_dense_lead, s.indexer_top_k) == (A, 256, 8, 2, 256)
    assert sum(s.indexer_types) == 4 and s.indexer_types[0] == 1
    total = sum(math.prod(x.shape) for x in tensor_specs(s))
    assert 3.8e9 < total * 4.85 / 8 < 4.8e9  # Q4_K_M: ~4.85 bits a weight
    with pytest.raises(ValueError, match="is a glm-dsa model"):
        preset_shape("glm5-bench", "deepseek2")


@pytest.mark.parametrize("size", ["tiny", "kquant", "small", "bench"])
def test_every_size_preset_makes_a_valid_glm_dsa(size: str) -> None:
    s = preset_shape(size, A)
    check_shape(s)
    assert s.n_rot <= s.indexer_head_size and s.indexer_head_size % 64 == 0 and s.q_lora_rank > 0


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"q_lora_rank": 0}, "--q-lora-rank"),
        ({"legacy_kv_b": True}, "attn_k_b"),
        ({"indexer_head_size": 96}, "power of two"),
        ({"indexer_head_size": 32, "n_rot": 16}, "power of two"),
        ({"indexer_top_k": 0}, "top-k"),
        ({"indexer_n_head": 0}, "heads"),
        ({"n_rot": 80, "head_dim": 144}, "--n-rot must be at most --indexer-head-size"),
        ({"indexer_types": (1,)}, "one 0 or 1 per layer"),
        ({"indexer_types": (1, 2)}, "one 0 or 1 per layer"),
        ({"indexer_types": (0, 1)}, "layer 0 must run its own indexer"),
        ({"n_expert_group": 2, "n_group_used": 1}, "expert groups"),
        ({"yarn_factor": 4.0}, "YaRN"),
        ({"n_shared_exp": 0}, "shared expert"),
        ({"hash_layer_count": 1}, "deepseek4's"),
    ],
)
def test_check_shape_refuses_what_llama_cpp_would(changes: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError) as e:
        check_shape(preset_shape("tiny", A).with_(**changes))
    assert words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("changes", [{"indexer_top_k": 8}, {"indexer_types": (1, 0)}])
def test_other_families_refuse_the_indexer(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="glm-dsa"):
        check_shape(preset_shape("tiny", "deepseek2").with_(**changes))


def test_cli_writes_and_refuses_glm_dsa(tmp_path: Path) -> None:
    out = tmp_path / "ok.gguf"
    flags = ["--n-layer", "3", "--indexer-types", "1,0,1", "--indexer-top-k", "12", "--indexer-n-head", "2"]
    r = run_cli("testmodel", str(out), "--arch", A, *flags, "--type", "Q8_0", "-q")
    assert r.returncode == 0, r.stderr
    f, t = _read(out)
    assert list(f[f"{A}.attention.indexer.types"]) == [True, False, True]  # type: ignore[call-overload]
    assert f[f"{A}.attention.indexer.top_k"] == 12 and "blk.1.indexer.proj.weight" not in t
    bad = tmp_path / "bad.gguf"
    r = run_cli("testmodel", str(bad), "--arch", A, "--indexer-head-size", "96")
    assert_clean_error(r, 2)
    assert "power of two" in r.stderr and not bad.exists()
