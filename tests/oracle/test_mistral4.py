"""Mistral Small 4 (mistral4: DeepSeek-V2's graph under its own name in llama.cpp) against llama.cpp on the same GGUF,
and streamed against resident: MLA with YaRN, a softmax router whose weights are normalised, shared experts, the
gate and up experts fused in the source (ffn_gate_up_exps: each expert's gate rows, then its up rows; with the
halves swapped in the repack, F32 is 2.6 off)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ModelFactory, run_cli
from tests.format.test_shards import copy_shards, plain, sha256, shards_of
from tests.ggufs import with_metadata
from tests.oracle.test_families import (
    f32_matches_llama_cpp,
    family_streamed_matches,
    quantized_matches_llama_cpp,
)
from tests.oracle.test_logits import _repacked
from tokenwing.format.gguf_io import KV, read_header

pytestmark = pytest.mark.oracle

VARIANTS: dict[str, dict[str, object]] = {
    # the factory's model: 3 MoE layers of 16 experts, top-4, one shared expert, MLA at the tiny sizes, YaRN x32,
    # each layer's gate and up experts in one ffn_gate_up_exps as the converter writes them (repack splits them)
    "factory": {"arch": "mistral4", "n_layer": 3, "n_expert": 16, "n_expert_used": 4},
    # a second geometry: a dense layer first, 8 query heads, 32 experts, top-4, two shared experts, gate and up
    # experts apart (llama.cpp loads either form)
    "dense-first": {
        "fused_gate_up": False,
        "arch": "mistral4",
        "n_layer": 4,
        "n_dense_lead": 1,
        "n_head": 8,
        "n_expert": 32,
        "n_expert_used": 4,
        "n_shared_exp": 2,
    },
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    f32_matches_llama_cpp(model_factory(type="F32", **VARIANTS[variant]), tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("variant", "type_name"), [("factory", "Q8_0"), ("factory", "Q4_K_M"), ("dense-first", "Q8_0")]
)
def test_quantized_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str, type_name: str) -> None:
    """test_families' bar (300 positions: mean KL <= 1e-4, clear top-1s kept) at its tame weights (std 0.03)."""
    shape = dict(VARIANTS[variant], weight_std=0.03)
    if type_name.startswith("Q4_K"):
        shape["preset"] = "kquant"  # rows of 256 where the real model's are
    quantized_matches_llama_cpp(model_factory(type=type_name, **shape), tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", VARIANTS)
def test_streamed_at_a_quarter_is_bit_identical_to_resident(
    model_factory: ModelFactory, tmp_path: Path, variant: str
) -> None:
    """25 % of the expert bytes, lookahead 0 and 2: the same logits as every expert in RAM."""
    family_streamed_matches(model_factory, tmp_path, VARIANTS[variant], percent=25)


def test_attention_temperature_is_refused_in_one_line(model_factory: ModelFactory, tmp_path: Path) -> None:
    """A file with llama.cpp's position-dependent query scaling (attention.temperature_scale) is not computed
    without it: it repacks (an architecture feature the engine lacks, as an architecture it does not run), and
    verify refuses it in one line naming the key, as run and serve do."""
    src = model_factory(type="F32", **VARIANTS["factory"])  # type: ignore[arg-type]
    kv = dict(read_header(str(src)).kv, **{"mistral4.attention.temperature_scale": KV.f32(0.1)})
    model = _repacked(with_metadata(src, tmp_path / "scaled.gguf", kv), tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "tokenwing", "verify", str(model)], capture_output=True, text=True, check=False
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "mistral4.attention.temperature_scale" in lines[0]


def test_fused_experts_repack_shard_by_shard_as_whole(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The shard-by-shard repack (--delete-source, the app's download path) reads a fused gate_up tensor's halves as
    the whole-file repack does: the same bytes."""
    first = model_factory(type="Q8_0", shards=3, **VARIANTS["factory"])  # type: ignore[arg-type]
    expected = sha256(plain(first, tmp_path))
    copies = copy_shards(shards_of(first), tmp_path / "src")
    out = tmp_path / "out.tw.gguf"
    r = run_cli("repack", str(copies[0]), "-o", str(out), "--delete-source", "-q")
    assert r.returncode == 0, r.stderr
    assert sha256(out) == expected
