"""Shard-by-shard repack (`--delete-source`, `--shards MANIFEST`) and the plan from header bytes alone."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ModelFactory, assert_clean_error, run_cli, start_cli


def shards_of(first: Path) -> list[Path]:
    return sorted(first.parent.glob(first.name.replace("-00001-of-", "-*-of-")))


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def plain(first: Path, tmp: Path) -> Path:
    out = tmp / "plain.tw.gguf"
    r = run_cli("repack", str(first), "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    return out


def copy_shards(files: list[Path], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        shutil.copyfile(f, folder / f.name)
        out.append(folder / f.name)
    return out


def manifest(folder: Path, files: list[Path], header_bytes: int) -> Path:
    """A manifest as the app writes it: where each shard will land, its size, and a file with its first bytes."""
    (folder / "headers").mkdir(parents=True, exist_ok=True)
    (folder / "shards").mkdir(exist_ok=True)
    entries = []
    for f in files:
        (folder / "headers" / f.name).write_bytes(f.read_bytes()[:header_bytes])
        entries.append({"path": f"shards/{f.name}", "size": f.stat().st_size, "header": f"headers/{f.name}"})
    path = folder / "manifest.json"
    path.write_text(json.dumps({"shards": entries}))
    return path


def test_delete_source_gives_the_bytes_of_a_plain_repack(model_factory: ModelFactory, tmp_path: Path) -> None:
    first = model_factory(type="Q8_0", shards=3, seed=7)
    expected = sha256(plain(first, tmp_path))
    copies = copy_shards(shards_of(first), tmp_path / "src")
    out = tmp_path / "out.tw.gguf"
    r = run_cli("repack", str(copies[1]), "-o", str(out), "--delete-source", "--json")  # any shard names the set
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"shards": 3, "done": [0, 1, 2], "complete": True, "output": str(out)}
    assert sha256(out) == expected
    assert not any(c.exists() for c in copies)  # each shard deleted once written and verified
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.tw.gguf", "plain.tw.gguf", "src"]  # no state left


def test_shards_in_any_order_across_runs_and_a_kill(model_factory: ModelFactory, tmp_path: Path) -> None:
    """Shards arrive out of order over several runs; one run is killed after writing a shard, before saving it."""
    first = model_factory(type="F16", shards=3, seed=8)
    files = shards_of(first)
    expected = sha256(plain(first, tmp_path))
    job = tmp_path / "job"
    m = manifest(job, files, 64 << 10)
    out = tmp_path / "models" / "m.tw.gguf"
    out.parent.mkdir()
    args = ("repack", "--shards", str(m), "-o", str(out), "--delete-source", "--json", "-q")

    def arrive(i: int) -> None:
        shutil.copyfile(files[i], job / "shards" / files[i].name)

    arrive(1)
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["done"] == [1] and not out.exists()
    assert not (job / "shards" / files[1].name).exists()

    arrive(0)
    marker = tmp_path / "paused"
    env = {**os.environ, "TOKENWING_TEST_REPACK_PAUSE": "shard:1", "TOKENWING_TEST_REPACK_PAUSE_FILE": str(marker)}
    proc = subprocess.Popen([sys.executable, "-m", "tokenwing", *args], env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (job / "shards" / files[0].name).exists()  # not verified and saved yet: kept

    arrive(2)
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["complete"] is True
    assert sha256(out) == expected
    assert not list((job / "shards").iterdir())
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.tw.gguf"]


def test_plan_from_header_bytes(model_factory: ModelFactory, tmp_path: Path) -> None:
    first = model_factory(type="Q8_0", shards=3, seed=7)
    files = shards_of(first)
    short = manifest(tmp_path / "short", files, 200)
    r = run_cli("repack", "--shards", str(short), "--plan", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"headers_incomplete": [0, 1, 2]}

    m = manifest(tmp_path / "job", files, 64 << 10)
    r = run_cli("repack", "--shards", str(m), "--plan", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    size = plain(first, tmp_path).stat().st_size
    sizes = [f.stat().st_size for f in files]
    assert plan["output_bytes"] == size and plan["source_bytes"] == sum(sizes)
    assert plan["peak_bytes"] == {"streaming": size + max(sizes), "copy": size + sum(sizes)}
    assert [s["bytes"] for s in plan["shards"]] == sizes
    assert all(0 < s["header_bytes"] < 64 << 10 for s in plan["shards"])
    assert plan["model"]["architecture"] == "qwen3moe" and plan["model"]["parameters"] > 0
    human = run_cli("repack", "--shards", str(m), "--plan")
    assert human.returncode == 0 and "repacking shard by shard" in human.stdout


def test_bad_shard_arguments_are_one_line(model_factory: ModelFactory, tmp_path: Path) -> None:
    first = model_factory(type="Q8_0", shards=3, seed=7)
    m = manifest(tmp_path / "job", shards_of(first), 64 << 10)
    assert_clean_error(run_cli("repack", "--shards", str(m)), 2)  # no -o
    assert_clean_error(run_cli("repack", str(first), "--shards", str(m), "--plan"), 2)  # both
    gone = tmp_path / "gone-00001-of-00002.gguf"
    assert_clean_error(run_cli("repack", str(gone), "-o", str(tmp_path / "x.tw.gguf"), "--delete-source"), 2)
    (tmp_path / "bad.json").write_text('{"shards": [{"path": "a.gguf", "size": -1}]}')
    assert_clean_error(run_cli("repack", "--shards", str(tmp_path / "bad.json"), "--plan"), 2)


def test_ctrl_c_keeps_what_was_verified(model_factory: ModelFactory, tmp_path: Path) -> None:
    """SIGINT while shard 2 is written (held there by the test hook): exit 130 with one line, shard 1's progress
    and the shards themselves kept; the same command then finishes with the bytes of a plain repack."""
    first = model_factory(type="Q8_0", shards=3, seed=9)
    expected = sha256(plain(first, tmp_path))
    copies = copy_shards(shards_of(first), tmp_path / "src")
    out = tmp_path / "out.tw.gguf"
    marker = tmp_path / "paused"
    args = ["repack", str(copies[0]), "-o", str(out), "--delete-source", "-q"]
    env = {**os.environ, "TOKENWING_TEST_REPACK_PAUSE": "shard:2", "TOKENWING_TEST_REPACK_PAUSE_FILE": str(marker)}
    # (with SIGINT at its default in the child: a CI that runs the suite as a background job passes it on ignored)
    proc = start_cli(*args, env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # (a failed test leaves no paused repack behind)
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in err
    assert not out.exists() and not copies[0].exists() and copies[1].exists() and copies[2].exists()
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert sha256(out) == expected
