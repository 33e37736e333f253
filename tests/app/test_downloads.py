"""DownloadManager against the local hub server: real HTTP, real faults (drops, stalls, ignored Range, corruption)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from runmyai.library.downloads import EMIT_INTERVAL_S, DownloadManager, DownloadStatus
from runmyai.library.hub import HubClient, HubError
from tests.app.hubserver import HubServer
from tests.conftest import Mount

T = TypeVar("T")
REPO = "acme/qwen-tw"
NAME = "qwen-q4.tw.gguf"
DATA = os.urandom(3 * 1024 * 1024 + 123)
SHA = hashlib.sha256(DATA).hexdigest()
HELD = 3600.0  # stall timeout while the hub holds a body (faults.hold_after): the client waits, never retries


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_file(REPO, NAME, DATA, tags=["tokenwing"])
        server.add_file(REPO, "README.md", b"# qwen\n")
        server.add_file("meta/gated-tw", "gated.tw.gguf", DATA[:200_000], tags=["tokenwing"], gated=True)
        server.accepted_tokens.add("hf_good")
        yield server


class Env:
    def __init__(self, root: Path, hub: HubServer) -> None:
        self.root, self.hub = root, hub
        self.state_dir = root / "downloads"
        self.models_dir = root / "models"
        self.events: list[DownloadStatus] = []

    def manager(self, client: HubClient | None = None, **kwargs: Any) -> DownloadManager:
        options: dict[str, Any] = {"stall_timeout_s": 0.5, "max_retries": 3, "retry_backoff_s": 0.02}
        options.update(kwargs)
        return DownloadManager(
            client or HubClient(endpoint=self.hub.url),
            self.state_dir,
            self.models_dir,
            self.events.append,
            **options,
        )

    def model_files(self) -> list[Path]:
        return sorted(p for p in self.models_dir.rglob("*") if p.is_file())

    def state_files(self) -> list[str]:
        return sorted(p.name for p in self.state_dir.iterdir())


@pytest.fixture
def env(tmp_path: Path, hub: HubServer) -> Env:
    return Env(tmp_path, hub)


def run(fn: Callable[[], Awaitable[T]], timeout: float = 120) -> T:
    async def main() -> T:
        return await asyncio.wait_for(fn(), timeout)

    return asyncio.run(main())


async def download(manager: DownloadManager, *args: Any, **kwargs: Any) -> DownloadStatus:
    await manager.start()
    try:
        return await manager.wait(manager.enqueue(*args, **kwargs))
    finally:
        await manager.close()


async def until(predicate: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_full_download_verified_and_moved(env: Env) -> None:
    status = run(lambda: download(env.manager(), REPO, NAME))
    assert status.state == "done", status.message
    assert "verified" in status.message
    assert status.dest == env.models_dir / "acme" / "qwen-tw" / NAME
    assert status.dest.read_bytes() == DATA
    assert status.done_bytes == status.total_bytes == len(DATA)
    assert env.state_files() == []  # partial and state file gone
    states = [e.state for e in env.events]
    assert states[0] == "queued" and "downloading" in states and "verifying" in states and states[-1] == "done"
    progress = [e.done_bytes for e in env.events if e.state == "downloading"]
    assert progress == sorted(progress)
    assert env.hub.body_bytes(NAME) == len(DATA)  # one pass, no re-fetch


def test_small_file_without_sha256_is_size_checked(env: Env) -> None:
    status = run(lambda: download(env.manager(), REPO, "README.md"))
    assert status.state == "done" and "no sha256" in status.message
    assert (env.models_dir / "acme" / "qwen-tw" / "README.md").read_bytes() == b"# qwen\n"


def test_cdn_redirect_keeps_token_on_the_hub(env: Env) -> None:
    env.hub.redirect_to_cdn = True
    client = HubClient(endpoint=env.hub.url, token="hf_good")
    status = run(lambda: download(env.manager(client), REPO, NAME))
    assert status.state == "done", status.message
    cdn = [r for r in env.hub.log if r.path.startswith("/cdn/")]
    resolve = [r for r in env.hub.log if "/resolve/" in r.path and r.method == "GET"]
    assert cdn and resolve
    assert all(r.authorization is None for r in cdn)  # the token never leaves the hub's host
    assert all(r.authorization == "Bearer hf_good" for r in resolve)


def test_resume_after_dropped_connection_does_not_restart(env: Env) -> None:
    env.hub.faults.drop_after = 1_000_000
    env.hub.faults.drop_times = 2
    status = run(lambda: download(env.manager(), REPO, NAME))
    assert status.state == "done", status.message
    gets = env.hub.gets(NAME)
    assert len(gets) == 3
    assert gets[0].range is None and gets[1].range == "bytes=1000000-" and gets[2].range == "bytes=2000000-"
    assert [g.status for g in gets] == [200, 206, 206]
    assert env.hub.body_bytes(NAME) == len(DATA)  # every byte fetched once
    assert status.dest is not None and status.dest.read_bytes() == DATA


def test_stall_is_detected_and_resumed(env: Env) -> None:
    env.hub.faults.stall_after = 500_000
    env.hub.faults.stall_s = 3600  # the server would stall for the rest of the test: the client must give up
    status = run(lambda: download(env.manager(stall_timeout_s=0.3), REPO, NAME))
    assert status.state == "done", status.message
    resumed = [g for g in env.hub.gets(NAME) if g.range]  # (the stalled GET is logged when the server lets go)
    assert [(g.range, g.body_bytes) for g in resumed] == [("bytes=500000-", len(DATA) - 500_000)]
    assert any("stalled" in e.message for e in env.events)


def test_server_ignoring_range_is_handled(env: Env) -> None:
    env.hub.faults.drop_after = 1_200_000
    env.hub.faults.ignore_range = True
    status = run(lambda: download(env.manager(), REPO, NAME))
    assert status.state == "done", status.message
    gets = env.hub.gets(NAME)
    assert len(gets) == 2 and gets[1].range == "bytes=1200000-" and gets[1].status == 200  # whole body again
    assert status.dest is not None and status.dest.read_bytes() == DATA  # the repeated prefix was skipped
    assert any("can't resume" in e.message for e in env.events)


def test_corrupt_bytes_fail_and_leave_nothing(env: Env) -> None:
    env.hub.faults.corrupt = True
    status = run(lambda: download(env.manager(), REPO, NAME))
    assert status.state == "failed"
    assert "corrupt" in status.message and "sha256" in status.message
    assert env.model_files() == []
    assert env.state_files() == []  # partial removed


def test_retries_are_bounded(env: Env) -> None:
    env.hub.faults.status = 503
    status = run(lambda: download(env.manager(max_retries=2), REPO, NAME, sha256=SHA, size=len(DATA)))
    assert status.state == "failed" and "3 tries" in status.message
    assert len(env.hub.gets(NAME)) == 3
    assert any("retrying" in e.message for e in env.events)


def test_pause_then_new_manager_resumes_from_partial(env: Env) -> None:
    env.hub.faults.hold_after = 600_000  # the server stops there until released: the pause lands mid-way

    async def first() -> str:
        manager = env.manager(stall_timeout_s=HELD)
        await manager.start()
        id_ = manager.enqueue(REPO, NAME)

        def item() -> DownloadStatus:
            return next(i for i in manager.items() if i.id == id_)

        await until(lambda: item().done_bytes == 600_000)
        manager.pause(id_)
        assert item().state == "paused"
        await manager.close()
        assert item().state == "paused"
        return id_

    id_ = run(first)
    env.hub.faults.release.set()
    part = env.state_dir / f"{id_}.part"
    kept = part.stat().st_size
    assert kept == 600_000  # every byte received was kept
    state = json.loads((env.state_dir / f"{id_}.json").read_text())
    assert state["repo"] == REPO and state["path"] == NAME and state["sha256"] == SHA
    env.hub.faults.throttle_bps = None

    async def second() -> DownloadStatus:
        manager = env.manager()  # "app restart"
        restored = {i.id: i for i in manager.items()}
        assert restored[id_].state == "paused" and restored[id_].done_bytes == kept
        assert restored[id_].total_bytes == len(DATA)
        await manager.start()
        manager.resume(id_)
        try:
            return await manager.wait(id_)
        finally:
            await manager.close()

    run(lambda: until(lambda: len(env.hub.gets(NAME)) == 1))  # the held GET is logged once the server closed it
    status = run(second)
    assert status.state == "done", status.message
    gets = env.hub.gets(NAME)
    assert len(gets) == 2 and gets[-1].range == f"bytes={kept}-"
    assert env.hub.body_bytes(NAME) - gets[0].body_bytes <= len(DATA) - kept  # the resumed GET sent only the rest
    assert status.dest is not None and status.dest.read_bytes() == DATA


def test_cancel_removes_partial(env: Env) -> None:
    env.hub.faults.hold_after = 100_000

    async def go() -> DownloadStatus:
        manager = env.manager(stall_timeout_s=HELD)
        await manager.start()
        id_ = manager.enqueue(REPO, NAME)
        await until(lambda: (env.state_dir / f"{id_}.part").exists() and manager.items()[0].done_bytes == 100_000)
        manager.cancel(id_)
        status = await manager.wait(id_)
        await manager.close()
        return status

    status = run(go)
    assert status.state == "cancelled"
    assert env.state_files() == [] and env.model_files() == []


def test_queue_runs_one_at_a_time_and_pause_of_queued(env: Env) -> None:
    async def go() -> list[DownloadStatus]:
        manager = env.manager(max_parallel=1)
        a = manager.enqueue(REPO, NAME)
        b = manager.enqueue(REPO, "README.md")
        assert manager.enqueue(REPO, NAME) == a  # same file, same download
        manager.pause(b)
        await manager.start()
        done_a = await manager.wait(a)
        assert next(i for i in manager.items() if i.id == b).state == "paused"
        manager.resume(b)
        done_b = await manager.wait(b)
        await manager.close()
        return [done_a, done_b]

    assert [s.state for s in run(go)] == ["done", "done"]


def test_not_enough_free_space(env: Env, tmpfs: Mount) -> None:
    """A real 1 MiB file system for the partial downloads: the 3 MB file is refused before any byte is fetched."""
    small = tmpfs(1 << 20)
    manager = DownloadManager(HubClient(endpoint=env.hub.url), small, env.models_dir, env.events.append)
    status = run(lambda: download(manager, REPO, NAME))
    assert status.state == "failed"
    assert "Not enough free space" in status.message and "MB" in status.message and str(small) in status.message
    assert env.hub.gets(NAME) == []  # checked before downloading anything
    assert [p.suffix for p in small.iterdir()] == [".json"]  # the failed item's state (to retry), no partial


def test_gated_repo_message_then_token(env: Env) -> None:
    status = run(lambda: download(env.manager(), "meta/gated-tw", "gated.tw.gguf"))
    assert status.state == "failed" and "gated" in status.message and "token" in status.message
    good = HubClient(endpoint=env.hub.url, token="hf_good")
    status = run(lambda: download(env.manager(good), "meta/gated-tw", "gated.tw.gguf"))
    assert status.state == "done", status.message


def test_gated_on_download_with_known_checksum(env: Env) -> None:
    # sha256 and size known (from a preset): no metadata call, the GET itself meets the gate
    args = ("meta/gated-tw", "gated.tw.gguf")
    sha, size = hashlib.sha256(DATA[:200_000]).hexdigest(), 200_000
    status = run(lambda: download(env.manager(), *args, sha256=sha, size=size))
    assert status.state == "failed" and "gated" in status.message
    assert [r.status for r in env.hub.gets("gated.tw.gguf")] == [401]


def test_missing_file_message(env: Env) -> None:
    status = run(lambda: download(env.manager(), REPO, "nope.tw.gguf"))
    assert status.state == "failed" and "does not exist" in status.message


def test_offline_mode(env: Env) -> None:
    offline = HubClient(endpoint=env.hub.url, offline=True)
    status = run(lambda: download(env.manager(offline), REPO, NAME))
    assert status.state == "failed" and "Offline mode" in status.message
    assert env.hub.log == []  # not one request

    # a download whose bytes all arrived before the app quit (the state file records size and sha256) finishes
    # offline: it is verified and installed from disk
    manager = env.manager(offline)
    id_ = manager.enqueue(REPO, NAME, sha256=SHA, size=len(DATA))
    (env.state_dir / f"{id_}.part").write_bytes(DATA)

    async def finish() -> DownloadStatus:
        fresh = env.manager(offline)
        await fresh.start()
        fresh.resume(id_)
        try:
            return await fresh.wait(id_)
        finally:
            await fresh.close()

    status = run(finish)
    assert status.state == "done" and "offline" in status.message
    assert env.hub.log == [] and status.dest is not None and status.dest.read_bytes() == DATA


def test_already_installed_is_not_downloaded_again(env: Env) -> None:
    assert run(lambda: download(env.manager(), REPO, NAME)).state == "done"
    count = len(env.hub.gets(NAME))
    status = run(lambda: download(env.manager(), REPO, NAME))
    assert status.state == "done" and "Already" in status.message
    assert len(env.hub.gets(NAME)) == count


def test_bad_input_is_rejected_clearly(env: Env) -> None:
    manager = env.manager()
    for args in (("../x", NAME), (REPO, "../../etc/passwd"), (REPO, "/abs.gguf")):
        with pytest.raises(HubError):
            manager.enqueue(*args)
    with pytest.raises(HubError):
        manager.enqueue(REPO, NAME, sha256="not-a-sha")
    with pytest.raises(HubError):
        manager.enqueue(REPO, NAME, size=-5)
    (env.state_dir / "garbage.json").write_text("{not json")
    (env.state_dir / "0123456789abcdef.json").write_text(json.dumps({"version": 1, "repo": "../x", "path": "a"}))
    assert env.manager().items() == []  # unreadable state is skipped, not a traceback


def test_absurd_size_from_hub_fails_clearly(env: Env) -> None:
    env.hub.faults.absurd_size = True
    status = run(lambda: download(env.manager(), REPO, NAME))
    assert status.state == "failed" and "size" in status.message
    assert env.hub.gets(NAME) == []


def test_event_loop_never_blocks(env: Env) -> None:
    big = os.urandom(12 * 1024 * 1024)
    env.hub.add_file(REPO, "big.tw.gguf", big)
    env.hub.faults.drop_after = 5_000_000  # a resume in the middle, too

    async def go() -> tuple[DownloadStatus, float, int]:
        worst = 0.0
        ticks = 0
        stop = asyncio.Event()

        async def watchdog() -> None:
            nonlocal worst, ticks
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                worst = max(worst, now - last - 0.005)
                last = now
                ticks += 1

        dog = asyncio.create_task(watchdog())
        await asyncio.sleep(0.05)
        status = await download(env.manager(), REPO, "big.tw.gguf")
        stop.set()
        await dog
        return status, worst, ticks

    status, worst, ticks = run(go)
    assert status.state == "done", status.message
    assert ticks > 10
    print(f"worst loop lag {worst * 1000:.1f} ms over {ticks} ticks")
    # 5x the worst seen here under load (101 ms); the lag on an idle machine is measured by bench/app_bench.py
    assert worst < 1.0, f"event loop blocked for {worst * 1000:.0f} ms"


def test_progress_speed_eta_and_throttled_callbacks(env: Env) -> None:
    """Speed and ETA are reported and agree with each other; updates are throttled. How close the speed is to
    the real rate is measured in bench/app_bench.py (it depends on how busy the machine is)."""
    env.hub.faults.throttle_bps = 2_000_000  # 3 MB in about 1.5 s, in 16 KiB writes: ~200 reads
    began = time.monotonic()
    status = run(lambda: download(env.manager(), REPO, NAME))
    took = time.monotonic() - began
    assert status.state == "done", status.message
    moving = [e for e in env.events if e.state == "downloading" and e.speed_bps > 0]
    assert moving, "no speed reported"
    for e in moving:
        assert e.total_bytes == len(DATA) and e.eta_s == pytest.approx((len(DATA) - e.done_bytes) / e.speed_bps)
    # one update per EMIT_INTERVAL_S at most, besides the state changes (Starting twice, Downloading), whatever
    # the time the download took
    assert len([e for e in env.events if e.state == "downloading"]) <= took / EMIT_INTERVAL_S + 1 + 3
    assert status.speed_bps == 0 and status.eta_s is None  # finished


def test_pause_then_cancel_at_once_removes_partial(env: Env) -> None:
    env.hub.faults.hold_after = 100_000

    async def go() -> DownloadStatus:
        manager = env.manager(stall_timeout_s=HELD)
        await manager.start()
        id_ = manager.enqueue(REPO, NAME)
        await until(lambda: manager.items()[0].done_bytes == 100_000)
        manager.pause(id_)
        manager.cancel(id_)  # while the task is still stopping for the pause
        status = await manager.wait(id_)
        await manager.close()
        return status

    status = run(go)
    assert status.state == "cancelled"
    assert env.state_files() == [] and env.model_files() == []


def test_failed_download_resumes_when_enqueued_again(env: Env) -> None:
    env.hub.faults.drop_after = 700_000
    env.hub.faults.drop_times = 100  # every try drops, but each makes progress ...
    env.hub.faults.status = None

    async def go() -> tuple[DownloadStatus, DownloadStatus]:
        manager = env.manager(max_retries=0)  # ... and no retries are allowed: fail after the first drop
        await manager.start()
        first = await manager.wait(manager.enqueue(REPO, NAME))
        env.hub.faults.drop_times = 0
        second = await manager.wait(manager.enqueue(REPO, NAME))
        await manager.close()
        return first, second

    first, second = run(go)
    assert first.state == "failed" and "kept" in first.message and first.done_bytes == 700_000
    assert second.state == "done", second.message
    assert env.hub.gets(NAME)[-1].range == "bytes=700000-"
