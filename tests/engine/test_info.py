"""`tokenwing info --json` is the one home of the engine facts a program that runs the engine needs: its flags with
their defaults and choices, the headroom it keeps in RAM and on a device, its exit codes, and a model's KV cache
per token. Each is read from where the engine itself keeps it, so it cannot drift from what the engine does."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tokenwing import errors
from tokenwing.compute import ggml_api
from tokenwing.compute.devices import headroom
from tokenwing.format.inspect import inspect_model
from tokenwing.info import engine_flags, model_facts
from tokenwing.runtime import session as session_module
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.streaming.memory import MemoryInfo
from tokenwing.streaming.settings import DECAY_TOKENS, StreamSettings


def test_info_reports_flags_headroom_exit_codes_and_the_models_kv_cache(repacked_factory: ModelFactory) -> None:
    model = repacked_factory(arch="qwen3next", type="F16", n_layer=8)
    r = run_cli("info", "--json", str(model))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    # every streaming setting with the default the engine runs with (history: it misses less than decay)
    flags = info["flags"]
    for f in dataclasses.fields(StreamSettings):
        assert flags["--moe-stream-" + f.name.replace("_", "-")]["default"] == f.default
    assert flags["--moe-stream-policy"] == {**flags["--moe-stream-policy"], "kind": "choice", "default": "history"}
    assert set(flags["--moe-stream-policy"]["choices"]) == {"history", "learned", "decay", "lru"}
    assert flags["--moe-stream-direct"]["kind"] == "bool" and flags["--lookahead"]["kind"] == "int"
    assert flags["--kv-type"]["default"] == "f16"
    assert info["decay_tokens_by_policy"] == DECAY_TOKENS
    # the device headroom rule gives what the engine keeps free
    rule = info["device_headroom"]
    for total in (2 << 30, 8 << 30, 24 << 30, 141 << 30):
        assert min(rule["max_bytes"], max(rule["min_bytes"], total // rule["divisor"])) == headroom(total)
    assert info["permanent_exit_kinds"] == ["bad_input", "corrupt_model", "unsupported"]  # (a full disk may pass)
    assert info["exit_codes"] == {
        "error": 1,
        "bad_input": 2,
        "corrupt_model": 3,
        "unsupported": 4,
        "no_disk_space": 5,
    }
    m = info["model"]
    assert m["architecture"] == "qwen3next" and m["kv_type"] == "f16"
    assert m["kv_bytes_per_token"] == inspect_model([str(model)])["kv_bytes_per_token"] > 0
    assert m["kv_bytes_per_token_by_type"] == {"f16": m["kv_bytes_per_token"], "f32": 2 * m["kv_bytes_per_token"]}
    assert m["parallel_auto"]["slots"] >= 1 and m["parallel_auto"]["context"] > 0
    # the line without --json says it too
    text = run_cli("info", str(model))
    assert text.returncode == 0 and "KV cache" in text.stdout and "per token" in text.stdout
    assert "serve --parallel auto:" in text.stdout


def test_info_gives_the_slots_a_server_would_keep(
    repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tokenwing info MODEL`'s `parallel_auto` is what a session opened with `--parallel auto` keeps under the same
    memory, computed before any weight is loaded: its slots, each one's context, and what a slot takes (a
    linear-attention model: its recurrent states and their checkpoints beside the KV cache)."""
    model = repacked_factory(arch="qwen3next", type="F16", n_layer=8, context_length=262144)
    facts = model_facts(str(model), MemoryInfo(64 << 30, 64 << 30, 64 << 30, 0))
    roomy, kv = facts["parallel_auto"], facts["kv_bytes_per_token"]
    one = roomy["bytes_per_slot"]
    assert roomy["slots"] == 4 and roomy["context"] == 262144
    assert one > kv * roomy["context"]  # the states count
    # memory whose 16th holds one more slot (its KV cache and states) and falls 16 bytes short of two, then holds
    # two exactly: two slots, then three, in the session as in `info` (a rule that counted less or more than a
    # slot takes would disagree with the session on one side of the line)
    for usable, slots in ((16 * 2 * one - 16, 2), (16 * 2 * one, 3)):
        mem = MemoryInfo(usable, usable, usable, 0)
        facts = model_facts(str(model), mem)["parallel_auto"]
        assert (facts["slots"], facts["context"]) == (slots, 262144)
        monkeypatch.setattr(session_module, "memory_info", lambda mem=mem: mem)
        s = Session(str(model), SessionOptions(parallel=0), log=lambda line: None)
        try:
            assert (len(s.seqs), s.n_ctx) == (facts["slots"], facts["context"])
            assert s.model.weights.bytes == facts["resident_weights_bytes"]
        finally:
            s.close()


def test_exit_codes_are_the_error_classes_and_one_kind_each() -> None:
    codes = errors.exit_codes()
    assert codes["no_disk_space"] == errors.DiskSpaceError.exit_code
    assert codes["unsupported"] == errors.UnsupportedError.exit_code
    assert len(set(codes.values())) == len(codes)


def test_flags_without_a_model_and_a_model_that_is_not_one(tmp_path: Path) -> None:
    budget = engine_flags()["--ram-budget"]
    assert budget["default"] is None and budget["kind"] == "str"  # None: the engine sizes it at start
    assert "25%" in budget["help"]  # (argparse's %% unescaped)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    assert_clean_error(run_cli("info", "--json", str(junk)), 2)


def test_info_names_its_ggml_the_cpu_backend_it_loaded_and_the_backends() -> None:
    """Which ggml runs is an engine fact (issue 46): the build's version and source, the CPU level it loaded and
    why (TOKENWING_CPU_VARIANT picks one: the lowest, which every x86-64 CPU runs), the GPU backends built and
    whether each loaded (TOKENWING_VULKAN=0 keeps Vulkan's unloaded)."""
    built = ggml_api.build_info()
    env = {**os.environ, ggml_api.ENV_CPU: "x64", ggml_api.ENV_VULKAN: "0"}
    r = subprocess.run(
        [sys.executable, "-m", "tokenwing", "info", "--json"], capture_output=True, text=True, env=env, check=False
    )
    assert r.returncode == 0, r.stderr
    g = json.loads(r.stdout)["ggml"]
    assert g["version"] == built["ggml"] and g["source"] == built["source"]
    assert g["cpu_variant"] == "x64" and ggml_api.ENV_CPU in g["cpu_variant_why"]
    assert set(g["cpu_variants"]) == set(ggml_api.cpu_variants()) and "x64" in g["cpu_variants"]
    assert set(g["backends"]) == {"cpu", *ggml_api.available_gpu_backends()} and g["backends"]["cpu"] is True
    if "vulkan" in g["backends"]:
        assert g["backends"]["vulkan"] is False  # built, not loaded: the line says so
    text = subprocess.run(
        [sys.executable, "-m", "tokenwing", "info"], capture_output=True, text=True, env=env, check=False
    ).stdout
    assert f"ggml {built['ggml']} ({built['source']})" in text
    assert "CPU backend: x64 (TOKENWING_CPU_VARIANT=x64)" in text
    # left to choose, it loads the level ggml's own scores rank first on this CPU
    auto = json.loads(run_cli("info", "--json").stdout)["ggml"]
    variants = ggml_api.cpu_variants()
    assert auto["cpu_variant"] == max(variants, key=lambda n: ggml_api.score(variants[n]))
