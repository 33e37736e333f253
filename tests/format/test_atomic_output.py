"""fsutil.atomic_output when an interrupt lands just after the rename, before the block ends (the CLI-level tests
in tests/test_cli.py reach this step through the engine's test pause; here a replaced file is the point)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenwing import fsutil


@pytest.mark.parametrize("existed", [False, True], ids=["new file", "replacing one"])
def test_interrupt_just_after_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existed: bool) -> None:
    """A new output goes again (the command failed); one that replaced an older file stays, whole: removing it
    would lose the older one too (the usage table, a trace)."""
    path = tmp_path / "t.json"
    if existed:
        path.write_text('{"old": 1}')

    def interrupted_at(point: str) -> None:  # what interrupts.py raises at a pause when a signal comes there
        if point == "output.renamed":
            raise KeyboardInterrupt

    monkeypatch.setattr(fsutil, "pause", interrupted_at)
    with pytest.raises(KeyboardInterrupt):
        fsutil.write_json_atomic(str(path), {"new": 2})
    assert list(tmp_path.iterdir()) == ([path] if existed else [])
    if existed:
        assert json.loads(path.read_text()) == {"new": 2}
