"""Issue 41: a model file's header numbers are hostile input. Each crafted file is refused in one line naming the
field, by every command, each run as a real subprocess under a 2 GiB address-space limit (so that a regression
fails here, as a MemoryError or a kill, instead of taking the machine); and the fixed-seed header fuzzer."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CliResult, ModelFactory, assert_clean_error
from tests.format.header_fuzz import limited, resign
from tokenwing.format.gguf_io import read_header

ROOT = Path(__file__).resolve().parents[2]


def run_limited(*args: str) -> CliResult:
    """`python -m tokenwing ARGS` under a 2 GiB address-space limit."""
    proc = subprocess.run(
        [sys.executable, "-m", "tokenwing", *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited(),  # (in place before the child runs anything)
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def set_int(src: Path, dst: Path, key: str, value: int) -> Path:
    """A copy of `src` with integer metadata `key` set to `value` in place (same width), re-signed if it is a
    model file: the crafted file of the issue (its other bytes, the checksum included, as a writer makes them)."""
    h = read_header(str(src))
    kv = h.kv[key]
    fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[int(kv.type)]
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(h.value_offsets[key])
        f.write(struct.pack(fmt, value))
    resign(dst)
    return dst


# ------------------------------------------------------------------------------------ block_count = 2**31 - 1

HUGE = 2_147_483_647


def test_huge_block_count_is_refused_by_every_command(
    model_factory: ModelFactory, repacked_factory: ModelFactory, tmp_path: Path
) -> None:
    """The issue's file: inspect grew 3 GB/s until the OOM killer came (models/hparams built per-layer tuples of
    2**31 items), repack exited 0; the same file re-signed did it in verify and run."""
    src = set_int(model_factory(), tmp_path / "b.gguf", "qwen3moe.block_count", HUGE)
    tw = set_int(repacked_factory(), tmp_path / "b.tw.gguf", "qwen3moe.block_count", HUGE)
    runs = {
        "inspect gguf": run_limited("inspect", str(src)),
        "repack": run_limited("repack", str(src), "-o", str(tmp_path / "out.tw.gguf"), "-q"),
        "inspect tw": run_limited("inspect", str(tw)),
        "verify": run_limited("verify", str(tw)),
        "run": run_limited("run", str(tw), "--prompt", "hi", "-n", "1"),
        "info": run_limited("info", str(tw)),
    }
    for what, r in runs.items():
        assert_clean_error(r, 2)
        assert "qwen3moe.block_count is 2,147,483,647" in r.stderr, (what, r.stderr)
    assert not (tmp_path / "out.tw.gguf").exists()


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("qwen3moe.block_count", 0, "qwen3moe.block_count is 0, outside"),
        ("qwen3moe.block_count", 3, "block_count is 3, but the file holds tensors of 2 blocks"),
        ("qwen3moe.block_count", 1, "block_count is 1, but the file holds tensors of block 1"),
        ("qwen3moe.attention.head_count", 0, "qwen3moe.attention.head_count is 0, outside"),
        ("qwen3moe.embedding_length", 1, "embedding_length is 1, but token_embd.weight is 64 wide"),
        ("qwen3moe.context_length", 4_294_967_295, "qwen3moe.context_length is 4,294,967,295, outside"),
        ("qwen3moe.expert_count", 1 << 20, "qwen3moe.expert_count is 1,048,576, outside"),
    ],
)
def test_repack_refuses_nonsense_metadata(
    model_factory: ModelFactory, tmp_path: Path, key: str, value: int, words: str
) -> None:
    """40 of the issue's 150 mutations were repacked (exit 0): block_count 0, head_count 0, embedding_length 1,
    context_length 4294967295."""
    src = set_int(model_factory(), tmp_path / "m.gguf", key, value)
    out = tmp_path / "out"
    out.mkdir()
    r = run_limited("repack", str(src), "-o", str(out / "m.tw.gguf"), "-q")
    assert_clean_error(r, 2)
    assert words in r.stderr
    assert os.listdir(out) == []


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("qwen3moe.context_length", 1 << 31, "qwen3moe.context_length is 2,147,483,648, outside"),
        ("qwen3moe.attention.head_count", 0, "qwen3moe.attention.head_count is 0, outside"),
        ("qwen3moe.attention.head_count_kv", 3, "head_count must be a multiple of head_count_kv"),
        ("qwen3moe.embedding_length", 1, "embedding_length is 1, but token_embd.weight is 64 wide"),
        ("qwen3moe.expert_used_count", 100, "expert_used_count 100 is more than expert_count 8"),
    ],
)
def test_verify_refuses_what_run_refuses(
    repacked_factory: ModelFactory, tmp_path: Path, key: str, value: int, words: str
) -> None:
    """A re-signed model file with inconsistent metadata: `verify` refuses it with the line `run` gives
    (context_length = 2**31 passed verify, then run died in a traceback allocating its graph)."""
    tw = set_int(repacked_factory(), tmp_path / "m.tw.gguf", key, value)
    verify = run_limited("verify", str(tw))
    run = run_limited("run", str(tw), "--prompt", "hi", "-n", "1")
    for r in (verify, run):
        assert_clean_error(r, 2)
        assert words in r.stderr
    assert verify.stderr == run.stderr  # the same line


def test_counts_beyond_the_file_are_refused_before_reading(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The tensor and key counts, and an array's length, against what the file's bytes can hold."""
    src = model_factory()
    data = bytearray(src.read_bytes())
    data[8:16] = struct.pack("<Q", 1 << 21)  # tensors: 64 MiB of entries at least, in a file of ~1 MiB
    p = tmp_path / "t.gguf"
    p.write_bytes(bytes(data))
    r = run_limited("inspect", str(p))
    assert_clean_error(r, 2)
    assert "claims 2,097,152 tensors" in r.stderr
    h = read_header(str(src))
    pos = h.value_offsets["tokenizer.ggml.tokens"] + 4  # (after the item type: the array's length)
    data = bytearray(src.read_bytes())
    data[pos : pos + 8] = struct.pack("<Q", 1 << 26)
    p.write_bytes(bytes(data))
    r = run_limited("inspect", str(p))
    assert_clean_error(r, 2)
    assert "'tokenizer.ggml.tokens' claims 67,108,864 items, more than the file holds" in r.stderr


# ------------------------------------------------------------------------------------------------ the fuzzer

FUZZ_CASES = 300  # (the worker's --cases below)


def test_header_fuzz_only_clean_refusals(
    model_factory: ModelFactory, repacked_factory: ModelFactory, tmp_path: Path
) -> None:
    """300 fixed-seed mutations (a source GGUF and its repacked file, 150 each), all under a 2 GiB limit: every
    command either accepts the file or refuses it in one line with a documented exit code, and a model file that
    `verify` accepts is one an engine start accepts."""
    shape = {"type": "Q8_0", "n_layer": 1, "vocab_size": 300}
    src, tw = model_factory(**shape), repacked_factory(**shape)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.format.header_fuzz", str(src), str(tw), str(tmp_path), "--cases", "300"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        preexec_fn=limited(),
        check=False,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(results) == FUZZ_CASES, (
        f"exit {proc.returncode} after {len(results)} cases (last: {results[-1:]})\n{proc.stderr[-3000:]}"
    )
    failures = [r for r in results if r["verdict"].startswith("failure")]
    assert failures == [], failures[:3]
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        by_kind.setdefault(r["kind"], {"accepted": 0, "refused": 0})[r["verdict"]] += 1
    # not vacuous: every kind of mutation was refused somewhere, and metadata mutations were accepted too
    assert all(v["refused"] > 0 for v in by_kind.values()), by_kind
    assert by_kind["meta"]["accepted"] > 0, by_kind
