"""`tokenwing info`: what this engine is and sees — version, the architectures it runs with the weight types it
computes, the memory headroom it keeps, the memory (and optionally the drive) it would size itself from, and
its compute devices. The app asks this instead of keeping copies of engine facts."""

from __future__ import annotations

import os
from typing import Any

from tokenwing.errors import BadInputError
from tokenwing.streaming.memory import HEADROOM, MemoryInfo, memory_info
from tokenwing.version import __version__


def weight_types() -> list[str]:
    """GGUF weight types that ggml's CPU backend has matrix kernels for (the engine computes every weight with
    ggml): read from ggml's own type table, not a list kept here."""
    from tokenwing.compute import ggml_api as ggml

    out = []
    for t in range(ggml.GGML_TYPE_COUNT):
        traits = ggml.ggml_get_type_traits_cpu(t)
        name = ggml.ggml_type_name(t)
        if traits and traits.contents.vec_dot and name and b" " not in name:
            out.append(name.decode().upper())
    return out


def devices(isa: list[str], mem: MemoryInfo) -> list[dict[str, Any]]:
    """Every compute device ggml sees (kind, name, description, type, free and total memory), the CPU with its
    cores, instruction sets and RAM (ggml counts all of it free); a registry that cannot be listed leaves the CPU
    alone, with the reason."""
    from tokenwing.compute.devices import list_devices

    cpu: dict[str, Any] = {
        "kind": "cpu",
        "name": "CPU",
        "cores": len(os.sched_getaffinity(0)),
        "isa": isa,
        "free": mem.usable,
        "total": mem.total,
    }
    try:
        found = list_devices()
    except Exception as e:  # never fail `info` over a device: it is what the app asks when something is wrong
        return [{**cpu, "error": f"listing devices failed: {e}"}]
    out = []
    for d in found:
        entry = d.as_dict()
        if d.kind == "cpu":
            entry.update(cpu)
        out.append(entry)
    out.sort(key=lambda e: e["kind"] != "cpu")  # the CPU first: the app and older readers look there
    return out


def engine_info(drive_file: str | None = None, drive_bytes: int = 64 << 20) -> dict[str, Any]:
    from tokenwing.autotune.probe import cpu_isa, probe_drive
    from tokenwing.models import supported_architectures
    from tokenwing.runtime.vram_experts import SWAP_EVERY, SWAP_MAX

    types = weight_types()
    mem = memory_info()
    info: dict[str, Any] = {
        "version": __version__,
        "architectures": {arch: {"weight_types": types} for arch in supported_architectures()},
        "headroom_bytes": HEADROOM,
        "memory": {
            "total": mem.total,
            "available": mem.available,
            "limit": mem.limit,
            "used_in_group": mem.used_in_group,
            "usable": mem.usable,
        },
        "devices": devices(cpu_isa(), mem),
        # the VRAM expert cache's swap rule, the most it copies to a device per decode token (the app's estimate)
        "vram_swaps": {"every_tokens": SWAP_EVERY, "max_experts": SWAP_MAX},
        "drive": None,
    }
    if drive_file is not None:
        try:
            size = os.path.getsize(drive_file)
        except OSError as e:
            raise BadInputError(f"cannot read {drive_file}: {e.strerror or e}") from None
        block = min(1 << 20, size // 4096 * 4096)  # expert-sized reads; a small file gets smaller ones
        if block == 0:
            raise BadInputError(f"{drive_file} is too small to measure reads from (under 4 KiB)")
        d = probe_drive(drive_file, block, drive_bytes, threads=(1, 8))
        info["drive"] = {
            "file": drive_file,
            "direct": d.direct,
            "block_bytes": d.block_bytes,
            "mb_per_s_by_threads": d.mb_per_s_by_threads,
        }
    return info
