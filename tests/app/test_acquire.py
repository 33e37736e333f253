"""From a split, multi-quant GGUF repository on the local hub server to a model that chats: one quant, every
shard, resumable, sha256-checked, repacked shard by shard within the disk (real HTTP, the real engine CLI)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import html
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from PySide6.QtWidgets import QApplication, QPushButton

from runmyai.engine.client import ChatClient, ChatSettings
from runmyai.engine.info import EngineInfo, ask_engine
from runmyai.engine.supervisor import EngineSupervisor
from runmyai.library.acquire import AcquireError, Acquirer, GetProgress, JobStatus
from runmyai.library.downloads import DownloadManager
from runmyai.library.estimate import DISK_MARGIN
from runmyai.library.hub import HubClient, HubFile, HubModel
from runmyai.library.keys import HubKey
from runmyai.library.local import LocalLibrary
from runmyai.library.quants import QuantError, find_quant, group_quants, quant_name
from runmyai.machine import MachineInfo, probe_machine
from runmyai.paths import AppPaths
from runmyai.ui import render
from runmyai.ui.controller import AppController
from runmyai.ui.main_window import MainWindow
from tests.app.hubserver import Faults, HubServer, RequestLog
from tests.app.test_app_scenario import until
from tests.conftest import ModelFactory, Mount
from tests.qtloop import run_qt

T = TypeVar("T")
REPO = "acme/Tiny-GGUF"
LAYOUT = {  # quant → where its shards are in the repository (the second one in a sub-folder, as big repos do)
    "Q8_0": "Tiny-Q8_0-{i:05d}-of-00003.gguf",
    "F16": "F16/Tiny-F16-{i:05d}-of-00003.gguf",
    "F32": "Tiny-F32-{i:05d}-of-00003.gguf",
}


MMPROJ = "mmproj-Tiny-F16.gguf"  # the repository's image encoder: downloaded beside the model (issue 45), not a quant
ODD = "acme/Odd-GGUF"  # the same shards with an architecture no engine runs (qwen9moe)


def with_architecture(data: bytes, arch: bytes) -> bytes:
    """A GGUF (shard) whose `general.architecture` says `arch` (as long as the one it had), else unchanged."""
    key = b"general.architecture"
    at = data.find(key)
    if at < 0:
        return data
    at += len(key)
    kind, length = struct.unpack_from("<IQ", data, at)
    assert kind == 8 and length == len(arch)  # a string of the same length: every offset stays
    at += 12
    return data[:at] + arch + data[at + length :]


def add_odd(hub: HubServer, split_models: dict[str, list[Path]]) -> None:
    for i, f in enumerate(split_models["Q8_0"], 1):
        data = with_architecture(f.read_bytes(), b"qwen9moe")
        hub.add_file(ODD, f"Odd-Q8_0-{i:05d}-of-00003.gguf", data, tags=["gguf"])


def shard_files(first: Path) -> list[Path]:
    return sorted(first.parent.glob(first.name.replace("-00001-of-", "-*-of-")))


@pytest.fixture(scope="module")
def split_models(model_factory: ModelFactory) -> dict[str, list[Path]]:
    return {q: shard_files(model_factory(type=q, shards=3, seed=5)) for q in LAYOUT}


@pytest.fixture
def hub(split_models: dict[str, list[Path]]) -> Iterator[HubServer]:
    with HubServer() as server:
        for q, files in split_models.items():
            for i, f in enumerate(files, 1):
                server.add_file(REPO, LAYOUT[q].format(i=i), f.read_bytes(), tags=["gguf"])
        server.add_file(REPO, MMPROJ, b"GGUF" + bytes(3000))  # a projector: not a quant
        server.add_file(REPO, "README.md", b"# Tiny\n")
        yield server


@pytest.fixture(scope="module")
def engine_info(tmp_path_factory: pytest.TempPathFactory) -> EngineInfo:
    info = asyncio.run(ask_engine(tmp_path_factory.mktemp("engine-info")))
    assert info.known, info.error
    return info


def plain_repack_sha(files: list[Path], tmp: Path, names: str | None = None) -> str:
    """What `tokenwing repack` writes in one go from the same shards under the same names (the repacked header
    records its sources' names): the bytes every path must end with."""
    folder = tmp / "plain"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    copies = [folder / (names.format(i=i) if names else f.name).rsplit("/", 1)[-1] for i, f in enumerate(files, 1)]
    for src, dst in zip(files, copies, strict=True):
        shutil.copyfile(src, dst)
    out = folder / "plain.tw.gguf"
    subprocess.run(
        [sys.executable, "-m", "tokenwing", "repack", str(copies[0]), "-o", str(out), "-q"], check=True, timeout=300
    )
    return sha256(out)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Env:
    def __init__(
        self, home: Path, hub: HubServer, engine: EngineInfo, client: HubClient | None = None, **acquirer: Any
    ) -> None:
        self.paths = AppPaths(home).ensure()
        self.hub = hub
        self.client = client or HubClient(endpoint=hub.url)
        self.downloads = DownloadManager(
            self.client, self.paths.downloads, self.paths.models, stall_timeout_s=2, max_retries=3,
            retry_backoff_s=0.02,
        )  # fmt: skip
        self.library = LocalLibrary(self.paths.models)
        self.machine: MachineInfo = probe_machine(self.paths.models)
        self.acquirer = Acquirer(
            self.client,
            self.downloads,
            self.library,
            self.paths.jobs,
            engine=lambda: engine,
            machine=lambda: self.machine,
            **acquirer,
        )
        self.progress: list[GetProgress] = []

    async def get(self, key: HubKey) -> Any:
        await self.downloads.start()
        try:
            return await self.acquirer.get(key, self.progress.append)
        finally:
            await self.downloads.close()


def run(fn: Callable[[], Awaitable[T]], timeout: float = 240) -> T:
    async def main() -> T:
        return await asyncio.wait_for(fn(), timeout)

    return asyncio.run(main())


def downloads_of(hub: HubServer, suffix: str) -> list[RequestLog]:
    """GETs of a file as a download (whole or resumed), not as a header read."""
    return [r for r in hub.gets(suffix) if not r.range or r.range.rstrip().endswith("-")]


def files_fetched(hub: HubServer) -> set[str]:
    """Repository paths whose body was requested as a download (whole or resumed), not as a header read."""
    out = set()
    for r in hub.gets(""):
        if "/resolve/" not in r.path:
            continue
        rng = r.range or ""
        if rng and not rng.rstrip().endswith("-"):
            continue  # bytes=0-N: a header
        out.add(r.path.split("/resolve/main/", 1)[1])
    return out


# ---------------------------------------------------------------------------------------------- quants
def _f(path: str, size: int | None = 10) -> HubFile:
    return HubFile("a/b", path, "main", size, None)


def test_quants_are_grouped_from_names_and_folders() -> None:
    files = [
        _f("Big-Q4_K_M-00002-of-00002.gguf", 20),
        _f("Big-Q4_K_M-00001-of-00002.gguf", 30),
        _f("UD-Q2_K_XL/Big-UD-Q2_K_XL-00001-of-00003.gguf"),
        _f("UD-Q2_K_XL/Big-UD-Q2_K_XL-00002-of-00003.gguf"),
        _f("UD-Q2_K_XL/Big-UD-Q2_K_XL-00003-of-00003.gguf"),
        _f("Big-Q8_0-00001-of-00002.gguf"),  # its second shard is missing: not offered
        _f("Big-IQ4_XS.gguf", 7),
        _f("mmproj-Big-F16.gguf"),
        _f("Big.tw.gguf"),
        _f("README.md"),
    ]
    quants = group_quants(files)
    assert [(q.name, q.size, len(q.files)) for q in quants] == [
        ("IQ4_XS", 7, 1),
        ("UD-Q2_K_XL", 30, 3),
        ("Q4_K_M", 50, 2),
    ]
    q4 = find_quant(quants, "q4_k_m")
    assert [f.path for f in q4.files] == ["Big-Q4_K_M-00001-of-00002.gguf", "Big-Q4_K_M-00002-of-00002.gguf"]
    assert q4.largest_shard == 30
    assert find_quant(quants, "UD").name == "UD-Q2_K_XL"  # a unique prefix
    with pytest.raises(QuantError, match=r"has no quant .Q5_K_M."):
        find_quant(quants, "Q5_K_M")
    assert quant_name("gpt-oss-120b-mxfp4-00001-of-00003.gguf") == "MXFP4"
    assert quant_name("Q4_K_M/model-00001-of-00002.gguf") == "Q4_K_M"


def test_quants_with_estimates_and_the_best_that_fits(hub: HubServer, tmp_path: Path, engine_info: EngineInfo) -> None:
    env = Env(tmp_path / "home", hub, engine_info)
    quants = run(lambda: env.acquirer.quants(REPO))
    assert [c.quant.name for c in quants.choices] == ["Q8_0", "F16", "F32"]  # smallest first
    assert quants.reference == "Q8_0"
    assert all(c.estimate is not None and c.estimate.verdict == "runs_well" for c in quants.choices)
    bpw = [c.bits_per_weight for c in quants.choices]
    assert bpw[0] is not None and 8 < bpw[0] < 12 and bpw[2] is not None and bpw[2] > 30  # Q8_0 ~8.5 (+F32 norms)
    best = quants.best()
    assert best is not None and best.quant.name == "F32"  # all run well here: the largest
    # the same repository on a drive where F32 does not fit (repacked + largest shard): F16 is the best
    f32 = quants.choices[2]
    assert f32.disk_needed is not None
    env.machine = dataclasses.replace(env.machine, disk_free=f32.disk_needed + DISK_MARGIN - 1)
    tight = run(lambda: env.acquirer.quants(REPO))
    assert tight.choices[2].estimate is not None and tight.choices[2].estimate.verdict == "no_disk_space"
    best = tight.best()
    assert best is not None and best.quant.name == "F16"
    # planning fetched headers only (closed ranges) and only of the reference quant
    assert files_fetched(hub) == set()
    assert {r.path.rsplit("/", 1)[-1] for r in hub.gets(".gguf")} <= {LAYOUT["Q8_0"].format(i=i) for i in (1, 2, 3)}


def test_no_quant_is_chosen_that_cannot_run_here(hub: HubServer, tmp_path: Path, engine_info: EngineInfo) -> None:
    """A repository the engine cannot run, or none of whose quants fits the disk: nothing is recommended, and
    `runmyai get OWNER/NAME` without a quant says why instead of taking the first (it took the smallest)."""
    env = Env(tmp_path / "home", hub, dataclasses.replace(engine_info, architectures={}))
    quants = run(lambda: env.acquirer.quants(REPO))
    assert quants.choices and all(c.estimate is not None for c in quants.choices) and quants.best() is None
    with pytest.raises(AcquireError, match=f"^{REPO} cannot run here: Not yet: the installed engine runs"):
        run(lambda: env.get(HubKey(REPO)))
    full = Env(tmp_path / "full", hub, engine_info)
    full.machine = dataclasses.replace(full.machine, disk_free=0)
    assert run(lambda: full.acquirer.quants(REPO)).best() is None
    with pytest.raises(AcquireError, match=r"No quant of .* fits on this disk"):
        run(lambda: full.get(HubKey(REPO)))
    assert not list((tmp_path / "home" / "models").rglob("*.gguf"))  # nothing was downloaded


def test_a_repository_the_engine_cannot_run_is_not_offered_and_its_failed_job_is_kept_until_forgotten(
    hub: HubServer, tmp_path: Path, engine_info: EngineInfo, split_models: dict[str, list[Path]]
) -> None:
    """Issue 29, defect 4: a repository of an architecture the engine does not run was offered for download with
    a quant marked recommended; the failed job was retried silently at every start and could not be forgotten."""
    add_odd(hub, split_models)
    events: list[JobStatus] = []
    env = Env(tmp_path / "home", hub, engine_info, on_job=events.append)
    quants = run(lambda: env.acquirer.quants(ODD))
    why = quants.cannot_run()
    assert why is not None and why.startswith(f"{ODD} cannot run here: the installed engine refuses it")
    assert "architecture 'qwen9moe' is not supported" in why and str(tmp_path) not in why and "\n" not in why
    assert quants.best() is None
    entry = render.hub_entry(HubModel(ODD, 0, 0, ("gguf",), ()), quants)  # what the window's list shows
    assert not entry.can_download and entry.choice is None and not entry.choices and entry.badge == "can't run here"
    assert why in html.unescape(entry.details_html) and "recommended" not in entry.details_html
    assert run(lambda: env.acquirer.quants(REPO)).cannot_run() is None  # the runnable one is offered

    # named anyway (`runmyai get acme/Odd-GGUF:Q8_0`): it fails for good, and is kept as failed, not to resume
    with pytest.raises(AcquireError, match=f"^{ODD} .Q8_0. cannot run here: .* will not change") as failure:
        run(lambda: env.get(HubKey(ODD, "Q8_0")))
    assert failure.value.permanent
    [job] = env.acquirer.started()
    assert job.failed == str(failure.value) and env.acquirer.status(job).state == "failed"
    assert env.acquirer.unfinished() == []  # what a start resumes
    assert files_fetched(hub) == set()  # no shard's data was downloaded
    assert [e.state for e in events] == ["running", "failed"] and events[-1].message == job.failed

    run(lambda: env.acquirer.forget(job.id))
    assert env.acquirer.started() == [] and not any(env.paths.jobs.iterdir())
    assert events[-1].state == "forgotten" and events[-1].id == job.id


def test_a_running_job_is_cancelled_and_forgotten(
    hub: HubServer, tmp_path: Path, engine_info: EngineInfo, split_models: dict[str, list[Path]]
) -> None:
    """Forgetting a job while it runs (the hub holds shard 2 half sent): its run stops as cancelled, and nothing
    it fetched or wrote is left — no partial download, shard, header, state file or engine progress."""
    shard2 = LAYOUT["Q8_0"].format(i=2)
    hold = hub.faults_for[shard2] = Faults(hold_after=split_models["Q8_0"][1].stat().st_size // 2)
    events: list[JobStatus] = []
    env = Env(tmp_path / "home", hub, engine_info, on_job=events.append)

    async def flow() -> None:
        await env.downloads.start()
        try:
            getting = asyncio.ensure_future(env.acquirer.get(HubKey(REPO, "Q8_0")))
            assert await asyncio.to_thread(hold.held.wait, 120), "the download never reached shard 2"
            [job] = env.acquirer.started()
            assert env.acquirer.status(job).state == "running"
            await env.acquirer.forget(job.id)
            with pytest.raises(asyncio.CancelledError):
                await getting
        finally:
            hold.release.set()
            await env.downloads.close()

    run(flow)
    assert env.acquirer.started() == [] and env.downloads.items() == []
    assert not any(env.paths.jobs.iterdir())
    left = [p for p in env.paths.home.rglob("*") if p.is_file() and p.suffix in (".part", ".gguf", ".json")]
    assert [p for p in left if p.parent != env.paths.settings] == [], left  # only the app's own settings
    assert not list(env.paths.models.rglob(".*.repack"))  # the engine's partial output too
    assert events[-1].state == "forgotten"


# ---------------------------------------------------------------------------------------------- get
def test_get_one_quant_with_a_drop_and_a_corrupt_shard_then_chat(
    hub: HubServer, tmp_path: Path, engine_info: EngineInfo, split_models: dict[str, list[Path]]
) -> None:
    shard2, shard3 = (LAYOUT["Q8_0"].format(i=i) for i in (2, 3))
    size2 = split_models["Q8_0"][1].stat().st_size
    env = Env(tmp_path / "home", hub, engine_info)
    hub.faults_for[shard2] = Faults(drop_after=size2 // 2)  # the connection drops in the middle of shard 2
    hub.faults_for[shard3] = Faults(corrupt=True, corrupt_times=1)  # shard 3 arrives corrupt once
    model = run(lambda: env.get(HubKey(REPO, "Q8_0")))
    assert model is not None and model.error is None and model.arch == "qwen3moe"
    assert model.path == env.paths.models / "acme" / "Tiny-GGUF" / "Tiny-Q8_0.tw.gguf"
    assert sha256(model.path) == plain_repack_sha(split_models["Q8_0"], tmp_path, LAYOUT["Q8_0"])
    # only the chosen quant's shards were downloaded; shard 2 resumed where it dropped; shard 3 came twice
    assert files_fetched(hub) == {LAYOUT["Q8_0"].format(i=i) for i in (1, 2, 3)} | {MMPROJ}
    gets2 = downloads_of(hub, shard2)
    assert len(gets2) == 2 and gets2[0].range is None and gets2[1].range == f"bytes={size2 // 2}-"
    assert [r.range for r in downloads_of(hub, shard3)] == [None, None]  # refused by sha256, fetched whole again
    # nothing else is left behind: no shard, no job folder, no engine progress, one library entry
    # (but the repository's image encoder, kept beside the model: library/mmproj.py)
    assert (model.path.parent / MMPROJ).read_bytes() == b"GGUF" + bytes(3000)
    left = [p for p in env.paths.home.rglob("*") if p.suffix == ".gguf" and not p.name.endswith(".tw.gguf")]
    assert left == [model.path.parent / MMPROJ]
    assert not env.paths.jobs.exists() or not any(env.paths.jobs.iterdir())
    assert [m.path for m in run(env.library.scan)] == [model.path]
    assert env.progress[-1].phase == "done" and env.progress[-1].fraction == 1.0

    async def chat() -> str:
        sup = EngineSupervisor(model.path, ["--ctx", "256"], load_timeout_s=120)
        endpoint = await sup.start()
        client = ChatClient(endpoint)
        try:
            text = ""
            async for d in client.stream_chat([{"role": "user", "content": "Hi"}], ChatSettings(max_tokens=4)):
                text += d.text
            return text
        finally:
            await client.aclose()
            await sup.stop()

    assert run(chat)  # the library entry chats


def test_get_survives_a_hub_that_drops_connections(
    hub: HubServer, tmp_path: Path, engine_info: EngineInfo, split_models: dict[str, list[Path]]
) -> None:
    """Issue 29, defect 2: `runmyai get` failed three runs in a row against a hub that drops connections ("Could
    not reach the hub … for the start of …"): the file downloads resumed, the tree listing and the shard headers'
    range reads were not tried again. Now one run gets the model, and no header byte is fetched twice."""
    env = Env(tmp_path / "home", hub, engine_info, HubClient(endpoint=hub.url, retry_backoff_s=0.01))
    hub.faults.api_drop_times = 2  # the tree listing, twice
    hub.faults.range_drop_after, hub.faults.range_drop_times = 4096, 6  # header reads, cut at 4 KiB six times
    model = run(lambda: env.get(HubKey(REPO, "Q8_0")))
    assert model.error is None and model.path.name == "Tiny-Q8_0.tw.gguf"
    assert len([r for r in hub.log if r.status == 0]) == 2  # the dropped listings were real
    headers = [r for r in hub.gets(".gguf") if r.range and not r.range.endswith("-")]
    assert len([r for r in headers if r.body_bytes == 4096]) == 6  # and so were the dropped header reads
    for i in (1, 2, 3):  # each header read continued from where its connection dropped
        reads = [r for r in headers if r.path.endswith(LAYOUT["Q8_0"].format(i=i))]
        starts = [int(r.range.split("=")[1].split("-")[0]) for r in reads if r.range]
        assert starts == [4096 * n for n in range(len(starts))], starts
    assert files_fetched(hub) == {LAYOUT["Q8_0"].format(i=i) for i in (1, 2, 3)} | {MMPROJ}


def test_local_split_import_from_any_shard(split_models: dict[str, list[Path]], tmp_path: Path) -> None:
    """Import GGUF… of a split model: any of its shards stands for the set; the rest are found."""
    src = tmp_path / "src"
    src.mkdir()
    for f in split_models["F16"]:
        shutil.copy(f, src / f.name)
    second = sorted(src.iterdir())[1]
    lib = LocalLibrary(tmp_path / "models")
    model = run(lambda: lib.import_gguf([second]))
    assert model.error is None and model.path.name.endswith("-F16.tw.gguf") and "-0000" not in model.path.name
    assert sha256(model.path) == plain_repack_sha(split_models["F16"], tmp_path)


# ---------------------------------------------------------------------------------------------- disk
def test_streaming_repack_fits_where_twice_the_model_does_not(
    model_factory: ModelFactory, tmpfs: Mount, tmp_path: Path, engine_info: EngineInfo
) -> None:
    files = shard_files(model_factory(preset="small", type="Q8_0", shards=3, seed=2))
    with HubServer() as server:
        for i, f in enumerate(files, 1):
            server.add_file("acme/Small-GGUF", f"Small-Q8_0-{i:05d}-of-00003.gguf", f.read_bytes(), tags=["gguf"])
        # plan first, on a roomy disk: the numbers the app states before downloading
        probe = Env(tmp_path / "probe", server, engine_info, disk_margin=1 << 20)
        plan_quants = run(lambda: probe.acquirer.quants("acme/Small-GGUF"))
        job = probe.acquirer._job("acme/Small-GGUF", "main", plan_quants.choices[0].quant)
        plan = run(lambda: probe.acquirer._plan(job))
        stream_peak, copy_peak = plan["peak_bytes"]["streaming"], plan["peak_bytes"]["copy"]
        overhead = 4 << 20  # the app's own files (settings, the job's headers and state, the engine's)
        size = (stream_peak + copy_peak) // 2  # between the two: only the streaming path fits
        assert stream_peak + overhead + (1 << 20) < size < copy_peak
        mnt = tmpfs(size)
        env = Env(mnt / "home", server, engine_info, disk_margin=1 << 20)
        base = shutil.disk_usage(mnt).used
        peak = [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], shutil.disk_usage(mnt).used - base)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            model = run(lambda: env.get(HubKey("acme/Small-GGUF", "Q8_0")))
        finally:
            stop.set()
            sampler.join()
        assert model.error is None and model.size_bytes == plan["output_bytes"]
        assert sha256(model.path) == plain_repack_sha(files, tmp_path, "Small-Q8_0-{i:05d}-of-00003.gguf")
        assert 0 < peak[0] <= stream_peak + overhead, (peak[0], stream_peak)
        assert peak[0] > plan["output_bytes"]  # it was sampled while the model was in flight

        # a disk too small even for the streaming path is refused before any data is fetched, with both numbers
        small = tmpfs(stream_peak // 2)
        env2 = Env(small / "home", server, engine_info, disk_margin=1 << 20)
        before = len(files_fetched(server))
        with pytest.raises(AcquireError, match=r"repacking while downloading needs .* if it were repacked after"):
            run(lambda: env2.get(HubKey("acme/Small-GGUF", "Q8_0")))
        assert len(files_fetched(server)) == before


# ---------------------------------------------------------------------------------------------- kill and resume
def _get_cmd(home: Path, hub: HubServer) -> list[str]:
    return [sys.executable, "-m", "runmyai", "--home", str(home), "get", f"{REPO}:Q8_0", "--hub", hub.url]


def _start(cmd: list[str], **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the app and the engine it runs, as a crash or a power cut would
    proc.wait(timeout=30)


def test_killed_during_download_and_during_repack_resumes_to_the_same_bytes(
    hub: HubServer, tmp_path: Path, split_models: dict[str, list[Path]]
) -> None:
    home = tmp_path / "home"
    shard2 = LAYOUT["Q8_0"].format(i=2)
    # 1. killed while shard 2 is half downloaded (the hub holds the body there)
    hold = hub.faults_for[shard2] = Faults(hold_after=split_models["Q8_0"][1].stat().st_size // 2)
    proc = _start(_get_cmd(home, hub))
    try:
        assert hold.held.wait(120), "the download never reached shard 2"
    finally:
        _kill_group(proc)
    hub.faults_for.clear()
    hold.release.set()
    kept = sum(p.stat().st_size for p in (home / "downloads").glob("*.part"))  # what reached the disk
    assert not list((home / "models").rglob("*.tw.gguf"))  # nothing half-written is listed

    # 2. killed while the engine repacks shard 2 (it holds after writing it, before verifying and saving)
    marker = tmp_path / "repack-paused"
    proc = _start(
        _get_cmd(home, hub),
        TOKENWING_TEST_REPACK_PAUSE="shard:2",
        TOKENWING_TEST_REPACK_PAUSE_FILE=str(marker),
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the repack never reached shard 2"
            time.sleep(0.02)
    finally:
        _kill_group(proc)
    assert not list((home / "models").rglob("*.tw.gguf"))

    # 3. the same command again finishes, with the bytes of an uninterrupted repack
    resumed = [r.range for r in downloads_of(hub, shard2)][1]
    assert resumed == (f"bytes={kept}-" if kept else None)  # from what the killed run had written, not before
    done = subprocess.run(_get_cmd(home, hub), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    out = home / "models" / "acme" / "Tiny-GGUF" / "Tiny-Q8_0.tw.gguf"
    assert sha256(out) == plain_repack_sha(split_models["Q8_0"], tmp_path, LAYOUT["Q8_0"])
    assert "Tiny-Q8_0" in done.stdout
    listed = subprocess.run(
        [sys.executable, "-m", "runmyai", "--home", str(home), "list"], capture_output=True, text=True, timeout=120
    )
    assert listed.returncode == 0 and str(out) in listed.stdout and "tokens/s" in listed.stdout


# ---------------------------------------------------------------------------------------------- the window
def test_the_window_shows_the_quants_and_gets_the_one_picked(
    qapp: QApplication, hub: HubServer, tmp_path: Path, split_models: dict[str, list[Path]]
) -> None:
    """Search, see each quant with its size and verdict (the best preselected), pick one, one click: in the
    library. The same Acquirer as `runmyai get`."""
    (tmp_path / "presets").mkdir()
    (tmp_path / "resources").mkdir()
    window = MainWindow()
    c = AppController(
        window,
        AppPaths(tmp_path / "home"),
        hub_endpoint=hub.url,
        presets_dir=tmp_path / "presets",
        resources_dir=tmp_path / "resources",
    )
    window.show()
    window.show_page("Discover")  # where a user searches and picks a quant
    lib = window.library

    async def flow() -> None:
        await c.start()
        lib.search.setText("Tiny")
        lib.search.returnPressed.emit()
        key = f"hub:{REPO}"
        await until(lambda: any(e.key == key and e.choices for e in c.models.entries()), 60, "quants")
        lib.select(key)
        labels = [lib.quant.itemText(i) for i in range(lib.quant.count())]
        assert [t.split(":")[0] for t in labels] == ["Q8_0", "F16", "F32"] and lib.quant.isVisible()
        assert "recommended" in lib.quant.currentText() and lib.quant.currentText().startswith("F32")
        assert "Bits/weight" in lib.details.toHtml()
        hub.add_file(REPO, "README.md", b"# Tiny\n\nA **tiny** model for the tests.\n")
        lib.tabs.setCurrentIndex(1)  # the model card: the repository's README, read when looked at
        await until(lambda: "A tiny model for the tests." in lib.model_card.toPlainText(), 30, "model card")
        lib.tabs.setCurrentIndex(0)
        lib.quant.setCurrentIndex(0)  # the user prefers the smallest
        lib.download_button.click()
        await until(lambda: any(m.path.name == "Tiny-Q8_0.tw.gguf" for m in c.models.local_models), 120, "get")
        assert lib.current_key() == f"local:{c.models.local_models[0].path}"  # selected, ready to chat
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()
    assert files_fetched(hub) == {LAYOUT["Q8_0"].format(i=i) for i in (1, 2, 3)} | {MMPROJ}


def test_the_window_resumes_a_get_killed_midway(
    qapp: QApplication, hub: HubServer, tmp_path: Path, split_models: dict[str, list[Path]]
) -> None:
    """`runmyai get` killed in the middle of shard 2; the window, started on the same home, continues the job by
    itself and ends with the model in its library (the bytes of an uninterrupted repack)."""
    home = tmp_path / "home"
    shard2 = LAYOUT["Q8_0"].format(i=2)
    hold = hub.faults_for[shard2] = Faults(hold_after=split_models["Q8_0"][1].stat().st_size // 2)
    proc = _start(_get_cmd(home, hub))
    try:
        assert hold.held.wait(120), "the download never reached shard 2"
    finally:
        _kill_group(proc)
    hub.faults_for.clear()
    hold.release.set()
    (tmp_path / "presets").mkdir()
    (tmp_path / "resources").mkdir()
    window = MainWindow()
    c = AppController(
        window,
        AppPaths(home),
        hub_endpoint=hub.url,
        presets_dir=tmp_path / "presets",
        resources_dir=tmp_path / "resources",
    )

    async def flow() -> None:
        await c.start()  # finds the started job and resumes it
        await until(lambda: any(m.path.name == "Tiny-Q8_0.tw.gguf" for m in c.models.local_models), 120, "resume")
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()
    out = home / "models" / "acme" / "Tiny-GGUF" / "Tiny-Q8_0.tw.gguf"
    assert sha256(out) == plain_repack_sha(split_models["Q8_0"], tmp_path, LAYOUT["Q8_0"])
    assert not any((home / "downloads" / "jobs").iterdir())


def test_the_window_lists_a_failed_job_without_running_it_again_and_forgets_it(
    qapp: QApplication, hub: HubServer, tmp_path: Path, engine_info: EngineInfo, split_models: dict[str, list[Path]]
) -> None:
    """Issue 29, defect 4, in the window: a job that failed for good (`runmyai get` of a repository the engine
    cannot run) is listed with its reason at the next start, not run again; its row's Forget removes it. The
    repository itself is not offered for download, and says why."""
    add_odd(hub, split_models)
    home = tmp_path / "home"
    with pytest.raises(AcquireError):
        run(lambda: Env(home, hub, engine_info).get(HubKey(ODD, "Q8_0")))
    (tmp_path / "presets").mkdir()
    (tmp_path / "resources").mkdir()
    window = MainWindow()
    c = AppController(
        window,
        AppPaths(home),
        hub_endpoint=hub.url,
        presets_dir=tmp_path / "presets",
        resources_dir=tmp_path / "resources",
    )
    [job] = c.jobs.acquirer.started()
    requests = len(hub.log)
    lib, table = window.library, window.library.downloads
    window.show()
    window.show_page("Discover")  # where a user sees the downloads and picks a repository

    async def flow() -> None:
        await c.start()
        assert table.item_ids() == [f"job:{job.id}"] and not c.jobs.acquirer.unfinished()
        assert "cannot run here" in table.item(0, 4).text() and "will not change" in table.item(0, 4).text()
        buttons = table.cellWidget(0, 5)
        enabled = {name: buttons.findChild(QPushButton, name).isEnabled() for name in ("pause", "resume", "forget")}
        assert enabled == {"pause": False, "resume": True, "forget": True}  # Resume: try again when asked to
        buttons.findChild(QPushButton, "forget").click()
        await until(lambda: table.rowCount() == 0, 30, "forget")
        assert not c.jobs.acquirer.started() and not any(c.paths.jobs.iterdir())
        assert len(hub.log) == requests  # it was never run again: not one request to the hub

        lib.search.setText("Odd")
        lib.search.returnPressed.emit()
        key = f"hub:{ODD}"
        await until(lambda: ODD in c.models.hub_quants, 60, "quants")
        lib.select(key)
        entry = next(e for e in c.models.entries() if e.key == key)
        assert entry.badge == "can't run here" and not lib.download_button.isEnabled() and not lib.quant.isVisible()
        assert "qwen9moe" in lib.details.toPlainText() and "recommended" not in lib.details.toPlainText()
        await c.shutdown()

    try:
        run_qt(qapp, flow)
    finally:
        window.close()
