"""What the installed engine runs and how it behaves, asked from it (`tokenwing info --json`) instead of kept as
copies in the app.

The answer that does not change while the engine stays the same (its version, the architectures it runs with
their weight types, the memory headroom it keeps in RAM and on a device, its flags with their defaults and
choices, its exit codes, its devices) is cached per engine version in the settings folder, so the engine runs
once per version, not once per app start. Memory is not cached: the machine probe reads it fresh
(`runmyai/machine.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runmyai import __version__
from runmyai.engine.command import engine_command, run_engine
from runmyai.jsonfile import read_json, write_json_atomic

INFO_TIMEOUT_S = 120.0  # the engine's first start on a cold disk imports numpy and ggml: seconds, not minutes


@dataclass(frozen=True)
class FlagInfo:
    """One engine flag as the engine describes it: its default (None: the engine decides at start), its kind
    (bool, int, choice, str) and, for a choice, its choices."""

    default: object
    kind: str
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeviceHeadroom:
    """What the engine keeps free on a device when it sizes its own VRAM budget: total / divisor, within bounds."""

    divisor: int
    min_bytes: int
    max_bytes: int

    def of(self, total: int) -> int:
        return min(self.max_bytes, max(self.min_bytes, total // self.divisor))


@dataclass(frozen=True)
class EngineMemory:
    """The memory the engine sees (`tokenwing info --json`'s `memory`): the engine's own reader, cgroup limits
    included, so the app's estimate sizes by what the engine will size by."""

    total: int  # physical RAM
    available: int  # free plus reclaimable cache
    limit: int  # the memory limit on the engine's group, or `total` where there is none below it
    used_in_group: int  # what that group already charges (0 without a limit)


@dataclass(frozen=True)
class EngineInfo:
    version: str
    architectures: dict[str, tuple[str, ...]]  # GGUF architecture id → the weight types the engine computes
    headroom_bytes: int  # what the engine leaves free for other programs when it sizes its caches
    devices: tuple[dict[str, object], ...]
    error: str | None = None  # the engine could not be asked: why (then `architectures` is empty)
    # the most experts the VRAM cache moves in per decode token (its swap rule: at most `max_experts` every
    # `every_tokens`); None from an engine that does not say
    swaps_per_token_max: float | None = None
    flags: Mapping[str, FlagInfo] = field(default_factory=dict)  # "--moe-stream-policy" → its default and choices
    exit_codes: Mapping[str, int] = field(default_factory=dict)  # "no_disk_space" → 5
    # the exit kinds retrying the same input cannot change ("corrupt_model"): the engine's word, not a copy
    permanent_kinds: frozenset[str] = frozenset()
    # the stats stream's fields as the engine sends them: {"token": (...), "layer": (...)} (empty: it does not say)
    stats_fields: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    device_headroom: DeviceHeadroom | None = None
    # the flags a preset may set, by its key, with their CLI spelling ("io-threads" → "--moe-stream-io-threads")
    preset_flags: Mapping[str, str] = field(default_factory=dict)
    # a routed expert's bits per weight by quant name ("Q4_K_M", "UD-Q4_K_XL"), upper-case, and the alignment of
    # each of its projections in the model file (0: the engine does not say)
    quant_bits: Mapping[str, float] = field(default_factory=dict)
    expert_alignment: int = 0
    process_bytes: int = 0  # the engine's own process before any model (its Python and ggml)
    # the architectures whose pictures the engine's server reads with a model's mmproj (`info --json`'s `images`:
    # empty where `serve` takes no --mmproj)
    image_architectures: frozenset[str] = frozenset()

    def runs(self, arch: str) -> bool:
        return arch in self.architectures

    @property
    def known(self) -> bool:
        return self.error is None

    def exit_kind(self, code: int | None) -> str | None:
        """The engine's name for an exit code ("no_disk_space"), None for one it does not name."""
        return next((kind for kind, c in self.exit_codes.items() if c == code), None)

    def permanent(self, code: int | None) -> bool:
        """True for an exit code whose failure the same input meets again (the engine's `permanent_exit_kinds`)."""
        return self.exit_kind(code) in self.permanent_kinds

    def quant_bits_of(self, quant: str) -> float | None:
        """A routed expert's bits per weight in a file of this quant name, as the engine says; None if unknown."""
        return self.quant_bits.get(quant.strip().upper())

    def device_headroom_bytes(self, total: int) -> int:
        """What the engine keeps free on a device of `total` bytes (0 when the engine does not say)."""
        return self.device_headroom.of(total) if self.device_headroom is not None else 0


def unknown(reason: str) -> EngineInfo:
    """What the app assumes when the engine cannot be asked: nothing runs, no headroom is known, and the reason
    says why (every estimate then says it too)."""
    return EngineInfo(__version__, {}, 0, (), reason)


def parse_info(raw: object) -> EngineInfo:
    """`tokenwing info --json`'s answer, checked field by field; ValueError when it is not one."""
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    version, archs, headroom = raw.get("version"), raw.get("architectures"), raw.get("headroom_bytes")
    if not isinstance(version, str) or not isinstance(archs, dict):
        raise ValueError("no version or architectures")
    if isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 0:
        raise ValueError("no headroom_bytes")
    architectures: dict[str, tuple[str, ...]] = {}
    for arch, facts in archs.items():
        types = facts.get("weight_types") if isinstance(facts, dict) else None
        if isinstance(arch, str) and isinstance(types, list):
            architectures[arch] = tuple(t for t in types if isinstance(t, str))
    devices_raw = raw.get("devices")
    devices = tuple(d for d in devices_raw if isinstance(d, dict)) if isinstance(devices_raw, list) else ()
    return EngineInfo(
        version,
        architectures,
        headroom,
        devices,
        swaps_per_token_max=_swap_rate(raw.get("vram_swaps")),
        flags=_flags(raw.get("flags")),
        exit_codes=_exit_codes(raw.get("exit_codes")),
        permanent_kinds=_names(raw.get("permanent_exit_kinds")),
        stats_fields=_stats_fields(raw.get("stats_fields")),
        device_headroom=_device_headroom(raw.get("device_headroom")),
        preset_flags=_preset_flags(raw.get("preset_flags")),
        quant_bits=_quant_bits(raw.get("quant_bits")),
        expert_alignment=_positive_int(raw.get("expert_alignment")),
        process_bytes=_positive_int(raw.get("process_bytes")),
        image_architectures=_image_architectures(raw.get("images")),
    )


def _image_architectures(raw: object) -> frozenset[str]:
    if not isinstance(raw, dict) or raw.get("serve") is not True or not isinstance(raw.get("architectures"), dict):
        return frozenset()
    return frozenset(a for a in raw["architectures"] if isinstance(a, str))


def parse_memory(raw: object) -> EngineMemory | None:
    """`info --json`'s `memory` object; None when it is not one."""
    if not isinstance(raw, dict):
        return None
    total, available, limit = (_positive_int(raw.get(k)) for k in ("total", "available", "limit"))
    used = raw.get("used_in_group")
    if not total or not limit or isinstance(used, bool) or not isinstance(used, int) or used < 0:
        return None
    return EngineMemory(total, available, limit, used)


def _preset_flags(raw: object) -> dict[str, str]:
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str) and v.startswith("--")}


def _quant_bits(raw: object) -> dict[str, float]:
    if not isinstance(raw, dict):
        return {}
    out: dict[str, float] = {}
    for k, v in raw.items():
        if isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= 64:
            out[k.upper()] = float(v)
    return out


def _flags(raw: object) -> dict[str, FlagInfo]:
    if not isinstance(raw, dict):
        return {}
    out: dict[str, FlagInfo] = {}
    for name, f in raw.items():
        if isinstance(name, str) and name.startswith("--") and isinstance(f, dict) and isinstance(f.get("kind"), str):
            choices = f.get("choices")
            listed = tuple(str(c) for c in choices) if isinstance(choices, list) else ()
            out[name] = FlagInfo(f.get("default"), str(f["kind"]), listed)
    return out


def _exit_codes(raw: object) -> dict[str, int]:
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and _positive_int(v)}


def _stats_fields(raw: object) -> dict[str, tuple[str, ...]]:
    if not isinstance(raw, dict):
        return {}
    return {k: tuple(n for n in v if isinstance(n, str)) for k, v in raw.items() if isinstance(v, list)}


def _names(raw: object) -> frozenset[str]:
    return frozenset(k for k in raw if isinstance(k, str)) if isinstance(raw, list) else frozenset()


def _device_headroom(raw: object) -> DeviceHeadroom | None:
    if not isinstance(raw, dict):
        return None
    divisor, low, high = (_positive_int(raw.get(k)) for k in ("divisor", "min_bytes", "max_bytes"))
    return DeviceHeadroom(divisor, low, high) if divisor and low and high >= low else None


def _swap_rate(rule: object) -> float | None:
    """`{"every_tokens": 8, "max_experts": 64}` -> 8.0 experts per token at most; None when it is not one."""
    if not isinstance(rule, dict):
        return None
    every, most = _positive_int(rule.get("every_tokens")), _positive_int(rule.get("max_experts"))
    return most / every if every and most else None


def _positive_int(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def ask_memory(command: Sequence[str] | None = None) -> EngineMemory | str:
    """The memory the engine sees now, by its own reader (`tokenwing info --json`'s `memory`; never cached:
    memory changes): blocking, for the machine probe's thread. Where the engine cannot be asked, the reason."""
    argv = [*(command if command is not None else engine_command()), "info", "--json"]
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    try:
        done = subprocess.run(argv, capture_output=True, timeout=INFO_TIMEOUT_S, stdin=subprocess.DEVNULL, env=env)
    except OSError as e:
        return f"the engine could not be started ({e.strerror or e})"
    except subprocess.TimeoutExpired:
        return f"the engine did not answer `tokenwing info` within {INFO_TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        last = next((ln for ln in reversed(done.stderr.decode(errors="replace").splitlines()) if ln.strip()), "")
        return f"`tokenwing info` failed (exit code {done.returncode}): {last.strip()}"
    try:
        raw = json.loads(done.stdout)
    except ValueError:
        raw = None
    memory = parse_memory(raw.get("memory")) if isinstance(raw, dict) else None
    return memory if memory is not None else "the engine's `tokenwing info --json` answer says no memory"


def cache_path(folder: Path, version: str = __version__) -> Path:
    return folder / f"engine-info-{version}.json"


async def ask_engine(folder: Path, command: Sequence[str] | None = None, *, refresh: bool = False) -> EngineInfo:
    """The engine's facts: from the cache for this version, else from `tokenwing info --json` (then cached).
    Never raises: an engine that cannot be asked gives `unknown(reason)` (and nothing is cached)."""
    path = cache_path(folder)
    if not refresh:
        cached = read_json(path)
        if cached is not None:
            try:
                info = parse_info(cached)
            except ValueError:
                info = None
            # (an answer cached by an engine of this version from before it reported its flags, exit codes,
            # which of them are for good, its stats fields, quant bits and preset flags is asked again)
            if (
                info is not None
                and info.version == __version__
                and info.flags
                and info.permanent_kinds
                and info.stats_fields
                and info.quant_bits
                and info.preset_flags
                and isinstance(cached.get("images"), dict)  # (what it reads images for: issue 45)
            ):
                return info
    argv = [*(command if command is not None else engine_command()), "info", "--json"]
    try:
        code, out, last = await run_engine(argv, INFO_TIMEOUT_S)
    except OSError as e:
        return unknown(f"the engine could not be started ({e.strerror or e})")
    except TimeoutError:
        return unknown(f"the engine did not answer `tokenwing info` within {INFO_TIMEOUT_S:.0f} s")
    if code != 0:
        return unknown(f"`tokenwing info` failed (exit code {code}): {last}")
    try:
        raw = json.loads(out)
        info = parse_info(raw)
    except ValueError:
        return unknown("the engine's `tokenwing info --json` answer could not be read")
    if info.version == __version__:  # another version is refused at chat time; never cache its facts
        with contextlib.suppress(OSError):  # a read-only settings folder: ask again next time
            await asyncio.to_thread(write_json_atomic, path, raw)
    return info
