"""A model's load options, as LM Studio's load dialog has them (Qt-free): the context length and the GPU offload,
chosen per model when it loads, kept per model (and machine) and passed on the engine's command line.

* What fits here comes from the engine: `tokenwing info MODEL --json` says the context one `serve` slot gets on
  this machine now (`model.parallel_auto.context`, from free memory and the model's KV cache per token) and the
  devices ggml sees (a GPU with its free VRAM, or the CPU alone). The model's own maximum is its file's.
* The choice is kept with the model's other engine overrides (AutotuneRunner's overrides file: `ctx`, `device`,
  `vram_budget`, `vram_layers`), so every later start of that model, from the picker too, uses it; the global
  context length in Settings applies only to a model without its own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runmyai.engine.autotune import AutotuneRunner
from runmyai.engine.command import FlagValue, engine_command, run_engine
from runmyai.units import human_bytes

MIN_CONTEXT = 256  # below this a chat template and one question do not fit
INFO_TIMEOUT_S = 120.0
KEYS = ("ctx", "device", "vram_budget", "vram_layers")  # the overrides this dialog owns
DEVICES = ("auto", "cpu", "vulkan", "cuda")  # the engine's --device choices


class LoadError(Exception):
    """The engine could not say what fits (one sentence)."""


@dataclass(frozen=True)
class Gpu:
    kind: str  # "vulkan" or "cuda": the --device that picks it
    name: str  # "NVIDIA H100 80GB HBM3"
    free: int
    total: int
    software: bool = False  # a driver that computes on the CPU (lavapipe): no offload worth offering


@dataclass(frozen=True)
class LoadFacts:
    """What the engine says about a model here, now."""

    fits_context: int | None  # the context one slot gets with this machine's free memory
    max_context: int | None  # the model's own (trained) context length
    gpus: tuple[Gpu, ...] = ()
    kv_bytes_per_token: int | None = None

    @property
    def default_context(self) -> int | None:
        """What fits here, at most the model's maximum."""
        if self.fits_context and self.max_context:
            return min(self.fits_context, self.max_context)
        return self.fits_context or self.max_context

    @property
    def offload(self) -> bool:
        """Whether there is a GPU to offload to (a software Vulkan driver is not one)."""
        return any(not g.software for g in self.gpus)

    def context_note(self) -> str:
        parts = []
        if self.fits_context:
            parts.append(f"{self.fits_context:,} tokens fit in the memory free now")
        if self.max_context:
            parts.append(f"the model's maximum is {self.max_context:,}")
        if self.kv_bytes_per_token:
            parts.append(f"{human_bytes(self.kv_bytes_per_token * 1024)} of memory per 1,024 tokens")
        text = "; ".join(parts)
        return text[:1].upper() + text[1:] + "." if parts else ""

    def gpu_note(self) -> str:
        real = [g for g in self.gpus if not g.software]
        if not real:
            return "No GPU here: the model runs on the CPU (GPU offload is unavailable)."
        return "; ".join(f"{g.name}: {human_bytes(g.free)} free of {human_bytes(g.total)}" for g in real) + "."


@dataclass(frozen=True)
class LoadOptions:
    """The user's choice; None leaves the engine's (or the app's) default."""

    context: int | None = None
    device: str | None = None  # auto, cpu, vulkan, cuda
    vram_budget: str | None = None  # a size (8G) or a share of the free VRAM (80%)
    vram_layers: int | None = None

    def values(self) -> dict[str, FlagValue | None]:
        return {"ctx": self.context, "device": self.device, "vram_budget": self.vram_budget,
                "vram_layers": self.vram_layers}  # fmt: skip


def parse_facts(info: object, max_context: int | None) -> LoadFacts:
    """`tokenwing info MODEL --json`'s answer; ValueError where it is not one."""
    if not isinstance(info, dict):
        raise ValueError("not an object")
    model = info.get("model")
    par = model.get("parallel_auto") if isinstance(model, dict) else None
    fits = par.get("context") if isinstance(par, dict) else None
    kv = model.get("kv_bytes_per_token") if isinstance(model, dict) else None
    gpus = []
    for d in info.get("devices") or []:
        if isinstance(d, dict) and d.get("kind") in ("vulkan", "cuda") and d.get("type") != "cpu":
            gpus.append(Gpu(str(d["kind"]), str(d.get("description") or d.get("name")), _int(d.get("free")),
                            _int(d.get("total")), bool(d.get("software"))))  # fmt: skip
    return LoadFacts(
        fits_context=fits if isinstance(fits, int) and fits > 0 else None,
        max_context=max_context if max_context and max_context > 0 else None,
        gpus=tuple(gpus),
        kv_bytes_per_token=kv if isinstance(kv, int) and kv > 0 else None,
    )


def _int(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


async def ask_facts(model: Path, max_context: int | None, command: Sequence[str] | None = None) -> LoadFacts:
    """Asks the engine (`tokenwing info MODEL --json`: the model's header and this machine's memory and devices,
    no weight loaded). LoadError in one sentence where it cannot answer."""
    argv = [*(command if command is not None else engine_command()), "info", str(model), "--json"]
    try:
        code, out, last = await run_engine(argv, INFO_TIMEOUT_S)
    except OSError as e:
        raise LoadError(f"The engine could not be started ({e.strerror or e}).") from None
    if code != 0:
        raise LoadError(f"The engine could not read the model: {last.removeprefix('tokenwing: ')}")
    try:
        return parse_facts(json.loads(out), max_context)
    except ValueError:
        raise LoadError("The engine's `tokenwing info` answer could not be read.") from None


def saved_options(autotune: AutotuneRunner, model: Path) -> LoadOptions:
    """The options kept for this model (none chosen: all None)."""
    o = autotune.overrides(model)
    ctx, layers = o.get("ctx"), o.get("vram_layers")
    device, budget = o.get("device"), o.get("vram_budget")
    return LoadOptions(
        context=int(ctx) if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else None,
        device=str(device) if device in DEVICES else None,
        vram_budget=str(budget) if isinstance(budget, str | int) and not isinstance(budget, bool) else None,
        vram_layers=int(layers) if isinstance(layers, int) and not isinstance(layers, bool) and layers >= 0 else None,
    )


def check_options(options: LoadOptions, facts: LoadFacts) -> LoadOptions:
    """The choice made safe to start with: the context within [MIN_CONTEXT, the model's maximum], no GPU settings
    where there is no GPU. ValueError (one sentence) for a VRAM budget the engine would refuse."""
    ctx = options.context
    if ctx is not None:
        ctx = max(MIN_CONTEXT, ctx)
        if facts.max_context:
            ctx = min(ctx, facts.max_context)
    if not facts.offload:
        return LoadOptions(context=ctx, device="cpu" if options.device == "cpu" else None)
    budget = (options.vram_budget or "").strip() or None
    if budget is not None and not _budget_ok(budget):
        raise ValueError(f"“{budget}” is not a VRAM budget: write a size (8G, 512M) or a share (80%).")
    return LoadOptions(ctx, options.device if options.device in DEVICES else None, budget, options.vram_layers)


def _budget_ok(text: str) -> bool:
    t = text.strip().upper()
    if t.endswith("%"):
        return t[:-1].replace(".", "", 1).isdigit() and 0 < float(t[:-1]) <= 100
    t = t.removesuffix("IB").removesuffix("B")
    if t and t[-1] in "KMGT":
        t = t[:-1]
    return t.replace(".", "", 1).isdigit() and float(t) > 0


def save_options(autotune: AutotuneRunner, model: Path, options: LoadOptions) -> dict[str, FlagValue]:
    """Keeps the choice with the model's other overrides (those it does not own are left as they are)."""
    current: dict[str, Any] = {k: v for k, v in autotune.overrides(model).items() if k not in KEYS}
    current.update({k: v for k, v in options.values().items() if v is not None})
    return autotune.set_overrides(model, current)


def has_own_context(autotune: AutotuneRunner, model: Path) -> bool:
    return saved_options(autotune, model).context is not None
