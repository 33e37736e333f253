"""'Will it run here?': the estimate's numbers checked by hand on a model with round numbers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from runmyai.engine.info import DeviceHeadroom, EngineInfo, EngineMemory, ask_engine, unknown
from runmyai.library.estimate import (
    DEFAULT_CALIBRATION,
    DEFAULT_DRIVE_BPS,
    DEFAULT_GPU_COPY_BPS,
    HIT_EXPONENT,
    Calibration,
    Footprint,
    calibration_for,
    hit_rate,
    launch_estimate,
    preset_footprint,
)
from runmyai.library.estimate import estimate as estimate_with
from runmyai.library.presets import ArchFacts, ChatDefaults, Preset, load_catalog
from runmyai.machine import (
    DecodeProbe,
    GpuCopy,
    GpuInfo,
    MachineInfo,
    nvidia_gpus,
    probe_machine,
    saved_drive_speed,
    saved_gpu_copy,
)
from runmyai.paths import bundled_dir

GIB = 1 << 30

# 10 MoE layers x 100 experts of 3,000,000 weights at 1 byte each (expert_bytes 3 MB):
#   experts in all X = 10 x 100 x 3e6 = 3e9 bytes; file 4e9, so 1e9 is always loaded.
#   per token: experts 10 layers x 4 x 3e6 = 1.2e8 bytes; active 1.3e8 params - 1.2e8 = 1e7 always-used bytes.
FACTS = ArchFacts("qwen3moe", 4e9, 1.3e8, 10, 0, 100, 0, 4, 1000, 1000, 4096)
PRESET = Preset(
    id="round",
    name="Round",
    repo="runmyai/Round-TW",
    file="Round.tw.gguf",
    size_bytes=4_000_000_000,
    sha256=None,
    quant="Q8_0",
    facts=FACTS,
    expert_bytes=3_000_000,
    chat=ChatDefaults(),
    flags=(),
    source="hub",
    notes="",
)
# Memory reads 13 GB/s: 1.3e8 bytes per token take 10 ms. The drive reads 1.2 GB/s.
MACHINE = MachineInfo(
    ram_total=32 * GIB,
    ram_available=16 * GIB,
    ram_limit=None,
    cores=8,
    cpu_model="test",
    isa=("avx2",),
    gpus=(),
    disk_free=100_000_000_000,
    drive_read_bps=1.2e9,
    mem_bandwidth_bps=13e9,
)
HEADROOM = 512 << 20
PROCESS = 256 << 20  # the engine's own process, as `info --json`'s process_bytes says it
# the device headroom rule as the engine states it (`tokenwing info --json`: tests/engine/test_info.py)
ENGINE = EngineInfo(
    "test",
    {"qwen3moe": ("Q8_0",)},
    HEADROOM,
    (),
    device_headroom=DeviceHeadroom(16, 256 << 20, 1 << 30),
    process_bytes=PROCESS,
)
# The same model as the engine reads it from its header: its KV cache and its compute graph's reserve known.
HEADER = dataclasses.replace(preset_footprint(PRESET), from_header=True)
# The arithmetic below counts weight reads only: no per-layer or per-token work (see test_engine_work_counts).
READS_ONLY = Calibration(0.0, 0.0, 13e9, "reads only", stream_factor=1.0, hidden_io=0.0)
H25 = 0.25**HIT_EXPONENT  # hits with a quarter of the experts cached (66 %)
MISS25 = 1.2e8 * (1 - H25)  # expert bytes a token misses then (of 1.2e8 it uses)


def estimate(model: Preset | Footprint, machine: MachineInfo, **kw: Any) -> Any:
    kw.setdefault("calibration", READS_ONLY)
    kw.setdefault("context", 0)
    return estimate_with(model, machine, kw.pop("engine", ENGINE), **kw)


# RAM for exactly a 25 % cache: headroom + the engine's process + 1e9 always loaded + 0.75e9 of experts.
QUARTER = HEADROOM + PROCESS + 1_000_000_000 + 750_000_000


def test_hit_rate_curve() -> None:
    assert HIT_EXPONENT == 0.3
    assert hit_rate(0.25) == pytest.approx(0.66, abs=0.005)  # measured: 71 % (built-in model), ~65 % (bench)
    assert hit_rate(0.04) == pytest.approx(0.38, abs=0.005)
    assert hit_rate(1.0) == hit_rate(3.0) == 1.0
    assert hit_rate(0.0) == 0.0


def test_fits_in_ram() -> None:
    e = estimate(PRESET, MACHINE)
    assert e.verdict == "runs_well"
    assert e.cache_bytes == 3_000_000_000 and e.hit_rate == 1.0
    assert e.active_bytes == 130_000_000
    assert e.io_seconds == 0.0 and e.compute_seconds == pytest.approx(0.010)
    assert e.tokens_per_s == pytest.approx(100.0)
    assert e.reasons[0].startswith("This is an estimate")
    assert any("About 100.0 tokens/s" in r for r in e.reasons)


def test_quarter_cache() -> None:
    e = estimate(PRESET, dataclasses.replace(MACHINE, ram_available=QUARTER))
    # 25 % cache -> 66 % hits -> 4.08e7 bytes missed per token / 1.2e9 = 34 ms, + 10 ms compute = 44 ms
    assert e.cache_bytes == 750_000_000
    assert e.hit_rate == pytest.approx(H25)
    assert e.miss_bytes == pytest.approx(MISS25)
    assert e.io_seconds == pytest.approx(MISS25 / 1.2e9)
    assert e.tokens_per_s == pytest.approx(1 / (MISS25 / 1.2e9 + 0.010))
    assert e.verdict == "runs_well"
    assert any("25% of the experts" in r for r in e.reasons)
    assert any("1.20 GB/s (measured)" in r for r in e.reasons)


def test_memory_limit_counts_without_headroom() -> None:
    # Plenty of free RAM, but a cgroup limit with 1e8 already used: room = limit - used, headroom not taken off.
    used = 100_000_000
    limit = PROCESS + 1_000_000_000 + 750_000_000 + used
    e = estimate(PRESET, dataclasses.replace(MACHINE, ram_limit=limit, ram_limit_used=used))
    assert e.cache_bytes == 750_000_000
    assert e.tokens_per_s == pytest.approx(1 / (MISS25 / 1.2e9 + 0.010))
    assert any("left under the memory limit" in r for r in e.reasons)


def test_slow_drive_runs_slowly() -> None:
    e = estimate(PRESET, dataclasses.replace(MACHINE, ram_available=QUARTER, drive_read_bps=1e8))
    # 4.08e7 / 1e8 = 408 ms + 10 ms
    assert e.tokens_per_s == pytest.approx(1 / (MISS25 / 1e8 + 0.010))
    assert e.verdict == "runs_slowly"


def test_smallest_cache_when_memory_is_short() -> None:
    e = estimate(PRESET, dataclasses.replace(MACHINE, ram_available=1_000_000_000))
    # the engine's minimum: top_k slots per layer = 10 x 4 x 3e6 = 1.2e8 (4 %), 38 % hits
    assert e.cache_bytes == 120_000_000 and not e.fits_in_memory
    assert e.hit_rate == pytest.approx(0.04**HIT_EXPONENT)
    assert e.tokens_per_s == pytest.approx(1 / (1.2e8 * (1 - 0.04**HIT_EXPONENT) / 1.2e9 + 0.010))
    assert e.verdict == "runs_slowly"  # fast enough on paper, but it would page
    assert any("page memory" in r for r in e.reasons)


def test_no_disk_space() -> None:
    e = estimate(PRESET, dataclasses.replace(MACHINE, disk_free=3_000_000_000))
    assert e.verdict == "no_disk_space"
    assert e.tokens_per_s == pytest.approx(100.0)  # still says how it would run
    assert any("GB short" in r for r in e.reasons)
    assert estimate(PRESET, dataclasses.replace(MACHINE, disk_free=0), installed=True).verdict == "runs_well"


def test_unsupported_architecture_wins() -> None:
    planned = dataclasses.replace(PRESET, facts=dataclasses.replace(FACTS, arch="deepseek2"))
    e = estimate(planned, dataclasses.replace(MACHINE, disk_free=0))
    assert e.verdict == "unsupported"
    assert any("the installed engine runs qwen3moe; not deepseek2" in r for r in e.reasons)
    # an engine that could not be asked runs nothing, and says why
    e = estimate(PRESET, MACHINE, engine=unknown("no engine here"))
    assert e.verdict == "unsupported" and any("no engine here" in r for r in e.reasons)


def test_streaming_costs_and_a_budget_share() -> None:
    """While experts stream, compute costs stream_factor times more plus stream_layer_s per MoE layer, and a share
    of the reads hides behind it; a preset's `--ram-budget 25%` caps the cache where more would fit."""
    cal = Calibration(0.0, 0.0, 13e9, "test", stream_factor=2.0, hidden_io=0.75, stream_layer_s=0.001)
    e = estimate(PRESET, dataclasses.replace(MACHINE, ram_available=QUARTER), calibration=cal)
    # 10 ms of reads from memory, doubled, + 1 ms for each MoE layer
    assert e.compute_seconds == pytest.approx(0.020 + FACTS.moe_layers * 0.001)
    assert e.io_seconds == pytest.approx(MISS25 / 1.2e9 * 0.25)
    assert estimate(PRESET, MACHINE, calibration=cal).compute_seconds == pytest.approx(0.010)  # all in RAM: 1x
    capped = estimate(PRESET, MACHINE, budget_share=0.25)
    assert capped.cache_bytes == 750_000_000 and capped.hit_rate == pytest.approx(H25)
    assert estimate(PRESET, MACHINE, budget_share=0.01).cache_bytes == 120_000_000  # never under the minimum


def test_the_autotuners_decode_rescales_the_defaults() -> None:
    probe = DecodeProbe(compute_s=0.0005, layers=6, active_bytes=5_000_000, streamed=False, model="m")
    cal = calibration_for(dataclasses.replace(MACHINE, decode_probe=probe))
    d = DEFAULT_CALIBRATION
    predicted = d.per_token_s + 6 * d.per_layer_s + 5e6 / d.mem_bps
    assert 1.2 < 0.0005 / predicted < 20  # (within the rescaling's bounds)
    assert cal.per_layer_s == pytest.approx(d.per_layer_s * 0.0005 / predicted)
    assert cal.stream_layer_s == pytest.approx(d.stream_layer_s * 0.0005 / predicted)
    assert cal.mem_bps == pytest.approx(d.mem_bps * predicted / 0.0005)
    assert "calibrated on autotune here" in cal.source  # (an autotune file saved before speeds were kept)
    assert calibration_for(MACHINE) is DEFAULT_CALIBRATION  # not measured yet: this machine class's default


def test_engine_work_and_context_count() -> None:
    """The engine's own work per layer and per token (the calibration) and the KV cache of the chosen context."""
    cal = Calibration(per_layer_s=0.001, per_token_s=0.002, mem_bps=13e9, source="test")
    e = estimate(PRESET, MACHINE, calibration=cal)
    # 10 ms of reads + 10 layers x 1 ms + 2 ms = 22 ms
    assert e.compute_seconds == pytest.approx(0.022) and e.tokens_per_s == pytest.approx(1 / 0.022)
    assert any("10 layers" in r and "test" in r for r in e.reasons)
    # a context's KV cache comes off the expert cache: 1 MB per token x 750 tokens = 750 MB, from a full cache
    fp = dataclasses.replace(HEADER, kv_bytes_per_token=1_000_000)
    quarter_plus_kv = dataclasses.replace(MACHINE, ram_available=QUARTER + 750_000_000)
    assert estimate(fp, quarter_plus_kv, context=750).cache_bytes == 750_000_000
    assert estimate(fp, quarter_plus_kv, context=0).cache_bytes == 1_500_000_000
    # ... and so does the compute graph's reserve the engine plans for the model (`inspect --json`'s
    # graph_reserve): 150 MB, and 200 kB a token of context, 150 MB more at 750 tokens
    graphed = dataclasses.replace(HEADER, graph_bytes=150_000_000, graph_bytes_per_context_token=200_000)
    e = estimate(graphed, quarter_plus_kv, context=750)
    assert e.cache_bytes == 1_500_000_000 - 300_000_000
    assert any("568.4 MB for the engine and its compute buffers" in r for r in e.reasons), e.reasons  # + PROCESS
    assert not any(r.startswith("Not counted yet") for r in e.reasons)
    # a preset before its header is read counts neither, and says so
    assert any(r.startswith("Not counted yet: the KV cache") for r in estimate(PRESET, quarter_plus_kv).reasons)


def test_defaults_when_nothing_is_measured() -> None:
    m = dataclasses.replace(MACHINE, ram_available=QUARTER, drive_read_bps=None, mem_bandwidth_bps=None)
    e = estimate(PRESET, m, calibration=DEFAULT_CALIBRATION)
    d = DEFAULT_CALIBRATION
    assert e.io_seconds == pytest.approx(MISS25 / DEFAULT_DRIVE_BPS * (1 - d.hidden_io))
    assert any("not measured yet" in r for r in e.reasons)
    assert any(d.source in r for r in e.reasons)
    work = d.per_token_s + FACTS.layers * d.per_layer_s
    streamed = (1.3e8 / d.mem_bps + work) * d.stream_factor + FACTS.moe_layers * d.stream_layer_s
    assert e.compute_seconds == pytest.approx(streamed)
    gpu = estimate(
        PRESET, dataclasses.replace(m, gpus=(GpuInfo(0, "RTX", 16 * GIB, 12 * GIB),)), calibration=DEFAULT_CALIBRATION
    )
    assert gpu.tokens_per_s == e.tokens_per_s  # VRAM not counted by this engine version
    assert any("VRAM is not counted" in r for r in gpu.reasons)


def test_real_presets_are_sane(tmp_path: Path) -> None:
    catalog = load_catalog(bundled_dir("presets"))
    catalog.bind_engine(asyncio.run(ask_engine(tmp_path)))  # (their experts sized by the installed engine)
    assert catalog.errors == ()
    desktop = dataclasses.replace(MACHINE, ram_available=28 * GIB, drive_read_bps=3e9, mem_bandwidth_bps=None)
    for p in catalog.presets:
        e = estimate(p, dataclasses.replace(desktop, disk_free=10**13))
        assert e.tokens_per_s > 0 and 0 < e.hit_rate <= 1
        assert (e.verdict == "unsupported") == (p.facts.arch != "qwen3moe")
    q30 = catalog.get("qwen3-30b-a3b")
    q235 = catalog.get("qwen3-235b-a22b")
    assert q30 is not None and q235 is not None
    assert estimate(q30, desktop).verdict == "runs_well"  # 17.6 GB of experts all fit in 28 GB
    small = estimate(q30, dataclasses.replace(desktop, ram_available=8 * GIB))
    assert small.hit_rate < 1 and small.tokens_per_s < estimate(q30, desktop).tokens_per_s
    big = estimate(q235, desktop)
    assert big.verdict == "no_disk_space" and big.tokens_per_s < small.tokens_per_s


# ---------------------------------------------------------------------------------------------- machine probe
def test_probe_this_machine(tmp_path: Path) -> None:
    """The machine probe's memory is the engine's answer (`tokenwing info --json`'s memory: its own reader of
    /proc and the cgroup limits, tests/streaming/test_memory.py), not a copy of that reader in the app."""
    m = probe_machine(tmp_path / "not-yet" / "models")
    assert m.memory_error is None
    engine = json.loads(subprocess.run([sys.executable, "-m", "tokenwing", "info", "--json"], capture_output=True,
                                       check=True).stdout)["memory"]  # fmt: skip
    assert m.ram_total == engine["total"] > 0 and 0 < m.ram_available <= m.ram_total
    assert m.ram_limit == (engine["limit"] if engine["limit"] < engine["total"] else None)
    assert m.ram_limit is None or 0 < m.ram_limit < m.ram_total
    assert 0 < m.ram_usable <= m.ram_available
    assert m.cores >= 1 and m.cpu_model
    assert isinstance(m.gpus, tuple)  # no GPU here: empty, not an error
    assert m.disk_free > 0
    assert m.drive_read_bps is None  # never benchmarked by the probe
    assert probe_machine(tmp_path, drive_read_bps=2e9).drive_read_bps == 2e9


def _fake_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Fake CPU 9000\nflags\t\t: fpu avx avx2 fma\n")
    return root


def test_the_engines_memory_limit_is_the_machines(tmp_path: Path) -> None:
    """A limit the engine reports (2 GiB, 1 GiB of it charged) is the machine's: the room under it, not the free
    RAM, is what a model gets; the engine's "limit = total" is no limit."""
    root = _fake_root(tmp_path)
    m = probe_machine(tmp_path, root=root, memory=EngineMemory(16 * GIB, 8 * GIB, 2 * GIB, GIB))
    assert (m.ram_total, m.ram_available, m.ram_limit, m.ram_limit_used) == (16 * GIB, 8 * GIB, 2 * GIB, GIB)
    assert m.ram_usable == GIB  # the room under the limit, not the free RAM
    assert m.cpu_model == "Fake CPU 9000" and m.isa == ("avx", "avx2", "fma")
    free = probe_machine(tmp_path, root=root, memory=EngineMemory(16 * GIB, 8 * GIB, 16 * GIB, 0))
    assert free.ram_limit is None and free.ram_limit_used == 0 and free.ram_usable == 8 * GIB


def test_an_engine_that_cannot_say_its_memory(tmp_path: Path) -> None:
    """No engine to ask: the probe says why, and the estimate says memory is not known rather than guessing."""
    m = probe_machine(tmp_path, command=[str(tmp_path / "no-such-engine")])
    assert m.memory_error is not None and "could not be started" in m.memory_error
    assert m.ram_total == m.ram_available == 0 and m.ram_limit is None
    e = estimate(PRESET, dataclasses.replace(m, disk_free=10**12))
    assert any(r.startswith("Memory is not known: the engine could not be started") for r in e.reasons), e.reasons


def test_drive_speed_from_a_saved_autotune(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text('{"not": "autotune"}')
    (tmp_path / "autotune.json").write_text(
        json.dumps({"machine": {"drive": {"mb_per_s_by_threads": {"1": 900.0, "8": 1250.5}}}})
    )
    assert saved_drive_speed(tmp_path) == pytest.approx(1250.5e6)
    assert probe_machine(tmp_path, autotune_dir=tmp_path).drive_read_bps == pytest.approx(1250.5e6)
    assert probe_machine(tmp_path, 3e9, autotune_dir=tmp_path).drive_read_bps == 3e9  # a parameter wins
    assert saved_drive_speed(tmp_path / "none") is None


def test_gpus_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU on the test machines: a stand-in NVML with two GPUs, then one whose init fails (no driver)."""
    calls: list[str] = []

    class Mem:
        def __init__(self, total: int, free: int) -> None:
            self.total, self.free = total, free

    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: Mem(24 * GIB, (20 - h) * GIB),
        nvmlDeviceGetName=lambda h: b"NVIDIA RTX 4090" if h == 0 else "NVIDIA H200",
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert nvidia_gpus() == (
        GpuInfo(0, "NVIDIA RTX 4090", 24 * GIB, 20 * GIB),
        GpuInfo(1, "NVIDIA H200", 24 * GIB, 19 * GIB),
    )
    assert calls == ["init", "shutdown"]

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_driver))
    assert nvidia_gpus() == ()


def test_a_gpu_the_engine_can_use_counts() -> None:
    """An engine that lists a GPU (not a CPU-type Vulkan driver): the always-used weights and the KV cache go to
    VRAM first, then experts; with NVML's free VRAM where NVML knows the card. Checked by hand: 3 GiB free, less
    the engine's 256 MiB kept and the model's compute graph (its reserve, as the engine plans it), holds the 1e9
    always-loaded bytes and the KV cache, and the rest is that share of the 3e9 bytes of experts."""
    m = dataclasses.replace(MACHINE, ram_available=QUARTER, gpus=(GpuInfo(0, "RTX 3050", 4 * GIB, 3 * GIB),))
    model = dataclasses.replace(HEADER, kv_bytes_per_token=2048, graph_bytes=100 << 20)
    model = dataclasses.replace(model, graph_bytes_per_context_token=64)
    cpu_only = estimate(model, m, context=4096)
    dev = {"kind": "vulkan", "name": "Vulkan0", "description": "NVIDIA GeForce RTX 3050", "free": 7 * GIB // 2,
           "total": 4 * GIB, "software": False}  # fmt: skip
    engine = dataclasses.replace(ENGINE, devices=({"kind": "cpu", "name": "CPU"}, dev))
    e = estimate(model, m, engine=engine, context=4096)
    kv = 4096 * 2048
    vram = 3 * GIB - (256 << 20) - (100 << 20) - 4096 * 64  # NVML's 3 GiB free, not the engine's cached 3.5
    share = (vram - 1e9 - kv) / 3e9
    assert any(f"{share:.0%} of the experts" in r and "all fit" in r for r in e.reasons), e.reasons
    assert e.hit_rate == pytest.approx(hit_rate(min(1.0, cpu_only.cache_share + share)))
    assert e.tokens_per_s > 1.5 * cpu_only.tokens_per_s
    lavapipe = dict(dev, description="llvmpipe (LLVM 15.0.6, 256 bits)", software=True)
    soft = estimate(model, m, engine=dataclasses.replace(ENGINE, devices=(lavapipe,)), context=4096)
    assert soft.tokens_per_s == cpu_only.tokens_per_s and any("VRAM is not counted" in r for r in soft.reasons)


# A GPU the engine can use, holding part of the experts: 3 GiB free of 4 (NVML), as above.
GPU_MACHINE = dataclasses.replace(MACHINE, ram_available=QUARTER, gpus=(GpuInfo(0, "RTX 3050", 4 * GIB, 3 * GIB),))
GPU_DEV = {"kind": "vulkan", "name": "Vulkan0", "description": "NVIDIA GeForce RTX 3050", "free": 3 * GIB,
           "total": 4 * GIB, "software": False}  # fmt: skip
SWAPPING_ENGINE = dataclasses.replace(ENGINE, devices=(GPU_DEV,), swaps_per_token_max=8.0)


def test_vram_swaps_copy_at_the_measured_speed_else_a_default() -> None:
    """A token waits for the VRAM swaps' copies: at most the engine's 8 experts a token × 3 MB, at the RAM → VRAM
    speed the autotuner measured on this GPU (24 GB/s: 1 ms), else the default (12 GB/s: 2 ms), said so."""
    assumed = estimate(PRESET, GPU_MACHINE, engine=SWAPPING_ENGINE, context=4096)
    assert DEFAULT_GPU_COPY_BPS == 12e9 and assumed.swap_seconds == pytest.approx(8 * 3e6 / 12e9)
    line = next(r for r in assumed.reasons if r.startswith("VRAM swaps"))
    assert "at most 8 experts a token" in line and "12.0 GB/s (assumed; the autotuner measures it)" in line
    assert assumed.tokens_per_s == pytest.approx(1 / (assumed.io_seconds + assumed.compute_seconds + 2e-3))

    copy = GpuCopy(24e9, 20e9, "NVIDIA GeForce RTX 3050", "m.tw.gguf")
    measured = estimate(PRESET, dataclasses.replace(GPU_MACHINE, gpu_copy=copy), engine=SWAPPING_ENGINE, context=4096)
    assert measured.swap_seconds == pytest.approx(8 * 3e6 / 24e9)
    assert any("24.0 GB/s (measured by the autotuner on this machine)" in r for r in measured.reasons)
    assert measured.tokens_per_s > assumed.tokens_per_s

    other = dataclasses.replace(copy, device="NVIDIA H200")  # measured on another device: not this one's speed
    e = estimate(PRESET, dataclasses.replace(GPU_MACHINE, gpu_copy=other), engine=SWAPPING_ENGINE, context=4096)
    assert e.swap_seconds == assumed.swap_seconds and any(
        "measured another device, NVIDIA H200" in r for r in e.reasons
    )

    quiet = estimate(PRESET, GPU_MACHINE, engine=dataclasses.replace(SWAPPING_ENGINE, swaps_per_token_max=None))
    assert quiet.swap_seconds == 0 and any("does not say how many it makes; not counted" in r for r in quiet.reasons)
    # every expert in VRAM (24 GiB free): nothing to swap, nothing counted
    big = dataclasses.replace(GPU_MACHINE, gpus=(GpuInfo(0, "RTX 3050", 32 * GIB, 24 * GIB),))
    whole = estimate(PRESET, big, engine=SWAPPING_ENGINE, context=4096)
    assert whole.swap_seconds == 0 and not any(r.startswith("VRAM swaps") for r in whole.reasons)


def test_gpu_copy_speeds_from_this_machines_saved_autotune(tmp_path: Path) -> None:
    """`machine.gpu` of the newest autotune result saved for this machine (its id in the file name); results of
    another machine and results without a GPU are not this machine's copy speed."""
    from runmyai.machine import machine_fingerprint

    here = machine_fingerprint().id
    gpu = {"name": "Vulkan0", "description": "NVIDIA H200", "up_gb_per_s": 25.5, "down_gb_per_s": 21.0}

    def save(name: str, machine: dict[str, Any], mtime: int) -> None:
        path = tmp_path / name
        path.write_text(json.dumps({"machine": machine, "runmyai": {"model": "/m/x.tw.gguf"}}))
        os.utime(path, (mtime, mtime))

    save(f"autotune-x-1-{here}.json", {"gpu": gpu}, 1000)
    save(f"autotune-y-2-{here}.json", {"gpu": None}, 2000)  # newer, no GPU measured: skipped
    save("autotune-z-3-0123456789ab.json", {"gpu": dict(gpu, up_gb_per_s=99.0)}, 3000)  # newest, another machine
    assert saved_gpu_copy(tmp_path, here) == GpuCopy(25.5e9, 21e9, "NVIDIA H200", "/m/x.tw.gguf")
    assert probe_machine(tmp_path, autotune_dir=tmp_path).gpu_copy == saved_gpu_copy(tmp_path, here)
    assert saved_gpu_copy(tmp_path, "0123456789ab") is not None and saved_gpu_copy(tmp_path, "ffffffffffff") is None
    assert probe_machine(tmp_path).gpu_copy is None


def test_an_image_encoder_started_with_the_model_stays_in_memory_beside_it(tmp_path: Path) -> None:
    """A vision model started with its mmproj (`--mmproj FILE`, issue 45) holds the encoder's weights as well: the
    expert cache gets that much less, and the reasoning says why."""
    encoder = tmp_path / "mmproj-F16.gguf"
    with open(encoder, "wb") as f:
        f.truncate(100_000_000)  # (its size is what counts)
    machine = dataclasses.replace(MACHINE, ram_available=QUARTER + 200_000_000)
    plain = launch_estimate(PRESET, machine, ENGINE, ["--ctx", "1"], installed=True, calibration=READS_ONLY)
    seeing = launch_estimate(
        PRESET, machine, ENGINE, ["--ctx", "1", "--mmproj", str(encoder)], installed=True, calibration=READS_ONLY
    )
    assert seeing.cache_bytes == plain.cache_bytes - 100_000_000
    assert any("the image encoder's 100.0 MB with it" in r for r in seeing.reasons), seeing.reasons
    assert not any("image encoder" in r for r in plain.reasons)
