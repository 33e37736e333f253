"""The physical limits a benchmark's result is measured against (issue 16 §1), in one place.

* Drive ceiling: the best direct-read rate of the drive holding the model — a deep queue through one io_uring and
  many threads, 512 KiB–4 MiB requests, cross-checked with `fio` in the same run — and at least the highest rate
  any reader reached in the run, the engine's own included (`DiskWatch` reads the device's sector counters in
  /proc/diskstats around a run).
* Fewest bytes: Belady's MIN on the run's own decode trace, at the run's slots per layer, from the cache the run
  started decoding with; bytes = misses × each layer's record size.
* Compute floor: the same decode path's time per token with every expert already in RAM (measured by the bench).
* Memory-bandwidth limit for in-RAM decode: the bytes a token touches (its routed experts, the resident weights it
  reads, its KV window) ÷ the RAM read bandwidth at the same thread count (a STREAM-style probe).
* Capped limit = min(drive ceiling ÷ Belady bytes per token, 1 ÷ compute floor).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwing import _core
from tokenwing.format.inspect import _lazy_tensors
from tokenwing.format.reader import ModelFile
from tokenwing.streaming.trace import Trace

MB = 1e6
REQUESTS = (512 << 10, 1 << 20, 2 << 20, 4 << 20)  # request sizes of the deep-queue probe
DEPTHS = (8, 32, 64)  # reads in flight through one io_uring


# ------------------------------------------------------------------------------------------ the device
@dataclass(frozen=True)
class DiskSample:
    sectors_read: int
    reads: int
    busy_ms: int  # time the device had I/O in flight (io_ticks)
    at: float  # time.monotonic()


def device_of(path: str) -> str | None:
    """The /proc/diskstats name of the block device holding `path` (its partition's whole disk's counters
    include the partition's), or None where it cannot be found (an overlay, a network file system)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    try:
        name = os.path.basename(os.path.realpath(f"/sys/dev/block/{major}:{minor}"))
    except OSError:
        return None
    return name if name and _read_diskstats(name) is not None else None


def _read_diskstats(name: str) -> DiskSample | None:
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 13 and fields[2] == name:
                    return DiskSample(int(fields[5]), int(fields[3]), int(fields[12]), time.monotonic())
    except OSError:
        pass
    return None


class DiskWatch:
    """Bytes the device read and how long it was busy between `start()` and `stop()` (every process's reads:
    on a shared machine other readers count too, so this confirms a rate rather than attributes it)."""

    def __init__(self, path: str) -> None:
        self.device = device_of(path)
        self.first: DiskSample | None = None
        self.last: DiskSample | None = None

    def start(self) -> DiskWatch:
        self.first = _read_diskstats(self.device) if self.device else None
        return self

    def stop(self) -> dict[str, float] | None:
        self.last = _read_diskstats(self.device) if self.device else None
        a, b = self.first, self.last
        if a is None or b is None or b.at <= a.at:
            return None
        secs = b.at - a.at
        nbytes = (b.sectors_read - a.sectors_read) * 512
        return {
            "bytes": float(nbytes),
            "seconds": secs,
            "mb_per_s": nbytes / secs / MB,
            "busy_share": min(1.0, (b.busy_ms - a.busy_ms) / 1000 / secs),
        }


# --------------------------------------------------------------------------------------- drive ceiling
@dataclass
class DriveCeiling:
    rates: dict[str, float] = field(default_factory=dict)  # MB/s by how it was reached

    def add(self, label: str, mb_per_s: float) -> None:
        if mb_per_s > 0:
            self.rates[label] = max(mb_per_s, self.rates.get(label, 0.0))

    @property
    def mb_per_s(self) -> float:
        return max(self.rates.values()) if self.rates else 0.0

    @property
    def best(self) -> str:
        return max(self.rates, key=lambda k: self.rates[k]) if self.rates else "—"

    def fio_best(self) -> float:
        return max((v for k, v in self.rates.items() if k.startswith("fio")), default=0.0)


def probe_drive(path: str, budget: int = 512 << 20, quick: bool = False) -> DriveCeiling:
    """The deep-queue probe: io_uring at several depths and request sizes, threads with whole-expert-sized and
    large requests, and fio at queue depth 32; each cell confirmed by the device's sector counters."""
    out = DriveCeiling()
    ok, why = _core.uring_available()
    sizes = REQUESTS[1::2] if quick else REQUESTS
    depths = DEPTHS[1:2] if quick else DEPTHS
    if ok:
        for block in sizes:
            for depth in depths:
                w = DiskWatch(path).start()
                secs, nbytes, _ = _core.read_benchmark_uring(path, block, depth, budget, seed=depth)
                out.add(f"io_uring {block >> 10} KiB × {depth}", nbytes / secs / MB)
                _confirm(out, w, f"device during io_uring {block >> 10} KiB × {depth}")
    else:
        out.rates["(io_uring unavailable: " + why + ")"] = 0.0
    for block, threads in ((1 << 20, 16), (4 << 20, 32)) if not quick else ((1 << 20, 16),):
        w = DiskWatch(path).start()
        secs, nbytes, _ = _core.read_benchmark(path, block, threads, budget, seed=threads)
        out.add(f"threads {block >> 10} KiB × {threads}", nbytes / secs / MB)
        _confirm(out, w, f"device during threads {block >> 10} KiB × {threads}")
    for block in sizes if not quick else sizes[:1]:
        rate = fio_rate(path, block, 32, budget)
        if rate is not None:
            out.add(f"fio {block >> 10} KiB, iodepth 32", rate)
    return out


def _confirm(out: DriveCeiling, w: DiskWatch, label: str) -> None:
    got = w.stop()
    if got is not None:
        out.add(label, got["mb_per_s"])


def fio_rate(path: str, block: int, depth: int, budget: int) -> float | None:
    """fio's random direct read rate over the file (MB/s), or None without fio."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    engine = "io_uring" if _core.uring_available()[0] else "libaio"
    cmd = [
        fio,
        "--name=ceiling",
        f"--filename={path}",
        "--readonly",
        "--direct=1",
        "--rw=randread",
        f"--bs={block}",
        f"--iodepth={depth}",
        f"--ioengine={engine}",
        f"--io_size={budget}",
        f"--size={os.path.getsize(path) // block * block}",
        "--output-format=json",
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        job = json.loads(r.stdout)["jobs"][0]["read"]
        return float(job["bw_bytes"]) / MB
    except (OSError, ValueError, KeyError, IndexError, subprocess.TimeoutExpired):
        return None


# ----------------------------------------------------------------------------------------- memory
def memory_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """RAM read bandwidth (bytes/s) at `threads` threads: the best of 3 passes over a 1 GiB buffer."""
    return float(_core.memory_read_bandwidth(nbytes, threads, 3))


def decode_bytes_touched(model: str, positions: list[int], kv_bytes_per_position: int) -> dict[str, float]:
    """What an in-RAM decode token reads, on average over `positions` (the KV length each token attends over):
    its routed experts, the resident weights (every matrix, the embedding table's one row), its KV window. A
    tensor the family reads sparsely from the file (qwen4exp's n-gram table) is not counted: its pages are drive
    reads, in the run's own bytes read (counted whole, q4x-bench's in-RAM decode reached 288 % of this limit)."""
    with ModelFile.open(model, announce_fallback=False) as mf:
        experts = float(sum(el.payload for el in mf.index.layers) * mf.index.n_used)
        lazy = _lazy_tensors(mf.header, str(mf.header.get("general.architecture")))
        dense = 0.0
        for t in mf.resident:
            if t.name in lazy:
                continue
            if t.name == "token_embd.weight":
                dense += t.nbytes / max(t.shape[-1], 1)  # one row
            else:
                dense += t.nbytes
    kv = float(np.mean([kv_bytes_per_position * p for p in positions])) if positions else 0.0
    return {"experts": experts, "dense": dense, "kv": kv, "total": experts + dense + kv}


# ------------------------------------------------------------------------------------------ Belady
def belady(trace: Trace, slots: int, record_sizes: list[int], warm: np.ndarray | None) -> dict[str, float]:
    """Belady's MIN on the decode rows of a recorded trace at `slots` per layer, starting from `warm` (the
    experts each layer held when decoding began, [layers, ≤ slots], -1 empty): misses and bytes per token."""
    decode = trace.prompt_tokens == 0
    return belady_rows(trace.selected[decode], trace.n_expert, slots, record_sizes, warm)


def belady_rows(
    sel: np.ndarray, n_expert: int, slots: int, record_sizes: list[int], warm: np.ndarray | None
) -> dict[str, float]:
    """Belady's MIN over rows of selections [tokens, streamed layers, k] in the order they are used (several
    sequences' decode steps: each step's rows one after another), at `slots` per layer from `warm`."""
    sel = np.ascontiguousarray(sel, np.int32)
    n = int(sel.shape[0])
    pred = np.zeros((n, sel.shape[1], 0, sel.shape[2]), np.int32)
    table = _core.simulate(
        sel, pred, np.zeros(n, np.int64), n_expert, slots, "belady", False, 64, _warm(warm, sel.shape[1], slots)
    )
    misses = table[:, 1].astype(np.float64)
    nbytes = float((misses * np.asarray(record_sizes, np.float64)).sum())
    return {"tokens": n, "misses": float(misses.sum()), "bytes_per_token": nbytes / max(n, 1)}


def _warm(warm: np.ndarray | None, layers: int, slots: int) -> np.ndarray:
    out = np.full((layers, slots), -1, np.int32)
    if warm is not None:
        w = np.asarray(warm, np.int32)[:, :slots]
        out[: w.shape[0], : w.shape[1]] = w
    return out


def capped_limit(ceiling_mb_s: float, belady_bytes_per_token: float, compute_floor_s: float) -> dict[str, float]:
    """min(drive ceiling ÷ fewest bytes per token, 1 ÷ compute floor), with both parts."""
    drive = ceiling_mb_s * MB / belady_bytes_per_token if belady_bytes_per_token > 0 else float("inf")
    compute = 1 / compute_floor_s if compute_floor_s > 0 else float("inf")
    return {"drive_tok_s": drive, "compute_tok_s": compute, "limit_tok_s": min(drive, compute)}


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads, summed by thread name (the core names its threads tw-io, tw-reap,
    tw-idle; ggml's workers and the interpreter keep theirs). From schedstat (nanoseconds) where the kernel keeps
    it, else from stat (clock ticks: too coarse for a few tokens)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    secs = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                fields = stat[stat.rindex(")") + 2 :].split()
                secs = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except OSError:
            continue
        key = "main" if tid == str(os.getpid()) else name
        out[key] = out.get(key, 0.0) + secs
    return out


def switches() -> dict[str, int]:
    """Context switches (voluntary + involuntary) of this process's threads by name: wake-ups, load-independent
    enough to compare I/O engines on a busy machine."""
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Name:")), "?")
        n = sum(int(ln.split(":")[1]) for ln in lines if ln.endswith("switches") or "ctxt_switches" in ln)
        key = "main" if tid == str(os.getpid()) else name
        out[key] = out.get(key, 0) + n
    return out


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    return {k: float(after[k]) - float(before.get(k, 0)) for k in after}
