"""No Python file over 800 lines (issue 46: each job one room): a file that long holds several jobs, as
`ui/controller.py` did at 2,028 lines (settings, presets, library, downloads, engine, autotune, chats, MCP, the
server page). Tests count too. Left out, as the issue leaves them: the generated test models (`testmodel/`) and a
family's own file in `models/` (one architecture's whole graph: a module defining a registered family);
the shared pieces beside them in `models/` count."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tokenwing.models import FAMILIES

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 800
# a family's own file: a module that defines a registered family (not the shared pieces beside them in models/:
# common.py, attention.py, routing.py, specs.py, hparams.py, mla.py, …)
FAMILY_FILES = {Path("engine", *cls.__module__.split(".")).with_suffix(".py") for cls in FAMILIES.values()}
# over the bar still, to be split (then taken out of here: the test fails while one listed is back under it)
STILL_OVER: set[str] = set()  # (compute/ggml_api.py was, 806 lines at 8630939: 763 with RoPE's arguments shared)


def _counted(path: Path) -> bool:
    if Path("engine/tokenwing/testmodel") in path.parents:
        return False
    return path not in FAMILY_FILES


def test_no_python_file_is_over_800_lines() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = [Path(f) for f in listed if _counted(Path(f)) and (REPO / f).is_file()]
    assert Path("app/runmyai/ui/controller.py") in files  # (the tree was found)
    long = {str(f): n for f in files if (n := len((REPO / f).read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert set(long) == STILL_OVER, f"over {MAX_LINES} lines: {long}; listed as still over: {sorted(STILL_OVER)}"
