"""A family's factory entry comes from its own file (issue 42 item 1): each registered family declares
`MoEModel.factory` in its own class (its key writer, tensor list and shape checks), and the factory's generic code
(testmodel/) names no family, so that adding one touches no file of the factory but its shape."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from tokenwing.format import layout as L
from tokenwing.models import FAMILIES
from tokenwing.testmodel.architectures import architecture, tensor_specs
from tokenwing.testmodel.shapes import preset_shape

REPO = Path(__file__).resolve().parents[2]
GENERIC = ["architectures.py", "writer.py", "weights.py", "kquant.py", "oracle.py"]  # (testmodel/: no family's)
FAMILY_MODULES = {cls.__module__ for cls in FAMILIES.values()}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_family_declares_its_own_factory_entry(arch: str) -> None:
    cls = FAMILIES[arch]
    # (a subclass inheriting its parent's entry would write the parent's keys under its own name)
    assert "factory" in vars(cls), f"{cls.__name__} declares no factory entry of its own"
    entry = cls.factory
    for fn in (entry.metadata, entry.check, entry.tensors):
        if fn is not None:
            assert fn.__module__.startswith("tokenwing.models."), f"{arch}: {fn} is not in models/"
    # the keys it writes are its own architecture's
    meta = architecture(arch).metadata(preset_shape("tiny", arch))
    assert meta and all(k.startswith(f"{arch}.") for k in meta)


@pytest.mark.parametrize("name", GENERIC)
def test_the_generic_factory_names_no_family(name: str) -> None:
    path = REPO / "engine" / "tokenwing" / "testmodel" / name
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and node.value in FAMILIES:
            found.append(f"{name}:{node.lineno}: {node.value!r}")
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            found += [f"{name}:{node.lineno}: imports {m}" for m in sorted(modules & FAMILY_MODULES)]
    assert not found, "the generic factory names a family: " + "; ".join(found)


def test_the_rule_reads_the_modules_it_should() -> None:
    assert "tokenwing.models.qwen3next" in FAMILY_MODULES and len(FAMILY_MODULES) >= 15
    assert all((REPO / "engine" / "tokenwing" / "testmodel" / n).is_file() for n in GENERIC)
    assert inspect.getsourcefile(FAMILIES["llama4"].factory.metadata) == inspect.getsourcefile(FAMILIES["llama4"])


# every family's default model, and its fused gate_up form where it has one (its entry takes the field)
LAYOUTS = [(a, False) for a in sorted(FAMILIES)]
LAYOUTS += [(a, True) for a in sorted(FAMILIES) if "fused_gate_up" in FAMILIES[a].factory.takes]


@pytest.mark.parametrize(("arch", "fused"), LAYOUTS)
def test_the_layout_streams_the_tensors_the_family_lists_as_experts(arch: str, fused: bool) -> None:
    """format/layout.py sits below models/ (it cannot read a family's list): it finds routed experts by llama.cpp's
    names, for the other MoE architectures too. For every family it must pick exactly what the list marks
    "expert" (streamed), no router, shared expert or latent projection among them."""
    listed = tensor_specs(preset_shape("tiny", arch).with_(fused_gate_up=fused))
    experts = {t.name for t in listed if t.role == "expert"}
    picked = {t.name for t in listed if L._EXPERT_RE.match(t.name) or L._MERGED_RE.match(t.name)}
    assert experts and picked == experts
    assert not fused or any("gate_up_exps" in name for name in experts)
