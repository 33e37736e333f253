"""Why the engine stopped, from its exit code and its log, as one sentence a user can act on.

What each exit code means is the engine's to say (`tokenwing info --json`'s `exit_codes`, `EngineInfo.exit_codes`:
bad input, corrupt model file, unsupported, no disk space, …): the app words each kind it knows, and an exit
code the engine does not name is a crash with the engine's own line. A negative code is the signal that ended it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

FaultKind = Literal[
    "out_of_memory", "corrupt_model", "unsupported", "bad_input", "no_disk_space", "crash", "start_failed", "stalled"
]

# After these the supervisor restarts the engine (with backoff); the others would fail the same way again.
RESTARTABLE: frozenset[FaultKind] = frozenset({"crash", "stalled"})

_OOM_WORDS = (
    "out of memory",
    "cannot allocate memory",
    "memoryerror",
    "std::bad_alloc",
    "failed to allocate",
    "errno 12",
)


class EngineError(Exception):
    """The engine could not be started or stopped working; str() is one human sentence."""

    def __init__(self, sentence: str, fault: Fault | None = None) -> None:
        super().__init__(sentence)
        self.fault = fault


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    sentence: str
    exit_code: int | None
    detail: str | None = None  # the engine's own error line, when it printed one

    @property
    def restartable(self) -> bool:
        return self.kind in RESTARTABLE


def engine_error_line(log: Sequence[str]) -> str | None:
    """The engine's last `tokenwing: error: ...` line (or argparse's `... error: ...`), without the prefix."""
    for line in reversed(log):
        text = line.strip()
        if text.startswith("tokenwing: error: "):
            return text.removeprefix("tokenwing: error: ").strip()
        if text.startswith("tokenwing ") and ": error: " in text:  # argparse: "tokenwing serve: error: ..."
            return text.split(": error: ", 1)[1].strip()
    return None


def _last_exception_line(log: Sequence[str]) -> str | None:
    in_traceback = False
    last: str | None = None
    for line in log:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line and not line.startswith((" ", "\t")):
            last, in_traceback = line.strip(), False
    return last


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _sentence_detail(detail: str | None) -> str:
    if not detail:
        return ""
    d = detail.rstrip(".")
    return f": {d}" if len(d) <= 300 else f": {d[:297]}..."


def classify_exit(
    exit_code: int | None,
    log: Sequence[str],
    *,
    oom_killed: bool = False,
    exit_codes: Mapping[str, int] | None = None,
) -> Fault:
    """The fault behind an engine exit. `oom_killed`: the kernel's OOM counter rose while it ran; `exit_codes`: the
    engine's names of its exit codes (`EngineInfo.exit_codes`)."""
    detail = engine_error_line(log)
    text = "\n".join(log[-200:]).lower()
    kind = next((k for k, c in (exit_codes or {}).items() if c == exit_code), None) if exit_code else None
    if oom_killed or any(w in text for w in _OOM_WORDS):
        return Fault(
            "out_of_memory",
            "The engine ran out of memory; close other programs or choose a smaller RAM budget for this model.",
            exit_code,
            detail,
        )
    if kind == "corrupt_model":
        return Fault(
            "corrupt_model",
            "The model file is damaged (it fails its own checksums); delete it and download it again.",
            exit_code,
            detail,
        )
    if kind == "unsupported":
        return Fault(
            "unsupported",
            "This version of the engine cannot run this model (its architecture or file format is not supported)"
            + _sentence_detail(detail)
            + ".",
            exit_code,
            detail,
        )
    if kind == "bad_input":
        return Fault(
            "bad_input",
            "The engine could not use the model file or one of its settings" + _sentence_detail(detail) + ".",
            exit_code,
            detail,
        )
    if kind == "no_disk_space":
        return Fault(
            "no_disk_space",
            "The drive is full: the engine could not write a file it needs"
            + _sentence_detail(detail)
            + ". Free some space on that drive, then start the model again.",
            exit_code,
            detail,
        )
    if exit_code is not None and exit_code < 0:
        name = _signal_name(-exit_code)
        return Fault("crash", f"The engine crashed ({name}).", exit_code, detail)
    exc = _last_exception_line(log)
    what = detail or exc or (f"exit code {exit_code}" if exit_code is not None else "no exit code")
    return Fault("crash", "The engine stopped unexpectedly" + _sentence_detail(what) + ".", exit_code, detail or exc)


def start_failed(reason: str) -> Fault:
    return Fault("start_failed", "The engine could not be started" + _sentence_detail(reason) + ".", None, reason)


def stalled(seconds: float, loading: bool) -> Fault:
    what = (
        f"did not finish loading the model in {seconds:.0f} s" if loading else f"stopped responding for {seconds:.0f} s"
    )
    return Fault("stalled", f"The engine {what}.", None, None)


def gave_up(fault: Fault, restarts: int) -> Fault:
    """The fault that ends the restarts: the same, with how often it was tried."""
    if restarts <= 0:
        return fault
    times = "restart" if restarts == 1 else "restarts"
    return replace(fault, sentence=f"{fault.sentence.rstrip('.')}, even after {restarts} {times}.")


def oom_kill_count() -> int | None:
    """The kernel's count of OOM kills in this process's memory cgroup (v2 memory.events, v1 oom_control).

    The engine runs in the app's cgroup, so a rise while it ran, together with SIGKILL, means the OOM killer.
    None when no counter is readable (not Linux, or no memory controller visible).
    """
    if not os.path.exists("/proc/self/cgroup"):
        return None
    candidates: list[Path] = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if controllers == "":
                candidates += [Path("/sys/fs/cgroup", rel, "memory.events"), Path("/sys/fs/cgroup/memory.events")]
            elif "memory" in controllers.split(","):
                candidates += [
                    Path("/sys/fs/cgroup/memory", rel, "memory.oom_control"),
                    Path("/sys/fs/cgroup/memory/memory.oom_control"),
                ]
    except (OSError, ValueError):
        return None
    for c in candidates:
        try:
            for line in c.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None
