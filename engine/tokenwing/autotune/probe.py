"""What this machine has: memory and the process's limit, cores and ISA, NVIDIA GPUs, the drive's read speed."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenwing import _core
from tokenwing.streaming.memory import MemoryInfo, memory_info


@dataclass
class DriveProbe:
    direct: bool
    block_bytes: int
    mb_per_s_by_threads: dict[int, float] = field(default_factory=dict)

    @property
    def best_threads(self) -> int:
        best = max(self.mb_per_s_by_threads.values())
        # the fewest threads within 5 % of the best: more threads cost memory and context switches
        return min(t for t, v in self.mb_per_s_by_threads.items() if v >= 0.95 * best)

    @property
    def best_mb_per_s(self) -> float:
        return max(self.mb_per_s_by_threads.values())


@dataclass
class MachineProbe:
    memory: MemoryInfo
    cores: int
    isa: list[str]
    gpus: list[dict[str, Any]]
    drive: DriveProbe | None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory"]["usable"] = self.memory.usable
        if self.drive:
            d["drive"]["best_threads"] = self.drive.best_threads
        return d


def cpu_isa() -> list[str]:
    wanted = ["avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile"]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in flags]
    except OSError:
        pass
    return []


def nvidia_gpus() -> list[dict[str, Any]]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(
                {"index": i, "name": str(pynvml.nvmlDeviceGetName(h)), "total": int(mem.total), "free": int(mem.free)}
            )
    finally:
        pynvml.nvmlShutdown()
    return out


def probe_drive(
    path: str,
    block: int,
    budget_bytes: int = 256 << 20,
    threads: tuple[int, ...] = (1, 2, 4, 8, 16),
    progress: Callable[[str], None] = lambda line: None,
) -> DriveProbe:
    probe = DriveProbe(direct=True, block_bytes=block)
    with _core.DirectFile(path) as f:
        probe.direct = f.direct
    for i, t in enumerate(threads):
        progress(f"measuring the drive: {t} I/O thread{'s' if t > 1 else ''} ({i + 1}/{len(threads)})")
        secs, nbytes, _ = _core.read_benchmark(path, block, t, budget_bytes, seed=t, direct=probe.direct)
        probe.mb_per_s_by_threads[t] = nbytes / secs / 1e6
    return probe


def probe_machine(
    model_path: str | None,
    record_size: int = 0,
    drive_bytes: int = 256 << 20,
    progress: Callable[[str], None] = lambda line: None,
) -> MachineProbe:
    progress("probing memory, cores and GPUs")
    drive = probe_drive(model_path, record_size, drive_bytes, progress=progress) if model_path and record_size else None
    return MachineProbe(memory_info(), len(os.sched_getaffinity(0)), cpu_isa(), nvidia_gpus(), drive)
