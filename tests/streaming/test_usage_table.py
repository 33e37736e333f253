"""The usage table next to the model: written by the engine, read back for idle fill, parsed defensively."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import ModelFactory
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.streaming.usage import UsageTable, load_usage, usage_path


def _session(model: Path, **kw: object) -> Session:
    opts = SessionOptions(n_ctx=256, ram_budget=1, **kw)  # type: ignore[arg-type]
    return Session(str(model), opts, log=lambda line: None)


def test_counts_are_saved_merged_and_seed_idle_fill(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    model = tmp_path / "m.tw.gguf"
    model.write_bytes(repacked_factory(type="Q8_0", n_expert=16, n_expert_used=2).read_bytes())
    s = _session(model)
    s.forward(list(range(40)))
    s.close()
    data = json.loads(Path(usage_path(str(model))).read_text())
    assert data["tokens"] == 40
    counts = data["layers"]
    assert all(sum(row) == 40 * 2 for row in counts.values())  # every token chose k=2 experts per layer

    s = _session(model)  # a second run adds to the table
    s.forward(list(range(10)))
    s.close()
    assert json.loads(Path(usage_path(str(model))).read_text())["tokens"] == 50

    # a fresh engine, idle: empty slots fill with the most used experts, evicting nothing
    s = _session(model, stream=_fast_idle())
    try:
        layer = s.streamed[0]
        table = load_usage(usage_path(str(model)), s.streamed, s.hp.n_expert, s.scheduler.usage.model_checksum, print)
        assert table is not None
        top = table.ranked(0)[: s.slots_per_layer]
        deadline = time.monotonic() + 120  # a hang guard: the fill comes after 50 ms without requests
        while not all(s.scheduler.holds(layer, top)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(s.scheduler.holds(layer, top))
    finally:
        s.close()


def _fast_idle():  # type: ignore[no-untyped-def]
    from tokenwing.streaming.settings import StreamSettings

    return StreamSettings(idle_fill_ms=50)


def test_without_the_table_nothing_is_written(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    model = tmp_path / "m.tw.gguf"
    model.write_bytes(repacked_factory(type="Q8_0").read_bytes())
    s = _session(model, usage_table=False)
    s.forward([1, 2, 3])
    s.close()
    assert not Path(usage_path(str(model))).exists()


@pytest.mark.parametrize(
    "content, reason",
    [
        ("{not json", "Expecting"),
        ('{"format": "other"}', "not a TokenWing usage table"),
        ('{"format": "tokenwing-usage", "version": 9}', "unknown version"),
        (
            '{"format": "tokenwing-usage", "version": 1, "model_checksum": 1, "tokens": 0, "layers": {}}',
            "another model",
        ),
        ('{"format": "tokenwing-usage", "version": 1, "model_checksum": 7, "tokens": -1, "layers": {}}', "malformed"),
        (
            '{"format": "tokenwing-usage", "version": 1, "model_checksum": 7, "tokens": 1, "layers": {"0": [1]}}',
            "wrong number",
        ),
        (
            '{"format": "tokenwing-usage", "version": 1, "model_checksum": 7, "tokens": 1, "layers": {"0": [1, -2]}}',
            "non-negative",
        ),
        (
            '{"format": "tokenwing-usage", "version": 1, "model_checksum": 7, "tokens": 1, "layers": {"0": [1, "x"]}}',
            "non-negative",
        ),
    ],
)
def test_bad_tables_are_ignored_with_one_line(tmp_path: Path, content: str, reason: str) -> None:
    path = tmp_path / "m.usage.json"
    path.write_text(content)
    lines: list[str] = []
    assert load_usage(str(path), [0], 2, 7, lines.append) is None
    assert len(lines) == 1 and reason in lines[0], lines


def test_ranking_and_halving() -> None:
    t = UsageTable([3], 4, 7)
    t.counts[0] = [2, 0, 5, 2]
    assert t.ranked(0) == [2, 0, 3]  # unused experts are not listed; ties go to the lower id
    old = UsageTable([3], 4, 7)
    old.counts[0] = [4, 4, 4, 4]
    old.tokens = (1 << 20) + 2
    merged = t.merge_into(old)
    assert list(merged.counts[0]) == [4, 2, 7, 4] and merged.tokens == (1 << 19) + 1
