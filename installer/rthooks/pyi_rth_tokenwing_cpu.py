"""PyInstaller runtime hook of the frozen `tokenwing` engine: picks the ggml CPU variant before anything imports ggml.

The bundle carries ggml built for several x86-64 levels, each a complete `ggml` package (its Python module and
libggml, libggml-base, libggml-cpu) under `_internal/ggml-cpu/VARIANT/ggml/`. `ggml` itself is not frozen into the
executable's archive: this hook puts exactly one variant's folder first on sys.path, so ggml's own loader opens
that folder's libraries and no other libggml-cpu is ever loaded (glibc would map a second copy under another path).

`TOKENWING_CPU_VARIANT=avx2|avx512` overrides the choice (tests run the portable variant on any machine with it).
Dev mode (not frozen) never runs this file: the installed ggml-python package is used as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

ENV = "TOKENWING_CPU_VARIANT"
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


def _install() -> None:
    root = os.path.join(getattr(sys, "_MEIPASS", os.path.dirname(sys.executable)), "ggml-cpu")
    available = os.listdir(root) if os.path.isdir(root) else []
    variant, note = choose(available, cpu_flags(), os.environ.get(ENV, "").strip().lower() or None)
    if variant is None:
        sys.stderr.write(f"tokenwing: error: {note}\n")
        raise SystemExit(4)  # unsupported
    sys.path.insert(0, os.path.join(root, variant))


if getattr(sys, "frozen", False):
    _install()
