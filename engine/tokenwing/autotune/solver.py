"""From what the machine has to settings, each with the reason it was chosen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenwing.autotune.probe import MachineProbe
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import human_bytes
from tokenwing.streaming.memory import HEADROOM, expert_budget
from tokenwing.streaming.streamer import SlotPlan, plan_slots

LEND_FROM = 16 << 30  # VRAM budget from which a prompt borrows the expert cache (`--vram-lend`)


@dataclass
class Choice:
    settings: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, value: Any, reason: str) -> None:
        self.settings[key] = value
        self.reasons[key] = reason


def _reserved(mf: ModelFile, n_ctx: int) -> int:
    """What the expert cache leaves room for: resident weights, an F16 KV cache of n_ctx, compute buffers."""
    meta, arch = mf.header, mf.arch
    n_layer = int(meta.get(f"{arch}.block_count") or 0)
    kv_row = (
        int(meta.get(f"{arch}.attention.head_count_kv") or 1) * int(meta.get(f"{arch}.attention.key_length") or 128) * 2
    )
    return sum(t.nbytes for t in mf.resident) + 2 * n_layer * kv_row * n_ctx + (256 << 20)


def plan_for(mf: ModelFile, m: MachineProbe, n_ctx: int = 4096) -> SlotPlan:
    """The expert cache this machine's free memory allows (what the replay probe runs at)."""
    return plan_slots(mf.index, expert_budget(m.memory, HEADROOM, _reserved(mf, n_ctx)), mf.index.n_used)


def choose(mf: ModelFile, m: MachineProbe, n_ctx: int = 4096) -> Choice:
    c = Choice()
    ex = mf.index
    reserved = _reserved(mf, n_ctx)
    plan = plan_for(mf, m, n_ctx)
    c.set(
        "ram_budget",
        plan.bytes,
        f"{human_bytes(m.memory.usable)} usable (free RAM under the memory limit {human_bytes(m.memory.limit)}) "
        f"minus {human_bytes(HEADROOM)} headroom minus {human_bytes(reserved)} for resident weights, a "
        f"{n_ctx}-token F16 KV cache and compute buffers: {plan.slots_per_layer} of {ex.n_expert} experts per "
        f"layer" + (f" ({plan.note})" if plan.note else ""),
    )
    c.set("threads", m.cores, f"{m.cores} cores available to this process")
    r = m.replay
    if r is not None:
        io = r.best([label for label in r.settings if label in r.tok_s and "lookahead" not in label])
        la = r.best([label for label in r.settings if label.startswith("lookahead")])
        tried = ", ".join(f"{label} {r.tok_s[label]:.1f}" for label in r.settings if "lookahead" not in label)
        why_io = (
            f"the fastest decode replayed through the core at {r.slots_per_layer} slots per layer "
            f"({r.compute_ms_per_layer:.1f} ms of compute a layer), the fewest reads in flight within 3 %: "
            f"tok/s {tried}"
        )
        c.set("moe_stream_io_engine", r.settings[io]["moe_stream_io_engine"], why_io)
        c.set("moe_stream_io_threads", r.settings[io]["moe_stream_io_threads"], why_io)
        tried = ", ".join(
            f"{label.split(' (')[0]} {r.tok_s[label]:.1f}" for label in r.settings if "lookahead" in label
        )
        why_la = f"the fastest replayed decode with {io} (no lookahead, then less, preferred within 3 %): tok/s {tried}"
        c.set("lookahead", r.settings[la]["lookahead"], why_la)
        c.set("moe_stream_prefetch_votes", r.settings[la]["moe_stream_prefetch_votes"], why_la)
    elif m.drive is not None:
        c.set(
            "moe_stream_io_threads",
            m.drive.best_threads,
            f"every expert fits in RAM (read once, at start): the fewest I/O threads within 5 % of the drive's best "
            f"direct-read speed ({m.drive.best_mb_per_s:.0f} MB/s with whole-expert reads)",
        )
    if m.drive is not None:
        c.set(
            "moe_stream_direct",
            m.drive.direct,
            "direct reads work on this file system"
            if m.drive.direct
            else "this file system refuses O_DIRECT: cached reads",
        )
    if r is None:
        c.set("lookahead", 2, "every expert fits in RAM: the lookahead is idle (its default)")
    full = plan.slots_per_layer >= ex.n_expert
    c.set(
        "expert_cache_share",
        round(plan.slots_per_layer / ex.n_expert, 3),
        "every expert fits in RAM: the drive is read only while the cache warms up"
        if full
        else "the rest is read from the drive when needed or predicted",
    )
    if m.gpus:
        c.set("gpus", [g["name"] for g in m.gpus], "NVIDIA GPUs as NVML sees them")
    _gpu(c, mf, m, n_ctx)
    return c


def _gpu(c: Choice, mf: ModelFile, m: MachineProbe, n_ctx: int) -> None:
    """The device, and what the VRAM tier would hold there (the engine plans again at each start, from the VRAM
    free then: nothing here is a byte count to keep)."""
    g = m.gpu
    if g is None:
        c.set("device", "cpu", m.gpu_reason.removeprefix("computing on the CPU: ") or "no GPU")
        return
    from tokenwing.runtime.placement import plan_for_file
    from tokenwing.runtime.preflight import preflight

    plan = plan_for_file(mf, preflight(mf).hp, int(g["budget"]), n_ctx)
    c.set(
        "device",
        g["kind"],
        f"{m.gpu_reason.removeprefix('computing on ')}; {human_bytes(int(g['free']))} free of "
        f"{human_bytes(int(g['total']))} VRAM ({g['memory_source']})",
    )
    c.set("vram_plan", plan.describe(), f"a budget of {g['budget_reason']}, for a {n_ctx}-token context")
    c.set(
        "vram_expert_share",
        round(plan.expert_slots / max(plan.n_expert, 1), 3),
        "the share of every layer's experts the VRAM holds: the hottest, swapped as decode moves on",
    )
    # Lending pays where the cache is large and still short of every expert (spec §11: on small GPUs it made long
    # prompts slower); a rule of thumb, not measured on this machine.
    lend = plan.expert_slots < plan.n_expert and int(g["budget"]) >= LEND_FROM
    c.set(
        "vram_lend",
        lend,
        f"prompts borrow the VRAM expert cache's coldest slots for their GPU waves: on from a "
        f"{human_bytes(LEND_FROM)} budget when the cache cannot hold every expert (a rule of thumb)"
        if lend
        else "prompts keep VRAM of their own for their GPU waves: "
        + ("every expert fits in VRAM" if plan.expert_slots >= plan.n_expert else "the VRAM is small"),
    )
    c.set(
        "gpu_copy_gb_per_s",
        {"up": round(float(g["up_gb_per_s"]), 2), "down": round(float(g["down_gb_per_s"]), 2)},
        "measured: 64 MiB in 4 MiB blocks between "
        + ("pinned" if g["pinned"] else "ordinary")
        + " RAM and the device, what a VRAM swap or a prompt's GPU wave copies",
    )
