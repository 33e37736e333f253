"""What this machine has: memory and the process's limit, cores and ISA, GPUs (NVML on NVIDIA; the device the
engine would compute on, its VRAM and host↔device copy speed), the drive's read speed, and how fast a decode's
reads go at each I/O setting (a decode replayed through the streaming core)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tokenwing import _core
from tokenwing.compute.backend import Backend, DeviceError
from tokenwing.compute.bandwidth import copy_speed
from tokenwing.compute.devices import DeviceOptions, list_devices, resolve_budget
from tokenwing.compute.probe import choose_device
from tokenwing.streaming.memory import MemoryInfo, memory_info
from tokenwing.streaming.replay import replay
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.trace import synthetic_trace


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
class ReplayProbe:
    """Decode tokens per second of a replay through the core (the engine's request pattern: a token's demand reads,
    its predictions read ahead in chunks, a layer's compute between) at each setting tried."""

    slots_per_layer: int
    compute_ms_per_layer: float  # the stand-in for a layer's compute
    tok_s: dict[str, float] = field(default_factory=dict)  # by setting label (see SETTINGS_OF)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # label → the flags it stands for

    def best(self, labels: list[str], margin: float = 0.03) -> str:
        """The fastest of `labels`; the first of them within `margin` of it (they are listed cheapest first)."""
        top = max(self.tok_s[label] for label in labels)
        return next(label for label in labels if self.tok_s[label] >= (1 - margin) * top)


@dataclass
class MachineProbe:
    memory: MemoryInfo
    cores: int
    isa: list[str]
    gpus: list[dict[str, Any]]  # NVIDIA GPUs as NVML sees them
    drive: DriveProbe | None
    devices: list[dict[str, Any]] = field(default_factory=list)  # ggml's devices, with their free memory
    gpu: dict[str, Any] | None = None  # the device `--device auto` takes: VRAM, budget, copy speeds
    gpu_reason: str = ""  # the engine's line about it (or why the CPU)
    replay: ReplayProbe | None = None

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


def probe_gpu(
    nvml: list[dict[str, Any]], options: DeviceOptions | None = None, progress: Callable[[str], None] = lambda _: None
) -> tuple[dict[str, Any] | None, list[dict[str, Any]], str]:
    """(the device `options` take (`--device auto`: CUDA, else a Vulkan GPU), with its VRAM — NVML's on NVIDIA,
    else what ggml reports: CUDA's free
    memory, the Vulkan memory budget — its budget and measured copy speeds; ggml's devices; the choice's line)."""
    try:
        found = list_devices()
    except Exception as e:  # (a registry that cannot be listed: the CPU)
        return None, [], f"computing on the CPU: listing devices failed ({e})"
    devices = [d.as_dict() for d in found]
    choice = choose_device(options or DeviceOptions(), found)
    if choice.device is None:
        return None, devices, choice.reason
    dev, source = choice.device, ("CUDA" if choice.device.kind == "cuda" else "the Vulkan memory budget")
    same = [g for g in nvml if "NVIDIA" in dev.description and str(g["name"]) in dev.description]
    if same:  # NVML's count of an NVIDIA GPU's memory
        dev = replace(dev, free=int(same[0]["free"]), total=int(same[0]["total"]))
        source = "NVML"
    budget, how = resolve_budget((options or DeviceOptions()).vram_budget, dev)
    progress(f"measuring copies between RAM and {dev.name}")
    try:
        backend = Backend(dev)
        try:
            speed = copy_speed(backend).as_dict()
        finally:
            backend.close()
    except DeviceError as e:
        return None, devices, f"computing on the CPU: {dev.name} failed ({e})"
    # how fast the CPU reads an expert it computes (decode reads each weight once): what a VRAM expert saves it
    ram = _core.memory_read_bandwidth(256 << 20, max(1, len(os.sched_getaffinity(0))), 2) / 1e9
    gpu = {**dev.as_dict(), "memory_source": source, "budget": budget, "budget_reason": how, **speed}
    gpu["ram_gb_per_s"] = ram
    return gpu, devices, choice.reason


def probe_machine(
    model_path: str | None,
    record_size: int = 0,
    drive_bytes: int = 256 << 20,
    progress: Callable[[str], None] = lambda line: None,
    device: DeviceOptions | None = None,
) -> MachineProbe:
    progress("probing memory, cores and GPUs")
    drive = probe_drive(model_path, record_size, drive_bytes, progress=progress) if model_path and record_size else None
    nvml = nvidia_gpus()
    gpu, devices, reason = probe_gpu(nvml, device, progress)
    return MachineProbe(memory_info(), len(os.sched_getaffinity(0)), cpu_isa(), nvml, drive, devices, gpu, reason)


# What the replay probe tries, cheapest first within each group (ties go to the earlier one).
IO_CANDIDATES = [("io_uring", 4), ("io_uring", 8), ("io_uring", 16), ("io_uring", 32), ("threads", 2), ("threads", 4),
                 ("threads", 8), ("threads", 16)]  # fmt: skip
LOOKAHEAD_CANDIDATES = [(0, 1), (1, 1), (2, 2), (2, 1)]  # (lookahead, prefetch votes)
PREDICTION_RECALL = (0.67, 0.58)  # the demo model's and the bench model's router lookahead at 1 and 2 layers


def probe_replay(
    mf: Any,
    slots: int,
    cores: int,
    tokens: int = 24,
    progress: Callable[[str], None] = lambda line: None,
) -> ReplayProbe:
    """Replays a synthetic decode of this model's shape (Zipf-skewed, temporally local routing; predictions at the
    recall measured on real routing) through the core at `slots` per layer, first at each I/O engine and depth
    (lookahead 2), then at each lookahead distance and vote count with the fastest I/O: decode tokens per second.
    A layer's compute is stood in for by busy CPU: its weights' bytes at half this machine's RAM bandwidth."""
    idx = mf.index
    per_layer = idx.n_used * sum(el.payload for el in idx.layers) / len(idx.layers)
    resident = sum(t.nbytes for t in mf.resident) / max(len(idx.layers), 1)
    bw = _core.memory_read_bandwidth(256 << 20, max(1, cores), 2)
    compute_s = (per_layer + resident) / (0.5 * bw)
    warmup = 8
    trace = synthetic_trace(tokens + warmup, len(idx.layers), idx.n_expert, idx.n_used, recall=PREDICTION_RECALL)
    out = ReplayProbe(slots, compute_s * 1e3)
    uring = _core.uring_available()[0]

    def run(label: str, settings: StreamSettings, lookahead: int) -> None:
        progress(f"replaying a decode: {label}")
        r = replay(mf, slots, settings, trace, compute_s, lookahead, warmup)
        out.tok_s[label] = max(out.tok_s.get(label, 0.0), r.tok_s)

    for _ in range(2):  # two interleaved passes, the better of each: a busy machine slows one, not both
        for engine, n in IO_CANDIDATES:
            if engine == "io_uring" and not uring:
                continue
            label = f"{engine} {n}"
            out.settings[label] = {"moe_stream_io_engine": engine, "moe_stream_io_threads": n}
            run(label, StreamSettings(io_engine=engine, io_threads=n, idle_fill_ms=-1), 2)
    io = out.best([label for label in out.settings if label in out.tok_s])
    io_settings = out.settings[io]
    for _ in range(2):
        for lookahead, votes in LOOKAHEAD_CANDIDATES:
            label = f"lookahead {lookahead}, votes {votes} ({io})"
            out.settings[label] = {**io_settings, "lookahead": lookahead, "moe_stream_prefetch_votes": votes}
            s = StreamSettings(
                io_engine=io_settings["moe_stream_io_engine"],
                io_threads=io_settings["moe_stream_io_threads"],
                prefetch_votes=votes,
                idle_fill_ms=-1,
            )
            run(label, s, lookahead)
    return out
