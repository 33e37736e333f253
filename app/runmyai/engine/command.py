"""How the app runs the `tokenwing` command: the bundled executable when frozen, else this Python's module.

The app never imports `tokenwing`; everything goes through this command line and the HTTP API.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

FlagValue = str | int | float | bool

# Flags the supervisor owns: an override may not change where the server listens or how it is watched.
RESERVED_FLAGS = frozenset({"host", "port", "watch_stdin", "model", "help", "version"})


def engine_command() -> list[str]:
    """The argv prefix that runs `tokenwing` (append a subcommand and its arguments)."""
    if getattr(sys, "frozen", False):
        exe = "tokenwing.exe" if os.name == "nt" else "tokenwing"
        return [str(Path(sys.executable).resolve().parent / exe)]
    return [sys.executable, "-m", "tokenwing"]


def flag_args(values: Mapping[str, FlagValue | None]) -> list[str]:
    """`{"ram_budget": 123, "moe_stream_direct": False}` -> `["--ram-budget", "123", "--no-moe-stream-direct"]`.

    Booleans map to the engine's `--flag` / `--no-flag` pairs; None leaves the flag out (the engine's default).
    """
    out: list[str] = []
    for key, value in values.items():
        if value is None:
            continue
        name = key.replace("_", "-")
        if isinstance(value, bool):
            out.append(f"--{name}" if value else f"--no-{name}")
        else:
            out += [f"--{name}", str(value)]
    return out


def check_flag_name(key: str) -> str:
    """A setting name usable as a flag (`ram_budget`, `moe_stream_io_threads`); ValueError otherwise."""
    k = key.strip().lstrip("-").replace("-", "_")
    if not k or not all(c.isascii() and (c.isalnum() or c == "_") for c in k) or not k[0].isalpha():
        raise ValueError(f"{key!r} is not an engine setting name")
    if k in RESERVED_FLAGS:
        raise ValueError(f"--{k.replace('_', '-')} is set by the app and cannot be overridden")
    return k


def display_line(argv: Sequence[str]) -> str:
    """The command line as one string for the log (it never holds a key: keys travel in the environment)."""
    return " ".join(a if a and " " not in a else repr(a) for a in argv)


async def run_engine(argv: Sequence[str], timeout_s: float) -> tuple[int, bytes, str]:
    """Runs a short engine command (`tokenwing info …`) to its end: (exit code, stdout, stderr's last line). Raises
    OSError where it cannot start, TimeoutError past `timeout_s`; a timeout or a cancel kills it first."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(os.environ, PYTHONIOENCODING="utf-8"),
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        proc.kill()
        await proc.wait()
        raise
    last = next((ln for ln in reversed(err.decode(errors="replace").splitlines()) if ln.strip()), "")
    return proc.returncode or 0, out, last.strip()
