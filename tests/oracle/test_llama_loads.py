"""llama.cpp (llama-cpp-python) loads every generated model: each architecture, each quant type, split too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ModelFactory
from tokenwing.testmodel.tokenizer import build_vocabulary

pytestmark = pytest.mark.oracle

ARCHS = {
    "qwen3moe": {},
    "qwen2moe": {"n_shared_exp": 1},
    "ernie4_5-moe": {"n_layer": 3, "n_dense_lead": 1, "n_shared_exp": 1},
    "glm4moe": {"n_layer": 3, "n_dense_lead": 1, "n_shared_exp": 1},
}
DIRECT = ["F32", "F16", "BF16", "Q8_0", "Q4_0"]
KQUANTS = ["Q4_K_M", "Q6_K"]
TEXTS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # 1024 tokens\n\n\n",
    "  leading spaces,\ttabs and   runs; it's don't WE'RE 3.14159 $19.99",
    "café naïve Straße 日本語 🙂 ünïcödé",
    "",
]


def probe_models(
    paths: list[Path], texts: list[str], chats: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Loads each model in llama.cpp (in a subprocess) and reports what it sees: tokens of `texts`, the
    conversations `chats` ({"messages": [...], "add_ass": bool}) through its chat template, finite logits."""
    req = Path(paths[0]).with_suffix(".probe.json")
    req.write_text(json.dumps({"paths": [str(p) for p in paths], "texts": texts, "chats": chats or []}))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("llama_probe.py")), str(req)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _probe(paths: list[Path]) -> list[dict[str, Any]]:
    return probe_models(paths, TEXTS)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_llama_cpp_loads_every_type(model_factory: ModelFactory, arch: str) -> None:
    shape = ARCHS[arch]
    paths = [model_factory(arch=arch, type=t, **shape) for t in DIRECT]
    paths += [model_factory(arch=arch, type=t, preset="kquant", **shape) for t in KQUANTS]
    results = _probe(paths)
    assert len(results) == len(paths)
    for r in results:
        assert r["n_vocab"] == 512
        assert r["logits_finite"], r["path"]
        assert float(r["logits_std"]) > 0.0  # random weights give spread logits, not a constant
    # the tokenizer works in llama.cpp and tokenizes exactly as the `tokenizers` model it was built from
    trained = build_vocabulary(512).trained
    for r in results:
        assert r["detokenized"] == TEXTS
        assert r["tokens"] == [trained.encode(t).ids for t in TEXTS]


def test_llama_cpp_loads_split_model(model_factory: ModelFactory) -> None:
    first = model_factory(type="Q8_0", shards=3, n_layer=3)
    assert "-00001-of-00003" in first.name
    (r,) = _probe([first])
    assert r["logits_finite"]


def test_same_seed_same_model_across_shards(model_factory: ModelFactory) -> None:
    """Each tensor has its own random stream: splitting a model does not change its weights."""
    import gguf

    whole = model_factory(type="Q8_0", n_layer=3)
    first = model_factory(type="Q8_0", shards=3, n_layer=3)
    a = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(whole)).tensors}
    b: dict[str, bytes] = {}
    for p in sorted(first.parent.glob(first.name.replace("-00001-", "-*-"))):
        b.update({t.name: bytes(t.data) for t in gguf.GGUFReader(str(p)).tensors})
    assert a == b


# The new families' variants (issue 13): each loads in llama.cpp and gives finite, spread logits.
FAMILY_MODELS: list[dict[str, Any]] = [
    {"arch": "deepseek2", "type": "F32"},
    {"arch": "deepseek2", "type": "Q8_0"},
    {"arch": "deepseek2", "type": "Q4_K_M", "preset": "kquant"},
    {"arch": "deepseek2", "type": "Q8_0", "n_mtp": 1},
    {"arch": "deepseek2", "type": "F16", "legacy_kv_b": True},
    {"arch": "deepseek2", "type": "F32", "q_lora_rank": 0, "n_layer": 27},
    {"preset": "kimi-tiny", "type": "Q8_0"},
    {"arch": "gpt-oss", "type": "F32"},
    {"arch": "gpt-oss", "type": "Q8_0"},
    {"arch": "gpt-oss", "type": "Q4_K_M", "preset": "kquant"},
    {"arch": "gpt-oss", "type": "MXFP4_MOE"},
    {"arch": "gpt-oss", "type": "BF16", "expert_type": "MXFP4"},
]


def test_llama_cpp_loads_deepseek2_and_gpt_oss(model_factory: ModelFactory) -> None:
    paths = [model_factory(**m) for m in FAMILY_MODELS]
    results = _probe(paths)
    assert len(results) == len(paths)
    for r in results:
        assert r["n_vocab"] == 512
        assert r["logits_finite"], r["path"]
        assert float(r["logits_std"]) > 0.1, r["path"]


def test_mxfp4_experts_as_ggml_reads_them(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The factory's own MXFP4 blocks: llama.cpp's quantizer turns them into F32 with ggml's dequantisation,
    which gives exactly gguf-py's values; those have the intended spread (1/sqrt(fan_in))."""
    import gguf
    import numpy as np

    from tokenwing.testmodel.kquant import quantize_with_llama_cpp

    src = model_factory(arch="gpt-oss", type="MXFP4_MOE", n_embd=256, n_ff_exp=64)
    out = tmp_path / "f32.gguf"
    quantize_with_llama_cpp(str(src), str(out), "ALL_F32")
    ours = {t.name: t for t in gguf.GGUFReader(str(src)).tensors}
    ggml = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    for name, fan_in in (("blk.0.ffn_gate_exps.weight", 256), ("blk.1.ffn_down_exps.weight", 64)):
        t = ours[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
        values = gguf.dequantize(t.data, t.tensor_type).reshape(-1)
        assert np.array_equal(values, np.asarray(ggml[name].data, dtype=np.float32).reshape(-1))
        assert abs(values.std() * np.sqrt(fan_in) - 1) < 0.1, (name, values.std())
        assert abs(values.mean()) < 0.05 / np.sqrt(fan_in)
