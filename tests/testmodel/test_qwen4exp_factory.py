"""The factory's Qwen3.8 Flash Next (`qwen4exp`): llama.cpp's keys and tensors per layer kind, the n-gram table and
its hash constants, the geometry llama.cpp refuses, the CLI flags and the presets."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tokenwing.models.qwen4exp import ple_head_vocab_sizes, ple_multipliers, ple_table_rows
from tokenwing.testmodel import preset_shape
from tokenwing.testmodel.architectures import check_shape, n_params, tensor_specs

A = "qwen4exp"
# What llama.cpp's converter writes for Qwen3.8 Flash Next (conversion/qwen4exp.py over Qwen3.5's), by key.
KEYS = {
    "context_length", "embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "expert_count", "expert_used_count", "expert_feed_forward_length", "rope.dimension_count",
    "expert_shared_feed_forward_length", "ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
    "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval", "rope.dimension_sections",
    "hyper_connection.count", "hyper_connection.low_rank", "attention.indexer.head_count",
    "attention.indexer.key_length", "attention.indexer.top_k", "attention.compress_ratios",
}  # fmt: skip
PLE_KEYS = {
    "ple.layers", "ple.ngram_size", "ple.heads_per_ngram", "ple.conv_kernel", "ple.eos_token_id",
    "embedding_length_per_layer_input", "ple.layer_multipliers", "ple.head_offsets", "ple.head_vocab_sizes",
}  # fmt: skip
HC = {f"hc_{p}_{t}.weight" for p in ("attn", "ffn") for t in ("norm", "down", "up", "inject")}
MOE = {f"ffn_{t}.weight" for t in ("gate_inp", "gate_exps", "up_exps", "down_exps", "gate_shexp", "up_shexp")}
MOE |= {"ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight"}
LINEAR = {f"{t}.weight" for t in ("attn_qkv", "attn_gate", "ssm_conv1d", "ssm_beta", "ssm_alpha", "ssm_norm")}
LINEAR |= {"ssm_out.weight"}
LINEAR |= {"ssm_dt.bias", "ssm_a"}
FULL = {f"attn_{t}.weight" for t in ("q", "k", "v", "output", "q_norm", "k_norm")}
FULL |= {f"indexer.{t}.weight" for t in ("q_proj", "k_proj", "q_norm", "k_norm")}
PLE = {f"ple_{t}.weight" for t in ("key", "value", "norm_key", "norm_query", "norm_conv", "conv1d")}


def _read(path: Path) -> tuple[dict[str, object], dict[str, gguf.ReaderTensor]]:
    r = gguf.GGUFReader(str(path))
    return {k: v.contents() for k, v in r.fields.items()}, {t.name: t for t in r.tensors}


def _layer(tensors: dict[str, gguf.ReaderTensor], i: int) -> set[str]:
    return {n.removeprefix(f"blk.{i}.") for n in tensors if n.startswith(f"blk.{i}.")}


def test_metadata_as_the_converter_writes_it(model_factory: ModelFactory) -> None:
    f, _ = _read(model_factory(arch=A))
    assert {k.removeprefix(A + ".") for k in f if k.startswith(A + ".")} == KEYS | PLE_KEYS
    assert f[f"{A}.block_count"] == 4 and f[f"{A}.full_attention_interval"] == 4
    assert list(f[f"{A}.attention.compress_ratios"]) == [0, 0, 0, 4]  # type: ignore[call-overload]
    assert (f[f"{A}.hyper_connection.count"], f[f"{A}.hyper_connection.low_rank"]) == (4, 32)
    assert list(f[f"{A}.ple.layers"]) == [0]  # type: ignore[call-overload]
    assert f[f"{A}.embedding_length_per_layer_input"] == 64 // 4  # 2 n-gram orders × 2 heads share n_embd
    assert f[f"{A}.ple.eos_token_id"] == f["tokenizer.ggml.eos_token_id"]
    assert f["tokenizer.ggml.pre"] == "qwen35"
    assert len(f[f"{A}.rope.dimension_sections"]) == 4  # type: ignore[arg-type]


def test_without_the_table_no_ple_keys(model_factory: ModelFactory) -> None:
    f, t = _read(model_factory(arch=A, ple_layer=-1))
    assert not {k for k in f if k.startswith(f"{A}.ple.")} and "per_layer_token_embd.weight" not in t
    assert _layer(t, 0) == HC | LINEAR | MOE


def test_tensors_per_layer_kind(model_factory: ModelFactory) -> None:
    _, t = _read(model_factory(arch=A, type="Q8_0", n_layer=5))
    assert _layer(t, 0) == HC | LINEAR | PLE | MOE
    assert _layer(t, 1) == _layer(t, 2) == _layer(t, 4) == HC | LINEAR | MOE
    assert _layer(t, 3) == HC | FULL | MOE
    assert {n for n in t if not n.startswith("blk.")} == {
        "token_embd.weight", "per_layer_token_embd.weight", "output.weight", "output_hc_norm.weight",
        "output_hc_down.weight", "output_hc_up.weight",
    }  # fmt: skip
    shape = {n: tuple(int(x) for x in v.shape) for n, v in t.items()}
    s = preset_shape("tiny", A)
    assert shape["blk.0.hc_attn_norm.weight"] == (4 * 64,)  # one gamma per stream element; llama.cpp reads [E, hc]
    assert shape["blk.0.hc_attn_down.weight"] == (4 * 64, 32) and shape["blk.0.hc_ffn_up.weight"] == (32, 4 * 64)
    assert shape["blk.0.hc_attn_inject.weight"] == (4 * 64, 4)
    assert shape["blk.0.ple_key.weight"] == (64, 4 * 64) and shape["blk.0.ple_conv1d.weight"] == (4, 4 * 64)
    assert shape["blk.3.attn_q.weight"] == (64, 2 * s.n_head * s.head_dim)  # each head's query, then its gate
    assert shape["blk.3.indexer.q_proj.weight"] == (64, 2 * 16) and shape["blk.3.indexer.k_proj.weight"] == (64, 16)
    assert shape["per_layer_token_embd.weight"] == (16, ple_table_rows(s))
    types = {n: v.tensor_type.name for n, v in t.items()}
    f32 = ("hc_attn_norm", "ple_norm_key", "ssm_conv1d", "ffn_gate_inp", "ffn_gate_inp_shexp")
    assert all(types[f"blk.0.{n}.weight"] == "F32" for n in f32) and types["output_hc_norm.weight"] == "F32"
    assert types["blk.0.hc_attn_down.weight"] == types["blk.0.ple_key.weight"] == "Q8_0"
    assert types["blk.3.indexer.q_proj.weight"] == types["blk.0.ffn_up_exps.weight"] == "Q8_0"
    assert len(t) == len(tensor_specs(preset_shape("tiny", A).with_(n_layer=5)))


@pytest.mark.parametrize("changes", [{}, {"vocab_size": 4096, "ple_ngram": 4, "ple_heads_per_ngram": 8}])
def test_the_hash_constants(changes: dict[str, int]) -> None:
    """Odd multipliers small enough that token · multiplier fits an int64 (llama.cpp hashes in uint64, the reference
    in int64: they agree only so); each head's rows a distinct prime, laid out one after another; the table padded
    to 128 rows (the reference's make_ngram_vocab_size_divisible_by)."""
    s = preset_shape("tiny", A).with_(**changes)
    m = ple_multipliers(s)
    assert len(m) == s.ple_ngram and all(x % 2 == 1 for x in m)
    assert all(x * (s.vocab_size - 1) < 2**63 for x in m)
    sizes = ple_head_vocab_sizes(s)
    assert len(sizes) == (s.ple_ngram - 1) * s.ple_heads_per_ngram == len(set(sizes))
    assert all(all(n % d for d in range(2, int(n**0.5) + 1)) for n in sizes)
    assert sizes == sorted(sizes) and sizes[0] >= s.ple_head_rows
    assert ple_table_rows(s) % 128 == 0 and 0 <= ple_table_rows(s) - sum(sizes) < 128


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ple_layer": 3}, "linear-attention layer"),
        ({"ple_heads_per_ngram": 3}, "multiple of the n-gram heads"),
        ({"hc_mult": 1}, "--hc-mult"),
        ({"indexer_top_k": 10}, "multiple of --qsa-ratio"),
        ({"ple_ngram": 1}, "--ple-ngram"),
        ({"ple_conv_kernel": 1}, "--ple-conv-kernel"),
        ({"n_shared_exp": 0}, "shared expert"),
        ({"n_dense_lead": 1}, "no dense layers"),
    ],
)
def test_geometry_llama_cpp_refuses(changes: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_shape(preset_shape("tiny", A).with_(**changes))


def test_other_families_refuse_qwen4exp_parts() -> None:
    with pytest.raises(ValueError, match="qwen4exp's"):
        check_shape(preset_shape("tiny", "qwen35moe").with_(ple_layer=0))
    with pytest.raises(ValueError, match="qwen4exp's"):
        check_shape(preset_shape("tiny", "qwen35moe").with_(hc_low_rank=32))


def test_geometries_the_flags_reach(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    r = run_cli(
        "testmodel", "--arch", A, "--n-layer", "8", "--ple-layer", "5", "--ple-ngram", "2",
        "--ple-heads-per-ngram", "4", "--hc-low-rank", "64", "--qsa-ratio", "8", "--indexer-top-k", "16",
        "--ple-head-rows", "300", "--ple-conv-kernel", "2", "-q", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    f, t = _read(out)
    assert list(f[f"{A}.ple.layers"]) == [5] and f[f"{A}.ple.ngram_size"] == 2  # type: ignore[call-overload]
    assert list(f[f"{A}.attention.compress_ratios"]) == [0, 0, 0, 8, 0, 0, 0, 8]  # type: ignore[call-overload]
    assert tuple(int(x) for x in t["blk.5.ple_conv1d.weight"].shape) == (2, 4 * 64)
    assert tuple(int(x) for x in t["output_hc_up.weight"].shape) == (64, 4 * 64)
    assert_clean_error(run_cli("testmodel", "--arch", A, "--ple-layer", "3", "-q", str(tmp_path / "x.gguf")), 2)


def test_the_bench_preset() -> None:
    s = preset_shape("q4x-bench")
    check_shape(s)
    assert (s.arch, s.n_embd, s.n_expert, s.n_expert_used, s.n_ff_exp) == (A, 2048, 512, 10, 512)
    assert (s.hc_mult, s.hc_low_rank, s.ple_layer, s.tokenizer) == (4, 320, 0, "qwen35")
    assert s.n_embd // ((s.ple_ngram - 1) * s.ple_heads_per_ngram) == 128  # the released table's row
    assert 7.5e9 < n_params(s) < 8.2e9
