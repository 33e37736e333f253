"""What this machine really did: the decode speeds its autotuner runs and its finished chat replies measured, kept
per model in one small JSON file under the app's settings, and the robust statistics "Will it run here?" takes from
them (docs/app-library.md, "The estimate").

Why several and robust: on a busy machine one measurement says little. The walk-through's built-in model measured
334.8, 0.5 and 75.6 tok/s in three runs on one 2-core machine shared by seven sessions, and the estimate, which took
the newest run alone, said each in turn; one slow run made every other model read "~0.0 tok/s". Here a model's
speed is the median of its recent runs, outliers dropped, with the range of the rest; runs made under heavy load
count only where no calmer ones exist.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from runmyai.jsonfile import read_json, write_json_atomic

SPEEDS_FILE = "measured-speeds.json"
KEEP_PER_MODEL = 12  # the newest measurements kept per model: the file stays small, old machines' runs age out
RECENT = 12  # the measurements a statistic looks at (per model; twice that for the machine as a whole)
# A run counts as made under heavy load when the 1-minute load average was at least this many runnable tasks per
# core. The engine's own threads are part of that average (one per core while it decodes), so 2.0 means at least
# as many other programs wanted the CPU as the engine did: it got half the machine or less, and measured the
# other programs as much as this machine. Such runs are set aside while a calmer run exists (MIN_CALM); where
# none do (a machine that is always this busy), they are what the user gets, and they stand.
HEAVY_LOAD_PER_CORE = 2.0
MIN_CALM = 1
# A run more than this factor from the median of its set is an outlier (a run that started while something else
# loaded the disk, a reply that waited on a tool): dropped, once there are at least 3 runs to tell the median by.
OUTLIER_FACTOR = 3.0
MIN_CHAT_TOKENS = 16  # a shorter reply's rate is mostly its first steps (page faults, graph set-up): not recorded

Source = Literal["autotune", "chat"]
_lock = threading.Lock()  # one read-modify-write of the file at a time (the app writes it from worker threads)


@dataclass(frozen=True)
class SpeedMeasurement:
    """One decode measured on this machine: what it ran at, and what the estimate's class defaults predicted for
    the same model as launched (the ratio calibrates every other model's estimate)."""

    model: str  # the model file's path, as text
    source: Source
    tokens_per_s: float  # as the user saw it (the chat footer, the autotuner's decode)
    at: float  # unix time
    load: float | None  # the 1-minute load average per core when it finished (None: not known on this system)
    compute_s: float  # seconds a token spent computing: 1 / tokens_per_s less the wait for the drive
    predicted_s: float  # what the class defaults predict for that compute (0: not known)

    @property
    def slowdown(self) -> float | None:
        """How much slower this machine computed than the class defaults predict (None: no prediction)."""
        return self.compute_s / self.predicted_s if self.predicted_s > 0 and self.compute_s > 0 else None

    @property
    def heavy_load(self) -> bool:
        return self.load is not None and self.load >= HEAVY_LOAD_PER_CORE


def load_per_core() -> float | None:
    """The 1-minute load average per core this process may use; None where the system has none (Windows)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return load / max(1, cores)


def _parse(item: object) -> SpeedMeasurement | None:
    if not isinstance(item, dict):
        return None
    try:
        m = SpeedMeasurement(
            model=str(item["model"]),
            source="chat" if item.get("source") == "chat" else "autotune",
            tokens_per_s=float(item["tokens_per_s"]),
            at=float(item.get("at") or 0.0),
            load=float(item["load"]) if isinstance(item.get("load"), int | float) else None,
            compute_s=float(item["compute_s"]),
            predicted_s=float(item.get("predicted_s") or 0.0),
        )
    except (KeyError, TypeError, ValueError):
        return None
    ok = all(math.isfinite(v) for v in (m.tokens_per_s, m.compute_s, m.predicted_s))
    return m if ok and m.tokens_per_s > 0 and m.compute_s > 0 else None


def read_speeds(folder: Path) -> tuple[SpeedMeasurement, ...]:
    """Every measurement saved in `folder` (a damaged file or entry counts as none), oldest first."""
    data = read_json(folder / SPEEDS_FILE) or {}
    raw = data.get("measurements")
    found = [m for m in (_parse(x) for x in (raw if isinstance(raw, list) else [])) if m is not None]
    return tuple(sorted(found, key=lambda m: m.at))


def record_speed(folder: Path, m: SpeedMeasurement) -> tuple[SpeedMeasurement, ...]:
    """Adds a measurement (keeping each model's newest KEEP_PER_MODEL), written atomically; returns them all.
    Raises OSError when the file cannot be written (the caller carries on without it)."""
    with _lock:
        kept = [*read_speeds(folder), m]
        per_model = Counter(x.model for x in kept)
        out: list[SpeedMeasurement] = []
        for x in kept:  # oldest first: a model's oldest go while it has more than it keeps
            if per_model[x.model] > KEEP_PER_MODEL:
                per_model[x.model] -= 1
                continue
            out.append(x)
        write_json_atomic(folder / SPEEDS_FILE, {"measurements": [asdict(x) for x in out]})
        return tuple(out)


def chat_measurement(
    model: Path,
    tokens_per_s: float | None,
    tokens: int | None,
    predicted_s: float,
    io_s: float,
    *,
    load: float | None = None,
    at: float | None = None,
) -> SpeedMeasurement | None:
    """A finished reply's speed as a measurement, or None when it says too little: no rate, or fewer than
    MIN_CHAT_TOKENS tokens. `predicted_s` and `io_s`: the class defaults' compute and drive wait a token for this
    model as launched (the wait is taken out of the measured time as the autotuner's decode takes it out)."""
    if not tokens_per_s or tokens_per_s <= 0 or not math.isfinite(tokens_per_s) or (tokens or 0) < MIN_CHAT_TOKENS:
        return None
    compute = max(1e-6, 1.0 / tokens_per_s - max(0.0, io_s))
    return SpeedMeasurement(
        str(model), "chat", tokens_per_s, time.time() if at is None else at, load, compute, max(0.0, predicted_s)
    )


# ---------------------------------------------------------------------------------------------- statistics
def robust_set(ms: Sequence[SpeedMeasurement], value: Callable[[SpeedMeasurement], float]) -> list[SpeedMeasurement]:
    """The measurements a statistic stands on: the newest RECENT, those under heavy load set aside while a calmer
    one exists, then (with 3 or more) those more than OUTLIER_FACTOR from the median dropped."""
    recent = sorted(ms, key=lambda m: m.at)[-RECENT:]
    calm = [m for m in recent if not m.heavy_load]
    pool = calm if len(calm) >= MIN_CALM else recent
    if len(pool) < 3:
        return pool
    mid = statistics.median(math.log(value(m)) for m in pool)
    return [m for m in pool if abs(math.log(value(m)) - mid) <= math.log(OUTLIER_FACTOR)]


@dataclass(frozen=True)
class Spread:
    """A robust statistic: the median and the range of the measurements it kept, and which they were."""

    median: float
    low: float
    high: float
    kept: tuple[SpeedMeasurement, ...]
    total: int  # measurements looked at, before any was set aside

    @property
    def provenance(self) -> str:
        """Where the numbers come from, for the card: "measured: 3 chats", "measured: autotune and 2 chats"."""
        return "measured: " + counted(self.kept)


def counted(ms: Iterable[SpeedMeasurement]) -> str:
    """'autotune', '2 autotunes', '3 chats', 'autotune, 1 chat' (a card at its narrowest holds ~30 characters)."""
    n = Counter(m.source for m in ms)
    parts = []
    if n["autotune"]:
        parts.append("autotune" if n["autotune"] == 1 else f"{n['autotune']} autotunes")
    if n["chat"]:
        parts.append(f"{n['chat']} chat{'s' if n['chat'] != 1 else ''}")
    return ", ".join(parts) or "nothing"


def spread(ms: Sequence[SpeedMeasurement], value: Callable[[SpeedMeasurement], float]) -> Spread | None:
    kept = robust_set(ms, value)
    if not kept:
        return None
    values = [value(m) for m in kept]
    mid = math.exp(statistics.median(math.log(v) for v in values))  # (in logs: the middle of two is their ratio's)
    return Spread(mid, min(values), max(values), tuple(kept), len(ms))


def model_speed(ms: Sequence[SpeedMeasurement], model: Path | str) -> Spread | None:
    """A model's measured tokens/s on this machine: the median and range of its robust set; None if unmeasured."""
    own = [m for m in ms if m.model == str(model)]
    return spread(own, lambda m: m.tokens_per_s) if own else None
