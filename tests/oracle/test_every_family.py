"""Every registered family (models.FAMILIES) against llama.cpp 0.3.36: the factory's default model of each, in F32,
a prompt then decode steps within 1e-4 of llama.cpp's logits (issue 42: every registered family passes the oracle).

Parametrized over the registry itself, so a family added to FAMILIES is checked here with no edit; a family the
factory cannot write, or llama.cpp cannot load, fails (the factory's or llama.cpp's error), never skips. Each
family's own test file checks its other geometries, its quantized types and its streaming; this one is the floor
every family stands on, kept cheap (the factory's default shape: 2 to 5 layers, 8 experts) for CI: 19 families in
13 s on this 2-core machine (46 s while it was loaded by 7).

The bar is test_families.f32_matches_llama_cpp's (max |diff| <= 1e-4, mean KL <= 1e-8) with its `rounding` allowance
(twice llama.cpp's own distance when only its batch changes), which only a graph rounding through ggml's F16 GELU
table needs (Gemma 4); every other family is within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_families import f32_matches_llama_cpp
from tokenwing.models import FAMILIES

pytestmark = pytest.mark.oracle

# A 48-token prompt then 48 decode steps: past the prompt, each step one position on its own graph, as served.
# (Fewer than the families' own 160: this runs for every family in CI; their files cross windows and blocks.)
POSITIONS = 96


@pytest.mark.parametrize("arch", FAMILIES)
def test_default_model_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, arch: str) -> None:
    f32_matches_llama_cpp(model_factory(arch=arch, type="F32"), tmp_path, POSITIONS, rounding=True)
