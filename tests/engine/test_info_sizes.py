"""What the app sizes a model by before it runs it, as the engine publishes it (issue 46 item 4): a quant's bits
per weight and the model file's alignment (`info --json`'s quant_bits, expert_alignment: one expert's bytes before
any file is here), the flags a preset may set with their spelling (preset_flags), the engine's own process
(process_bytes) and a model's compute graph reserve (`inspect --json`'s graph_reserve). Each is checked against
what the engine does: a repacked file's expert records, its parser's flags, the graph a session allocates."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tests.conftest import ModelFactory, run_cli
from tokenwing.format import layout as L
from tokenwing.format.inspect import inspect_model
from tokenwing.runtime.session import Session, SessionOptions


@pytest.fixture(scope="module")
def info() -> dict[str, Any]:
    r = run_cli("info", "--json")
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def bits(type_name: str) -> float:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return size * 8 / block


def test_quant_bits_are_ggmls_blocks_and_llama_cpps_mixes(info: dict[str, Any]) -> None:
    q = info["quant_bits"]
    for uniform in ("F16", "BF16", "Q8_0", "Q6_K", "Q4_0", "MXFP4", "IQ4_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"):
        assert q[uniform] == bits(uniform), uniform
    assert q["MXFP4_MOE"] == bits("MXFP4") == 4.25
    # the _M mixes: gate and up at the base K-quant, ffn_down one type up in half the layers
    assert q["Q4_K_M"] == pytest.approx((2 * 4.5 + (6.5625 + 4.5) / 2) / 3) == pytest.approx(4.84375)
    assert q["Q5_K_M"] == pytest.approx((2 * bits("Q5_K") + (bits("Q6_K") + bits("Q5_K")) / 2) / 3)
    assert q["Q3_K_M"] == pytest.approx((2 * bits("Q3_K") + bits("Q4_K")) / 3)
    # unsloth's dynamic quants count as the class their name gives
    assert q["UD-Q4_K_XL"] == q["Q4_K_M"] and q["UD-Q8_K_XL"] == q["Q8_0"] and q["UD-IQ1_M"] == q["IQ1_M"]
    assert "Q4_K_XL" not in q and "UD-Q9_K_XL" not in q
    assert info["expert_alignment"] == L.ALIGNMENT == 4096


@pytest.mark.parametrize(("type_name", "quant"), [("Q8_0", "Q8_0"), ("F16", "F16")])
def test_an_experts_bytes_from_the_published_facts_are_the_repacked_files(
    repacked_factory: ModelFactory, info: dict[str, Any], type_name: str, quant: str
) -> None:
    """3 projections of width × ffn weights at the quant's bits, each on the file's alignment (what the app works
    out for a model before it has the file) is the record the repacked file holds for each expert."""
    model = repacked_factory(arch="qwen3moe", type=type_name)
    layer = inspect_model([str(model)])["experts"]["layers"][0]
    width, ffn = layer["gate_shape"]
    align = info["expert_alignment"]
    projection = math.ceil(width * ffn * info["quant_bits"][quant] / 8)
    assert 3 * (-(-projection // align) * align) == layer["record_bytes"]


def test_preset_flags_are_the_engines_own(info: dict[str, Any]) -> None:
    """A preset's flag keys are the engine's: lookahead and each --moe-stream-* flag, spelled as its parser takes
    them (and so known to `flags`, with kinds and defaults)."""
    spelled = info["preset_flags"]
    assert spelled["lookahead"] == "--lookahead" and spelled["io-threads"] == "--moe-stream-io-threads"
    assert set(spelled.values()) <= set(info["flags"])
    assert {n for n in info["flags"] if n.startswith("--moe-stream-")} <= set(spelled.values())
    assert "--ram-budget" not in spelled.values() and "--ctx" not in spelled.values()  # (the machine's, the user's)


def test_the_engines_process_is_counted(info: dict[str, Any]) -> None:
    assert 10 << 20 < info["process_bytes"] < info["memory"]["total"]


def test_the_graph_reserve_is_what_a_session_allocates(repacked_factory: ModelFactory) -> None:
    """`inspect --json`'s graph_reserve at a context is the graph context a session opened at that context
    allocates (memory_plan.graph_bytes at the default prompt batch), for attention and linear-attention layers."""
    for arch in ("qwen3moe", "qwen3next"):
        model = repacked_factory(arch=arch, type="F16", n_layer=4 if arch == "qwen3moe" else 8)
        g = inspect_model([str(model)])["graph_reserve"]
        assert g["max_batch"] == SessionOptions().max_batch and g["per_context_token"] > 0
        for n_ctx in (256, 1024):
            s = Session(str(model), SessionOptions(n_ctx=n_ctx), log=lambda line: None)
            try:
                assert s.graph.mem_bytes == g["bytes"] + g["per_context_token"] * n_ctx, (arch, n_ctx)
            finally:
                s.close()
