"""One owner of device memory in the VRAM tier (issue 46): only runtime/vram/source.py makes device graphs and graph
allocators, only runtime/vram/weights.py makes device tensors. Read with `ast`: a call of the class anywhere else
under engine/tokenwing/runtime/ is a second owner."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "engine" / "tokenwing" / "runtime"
OWNERS = {
    "DeviceGraph": "vram/source.py",
    "GraphAllocator": "vram/source.py",
    "DeviceTensors": "vram/weights.py",
}


def _makers(path: Path) -> set[str]:
    """The owned classes this file calls (by name or as an attribute: `backend.DeviceGraph(...)`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in OWNERS:
                out.add(name)
    return out


def test_only_source_makes_device_graphs_and_only_weights_makes_device_tensors() -> None:
    found = {str(p.relative_to(RUNTIME)): _makers(p) for p in sorted(RUNTIME.rglob("*.py"))}
    strays = [f"{f} makes {c}" for f, made in found.items() for c in sorted(made) if OWNERS[c] != f]
    assert not strays
    # (the owners really are found: a rename of the classes would leave this test passing on nothing)
    assert found["vram/source.py"] == {"DeviceGraph", "GraphAllocator"}
    assert found["vram/weights.py"] == {"DeviceTensors"}
