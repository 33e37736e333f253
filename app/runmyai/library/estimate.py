""" "Will it run here?": an estimate of decode speed before any download, from the math of MoE streaming.

Pure functions over a `Preset` and a `MachineInfo`. The model (docs/app-library.md has the derivation):

* A token reads `active bytes` of weights: the always-used part (attention, shared experts, routers, dense
  layers, output head) plus top_k routed experts in every MoE layer.
* The expert cache gets what memory is left after other apps (HEADROOM), the engine's own buffers and KV cache
  (ENGINE_RESERVE) and the always-loaded part of the file; never less than top_k slots per layer (the engine's
  minimum). It holds a share f of all routed experts.
* Expected hit rate h = f ** HIT_EXPONENT (an assumption: routing is skewed, so a cache holding a share f of
  the experts serves more than f of the requests; see HIT_EXPONENT).
* Time per token = misses / drive speed + active bytes / memory bandwidth, added up with no overlap: the
  engine overlaps them, so this errs on the slow side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runmyai.library.machine import MachineInfo
from runmyai.library.presets import ENGINE_ARCHS, Preset

GIB = 1 << 30
HEADROOM = 512 << 20  # left free for other apps (Run My AI's presets' headroom, spec section 4)
ENGINE_RESERVE = 1 << 30  # KV cache at a 4k context, compute buffers and the engine process itself
DISK_MARGIN = 256 << 20  # kept free beyond the file itself
DEFAULT_DRIVE_BPS = 1.0e9  # unmeasured drive: a modest NVMe (our virtual dev disk measures 1.0-1.3 GB/s)
DEFAULT_MEM_BPS = 20e9  # unmeasured RAM: effective CPU read bandwidth of dual-channel DDR4, conservatively
# Hit rate vs cache share: h = f ** 0.5. Measured on the bench model (docs/results.md, engine table): 53 % hits
# under a 25 % memory cap and 71 % under 40 %, where the cap also holds the rest of the process, so the cache's
# share was smaller still; sqrt gives 50 % and 63 % at 25 % and 40 %: a little below the measurements on purpose.
HIT_EXPONENT = 0.5
RUNS_WELL_TOKENS_PER_S = 5.0  # about reading speed

Verdict = Literal["runs_well", "runs_slowly", "no_disk_space", "unsupported"]


@dataclass(frozen=True)
class Estimate:
    tokens_per_s: float
    verdict: Verdict
    reasons: tuple[str, ...]  # the reasoning, one human line each, starting with "This is an estimate"
    hit_rate: float
    cache_bytes: int
    # the parts, for the UI's details (added to the contract)
    active_bytes: int = 0
    miss_bytes: float = 0.0
    io_seconds: float = 0.0
    compute_seconds: float = 0.0
    fits_in_memory: bool = True  # the always-loaded part plus the smallest cache fit in usable RAM


def hit_rate(cache_share: float) -> float:
    """Expected share of expert requests served from the cache, for a cache holding `cache_share` of them."""
    if cache_share >= 1.0:
        return 1.0
    if cache_share <= 0.0:
        return 0.0
    return float(cache_share**HIT_EXPONENT)


def active_bytes(preset: Preset) -> tuple[int, int]:
    """(always-used bytes a token reads, routed-expert bytes a token reads) at the preset's quant."""
    f = preset.facts
    expert_bytes_per_token = f.moe_layers * f.top_k * preset.expert_bytes
    bytes_per_param = preset.expert_bytes / f.expert_params
    dense_params = max(0.0, f.active_params - f.moe_layers * f.top_k * f.expert_params)
    return round(dense_params * bytes_per_param), expert_bytes_per_token


def estimate(preset: Preset, machine: MachineInfo, *, installed: bool = False) -> Estimate:
    """Decode tokens/s of `preset` on `machine`, with the reasoning. `installed`: skip the disk-space check."""
    f = preset.facts
    reasons = ["This is an estimate from the model's shape and this machine, not a measurement."]

    dense_tok, experts_tok = active_bytes(preset)
    active = dense_tok + experts_tok
    reasons.append(
        f"Each token reads {_gb(active)} of weights: {_gb(dense_tok)} always used (attention, routers, "
        f"{'shared experts, ' if f.shared_experts else ''}output) + {f.top_k} experts × {f.moe_layers} layers × "
        f"{_mb(preset.expert_bytes)}."
    )
    experts_all = preset.expert_total_bytes
    resident = preset.resident_bytes
    reasons.append(
        f"The file is {_gb(preset.size_bytes)}: {_gb(experts_all)} of routed experts streamed from the drive "
        f"({f.experts} per layer), {_gb(resident)} always loaded."
    )

    # ---- memory → cache size → hit rate
    # The headroom for other apps comes off free RAM, not off a memory limit (they live outside the group).
    room = machine.ram_available - HEADROOM
    limit_note = ""
    if machine.ram_limit is not None:
        room = min(room, machine.ram_limit - machine.ram_limit_used)
        limit_note = f" ({_gb(machine.ram_limit - machine.ram_limit_used)} left under the memory limit)"
    budget = room - ENGINE_RESERVE - resident
    minimum = f.moe_layers * f.top_k * preset.expert_bytes
    fits = budget >= minimum
    cache = int(min(max(budget, minimum), experts_all))
    share = cache / experts_all if experts_all else 1.0
    hits = hit_rate(share)
    reasons.append(
        f"Memory: {_gb(machine.ram_available)} available{limit_note}; after {_gb(HEADROOM)} for other apps, "
        f"{_gb(ENGINE_RESERVE)} for the context and buffers and {_gb(resident)} always loaded, the expert cache "
        f"gets {_gb(cache)}: {share:.0%} of the experts."
    )
    if not fits:
        reasons.append(
            f"That is less than the engine's smallest cache ({_gb(minimum)}, {f.top_k} experts per layer): the "
            "system will page memory, so expect it to be slower than this estimate."
        )
    gpu_vram = sum(g.vram_free for g in machine.gpus)
    if machine.gpus:
        reasons.append(
            f"GPU: {len(machine.gpus)} with {_gb(gpu_vram)} free VRAM; this engine version doesn't use GPUs yet, "
            "so VRAM is not counted."
        )
    if hits >= 1.0:
        reasons.append("Every expert fits in the cache: after warming up, the drive is no longer read.")
    else:
        reasons.append(
            f"Expected cache hit rate {hits:.0%}: assumed to grow as the square root of the cache's share "
            f"({share:.0%}), below what the engine measured on its bench model (53 % at a 25 % memory cap)."
        )

    # ---- time per token
    miss = experts_tok * (1.0 - hits)
    drive = machine.drive_read_bps
    drive_bps = drive if drive and drive > 0 else DEFAULT_DRIVE_BPS
    io_s = miss / drive_bps
    if miss > 0:
        how = "measured" if drive else "assumed; not measured yet"
        reasons.append(
            f"Drive: {_gb(miss)} of misses per token at {drive_bps / 1e9:.2f} GB/s ({how}) → "
            f"{io_s * 1000:.0f} ms per token waiting for reads."
        )
    mem = machine.mem_bandwidth_bps
    mem_bps = mem if mem and mem > 0 else DEFAULT_MEM_BPS
    compute_s = active / mem_bps
    reasons.append(
        f"Compute: {_gb(active)} read from memory at {mem_bps / 1e9:.0f} GB/s "
        f"({'measured' if mem else 'a conservative assumption'}) → {compute_s * 1000:.0f} ms per token."
    )
    seconds = io_s + compute_s
    tps = 1.0 / seconds if seconds > 0 else 0.0
    reasons.append(f"About {tps:.1f} tokens/s ({seconds * 1000:.0f} ms per token, reads and compute not overlapped).")

    # ---- disk and verdict
    need = preset.size_bytes + DISK_MARGIN
    disk_ok = installed or machine.disk_free >= need
    if not installed:
        reasons.append(
            f"Disk: needs {_gb(preset.size_bytes)}; {_gb(machine.disk_free)} free in the models folder"
            + ("." if disk_ok else f" — {_gb(need - machine.disk_free)} short.")
        )
    verdict: Verdict
    if preset.engine_support != "supported":
        verdict = "unsupported"
        reasons.append(
            f"Not yet: this version of the engine runs {', '.join(sorted(ENGINE_ARCHS))}; the {f.arch} "
            "architecture is planned."
        )
    elif not disk_ok:
        verdict = "no_disk_space"
        reasons.append("Won't fit on disk: free some space or choose a models folder on another drive.")
    elif tps >= RUNS_WELL_TOKENS_PER_S and fits:
        verdict = "runs_well"
        reasons.append(f"Runs well: at least {RUNS_WELL_TOKENS_PER_S:.0f} tokens/s, about reading speed.")
    else:
        verdict = "runs_slowly"
        reasons.append(
            f"Runs slowly: under {RUNS_WELL_TOKENS_PER_S:.0f} tokens/s"
            + ("." if fits else ", and memory is short.")
            + " More RAM or a faster drive helps."
        )
    return Estimate(
        tokens_per_s=tps,
        verdict=verdict,
        reasons=tuple(reasons),
        hit_rate=hits,
        cache_bytes=cache,
        active_bytes=active,
        miss_bytes=miss,
        io_seconds=io_s,
        compute_seconds=compute_s,
        fits_in_memory=fits,
    )


def _gb(n: float) -> str:
    if abs(n) >= 1e9:
        return f"{n / 1e9:.1f} GB"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.0f} MB"
    return f"{n / 1e3:.0f} kB"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"
