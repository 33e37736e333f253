"""The test-model factory: shapes, determinism, sizes and types."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tokenwing.testmodel import preset_shape, write_test_model
from tokenwing.testmodel.architectures import check_shape, n_params, tensor_specs
from tokenwing.testmodel.tokenizer import build_vocabulary


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    s = preset_shape("tiny")
    for d in "abc":
        (tmp_path / d).mkdir()
    a, b, c = (tmp_path / d / "m.gguf" for d in "abc")  # the name goes into general.name
    write_test_model(str(a), s, "Q4_0", seed=3)
    write_test_model(str(b), s, "Q4_0", seed=3)
    write_test_model(str(c), s, "Q4_0", seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
def test_weights_have_the_intended_spread(model_factory: ModelFactory, type_name: str) -> None:
    r = gguf.GGUFReader(str(model_factory(type=type_name, n_embd=256, n_ff_exp=64)))
    tensors = {t.name: t for t in r.tensors}
    expected = {"token_embd.weight": 1.0, "blk.0.ffn_up_exps.weight": 1 / 16, "blk.0.ffn_down_exps.weight": 1 / 8}
    for name, std in expected.items():
        t = tensors[name]
        values = gguf.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert abs(values.std() / std - 1) < 0.1, (name, values.std())
        assert abs(values.mean()) < 0.1 * std
    norm = gguf.dequantize(tensors["blk.0.attn_norm.weight"].data, gguf.GGMLQuantizationType.F32)
    assert abs(norm.mean() - 1) < 0.1


def test_metadata_and_tensor_table(model_factory: ModelFactory) -> None:
    r = gguf.GGUFReader(str(model_factory(arch="ernie4_5-moe", n_layer=3, n_dense_lead=1, n_shared_exp=1)))
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "ernie4_5-moe"
    assert f["ernie4_5-moe.leading_dense_block_count"] == 1
    assert f["ernie4_5-moe.expert_count"] == 8 and f["ernie4_5-moe.expert_used_count"] == 2
    assert f["ernie4_5-moe.rope.freq_base"] == 1_000_000.0
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "qwen2"
    assert len(f["tokenizer.ggml.tokens"]) == 512
    assert "<|im_start|>" in f["tokenizer.chat_template"]
    names = {t.name for t in r.tensors}
    assert "blk.0.ffn_up.weight" in names and "blk.0.ffn_up_exps.weight" not in names  # the dense layer
    assert {"blk.1.ffn_up_exps.weight", "blk.1.ffn_up_shexp.weight"} <= names
    assert len(names) == len(
        tensor_specs(preset_shape("tiny").with_(arch="ernie4_5-moe", n_layer=3, n_dense_lead=1, n_shared_exp=1))
    )


def test_bench_preset_geometry() -> None:
    s = preset_shape("bench")
    experts = s.n_layer * s.n_expert * 3 * s.n_embd * s.n_ff_exp
    assert experts / n_params(s) > 0.95  # experts dominate, as in the models we target
    # Q4_K (4.5 bits) of one token's routed experts if all miss: 274 MB, as the engine issue states
    per_token = s.n_layer * s.n_expert_used * 3 * s.n_embd * s.n_ff_exp * 144 / 256
    assert abs(per_token / 1e6 - 255) < 25


def test_vocabulary_sizes() -> None:
    v = build_vocabulary(300)
    assert len(v.tokens) == len(v.token_types) == 300
    assert len(set(v.tokens)) == 300
    assert v.tokens[v.eos_id] == "<|im_end|>"
    big = build_vocabulary(5000)
    assert len(big.tokens) == 5000 and big.tokens[-1].startswith("<|reserved_")
    with pytest.raises(ValueError, match="at least"):
        build_vocabulary(100)


def test_split_writes_consistent_shards(model_factory: ModelFactory) -> None:
    first = model_factory(type="F16", shards=2)
    shards = sorted(first.parent.glob(first.name.replace("-00001-of-00002", "-*-of-00002")))
    assert len(shards) == 2
    fields = [gguf.GGUFReader(str(p)).fields for p in shards]
    assert [f["split.no"].contents() for f in fields] == [0, 1]
    assert all(f["split.count"].contents() == 2 for f in fields)
    total = sum(len(gguf.GGUFReader(str(p)).tensors) for p in shards)
    assert fields[0]["split.tensors.count"].contents() == total


def _fields(path: Path) -> dict[str, object]:
    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}


# What llama.cpp's converter writes for DeepSeek-V3 (conversion/deepseek.py DeepseekV2Model + TextModel),
# Kimi K2 likewise, and gpt-oss (conversion/gpt_oss.py).
DEEPSEEK2_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon", "expert_count",
    "expert_used_count", "expert_group_count", "expert_group_used_count", "expert_gating_func",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "leading_dense_block_count", "vocab_size",
    "attention.q_lora_rank", "attention.kv_lora_rank", "attention.key_length", "attention.value_length",
    "attention.key_length_mla", "attention.value_length_mla", "expert_feed_forward_length", "expert_shared_count",
    "expert_weights_scale", "expert_weights_norm", "rope.dimension_count", "rope.scaling.yarn_log_multiplier",
}  # fmt: skip
GPT_OSS_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon", "expert_count",
    "expert_used_count", "attention.key_length", "attention.value_length", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    "attention.sliding_window", "expert_feed_forward_length",
}  # fmt: skip


def _arch_keys(f: dict[str, object], arch: str) -> set[str]:
    return {k.removeprefix(arch + ".") for k in f if k.startswith(arch + ".")}


def test_deepseek_v3_metadata_and_tensors(model_factory: ModelFactory) -> None:
    f = _fields(model_factory(arch="deepseek2", n_layer=3, n_mtp=1))
    a = "deepseek2"
    assert _arch_keys(f, a) == DEEPSEEK2_KEYS | {"nextn_predict_layers"}
    # MLA as MQA over the latent: one KV head of kv_lora_rank + rope dims; per-head sizes in *_mla
    assert f[f"{a}.block_count"] == 4 and f[f"{a}.nextn_predict_layers"] == 1
    assert f[f"{a}.attention.head_count_kv"] == 1
    assert (f[f"{a}.attention.key_length"], f[f"{a}.attention.value_length"]) == (64 + 16, 64)
    assert (f[f"{a}.attention.key_length_mla"], f[f"{a}.attention.value_length_mla"]) == (48, 32)
    assert (f[f"{a}.attention.q_lora_rank"], f[f"{a}.attention.kv_lora_rank"]) == (96, 64)
    assert f[f"{a}.rope.dimension_count"] == 16
    assert f[f"{a}.expert_gating_func"] == 2 and f[f"{a}.expert_weights_norm"] is True
    assert f[f"{a}.expert_weights_scale"] == 2.5
    assert (f[f"{a}.expert_group_count"], f[f"{a}.expert_group_used_count"]) == (4, 2)
    assert f[f"{a}.rope.scaling.type"] == "yarn" and f[f"{a}.rope.scaling.factor"] == 40.0
    assert f[f"{a}.rope.scaling.original_context_length"] == 4096
    assert abs(float(f[f"{a}.rope.scaling.yarn_log_multiplier"]) - 0.1) < 1e-7  # type: ignore[arg-type]
    assert f["tokenizer.ggml.pre"] == "deepseek-v3" and f["tokenizer.ggml.add_bos_token"] is True
    names = {t.name for t in gguf.GGUFReader(str(model_factory(arch="deepseek2", n_layer=3, n_mtp=1))).tensors}
    layer1 = {n.removeprefix("blk.1.") for n in names if n.startswith("blk.1.")}
    assert layer1 == {
        "attn_norm.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight", "attn_kv_a_mqa.weight",
        "attn_kv_a_norm.weight", "attn_k_b.weight", "attn_v_b.weight", "attn_output.weight", "ffn_norm.weight",
        "ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight", "ffn_up_exps.weight",
        "ffn_down_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
    }  # fmt: skip
    assert {"blk.0.ffn_up.weight", "blk.0.ffn_down.weight"} <= names  # a leading dense layer
    mtp = {n.removeprefix("blk.3.") for n in names if n.startswith("blk.3.")}
    assert layer1 | {f"nextn.{t}.weight" for t in ("eh_proj", "enorm", "hnorm", "embed_tokens")} <= mtp
    assert {"nextn.shared_head_head.weight", "nextn.shared_head_norm.weight"} <= mtp


def test_deepseek2_variants(model_factory: ModelFactory) -> None:
    r = gguf.GGUFReader(str(model_factory(arch="deepseek2", legacy_kv_b=True)))
    f = {k: v.contents() for k, v in r.fields.items()}
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert "blk.1.attn_k_b.weight" not in shapes
    assert shapes["blk.1.attn_kv_b.weight"] == (64, 4 * (32 + 32))  # kv_lora → heads × (nope + v)
    assert f["deepseek2.attention.head_count_kv"] == 4 and "deepseek2.attention.key_length_mla" not in f
    assert (f["deepseek2.attention.key_length"], f["deepseek2.attention.value_length"]) == (48, 32)
    lite = gguf.GGUFReader(str(model_factory(arch="deepseek2", q_lora_rank=0, n_layer=27)))
    names = {t.name for t in lite.tensors}
    assert "blk.1.attn_q.weight" in names and "blk.1.attn_q_a.weight" not in names
    assert "deepseek2.attention.q_lora_rank" not in {k for k in lite.fields}  # as DeepSeek-V2-Lite's GGUF
    split = {
        t.name: tuple(int(x) for x in t.shape) for t in gguf.GGUFReader(str(model_factory(arch="deepseek2"))).tensors
    }
    assert split["blk.1.attn_k_b.weight"] == (32, 64, 4) and split["blk.1.attn_v_b.weight"] == (64, 32, 4)
    kimi = _fields(model_factory(preset="kimi-tiny"))
    assert kimi["deepseek2.expert_count"] == 384 and kimi["deepseek2.expert_group_count"] == 1
    assert kimi["deepseek2.expert_group_used_count"] == 1 and kimi["deepseek2.leading_dense_block_count"] == 1
    assert kimi["deepseek2.rope.scaling.yarn_beta_fast"] == 1.0  # as Kimi K2's config (llama.cpp ignores it)
    assert kimi["tokenizer.ggml.pre"] == "kimi-k2"


def test_gpt_oss_metadata_and_tensors(model_factory: ModelFactory) -> None:
    path = model_factory(arch="gpt-oss", type="MXFP4_MOE")
    f = _fields(path)
    assert _arch_keys(f, "gpt-oss") == GPT_OSS_KEYS
    assert f["gpt-oss.attention.sliding_window"] == 128 and f["gpt-oss.rope.scaling.factor"] == 32.0
    assert f["gpt-oss.rope.freq_base"] == 150000.0 and f["general.file_type"] == 38  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    assert f["tokenizer.ggml.pre"] == "gpt-4o"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    layer0 = {n.removeprefix("blk.0."): ty for n, ty in types.items() if n.startswith("blk.0.")}
    assert layer0 == {
        "attn_norm.weight": "F32", "attn_q.weight": "Q8_0", "attn_q.bias": "F32", "attn_k.weight": "Q8_0",
        "attn_k.bias": "F32", "attn_v.weight": "Q8_0", "attn_v.bias": "F32", "attn_output.weight": "Q8_0",
        "attn_output.bias": "F32", "attn_sinks.weight": "F32", "post_attention_norm.weight": "F32",
        "ffn_gate_inp.weight": "F32", "ffn_gate_inp.bias": "F32", "ffn_gate_exps.weight": "MXFP4",
        "ffn_up_exps.weight": "MXFP4", "ffn_down_exps.weight": "MXFP4", "ffn_gate_exps.bias": "F32",
        "ffn_up_exps.bias": "F32", "ffn_down_exps.bias": "F32",
    }  # fmt: skip
    assert types["token_embd.weight"] == types["output.weight"] == "Q8_0"


def test_mxfp4_experts_have_the_intended_spread(model_factory: ModelFactory) -> None:
    r = gguf.GGUFReader(str(model_factory(arch="gpt-oss", type="F32", expert_type="MXFP4", n_embd=256)))
    t = {x.name: x for x in r.tensors}["blk.0.ffn_up_exps.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
    values = gguf.dequantize(t.data, t.tensor_type).astype(np.float64)
    assert abs(values.std() * 16 - 1) < 0.1 and abs(values.mean()) < 0.01


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"arch": "deepseek2", "n_shared_exp": 0}, "shared expert"),
        ({"arch": "deepseek2", "n_rot": 48}, "n-rot"),
        ({"arch": "deepseek2", "q_lora_rank": 0}, "q_lora_rank"),
        ({"arch": "deepseek2", "n_layer": 27}, "lite"),
        ({"arch": "deepseek2", "n_expert_group": 3}, "multiple of --n-expert-group"),
        ({"arch": "deepseek2", "n_group_used": 4}, "--n-group-used"),
        ({"arch": "deepseek2", "n_expert_group": 8}, "below --n-expert"),
        ({"arch": "deepseek2", "n_group_used": 1, "n_expert_used": 3}, "groups used"),
        ({"arch": "deepseek2", "n_mtp": 2}, "--n-mtp"),
        ({"arch": "qwen3moe", "kv_lora_rank": 64}, "deepseek2"),
        ({"arch": "gpt-oss", "n_shared_exp": 1}, "no shared experts"),
        ({"arch": "gpt-oss", "n_dense_lead": 1}, "no leading dense"),
        ({"arch": "gpt-oss", "head_dim": 15}, "even"),
        ({"arch": "gpt-oss", "yarn_factor": 0.5}, "--yarn-factor"),
        ({"arch": "gpt-oss", "tokenizer": "bert"}, "unknown tokenizer"),
        ({"arch": "qwen3next", "ssm_dt_rank": 3}, "multiple of their key heads"),
        ({"arch": "qwen3next", "ssm_d_conv": 1}, "convolution of 2"),
        ({"arch": "qwen35moe", "rope_sections": (4, 4, 4, 0)}, "IMRoPE"),
        ({"arch": "qwen35moe", "legacy_ssm_in": True}, "ssm_in"),
        ({"arch": "qwen35moe", "n_mtp": 1}, "bailingmoe3"),
        ({"arch": "bailingmoe3", "kda_gate_lower_bound": 0.0}, "negative"),
        ({"arch": "bailingmoe3", "n_shared_exp": 0}, "shared expert"),
    ],
)
def test_check_shape_refuses_what_llama_cpp_would(changes: dict[str, object], words: str) -> None:
    arch = str(changes.pop("arch"))
    with pytest.raises(ValueError) as e:
        check_shape(preset_shape("tiny", arch).with_(**changes))
    assert words in str(e.value)


def test_presets_for_issue_13() -> None:
    ds = preset_shape("ds-bench")
    check_shape(ds)
    assert (ds.arch, ds.n_embd, ds.n_expert, ds.n_ff_exp, ds.n_expert_used) == ("deepseek2", 2048, 256, 512, 8)
    assert (ds.n_expert_group, ds.n_group_used, ds.n_dense_lead, ds.n_shared_exp) == (8, 4, 2, 1)
    # Q4_K_M (~4.5-4.9 bits per weight) of the whole model: 4-5 GB
    assert 4.0e9 < n_params(ds) * 4.7 / 8 < 5.0e9
    oss = preset_shape("oss-bench")
    check_shape(oss)
    experts = (oss.n_layer - oss.n_dense_lead) * oss.n_expert * 3 * oss.n_embd * oss.n_ff_exp
    assert 4.0e9 < experts * 17 / 32 + (n_params(oss) - experts) * 34 / 32 < 5.0e9  # MXFP4 experts, Q8_0 rest
    kimi = preset_shape("kimi-tiny")
    check_shape(kimi)
    assert (kimi.n_expert, kimi.n_expert_group, kimi.tokenizer) == (384, 1, "kimi-k2")
    with pytest.raises(ValueError, match="is a deepseek2 model"):
        preset_shape("ds-bench", "gpt-oss")


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe", "bailingmoe3"])
def test_hybrid_metadata_and_tensors(model_factory: ModelFactory, arch: str) -> None:
    """The linear-attention families: llama.cpp's keys and, per layer, linear or full attention in its pattern."""
    path = model_factory(arch=arch, type="Q8_0", n_layer=4, n_mtp=1 if arch == "bailingmoe3" else 0)
    f = _fields(path)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    if arch == "bailingmoe3":
        assert list(f["bailingmoe3.attention.head_count_kv"]) == [0, 0, 1, 1, 1]  # KDA, KDA, MLA, MLA, MTP (MLA)
        assert f["bailingmoe3.kda.head_dim"] == 16 and f["bailingmoe3.kda.gate_lower_bound"] == -5.0
        assert types["blk.0.ssm_conv1d_q.weight"] == types["blk.0.ssm_a"] == "F32"
        assert types["blk.0.ssm_f_a.weight"] == types["blk.2.attn_gate.weight"] == "Q8_0"
        assert "blk.4.nextn.eh_proj.weight" in types and "blk.0.ffn_gate.weight" in types  # MTP, dense layer
    else:
        assert f[f"{arch}.full_attention_interval"] == 4 and f[f"{arch}.ssm.inner_size"] == 64
        assert ("blk.0.attn_qkv.weight" in types) and ("blk.3.attn_qkv.weight" not in types)
        assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == "F32"
        assert ("blk.0.ssm_alpha.weight" in types) == (arch == "qwen35moe")
        assert (f.get(f"{arch}.rope.dimension_sections") is not None) == (arch == "qwen35moe")
    a = gguf.GGUFReader(str(path))
    ssm_a = next(t for t in a.tensors if t.name == "blk.0.ssm_a")
    assert (np.sign(ssm_a.data) == (1 if arch == "bailingmoe3" else -1)).all()  # exp(A_log) or -exp(A_log)


def test_ling_bench_preset() -> None:
    """Ling 3.0 Flash's pattern at ~4.4 GB: 512 experts top-8, MLA in every 6th layer, KDA in the others."""
    from tokenwing.models.bailingmoe3 import ling_full_attention

    ling = preset_shape("ling-bench")
    check_shape(ling)
    assert (ling.arch, ling.n_expert, ling.n_expert_used, ling.n_layer) == ("bailingmoe3", 512, 8, 18)
    assert [i for i in range(ling.n_layer) if ling_full_attention(ling, i)] == [5, 11, 17]
    assert 4.0e9 < n_params(ling) * 4.7 / 8 < 5.0e9


def test_cli_refuses_bad_geometry_in_one_line(tmp_path: Path) -> None:
    r = run_cli("testmodel", str(tmp_path / "x.gguf"), "--arch", "deepseek2", "--n-expert-group", "3")
    assert_clean_error(r, 2)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "gpt-4o"])
def test_family_vocabularies(name: str) -> None:
    v = build_vocabulary(20000, name)
    assert len(v.tokens) == len(set(v.tokens)) == len(v.token_types) == 20000 and v.pre == name
    assert v.token_types[v.eos_id] == 3 and v.token_types[v.bos_id] == 3
    if name == "kimi-k2":
        assert v.tokens[-1] == "[PAD19999]" and v.token_types[-1] == 5  # unused, as the converter pads
    if name == "deepseek-v3":
        assert v.token_types[v.tokens.index("<｜User｜>")] == 4  # an added token that is not special
