"""From a hub repository to a model in the library: one quant, every shard, repacked within the disk a user has.

The one code path behind the window's Download button and `runmyai get REPO[:QUANT]`:

1. **Quants.** The repository's GGUFs grouped into quants (`quants.py`); one quant's shard headers are fetched
   with HTTP range requests and planned by the engine (`tokenwing repack --shards M --plan --json`), which gives
   the model's facts for "Will it run here?" on every quant (the other quants scaled by their size) and the
   best one: the largest that runs well and fits the disk.
2. **Plan.** Every shard header of the chosen quant is fetched the same way, so the repacked file is planned
   before any tensor data arrives: its size and the disk at the peak of either path, checked against the free
   space before a byte of data is fetched.
3. **Download and repack together.** Shards are downloaded in order (resumable, sha256-checked against the
   hub's LFS checksum, refetched when corrupt) into the job's folder; as each completes, the engine repacks the
   shards that are there (`--delete-source`: each is deleted once its data is written and verified), so the
   drive holds the repacked file so far plus at most two shards (one repacking, one downloading): under the
   repacked file + the largest shard at any moment.
4. **Restart anywhere.** The job (`downloads/jobs/<id>/job.json`, the header files and the engine's manifest)
   survives the app; partial downloads resume; the engine resumes from its last verified shard and reports which
   shards it holds. The repacked file appears in the models folder only once complete and verified.
5. **Failures that stay.** A job that failed in a way trying again will not change (an architecture the engine
   cannot run, a corrupt repository, a file the hub no longer has) is kept as failed with its reason: never
   resumed at start, shown until the user forgets it or asks for it again. Any job can be forgotten: it is
   stopped and everything it left (partial downloads, shards, headers, the engine's partial output) removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from runmyai.engine.info import EngineInfo
from runmyai.jsonfile import read_json, write_json_atomic
from runmyai.library.downloads import DownloadManager, DownloadStatus, download_id
from runmyai.library.estimate import DISK_MARGIN, Estimate, Footprint, footprint_from_inspect, launch_estimate
from runmyai.library.hub import REPACKED_SUFFIX, HubClient, HubError, HubFile
from runmyai.library.keys import HubKey
from runmyai.library.local import LibraryError, LocalLibrary, LocalModel, repacked_name
from runmyai.library.mmproj import MmprojError, get_mmproj
from runmyai.library.quants import Quant, QuantError, find_quant, group_quants
from runmyai.machine import MachineInfo, disk_free
from runmyai.units import SizeSum, human_bytes

log = logging.getLogger(__name__)

JOB_VERSION = 1
FIRST_HEADER_BYTES = 8 << 20  # the first shard carries the tokenizer: Qwen3's GGUF header is about 6 MB
OTHER_HEADER_BYTES = 1 << 20  # later shards carry the split keys and their part of the tensor table
MAX_HEADER_BYTES = 1 << 30
CORRUPT_RETRIES = 3  # a shard whose sha256 does not match is fetched again this many times
SOURCE_WINDOW = 2  # shards on disk at once in their downloaded form (one repacking, one downloading)

Phase = Literal["listing", "planning", "downloading", "repacking", "done"]
JobState = Literal["running", "paused", "failed", "done", "forgotten"]
# What the hub says for good: a file or repository that is not there, bytes that never match their checksum, a
# file changed upstream under the job's recorded checksums.
PERMANENT_HUB_KINDS = frozenset({"not_found", "corrupt", "changed"})


class AcquireError(Exception):
    """One sentence for the user. The job is kept: run it again to resume; `permanent`: trying again will not
    change it (the job is kept as failed, not resumed at start)."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class GetProgress:
    phase: Phase
    fraction: float  # of the whole job: downloading and repacking count half each
    message: str


ProgressFn = Callable[[GetProgress], None]


@dataclass(frozen=True)
class JobStatus:
    """A job as the user sees it (the app's downloads list): `on_job` gets one at every change."""

    id: str
    repo: str
    quant: str
    state: JobState
    fraction: float  # of the whole job, as GetProgress counts it
    size: int  # the quant's bytes on the hub
    message: str


@dataclass(frozen=True)
class QuantChoice:
    quant: Quant
    estimate: Estimate | None
    bits_per_weight: float | None
    disk_needed: int | None  # at the peak, repacking while downloading
    exact: bool  # planned from this quant's own headers (else scaled from the reference quant)

    @property
    def fits_disk(self) -> bool:
        return self.estimate is None or self.estimate.verdict != "no_disk_space"


@dataclass(frozen=True)
class RepoQuants:
    repo: str
    revision: str
    choices: tuple[QuantChoice, ...]
    repacked: tuple[HubFile, ...]  # already-repacked files in the repository (downloaded as they are)
    reference: str | None  # the quant whose headers gave the model's facts
    note: str = ""  # why there are no estimates, when there are none
    refused: str = ""  # the engine's reason when it refuses the model itself (its plan failed for good)

    def best(self) -> QuantChoice | None:
        """The largest quant that runs well and fits the disk; else the fastest that runs, slowly, and fits; None
        when no quant is estimated to run here and fit (unsupported, too big for the disk, or no estimate): the
        app never recommends one of those."""
        good = [c for c in self.choices if c.estimate is not None and c.estimate.verdict == "runs_well"]
        if good:
            return max(good, key=lambda c: c.quant.size or 0)
        fits = [c for c in self.choices if c.estimate is not None and c.estimate.verdict == "runs_slowly"]
        if fits:
            return max(fits, key=lambda c: (c.estimate.tokens_per_s if c.estimate else 0, c.quant.size or 0))
        return None

    def cannot_run(self) -> str | None:
        """Why no quant of this repository can run on the installed engine, in one sentence (None when one may):
        the engine refused the model, or its estimate says the engine does not run its architecture. Such a
        repository is not offered for download as a model to run."""
        if self.refused:
            return f"{self.repo} cannot run here: {self.refused}"
        estimates = [c.estimate for c in self.choices if c.estimate is not None]
        if estimates and all(e.verdict == "unsupported" for e in estimates):
            return f"{self.repo} cannot run here: {estimates[0].reasons[-1]}"
        return None

    def why_none(self) -> str:
        """Why `best()` is None, in one sentence."""
        if self.refused:
            return f"{self.repo} cannot run here: {self.refused}"
        if self.note:
            return f"No quant of {self.repo} can be chosen for this machine ({self.note})."
        estimates = [c.estimate for c in self.choices if c.estimate is not None]
        unsupported = next((e for e in estimates if e.verdict == "unsupported"), None)
        if unsupported is not None:
            return f"{self.repo} cannot run here: {unsupported.reasons[-1]}"
        if estimates and all(e.verdict == "no_disk_space" for e in estimates):
            return f"No quant of {self.repo} fits on this disk; free some space or choose another models folder."
        return f"No quant of {self.repo} can be estimated for this machine."

    def get(self, name: str) -> QuantChoice:
        quant = find_quant([c.quant for c in self.choices], name)
        return next(c for c in self.choices if c.quant is quant)


@dataclass
class ShardSpec:
    path: str  # in the repository
    size: int
    sha256: str | None
    header_bytes: int = 0  # how much of its start is in the job's header file

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass
class Job:
    """One quant on its way into the library; saved in its folder after every step."""

    folder: Path
    repo: str
    revision: str
    quant: str
    shards: list[ShardSpec]
    output: str  # the repacked file, relative to the models folder
    plan: dict[str, Any] | None = None
    done: list[int] = dataclasses.field(default_factory=list)  # shards the engine has repacked (and deleted)
    started: bool = False  # False: only planned (to show the quants); True: the user asked for this model
    failed: str | None = None  # why it stopped for good (AcquireError.permanent): not resumed at start

    @property
    def id(self) -> str:
        return self.folder.name

    def shard_file(self, i: int) -> Path:
        return self.folder / "shards" / self.shards[i].name

    def header_file(self, i: int) -> Path:
        return self.folder / "headers" / self.shards[i].name

    @property
    def manifest(self) -> Path:
        return self.folder / "manifest.json"

    def save(self) -> None:
        data = {
            "version": JOB_VERSION,
            "repo": self.repo,
            "revision": self.revision,
            "quant": self.quant,
            "output": self.output,
            "shards": [dataclasses.asdict(s) for s in self.shards],
            "plan": self.plan,
            "done": sorted(set(self.done)),
            "started": self.started,
            "failed": self.failed,
        }
        write_json_atomic(self.folder / "job.json", data)

    def write_manifest(self) -> None:
        """The engine's view of the shards: where each lands, its size, and its header file."""
        shards = [{"path": f"shards/{s.name}", "size": s.size, "header": f"headers/{s.name}"} for s in self.shards]
        write_json_atomic(self.manifest, {"shards": shards})

    @classmethod
    def load(cls, folder: Path) -> Job | None:
        data = read_json(folder / "job.json")
        if data is None or data.get("version") != JOB_VERSION:
            return None
        try:
            shards = [
                ShardSpec(str(s["path"]), int(s["size"]), s.get("sha256"), int(s.get("header_bytes", 0)))
                for s in data["shards"]
            ]
            plan = data.get("plan")
            failed = data.get("failed")
            return cls(
                folder,
                str(data["repo"]),
                str(data["revision"]),
                str(data["quant"]),
                shards,
                str(data["output"]),
                plan if isinstance(plan, dict) else None,
                [int(i) for i in data.get("done", [])],
                bool(data.get("started", False)),
                str(failed) if failed is not None else None,
            )
        except (KeyError, TypeError, ValueError):
            return None


def _scaled(fp: Footprint, ratio: float) -> Footprint:
    """Another quant of the same model: its weights scale with its size (the alignment padding does not)."""
    return dataclasses.replace(
        fp,
        size_bytes=round(fp.size_bytes * ratio),
        expert_bytes=max(1, round(fp.expert_bytes * ratio)),
        dense_bytes_per_token=round(fp.dense_bytes_per_token * ratio),
        lazy_bytes=round(fp.lazy_bytes * ratio),
    )


def job_id(repo: str, revision: str, quant: str) -> str:
    return hashlib.sha256(f"{repo}\n{revision}\n{quant}".encode()).hexdigest()[:16]


class Acquirer:
    """Gets models from the hub into the library; see the module docstring."""

    def __init__(
        self,
        hub: HubClient,
        downloads: DownloadManager,
        library: LocalLibrary,
        jobs_dir: Path,
        *,
        engine: Callable[[], EngineInfo],
        machine: Callable[[], MachineInfo | None],
        disk_margin: int = DISK_MARGIN,
        on_job: Callable[[JobStatus], None] | None = None,
    ) -> None:
        """`engine`, `machine`: the current engine facts and machine probe (they change while the app runs);
        `disk_margin`: free space kept beyond a job's peak; `on_job`: every change of a started job."""
        self.hub = hub
        self.downloads = downloads
        self.library = library
        self.jobs_dir = jobs_dir
        self.engine = engine
        self.machine = machine
        self.disk_margin = disk_margin
        self.on_job = on_job
        self._running: dict[str, asyncio.Task[Any]] = {}  # job id → the task running it

    # ------------------------------------------------------------------------------------------ quants
    async def quants(self, repo: str, revision: str = "main", files: list[HubFile] | None = None) -> RepoQuants:
        """The repository's quants, each with its size, bits per weight and "Will it run here?"."""
        files = files if files is not None else await self.hub.list_files(repo, revision)
        quants = group_quants(files)
        repacked = tuple(f for f in files if f.path.endswith(REPACKED_SUFFIX))
        if not quants:
            return RepoQuants(repo, revision, (), repacked, None, "no GGUF model files in this repository")
        reference = quants[0]  # the smallest: its plan fetches the least (the model's facts are the same)
        job = self._job(repo, revision, reference)
        try:  # a job under way has its plan: never touch its files from here
            plan = job.plan if job.started and job.plan is not None else await self._plan(job)
        except (HubError, LibraryError, AcquireError) as e:
            choices = tuple(QuantChoice(q, None, None, None, False) for q in quants)
            refused = self._refusal(e, job)
            return RepoQuants(repo, revision, choices, repacked, None, f"no estimate: {e}", refused or "")
        finally:
            if not job.started:  # only looked at: leave no header files behind (a download plans again)
                await asyncio.to_thread(shutil.rmtree, job.folder, True)
        return RepoQuants(repo, revision, self._choices(quants, reference, plan), repacked, reference.name)

    def _choices(self, quants: list[Quant], reference: Quant, plan: dict[str, Any]) -> tuple[QuantChoice, ...]:
        model = plan["model"]
        base = footprint_from_inspect(model, int(plan["output_bytes"]))
        params = model.get("parameters")
        machine, engine = self.machine(), self.engine()
        ref_size = reference.size or 1
        out: list[QuantChoice] = []
        for q in quants:
            exact = q is reference
            ratio = (q.size or ref_size) / ref_size
            fp = base if exact else _scaled(base, ratio)
            peak = fp.size_bytes + q.largest_shard
            bpw = (q.size or 0) * 8 / params if isinstance(params, int) and params > 0 and q.size else None
            est = launch_estimate(fp, machine, engine, disk_needed=peak) if machine is not None else None
            out.append(QuantChoice(q, est, bpw, peak, exact))
        return tuple(out)

    # ------------------------------------------------------------------------------------------ jobs
    def _job(self, repo: str, revision: str, quant: Quant) -> Job:
        """The job of this quant: the one saved by an earlier run, else a new one (saved once it starts)."""
        folder = self.jobs_dir / job_id(repo, revision, quant.name)
        job = Job.load(folder)
        if job is not None:
            return job
        shards = [ShardSpec(f.path, f.size or 0, f.sha256) for f in quant.files]
        if any(s.size <= 0 for s in shards):
            raise AcquireError(f"The hub did not say how big the shards of {quant.name} are; try again later.")
        output = "/".join([*repo.split("/"), repacked_name(Path(quant.first.path))])
        return Job(folder, repo, revision, quant.name, shards, output)

    def started(self) -> list[Job]:
        """Every job the user asked for that is not finished (interrupted, or failed for good), oldest first."""
        try:
            folders = sorted(self.jobs_dir.iterdir(), key=lambda p: p.stat().st_mtime)
        except OSError:
            return []
        jobs = (Job.load(f) for f in folders if f.is_dir())
        return [job for job in jobs if job is not None and job.started]

    def unfinished(self) -> list[Job]:
        """Jobs left by an earlier run to resume (interrupted downloads or repacks), oldest first; not those that
        failed for good (retrying at every start changed nothing, silently: issue 29, defect 4)."""
        return [job for job in self.started() if job.failed is None]

    def status(self, job: Job) -> JobStatus:
        """A job that is not running as the user sees it: paused (resumable) or failed (with its reason)."""
        if self.is_running(job.id):
            state: JobState = "running"
            message = "Running…"
        elif job.failed is not None:
            state, message = "failed", job.failed
        else:
            state, message = "paused", "Paused: resume to continue."
        size = self._size(job)  # a shard the engine holds is downloaded and repacked: both halves of its part
        done = sum(job.shards[i].size for i in set(job.done) if 0 <= i < len(job.shards))
        return JobStatus(job.id, job.repo, job.quant, state, done / max(1, size), size, message)

    def is_running(self, job_id: str) -> bool:
        task = self._running.get(job_id)
        return task is not None and not task.done()

    def find(self, job_id: str) -> Job | None:
        return next((job for job in self.started() if job.id == job_id), None)

    async def forget(self, job_id: str) -> None:
        """Cancels a job (stopping its run, which the caller of `run` sees as a cancellation) and removes all it
        left: its downloads and their partial files, its shards and headers, the engine's partial output."""
        task = self._running.get(job_id)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        job = Job.load(self.jobs_dir / job_id)
        if job is None:
            return
        for i in range(len(job.shards)):
            id_ = self.downloads_id(job, i)
            with contextlib.suppress(KeyError):
                self.downloads.cancel(id_)
                await self.downloads.wait(id_)  # a running one removes its partial as it stops
                self.downloads.forget(id_)
        dest = self.library.models_dir / job.output
        await asyncio.to_thread(shutil.rmtree, job.folder, True)
        await asyncio.to_thread(shutil.rmtree, _engine_state(dest), True)
        self._emit(JobStatus(job.id, job.repo, job.quant, "forgotten", 0.0, self._size(job), "Forgotten."))

    def _clear(self, job: Job) -> None:
        """A finished job's leftovers: its folder and its (finished) downloads' entries."""
        for i in range(len(job.shards)):
            id_ = self.downloads_id(job, i)
            with contextlib.suppress(KeyError):
                self.downloads.cancel(id_)
                self.downloads.forget(id_)
        shutil.rmtree(job.folder, ignore_errors=True)

    def _emit(self, status: JobStatus) -> None:
        if self.on_job is not None:
            try:
                self.on_job(status)
            except Exception:
                log.exception("on_job callback failed")

    @staticmethod
    def _size(job: Job) -> int:
        return sum(s.size for s in job.shards)

    def _permanent(self, e: BaseException) -> bool:
        """True for a failure that will not change by trying again (see PERMANENT_*)."""
        if isinstance(e, AcquireError):
            return e.permanent
        if isinstance(e, LibraryError):
            return self.engine().permanent(e.exit_code)  # (the engine says which of its refusals are for good)
        if isinstance(e, HubError):
            return e.kind in PERMANENT_HUB_KINDS
        return False

    def _refusal(self, e: BaseException, job: Job) -> str | None:
        """The engine's one-line reason when it refuses the model itself (an architecture it cannot run, a
        corrupt header), without the job's folder in it; None for any other failure."""
        if not isinstance(e, LibraryError) or not self.engine().permanent(e.exit_code):
            return None
        reason = e.detail or str(e)
        for folder in ("headers", "shards"):  # a shard by its name, not where the job keeps it
            reason = reason.replace(f"{job.folder / folder}{os.sep}", "")
        reason = reason.rstrip(".")
        return f"the installed engine refuses it ({reason})."

    def downloads_id(self, job: Job, i: int) -> str:
        return download_id(job.repo, job.shards[i].path, job.revision)

    # ------------------------------------------------------------------------------------------ get
    async def get(self, key: HubKey, on_progress: ProgressFn | None = None) -> LocalModel:
        """Gets `key.repo` (at `key.quant`, else the best quant for this machine) into the library."""
        report = on_progress or (lambda p: None)
        report(GetProgress("listing", 0.0, f"Reading {key.repo} on the hub…"))
        files = await self.hub.list_files(key.repo)
        quants = group_quants(files)
        if key.quant is None and not quants:
            repacked = [f for f in files if f.path.endswith(REPACKED_SUFFIX)]
            if repacked:
                return await self._download_repacked(repacked[0], report)
        if not quants:
            raise AcquireError(f"{key.repo} holds no GGUF model files.")
        try:
            if key.quant is not None:
                quant = find_quant(quants, key.quant)
            else:
                report(GetProgress("planning", 0.0, "Choosing the quant that suits this machine…"))
                repo_quants = await self.quants(key.repo, files=files)
                best = repo_quants.best()
                if best is None:
                    raise AcquireError(f"{repo_quants.why_none()} To get one anyway, name it: {key.repo}:QUANT.")
                quant = best.quant
        except QuantError as e:
            raise AcquireError(str(e)) from None
        return await self.run(self._job(key.repo, "main", quant), report)

    async def run(self, job: Job, on_progress: ProgressFn | None = None) -> LocalModel:
        """Runs (or resumes) a job to the end: the model in the library, the job's folder gone. Asked for again, a
        job that failed for good is tried again; failing for good again, it raises a permanent AcquireError."""
        given = on_progress or (lambda p: None)

        def report(p: GetProgress) -> None:
            given(p)
            self._emit(JobStatus(job.id, job.repo, job.quant, "running", p.fraction, self._size(job), p.message))

        dest = self.library.models_dir / job.output
        if dest.is_file():
            await self._encoder(job, dest, report)
            self._clear(job)
            return await self.library.describe(dest)
        # its own task, so that `forget` stops this job and nothing else its caller does
        task = asyncio.ensure_future(self._run(job, dest, report))
        self._running[job.id] = task
        try:
            model = await task
        finally:
            if self._running.get(job.id) is task:
                del self._running[job.id]
        await self._encoder(job, dest, report)
        self._clear(job)
        given(GetProgress("done", 1.0, f"{dest.name} is in your library."))
        self._emit(JobStatus(job.id, job.repo, job.quant, "done", 1.0, self._size(job), f"{dest.name} is ready."))
        return model

    async def _encoder(self, job: Job, dest: Path, report: ProgressFn) -> None:
        """A vision model's image encoder (its repository's mmproj) beside it (library/mmproj.py); failing, the job
        stays to be run again (the model is there: only the encoder is fetched then)."""
        report(GetProgress("downloading", 1.0, f"Looking for {job.repo}'s image encoder…"))
        try:
            await get_mmproj(self.hub, self.downloads, job.repo, job.revision, dest.parent, self.library.presets)
        except (HubError, MmprojError) as e:
            raise AcquireError(f"{dest.name} is here, but its image encoder is not: {e}") from None

    async def _run(self, job: Job, dest: Path, report: ProgressFn) -> LocalModel:
        try:
            report(GetProgress("planning", 0.0, f"Planning {job.quant} from its shards' headers…"))
            if not job.started or job.failed is not None:
                job.started, job.failed = True, None
                await asyncio.to_thread(job.save)
            if job.plan is None:
                job.plan = await self._plan(job)
                await asyncio.to_thread(job.save)
            self._check_disk(job, dest)
            return await _Transfer(self, job, dest, report).run()
        except (HubError, LibraryError, AcquireError) as e:
            if not self._permanent(e):
                self._emit(dataclasses.replace(self.status(job), state="paused", message=f"Stopped: {e}"))
                raise
            refused = self._refusal(e, job)
            why = f"{job.repo} ({job.quant}) cannot run here: {refused}" if refused else str(e).rstrip(".") + "."
            job.failed = f"{why} Trying again will not change that."
            await asyncio.to_thread(job.save)
            self._emit(dataclasses.replace(self.status(job), state="failed", message=job.failed))
            raise AcquireError(job.failed, permanent=True) from None
        except asyncio.CancelledError:
            if (self.jobs_dir / job.id).is_dir():  # not forgotten meanwhile
                self._emit(dataclasses.replace(self.status(job), state="paused", message="Paused."))
            raise

    async def _download_repacked(self, f: HubFile, report: ProgressFn) -> LocalModel:
        """A repository of already-repacked files: the file itself, straight into the models folder."""
        id_ = self.downloads.enqueue(f.repo, f.path, f.revision, f.sha256, f.size)
        report(GetProgress("downloading", 0.0, f"Downloading {f.path}…"))
        status = await self.downloads.wait(id_)
        if status.state != "done" or status.dest is None:
            raise AcquireError(status.message)
        return await self.library.describe(status.dest)

    async def _plan(self, job: Job) -> dict[str, Any]:
        """The engine's plan from the shards' headers, fetching more of a header while it is cut too short."""
        await asyncio.to_thread(lambda: (job.folder / "headers").mkdir(parents=True, exist_ok=True))
        want = {
            i: min(s.size, FIRST_HEADER_BYTES if i == 0 else OTHER_HEADER_BYTES)
            for i, s in enumerate(job.shards)
            if s.header_bytes == 0 or not job.header_file(i).is_file()
        }
        while True:
            for i, length in want.items():
                s = job.shards[i]
                data = await self.hub.read_prefix(job.repo, s.path, length, job.revision)
                await asyncio.to_thread(_write_file, job.header_file(i), data)
                s.header_bytes = len(data)
            await asyncio.to_thread(job.write_manifest)
            await asyncio.to_thread(job.save)
            plan = await self.library.plan_shards(job.manifest)
            short = plan.get("headers_incomplete")
            if not short:
                break
            want = {}
            for i in short:
                s = job.shards[int(i)]
                if s.header_bytes >= min(s.size, MAX_HEADER_BYTES):
                    raise AcquireError(f"The header of {s.name} is larger than {human_bytes(MAX_HEADER_BYTES)}.")
                want[int(i)] = min(s.size, 4 * s.header_bytes)
        for key in ("output_bytes", "peak_bytes", "model", "largest_shard_bytes", "shards"):
            if key not in plan:
                raise AcquireError("The engine's plan of this model could not be read.")
        # keep only each header (what was fetched beyond it is tensor data: no use, and disk taken)
        by_name = {str(e.get("file")): e.get("header_bytes") for e in plan["shards"] if isinstance(e, dict)}
        for i, s in enumerate(job.shards):
            keep = by_name.get(s.name)
            if isinstance(keep, int) and 0 < keep < s.header_bytes:
                await asyncio.to_thread(os.truncate, job.header_file(i), keep)
                s.header_bytes = keep
        await asyncio.to_thread(job.save)
        return plan

    def _check_disk(self, job: Job, dest: Path) -> None:
        """Enough free space for the rest of the job at its peak, said with both paths' numbers, or an error."""
        assert job.plan is not None
        out = int(job.plan["output_bytes"])
        largest = int(job.plan["largest_shard_bytes"])
        copy_peak = int(job.plan["peak_bytes"]["copy"])
        stream_peak = int(job.plan["peak_bytes"]["streaming"])
        parts = [self.downloads.state_dir / f"{self.downloads_id(job, i)}.part" for i in range(len(job.shards))]
        already = _allocated_under(_engine_state(dest)) + sum(
            _size(p) for p in [*parts, *(job.shard_file(i) for i in range(len(job.shards)))]
        )
        held = min(already, stream_peak)  # what the job has on the drive already counts toward its peak
        margin = self.disk_margin
        free = disk_free(dest.parent)
        if free >= stream_peak - held + margin:
            return
        # every number in one unit and each sum worked out from the numbers as shown, so that they add up
        u: SizeSum | None = SizeSum(out, largest, margin, held, free, copy_peak)
        while u is not None:
            need = u.q(out) + u.q(largest) + u.q(margin) - u.q(held)
            if need > u.q(free):
                break
            u = u.finer()  # rounded, the shortfall vanished: state it more precisely
        assert u is not None  # in whole bytes the shown sums are the true ones
        less = f" − {u.text(u.q(held))} this job already holds" if u.q(held) else ""
        copy = u.q(copy_peak) + u.q(margin) - u.q(held)
        raise AcquireError(
            f"Not enough free space for {job.quant} of {job.repo}: repacking while downloading needs {u.text(need)} "
            f"at its peak (the repacked file {u.text(u.q(out))} + the largest shard {u.text(u.q(largest))} + "
            f"{u.text(u.q(margin))} kept free{less}; {u.text(copy)} if it were repacked after the download), but "
            f"{u.text(u.q(free))} is free in {dest.parent}: {u.text(need - u.q(free))} short."
        )


class _Transfer:
    """The download and repack loop of one job (see the module docstring, step 3)."""

    def __init__(self, owner: Acquirer, job: Job, dest: Path, report: ProgressFn) -> None:
        self.a = owner
        self.job = job
        self.dest = dest
        self.report = report
        self.n = len(job.shards)
        self.total = sum(s.size for s in job.shards)
        self.corrupt: dict[int, int] = {}
        self.waiting: dict[int, asyncio.Task[DownloadStatus]] = {}  # shard → its download's end
        self.repack: asyncio.Task[dict[str, Any]] | None = None
        self.repack_fraction = 0.0
        self.downloaded: set[int] = set()  # finished downloads not yet repacked (their file is in shards/)

    def _present(self, i: int) -> bool:
        return _size(self.job.shard_file(i)) == self.job.shards[i].size

    async def run(self) -> LocalModel:
        job = self.job
        await asyncio.to_thread(lambda: (job.folder / "shards").mkdir(parents=True, exist_ok=True))
        await asyncio.to_thread(job.write_manifest)
        try:
            # the engine first: it knows which shards an earlier run repacked and deleted, and takes any
            # downloaded shard that is waiting
            if any(self._present(i) for i in range(self.n)) or _engine_state(self.dest).exists():
                self._start_repack()
                assert self.repack is not None
                await asyncio.wait({self.repack})
                if await self._repack_done():
                    return await self.a.library.describe(self.dest)
            while True:
                self._fill_window()
                waiters: set[asyncio.Future[Any]] = set(self.waiting.values())
                if self.repack is not None:
                    waiters.add(self.repack)
                if not waiters:
                    raise AcquireError(f"Nothing left to do for {job.quant} of {job.repo}, but no repacked file.")
                done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for i, task in list(self.waiting.items()):
                    if task in done:
                        del self.waiting[i]
                        self._downloaded(i, task.result())
                if self.repack is not None and self.repack in done and await self._repack_done():
                    return await self.a.library.describe(self.dest)
                if self.repack is None and self.downloaded:
                    self._start_repack()
        except BaseException:
            await self._stop()
            raise

    def _fill_window(self) -> None:
        """Starts the next downloads while fewer than SOURCE_WINDOW shards are on disk or arriving."""
        pending = [i for i in range(self.n) if i not in self.job.done]
        busy = len(self.waiting) + len(self.downloaded)
        for i in pending:
            if busy >= SOURCE_WINDOW:
                break
            if i in self.waiting or i in self.downloaded:
                continue
            if self._present(i):
                self.downloaded.add(i)
                busy += 1
                continue
            s = self.job.shards[i]
            id_ = self.a.downloads.enqueue(
                self.job.repo, s.path, self.job.revision, s.sha256, s.size, dest=self.job.shard_file(i)
            )
            self.waiting[i] = asyncio.ensure_future(self._wait(id_))
            busy += 1
        if self.repack is None and self.downloaded:
            self._start_repack()

    async def _wait(self, id_: str) -> DownloadStatus:
        return await self.a.downloads.wait(id_)

    def _downloaded(self, i: int, status: DownloadStatus) -> None:
        name = self.job.shards[i].name
        if status.state == "done":
            self.downloaded.add(i)
            self._progress()
            return
        if status.state == "failed" and status.error_kind == "corrupt":
            tries = self.corrupt[i] = self.corrupt.get(i, 0) + 1
            if tries <= CORRUPT_RETRIES:
                log.warning("%s failed its sha256 check; fetching it again (%d)", name, tries)
                self.report(GetProgress("downloading", self._fraction(), f"{name} was corrupt; fetching it again…"))
                return  # the next _fill_window enqueues it again
        if status.state != "failed":
            raise AcquireError(f"The download of {name} was cancelled.")
        raise AcquireError(status.message, permanent=status.error_kind in PERMANENT_HUB_KINDS)

    def _start_repack(self) -> None:
        def on_progress(fraction: float, message: str) -> None:
            self.repack_fraction = fraction
            self._progress()

        self.repack = asyncio.ensure_future(self.a.library.repack_shards(self.job.manifest, self.dest, on_progress))

    async def _repack_done(self) -> bool:
        """Takes a finished engine run's answer; True when the repacked file is complete."""
        task, self.repack = self.repack, None
        assert task is not None
        result = task.result()  # LibraryError propagates: the job stays, resumable
        self.job.done = sorted(set(result["done"]))
        await asyncio.to_thread(self.job.save)
        self.downloaded -= set(self.job.done)
        self._progress()
        return bool(result["complete"]) and self.dest.is_file()

    def _fraction(self) -> float:
        got = sum(self.job.shards[i].size for i in set(self.job.done) | self.downloaded)
        for st in self.a.downloads.items():
            if st.dest is not None and st.dest.parent == self.job.folder / "shards" and st.state != "done":
                got += st.done_bytes
        return 0.5 * min(1.0, got / max(1, self.total)) + 0.5 * self.repack_fraction

    def _progress(self) -> None:
        arriving = [self.job.shards[i].name for i in sorted(self.waiting)]
        phase: Phase = "repacking" if self.repack is not None and not self.waiting else "downloading"
        text = progress_text(len(self.job.done), self.n, arriving, phase == "repacking")
        self.report(GetProgress(phase, self._fraction(), text))

    async def _stop(self) -> None:
        """Pauses the job's downloads and interrupts the engine (which keeps what it verified)."""
        for i, task in self.waiting.items():
            with contextlib.suppress(KeyError):
                self.a.downloads.pause(self.a.downloads_id(self.job, i))
            task.cancel()
        tasks: list[asyncio.Future[Any]] = list(self.waiting.values())
        if self.repack is not None:
            self.repack.cancel()
            tasks.append(self.repack)
        await asyncio.gather(*tasks, return_exceptions=True)


def progress_text(done: int, shards: int, arriving: Sequence[str], repacking: bool) -> str:
    """A get's progress in words, beside its repository and quant (each place that shows it names them: it read
    'Getting OWNER/NAME (Q8_0): Q8_0: 0 of 1 shards repacked; downloading none' at 50 %, while it repacked). A
    one-file quant says no part counts."""
    doing = "preparing it for the engine" if repacking or not arriving else "downloading"
    if shards <= 1:
        return doing[0].upper() + doing[1:]
    names = f" {', '.join(arriving)}" if doing == "downloading" else ""
    return f"{done} of {shards} parts ready; {doing}{names}"


def _engine_state(dest: Path) -> Path:
    """Where the engine keeps a resumable repack's progress beside its output (docs/model-format.md)."""
    return dest.parent / f".{dest.name}.repack"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _allocated_under(folder: Path) -> int:
    """Bytes the files in a folder take on the drive (the engine's partial output is sparse until written)."""
    total = 0
    try:
        for p in folder.rglob("*"):
            with contextlib.suppress(OSError, AttributeError):
                total += p.stat().st_blocks * 512
    except OSError:
        pass
    return total


def _write_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_bytes(data)
    tmp.replace(path)
