""" "Will it run here?": an estimate of decode speed before any download, from the math of MoE streaming.

Pure functions over a `Footprint` (from a preset's published facts, or from the engine's plan of a GGUF), a
`MachineInfo` and the installed engine's `EngineInfo`. The model (docs/app-library.md has the derivation):

* A token reads `active bytes` of weights: the always-used part (attention, shared experts, routers, dense
  layers, output head) plus top_k routed experts in every MoE layer.
* The expert cache gets what memory is left after other apps (the engine's own headroom), the engine's process
  (`info --json`'s `process_bytes`), its compute graph's reserve and the KV cache of the chosen context (the
  model's `graph_reserve` and `kv_bytes_per_token`, from `inspect --json` on its header) and the always-loaded part
  of the file; never less than top_k slots per layer (the engine's minimum). A preset's card before any header is
  read counts neither the graph nor the KV cache, and says so. It holds a share f of all routed experts.
* Expected hit rate h = f ** HIT_EXPONENT (an assumption: routing is skewed, so a cache holding a share f of
  the experts serves more than f of the requests; see HIT_EXPONENT and MEASURED_HITS).
* Time per token = compute + the wait for the drive. Compute: active bytes / memory bandwidth + the engine's
  own work per layer and per token, times `stream_factor` while experts stream (streamed experts are computed
  in the file's layout, and the reads take CPU). Wait: misses / drive speed × (1 − `hidden_io`), the share of
  the reads the engine does not hide behind compute (lookahead prefetch, reads overlapping compute). With a
  GPU holding part of the experts, + the VRAM swaps' copies: at most the engine's limit of experts per token
  (`tokenwing info --json`), at the RAM → VRAM copy speed the autotuner measured here (else a default).
  All of it is a `Calibration`: fitted on this machine class by bench/estimate_bench.py, rescaled by what this
  machine measured (its autotuner runs and finished chat replies, runmyai.speeds): the median of several, robust to
  one slow run, and their range.

Shown as a range with where it came from: a model measured here says its own measurements ("~40–55 tok/s ·
measured: 3 chats"), any other model its estimate's range ("estimated from the model's shape").

One code path for every place that shows it (the library window, `runmyai list`, a hub repository's quant
table): `launch_estimate` of the model as the app would start it — the engine flags it gets (a preset's share of
the experts in RAM, `--ctx`), the footprint the engine reports for an installed file (`installed_estimate`),
else its preset's. Every sentence of the reasoning is written from the numbers it states.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from runmyai.engine.info import EngineInfo
from runmyai.engine.settings import DEFAULT_CONTEXT
from runmyai.library.local import LocalModel
from runmyai.library.presets import Preset
from runmyai.machine import DecodeProbe, MachineInfo
from runmyai.speeds import SpeedMeasurement, Spread, counted, model_speed, robust_set
from runmyai.units import SizeSum
from runmyai.units import human_bytes as hb

DISK_MARGIN = 256 << 20  # kept free beyond the file itself
DEFAULT_DRIVE_BPS = 1.0e9  # unmeasured drive: a modest NVMe (our virtual dev disk measures 1.0-1.3 GB/s)
# Hit rate vs cache share: h = f ** 0.3. Measured: the built-in model with 25 % and 40 % of its experts in RAM
# hits 71 % and 81 % (0.25 ** 0.25, 0.40 ** 0.23); the bench model (docs/results.md, engine table) 52 % and 72 %
# under 25 % and 40 % memory caps, where the caps also hold the process and the resident weights (cache shares
# of about 15 % and 31 %: 0.15 ** 0.35, 0.31 ** 0.28). 0.3 sits in the middle, slightly low for the small model.
HIT_EXPONENT = 0.3
# Those measurements, which the estimate's reasoning compares its curve with: (what, the share of the experts
# cached, the share of requests it served).
MEASURED_HITS: tuple[tuple[str, float, float], ...] = (
    ("the built-in model", 0.25, 0.71),
    ("the built-in model", 0.40, 0.81),
    ("the bench model", 0.15, 0.52),
    ("the bench model", 0.31, 0.72),
)
RUNS_WELL_TOKENS_PER_S = 5.0  # about reading speed

Verdict = Literal["runs_well", "runs_slowly", "no_disk_space", "unsupported"]


@dataclass(frozen=True)
class Calibration:
    """The engine's own cost per decoded token beyond reading weights, and the memory bandwidth it gets."""

    per_layer_s: float  # graph building, kernel launches and synchronisation per layer of one token
    per_token_s: float  # sampling, the output head's softmax, the HTTP stream, Python
    mem_bps: float  # effective bandwidth of the weight reads (a token's active bytes)
    source: str  # "measured by the autotuner on this machine" / "a default for this machine class"
    stream_factor: float = 1.0  # compute while experts stream, over compute with every expert in RAM
    hidden_io: float = 0.7  # share of the drive's read time hidden behind compute
    stream_layer_s: float = 0.0  # more per streamed layer while experts stream (a graph per layer, the waits)
    wait_s: float = 0.0  # a token's wait for the CPU on a busy machine, beyond computing (see MAX_COMPUTE_SLOWDOWN)
    # the fastest and slowest of the measurements this was calibrated on (None: not calibrated here): the range
    band: tuple[Calibration, Calibration] | None = None
    runs: tuple[SpeedMeasurement, ...] = ()  # the measurements it stands on

    def scaled(self, k: float, source: str, wait_s: float = 0.0) -> Calibration:
        """The same shape of costs on a machine k times slower at computing, and waiting `wait_s` a token."""
        return Calibration(
            self.per_layer_s * k,
            self.per_token_s * k,
            self.mem_bps / k,
            source,
            self.stream_factor,
            self.hidden_io,
            self.stream_layer_s * k,
            wait_s,
        )

    def streaming_s(self, in_ram_s: float, moe_layers: int) -> float:
        """A token's compute while experts stream, from its compute with every expert in RAM."""
        return in_ram_s * self.stream_factor + moe_layers * self.stream_layer_s


# Defaults for this machine class (a 2-core x86-64 VM), fitted to the engine's decode measured on an idle machine
# (docs/results.md, "The estimate", 2026-12-01): in RAM the built-in model (6 layers, 5.0 MB touched a token) at
# 0.31 ms a token and the bench model (12 layers, 471 MB) at 13.3 ms give the weights read at ~36 GB/s, 0.11 ms a
# token and 0.011 ms a layer (the one-graph decode step); under 40 % and 25 % caps the bench model's 37.0 and
# 47.2 ms a token give 29 % of its misses' read time at the probed drive speed left unhidden (hidden_io) and
# 0.4 ms more per streamed layer (a graph per layer and its waits: the per-layer path in RAM alone costs 0.55 ms
# a layer more than the one-graph step there). The built-in model's capped runs (2.35 and 2.52 ms a token) are
# then estimated within 0.8x.
DEFAULT_CALIBRATION = Calibration(
    per_layer_s=0.011e-3,
    per_token_s=0.11e-3,
    mem_bps=36e9,
    source="a default for this class of machine (the autotuner measures this one)",
    stream_factor=1.0,
    hidden_io=0.7,
    stream_layer_s=0.4e-3,
)


# How far a measurement may rescale the defaults: only one that cannot be a decode is refused. On this 2-core
# machine shared by five sessions (load average 10) the built-in model decoded at 1.49 tok/s after autotune, 0.67 s
# a token against the 0.32 ms the defaults predict (2,100x), and the chat then measured 1.7 tok/s.
MIN_SLOWDOWN, MAX_SLOWDOWN = 0.2, 10_000.0
# But such a run does not say every model computes 2,100x slower: taken as a multiplier of every cost (as it was),
# it made the 30B models read "~0.0 tok/s". A machine can be a few times slower at computing than this class's
# defaults (a laptop's RAM reads 10-15 GB/s against this VM's 36); beyond that, what a measurement shows is time
# its tokens spent not computing: waiting for a CPU among other programs, which every model's token waits alike.
# So a measured slowdown is a multiplier up to this factor, and the rest of its time an added wait per token.
MAX_COMPUTE_SLOWDOWN = 4.0
# The range an estimate is shown with. From the model's shape alone, on defaults fitted on another machine, it is
# wide: within 0.8x on the runs the defaults were fitted to, but this machine's CPU, RAM and load are not that
# one's. Calibrated here, the range is the one of the measurements it stands on, never narrower than the fit's
# own error (MODEL_SPREAD): the model's shape is still an estimate.
SHAPE_SPREAD = (0.5, 1.5)
MODEL_SPREAD = (0.8, 1.25)


def predicted_compute_s(layers: int, active_bytes: int, streamed: bool) -> float:
    """What this machine class's defaults predict a decoded token computes for (the autotuner's probe's shape)."""
    c = DEFAULT_CALIBRATION
    in_ram = c.per_token_s + layers * c.per_layer_s + active_bytes / c.mem_bps
    return c.streaming_s(in_ram, layers) if streamed else in_ram


def probe_measurement(
    p: DecodeProbe, model: str, tokens_per_s: float, at: float, load: float | None
) -> SpeedMeasurement:
    """The autotuner's decode probe as a measurement (runmyai.speeds)."""
    predicted = predicted_compute_s(p.layers, p.active_bytes, p.streamed)
    tps = tokens_per_s if tokens_per_s > 0 else 1.0 / p.compute_s
    return SpeedMeasurement(model, "autotune", tps, at, load, p.compute_s, predicted)


def _split(m: SpeedMeasurement) -> tuple[float, float]:
    """A measurement's (compute slowdown, wait a token): its slowdown up to MAX_COMPUTE_SLOWDOWN multiplies the
    costs, the rest of its time is a wait — but only a run made without heavy load passes its wait on. A run under
    heavy load measured the other programs as much as this machine: the self-test's one chat of the built-in model
    at load 15 on 2 cores (0.4 tok/s, 2.3 s a token beyond 4x its compute) made every hub model's card read
    ~0.3-0.5 tok/s, a 30B model as fast as the 22 M one. Its model's own card still shows what it measured; for
    the others it can say at most "this machine computes up to 4x slower" until a calmer run exists."""
    r = m.slowdown or 1.0
    k = min(MAX_COMPUTE_SLOWDOWN, max(MIN_SLOWDOWN, min(MAX_SLOWDOWN, r)))
    return k, 0.0 if m.heavy_load else max(0.0, m.compute_s - k * m.predicted_s)


def calibration_for(machine: MachineInfo) -> Calibration:
    """This machine's costs: the defaults of its class, scaled by what was measured here (autotune runs, chats):
    the median slowdown and wait of a robust set of the recent measurements (runmyai.speeds.robust_set), and the
    fastest and slowest of them as the band. An autotune result saved before measurements were kept counts as one."""
    c = DEFAULT_CALIBRATION
    runs = [m for m in machine.speeds if m.slowdown is not None]
    p = machine.decode_probe
    if not runs and p is not None:
        runs = [probe_measurement(p, p.model, 0.0, 0.0, None)]
    kept = robust_set(runs, lambda m: m.slowdown or 1.0)
    if not kept:
        return c
    parts = [_split(m) for m in kept]
    ks, waits = [k for k, _ in parts], [w for _, w in parts]
    k = math.exp(statistics.median(math.log(x) for x in ks))
    wait = statistics.median(waits)
    source = f"calibrated on {counted(kept)} here: {k:.2f}x this machine class's default"  # (the wait: its own line)
    fast, slow = c.scaled(min(ks), source, min(waits)), c.scaled(max(ks), source, max(waits))
    return dataclasses.replace(c.scaled(k, source, wait), band=(fast, slow), runs=tuple(kept))


@dataclass(frozen=True)
class Footprint:
    """What the estimate needs to know of a model, whether it comes from a preset or from a GGUF's header."""

    arch: str
    size_bytes: int  # the repacked file
    layers: int
    moe_layers: int
    experts: int  # routed experts per MoE layer
    top_k: int
    shared_experts: int
    expert_bytes: int  # one routed expert as stored in the repacked file
    dense_bytes_per_token: int  # always-used weights a token reads (attention, shared experts, dense layers, head)
    kv_bytes_per_token: int  # the KV cache one token of context takes (F16): the engine's number (0: not known)
    context: int = 0  # the model's own context length (0: not known)
    # the compute graph's reserve the engine plans for it: bytes, plus this much per token of context (`inspect
    # --json`'s graph_reserve; 0: not known)
    graph_bytes: int = 0
    graph_bytes_per_context_token: int = 0
    from_header: bool = True  # False: a preset's published facts, before the engine read the model's header
    # data the engine reads a few rows of from the drive instead of loading (qwen4exp's n-gram table: `inspect`'s
    # "lazy"): in the file, neither always loaded nor streamed as experts
    lazy_bytes: int = 0
    encoder_bytes: int = 0  # a vision model's image encoder started with it (`--mmproj`): resident beside it

    @property
    def expert_total_bytes(self) -> int:
        """All routed experts of all MoE layers: what is streamed from the drive."""
        return self.moe_layers * self.experts * self.expert_bytes

    @property
    def resident_bytes(self) -> int:
        """Everything else in the file (attention, shared experts, dense layers, embeddings) but what is read
        sparsely, and the image encoder where one is loaded: always in memory."""
        return max(0, self.size_bytes - self.expert_total_bytes - self.lazy_bytes) + self.encoder_bytes


def preset_footprint(preset: Preset) -> Footprint:
    """A preset's published facts as a footprint (the always-used part from its active parameters)."""
    f = preset.facts
    bytes_per_param = preset.expert_bytes / f.expert_params  # (0 until the engine's facts size the expert)
    dense_params = max(0.0, f.active_params - f.moe_layers * f.top_k * f.expert_params)
    return Footprint(
        arch=f.arch,
        size_bytes=preset.size_bytes,
        layers=f.layers,
        moe_layers=f.moe_layers,
        experts=f.experts,
        top_k=f.top_k,
        shared_experts=f.shared_experts,
        expert_bytes=preset.expert_bytes,
        dense_bytes_per_token=round(dense_params * bytes_per_param),
        kv_bytes_per_token=0,  # (the engine's, from the header: not known before it is read)
        context=f.context,
        from_header=False,
        lazy_bytes=round(f.sparse_params * bytes_per_param),  # (at the experts' quant, as the rest)
    )


def footprint_from_inspect(model: Mapping[str, Any], output_bytes: int) -> Footprint:
    """What the engine says of a model (`tokenwing inspect --json`, also the `model` part of a repack plan) as
    a footprint; KeyError/TypeError/ValueError when the answer lacks a part."""
    ex = model["experts"]
    layers = ex.get("layers") or []
    record = round(sum(int(el["record_bytes"]) for el in layers) / max(1, len(layers))) if layers else 0
    streamed = len(ex["streamed_layers"])
    block_count = model.get("block_count")
    graph = model.get("graph_reserve") or {}
    return Footprint(
        arch=str(model["architecture"]),
        size_bytes=output_bytes,
        layers=int(block_count) if isinstance(block_count, int) else streamed,
        moe_layers=streamed,
        experts=int(ex["count"]),
        top_k=int(ex["used_per_token"]),
        shared_experts=int(model.get("shared_experts") or 0),
        expert_bytes=record,
        dense_bytes_per_token=int(model["resident"].get("read_per_token_bytes", model["resident"]["bytes"])),
        kv_bytes_per_token=int(model.get("kv_bytes_per_token") or 0),
        context=int(model.get("context_length") or 0),
        lazy_bytes=int((model.get("lazy") or {}).get("bytes") or 0),
        graph_bytes=int(graph.get("bytes") or 0),
        graph_bytes_per_context_token=int(graph.get("per_context_token") or 0),
    )


def footprint_of(local: LocalModel, preset: Preset | None) -> Footprint | None:
    """An installed model's footprint: what the engine said of the file (`inspect --json`), else its preset's
    published facts; None when neither is known."""
    if local.facts is not None:
        try:
            return footprint_from_inspect(local.facts, local.size_bytes)
        except (KeyError, TypeError, ValueError):
            pass
    return preset_footprint(preset) if preset is not None else None


@dataclass(frozen=True)
class Estimate:
    tokens_per_s: float
    verdict: Verdict
    reasons: tuple[str, ...]  # the reasoning, one human line each, starting with "This is an estimate"
    hit_rate: float
    cache_bytes: int
    active_bytes: int = 0
    miss_bytes: float = 0.0
    io_seconds: float = 0.0
    compute_seconds: float = 0.0
    fits_in_memory: bool = True  # the always-loaded part plus the smallest cache fit in usable RAM
    cache_share: float = 1.0  # the expert cache's share of all routed experts
    swap_seconds: float = 0.0  # per token: copying the VRAM cache's newcomers to the GPU (at most)
    # the range it is shown with and where it comes from: "estimated from the model's shape", "measured: 3 chats"
    low_tokens_per_s: float = 0.0
    high_tokens_per_s: float = 0.0
    basis: str = "estimated from its shape"
    measured: bool = False  # the numbers are this model's own measurements here, not an estimate

    @property
    def speed(self) -> str:
        """The range as a card says it: "~40–55 tok/s", "~6.2 tok/s", "< 0.1 tok/s"."""
        return speed_range(self.low_tokens_per_s or self.tokens_per_s, self.high_tokens_per_s or self.tokens_per_s)


def _num(v: float) -> str:
    if v >= 9950:
        return f"{v / 1000:.0f}k"  # two figures, as below 10: "Runs well here · ~3.7k–11.1k tok/s" cut its card
    if v >= 999.5:
        return f"{v / 1000:.1f}k"  # (a card at its narrowest holds "~1.6k–2.5k", not "~1,650–2,450")
    return f"{v:.1f}" if v < 9.95 else f"{v:.0f}"


def speed_range(low: float, high: float) -> str:
    """tokens/s from `low` to `high` in a few characters; what rounds to 0.0 is said as under 0.1 (a card said
    "~0.0 tok/s")."""
    if high < 0.05:
        return "< 0.1 tok/s"
    if low < 0.05:
        return f"up to {_num(high)} tok/s"
    a, b = _num(low), _num(high)
    return f"~{a} tok/s" if a == b else f"~{a}–{b} tok/s"


def speed_words(tokens_per_s: float) -> str:
    """One speed in a sentence: "about 48.2 tokens/s", "under 0.1 tokens/s"."""
    return "under 0.1 tokens/s" if tokens_per_s < 0.05 else f"about {tokens_per_s:.1f} tokens/s"


# A GPU's own memory bandwidth (what its share of a token's weights is read at) is not measured (NVML does not
# report it, nor does the autotuner): this is a conservative figure for the 8-24 GB cards the app is for (an RTX
# 3060 has 360 GB/s, a 4090 1 TB/s). Copies between RAM and the GPU are another matter: see GpuPart.copy_bps.
GPU_BPS = 300e9
# RAM → VRAM copies (a VRAM swap's) where the autotuner has not measured this machine's GPU: pinned copies over a
# PCIe 4.0 x8 or 3.0 x16 link, ~12 GB/s, the slow end of the cards the app is for (4.0 x16 copies ~25 GB/s).
DEFAULT_GPU_COPY_BPS = 12e9


@dataclass(frozen=True)
class GpuPart:
    """What the engine's VRAM tier would hold: the share of the always-used weights (with their KV cache), the
    share of all routed experts, and the line saying so (empty: no GPU to speak of)."""

    dense_share: float = 0.0
    expert_share: float = 0.0
    line: str = ""
    copy_bps: float = DEFAULT_GPU_COPY_BPS  # RAM → VRAM, what a swap copies at
    copy_source: str = "assumed"  # where copy_bps comes from, for the reasons


def gpu_part(fp: Footprint, machine: MachineInfo, engine: EngineInfo, kv: int, graph: int) -> GpuPart:
    """The engine's placement in VRAM (layers' always-used weights and KV cache first, then experts), on the GPU
    it would compute on: one it lists that is not a CPU-type driver, with NVML's free VRAM where NVML knows it."""
    usable = [d for d in engine.devices if d.get("kind") not in (None, "cpu") and not d.get("software")]
    if not usable:
        if not machine.gpus:
            return GpuPart()
        vram = sum(g.vram_free for g in machine.gpus)
        return GpuPart(
            line=f"GPU: {len(machine.gpus)} with {hb(vram)} free VRAM; the installed engine sees no GPU it can use "
            "(no Vulkan or CUDA driver for it), so VRAM is not counted."
        )
    d = next((x for x in usable if x.get("kind") == "cuda"), usable[0])
    name = str(d.get("description") or d.get("name"))
    nvml = [g for g in machine.gpus if g.name and g.name in name]
    free = nvml[0].vram_free if nvml else _as_int(d.get("free"))
    total = nvml[0].vram_total if nvml else _as_int(d.get("total"))
    vram = max(0, free - engine.device_headroom_bytes(total) - graph)  # the engine's own rule, its graph's reserve
    dense = fp.resident_bytes + kv
    dense_share = min(1.0, vram / dense) if dense else 1.0
    left = max(0, vram - dense)
    expert_share = min(1.0, left / fp.expert_total_bytes) if fp.expert_total_bytes else 0.0
    placed = "all fit" if dense_share >= 1 else f"{dense_share:.0%} fit"
    copy, copy_bps = machine.gpu_copy, DEFAULT_GPU_COPY_BPS
    if copy is not None and copy.device == name:
        copy_bps, source = copy.up_bps, "measured by the autotuner on this machine"
    elif copy is not None:
        source = f"assumed: the autotuner measured another device, {copy.device}"
    else:
        source = "assumed; the autotuner measures it"
    return GpuPart(
        dense_share,
        expert_share,
        f"GPU: {name} with {hb(free)} free VRAM: of the always-used weights and the KV cache ({hb(dense)}) "
        f"{placed} there, and {expert_share:.0%} of the experts (the most used, swapped as the text moves on); "
        "it computes those while the CPU computes the rest.",
        copy_bps,
        source,
    )


def _as_int(v: object) -> int:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0


def hit_rate(cache_share: float) -> float:
    """Expected share of expert requests served from the cache, for a cache holding `cache_share` of them."""
    if cache_share >= 1.0:
        return 1.0
    if cache_share <= 0.0:
        return 0.0
    return float(cache_share**HIT_EXPONENT)


def hit_rate_reason(share: float) -> str:
    """The hit-rate line of the reasoning, written from the numbers: the rule, and how it compares with the
    measurement nearest to this share."""
    hits = hit_rate(share)
    what, m_share, m_hits = min(MEASURED_HITS, key=lambda m: abs(m[1] - share))
    rule = hit_rate(m_share)
    if abs(rule - m_hits) < 0.005:
        compared = "as the rule gives"
    else:
        compared = f"where the rule gives {rule:.0%}, {'more' if rule > m_hits else 'less'} than measured"
    return (
        f"Expected cache hit rate {hits:.0%}: the cache's share of the experts ({share:.0%}) to the power "
        f"{HIT_EXPONENT:g}, as routing favours some experts over others. Measured on {what}: {m_hits:.0%} of "
        f"requests served with {m_share:.0%} of the experts cached, {compared}."
    )


def active_bytes(fp: Footprint) -> tuple[int, int]:
    """(always-used bytes a token reads, routed-expert bytes a token reads)."""
    return fp.dense_bytes_per_token, fp.moe_layers * fp.top_k * fp.expert_bytes


def estimate(
    model: Preset | Footprint,
    machine: MachineInfo,
    engine: EngineInfo,
    *,
    installed: bool = False,
    context: int = DEFAULT_CONTEXT,
    calibration: Calibration | None = None,
    disk_needed: int | None = None,
    budget_share: float | None = None,
) -> Estimate:
    """Decode tokens/s of a model on `machine`, with the reasoning. `installed`: skip the disk-space check;
    `disk_needed`: what the download needs at its peak (default: the repacked file); `budget_share`: the
    engine is told to keep this share of the experts in RAM (`--ram-budget 25%`), when less than fits."""
    fp = preset_footprint(model) if isinstance(model, Preset) else model
    cal = calibration if calibration is not None else calibration_for(machine)
    if cal.runs:
        reasons = [
            f"This is an estimate from the model's shape, calibrated by what this machine measured ({counted(cal.runs)}"
            "), not a measurement of this model."
        ]
    else:
        reasons = ["This is an estimate from the model's shape and this machine, not a measurement."]

    dense_tok, experts_tok = active_bytes(fp)
    active = dense_tok + experts_tok
    reasons.append(
        f"Each token reads {hb(active)} of weights: {hb(dense_tok)} always used (attention, routers, "
        f"{'shared experts, ' if fp.shared_experts else ''}output) + {fp.top_k} experts × {fp.moe_layers} layers × "
        f"{_mb(fp.expert_bytes)}."
    )
    experts_all = fp.expert_total_bytes
    resident = fp.resident_bytes
    reasons.append(
        f"The file is {hb(fp.size_bytes)}: {hb(experts_all)} of routed experts streamed from the drive "
        f"({fp.experts} per layer), {hb(resident)} always loaded"
        + (f" (the image encoder's {hb(fp.encoder_bytes)} with it)." if fp.encoder_bytes else ".")
    )

    # ---- memory → cache size → hit rate
    # The headroom for other apps comes off free RAM, not off a memory limit (they live outside the group).
    headroom = engine.headroom_bytes
    room = machine.ram_available - headroom
    limit_note = ""
    if machine.ram_limit is not None:
        room = min(room, machine.ram_limit - machine.ram_limit_used)
        limit_note = f" ({hb(machine.ram_limit - machine.ram_limit_used)} left under the memory limit)"
    kv = fp.kv_bytes_per_token * context
    graph = fp.graph_bytes + fp.graph_bytes_per_context_token * context
    engine_bytes = engine.process_bytes + graph
    budget = room - engine_bytes - kv - resident
    minimum = fp.moe_layers * fp.top_k * fp.expert_bytes
    fits = budget >= minimum
    cache = int(min(max(budget, minimum), experts_all))
    if budget_share is not None:
        cache = max(minimum, min(cache, int(budget_share * experts_all)))
    share = cache / experts_all if experts_all else 1.0
    gpu = gpu_part(fp, machine, engine, kv, graph)
    hits = hit_rate(min(1.0, share + gpu.expert_share))  # (the RAM cache may hold some of the VRAM's experts too)
    reasons.append(
        f"Memory: {hb(machine.ram_available)} available{limit_note}; after {hb(headroom)} for other apps, "
        f"{hb(kv)} for a {context:,}-token context, {hb(engine_bytes)} for the engine and its compute buffers "
        f"and {hb(resident)} always loaded, the expert cache gets {hb(cache)}: {share:.0%} of the experts."
    )
    if machine.memory_error:
        reasons.append(f"Memory is not known: {machine.memory_error}.")
    if not fp.from_header:
        reasons.append(
            "Not counted yet: the KV cache and the compute buffers, whose sizes the engine reads from the model's "
            "header (when its quants are listed or it is downloaded); with them the cache is smaller."
        )
    if not fits:
        reasons.append(
            f"That is less than the engine's smallest cache ({hb(minimum)}, {fp.top_k} experts per layer): the "
            "system will page memory, so expect it to be slower than this estimate."
        )
    if gpu.line:
        reasons.append(gpu.line)
    if hits >= 1.0:
        reasons.append("Every expert fits in the cache: after warming up, the drive is no longer read.")
    else:
        reasons.append(hit_rate_reason(min(1.0, share + gpu.expert_share)))

    # ---- time per token
    miss = experts_tok * (1.0 - hits)
    drive = machine.drive_read_bps
    drive_bps = drive if drive and drive > 0 else DEFAULT_DRIVE_BPS
    io_s = miss / drive_bps * (1.0 - cal.hidden_io)
    if miss > 0:
        how = "measured" if drive else "assumed; not measured yet"
        reasons.append(
            f"Drive: {hb(miss)} of misses per token at {drive_bps / 1e9:.2f} GB/s ({how}), "
            f"{cal.hidden_io:.0%} of it hidden behind compute → {io_s * 1000:.0f} ms per token waiting for reads."
        )
    mem = machine.mem_bandwidth_bps or cal.mem_bps
    # the GPU reads its share of the dense part and the experts it holds (in parallel with the CPU's experts)
    vram_hits = hit_rate(gpu.expert_share) if gpu.expert_share > 0 else 0.0
    gpu_dense, gpu_experts = dense_tok * gpu.dense_share, experts_tok * vram_hits
    cpu_dense, cpu_experts = dense_tok - gpu_dense, experts_tok - gpu_experts
    streaming = hits < 1.0

    def token_parts(c: Calibration) -> tuple[float, float, float, float]:
        """(memory bandwidth, reads, the engine's work, compute) a token, with the costs of `c`."""
        bw = machine.mem_bandwidth_bps or c.mem_bps
        read = (cpu_dense + gpu_dense * bw / GPU_BPS + max(cpu_experts, gpu_experts * bw / GPU_BPS)) / bw
        work = c.per_token_s + fp.layers * c.per_layer_s
        return bw, read, work, (c.streaming_s(read + work, fp.moe_layers) if streaming else read + work)

    mem, read_s, work_s, compute_s = token_parts(cal)
    where = f"{hb(active)} read from memory at {hb(mem)}/s"  # a busy machine's can be MB/s ("0 GB/s" said)
    if gpu.line:
        where = (
            f"{hb(cpu_dense + cpu_experts)} read from RAM at {mem / 1e9:.0f} GB/s and {hb(gpu_dense + gpu_experts)} "
            f"from VRAM at {GPU_BPS / 1e9:.0f} GB/s (assumed)"
        )
    reasons.append(
        f"Compute: {where} ({read_s * 1000:.1f} ms) + the engine's work for {fp.layers} layers "
        f"({work_s * 1000:.1f} ms)"
        + (
            f", ×{cal.stream_factor:g} and {cal.stream_layer_s * 1000:g} ms more per layer while experts stream"
            if streaming
            else ""
        )
        + f" → {compute_s * 1000:.1f} ms per token ({cal.source})."
    )
    swap_s = 0.0
    if 0 < gpu.expert_share < 1:  # (none to swap when VRAM holds every expert, or none)
        # The main thread copies staged newcomers into VRAM between two steps: a token waits for those copies.
        per_token = engine.swaps_per_token_max
        if per_token:
            swap_s = per_token * fp.expert_bytes / gpu.copy_bps
            reasons.append(
                f"VRAM swaps: at most {per_token:g} experts a token (the engine's limit) × {_mb(fp.expert_bytes)} "
                f"copied to the GPU at {gpu.copy_bps / 1e9:.1f} GB/s ({gpu.copy_source}) → up to "
                f"{swap_s * 1000:.1f} ms per token, counted in full (fewer once the VRAM holds what the text uses)."
            )
        else:
            reasons.append("VRAM swaps: the installed engine does not say how many it makes; not counted.")
    if cal.wait_s > 0:
        reasons.append(
            f"Waiting for the CPU: {cal.wait_s * 1000:.0f} ms a token, what the measurements here took beyond "
            f"computing ({MAX_COMPUTE_SLOWDOWN:g}x this machine class's compute at most): other programs' share of it."
        )
    seconds = io_s + compute_s + swap_s + cal.wait_s
    tps = 1.0 / seconds if seconds > 0 else 0.0
    if cal.band is not None:  # the fastest and slowest measurements' calibrations, widened to the model's own error
        slow_s, fast_s = (io_s + token_parts(c)[3] + swap_s + c.wait_s for c in (cal.band[1], cal.band[0]))
        low = min(1.0 / slow_s, tps * MODEL_SPREAD[0])
        high = max(1.0 / fast_s, tps * MODEL_SPREAD[1])
        basis = f"estimated, calibrated by {len(cal.runs)} run{'s' if len(cal.runs) != 1 else ''}"
    else:
        low, high = tps * SHAPE_SPREAD[0], tps * SHAPE_SPREAD[1]
        basis = "estimated from its shape"
    reasons.append(
        f"{speed_words(tps)[0].upper()}{speed_words(tps)[1:]} ({seconds * 1000:,.0f} ms per token); shown as "
        f"{speed_range(low, high)}: "
        + (
            "the fastest and slowest of the measurements here, at least the estimate's own error."
            if cal.band is not None
            else "from the model's shape alone, on defaults from another machine, it may be off by half either way."
        )
    )

    # ---- disk and verdict
    files = disk_needed if disk_needed is not None else fp.size_bytes
    disk_ok = installed or machine.disk_free >= files + DISK_MARGIN
    if not installed:
        peak = "at the peak of its download and repack" if disk_needed is not None else "for the model"
        reasons.append(disk_reason(files, peak, machine.disk_free))
    verdict: Verdict
    if not engine.runs(fp.arch):
        verdict = "unsupported"
        if engine.known:
            reasons.append(
                f"Not yet: the installed engine runs {', '.join(sorted(engine.architectures))}; not {fp.arch}."
            )
        else:
            reasons.append(f"Unknown: {engine.error}.")
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
        cache_share=share,
        swap_seconds=swap_s,
        low_tokens_per_s=low,
        high_tokens_per_s=high,
        basis=basis,
    )


def measured_estimate(est: Estimate, measured: Spread) -> Estimate:
    """An installed model's estimate once it was measured here: its own measurements' median and range, where
    they came from, and the verdict they give; the estimate's reasoning stays below, for comparison."""
    verdict = est.verdict
    if verdict in ("runs_well", "runs_slowly"):
        verdict = "runs_well" if measured.median >= RUNS_WELL_TOKENS_PER_S and est.fits_in_memory else "runs_slowly"
    dropped = measured.total - len(measured.kept)
    runs = counted(measured.kept)
    if len(measured.kept) > 1:
        runs = f"the median of {runs}; {speed_range(measured.low, measured.high)} from the slowest to the fastest"
    set_aside = (
        f"; {dropped} older, outlying or heavy-load run{'s' if dropped != 1 else ''} set aside" if dropped else ""
    )
    line = f"Measured on this machine: {speed_words(measured.median)} ({runs}{set_aside})."
    rest = est.reasons[1:]
    words = {"runs_well": "Runs well", "runs_slowly": "Runs slowly"}
    tail = [r for r in rest if not r.startswith(("Runs well:", "Runs slowly:"))]
    if verdict in words:
        tail.append(
            f"{words[verdict]}: {'at least' if verdict == 'runs_well' else 'under'} {RUNS_WELL_TOKENS_PER_S:.0f} "
            "tokens/s as measured" + ("." if est.fits_in_memory else ", and memory is short.")
        )
    return dataclasses.replace(
        est,
        tokens_per_s=measured.median,
        verdict=verdict,
        reasons=(line, "For comparison, the estimate from the model's shape and this machine, worked out:", *tail),
        low_tokens_per_s=measured.low,
        high_tokens_per_s=measured.high,
        basis=measured.provenance,
        measured=True,
    )


def launch_flags_share(flags: Sequence[str]) -> float | None:
    """The share of the experts `--ram-budget N%` keeps in RAM, the last one given winning as in the engine's
    parser; None without one, or with a size (the engine then sizes the cache by bytes: not modelled)."""
    share = None
    for i, a in enumerate(flags[:-1]):
        if a == "--ram-budget":
            value = flags[i + 1]
            share = float(value[:-1]) / 100 if value.endswith("%") and _is_number(value[:-1]) else None
    return share


def launch_flags_encoder_bytes(flags: Sequence[str]) -> int:
    """The image encoder `--mmproj FILE` loads beside the model: its file's size (its weights stay resident: the
    vision tower is dense); 0 without one."""
    for i, a in enumerate(flags[:-1]):
        if a == "--mmproj":
            with contextlib.suppress(OSError):
                return os.path.getsize(flags[i + 1])
    return 0


def launch_flags_context(flags: Sequence[str]) -> int | None:
    """The context `--ctx N` asks for (the last one given), None without one."""
    ctx = None
    for i, a in enumerate(flags[:-1]):
        if a == "--ctx" and flags[i + 1].isdigit() and int(flags[i + 1]) > 0:
            ctx = int(flags[i + 1])
    return ctx


def disk_reason(files: int, what: str, free: int) -> str:
    """An estimate's disk line, "Disk: needs N (F what + M kept free); X free in the models folder — S short.",
    whose sums add up as shown (runmyai.units.SizeSum; issue 29, defect 5: the shortfall counted the margin, the
    "needs" did not)."""
    short = files + DISK_MARGIN - free
    u: SizeSum | None = SizeSum(files, DISK_MARGIN, free)
    while u is not None:
        need = u.q(files) + u.q(DISK_MARGIN)
        if (need - u.q(free) > 0) == (short > 0):  # else rounding turned a shortfall into none, or back
            break
        u = u.finer()
    assert u is not None  # in whole bytes the shown sums are the true ones
    line = (
        f"Disk: needs {u.text(need)} ({u.text(u.q(files))} {what} + {u.text(u.q(DISK_MARGIN))} kept free); "
        f"{u.text(u.q(free))} free in the models folder"
    )
    return line + (f" — {u.text(need - u.q(free))} short." if short > 0 else ".")


def launch_estimate(
    model: Preset | Footprint,
    machine: MachineInfo,
    engine: EngineInfo,
    flags: Sequence[str] = (),
    *,
    installed: bool = False,
    disk_needed: int | None = None,
    calibration: Calibration | None = None,
) -> Estimate:
    """The estimate of a model as the app would start it with these engine `flags` (a preset's, then autotune's
    and the user's overrides): their `--ram-budget` share of the experts and `--ctx`; without `--ctx`, the chat
    context the app gives a model (DEFAULT_CONTEXT, at most the model's own). Every view of an estimate comes
    through here, so the window, `runmyai list` and the quant table agree."""
    fp = preset_footprint(model) if isinstance(model, Preset) else model
    encoder = launch_flags_encoder_bytes(flags)
    if encoder:
        fp = dataclasses.replace(fp, encoder_bytes=encoder)
    context = launch_flags_context(flags)
    if context is None:
        context = min(DEFAULT_CONTEXT, fp.context) if fp.context else DEFAULT_CONTEXT
    return estimate(
        fp,
        machine,
        engine,
        installed=installed,
        context=context,
        calibration=calibration,
        disk_needed=disk_needed,
        budget_share=launch_flags_share(flags),
    )


def installed_estimate(
    local: LocalModel,
    preset: Preset | None,
    machine: MachineInfo,
    engine: EngineInfo,
    flags: Sequence[str] = (),
    *,
    calibration: Calibration | None = None,
) -> Estimate | None:
    """An installed model's estimate, with or without a preset: None for a file that cannot be used or whose
    facts are not known."""
    fp = footprint_of(local, preset)
    if fp is None or local.error is not None:
        return None
    est = launch_estimate(fp, machine, engine, flags, installed=True, calibration=calibration)
    measured = model_speed(machine.speeds, local.path) if calibration is None else None
    return measured_estimate(est, measured) if measured is not None else est


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else hb(n)
