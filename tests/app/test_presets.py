"""The presets catalog: every shipped preset loads and obeys the rules; a bad preset is one clear line."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from runmyai.engine.info import EngineInfo, ask_engine
from runmyai.library.presets import (
    Catalog,
    Preset,
    check_flags,
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
    "minimax-m2": "minimax-m2",
    "kimi-k3": "kimi-k3",
    "glm-5": "glm-dsa",
    "glm-5.2": "glm-dsa",
    "qwen3.8-flash-next": "qwen4exp",
    "deepseek-v4-flash": "deepseek4",
    "tokenwing-demo-moe": "qwen3moe",
    "qwen3-vl-30b-a3b": "qwen3vlmoe",
    "qwen3-vl-235b-a22b": "qwen3vlmoe",
    "mistral-small-4": "mistral4",
    "gemma-4-26b-a4b": "gemma4",
    "llama-4-scout": "llama4",
    "llama-4-maverick": "llama4",
    "hy3-preview": "hy_v3",
    "mimo-v2-flash": "mimo2",
    "step-3.5-flash": "step35",
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


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EngineInfo:
    info = asyncio.run(ask_engine(tmp_path_factory.mktemp("settings")))
    assert info.known and info.flags, info.error
    return info


def bound(directory: Path, engine: EngineInfo) -> Catalog:
    """The catalog as the app holds it once the engine has answered: its presets sized by the engine's facts."""
    catalog = load_catalog(directory)
    catalog.bind_engine(engine)
    return catalog


def test_every_shipped_preset_loads(engine: EngineInfo) -> None:
    catalog = bound(PRESETS, engine)
    assert catalog.errors == ()
    assert {p.id: p.facts.arch for p in catalog.presets} == EXPECTED
    assert catalog.presets[0].id == "tokenwing-demo-moe"  # bundled first, then by size


@pytest.mark.parametrize("preset_id", sorted(EXPECTED))
def test_preset_rules(preset_id: str, engine: EngineInfo) -> None:
    p = bound(PRESETS, engine).get(preset_id)
    assert isinstance(p, Preset)
    f = p.facts
    assert 0 < f.active_params <= f.total_params
    assert 1 <= f.top_k <= f.experts
    assert 0 <= f.dense_layers < f.layers
    # the routed experts fit in the published parameter counts
    assert f.moe_layers * f.experts * f.expert_params <= f.total_params * 1.01
    assert f.moe_layers * f.top_k * f.expert_params <= f.active_params * 1.01
    assert f.hidden > 0 and f.expert_ffn > 0 and f.context > 0
    # expert bytes: the quant's bits per weight, three projections each padded to the file's alignment, both the
    # engine's (or stated, where the experts' type is not the quant name's class: DeepSeek V4's MXFP4 experts in
    # unsloth's UD-Q8_K_XL)
    align = engine.expert_alignment
    assert align == 4096 and p.expert_bytes % align == 0
    bits = engine.quant_bits_of(p.quant)
    assert bits is not None, p.quant
    raw = f.expert_params * bits / 8
    assert p.expert_bytes_stated or raw <= p.expert_bytes < raw + 3 * align
    assert p.expert_total_bytes <= p.size_bytes
    assert p.file.endswith(".tw.gguf")
    assert p.sha256 is None or len(p.sha256) == 64
    assert p.source == ("bundled" if preset_id == "tokenwing-demo-moe" else "hub")
    assert not hasattr(f, "kv_bytes_per_token")  # the engine's number, from the model's header (test_engine_facts)
    if p.source == "hub":  # downloadable from its GGUF until the repacked file is published
        assert p.gguf is not None and p.gguf.default in p.gguf.quants and not p.published
        assert p.gguf.default == p.quant
    if p.source == "hub":
        assert p.repo is not None and p.repo.startswith("runmyai/") and p.repo.endswith("-TW")
    else:
        assert p.repo is None and p.bundled_source == "demo-model/tokenwing-demo-moe.gguf"
    assert 0 <= p.chat.temperature <= 2 and 0 < p.chat.top_p <= 1 and p.chat.top_k >= 0
    # nothing measured to differ from the engine's defaults yet, so no flag but the built-in model's budget
    assert p.measured_flags == () and p.flag_values == {}
    assert p.flags == (("--ram-budget", "25%") if p.source == "bundled" else ())


def test_known_numbers(engine: EngineInfo) -> None:
    c = bound(PRESETS, engine)
    q = c.get("qwen3-30b-a3b")
    assert q is not None
    # 2048 x 768 weights at 4.84375 bits = 952,320 bytes, padded to 233 x 4096 = 954,368; three projections
    assert engine.quant_bits_of("Q4_K_M") == pytest.approx(4.84375)
    assert q.expert_bytes == 3 * 954_368
    assert q.chat.temperature == 0.6 and q.chat.top_k == 20
    demo = c.get("tokenwing-demo-moe")
    assert demo is not None
    # Q8_0: 256 x 128 weights x 34/32 bytes = 34,816, padded to 36,864
    assert demo.expert_bytes == expert_bytes_for(256, 128, "Q8_0", engine) == 3 * 36_864
    assert demo.facts.experts == 32 and demo.facts.top_k == 4 and demo.facts.layers == 6
    kimi = c.get("kimi-k2")
    assert kimi is not None and kimi.facts.experts == 384
    # Kimi K3's experts run in its 3584-wide latent, not its 7168 hidden: 3584 x 3072 MXFP4 weights at 4.25 bits =
    # 5,849,088 bytes (1,428 x 4096), three projections
    k3 = c.get("kimi-k3")
    assert k3 is not None and k3.facts.hidden == 7168
    assert k3.expert_bytes == 3 * 5_849_088
    # Qwen3.8 Flash Next's 51B-weight n-gram table, at the preset's quant, is read from the drive, not kept in RAM:
    # the always-loaded part is the file less its experts and the table
    from runmyai.library.estimate import preset_footprint

    # DeepSeek V4 Flash: unsloth's UD-Q8_K_XL is the default, its experts stated as the checkpoint's FP4 (MXFP4) and
    # not the name's Q8_0 class: 3 x 4096 x 2048 x 4.25 / 8 = 3 x 4,456,448, 147 GB of 43 x 256 in its 162 GB
    v4 = c.get("deepseek-v4-flash")
    assert v4 is not None and v4.quant == "UD-Q8_K_XL" and v4.gguf is not None
    assert v4.gguf.repo == "unsloth/DeepSeek-V4-Flash-GGUF" and v4.expert_bytes_stated
    assert v4.expert_bytes == expert_bytes_for(4096, 2048, "MXFP4", engine) == 3 * 4_456_448
    assert v4.expert_total_bytes == 147_169_738_752 < v4.size_bytes
    assert expert_bytes_for(4096, 2048, "UD-Q8_K_XL", engine) == expert_bytes_for(4096, 2048, "Q8_0", engine)

    q38 = c.get("qwen3.8-flash-next")
    assert q38 is not None and q38.facts.sparse_params == 51e9
    fp = preset_footprint(q38)
    assert fp.lazy_bytes == round(51e9 * q38.expert_bytes / q38.facts.expert_params) > 25e9
    assert fp.resident_bytes == q38.size_bytes - q38.expert_total_bytes - fp.lazy_bytes


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
        (
            GOOD.replace("context = 4096", "context = 4096\nsparse_params = 3e9"),
            "bad.toml: arch.sparse_params: 3e+09 and the routed experts are more than total_params",
        ),
        (GOOD + '\n[gguf]\nrepo = "nope"\nquants = ["Q4_K_M"]\n', "bad.toml: gguf.repo: expected 'owner/name'"),
        (GOOD + '\n[gguf]\nrepo = "a/b"\nquants = []\n', "bad.toml: gguf.quants: expected a list of quant"),
        (
            GOOD + '\n[gguf]\nrepo = "a/b"\nquants = ["Q4_K_M"]\ndefault = "Q8_0"\n',
            "bad.toml: gguf.default: 'Q8_0' is not one of gguf.quants",
        ),
        ('engine_support = "supported"\n' + GOOD, "bad.toml: engine_support: unknown field"),
        (GOOD.replace('quant = "Q8_0"', 'quant = "Q 8"'), "bad.toml: quant: 'Q 8' is not a quant name"),
        (GOOD.replace('file = "Good.tw.gguf"', 'file = "Good.gguf"'), "bad.toml: file: expected a file name"),
        (GOOD.replace('repo = "runmyai/Good-TW"', 'repo = "nope"'), "bad.toml: repo: expected 'owner/name'"),
        (GOOD.replace('sha256 = ""', 'sha256 = "abc"'), "bad.toml: sha256: expected 64 hexadecimal digits"),
        (GOOD.replace("context = 4096", "context = 4096\ntop_kk = 3"), "bad.toml: arch.top_kk: unknown field"),
        (GOOD + "\n[chat]\ntop_p = 1.5\n", "bad.toml: chat.top_p: must be between 0 and 1 (got 1.5)"),
        (GOOD + "\n[flags]\nio-threads = 4\n", "bad.toml: flags.io-threads: a preset sets only what was measured"),
        (GOOD + '\n[flags]\npolicy = "decay"\n', "bad.toml: flags.policy: a preset sets only what was measured"),
        (GOOD + '\n[flags]\ndirect = 1.5\nmeasured = ["direct"]\n', "bad.toml: flags.direct: expected true/false"),
        (GOOD + '\n[flags]\nmeasured = ["chunk-kib"]\n', "bad.toml: flags.measured: 'chunk-kib' is not a flag"),
        (GOOD + '\n[flags]\n"Turbo Mode" = 1\n', "bad.toml: flags.Turbo Mode: not a flag key"),
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


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (
            GOOD.replace('quant = "Q8_0"', 'quant = "Q9_9"'),
            "bad.toml: quant: the installed engine does not size 'Q9_9'",
        ),
        (
            GOOD.replace('quant = "Q8_0"', 'quant = "UD-Q9_K_XL"'),
            "bad.toml: quant: the installed engine does not size 'UD-Q9_K_XL'",
        ),
        (GOOD.replace("size_bytes = 4_000_000_000", "size_bytes = 1_000_000"), "bad.toml: size_bytes: 1,000,000"),
    ],
)
def test_a_preset_the_engine_cannot_size_is_one_clear_line(
    tmp_path: Path, engine: EngineInfo, bad: str, expected: str
) -> None:
    """What only the engine can say (a quant's bits, so the experts' bytes against the file's size) is checked
    once it has answered: a preset it cannot size becomes one error line, and the rest of the catalog is sized."""
    (tmp_path / "good.toml").write_text(GOOD)
    (tmp_path / "bad.toml").write_text(bad)
    catalog = load_catalog(tmp_path)
    assert catalog.errors == () and len(catalog.presets) == 2  # (the file itself is fine)
    new = catalog.bind_engine(engine)
    assert [p.id for p in catalog.presets] == ["good"] and catalog.errors == tuple(new)
    assert len(new) == 1 and new[0].startswith(expected) and "\n" not in new[0], new
    assert catalog.presets[0].expert_bytes == expert_bytes_for(1000, 1000, "Q8_0", engine) > 0


def test_unsloth_quant_names(tmp_path: Path, engine: EngineInfo) -> None:
    """unsloth's dynamic quants (UD-Q4_K_XL, UD-IQ1_M, UD-Q8_K_XL: the names its repositories, and so a preset's
    [gguf] default and quant, use) count as the type their name gives, by the engine's word; a name of no known
    type is not sized."""
    q = engine.quant_bits_of
    assert q("UD-Q4_K_XL") == q("Q4_K_M") and q("UD-Q8_K_XL") == q("Q8_0") == 8.5
    assert q("UD-IQ1_M") == q("IQ1_M") and q("ud-q2_k_xl") == q("Q2_K")
    assert q("UD-Q4_K_M") == q("Q4_K_M") is not None
    assert q("Q4_K_XL") is None and q("UD-Q9_K_XL") is None and q("UD-") is None
    # IQ1_M: 256 weights in 56 bytes (ggml's block), 1.75 bits
    assert q("IQ1_M") == 1.75 and expert_bytes_for(1024, 1024, "UD-IQ1_M", engine) == 3 * 229_376
    ud = GOOD.replace('quant = "Q8_0"', 'quant = "UD-IQ1_M"') + (
        '\n[gguf]\nrepo = "unsloth/Good-GGUF"\nquants = ["UD-IQ1_M", "UD-Q4_K_XL"]\ndefault = "UD-IQ1_M"\n'
    )
    (tmp_path / "ud.toml").write_text(ud)
    catalog = bound(tmp_path, engine)
    assert catalog.errors == ()
    p = catalog.get("ud")
    assert p is not None and p.quant == "UD-IQ1_M" and not p.expert_bytes_stated
    # 218,750 bytes, 4 KiB-padded
    assert p.expert_bytes == expert_bytes_for(1000, 1000, "IQ1_M", engine) == 3 * 221_184


@pytest.mark.parametrize("preset_id", sorted(i for i in EXPECTED if i != "tokenwing-demo-moe"))
def test_gguf_quants_are_names_the_repository_gives(preset_id: str) -> None:
    """A preset's [gguf] quants are the names the app reads from the repository's files (split in a folder per
    quant, as unsloth and bartowski lay them out), so that "Download" finds its default: UD-Q8_K_XL for DeepSeek V4
    Flash, a name the app once did not count as a quant type."""
    from runmyai.library.hub import HubFile
    from runmyai.library.quants import find_quant, group_quants

    p = load_catalog(PRESETS).get(preset_id)
    assert p is not None and p.gguf is not None
    stem = p.gguf.repo.split("/")[1].removesuffix("-GGUF")
    files = [
        HubFile(p.gguf.repo, f"{q}/{stem}-{q}-0000{i}-of-00002.gguf", "main", 1_000_000 * (n + 1), None)
        for n, q in enumerate(p.gguf.quants)
        for i in (1, 2)
    ]
    assert sorted(q.name for q in group_quants(files)) == sorted(p.gguf.quants)
    assert find_quant(group_quants(files), p.gguf.default).name == p.gguf.default == p.quant


def test_stated_expert_bytes_and_flags(tmp_path: Path, engine: EngineInfo) -> None:
    text = GOOD.replace("context = 4096", "context = 4096\nexpert_bytes = 2_000_000")
    text += '\n[flags]\nlookahead = 3\ndirect = false\npolicy = "lru"\nverify = true\n'
    text += 'measured = ["lookahead", "direct", "policy", "verify"]\n'
    (tmp_path / "s.toml").write_text(text)
    loaded = load_catalog(tmp_path).presets[0]
    assert loaded.flags == ()  # (spelled by the engine, once it has answered)
    catalog = bound(tmp_path, engine)
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
    assert p.measured_flags == ("lookahead", "direct", "policy", "verify")
    assert p.chat.temperature == 0.7 and p.chat.top_k == 0  # defaults when [chat] is absent


def test_presets_take_the_engines_defaults(engine: EngineInfo) -> None:
    """Defect 6: every preset pinned policy = "decay" and decay-tokens = 64 while the engine's default is history
    (it misses less: docs/results.md), and FLAG_DEFAULTS kept a copy of the engine's defaults. Now a preset sets
    nothing the engine defaults, and each shipped one passes the engine's own check of its flags."""
    assert engine.flags["--moe-stream-policy"].default == "history"
    for p in bound(PRESETS, engine).presets:
        assert not any(a.startswith(("--moe-stream-", "--lookahead")) for a in p.flags), p.id
        assert check_flags(p, engine) == [], p.id


def test_a_preset_is_checked_against_the_engines_flags(tmp_path: Path, engine: EngineInfo) -> None:
    def preset(flags: str) -> Preset:
        (tmp_path / "f.toml").write_text(GOOD + "\n[flags]\n" + flags)
        catalog = load_catalog(tmp_path)
        assert catalog.errors == (), catalog.errors
        return catalog.presets[0]

    # any choice the engine offers (decay and lru, where history is its default), measured for the model
    assert check_flags(preset('policy = "lru"\nmeasured = ["policy"]\n'), engine) == []
    assert check_flags(preset('policy = "decay"\nio-threads = 16\nmeasured = ["policy", "io-threads"]\n'), engine) == []
    problems = check_flags(
        preset(
            'policy = "history"\nio-threads = "many"\ndirect = 1\nturbo = 1\npolicy2 = "x"\n'
            'measured = ["policy", "io-threads", "direct", "turbo", "policy2"]\n'
        ),
        engine,
    )
    assert problems == [
        "f: flags.policy: 'history' is the engine's default for --moe-stream-policy: leave it out",
        "f: flags.io-threads: --moe-stream-io-threads takes a whole number",
        "f: flags.direct: --moe-stream-direct is on or off: true or false",
        "f: flags.turbo: the installed engine has no flag a preset sets as 'turbo'",
        "f: flags.policy2: the installed engine has no flag a preset sets as 'policy2'",
    ]
    # the choices named are the engine's own (they grow: `learned` came after this test), never a copy here
    (wrong,) = check_flags(preset('policy = "fifo"\nmeasured = ["policy"]\n'), engine)
    assert wrong.startswith("f: flags.policy: --moe-stream-policy is one of history, ")
    assert wrong.endswith("(got 'fifo')")


def test_missing_folder(tmp_path: Path) -> None:
    catalog = load_catalog(tmp_path / "nope")
    assert catalog.presets == () and len(catalog.errors) == 1 and "does not exist" in catalog.errors[0]


# The families new in issues 25, 27 and 42, by their presets.
NEW_FAMILIES = [
    "kimi-k3",
    "minimax-m2",
    "glm-5",
    "glm-5.2",
    "qwen3.8-flash-next",
    "deepseek-v4-flash",
    "ling-flash-2.0",
    "gemma-4-26b-a4b",
    "llama-4-scout",
    "llama-4-maverick",
    "hy3-preview",
    "mimo-v2-flash",
    "step-3.5-flash",
]


@pytest.mark.parametrize("preset_id", NEW_FAMILIES)
def test_will_it_run_here_for_the_new_families(engine: EngineInfo, preset_id: str) -> None:
    """ "Will it run here?" with the installed engine: it runs the preset's architecture (so the verdict is the
    machine's, not "unsupported"). Before the model's header is read the engine has not said its KV cache or its
    compute graph: the estimate counts the engine's own process (`process_bytes`) and says the rest is not
    counted yet, and a longer context changes nothing it claims to know."""
    from runmyai.engine.settings import DEFAULT_CONTEXT
    from runmyai.library.estimate import estimate, preset_footprint
    from runmyai.machine import MachineInfo

    p = bound(PRESETS, engine).get(preset_id)
    assert p is not None
    assert engine.runs(p.facts.arch), p.facts.arch
    gib = 1 << 30
    fp = preset_footprint(p)
    assert fp.kv_bytes_per_token == 0 and fp.graph_bytes == 0 and not fp.from_header
    ram = fp.resident_bytes + fp.expert_total_bytes // 2 + engine.headroom_bytes + engine.process_bytes  # half cached
    machine = MachineInfo(
        ram_total=ram + 16 * gib,
        ram_available=ram,
        ram_limit=None,
        cores=8,
        cpu_model="test",
        isa=("avx2",),
        gpus=(),
        disk_free=4000 * gib,
        drive_read_bps=3e9,
        mem_bandwidth_bps=40e9,
    )
    e = estimate(p, machine, engine)
    assert e.verdict in ("runs_well", "runs_slowly") and e.tokens_per_s > 0 and 0 < e.cache_share < 1
    assert e.cache_bytes == pytest.approx(fp.expert_total_bytes // 2, abs=1)
    assert any(r.startswith("Not counted yet: the KV cache and the compute buffers") for r in e.reasons), e.reasons
    longer = estimate(p, machine, engine, context=4 * DEFAULT_CONTEXT)
    assert longer.cache_bytes == e.cache_bytes
