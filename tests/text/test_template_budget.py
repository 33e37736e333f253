"""Issue 41: chat templates render within a budget — memory, time, output — enforced by the environment they run
in (a child process with a capped address space, killed past its time: text/render_worker.py), not by matching
operators. Each of the issue's template bombs is refused with one line, by a render run under a 2 GiB
address-space limit (so that a regression fails here instead of taking the machine), and the renderer renders
again after each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tests.format.header_fuzz import limited
from tests.format.test_hostile_header import run_limited
from tests.ggufs import with_metadata
from tokenwing.format.gguf_io import KV, read_header

ROOT = Path(__file__).resolve().parents[2]

BOMBS = {
    # `~` doubling a string: 4 GB in 10.6 s
    "tilde": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s|length }}",
    # a dict doubled through dict(ns.d, **{k: ns.d}), then tojson: 4 GB
    "dict": "{% set ns = namespace(d={'a': 1}) %}{% for i in range(60) %}"
    "{% set ns.d = dict(ns.d, **{'k' ~ i: ns.d}) %}{% endfor %}{{ ns.d|tojson|length }}",
    # range(10)|slice(100000000): 6.6 GB, past the client's 60 s
    "slice": "{{ range(10)|slice(100000000)|list|length }}",
    # repeated replace('a', 'aa'): 3.2 GB and a 2**31-character reply
    "replace": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s.replace('a', 'aa') %}"
    "{% endfor %}{{ ns.s|length }}",
    "ljust": "{{ 'a'.ljust(2000000000)|length }}",
    "zfill": "{{ '1'.zfill(2000000000)|length }}",
    "center": "{{ 'a'.center(2000000000)|length }}",
    "format": "{{ '{:>1999999999}'.format('a')|length }}",
    # no growth at all, only steps: 10**15 of them
    "steps": "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
    "{% endfor %}{% endfor %}{% endfor %}",
}

SCRIPT = """
import json, sys
from tokenwing.errors import BadInputError
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.render_worker import TemplateBudgetError
ok = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
out = {}
for name, source in json.loads(sys.argv[1]).items():
    try:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
        out[name] = "rendered"
    except TemplateBudgetError as e:
        out[name] = "budget: " + str(e)
    except BadInputError as e:
        out[name] = "refused: " + str(e)
    out[name + " then"] = ok.render([{"role": "user", "content": "still here"}])
print(json.dumps(out))
"""


def test_template_bombs_are_refused_within_the_budget() -> None:
    env = {**os.environ, "TOKENWING_TEST_RENDER_SECONDS": "3"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(BOMBS)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
        preexec_fn=limited(),  # (the limit holds before the child runs anything)
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    for name in BOMBS:
        assert out[name].startswith("budget: the chat template "), (name, out[name])
        assert "\n" not in out[name]
        assert out[name + " then"] == "still here"  # a fresh renderer took over
    assert "longer than its 3 s budget" in out["steps"]


def test_a_template_that_breaks_the_budget_is_refused_when_the_model_loads(
    model_factory: ModelFactory, tmp_path: Path
) -> None:
    """verify (and serve, with the same check before its handshake) refuse a model whose template goes over its
    budget for a one-message chat."""
    src = model_factory()
    kv = dict(read_header(str(src)).kv)
    kv["tokenizer.chat_template"] = KV.string(BOMBS["ljust"])
    bomb = with_metadata(src, tmp_path / "bomb.gguf", kv)
    r = run_cli("repack", str(bomb), "-o", str(tmp_path / "bomb.tw.gguf"), "-q")
    assert r.returncode == 0, r.stderr
    r = run_limited("verify", str(tmp_path / "bomb.tw.gguf"))
    assert_clean_error(r, 2)
    assert "the chat template took more than its 1024 MiB budget (rendering a one-message chat)" in r.stderr


@pytest.mark.parametrize("source", ["{{ messages[0].content * 3 }}", "{{ (messages|tojson) ~ '!' }}"])
def test_ordinary_templates_still_render(source: str) -> None:
    from tokenwing.text.chat import ChatTemplate

    out = ChatTemplate(source).render([{"role": "user", "content": "ab"}])
    assert out in ("ababab", '[{"role": "user", "content": "ab"}]!')
