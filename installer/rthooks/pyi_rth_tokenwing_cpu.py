"""PyInstaller runtime hook of the frozen `tokenwing` engine: picks the ggml CPU variant before anything imports ggml.

The bundle carries ggml built for several x86-64 levels, each a complete `ggml` package (its Python module and
libggml, libggml-base, libggml-cpu) under `_internal/ggml-cpu/VARIANT/ggml/`. `ggml` itself is not frozen into the
executable's archive: this hook puts exactly one variant's folder first on sys.path, so ggml's own loader opens
that folder's libraries and no other libggml-cpu is ever loaded (glibc would map a second copy under another path).

`TOKENWING_CPU_VARIANT=avx2|avx512` overrides the choice (tests run the portable variant on any machine with it).
Dev mode (not frozen) never runs this file: the installed ggml-python package is used as it is.

Each CPU variant may have a Vulkan twin, `VARIANT-vulkan` (the same CPU code plus ggml's Vulkan backend). It needs
the Vulkan loader, `libvulkan.so.1`, from the user's system (the bundle does not carry one: the GPU's driver
comes with the system's); without it importing that ggml fails, so the twin is taken only when the loader opens.
A loader without a working driver is fine: the engine then finds no Vulkan device and computes on the CPU.
`TOKENWING_VULKAN=0` keeps the CPU-only variant (a loader that misbehaves).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

ENV = "TOKENWING_CPU_VARIANT"
VULKAN_ENV = "TOKENWING_VULKAN"
VULKAN = "-vulkan"
# Best first; each with the CPU flags (as /proc/cpuinfo names them) its code may execute.
_AVX2 = frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})
NEEDS: dict[str, frozenset[str]] = {
    "avx512": _AVX2 | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"},
    "avx2": _AVX2,
    "generic": frozenset(),  # a single build for the platform (the Windows and macOS recipes), chosen by its flags
}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first CPU's flags, or None where they cannot be read (not Linux)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        return None
    return None


def choose(available: Iterable[str], flags: frozenset[str] | None, override: str | None) -> tuple[str | None, str]:
    """(variant, note): the variant to load (None: this CPU can run none of them) and a line saying why."""
    have = [v for v in NEEDS if v in set(available)]  # best first
    if not have:
        return None, "this bundle holds no ggml CPU variant"
    if override:
        if override in have:
            return override, f"{ENV}={override}"
        note = f"{ENV}={override} is not one of {', '.join(have)}; choosing by CPU"
    else:
        note = "by CPU"
    if flags is None:  # unknown CPU (not Linux): the portable floor
        return have[-1], f"{note}: CPU flags unknown, using {have[-1]}"
    for v in have:
        if NEEDS[v] <= flags:
            return v, f"{note}: {v}"
    missing = sorted(NEEDS[have[-1]] - flags)
    return None, f"this CPU lacks {', '.join(missing)}, which TokenWing needs (an x86-64 CPU with AVX2 or later)"


def vulkan_loader() -> bool:
    """Whether the system's Vulkan loader opens (it stays loaded: ggml would load it next anyway)."""
    import ctypes

    try:
        ctypes.CDLL("libvulkan.so.1")
    except OSError:
        return False
    return True


def with_vulkan(variant: str, available: Iterable[str], loader: bool, setting: str | None) -> tuple[str, str]:
    """(folder, note): the CPU variant's Vulkan twin where it is in the bundle, the loader opens and the user did
    not turn it off, else the CPU variant itself."""
    if variant + VULKAN not in set(available):
        return variant, "no Vulkan build in this bundle"
    if setting == "0":
        return variant, f"{VULKAN_ENV}=0"
    if not loader:
        return variant, "no Vulkan loader (libvulkan.so.1) on this system: CPU only"
    return variant + VULKAN, "with Vulkan"


def _install() -> None:
    root = os.path.join(getattr(sys, "_MEIPASS", os.path.dirname(sys.executable)), "ggml-cpu")
    available = os.listdir(root) if os.path.isdir(root) else []
    cpu_only = [v for v in available if not v.endswith(VULKAN)]
    variant, note = choose(cpu_only, cpu_flags(), os.environ.get(ENV, "").strip().lower() or None)
    if variant is None:
        sys.stderr.write(f"tokenwing: error: {note}\n")
        raise SystemExit(4)  # unsupported
    setting = os.environ.get(VULKAN_ENV, "").strip() or None
    folder, _ = with_vulkan(variant, available, setting != "0" and vulkan_loader(), setting)
    sys.path.insert(0, os.path.join(root, folder))


if getattr(sys, "frozen", False):
    _install()
