"""The app asks, the engine answers (issue 46 item 4): no preset and no app source holds a number or rule the engine
gives (`tokenwing info --json`, `inspect --json`). The app's sources are read with `ast` (comments and docstrings
may name the engine's facts; code may not hold them) and the presets with `tomllib`."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runmyai.paths import bundled_dir
from tests.app.engine_facts import installed_engine

APP = Path(__file__).resolve().parents[2] / "app" / "runmyai"
PRESETS = bundled_dir("presets")

# Copies the app once kept (issue 46's list), by the names they had: a quant's bits, the file's alignment, the
# expert-size and quant-class rules, the engine's reserve, the cgroup reader, the flag prefix rule, the permanent
# exit kinds and the stats stream's fields.
COPIES = {
    "QUANT_BITS",
    "_XL_CLASS",
    "quant_class",
    "ALIGN",
    "ENGINE_RESERVE",
    "ram_info",
    "cgroup_memory_limit",
    "_read_limit",
    "_NO_LIMIT",
    "flag_name",
    "_PLAIN_FLAGS",
    "PERMANENT_ENGINE_KINDS",
    "_KNOWN",
}
# What the engine's memory reader reads: the app asks the engine instead of reading these itself.
MEMORY_FILES = ("meminfo", "memory.max", "memory.current", "memory.limit_in_bytes", "memory.usage_in_bytes")
# A preset key whose number the engine gives from the model's header.
HEADER_KEYS = {"kv_bytes_per_token", "graph_reserve", "graph_bytes"}


def app_sources() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(APP.rglob("*.py")):
        yield str(path.relative_to(APP)), ast.parse(path.read_text(encoding="utf-8"))


def defined_names(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        yield n.id


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants (a module's, a class's, a function's): prose, not code."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def code_constants(tree: ast.Module) -> Iterator[object]:
    prose = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in prose:
            yield node.value


def keys(table: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(table, dict):
        for k, v in table.items():
            yield prefix + k
            yield from keys(v, prefix + k + ".")


def engine_numbers() -> set[float]:
    """The engine's published numbers that could only be copies if found in the app: a quant's bits per weight
    with a fraction no other number of the app has by chance (6.5625, 4.84375, …: more than one decimal place)."""
    return {b for b in installed_engine().quant_bits.values() if round(b, 1) != b}


def test_no_app_source_holds_a_copy_of_an_engine_fact() -> None:
    numbers = engine_numbers()
    assert 6.5625 in numbers and any(abs(n - 4.84375) < 1e-9 for n in numbers)  # (the engine does say them)
    found: list[str] = []
    for name, tree in app_sources():
        found += [f"{name}: defines {n}" for n in set(defined_names(tree)) & COPIES]
        for value in code_constants(tree):
            if isinstance(value, float) and any(abs(value - n) < 1e-9 for n in numbers):
                found.append(f"{name}: the engine's number {value}")
            elif isinstance(value, str) and value.startswith("--moe-stream"):
                found.append(f"{name}: spells the engine's flags itself ({value!r})")
            elif isinstance(value, str) and value.endswith(MEMORY_FILES):
                found.append(f"{name}: reads {value!r}, as the engine's memory reader does")
    assert found == []


def test_no_preset_holds_a_number_the_engine_gives() -> None:
    found: list[str] = []
    presets = sorted(PRESETS.glob("*.toml"))
    assert len(presets) >= 19
    for path in presets:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        found += [f"{path.name}: {k}" for k in keys(data) if k.rsplit(".", 1)[-1] in HEADER_KEYS]
    assert found == []
