"""From what the machine has to settings, each with the reason it was chosen."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwing.autotune.probe import MachineProbe
from tokenwing.format.layout import K_HEADER_CHECKSUM
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import human_bytes
from tokenwing.runtime.placement import VramPlan, plan_for_file
from tokenwing.runtime.preflight import preflight
from tokenwing.streaming.memory import HEADROOM, expert_budget
from tokenwing.streaming.streamer import SlotPlan, plan_slots
from tokenwing.streaming.usage import load_usage, usage_path

# Decode tokens within which a prompt's refill must pay for itself for `--vram-lend` to be on: a short chat reply
# (the one input of the lending rule that is a choice, not a measurement)
REPLY_TOKENS = 128


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
    _gpu(c, mf, m, n_ctx, plan.slots_per_layer)
    return c


@dataclass(frozen=True)
class LendCase:
    """What `--vram-lend` gains and costs on a machine: sizes from the VRAM plans with and without it, speeds as
    `probe_gpu` and `probe_drive` measured them."""

    slots: int  # VRAM expert slots per layer without lending
    slots_lent: int  # with lending (decode's compute buffers kept apart only)
    n_expert: int
    n_used: int  # experts a token selects per layer
    layers: int  # streamed layers
    expert_bytes: float  # one expert on the device (mean over the layers)
    lent_bytes: int  # what a prompt borrows, refilled after it: its compute buffer
    lendable_bytes: int  # the most the cache can lend (all but one slot per layer)
    hit_share: float  # share of a layer's selections that the extra slots' experts take (usage table, else uniform)
    up_gb_per_s: float  # RAM → device copies
    ram_gb_per_s: float  # the CPU reading RAM: what computing an expert there takes per byte
    ram_share: float  # share of each layer's experts the RAM cache holds (a refill reads the others from the drive)
    drive_mb_per_s: float | None


def lend_pays(c: LendCase) -> tuple[bool, str]:
    """Whether lending the VRAM expert cache to prompts pays on this machine, and why, with the numbers. The cost:
    a refill after each prompt (the lent bytes up from RAM, the share RAM lacks from the drive). The gain: each
    decode token finds more of its experts in VRAM, each one the CPU then does not compute (decode reads an
    expert's weights once: its bytes at the RAM read speed). On when the gain pays the refill back within
    REPLY_TOKENS decode tokens; off where the cache cannot lend what a prompt needs (its chunks would shrink:
    spec §11, long prompts slower on small GPUs)."""
    if c.slots >= c.n_expert:
        return False, "every expert fits in VRAM without lending"
    if c.slots_lent <= c.slots:
        return False, "lending gives no more expert slots at this budget"
    if c.lent_bytes > c.lendable_bytes:
        return False, (
            f"the cache could lend {human_bytes(c.lendable_bytes)} of the {human_bytes(c.lent_bytes)} a prompt "
            "computes with: its chunks would shrink (long prompts slower, as the spec measured on small GPUs)"
        )
    refill_s = c.lent_bytes / (c.up_gb_per_s * 1e9)
    drive = ""
    if c.ram_share < 1 and c.drive_mb_per_s:
        read_s = (1 - c.ram_share) * c.lent_bytes / (c.drive_mb_per_s * 1e6)
        refill_s += read_s
        drive = f" and {1 - c.ram_share:.0%} of it from the drive at {c.drive_mb_per_s:.0f} MB/s"
    hits = c.layers * c.n_used * c.hit_share
    each_s = c.expert_bytes / (c.ram_gb_per_s * 1e9)
    saved_s = hits * each_s
    tokens = refill_s / saved_s if saved_s > 0 else math.inf
    on = tokens <= REPLY_TOKENS
    return on, (
        f"{c.slots} → {c.slots_lent} of {c.n_expert} experts per layer in VRAM: {hits:.2f} more of a decode "
        f"token's experts there, {each_s * 1e6:.0f} µs of CPU each (a {human_bytes(int(c.expert_bytes))} expert "
        f"at the measured {c.ram_gb_per_s:.1f} GB/s RAM read speed), {saved_s * 1e3:.3f} ms a token; a prompt "
        f"borrows {human_bytes(c.lent_bytes)}, refilled at the measured {c.up_gb_per_s:.1f} GB/s{drive}: "
        f"{refill_s * 1e3:.1f} ms a prompt; paid back after {tokens:.0f} decode tokens ("
        + ("within" if on else "more than")
        + f" {REPLY_TOKENS}: {'on' if on else 'off'})"
    )


def _hit_share(mf: ModelFile, layers: list[int], lo: int, hi: int) -> tuple[float, str]:
    """The share of a layer's selections that its experts ranked lo…hi-1 take: from the usage table beside the
    model where there is one (mean over the streamed layers), else as if every expert were used alike."""
    idx = mf.index
    checksum = int(mf.header.get(K_HEADER_CHECKSUM) or 0)
    table = load_usage(usage_path(mf.path), layers, idx.n_expert, checksum, lambda _: None)
    if table is None or table.tokens == 0:
        return (hi - lo) / idx.n_expert, "every expert alike: no usage table yet"
    ranked = -np.sort(-table.counts, axis=1)
    totals = ranked.sum(axis=1)
    share = ranked[:, lo:hi].sum(axis=1) / np.maximum(totals, 1e-9)
    return float(share[totals > 0].mean()) if (totals > 0).any() else 0.0, "from the usage table"


def _gpu(c: Choice, mf: ModelFile, m: MachineProbe, n_ctx: int, ram_slots: int) -> None:
    """The device, and what the VRAM tier would hold there (the engine plans again at each start, from the VRAM
    free then: nothing here is a byte count to keep)."""
    g = m.gpu
    if g is None:
        c.set("device", "cpu", m.gpu_reason.removeprefix("computing on the CPU: ") or "no GPU")
        return
    hp, budget = preflight(mf).hp, int(g["budget"])
    plan = plan_for_file(mf, hp, budget, n_ctx)
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
    lent = plan_for_file(mf, hp, budget, n_ctx, lend=True)
    c.set("vram_lend", *_lend(mf, m, plan, lent, ram_slots, hp.n_layer))
    c.set(
        "gpu_copy_gb_per_s",
        {"up": round(float(g["up_gb_per_s"]), 2), "down": round(float(g["down_gb_per_s"]), 2)},
        "measured: 64 MiB in 4 MiB blocks between "
        + ("pinned" if g["pinned"] else "ordinary")
        + " RAM and the device, what a VRAM swap or a prompt's GPU wave copies",
    )


def _lend(
    mf: ModelFile, m: MachineProbe, plan: VramPlan, lent: VramPlan, ram_slots: int, n_layer: int
) -> tuple[bool, str]:
    """`--vram-lend` from the VRAM plans without and with it and the measured speeds (`lend_pays`)."""
    g = m.gpu
    assert g is not None
    if "ram_gb_per_s" not in g:  # (a probe from before lending was costed)
        return False, "the RAM read speed was not measured"
    layers = [el.layer for el in mf.index.layers if el.layer < n_layer]
    n_layers = len(layers)
    row = lent.expert_bytes // lent.expert_slots if lent.expert_slots else 0
    need = plan.reserve - lent.reserve  # a prompt chunk's compute buffer beyond decode's
    share, source = _hit_share(mf, layers, plan.expert_slots, lent.expert_slots)
    case = LendCase(
        slots=plan.expert_slots,
        slots_lent=lent.expert_slots,
        n_expert=plan.n_expert,
        n_used=mf.index.n_used,
        layers=n_layers,
        expert_bytes=row / max(n_layers, 1),
        lent_bytes=need,
        lendable_bytes=max(lent.expert_slots - 1, 0) * row,
        hit_share=share,
        up_gb_per_s=float(g["up_gb_per_s"]),
        ram_gb_per_s=float(g["ram_gb_per_s"]),
        ram_share=min(1.0, ram_slots / max(mf.index.n_expert, 1)),
        drive_mb_per_s=m.drive.best_mb_per_s if m.drive is not None else None,
    )
    on, why = lend_pays(case)
    return on, why if case.slots >= case.n_expert or case.slots_lent <= case.slots else f"{why}; hits {source}"
