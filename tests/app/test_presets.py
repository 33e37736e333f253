"""The presets catalog: every shipped preset loads and obeys the rules; a bad preset is one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from runmyai.library.presets import (
    FLAG_DEFAULTS,
    QUANT_BITS,
    Preset,
    expert_bytes_for,
    load_catalog,
)
from runmyai.paths import bundled_dir

PRESETS = bundled_dir("presets")
EXPECTED = {
    "qwen3-30b-a3b": "qwen3moe",
    "qwen3-235b-a22b": "qwen3moe",
    "deepseek-v3.1": "deepseek2",
    "kimi-k2": "deepseek2",
    "gpt-oss-120b": "gpt-oss",
    "glm-4.5-air": "glm4moe",
    "glm-4.5": "glm4moe",
    "gpt-oss-20b": "gpt-oss",
    "qwen3.5-397b-a17b": "qwen35moe",
    "ling-flash-2.0": "bailingmoe2",
    "ling-3.0-flash": "bailingmoe3",
    "qwen3-next-80b-a3b": "qwen3next",
    "tokenwing-demo-moe": "qwen3moe",
}

GOOD = """\
name = "Good"
repo = "runmyai/Good-TW"
file = "Good.tw.gguf"
size_bytes = 4_000_000_000
sha256 = ""
quant = "Q8_0"

[arch]
arch = "qwen3moe"
total_params = 4e9
active_params = 1e9
layers = 10
experts = 100
top_k = 4
hidden = 1000
expert_ffn = 1000
context = 4096
"""


def test_every_shipped_preset_loads() -> None:
    catalog = load_catalog(PRESETS)
    assert catalog.errors == ()
    assert {p.id: p.facts.arch for p in catalog.presets} == EXPECTED
    assert catalog.presets[0].id == "tokenwing-demo-moe"  # bundled first, then by size


@pytest.mark.parametrize("preset_id", sorted(EXPECTED))
def test_preset_rules(preset_id: str) -> None:
    p = load_catalog(PRESETS).get(preset_id)
    assert isinstance(p, Preset)
    f = p.facts
    assert 0 < f.active_params <= f.total_params
    assert 1 <= f.top_k <= f.experts
    assert 0 <= f.dense_layers < f.layers
    # the routed experts fit in the published parameter counts
    assert f.moe_layers * f.experts * f.expert_params <= f.total_params * 1.01
    assert f.moe_layers * f.top_k * f.expert_params <= f.active_params * 1.01
    assert f.hidden > 0 and f.expert_ffn > 0 and f.context > 0
    # expert bytes: the quant's bits per weight, three projections each padded to 4 KiB
    assert p.expert_bytes % 4096 == 0
    raw = f.expert_params * QUANT_BITS[p.quant] / 8
    assert raw <= p.expert_bytes < raw + 3 * 4096
    assert p.expert_total_bytes <= p.size_bytes
    assert p.file.endswith(".tw.gguf")
    assert p.sha256 is None or len(p.sha256) == 64
    assert p.source == ("bundled" if preset_id == "tokenwing-demo-moe" else "hub")
    assert f.kv_bytes_per_token > 0  # the KV cache of the chosen context is part of the estimate
    if p.source == "hub":  # downloadable from its GGUF until the repacked file is published
        assert p.gguf is not None and p.gguf.default in p.gguf.quants and not p.published
        assert p.gguf.default == p.quant
    if p.source == "hub":
        assert p.repo is not None and p.repo.startswith("runmyai/") and p.repo.endswith("-TW")
    else:
        assert p.repo is None and p.bundled_source == "demo-model/tokenwing-demo-moe.gguf"
    assert 0 <= p.chat.temperature <= 2 and 0 < p.chat.top_p <= 1 and p.chat.top_k >= 0
    # every flag the engine knows, documented defaults, none claimed as measured yet
    if p.source == "bundled":  # the built-in model streams a quarter of its experts from the first screen
        assert p.flags[:2] == ("--ram-budget", "25%")
    flags = p.flags[2:] if p.source == "bundled" else p.flags
    assert flags[:2] == ("--lookahead", "2")
    assert "--moe-stream-io-threads" in flags and "--moe-stream-direct" in flags
    assert len([a for a in flags if a.startswith("--")]) == len(FLAG_DEFAULTS) - 1  # all but verify
    assert p.measured_flags == ()


def test_known_numbers() -> None:
    c = load_catalog(PRESETS)
    q = c.get("qwen3-30b-a3b")
    assert q is not None
    # 2048 x 768 weights at 4.84375 bits = 952,320 bytes, padded to 233 x 4096 = 954,368; three projections
    assert QUANT_BITS["Q4_K_M"] == pytest.approx(4.84375)
    assert q.expert_bytes == 3 * 954_368
    assert q.chat.temperature == 0.6 and q.chat.top_k == 20
    demo = c.get("tokenwing-demo-moe")
    assert demo is not None
    # Q8_0: 256 x 128 weights x 34/32 bytes = 34,816, padded to 36,864
    assert demo.expert_bytes == expert_bytes_for(256, 128, "Q8_0") == 3 * 36_864
    assert demo.facts.experts == 32 and demo.facts.top_k == 4 and demo.facts.layers == 6
    kimi = c.get("kimi-k2")
    assert kimi is not None and kimi.facts.experts == 384


def _catalog_with(tmp_path: Path, bad: str, name: str = "bad.toml") -> tuple[tuple[str, ...], list[str]]:
    (tmp_path / "good.toml").write_text(GOOD)
    (tmp_path / name).write_bytes(bad.encode("utf-8") if isinstance(bad, str) else bad)
    catalog = load_catalog(tmp_path)
    return catalog.errors, [p.id for p in catalog.presets]


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (GOOD.replace("layers = 10\n", ""), "bad.toml: arch.layers: missing"),
        (GOOD.replace('name = "Good"\n', ""), "bad.toml: name: missing"),
        (GOOD.replace("layers = 10", 'layers = "ten"'), "bad.toml: arch.layers: expected a whole number"),
        (GOOD.replace("layers = 10", "layers = 10.5"), "bad.toml: arch.layers: expected a whole number"),
        (GOOD.replace("top_k = 4", "top_k = 101"), "bad.toml: arch.top_k: more than arch.experts"),
        (GOOD.replace("active_params = 1e9", "active_params = 5e9"), "bad.toml: arch.active_params: more than"),
        (GOOD.replace("active_params = 1e9", "active_params = 1e8"), "bad.toml: arch.active_params: 1e+08 is less"),
        (GOOD.replace("total_params = 4e9", "total_params = 2e9"), "bad.toml: arch.total_params: 2e+09 is less"),
        (GOOD.replace('arch = "qwen3moe"', 'arch = "Qwen 3"'), "bad.toml: arch.arch: 'Qwen 3' is not a GGUF"),
        (GOOD + '\n[gguf]\nrepo = "nope"\nquants = ["Q4_K_M"]\n', "bad.toml: gguf.repo: expected 'owner/name'"),
        (GOOD + '\n[gguf]\nrepo = "a/b"\nquants = []\n', "bad.toml: gguf.quants: expected a list of quant"),
        (
            GOOD + '\n[gguf]\nrepo = "a/b"\nquants = ["Q4_K_M"]\ndefault = "Q8_0"\n',
            "bad.toml: gguf.default: 'Q8_0' is not one of gguf.quants",
        ),
        ('engine_support = "supported"\n' + GOOD, "bad.toml: engine_support: unknown field"),
        (GOOD.replace('quant = "Q8_0"', 'quant = "Q9_9"'), "bad.toml: quant: unknown type 'Q9_9'"),
        (GOOD.replace('file = "Good.tw.gguf"', 'file = "Good.gguf"'), "bad.toml: file: expected a file name"),
        (GOOD.replace('repo = "runmyai/Good-TW"', 'repo = "nope"'), "bad.toml: repo: expected 'owner/name'"),
        (GOOD.replace('sha256 = ""', 'sha256 = "abc"'), "bad.toml: sha256: expected 64 hexadecimal digits"),
        (GOOD.replace("size_bytes = 4_000_000_000", "size_bytes = 1_000_000"), "bad.toml: size_bytes: 1,000,000"),
        (GOOD.replace("context = 4096", "context = 4096\ntop_kk = 3"), "bad.toml: arch.top_kk: unknown field"),
        (GOOD + "\n[chat]\ntop_p = 1.5\n", "bad.toml: chat.top_p: must be between 0 and 1 (got 1.5)"),
        (GOOD + "\n[flags]\nio-threads = 0\n", "bad.toml: flags.io-threads: must be at least 1"),
        (GOOD + '\n[flags]\ndirect = "yes"\n', "bad.toml: flags.direct: expected true or false"),
        (GOOD + '\n[flags]\nmeasured = ["chunk-kib"]\n', "bad.toml: flags.measured: 'chunk-kib' is not a flag"),
        (GOOD + "\n[flags]\nturbo = 1\n", "bad.toml: flags.turbo: unknown field"),
        (GOOD + '\n[flags]\nram-budget = "8G"\n', "bad.toml: flags.ram-budget: expected a share of the experts"),
        (GOOD.split("[arch]")[0] + 'arch = "qwen3moe"\n', "bad.toml: [arch]: expected a table, got a string"),
        (GOOD.split("[arch]")[0], "bad.toml: [arch]: missing table"),
        ("name = \n", "bad.toml: not valid TOML: "),
        ("this is [not toml", "bad.toml: not valid TOML: "),
    ],
)
def test_bad_preset_is_one_clear_line(tmp_path: Path, bad: str, expected: str) -> None:
    errors, loaded = _catalog_with(tmp_path, bad)
    assert loaded == ["good"]  # the rest of the catalog still loads
    assert len(errors) == 1
    assert errors[0].startswith(expected), errors[0]
    assert "\n" not in errors[0]


def test_binary_garbage_and_duplicate_ids(tmp_path: Path) -> None:
    (tmp_path / "good.toml").write_text(GOOD)
    (tmp_path / "garbage.toml").write_bytes(b"\xff\xfe\x00 garbage")
    (tmp_path / "zz-copy.toml").write_text('id = "good"\n' + GOOD)
    catalog = load_catalog(tmp_path)
    assert [p.id for p in catalog.presets] == ["good"]
    assert catalog.errors == ("garbage.toml: not UTF-8 text", "zz-copy.toml: id: 'good' is already used by good.toml")


def test_stated_expert_bytes_and_flags(tmp_path: Path) -> None:
    text = GOOD.replace("context = 4096", "context = 4096\nexpert_bytes = 2_000_000")
    text += '\n[flags]\nlookahead = 3\ndirect = false\npolicy = "lru"\nverify = true\nmeasured = ["lookahead"]\n'
    (tmp_path / "s.toml").write_text(text)
    catalog = load_catalog(tmp_path)
    assert catalog.errors == ()
    p = catalog.presets[0]
    assert p.expert_bytes == 2_000_000 and p.expert_bytes_stated
    assert p.flags == (
        "--lookahead",
        "3",
        "--no-moe-stream-direct",
        "--moe-stream-policy",
        "lru",
        "--moe-stream-verify",
    )
    assert p.measured_flags == ("lookahead",)
    assert p.chat.temperature == 0.7 and p.chat.top_k == 0  # defaults when [chat] is absent


def test_missing_folder(tmp_path: Path) -> None:
    catalog = load_catalog(tmp_path / "nope")
    assert catalog.presets == () and len(catalog.errors) == 1 and "does not exist" in catalog.errors[0]
