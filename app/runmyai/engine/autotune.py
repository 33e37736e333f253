"""`tokenwing autotune MODEL --json` for the app: run it (progress, cancel), keep its result per model and machine,
let an advanced user override any flag, and turn both into `tokenwing serve` flags.

Memory follows the machine: autotune's RAM budget is a byte count measured at tuning time, and memory that was
free then may not be free at the next start (another program, a smaller container). So the saved result keeps
the share of the experts the cache held (`expert_cache_share`) and the rule (`memory_rule`: the engine sizes its
cache at every start from what is free then, which is what it does without `--ram-budget`), never the bytes.
A user who wants a fixed budget overrides `ram_budget` (a share such as `25%`, or a size).

The context is chosen too (`--ctx`): DEFAULT_CONTEXT for chat, at most the model's own, unless the user
overrides `ctx`; autotune plans the KV cache of that context, and the engine reserves just that.

The merge: autotune's chosen settings that are engine flags, then the overrides on top (an override with an
empty value is removed), then `--ctx`. `serve_flags()` is what EngineSupervisor gets as `flags`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runmyai.engine.command import FlagValue, check_flag_name, engine_command, flag_args
from runmyai.engine.faults import classify_exit, engine_error_line
from runmyai.engine.settings import DEFAULT_CONTEXT, SettingsFiles
from runmyai.jsonfile import read_json, write_json_atomic
from runmyai.library.estimate import probe_measurement
from runmyai.machine import DecodeProbe, GpuInfo, GpuReport, MachineFingerprint, machine_fingerprint, nvidia_vram
from runmyai.paths import AppPaths
from runmyai.speeds import load_per_core, record_speed

# Settings autotune reports that are not `tokenwing serve` flags (they explain the choice).
INFO_ONLY = frozenset(
    {"expert_cache_share", "gpus", "memory_rule", "vram_plan", "vram_expert_share", "gpu_copy_gb_per_s"}
)
MEMORY_RULE = "free memory at each start"
DECODE_PROBE_TOKENS = 32  # a short decode after autotune calibrates the estimate (a few seconds on small models)
# With the built-in model (the first start's offer) a longer one: its first tokens are slow (page faults, graph
# set-up), and 32 of them ran at a third of the steady speed here (68.8 against 212.6 tok/s for 128), which the
# estimate then took for this machine's. 128 of the built-in model's tokens take about a second.
SMALL_MODEL_PROBE_TOKENS = 128
DECODE_PROBE_TIMEOUT_S = 300.0
_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


class AutotuneError(Exception):
    """Autotune could not run or its result could not be read; str() is one human sentence."""


@dataclass(frozen=True)
class DriveSpeed:
    direct: bool  # O_DIRECT reads work on the model's file system
    block_bytes: int  # one expert record, as read
    mb_per_s_by_threads: dict[int, float]
    best_threads: int | None

    @property
    def best_mb_per_s(self) -> float:
        return max(self.mb_per_s_by_threads.values(), default=0.0)


@dataclass(frozen=True)
class AutotuneResult:
    model: str
    machine: MachineFingerprint
    measured_at: float  # unix time
    ram_total: int
    ram_available: int
    ram_limit: int
    ram_usable: int
    cores: int
    isa: tuple[str, ...]
    drive: DriveSpeed | None
    gpus: tuple[GpuInfo, ...]  # VRAM per NVIDIA GPU, from NVML in the app
    gpu_note: str
    settings: dict[str, Any]  # what autotune chose (flags and informational values)
    reasons: dict[str, str]  # why, per setting
    raw: dict[str, Any] = field(repr=False)  # autotune's JSON as printed
    decode: dict[str, Any] | None = None  # a short decode measured after autotune (the estimate's calibration)

    def flag_values(self) -> dict[str, FlagValue]:
        """The chosen settings that are `tokenwing serve` flags."""
        return {
            k: v
            for k, v in self.settings.items()
            if k not in INFO_ONLY and isinstance(v, str | int | float | bool) and _is_flag_name(k)
        }

    def machine_lines(self) -> list[str]:
        """What was measured, one line each, for the autotune dialog."""
        gib = 1 << 30
        lines = [
            f"Memory: {self.ram_available / gib:.1f} GiB free of {self.ram_total / gib:.1f} GiB, limit "
            f"{self.ram_limit / gib:.1f} GiB; usable {self.ram_usable / gib:.1f} GiB",
            f"CPU: {self.machine.cpu_model}, {self.cores} cores ({' '.join(self.isa) or 'no SIMD flags found'})",
        ]
        if self.drive is not None:
            speeds = ", ".join(f"{t}: {v:.0f}" for t, v in sorted(self.drive.mb_per_s_by_threads.items()))
            lines.append(
                f"Drive: {'direct' if self.drive.direct else 'cached'} reads, MB/s by I/O threads: {speeds}"
                + (f" (best with {self.drive.best_threads})" if self.drive.best_threads else "")
            )
        else:
            lines.append("Drive: not measured")
        if self.gpus:
            lines += [
                f"GPU {g.index}: {g.name}, {g.vram_free / gib:.1f} GiB free of {g.vram_total / gib:.1f} GiB VRAM"
                for g in self.gpus
            ]
        else:
            lines.append(f"GPU: {self.gpu_note}")
        g = self.raw.get("machine", {}).get("gpu")
        if isinstance(g, dict):  # the device the engine computes on, as the engine measured it
            lines.append(
                f"Engine's GPU: {g.get('name')} ({g.get('description')}), {_int(g.get('free')) / gib:.1f} GiB free of "
                f"{_int(g.get('total')) / gib:.1f} GiB ({g.get('memory_source')}); copies from RAM "
                f"{float(g.get('up_gb_per_s') or 0):.1f} GB/s, back {float(g.get('down_gb_per_s') or 0):.1f} GB/s"
            )
        if isinstance(self.settings.get("vram_plan"), str):
            lines.append(f"In VRAM: {self.settings['vram_plan']}")
        if self.decode is not None:
            d = self.decode
            lines.append(
                f"Decode: {d.get('tokens')} tokens at {float(d.get('tokens_per_s', 0)):.1f} tokens/s, "
                f'{float(d.get("compute_s", 0)) * 1000:.1f} ms of compute each (calibrates "Will it run here?")'
            )
        return lines

    def to_json(self) -> dict[str, Any]:
        out = dict(self.raw)
        out["runmyai"] = {
            "model": self.model,
            "machine": self.machine.as_dict(),
            "measured_at": self.measured_at,
            "gpus": [{"index": g.index, "name": g.name, "total": g.vram_total, "free": g.vram_free} for g in self.gpus],
            "gpu_note": self.gpu_note,
            "decode": self.decode,
        }
        return out


async def _spawn(argv: Sequence[str], stderr: int) -> asyncio.subprocess.Process:
    """An engine command in its own process group (killed with its children when cancelled)."""
    extra: dict[str, Any] = {"creationflags": 0x00000200} if os.name == "nt" else {"start_new_session": True}
    return await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr, **extra
    )


def _is_flag_name(key: str) -> bool:
    try:
        check_flag_name(key)
    except ValueError:
        return False
    return True


def _int(v: object) -> int:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0


def parse_result(raw: object, model: str, machine: MachineFingerprint, gpus: GpuReport, when: float) -> AutotuneResult:
    """Autotune's JSON -> AutotuneResult; AutotuneError when the essentials are missing."""
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("machine"), dict)
        or not isinstance(raw.get("settings"), dict)
    ):
        raise AutotuneError("Autotune's output could not be read (is the engine the same version as the app?).")
    m = raw["machine"]
    mem = m.get("memory") if isinstance(m.get("memory"), dict) else {}
    drive: DriveSpeed | None = None
    d = m.get("drive")
    if isinstance(d, dict) and isinstance(d.get("mb_per_s_by_threads"), dict):
        speeds: dict[int, float] = {}
        for k, v in d["mb_per_s_by_threads"].items():
            with contextlib.suppress(ValueError, TypeError):
                speeds[int(k)] = float(v)
        best = d.get("best_threads")
        drive = DriveSpeed(
            bool(d.get("direct")), _int(d.get("block_bytes")), speeds, best if isinstance(best, int) else None
        )
    reasons_raw = raw.get("reasons")
    reasons = {str(k): str(v) for k, v in reasons_raw.items()} if isinstance(reasons_raw, dict) else {}
    settings = dict(raw["settings"])
    if "ram_budget" in settings:  # bytes that were free at tuning time: keep the share and the rule instead
        del settings["ram_budget"]
        why = reasons.pop("ram_budget", "")
        reasons["memory_rule"] = (
            "the engine sizes its expert cache at every start from the memory free then (at tuning time: "
            + (why or "no reason given")
            + ")"
        )
        settings["memory_rule"] = MEMORY_RULE
    isa = m.get("isa")
    return AutotuneResult(
        model=model,
        machine=machine,
        measured_at=when,
        ram_total=_int(mem.get("total")),
        ram_available=_int(mem.get("available")),
        ram_limit=_int(mem.get("limit")),
        ram_usable=_int(mem.get("usable")),
        cores=_int(m.get("cores")),
        isa=tuple(str(x) for x in isa) if isinstance(isa, list) else (),
        drive=drive,
        gpus=gpus.gpus,
        gpu_note=gpus.note,
        settings=settings,
        reasons=reasons,
        raw={"machine": raw["machine"], "settings": settings, "reasons": reasons},
    )


def parse_override(value: FlagValue | str) -> FlagValue:
    """A typed-in override: "true"/"false" (yes/no, on/off) become the flag's on/off form; the rest stays text."""
    if isinstance(value, str):
        v = value.strip()
        if v.lower() in _TRUE:
            return True
        if v.lower() in _FALSE:
            return False
        return v
    return value


class AutotuneRunner:
    def __init__(
        self,
        paths: AppPaths | Path,
        *,
        command: Sequence[str] | None = None,
        probe_bytes: str | None = None,
        ctx: int | None = None,
        machine: MachineFingerprint | None = None,
    ) -> None:
        """`paths`: the app's paths (files go to `paths.settings`) or a folder. `probe_bytes` and `ctx` are
        passed to autotune when given (`--probe-bytes`, `--ctx`)."""
        folder = paths.settings if isinstance(paths, AppPaths) else Path(paths)
        self.files = SettingsFiles(folder, machine or machine_fingerprint())
        self.command = list(command) if command is not None else engine_command()
        self.probe_bytes = probe_bytes
        self.ctx = ctx
        self.pid: int | None = None  # the autotune process while one runs

    # ------------------------------------------------------------------------------------------ running
    async def run(
        self,
        model: Path,
        on_progress: Callable[[str], None] | None = None,
        *,
        exit_codes: Mapping[str, int] | None = None,
        decode_tokens: int = DECODE_PROBE_TOKENS,
    ) -> AutotuneResult:
        """Runs autotune, saves and returns the result. Cancelling the task kills the process (and its group).
        `exit_codes`: the engine's names of its exit codes (`EngineInfo.exit_codes`), to word its failure."""
        argv = [*self.command, "autotune", str(model), "--json"]
        if self.probe_bytes:
            argv += ["--probe-bytes", self.probe_bytes]
        argv += ["--ctx", str(self.ctx or self.context(model))]  # the KV cache the model will be served with
        gpu_task = asyncio.ensure_future(asyncio.to_thread(nvidia_vram))
        try:
            proc = await _spawn(argv, asyncio.subprocess.PIPE)
        except OSError as e:
            gpu_task.cancel()
            raise AutotuneError(f"Autotune could not be started: {argv[0]}: {e.strerror or e}.") from None
        self.pid = proc.pid
        lines: list[str] = []
        assert proc.stdout is not None and proc.stderr is not None
        stdout_task = asyncio.ensure_future(proc.stdout.read())
        try:
            await self._progress(proc.stderr, lines, on_progress)
            out = await stdout_task
            code = await proc.wait()
        except BaseException:
            stdout_task.cancel()
            gpu_task.cancel()
            await self._kill(proc)
            raise
        finally:
            self.pid = None
        gpus = await gpu_task
        if code != 0:
            fault = classify_exit(code, lines, exit_codes=exit_codes)
            if fault.kind in ("bad_input", "corrupt_model", "unsupported", "no_disk_space", "out_of_memory"):
                raise AutotuneError(fault.sentence)
            detail = engine_error_line(lines) or (lines[-1] if lines else f"exit code {code}")
            raise AutotuneError(f"Autotune failed: {detail.rstrip('.')}.")
        try:
            raw = json.loads(out)
        except ValueError:
            raw = None
        result = parse_result(raw, str(model), self.files.machine, gpus, time.time())
        # The model's shape (for the decode probe's calibration) is asked before the probe, so that the probe's
        # decode is the measurement's last process: asked after it, its engine start kept the bar up ~1-2 s more
        # (issue 50: the bar sat ~20 s after the autotuner exited, saying "measuring…"). Not beside autotune or
        # the decode: a Python start on a 2-core machine would disturb their timings.
        code, shape = await self._run_quiet([*self.command, "inspect", "--json", str(model)])
        if on_progress is not None:
            on_progress(f"measuring decode speed: {decode_tokens} tokens")
        decode = await self._probe_decode(
            model,
            flag_args({**result.flag_values(), "ctx": 256}),
            decode_tokens,
            shape if code == 0 else "",
            on_progress,
        )
        result = dataclasses.replace(result, decode=decode)
        load = load_per_core()

        def save() -> None:  # (one worker-thread hop for both files: each write waits for its fsync)
            write_json_atomic(self.files.autotune_path(model), result.to_json())
            if decode is not None:
                self._record(model, decode, load)

        await asyncio.to_thread(save)
        return result

    def _record(self, model: Path, decode: Mapping[str, Any], load: float | None) -> None:
        """The decode probe joins this machine's measured speeds (runmyai.speeds), which calibrate the estimate
        robustly over several runs; the autotune file keeps only the newest. `load`: the load average per core as
        the decode ended (its minute also holds autotune's own drive probe, a second or two of it)."""
        try:
            probe = DecodeProbe(
                float(decode["compute_s"]),
                int(decode["layers"]),
                int(decode["active_bytes"]),
                bool(decode["streamed"]),
                str(decode["model"]),
            )
            m = probe_measurement(probe, str(model), float(decode["tokens_per_s"]), time.time(), load)
        except (KeyError, TypeError, ValueError):
            return
        with contextlib.suppress(OSError):  # the estimate then stands on the autotune file alone
            record_speed(self.files.folder, m)

    async def _probe_decode(
        self,
        model: Path,
        flags: list[str],
        tokens: int = DECODE_PROBE_TOKENS,
        shape: str = "",
        on_progress: Callable[[str], None] | None = None,
    ) -> dict[str, Any] | None:
        """A short decode with the chosen flags (`tokenwing run --stats-json`): the engine's compute per token
        on this machine, the drive's wait taken out, for a model of this shape (`shape`: `inspect --json`'s
        output). None when it cannot be measured (the estimate then keeps its defaults). While it runs, a progress
        line each second says how long it has run: on a busy machine it takes a while (128 of the built-in model's
        tokens, 15 s under a load average of 10), and an unchanging "measuring…" looked stuck."""
        with tempfile.TemporaryDirectory(prefix="runmyai-decode-") as tmp:
            stats_path = Path(tmp) / "stats.json"
            run = [*self.command, "run", str(model), "--prompt", "The", "-n", str(tokens), "--temp", "0"]
            decoding = asyncio.ensure_future(self._run_quiet([*run, "--stats-json", str(stats_path), *flags]))
            started = time.monotonic()
            try:
                while not decoding.done():
                    await asyncio.wait([decoding], timeout=1.0)
                    if not decoding.done() and on_progress is not None:
                        seconds = time.monotonic() - started
                        on_progress(f"measuring decode speed: {tokens} tokens ({seconds:.0f} s so far)")
            finally:
                if not decoding.done():  # cancelled: the decode's process group is killed by its own task
                    decoding.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await decoding
            code, _ = decoding.result()
            stats = read_json(stats_path) if code == 0 else None
        try:
            info = json.loads(shape) if shape else None
            assert stats is not None and isinstance(info, dict)
            # the rate the decode settles at, its first steps (page faults, a cold cache) left out: 32 tokens of
            # a large model are mostly those (the engine's whole-run rate where it gives no steady one)
            steady = stats.get("decode_steady_tokens_per_s")
            tps = float(steady if steady else stats["decode_tokens_per_s"])
            wait_ms = stats.get("ssd_wait_ms_per_token_steady" if steady else "ssd_wait_ms_per_token")
            wait = float(wait_ms or 0.0) / 1000
            active = int(info["resident"]["read_per_token_bytes"]) + int(info["experts"]["miss_bytes_per_token"])
            return {
                "model": model.name,
                "tokens": int(stats["decode_tokens"]),
                "steady": bool(steady),
                "tokens_per_s": tps,
                "compute_s": max(1e-5, 1 / tps - wait),
                "layers": int(info["block_count"]),
                "active_bytes": active,
                "streamed": float(stats.get("hit_rate") or 1.0) < 0.999,
            }
        except (AssertionError, KeyError, TypeError, ValueError, ZeroDivisionError):
            return None

    async def _run_quiet(self, argv: list[str]) -> tuple[int, str]:
        """An engine command's exit code and stdout; killed with its group when cancelled or past the timeout."""
        try:
            proc = await _spawn(argv, asyncio.subprocess.DEVNULL)
        except OSError:
            return -1, ""
        self.pid = proc.pid
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), DECODE_PROBE_TIMEOUT_S)
        except TimeoutError:
            await self._kill(proc)
            return -1, ""
        except BaseException:
            await self._kill(proc)
            raise
        finally:
            self.pid = None
        return proc.returncode or 0, out.decode("utf-8", "replace")

    @staticmethod
    async def _progress(
        stream: asyncio.StreamReader, lines: list[str], on_progress: Callable[[str], None] | None
    ) -> None:
        buf = ""
        while chunk := await stream.read(4096):
            buf += chunk.decode("utf-8", "replace")
            *complete, buf = re.split(r"[\r\n]", buf)
            for line in complete:
                if line.strip():
                    lines.append(line.strip())
                    del lines[:-200]
                    if on_progress is not None:
                        on_progress(line.strip())
        if buf.strip():
            lines.append(buf.strip())
            if on_progress is not None:
                on_progress(buf.strip())

    @staticmethod
    async def _kill(proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        try:
            if os.name == "nt":
                proc.kill()
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), timeout=10)

    # ------------------------------------------------------------------------------------------ saved
    def saved(self, model: Path) -> AutotuneResult | None:
        """The result saved for this model on this machine; None when there is none (or it cannot be read)."""
        data = read_json(self.files.autotune_path(model))
        if data is None:
            return None
        meta_raw = data.get("runmyai")
        meta: dict[str, Any] = meta_raw if isinstance(meta_raw, dict) else {}
        raw_gpus_any = meta.get("gpus")
        raw_gpus: list[Any] = raw_gpus_any if isinstance(raw_gpus_any, list) else []
        gpus: list[GpuInfo] = []
        for g in raw_gpus:
            with contextlib.suppress(TypeError, ValueError, KeyError):
                gpus.append(GpuInfo(int(g["index"]), str(g["name"]), int(g["total"]), int(g["free"])))
        note = str(meta.get("gpu_note") or ("no NVIDIA GPU" if not gpus else ""))
        when = meta.get("measured_at")
        try:
            result = parse_result(
                data,
                str(meta.get("model") or model),
                self.files.machine,
                GpuReport(tuple(gpus), note),
                float(when) if isinstance(when, int | float) else 0.0,
            )
        except AutotuneError:
            return None
        decode = meta.get("decode")
        return dataclasses.replace(result, decode=decode if isinstance(decode, dict) else None)

    def overrides(self, model: Path) -> dict[str, FlagValue]:
        data = read_json(self.files.overrides_path(model)) or {}
        raw = data.get("overrides")
        if not isinstance(raw, dict):
            return {}
        return {str(k): v for k, v in raw.items() if isinstance(v, str | int | float | bool) and _is_flag_name(str(k))}

    def set_overrides(self, model: Path, values: Mapping[str, FlagValue | str | None]) -> dict[str, FlagValue]:
        """Replaces this model's overrides. Keys are setting names (`ram_budget`, `moe-stream-io-threads`,
        `--lookahead`); an empty value or None drops the key. ValueError for a name that is not a flag or one
        the app owns (`port`, `host`, ...)."""
        clean: dict[str, FlagValue] = {}
        for key, value in values.items():
            name = check_flag_name(key)
            if value is None or (isinstance(value, str) and not value.strip()):
                continue
            clean[name] = parse_override(value)
        write_json_atomic(self.files.overrides_path(model), {"overrides": clean})
        return clean

    def set_override(self, model: Path, key: str, value: FlagValue | str | None) -> dict[str, FlagValue]:
        current: dict[str, FlagValue | str | None] = dict(self.overrides(model))
        current[check_flag_name(key)] = value
        return self.set_overrides(model, current)

    def merged(self, model: Path) -> dict[str, FlagValue]:
        """Autotune's flags with the overrides on top."""
        saved = self.saved(model)
        values: dict[str, FlagValue] = dict(saved.flag_values()) if saved else {}
        values.update(self.overrides(model))
        return values

    def context(self, model: Path, model_context: int | None = None) -> int:
        """The chat context for this model: the user's `ctx` override, else DEFAULT_CONTEXT (at most the model's)."""
        chosen = self.overrides(model).get("ctx")
        with contextlib.suppress(TypeError, ValueError):
            if chosen is not None and not isinstance(chosen, bool) and int(chosen) > 0:
                return int(chosen)
        return min(DEFAULT_CONTEXT, model_context) if model_context else DEFAULT_CONTEXT

    def serve_flags(self, model: Path, model_context: int | None = None) -> list[str]:
        values = self.merged(model)
        values["ctx"] = self.context(model, model_context)
        return flag_args(values)
