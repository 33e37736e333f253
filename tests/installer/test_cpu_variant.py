"""The frozen engine's choice of ggml CPU variant (installer/rthooks/pyi_rth_tokenwing_cpu.py), on made-up CPUs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

HOOK = Path(__file__).resolve().parents[2] / "installer" / "rthooks" / "pyi_rth_tokenwing_cpu.py"
HASWELL = frozenset(["fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"])
SKYLAKE_X = HASWELL | frozenset(["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"])
SANDY_BRIDGE = frozenset(["fpu", "sse4_2", "avx"])
BOTH = ["avx2", "avx512"]


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pyi_rth_tokenwing_cpu", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not frozen: only defines its functions
    return module


def test_best_variant_the_cpu_can_run(hook: ModuleType) -> None:
    assert hook.choose(BOTH, SKYLAKE_X, None)[0] == "avx512"
    assert hook.choose(BOTH, HASWELL, None)[0] == "avx2"
    assert hook.choose(["avx2"], SKYLAKE_X, None)[0] == "avx2"
    # AVX-512 F alone (Knights Landing lacks VL/DQ/BW) is not enough for the avx512 build
    assert hook.choose(BOTH, HASWELL | {"avx512f", "avx512cd"}, None)[0] == "avx2"


def test_override(hook: ModuleType) -> None:
    assert hook.choose(BOTH, SKYLAKE_X, "avx2") == ("avx2", "TOKENWING_CPU_VARIANT=avx2")
    variant, note = hook.choose(BOTH, HASWELL, "sse9")
    assert variant == "avx2" and "not one of" in note


def test_unknown_cpu_gets_the_portable_floor(hook: ModuleType) -> None:
    assert hook.choose(BOTH, None, None)[0] == "avx2"
    assert hook.choose(["generic"], None, None)[0] == "generic"


def test_cpu_without_avx2_is_refused_with_a_reason(hook: ModuleType) -> None:
    variant, note = hook.choose(BOTH, SANDY_BRIDGE, None)
    assert variant is None
    assert "avx2" in note and "bmi2" in note and "fma" in note


def test_reads_this_machines_flags(hook: ModuleType, tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma f16c bmi2\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert hook.cpu_flags(str(info)) == frozenset({"fpu", "avx", "avx2", "fma", "f16c", "bmi2"})
    assert hook.cpu_flags(str(tmp_path / "missing")) is None


def test_vulkan_twin_only_with_a_loader(hook: ModuleType) -> None:
    bundle = ["avx2", "avx512", "avx2-vulkan", "avx512-vulkan"]
    assert hook.with_vulkan("avx512", bundle, True, None) == ("avx512-vulkan", "with Vulkan")
    assert hook.with_vulkan("avx2", bundle, True, None)[0] == "avx2-vulkan"
    folder, note = hook.with_vulkan("avx512", bundle, False, None)
    assert folder == "avx512" and "libvulkan.so.1" in note
    assert hook.with_vulkan("avx512", bundle, True, "0") == ("avx512", "TOKENWING_VULKAN=0")
    assert hook.with_vulkan("avx512", BOTH, True, None)[0] == "avx512"  # a bundle without Vulkan builds
    # the CPU choice itself never lands on a Vulkan twin
    assert hook.choose(bundle, SKYLAKE_X, None)[0] == "avx512"


def test_vulkan_loader_is_looked_up_on_this_system(hook: ModuleType) -> None:
    import ctypes.util

    assert hook.vulkan_loader() == (ctypes.util.find_library("vulkan") is not None)
