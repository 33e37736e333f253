"""The factory's DeepSeek V4 (`deepseek4`): llama.cpp's keys and tensors per layer kind, the hash layers' tables,
the geometry llama.cpp refuses, the CLI flags and the presets."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tokenwing.models.deepseek4 import dsv4_compress_ratios
from tokenwing.testmodel import preset_shape
from tokenwing.testmodel.architectures import check_shape, n_params, tensor_specs

A = "deepseek4"
# What llama.cpp's converter writes for DeepSeek V4 (conversion/deepseek.py and the base class), by key.
DEEPSEEK4_KEYS = {
    "block_count", "context_length", "embedding_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "expert_count", "expert_used_count", "expert_feed_forward_length", "vocab_size", "rope.dimension_count",
    "attention.q_lora_rank", "attention.sliding_window", "expert_gating_func", "expert_shared_count",
    "expert_weights_scale", "expert_weights_norm", "swiglu_clamp_exp", "swiglu_clamp_shexp",
    "attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k",
    "attention.output_group_count", "attention.output_lora_rank", "attention.compress_ratios",
    "attention.compress_rope_freq_base", "hyper_connection.count", "hyper_connection.sinkhorn_iterations",
    "hyper_connection.epsilon", "hash_layer_count", "embedding_length_out", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
}  # fmt: skip
# Every layer's tensors; a compressing layer adds its compressor, a CSA layer (ratio 4) the indexer too.
COMMON = {
    "attn_norm.weight", "attn_sinks.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight",
    "attn_kv.weight", "attn_kv_a_norm.weight", "attn_output_a.weight", "attn_output_b.weight",
    "hc_attn_fn.weight", "hc_attn_base.weight", "hc_attn_scale.weight", "hc_ffn_fn.weight", "hc_ffn_base.weight",
    "hc_ffn_scale.weight", "ffn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
    "ffn_down_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
}  # fmt: skip
COMPRESSOR = {f"attn_compressor_{t}.weight" for t in ("kv", "gate", "ape", "norm")}
INDEXER = {"indexer.proj.weight", "indexer.attn_q_b.weight"}
INDEXER |= {f"indexer_compressor_{t}.weight" for t in ("kv", "gate", "ape", "norm")}


def _read(path: Path) -> tuple[dict[str, object], dict[str, gguf.ReaderTensor]]:
    r = gguf.GGUFReader(str(path))
    return {k: v.contents() for k, v in r.fields.items()}, {t.name: t for t in r.tensors}


def _layer(tensors: dict[str, gguf.ReaderTensor], i: int) -> set[str]:
    return {n.removeprefix(f"blk.{i}.") for n in tensors if n.startswith(f"blk.{i}.")}


def test_deepseek4_metadata_as_the_converter_writes_it(model_factory: ModelFactory) -> None:
    f, _ = _read(model_factory(arch=A))
    assert {k.removeprefix(A + ".") for k in f if k.startswith(A + ".")} == DEEPSEEK4_KEYS
    s = preset_shape("tiny", A)
    assert f[f"{A}.block_count"] == s.n_layer == 4
    assert f[f"{A}.attention.head_count_kv"] == 1
    assert f[f"{A}.attention.key_length"] == f[f"{A}.attention.value_length"] == 128
    assert f[f"{A}.expert_gating_func"] == 4  # sqrtsoftplus: llama.cpp's loader throws on any other
    assert f[f"{A}.expert_weights_norm"] is True and f[f"{A}.expert_weights_scale"] == 1.5
    # one ratio per block plus the MTP block's the config lists (V4 Flash: 44 for 43 blocks)
    assert list(f[f"{A}.attention.compress_ratios"]) == [0, 0, 4, 128, 0]  # type: ignore[call-overload]
    assert list(f[f"{A}.swiglu_clamp_exp"]) == list(f[f"{A}.swiglu_clamp_shexp"]) == [10.0] * 4  # type: ignore[call-overload]
    assert (f[f"{A}.hyper_connection.count"], f[f"{A}.hyper_connection.sinkhorn_iterations"]) == (4, 20)
    assert f[f"{A}.embedding_length_out"] == 4 * 64
    assert f[f"{A}.attention.compress_rope_freq_base"] == 160000.0 and f[f"{A}.rope.freq_base"] == 10000.0
    assert (f[f"{A}.attention.output_group_count"], f[f"{A}.attention.output_lora_rank"]) == (2, 32)
    assert (f[f"{A}.attention.indexer.head_count"], f[f"{A}.attention.indexer.key_length"]) == (4, 64)
    assert f[f"{A}.hash_layer_count"] == 2 and f[f"{A}.rope.scaling.factor"] == 16.0
    assert f["tokenizer.ggml.pre"] == "joyai-llm" and f["tokenizer.ggml.add_bos_token"] is True


def test_deepseek4_tensors_per_layer_kind(model_factory: ModelFactory) -> None:
    """Layers 0-1 window-only and hash-routed, 2 CSA with the indexer, 3 HCA; llama.cpp's shapes (GGUF order)."""
    _, t = _read(model_factory(arch=A, type="Q8_0"))
    hashed = {"ffn_gate_tid2eid.weight"}
    routed = {"exp_probs_b.bias"}
    assert _layer(t, 0) == _layer(t, 1) == COMMON | hashed
    assert _layer(t, 2) == COMMON | routed | COMPRESSOR | INDEXER
    assert _layer(t, 3) == COMMON | routed | COMPRESSOR
    assert {n for n in t if not n.startswith("blk.")} == {
        "token_embd.weight", "output_norm.weight", "output.weight", "output_hc_fn.weight", "output_hc_base.weight",
        "output_hc_scale.weight",
    }  # fmt: skip
    shape = {n: tuple(int(x) for x in v.shape) for n, v in t.items()}
    assert shape["blk.2.attn_q_b.weight"] == (32, 4 * 128)
    assert shape["blk.2.attn_output_a.weight"] == (4 * 128 // 2, 32 * 2)  # 2-D as converted; llama.cpp makes 3-D
    assert shape["blk.2.attn_output_b.weight"] == (2 * 32, 64)
    assert shape["blk.2.hc_attn_fn.weight"] == (4 * 64, 6 * 4) and shape["blk.2.hc_attn_scale.weight"] == (3,)
    assert shape["output_hc_fn.weight"] == (4 * 64, 4) and shape["output_hc_scale.weight"] == (1,)
    assert shape["blk.2.attn_compressor_kv.weight"] == (64, 2 * 128)  # CSA: two overlapping windows
    assert shape["blk.2.attn_compressor_ape.weight"] == (2 * 128, 4)
    assert shape["blk.3.attn_compressor_kv.weight"] == (64, 128)  # HCA: one window of 128
    assert shape["blk.3.attn_compressor_ape.weight"] == (128, 128)
    assert shape["blk.2.indexer.attn_q_b.weight"] == (32, 4 * 64) and shape["blk.2.indexer.proj.weight"] == (64, 4)
    assert shape["blk.2.indexer_compressor_ape.weight"] == (2 * 64, 4)
    assert shape["blk.0.ffn_gate_tid2eid.weight"] == (2, 512)  # top-k experts per token id
    assert shape["blk.2.ffn_up_shexp.weight"] == (64, 32)  # one shared expert as wide as a routed one
    types = {n: v.tensor_type.name for n, v in t.items()}
    assert types["blk.0.ffn_gate_tid2eid.weight"] == "I32"
    f32 = ("hc_attn_fn", "hc_ffn_base", "attn_sinks", "attn_compressor_ape", "indexer_compressor_ape", "ffn_gate_inp")
    assert all(types[f"blk.2.{n}.weight"] == "F32" for n in f32) and types["output_hc_fn.weight"] == "F32"
    assert types["blk.2.attn_output_a.weight"] == types["blk.2.indexer.attn_q_b.weight"] == "Q8_0"
    assert len(t) == len(tensor_specs(preset_shape("tiny", A)))


def test_mxfp4_experts_as_the_converter_writes_them(model_factory: ModelFactory) -> None:
    f, t = _read(model_factory(arch=A, type="MXFP4_MOE"))
    assert f["general.file_type"] == 38  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE, as the converter marks V4's files
    types = {n: v.tensor_type.name for n, v in t.items()}
    assert {types[f"blk.3.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {"MXFP4"}
    assert types["blk.3.ffn_up_shexp.weight"] == types["blk.3.attn_kv.weight"] == "Q8_0"
    assert types["blk.1.ffn_gate_tid2eid.weight"] == "I32"


@pytest.mark.parametrize(
    "changes",
    [{}, {"n_expert": 64, "n_expert_used": 6, "hash_layer_count": 4, "vocab_size": 4096}, {"n_expert_used": 8}],
)
def test_hash_tables_hold_valid_expert_ids(model_factory: ModelFactory, changes: dict[str, int]) -> None:
    """Each hash layer's ffn_gate_tid2eid routes every token id to top-k distinct experts, each below n_expert;
    the tables cover every expert and differ between layers."""
    s = preset_shape("tiny", A).with_(**changes)
    _, t = _read(model_factory(arch=A, **changes))
    tables = []
    for i in range(s.n_layer):
        name = f"blk.{i}.ffn_gate_tid2eid.weight"
        if i >= s.hash_layer_count:
            assert name not in t and f"blk.{i}.exp_probs_b.bias" in t
            continue
        ids = np.asarray(t[name].data).reshape(s.vocab_size, s.n_expert_used)
        assert ids.dtype == np.int32
        assert ids.min() >= 0 and ids.max() < s.n_expert
        assert all(len(set(row)) == s.n_expert_used for row in ids.tolist())  # distinct experts per token
        assert len(np.unique(ids)) == s.n_expert  # no expert left out
        tables.append(ids)
    assert len(tables) == s.hash_layer_count
    assert all(not np.array_equal(a, b) for a, b in itertools.pairwise(tables))


def test_geometries_and_the_default_layer_pattern() -> None:
    for n_layer, ratios in [(1, (4,)), (2, (4, 128)), (3, (0, 4, 128)), (4, (0, 0, 4, 128))]:
        s = preset_shape("tiny", A).with_(n_layer=n_layer, hash_layer_count=min(2, n_layer))
        check_shape(s)
        assert dsv4_compress_ratios(s) == ratios
    v4_flash = preset_shape("tiny", A).with_(n_layer=43)
    ratios = dsv4_compress_ratios(v4_flash)
    assert ratios[:4] == (0, 0, 4, 128) and (ratios.count(4), ratios.count(128)) == (21, 20)
    for size in ("tiny", "kquant", "small", "bench"):
        s = preset_shape(size, A)
        check_shape(s)
        assert s.indexer_head_size % 64 == 0 and s.head_dim // s.n_rot == 8
        # every matrix row a multiple of 32 (Q8_0), of 256 in the K-quant preset
        rows = {spec.shape[0] for spec in tensor_specs(s) if spec.role in ("matrix", "expert") and len(spec.shape) > 1}
        assert all(r % (256 if size == "kquant" else 32) == 0 for r in rows), (size, rows)
    explicit = preset_shape("tiny", A).with_(compress_ratios=(4, 4, 0, 128), o_group_count=4, hash_layer_count=4)
    check_shape(explicit)
    names = {spec.name for spec in tensor_specs(explicit)}
    assert "blk.1.indexer.proj.weight" in names and "blk.2.attn_compressor_kv.weight" not in names


def test_ds4_bench_preset() -> None:
    """DeepSeek V4 Flash scaled to one machine: 256 experts top-6, V4's layer pattern, ~4.6 GB at MXFP4_MOE."""
    s = preset_shape("ds4-bench")
    check_shape(s)
    assert (s.arch, s.n_expert, s.n_expert_used, s.hash_layer_count) == (A, 256, 6, 3)
    assert dsv4_compress_ratios(s)[:4] == (0, 0, 4, 128)
    specs = tensor_specs(s)
    experts = sum(math.prod(x.shape) for x in specs if x.role == "expert")
    assert 4.0e9 < experts * 17 / 32 + (n_params(s) - experts) * 34 / 32 < 5.0e9  # MXFP4 experts, Q8_0 rest
    with pytest.raises(ValueError, match="is a deepseek4 model"):
        preset_shape("ds4-bench", "deepseek2")


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"hc_mult": 2}, "exactly 4 hyper-connection streams"),
        ({"n_head_kv": 2}, "--n-head-kv 1"),
        ({"q_lora_rank": 0}, "--q-lora-rank"),
        ({"kv_lora_rank": 64}, "--q-lora-rank"),
        ({"n_rot": 96}, "--n-rot"),
        ({"n_rot": 15}, "--n-rot"),
        ({"indexer_head_size": 96}, "multiple of 64"),
        ({"indexer_top_k": 0}, "top-k"),
        ({"o_group_count": 3}, "--o-group-count"),
        ({"compress_ratios": (0, 4, 128)}, "one ratio per layer"),
        ({"compress_ratios": (0, 4, 8, 128)}, "0, 4 or 128"),
        ({"compress_ratios": (0, 0, 128, 128)}, "at least one CSA layer"),
        ({"hash_layer_count": 5}, "--hash-layer-count"),
        ({"n_shared_exp": 0}, "shared expert"),
        ({"n_mtp": 1}, "--n-mtp 0"),
        ({"n_expert_group": 2, "n_group_used": 1}, "expert groups"),
        ({"n_dense_lead": 1}, "no leading dense layers"),
        ({"hc_sinkhorn_iters": 0}, "--hc-sinkhorn-iters"),
        ({"sliding_window": 0}, "--sliding-window"),
    ],
)
def test_check_shape_refuses_what_llama_cpp_would(changes: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError) as e:
        check_shape(preset_shape("tiny", A).with_(**changes))
    assert words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("changes", [{"hc_mult": 4}, {"hash_layer_count": 1}, {"compress_ratios": (4, 4)}])
def test_other_families_refuse_deepseek4_geometry(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="deepseek4's"):
        check_shape(preset_shape("tiny").with_(**changes))


def test_cli_writes_and_refuses_deepseek4(tmp_path: Path) -> None:
    out = tmp_path / "ok.gguf"
    flags = ["--compress-ratios", "4,128,4,0,4", "--hash-layer-count", "3", "--o-group-count", "4"]
    r = run_cli("testmodel", str(out), "--arch", A, "--n-layer", "5", *flags, "--type", "Q8_0", "-q")
    assert r.returncode == 0, r.stderr
    f, t = _read(out)
    assert list(f[f"{A}.attention.compress_ratios"]) == [4, 128, 4, 0, 4, 0]  # type: ignore[call-overload]
    assert f[f"{A}.attention.output_group_count"] == 4 and "blk.2.ffn_gate_tid2eid.weight" in t
    bad = tmp_path / "bad.gguf"
    r = run_cli("testmodel", str(bad), "--arch", A, "--compress-ratios", "0,0,128,128")
    assert_clean_error(r, 2)
    assert "CSA layer" in r.stderr and not bad.exists()
