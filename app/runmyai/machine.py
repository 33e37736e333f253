"""What this machine has, for "Will it run here?": memory and the memory limit, CPU, GPUs, disk, drive speed.

The probe only reads what the system already knows: it never benchmarks the drive (the engine's autotuner does
that; its saved result is read here when there is one).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import json
import os
import platform
import shutil
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from runmyai.engine.info import EngineMemory, ask_memory
from runmyai.speeds import SpeedMeasurement, read_speeds

T = TypeVar("T")

# CPU features that matter to the engine's kernels, as /proc/cpuinfo names them (x86 "flags", Arm "Features").
ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "asimd",
    "asimddp",
    "sve",
    "sve2",
)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    vram_total: int
    vram_free: int


@dataclass(frozen=True)
class DecodeProbe:
    """A short decode the autotuner ran here: the engine's compute per token (the drive's wait taken out) for a
    model of this shape; the estimate scales its per-machine-class costs by it."""

    compute_s: float
    layers: int
    active_bytes: int  # weights a token reads
    streamed: bool  # some experts streamed from the drive (hit rate under 100 %)
    model: str


@dataclass(frozen=True)
class GpuCopy:
    """Host↔device copy speeds the engine measured on this machine's GPU (`tokenwing autotune`: the copies a VRAM
    swap makes, expert-sized blocks from pinned RAM where the device has it), and the device they are of."""

    up_bps: float  # RAM → VRAM, bytes/s
    down_bps: float  # VRAM → RAM
    device: str  # ggml's description of the device (a GPU's product name)
    model: str  # the model autotune ran with (the speeds do not depend on it)


@dataclass(frozen=True)
class MachineInfo:
    ram_total: int
    ram_available: int  # free plus reclaimable cache (MemAvailable)
    ram_limit: int | None  # the engine's memory limit (cgroup v1 or v2); None when there is none below RAM
    cores: int  # cores this process may run on
    cpu_model: str
    isa: tuple[str, ...]
    gpus: tuple[GpuInfo, ...]
    disk_free: int  # at the models folder
    drive_read_bps: float | None  # measured expert reads (autotune), None when not measured yet
    ram_limit_used: int = 0  # what the limiting cgroup already charges (0 without a limit)
    mem_bandwidth_bps: float | None = None  # RAM bandwidth when known (none is measured yet)
    decode_probe: DecodeProbe | None = None  # the newest decode the autotuner measured on this machine
    gpu_copy: GpuCopy | None = None  # the newest host↔device copy speeds the autotuner measured on this machine
    # every decode measured here (autotune runs and finished chat replies, runmyai.speeds): what calibrates the
    # estimate, robustly, and what a measured model's card says
    speeds: tuple[SpeedMeasurement, ...] = ()
    memory_error: str | None = None  # the engine could not say what memory it sees (then the RAM fields are 0)

    @property
    def ram_usable(self) -> int:
        """Bytes a new process could still take: free RAM, and room under the memory limit."""
        if self.ram_limit is None:
            return self.ram_available
        return max(0, min(self.ram_available, self.ram_limit - self.ram_limit_used))


def probe_machine(
    models_dir: Path,
    drive_read_bps: float | None = None,
    *,
    autotune_dir: Path | None = None,
    mem_bandwidth_bps: float | None = None,
    root: Path = Path("/"),
    memory: EngineMemory | str | None = None,
    command: Sequence[str] | None = None,
) -> MachineInfo:
    """Probes this machine (about a second, the engine's start; `probe_machine_async` runs it off the event loop).

    The memory is the engine's answer (`tokenwing info --json`, by its own reader of /proc and the cgroup limits,
    asked with `command` unless `memory` gives it, or says why it could not be), so the estimate sizes by what the
    engine will. `drive_read_bps` wins over a saved autotune result in `autotune_dir`; `root` points /proc at a
    fake tree in tests.
    """
    if memory is None:
        memory = ask_memory(command)
    error = memory if isinstance(memory, str) else None
    mem = memory if isinstance(memory, EngineMemory) else EngineMemory(0, 0, 0, 0)
    limit: int | None = mem.limit if mem.limit < mem.total else None  # (the engine says `total` for no limit)
    model, isa = cpu_info(root)
    if drive_read_bps is None and autotune_dir is not None:
        drive_read_bps = saved_drive_speed(autotune_dir)
    probe = saved_decode_probe(autotune_dir) if autotune_dir is not None else None
    copy = saved_gpu_copy(autotune_dir, _machine_id()) if autotune_dir is not None else None
    speeds = read_speeds(autotune_dir) if autotune_dir is not None else ()
    return MachineInfo(
        ram_total=mem.total,
        ram_available=mem.available,
        ram_limit=limit,
        cores=_cores(),
        cpu_model=model,
        isa=isa,
        gpus=nvidia_gpus(),
        disk_free=disk_free(models_dir),
        drive_read_bps=drive_read_bps,
        ram_limit_used=mem.used_in_group if limit is not None else 0,
        mem_bandwidth_bps=mem_bandwidth_bps,
        decode_probe=probe,
        gpu_copy=copy,
        speeds=speeds,
        memory_error=error,
    )


async def probe_machine_async(
    models_dir: Path, drive_read_bps: float | None = None, *, autotune_dir: Path | None = None
) -> MachineInfo:
    return await asyncio.to_thread(probe_machine, models_dir, drive_read_bps, autotune_dir=autotune_dir)


# ---------------------------------------------------------------------------------------------- CPU
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_info(root: Path = Path("/")) -> tuple[str, tuple[str, ...]]:
    """(CPU model name, the ISA flags of ISA_FLAGS it has)."""
    model = ""
    flags: set[str] = set()
    try:
        for line in (root / "proc" / "cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key in ("model name", "hardware", "cpu model") and not model:
                model = value.strip()
            elif key in ("flags", "features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine() or "unknown CPU", tuple(
        f for f in ISA_FLAGS if f in flags
    )


# ---------------------------------------------------------------------------------------------- GPUs
@dataclass(frozen=True)
class GpuReport:
    gpus: tuple[GpuInfo, ...]
    note: str  # "no NVIDIA GPU", "2 NVIDIA GPUs", or why NVML could not be asked


def nvidia_vram() -> GpuReport:
    """VRAM per NVIDIA GPU through NVML. No driver or no GPU is a normal answer ("no NVIDIA GPU"), not an error.
    Blocking (NVML can take a moment to initialise): call it with asyncio.to_thread from the event loop."""
    try:
        import pynvml
    except ImportError:
        return GpuReport((), "no NVIDIA GPU (NVML bindings are not installed)")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # (looked up by name: bindings differ between versions)
        names = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
        missing = tuple(t for t in (getattr(pynvml, n, None) for n in names) if isinstance(t, type))
        return GpuReport((), "no NVIDIA GPU" if missing and isinstance(e, missing) else f"no NVIDIA GPU (NVML: {e})")
    gpus: list[GpuInfo] = []
    try:
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name: Any = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            gpus.append(GpuInfo(i, str(name), int(mem.total), int(mem.free)))
    except Exception as e:
        return GpuReport(tuple(gpus), f"NVML failed after {len(gpus)} GPUs: {e}")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    if not gpus:
        return GpuReport((), "no NVIDIA GPU")
    return GpuReport(tuple(gpus), f"{len(gpus)} NVIDIA GPU{'s' if len(gpus) > 1 else ''}")


def nvidia_gpus() -> tuple[GpuInfo, ...]:
    """VRAM per NVIDIA GPU; none (no driver, no GPU, an NVML error): an empty tuple."""
    return nvidia_vram().gpus


# ---------------------------------------------------------------------------------------------- disk
def disk_free(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    p = path.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return int(shutil.disk_usage(p).free)
    except OSError:
        return 0


def _newest_saved(directory: Path, pattern: str, read: Callable[[Any], T | None]) -> T | None:
    """`read(json)` of the newest saved autotune result in `directory` it can read (None: none could)."""
    try:
        files = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    for path in files:
        try:
            value = read(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if value is not None:
            return value
    return None


def saved_drive_speed(directory: Path) -> float | None:
    """Best measured read speed (bytes/s) in the newest saved `tokenwing autotune --json` result in `directory`.

    That JSON holds machine.drive.mb_per_s_by_threads ({threads: MB/s}); files without it are skipped.
    """

    def read(data: Any) -> float | None:
        best = max(float(v) for v in data["machine"]["drive"]["mb_per_s_by_threads"].values())
        return best * 1e6 if best > 0 else None

    return _newest_saved(directory, "*.json", read)


def saved_gpu_copy(directory: Path, machine_id: str) -> GpuCopy | None:
    """The newest host↔device copy speeds in the autotune results saved for this machine (`autotune-<model>-<machine
    id>.json`: `machine.gpu` as `tokenwing autotune --json` printed it); None when none has a GPU measured."""

    def read(data: Any) -> GpuCopy | None:
        g = data["machine"]["gpu"]
        copy = GpuCopy(
            float(g["up_gb_per_s"]) * 1e9,
            float(g["down_gb_per_s"]) * 1e9,
            str(g.get("description") or g["name"]),
            str(data.get("runmyai", {}).get("model") or ""),
        )
        return copy if copy.up_bps > 0 else None

    return _newest_saved(directory, f"autotune-*-{machine_id}.json", read)


def _machine_id() -> str:
    return machine_fingerprint().id


def saved_decode_probe(directory: Path) -> DecodeProbe | None:
    """The newest decode measurement in the saved autotune results (`runmyai.decode`); None when there is none."""

    def read(data: Any) -> DecodeProbe | None:
        d = data["runmyai"]["decode"]
        probe = DecodeProbe(
            float(d["compute_s"]), int(d["layers"]), int(d["active_bytes"]), bool(d["streamed"]), str(d["model"])
        )
        return probe if probe.compute_s > 0 and probe.layers > 0 else None

    return _newest_saved(directory, "autotune-*.json", read)


@dataclass(frozen=True)
class MachineFingerprint:
    hostname: str
    cpu_model: str
    ram_total: int

    @property
    def id(self) -> str:
        text = f"{self.hostname}|{self.cpu_model}|{self.ram_total}"
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def as_dict(self) -> dict[str, Any]:
        return {"hostname": self.hostname, "cpu_model": self.cpu_model, "ram_total": self.ram_total, "id": self.id}


_FINGERPRINT: MachineFingerprint | None = None


def machine_fingerprint() -> MachineFingerprint:
    """This machine (computed once per process: a few small reads)."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        # (RAM's size as the OS gives it, MemTotal on Linux: only part of this machine's name, no sizing by it;
        # psutil by name, as it has no type stubs)
        ram = int(importlib.import_module("psutil").virtual_memory().total)
        _FINGERPRINT = MachineFingerprint(socket.gethostname(), cpu_info()[0], ram)
    return _FINGERPRINT
