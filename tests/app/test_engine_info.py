"""The app asks the installed engine what it runs (`tokenwing info --json`), caches it per version, and the
library's "supported / not supported yet" follows that answer, not a copy kept in the app."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from runmyai import __version__
from runmyai.engine.info import EngineInfo, ask_engine, cache_path, parse_info
from runmyai.engine.stats import LAYER_FIELDS, TOKEN_FIELDS
from runmyai.library.keys import HubKey, LocalKey, PresetKey, parse_key, parse_model_ref
from runmyai.machine import probe_machine
from runmyai.ui import render
from tests.app.engine_facts import sized_catalog


def test_the_engine_says_what_it_runs_and_it_is_cached(tmp_path: Path) -> None:
    from tokenwing.models import supported_architectures
    from tokenwing.runtime.vram.experts import SWAP_EVERY, SWAP_MAX
    from tokenwing.streaming.memory import HEADROOM

    info = asyncio.run(ask_engine(tmp_path))
    assert info.known and info.version == __version__
    assert set(info.architectures) == set(supported_architectures())  # glm4moe included: the engine runs it
    assert "glm4moe" in info.architectures and "Q8_0" in info.architectures["glm4moe"]
    assert info.headroom_bytes == HEADROOM  # one number, the engine's
    assert info.swaps_per_token_max == SWAP_MAX / SWAP_EVERY  # the estimate's bound on VRAM swaps, the engine's
    assert json.loads(cache_path(tmp_path).read_text())["version"] == __version__
    # which refusals are for good is the engine's word too (a download that fails so is not resumed)
    assert info.permanent_kinds == {"bad_input", "corrupt_model", "unsupported"}
    assert info.permanent(info.exit_codes["corrupt_model"]) and not info.permanent(info.exit_codes["no_disk_space"])
    assert not info.permanent(None) and not info.permanent(1)
    # every field the stats client reads is one the engine says it sends (a renamed field fails here, not in a graph)
    assert set(TOKEN_FIELDS) <= set(info.stats_fields["token"]) and "layers" in TOKEN_FIELDS
    assert set(LAYER_FIELDS) <= set(info.stats_fields["layer"]) and "hits" in LAYER_FIELDS
    # cached per version: a broken engine command is not even run
    broken = [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert asyncio.run(ask_engine(tmp_path, broken)) == info
    # asked again, a broken engine is an unknown engine with the reason, never an exception
    again = asyncio.run(ask_engine(tmp_path, broken, refresh=True))
    assert not again.known and again.architectures == {} and "exit code 3" in (again.error or "")
    missing = asyncio.run(ask_engine(tmp_path / "x", [str(tmp_path / "no-such-tokenwing")]))
    assert not missing.known and "could not be started" in (missing.error or "")


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"version": 1},
        {"version": "1", "architectures": {}},
        {"version": "1", "architectures": {}, "headroom_bytes": -1},
    ],
)
def test_garbage_is_not_engine_info(raw: object) -> None:
    with pytest.raises(ValueError):
        parse_info(raw)


def test_what_is_permanent_follows_the_engines_word(tmp_path: Path) -> None:
    """A kind the engine calls permanent is, one it does not is not: the app keeps no list of its own. A cached
    answer from before the engine said so is asked again."""
    base = {"version": "1", "architectures": {}, "headroom_bytes": 0, "exit_codes": {"bad_input": 2, "odd": 9}}
    said = parse_info({**base, "permanent_exit_kinds": ["odd", 7]})
    assert said.permanent(9) and not said.permanent(2) and said.permanent_kinds == {"odd"}
    assert not parse_info(base).permanent(2)  # an engine that does not say: nothing is taken as for good
    asyncio.run(ask_engine(tmp_path))
    old = json.loads(cache_path(tmp_path).read_text())
    del old["permanent_exit_kinds"]
    cache_path(tmp_path).write_text(json.dumps(old))
    assert asyncio.run(ask_engine(tmp_path)).permanent_kinds  # asked again, not read from the old answer
    assert "permanent_exit_kinds" in json.loads(cache_path(tmp_path).read_text())  # and cached anew


def test_a_swap_rule_that_cannot_be_read_is_none() -> None:
    base = {"version": "1", "architectures": {}, "headroom_bytes": 0}
    assert parse_info({**base, "vram_swaps": {"every_tokens": 8, "max_experts": 64}}).swaps_per_token_max == 8.0
    for bad in (None, [], {"every_tokens": 0, "max_experts": 64}, {"every_tokens": True, "max_experts": 64}):
        assert parse_info({**base, "vram_swaps": bad}).swaps_per_token_max is None  # older engine or garbage


def test_catalog_support_follows_the_engine(tmp_path: Path) -> None:
    catalog = sized_catalog()
    machine = probe_machine(tmp_path)
    glm = catalog.get("glm-4.5-air")
    deepseek = catalog.get("deepseek-v3.1")
    assert glm is not None and deepseek is not None
    runs_glm = EngineInfo("x", {"glm4moe": ("Q4_K",)}, 0, ())
    view = render.View(machine, runs_glm)
    assert render.preset_entry(glm, view).badge != "not supported yet"
    assert render.preset_entry(deepseek, view).badge == "not supported yet"
    assert "cannot run the deepseek2 architecture yet" in render.preset_entry(deepseek, view).details_html
    # an engine that gains deepseek2 makes it supported, with no change to the app
    view = render.View(machine, EngineInfo("x", {"deepseek2": ("Q4_K",)}, 0, ()))
    assert render.preset_entry(deepseek, view).badge != "not supported yet"


def test_keys_round_trip() -> None:
    for key in (LocalKey(Path("/m/a b.tw.gguf")), PresetKey("qwen3-30b-a3b"), HubKey("a/b"), HubKey("a/b", "Q4_K_M")):
        assert parse_key(str(key)) == key
    assert parse_key("hub:not-a-repo") is None and parse_key("nonsense") is None and parse_key("local:") is None
    assert parse_model_ref("unsloth/Qwen3-30B-A3B-GGUF:UD-Q4_K_XL") == HubKey(
        "unsloth/Qwen3-30B-A3B-GGUF", "UD-Q4_K_XL"
    )
    with pytest.raises(ValueError, match="not a repository"):
        parse_model_ref("just-a-name")
