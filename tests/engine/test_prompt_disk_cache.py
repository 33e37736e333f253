"""The server's prompt cache on disk (server/prompt_disk_cache.py, issue 44), through the official `openai` client:
a second server on the same folder restores what the first wrote and answers as the uninterrupted server does, to
the bit of its logprobs; a truncated or flipped snapshot, a full disk and a crash during the write are each
ignored or refused, the reply unchanged, no traceback."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ModelFactory, Mount, fill_disk
from tests.engine.test_server import Server
from tests.pauses import Pauses
from tokenwing.runtime.snapshot import SUFFIX
from tokenwing.testpause import GO

TURN1 = [{"role": "user", "content": "Tell me something about the weather today, and about the sea."}]
FAMILIES = {"qwen3moe": {"type": "Q8_0", "n_layer": 3}, "ling": {"type": "Q8_0", "arch": "bailingmoe3", "n_layer": 4}}


def _ask(server: Server, messages: list[dict[str, str]]) -> tuple[str, list[float], dict[str, Any]]:
    r = server.client().chat.completions.create(
        model="x",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    logprobs = [t.logprob for t in r.choices[0].logprobs.content]
    logprobs += [a.logprob for t in r.choices[0].logprobs.content for a in t.top_logprobs]
    return r.choices[0].message.content or "", logprobs, r.model_extra["tokenwing"]  # type: ignore[index]


def _turn2(reply: str) -> list[dict[str, str]]:
    return [*TURN1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And tomorrow?"}]


def _snapshots(folder: Path) -> list[Path]:
    return sorted(folder.glob("*" + SUFFIX))


def _no_traceback(log: str) -> None:
    assert "Traceback" not in log and "internal error" not in log, log


def _uninterrupted(model: Path) -> tuple[Path, list[Any]]:
    """A model, and its uninterrupted run: turn 1 then turn 2 on one server that keeps its context in RAM only."""
    ram = Server(model, "--prompt-cache-size", "0", "--no-usage-table")
    try:
        first = _ask(ram, TURN1)
        second = _ask(ram, _turn2(first[0]))
    finally:
        _no_traceback(ram.stop())
    return model, [first, second]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, repacked_factory: ModelFactory) -> tuple[Path, list[Any]]:
    """Each family's model and uninterrupted run (attention; recurrent with MLA)."""
    return _uninterrupted(repacked_factory(**FAMILIES[request.param]))


@pytest.fixture(scope="module")
def qwen(repacked_factory: ModelFactory) -> tuple[Path, list[Any]]:
    """One model for the fault tests."""
    return _uninterrupted(repacked_factory(**FAMILIES["qwen3moe"]))


def test_second_server_restores_what_the_first_wrote(family: tuple[Path, list[Any]], tmp_path: Path) -> None:
    model, (first, second) = family
    folder = tmp_path / "pc"
    a = Server(model, "--prompt-cache-dir", str(folder), "--no-usage-table")
    got1 = _ask(a, TURN1)
    log_a = a.stop()  # (its writes end before it exits)
    _no_traceback(log_a)
    assert got1[:2] == first[:2] and "prompt_restored_tokens" not in got1[2]
    (snap,) = _snapshots(folder)
    size = snap.stat().st_size
    b = Server(model, "--prompt-cache-dir", str(folder), "--no-usage-table")
    got2 = _ask(b, _turn2(got1[0]))
    log_b = b.stop()
    _no_traceback(log_b)
    assert "prompt cache on disk: " in log_b and "(1 snapshots" in log_b, log_b
    extra = got2[2]
    # the uninterrupted server kept as many tokens of its context; this one read them from the disk
    assert extra["prompt_cached_tokens"] == second[2]["prompt_cached_tokens"] > 0
    assert extra["prompt_restored_tokens"] >= extra["prompt_cached_tokens"]
    assert extra["prompt_restore_bytes"] == size
    assert extra["prompt_restore_ms"] > 0
    assert got2[:2] == second[:2]  # the same reply and logprobs, to the bit


def _write_one(model: Path, folder: Path) -> Path:
    a = Server(model, "--prompt-cache-dir", str(folder), "--no-usage-table")
    _ask(a, TURN1)
    _no_traceback(a.stop())
    (snap,) = _snapshots(folder)
    return snap


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_damaged_snapshot_is_refused(qwen: tuple[Path, list[Any]], tmp_path: Path, damage: str) -> None:
    model, (first, _) = qwen
    folder = tmp_path / "pc"
    snap = _write_one(model, folder)
    data = bytearray(snap.read_bytes())
    if damage == "truncated":
        del data[len(data) * 3 // 4 :]
    else:
        data[len(data) * 3 // 4] ^= 0x04  # (in the payload: the header still reads)
    snap.write_bytes(bytes(data))
    b = Server(model, "--prompt-cache-dir", str(folder), "--no-usage-table")
    got = _ask(b, TURN1)
    log = b.stop()
    _no_traceback(log)
    assert "prompt_restored_tokens" not in got[2] and got[2]["prompt_cached_tokens"] == 0
    assert got[:2] == first[:2]
    assert f"prompt cache: {snap.name} refused" in log, log
    # the damaged file went; the same context, saved again by this server, is whole
    assert _snapshots(folder) == [snap] and snap.read_bytes() != bytes(data)


def test_a_flipped_byte_in_a_late_piece_is_never_used(
    qwen: tuple[Path, list[Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In 4 KiB pieces, a byte flipped near the snapshot's end is found after the earlier pieces were copied into
    the slot: the restore is refused, the slot emptied, the prompt computed from scratch, with the reply and
    logprobs of a server that never had the snapshot."""
    model, (first, _) = qwen
    folder = tmp_path / "pc"
    snap = _write_one(model, folder)
    data = bytearray(snap.read_bytes())
    assert len(data) > 5 * 4096  # (the header's page, then pieces: more than are in flight at once)
    data[-2] ^= 0x04
    snap.write_bytes(bytes(data))
    fresh = Server(model, "--prompt-cache-size", "0", "--no-usage-table")
    want = _ask(fresh, _turn2(first[0]))
    _no_traceback(fresh.stop())
    monkeypatch.setenv("TOKENWING_TEST_SNAPSHOT_PIECE", "4096")
    b = Server(model, "--prompt-cache-dir", str(folder), "--no-usage-table")
    got = _ask(b, _turn2(first[0]))
    log = b.stop()
    _no_traceback(log)
    assert f"prompt cache: {snap.name} refused (section" in log and "checksum" in log, log
    assert "prompt_restored_tokens" not in got[2] and got[2]["prompt_cached_tokens"] == 0
    assert got[:2] == want[:2]


def test_full_disk_keeps_nothing_and_loses_nothing(qwen: tuple[Path, list[Any]], tmpfs: Mount) -> None:
    model, (first, second) = qwen
    disk = tmpfs(32 << 20)
    folder = disk / "pc"
    folder.mkdir()
    filler = fill_disk(disk, 64 << 10)  # another file took the space
    flags = ("--prompt-cache-dir", str(folder), "--prompt-cache-size", "1G", "--no-usage-table")
    a = Server(model, *flags)
    got1 = _ask(a, TURN1)
    got2 = _ask(a, _turn2(got1[0]))
    log = a.stop()
    _no_traceback(log)
    assert log.count("prompt cache: a snapshot was not saved: not enough free space") == 2, log
    assert got1[:2] == first[:2] and got2[:2] == second[:2]  # (its RAM cache: as the uninterrupted server)
    assert not list(folder.iterdir())  # nothing partial left
    filler.unlink()  # space again: the next server's context is kept
    b = Server(model, *flags)
    assert _ask(b, TURN1)[:2] == first[:2]
    _no_traceback(b.stop())
    assert len(_snapshots(folder)) == 1 and len(list(folder.iterdir())) == 1


def test_crash_during_the_write_leaves_nothing_used(
    qwen: tuple[Path, list[Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, (first, _) = qwen
    folder = tmp_path / "pc"
    pauses = Pauses(tmp_path / "pauses", "output.rename")  # written and fsynced, not yet renamed
    pauses.arm(monkeypatch)
    a = Server(model, "--prompt-cache-dir", str(folder), "--no-usage-table")
    got1 = _ask(a, TURN1)
    pid = pauses.wait("output.rename", alive=lambda: a.proc.poll() is None)
    assert pid == a.proc.pid
    os.kill(pid, signal.SIGKILL)
    a.proc.communicate(timeout=30)
    partial = [p for p in folder.iterdir()]
    assert len(partial) == 1 and ".partial-" in partial[0].name and not _snapshots(folder)
    monkeypatch.delenv("TOKENWING_TEST_PAUSE")
    b = Server(model, "--prompt-cache-dir", str(folder), "--no-usage-table")
    assert not list(folder.iterdir())  # the dead writer's file is gone once the next server is ready
    got = _ask(b, TURN1)
    log = b.stop()
    _no_traceback(log)
    assert "prompt_restored_tokens" not in got[2] and got[:2] == got1[:2] == first[:2]
    assert len(_snapshots(folder)) == 1  # and this server's own is whole


def test_least_recently_used_go_past_the_size(qwen: tuple[Path, list[Any]], tmp_path: Path) -> None:
    model, _ = qwen
    one = _write_one(model, tmp_path / "measure").stat().st_size
    folder = tmp_path / "pc"
    other = [{"role": "user", "content": "Write a short poem about the mountains, and about the rivers."}]
    flags = ("--prompt-cache-dir", str(folder), "--prompt-cache-size", str(one * 3 // 2), "--no-usage-table")
    a = Server(model, *flags)
    _ask(a, TURN1)
    _ask(a, other)  # (its slot waits for turn 1's write, then its own goes past the size: turn 1's goes)
    _no_traceback(a.stop())
    assert len(_snapshots(folder)) == 1
    b = Server(model, *flags)
    kept, gone = _ask(b, other), _ask(b, TURN1)
    _no_traceback(b.stop())
    assert kept[2]["prompt_restored_tokens"] > 0 and "prompt_restored_tokens" not in gone[2]


def test_a_restore_does_not_stop_another_slots_decode(
    qwen: tuple[Path, list[Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44 item 3: a restore runs off the engine thread. Held at serve.restore (its read not started), another
    request in the other slot is admitted and decodes every one of its tokens; let go, the restored reply is the
    uninterrupted server's, to the bit."""
    model, (first, second) = qwen
    folder = tmp_path / "pc"
    _write_one(model, folder)
    pauses = Pauses(tmp_path / "pauses", "serve.restore")
    pauses.arm(monkeypatch)
    b = Server(model, "--prompt-cache-dir", str(folder), "--no-usage-table", "--parallel", "2")
    got: list[tuple[str, list[float], dict[str, Any]]] = []
    restoring = threading.Thread(target=lambda: got.append(_ask(b, _turn2(first[0]))))
    restoring.start()
    try:
        pauses.wait("serve.restore", alive=lambda: b.proc.poll() is None)
        other = b.client().chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert other.usage is not None and other.usage.completion_tokens == 8  # 8 decode steps, the restore held
        assert not got and pauses.reached("serve.restore") == b.proc.pid
    finally:
        (pauses.folder / ("serve.restore" + GO)).touch()
        restoring.join(timeout=300)
        log = b.stop()
    _no_traceback(log)
    (restored,) = got
    assert restored[2]["prompt_restored_tokens"] > 0
    assert restored[2]["prompt_cached_tokens"] == second[2]["prompt_cached_tokens"]
    assert restored[:2] == second[:2]
