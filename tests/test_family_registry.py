"""One family list (issue 42 item 1): `models.FAMILIES`. The lists that used to be kept by hand derive from it, and
nothing names a family the registry does not hold."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tokenwing.commands.testmodel import arch_help, preset_help
from tokenwing.format import layout as L
from tokenwing.models import FAMILIES, supported_architectures
from tokenwing.testmodel.architectures import ARCHITECTURES
from tokenwing.testmodel.shapes import FAMILY_PRESETS, PRESETS, preset_shape

REPO = Path(__file__).resolve().parents[1]
PRESET_FILES = sorted((REPO / "presets").glob("*.toml"))


def test_the_presets_are_found() -> None:
    assert len(PRESET_FILES) >= 10  # (the folder moved: the next test would pass on nothing)


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.stem)
def test_every_app_preset_names_a_registered_family(path: Path) -> None:
    arch = tomllib.loads(path.read_text(encoding="utf-8"))["arch"]["arch"]
    assert arch in FAMILIES, f"{path.name}: {arch!r} is not in models.FAMILIES"


@pytest.mark.parametrize("name", [*PRESETS, *FAMILY_PRESETS])
def test_every_factory_preset_names_a_registered_family(name: str) -> None:
    assert preset_shape(name).arch in FAMILIES


def test_the_factory_makes_every_registered_family_and_no_other() -> None:
    assert set(ARCHITECTURES) == set(FAMILIES)


def test_the_lists_derive_from_the_registry() -> None:
    assert supported_architectures() == sorted(FAMILIES)  # info --json's architectures
    names = arch_help().replace(" (the default)", "").replace(" or ", ", ").split(", ")
    assert sorted(names) == sorted(FAMILIES)
    assert all(f"{name} ({shape.arch})" in preset_help() for name, shape in FAMILY_PRESETS.items())
    assert preset_help().startswith(", ".join(PRESETS) + " (any architecture); ")
    # repack lays out every registered family and the other llama.cpp MoE architectures; no family twice
    assert not L.OTHER_MOE_ARCHS & set(FAMILIES)


def test_testmodel_help_lists_every_family_and_preset() -> None:
    r = run_cli("testmodel", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split()).replace("- ", "-")  # (argparse wraps the lines, after a hyphen too)
    assert all(arch in text for arch in FAMILIES)
    assert all(name in text for name in FAMILY_PRESETS)


def test_the_app_holds_no_architecture_names() -> None:
    """Which architectures run is the engine's answer (`tokenwing info --json`, app/runmyai/engine/info.py): the
    app's code names none of them."""
    found = []
    for f in sorted((REPO / "app" / "runmyai").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in FAMILIES:
                found.append(f"{f.relative_to(REPO)}:{node.lineno}: {node.value}")
    assert not found
