"""Installed models: the models folder, the built-in demo model, and importing a GGUF.

The app never imports the engine's Python modules: it runs the `tokenwing` CLI (`repack`, `inspect --json`)
as an asyncio subprocess. Everything here is async and Qt-free (the app runs it on the Qt loop via qasync).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runmyai.engine.command import engine_command
from runmyai.jsonfile import write_json_atomic
from runmyai.library.mmproj import remove_mmproj_with
from runmyai.library.presets import Preset
from runmyai.library.quants import quant_name
from runmyai.units import human_bytes

ProgressCallback = Callable[[float, str], None]

DEMO_FILE = "tokenwing-demo-moe.tw.gguf"  # the demo model in the models folder
DEMO_SOURCE = "demo-model/tokenwing-demo-moe.gguf"  # the shipped GGUF, relative to resources/
_CACHE_FILE = ".library.json"  # per file: size, mtime and what `inspect` said (and sha256 once computed)
# What `inspect` says changes with the engine (2: KV bytes per token by the model family's rule, no longer counting
# linear-attention layers): an entry from another version of it is inspected again.
_FACTS_VERSION = 4  # 3: the name from general.basename where general.name is the file's; 4: its graph reserve
_STOP_GRACE_S = 10.0  # after SIGTERM, the engine removes its partial output and exits; then it is killed
_SHARD = re.compile(r"-\d{5}-of-\d{5}$")
_GGUF_SUFFIX = re.compile(r"[-_.]gguf$", re.IGNORECASE)
# How a repack's two passes share the progress bar (repack reads and writes, verify only reads: ~2:1 in
# docs/results.md).
_STAGES = {"repacking": (0.0, 0.7, "Converting"), "verifying": (0.7, 1.0, "Checking the new file")}


class LibraryError(Exception):
    """One sentence for the user. `exit_code` is the engine's, when the engine reported it."""

    def __init__(
        self, message: str, exit_code: int | None = None, *, detail: str | None = None, permanent: bool = False
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.detail = detail  # the engine's own one-line reason, when it gave one
        self.permanent = permanent  # trying again cannot change it (a corrupt file): no Retry


class ImportCancelled(LibraryError):
    """The import was cancelled through its `cancel` event; nothing was kept."""


@dataclass(frozen=True)
class LocalModel:
    path: Path
    name: str
    preset_id: str | None
    size_bytes: int
    arch: str | None
    bundled: bool
    error: str | None = None  # the file is listed but can't be used: why (one sentence)
    facts: Mapping[str, Any] | None = None  # what `tokenwing inspect --json` said (the estimate's input)


def header_name(info: Mapping[str, Any], file: str) -> str | None:
    """The model's own name in its header (`tokenwing inspect --json`): `general.name`, unless that only repeats
    the file's name (some converters write the file's stem there: an import of `m.gguf` was called "m"), then
    `general.basename` with its `general.size_label` ("Qwen3 30B-A3B"); None when the header names nothing."""
    stem = file.removesuffix(".gguf").removesuffix(".tw").lower()
    raw, base = info.get("name"), info.get("basename")
    name = raw.strip() if isinstance(raw, str) and raw.strip() else None
    basename = base if isinstance(base, str) else None
    if basename and basename.strip() and (name is None or name.lower() == stem):
        size = info.get("size_label")
        return basename.strip() + (f" {size.strip()}" if isinstance(size, str) and size.strip() else "")
    return name


def model_name(path: Path, models_dir: Path, general_name: str | None = None) -> str:
    """What a model without a preset is called: a download by its repository (it lands in
    `<models>/<owner>/<repo>/`) and its quant, `Tiny-MoE-3B-A1B (Q8_0)`; else by the name in its header
    (`general.name`) and the quant its file names; else by its file. The walk-through's picker and My models
    said "tiny-moe-Q8_0", the file's name, for a model downloaded from `acme/Tiny-MoE-3B-A1B-GGUF`; the
    repository itself stays in My models' own column. A "-GGUF" ending is the format, not the model: dropped."""
    quant = quant_name(path.name)
    try:
        parts = path.relative_to(models_dir).parts
    except ValueError:
        parts = ()
    if len(parts) >= 3:
        base = _GGUF_SUFFIX.sub("", parts[1]) or parts[1]
    elif general_name and general_name.strip():
        base = general_name.strip()
    else:
        return path.name.removesuffix(".tw.gguf")
    return f"{base} ({quant})" if quant and quant.lower() not in base.lower() else base


def repacked_name(source: Path) -> str:
    """`Model-Q4_K_M.gguf` (or its first shard `…-00001-of-00003.gguf`) → `Model-Q4_K_M.tw.gguf`."""
    stem = source.name.removesuffix(".gguf")
    return _SHARD.sub("", stem) + ".tw.gguf"


class LocalLibrary:
    def __init__(
        self,
        models_dir: Path,
        bundled_dir: Path | None = None,
        *,
        presets: Sequence[Preset] = (),
        engine: Sequence[str] | None = None,
    ) -> None:
        """`bundled_dir`: the app's resources/ folder (or the folder holding the demo GGUF itself);
        `presets`: the catalog, to name installed files; `engine`: the command that runs the engine CLI."""
        self.models_dir = models_dir
        self.bundled_dir = bundled_dir
        self.presets = tuple(presets)
        self.engine = list(engine) if engine is not None else engine_command()
        self.extra_dirs: list[Path] = []  # more folders the user keeps models in (Settings), scanned as found
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        # the engine's name for an exit code ("corrupt_model"; EngineInfo.exit_kind), to word a failed import
        self.exit_kind: Callable[[int], str | None] | None = None

    # ------------------------------------------------------------------------------------------ listing
    async def scan(self) -> list[LocalModel]:
        """Every `*.tw.gguf` in the models folder and below it (downloads land in `<owner>/<repo>/`), with its
        architecture and matching preset (cached)."""
        paths = await asyncio.to_thread(self._model_paths)
        cache = self._load_cache()
        models = await asyncio.gather(*(self._describe(p, cache) for p in paths))
        keys = [self._key(p) for p in paths]
        await asyncio.to_thread(self._save_cache, {k: cache[k] for k in keys if k in cache})
        return sorted((m for m in models if m is not None), key=lambda m: (not m.bundled, m.name.lower()))

    def _model_paths(self) -> list[Path]:
        paths: set[Path] = set()
        for folder in (self.models_dir, *self.extra_dirs):
            try:
                found = folder.rglob("*.tw.gguf")
                paths.update(p for p in found if not any(part.startswith(".") for part in p.parts[-3:]))
            except OSError:
                continue  # a folder the user named that is gone (an unplugged drive): the others still count
        return sorted(paths)

    # ------------------------------------------------------------------------------------------ managing
    async def verify(self, path: Path, *, full: bool = True) -> None:
        """`tokenwing verify [--full] PATH`: every expert's checksum (a sample without `full`); the engine's
        reason as a LibraryError. Cancelling the task stops the engine."""
        rc, _, lines = await self._run(["verify", *(["--full"] if full else []), str(path)])
        if rc != 0:
            raise LibraryError(f"{path.name} failed verification: {_engine_error(lines, rc)}.", rc)

    def delete(self, path: Path) -> None:
        """Removes a model file and what the engine keeps beside it (its usage table); only files in a models
        folder this library scans (a stray path is refused, never deleted)."""
        folders = (self.models_dir, *self.extra_dirs)
        if not path.name.endswith(".tw.gguf") or not any(path.is_relative_to(f) for f in folders):
            raise LibraryError(f"{path} is not in a models folder; nothing was deleted.")
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise LibraryError(f"Couldn't delete {path.name}: {e.strerror or e}.") from None
        usage = path.with_name(path.name + ".usage.json")  # the engine's name for it (streaming/usage.py)
        with contextlib.suppress(OSError):
            usage.unlink()
        with contextlib.suppress(OSError):
            remove_mmproj_with(path)  # (its image encoder, with the last model of its folder)
        folder = path.parent
        while folder != self.models_dir and folder.is_relative_to(self.models_dir):  # an emptied <owner>/<repo>/
            try:
                folder.rmdir()
            except OSError:
                break
            folder = folder.parent

    def _key(self, path: Path) -> str:
        try:
            return path.relative_to(self.models_dir).as_posix()
        except ValueError:
            return str(path)

    async def _describe(self, path: Path, cache: dict[str, dict[str, Any]]) -> LocalModel | None:
        try:
            st = path.stat()
        except OSError:
            return None  # removed meanwhile
        entry = cache.get(self._key(path))
        if (
            not entry
            or entry.get("facts_version") != _FACTS_VERSION
            or entry.get("size") != st.st_size
            or entry.get("mtime_ns") != st.st_mtime_ns
        ):
            entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "facts_version": _FACTS_VERSION}
            try:
                info = await self.inspect(path)
                if info.get("kind") != "tokenwing":
                    entry["error"] = "not a TokenWing model file (import the GGUF instead of copying it)"
                entry["arch"] = info.get("architecture")
                entry["name"] = header_name(info, path.name)
                entry["facts"] = _facts(info)
            except LibraryError as e:
                entry["error"] = str(e)
                if e.exit_code is None:  # the engine didn't run (not the file's fault): ask again next scan
                    return self._model(path, st.st_size, entry, None)
            cache[self._key(path)] = entry
        return self._model(path, st.st_size, entry, await self._match_preset(path, st.st_size, entry))

    def _model(self, path: Path, size: int, entry: dict[str, Any], preset: Preset | None) -> LocalModel:
        general = entry.get("name") if isinstance(entry.get("name"), str) else None
        name = preset.name if preset else model_name(path, self.models_dir, general)
        return LocalModel(
            path=path,
            name=str(name),
            preset_id=preset.id if preset else None,
            size_bytes=size,
            arch=entry.get("arch"),
            bundled=(preset is not None and preset.source == "bundled") or path.name == DEMO_FILE,
            error=entry.get("error"),
            facts=entry.get("facts") if isinstance(entry.get("facts"), dict) else None,
        )

    async def _match_preset(self, path: Path, size: int, entry: dict[str, Any]) -> Preset | None:
        by_name = next((p for p in self.presets if p.file == path.name), None)
        if by_name is not None:
            return by_name
        # repacked here from the preset's GGUF source: models/<owner>/<name>/ of that repository
        by_source = next((p for p in self.presets if p.gguf and path.parent == self._repo_dir(p.gguf.repo)), None)
        if by_source is not None:
            return by_source
        candidates = [p for p in self.presets if p.sha256 and p.size_bytes == size]
        if not candidates:
            return None
        if "sha256" not in entry:
            entry["sha256"] = await asyncio.to_thread(_sha256, path)
        return next((p for p in candidates if p.sha256 == entry["sha256"]), None)

    def _repo_dir(self, repo: str) -> Path:
        return self.models_dir.joinpath(*repo.split("/"))

    async def inspect(self, path: Path) -> dict[str, Any]:
        """`tokenwing inspect --json PATH`, parsed; the engine's error as a LibraryError."""
        async with self._inspect_slots():
            rc, out, lines = await self._run(["inspect", "--json", str(path)])
        if rc != 0:
            raise LibraryError(f"{_engine_error(lines, rc)} (engine exit code {rc})", rc)
        try:
            data = json.loads(out)
        except ValueError:
            raise LibraryError(f"the engine's description of {path.name} was not readable") from None
        if not isinstance(data, dict):
            raise LibraryError(f"the engine's description of {path.name} was not readable")
        return data

    def _inspect_slots(self) -> asyncio.Semaphore:
        """At most two engine processes inspecting at once (per event loop)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(2))
        return self._slots[1]

    # ------------------------------------------------------------------------------------------ import
    async def import_gguf(
        self,
        sources: Sequence[Path],
        on_progress: ProgressCallback | None = None,
        *,
        cancel: asyncio.Event | None = None,
    ) -> LocalModel:
        """Converts a GGUF (or all shards of one) into the models folder with `tokenwing repack`.

        Cancel by cancelling the task or setting `cancel` (then ImportCancelled is raised): the engine is
        interrupted and nothing partial is left. Engine failures raise LibraryError with its one-line message.
        """
        if not sources:
            raise LibraryError("Choose a GGUF file to import.")
        sources = [Path(s) for s in sources]
        dest = self.models_dir / repacked_name(sources[0])
        if dest.exists():
            raise LibraryError(f"{dest.name} is already in your library.")
        await self._repack(sources, dest, on_progress, cancel)
        return await self._describe_one(dest)

    async def _describe_one(self, path: Path) -> LocalModel:
        cache = self._load_cache()
        model = await self._describe(path, cache)
        await asyncio.to_thread(self._save_cache, cache)
        if model is None:
            raise LibraryError(f"{path.name} disappeared from the models folder.")
        return model

    async def _repack(
        self, sources: Sequence[Path], dest: Path, on_progress: ProgressCallback | None, cancel: asyncio.Event | None
    ) -> None:
        self.models_dir.mkdir(parents=True, exist_ok=True)
        report = on_progress or (lambda fraction, message: None)
        report(0.0, "Starting the engine")

        def on_line(line: str) -> None:
            if not line.startswith("{"):
                return
            try:
                rec = json.loads(line)
                lo, hi, label = _STAGES[rec["progress"]]
                done, total = int(rec["done"]), max(int(rec["total"]), 1)
            except (ValueError, KeyError, TypeError):
                return
            report(lo + (hi - lo) * min(done / total, 1.0), f"{label}: {human_bytes(done)} of {human_bytes(total)}")

        args = ["repack", *(str(s) for s in sources), "-o", str(dest), "--progress-json"]
        try:
            rc, _, lines = await self._run(args, on_line, cancel, cleanup=dest)
        except (ImportCancelled, asyncio.CancelledError) as e:
            # A cancel can come after the engine finished (its outcome decided, a stop signal no longer changes
            # it): the caller is told nothing was kept, so nothing is.
            with contextlib.suppress(OSError):
                dest.unlink()
            if isinstance(e, ImportCancelled):
                raise ImportCancelled(f"The import of {sources[0].name} was cancelled; nothing was kept.") from None
            raise
        if rc != 0:
            reason = _engine_error(lines, rc)
            kind = self.exit_kind(rc) if self.exit_kind is not None else None
            sentence, permanent = import_failure(sources[0].name, reason, kind)
            raise LibraryError(sentence, rc, detail=f"The engine said: {reason} (exit code {rc}).", permanent=permanent)
        report(1.0, "Done")

    # ------------------------------------------------------------------------------------------ split models
    async def plan_shards(self, manifest: Path) -> dict[str, Any]:
        """`tokenwing repack --shards MANIFEST --plan --json`: the repacked size, the disk either path needs and
        what `inspect` says of the model, from the shards' headers alone (or `{"headers_incomplete": [i, …]}`)."""
        rc, out, lines = await self._run(["repack", "--shards", str(manifest), "--plan", "--json"])
        if rc != 0:
            reason = _engine_error(lines, rc)
            raise LibraryError(f"The engine could not plan this model: {reason}.", rc, detail=reason)
        try:
            data = json.loads(out)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise LibraryError("The engine's plan of this model could not be read.")
        return data

    async def repack_shards(
        self,
        manifest: Path,
        dest: Path,
        on_progress: ProgressCallback | None = None,
        *,
        cancel: asyncio.Event | None = None,
    ) -> dict[str, Any]:
        """Repacks the manifest's shards that are there now into `dest`, deleting each once its data is written
        and verified (`tokenwing repack --shards M --delete-source`). Resumable: the engine keeps its progress
        beside `dest` (also when cancelled here), and the run that repacks the last shard renames `dest` into
        place. Returns the engine's answer: `{"shards": N, "done": [i, …], "complete": bool}`."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        report = on_progress or (lambda fraction, message: None)

        def on_line(line: str) -> None:
            if not line.startswith("{"):
                return
            try:
                rec = json.loads(line)
                done, total = int(rec["done"]), max(int(rec["total"]), 1)
            except (ValueError, KeyError, TypeError):
                return
            report(min(done / total, 1.0), f"{human_bytes(done)} of {human_bytes(total)}")

        args = ["repack", "--shards", str(manifest), "-o", str(dest), "--delete-source", "--progress-json", "--json"]
        rc, out, lines = await self._run(args, on_line, cancel)
        if rc != 0:
            reason = _engine_error(lines, rc)
            raise LibraryError(f"Couldn't repack {dest.name}: {reason} (engine exit code {rc}).", rc, detail=reason)
        try:
            data = json.loads(out.strip().splitlines()[-1])
            done = [int(i) for i in data["done"]]
            complete = bool(data["complete"])
        except (ValueError, KeyError, TypeError, IndexError):
            raise LibraryError(f"The engine's answer about {dest.name} could not be read.") from None
        return {"shards": data.get("shards"), "done": done, "complete": complete}

    async def describe(self, path: Path) -> LocalModel:
        """One model file as `scan` lists it (inspected, matched to a preset)."""
        return await self._describe_one(path)

    # ------------------------------------------------------------------------------------------ demo
    def bundled_demo_source(self) -> Path | None:
        if self.bundled_dir is None:
            return None
        relative = next((p.bundled_source for p in self.presets if p.source == "bundled" and p.bundled_source), None)
        for candidate in (self.bundled_dir / (relative or DEMO_SOURCE), self.bundled_dir / Path(DEMO_SOURCE).name):
            if candidate.is_file():
                return candidate
        return None

    async def ensure_bundled_demo(self, on_progress: ProgressCallback | None = None) -> LocalModel | None:
        """Repacks the shipped demo GGUF into the models folder on first start (or when the app ships a new one).

        Skipped when the folder already holds the output of a successful repack of this very source: a stamp
        beside it records the source's sha256 and the output's size (the repack verified every checksum of the
        output before it was renamed into place). None when the app ships no demo model.
        """
        source = self.bundled_demo_source()
        if source is None:
            return None
        file = next((p.file for p in self.presets if p.source == "bundled"), DEMO_FILE)
        dest = self.models_dir / file
        stamp_path = self.models_dir / f".{file}.bundled.json"
        source_sha = await asyncio.to_thread(_sha256, source)
        with contextlib.suppress(OSError, ValueError):
            stamp = json.loads(stamp_path.read_text())
            if stamp.get("source_sha256") == source_sha and stamp.get("size") == dest.stat().st_size:
                return await self._describe_one(dest)
        with contextlib.suppress(FileNotFoundError):
            dest.unlink()  # an older or unverified demo: ours to replace
        await self._repack([source], dest, on_progress, None)
        await asyncio.to_thread(
            write_json_atomic, stamp_path, {"source_sha256": source_sha, "size": dest.stat().st_size}
        )
        return await self._describe_one(dest)

    # ------------------------------------------------------------------------------------------ engine
    async def _run(
        self,
        args: Sequence[str],
        on_line: Callable[[str], None] | None = None,
        cancel: asyncio.Event | None = None,
        cleanup: Path | None = None,
    ) -> tuple[int, str, list[str]]:
        """Runs the engine CLI: (exit code, stdout, stderr lines). Cancelling (the task or `cancel`) stops it with
        SIGTERM, on which it removes its partial output; `cleanup` is that output's final path (a
        `.NAME.partial-PID` the engine could not remove, if it had to be killed, is removed here)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8")
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.engine,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
        except OSError as e:
            raise LibraryError(f"The engine could not be started: {e.strerror or e}.") from None
        assert proc.stdout is not None and proc.stderr is not None
        lines: list[str] = []

        async def read_stderr(stream: asyncio.StreamReader) -> None:
            async for raw in stream:
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                lines.append(line)
                del lines[:-200]
                if on_line is not None:
                    on_line(line)

        stdout_task = asyncio.ensure_future(proc.stdout.read())
        stderr_task = asyncio.ensure_future(read_stderr(proc.stderr))
        done_task = asyncio.ensure_future(asyncio.gather(stdout_task, stderr_task, proc.wait()))
        waiters: set[asyncio.Future[Any]] = {done_task}
        cancel_task = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
        if cancel_task is not None:
            waiters.add(cancel_task)
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if not done_task.done():
                raise ImportCancelled("cancelled")
            out, _, rc = done_task.result()
        except BaseException:  # cancelled (task or event), or an error: stop the engine, leave nothing
            await _stop(proc)
            for t in (stdout_task, stderr_task, done_task):
                t.cancel()
            await asyncio.gather(stdout_task, stderr_task, done_task, return_exceptions=True)
            if cleanup is not None:
                _remove_partial(cleanup, proc.pid)
            raise
        finally:
            if cancel_task is not None:
                cancel_task.cancel()
        if rc != 0 and cleanup is not None:
            _remove_partial(cleanup, proc.pid)
        return rc, out.decode("utf-8", errors="replace"), lines

    # ------------------------------------------------------------------------------------------ cache
    def _load_cache(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads((self.models_dir / _CACHE_FILE).read_text())
            files = data.get("files", {})
            return {k: v for k, v in files.items() if isinstance(v, dict)}
        except (OSError, ValueError, AttributeError):
            return {}

    def _save_cache(self, files: dict[str, dict[str, Any]]) -> None:
        if self.models_dir.is_dir():
            with contextlib.suppress(OSError):
                write_json_atomic(self.models_dir / _CACHE_FILE, {"files": files})


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM (the engine then removes its partial output and exits 143); killed if it doesn't within 10 s.

    Not SIGINT: an app started with SIGINT ignored (a shell's background job) passes that on to the engine,
    which then never saw the cancel and finished the import (measured: the output of a cancelled import stayed).
    """
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()  # TerminateProcess on Windows
    try:
        await asyncio.wait_for(proc.wait(), _STOP_GRACE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def _remove_partial(dest: Path, pid: int) -> None:
    with contextlib.suppress(OSError):
        (dest.parent / f".{dest.name}.partial-{pid}").unlink()


def import_failure(name: str, reason: str, kind: str | None) -> tuple[str, bool]:
    """(one plain sentence, whether it is permanent) for a failed import, from the engine's name for its exit code
    (`tokenwing info --json`'s exit_codes). The engine's own words ("…: not a GGUF file (magic b'hell')", a
    tensor's name, the exit code) are for the details: the walk-through's notification showed them, and offered
    Retry for a corrupt file, which no retry can change. Retry stays for what can pass (disk space, a crash)."""
    if kind is None and any(w in reason.lower() for w in ("not a gguf", "corrupt", "truncated", "checksum")):
        kind = "bad_input"  # an engine that does not name its exit codes: its words
    if kind == "no_disk_space":
        return f"There is not enough free disk space to import {name}; free some and try again.", False
    if kind == "unsupported":
        return f"The model in {name} is of a kind this version of Run My AI cannot run yet.", True
    if kind == "corrupt_model":
        return f"The file {name} is damaged: its contents do not match its own checksums. Download it again.", True
    if kind == "bad_input":
        return f"The file {name} is damaged or not a GGUF model, so it cannot be imported.", True
    return f"The import of {name} stopped: the engine quit before it finished.", False


def _engine_error(lines: Sequence[str], rc: int) -> str:
    """The engine's one-line error ("tokenwing: error: …"), without the prefix and final period."""
    for line in reversed(lines):
        if line.startswith("tokenwing: error: "):
            return line.removeprefix("tokenwing: error: ").rstrip(".")
    for line in reversed(lines):
        text = line.strip()
        if text and not text.startswith("{"):
            return text.removeprefix("tokenwing: ").rstrip(".")
    return f"the engine stopped with exit code {rc}"


def _facts(info: Mapping[str, Any]) -> dict[str, Any]:
    """The part of `inspect --json` the estimate uses, without the per-layer table (the cache stays small)."""
    keys = ("architecture", "block_count", "context_length", "shared_experts", "kv_bytes_per_token", "graph_reserve")
    facts = {k: info.get(k) for k in keys}
    experts = info.get("experts")
    if isinstance(experts, dict):
        layers = experts.get("layers") or []
        records = [
            int(el["record_bytes"]) for el in layers if isinstance(el, dict) and isinstance(el.get("record_bytes"), int)
        ]
        facts["experts"] = {
            "count": experts.get("count"),
            "used_per_token": experts.get("used_per_token"),
            "streamed_layers": experts.get("streamed_layers"),
            "layers": [{"record_bytes": round(sum(records) / len(records))}] if records else [],
        }
    facts["resident"] = info.get("resident")
    facts["lazy"] = info.get("lazy")
    return facts


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
