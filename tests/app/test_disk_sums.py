"""The full-disk sentences add up (issue 29, defect 5): what a model needs is its files + the margin kept free, and
the shortfall is that less what is free, in the numbers as the sentence shows them — the estimate's disk line and
the refusal of a job whose peak does not fit. Before, the estimate said "needs 10.0 GB; 5.0 GB free — 5.3 GB
short" (the shortfall counted the margin, the "needs" did not)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from runmyai.engine.info import EngineInfo
from runmyai.library.acquire import AcquireError, Acquirer, Job, ShardSpec
from runmyai.library.downloads import DownloadManager
from runmyai.library.estimate import DISK_MARGIN, disk_reason, launch_estimate
from runmyai.library.hub import HubClient
from runmyai.library.local import LocalLibrary
from tests.app.test_estimate import ENGINE, MACHINE, PRESET


def size(name: str) -> str:
    return rf"(?P<{name}>\d+(?:\.\d)?) (?P<{name}_unit>bytes|KB|MB|GB|TB)"


ESTIMATE_LINE = re.compile(
    rf"Disk: needs {size('need')} \({size('files')} for the model \+ {size('margin')} kept free\); "
    rf"{size('free')} free in the models folder(?: — {size('short')} short)?\."
)


def sizes(match: re.Match[str]) -> dict[str, Decimal]:
    """The numbers of a sentence by name, checked to share one unit."""
    found = match.groupdict()
    units = {u for key, u in found.items() if key.endswith("_unit") and u is not None}
    assert len(units) == 1, match.group(0)  # one unit: a reader can add them up
    return {k: Decimal(n) for k, n in found.items() if k + "_unit" in found and n is not None}


@given(files=st.integers(0, 10**13), free=st.integers(0, 10**13))
@example(files=10_060_000_000, free=5_000_000_000)  # each rounded on its own: 10.1 GB + 268.4 MB = 10.3 GB
@example(files=10_000_000_000, free=10_000_000_000 + DISK_MARGIN - 1)  # short by one byte
@example(files=10_000_000_000, free=10_000_000_000 + DISK_MARGIN)  # just fits
@example(files=10_000_000_000, free=10_000_000_000 + DISK_MARGIN + 40_000_000)  # fits; rounded, it would not
def test_the_estimate_disk_line_adds_up(files: int, free: int) -> None:
    line = disk_reason(files, "for the model", free)
    match = ESTIMATE_LINE.fullmatch(line)
    assert match is not None, line
    n = sizes(match)
    assert n["need"] == n["files"] + n["margin"], line
    assert ("short" in n) == (files + DISK_MARGIN > free), line  # a shortfall is said exactly when there is one
    if "short" in n:
        assert n["short"] == n["need"] - n["free"] and n["short"] > 0, line
    else:
        assert n["need"] <= n["free"], line


def test_the_estimate_says_it_through_its_one_code_path() -> None:
    machine = dataclasses.replace(MACHINE, disk_free=PRESET.size_bytes // 2)
    est = launch_estimate(PRESET, machine, ENGINE)
    [line] = [r for r in est.reasons if r.startswith("Disk:")]
    assert est.verdict == "no_disk_space" and ESTIMATE_LINE.fullmatch(line), line
    peak = launch_estimate(PRESET, machine, ENGINE, disk_needed=PRESET.size_bytes * 2)
    assert any("at the peak of its download and repack + " in r for r in peak.reasons), peak.reasons


JOB_LINE = re.compile(
    rf"Not enough free space for Q8_0 of acme/Big-GGUF: repacking while downloading needs {size('need')} at its "
    rf"peak \(the repacked file {size('out')} \+ the largest shard {size('largest')} \+ {size('margin')} kept free"
    rf"(?: − {size('held')} this job already holds)?; {size('copy')} if it were repacked after the download\), "
    rf"but {size('free')} is free in (?P<folder>.+): {size('short')} short\."
)


@pytest.mark.parametrize("held", [0, 1_234_567_890])
def test_a_job_refused_for_its_peak_says_sums_that_add_up(tmp_path: Path, held: int) -> None:
    """A 600 GB model in two shards on whatever this drive has free, with a margin that no drive has: refused
    before a byte is fetched, in numbers that add up (with what the job already holds taken off, when it holds
    some)."""
    models, downloads = tmp_path / "models", tmp_path / "downloads"
    manager = DownloadManager(HubClient(endpoint="http://127.0.0.1:9"), downloads, models)
    margin = 10**14  # 100 TB kept free: never there
    acquirer = Acquirer(
        manager.hub,
        manager,
        LocalLibrary(models),
        downloads / "jobs",
        engine=lambda: EngineInfo("test", {}, 0, ()),
        machine=lambda: None,
        disk_margin=margin,
    )
    out, shard = 600_123_456_789, 320_987_654_321
    job = Job(
        downloads / "jobs" / "j1",
        "acme/Big-GGUF",
        "main",
        "Q8_0",
        [
            ShardSpec("Big-Q8_0-00001-of-00002.gguf", shard, None),
            ShardSpec("Big-Q8_0-00002-of-00002.gguf", shard - 7, None),
        ],
        "acme/Big-GGUF/Big-Q8_0.tw.gguf",
        plan={
            "output_bytes": out,
            "largest_shard_bytes": shard,
            "peak_bytes": {"streaming": out + shard, "copy": out + 2 * shard - 7},
        },
    )
    if held:  # a shard already downloaded, sparse: its size is what counts
        job.shard_file(0).parent.mkdir(parents=True)
        with open(job.shard_file(0), "wb") as f:
            f.truncate(held)
    dest = models / job.output
    dest.parent.mkdir(parents=True)
    with pytest.raises(AcquireError) as refused:
        acquirer._check_disk(job, dest)
    message = str(refused.value)
    match = JOB_LINE.fullmatch(message)
    assert match is not None, message
    n = sizes(match)
    held_shown = n.get("held", Decimal(0))
    assert n["need"] == n["out"] + n["largest"] + n["margin"] - held_shown, message
    assert n["short"] == n["need"] - n["free"] and n["short"] > 0, message
    assert n["copy"] > n["need"] and (held_shown > 0) == bool(held), message
    assert match.group("folder") == str(dest.parent)
    asyncio.run(manager.close())
