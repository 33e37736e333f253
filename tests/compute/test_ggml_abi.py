"""The engine's ggml bindings (compute/ggml_api.py) against the headers of the ggml build they load.

Every declared function is compiled as a C prototype after ggml's own headers: C rejects a redeclaration whose
types differ ("conflicting types"), so a signature that changed upstream fails here. Every declared struct's size
and each field's offset and size, and every declared constant, are checked with static assertions. An upgrade of
ggml that changes any of them fails this test, not a user's run.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tokenwing.compute import ggml_api

ROOT = Path(__file__).resolve().parents[2]
HEADERS = ("ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpu.h")


def c_source(declarations: str) -> str:
    lines = ["#include <stddef.h>", *(f"#include <{h}>" for h in HEADERS), declarations]
    for struct, c_name in ggml_api.STRUCTS:
        lines.append(f'_Static_assert(sizeof({c_name}) == {ctypes.sizeof(struct)}, "sizeof {c_name}");')
        for field in struct._fields_:
            name = field[0]
            offset = getattr(struct, name).offset
            size = getattr(struct, name).size
            lines.append(f'_Static_assert(offsetof({c_name}, {name}) == {offset}, "{c_name}.{name} offset");')
            lines.append(f'_Static_assert(sizeof((({c_name} *)0)->{name}) == {size}, "{c_name}.{name} size");')
    for name, value in ggml_api.CONSTANTS.items():
        lines.append(f'_Static_assert({name} == {value}, "{name}");')
    return "\n".join(lines) + "\n"


def compile_c(source: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (./dev's set-up has one)"
    src = tmp_path / "abi.c"
    src.write_text(source)
    return subprocess.run(
        [cc, "-std=c11", "-fsyntax-only", "-Werror", "-I", str(ggml_api.HOME / "include"), str(src)],
        capture_output=True,
        text=True,
    )


def test_declarations_structs_and_constants_match_the_headers(tmp_path: Path) -> None:
    assert (ggml_api.HOME / "include" / "ggml.h").is_file(), "the ggml build installs its headers"
    r = compile_c(c_source(ggml_api.c_declarations()), tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert len(ggml_api.DECLARED) > 100


@pytest.mark.parametrize(
    ("declaration", "wrong"),
    [
        ("struct ggml_tensor * ggml_add(", "struct ggml_tensor * ggml_add(int, "),  # a parameter too many
        ("size_t ggml_nbytes(const struct ggml_tensor *)", "int64_t ggml_nbytes(const struct ggml_tensor *)"),
    ],
)
def test_a_changed_signature_fails_to_compile(tmp_path: Path, declaration: str, wrong: str) -> None:
    """The check itself: a declaration that no longer matches the header is an error."""
    decls = ggml_api.c_declarations()
    assert declaration in decls
    r = compile_c(c_source(decls.replace(declaration, wrong, 1)), tmp_path)
    assert r.returncode != 0 and "conflicting types" in r.stderr


def test_a_changed_layout_or_constant_fails_to_compile(tmp_path: Path) -> None:
    source = c_source(ggml_api.c_declarations())
    moved = source.replace("offsetof(struct ggml_tensor, data) == ", "offsetof(struct ggml_tensor, data) == 8 + ", 1)
    assert compile_c(moved, tmp_path).returncode != 0
    renumbered = source.replace("GGML_TYPE_Q4_K == 12", "GGML_TYPE_Q4_K == 13", 1)
    assert compile_c(renumbered, tmp_path).returncode != 0


def test_exactly_the_api_the_engine_uses_is_declared() -> None:
    """Each declared function is called somewhere in the engine or its tests and benchmarks (no dead declarations),
    and each ggml function they name is declared (or it would fail at its first call)."""
    used: set[str] = set()
    for path in [
        *(ROOT / "engine" / "tokenwing").rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "bench").rglob("*.py"),
    ]:
        if path.name in ("ggml_api.py", Path(__file__).name):
            continue
        used |= set(re.findall(r"\b(?:ops|ggml|ggml_api)\.(ggml_[a-z0-9_]+)\b", path.read_text()))
    api = ggml_api.__dict__
    declared = set(ggml_api.DECLARED)
    # (functions the bindings call themselves: loading backends, the log)
    internal = {"ggml_backend_load", "ggml_log_set"}
    structs = {name for name in used if isinstance(api.get(name), type)}  # ggml_init_params(...) and the like
    assert used - declared - structs == set(), "called but not declared"
    assert declared - used - internal == set(), "declared but never called"
    assert all(name in api for name in declared)


def test_no_other_module_loads_ggml() -> None:
    """ggml-python is gone, and nothing but the bindings opens a ggml library."""
    for folder in ("engine", "app", "tests", "bench", "installer"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"^\s*(import ggml\b|from ggml\b)", text, re.M), path
            if path.name not in ("ggml_api.py", Path(__file__).name):
                assert "CDLL(" not in text or "libggml" not in text, path


def test_the_cpu_backend_is_the_best_level_this_cpu_runs() -> None:
    variants = ggml_api.cpu_variants()
    assert {"x64", "haswell", "skylakex"} <= set(variants)  # every x86-64 level is in the one build
    scores = {name: ggml_api.score(path) for name, path in variants.items()}
    assert scores["x64"] > 0
    assert scores[ggml_api.CPU_VARIANT] == max(scores.values())


def test_the_demo_builds_the_level_the_all_levels_build_loads_here() -> None:
    """./dev demo builds one CPU level (engine/ggml/build.sh --cpu-level best): the one ggml's loader takes here from
    the all-levels build, by ggml's own score; build.sh --cpu-level names it."""
    r = subprocess.run(
        [str(ROOT / "engine" / "ggml" / "build.sh"), "--cpu-level"], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
    scores = {name: ggml_api.score(path) for name, path in ggml_api.cpu_variants().items()}
    assert r.stdout.strip() == max(scores, key=lambda n: scores[n])


def test_a_cpu_level_this_cpu_lacks_is_refused_in_one_line() -> None:
    variants = ggml_api.cpu_variants()
    with pytest.raises(ggml_api.GgmlMissing, match="is not one of"):
        ggml_api.choose_cpu_variant(variants, "pentium")
    name, why = ggml_api.choose_cpu_variant(variants, "x64")
    assert (name, why) == ("x64", f"{ggml_api.ENV_CPU}=x64")
