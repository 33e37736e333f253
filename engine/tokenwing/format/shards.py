"""A split model repacked shard by shard, within the disk a user has: resumable, deleting each shard once done.

`tokenwing repack SHARDS… --delete-source` (or `--shards MANIFEST`, for shards still downloading) plans the
repacked file from every shard's header, then takes the shards that are there, one at a time:

1. its tensors are written where the plan puts them in the output (a sparse file of the final size, beside it
   in `.NAME.repack/partial`): resident tensors whole, each expert projection into its experts' records;
2. the output is flushed, and every byte written is read back and checked against the source's hash;
3. the progress (shards done, the resident tensors' and the completed layers' checksums) is saved atomically
   in `.NAME.repack/state.json`, with a copy of each shard's header so the plan survives the shards;
4. the shard is deleted (`--delete-source`).

Any shard order works (a layer whose projections straddle two shards gets its records' checksums once its
last projection is written). A later run with the same shards continues after the last saved shard: what a
killed run wrote after that is simply written again. The run that completes the last shard writes the final
header, checks it, and renames the output into place; the file is then byte for byte what a plain repack of
the same shards writes. The disk holds at most the output's bytes written so far plus the shards not yet
deleted, so a model repacked as it downloads needs the repacked size plus about one shard, not twice the model.

`plan_summary` is what `--plan --json` prints: the app asks it before a download, from the header bytes alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from tokenwing.errors import BadInputError, DiskSpaceError
from tokenwing.format import layout as L
from tokenwing.format.gguf_io import encode_header, read_header
from tokenwing.format.inspect import inspect_source
from tokenwing.format.repack import Plan, _Output, _Sources, copy_resident, final_header, plan_repack
from tokenwing.format.source import ManifestShard, SourceModel, expand_shard_names, open_manifest
from tokenwing.fsutil import SPACE_MARGIN, fsync_dir, human_bytes
from tokenwing.progress import Progress

STATE_VERSION = 1
READ_CHUNK = 8 << 20
PAUSE_ENV = "TOKENWING_TEST_REPACK_PAUSE"  # tests: "shard:N" holds the run after writing shard N's data ...
PAUSE_FILE_ENV = "TOKENWING_TEST_REPACK_PAUSE_FILE"  # ... having created this file, until it is killed


def shards_from_paths(paths: list[str], out_path: str) -> list[ManifestShard]:
    """Shards named on the command line: the first of a split set stands for all of them; a shard already
    repacked and deleted by an earlier run of the same repack is known from that run's saved progress."""
    paths = expand_shard_names(paths)
    saved = _load_state(state_dir(out_path))
    files = saved.files if saved is not None else {}
    out = []
    for p in paths:
        try:
            size = os.path.getsize(p)
        except OSError:
            size = files.get(os.path.basename(p), 0)
            if not size:
                raise BadInputError(f"{p} does not exist (and no earlier run of this repack saw it)") from None
        out.append(ManifestShard(p, size, None))
    return out


def plan_summary(source: SourceModel) -> dict[str, Any]:
    """The repacked file's size and the peak disk of both paths, with what `inspect` says of the model.

    Shard by shard, the output only holds bytes already written (a sparse file until then), so with one shard
    repacking and the next one downloading the drive holds at most the repacked file + the largest shard.
    After the download: every shard + the output."""
    plan = plan_repack(source)
    sizes = source.shard_sizes()
    largest = max(sizes)
    return {
        "output_bytes": plan.file_size,
        "source_bytes": sum(sizes),
        "largest_shard_bytes": largest,
        "shards": [
            {"file": os.path.basename(p), "bytes": n, "header_bytes": h}
            for p, n, h in zip(source.paths, sizes, source.header_bytes, strict=True)
        ],
        "peak_bytes": {"streaming": plan.file_size + largest, "copy": plan.file_size + sum(sizes)},
        "model": inspect_source(source),
    }


def state_dir(out_path: str) -> str:
    """Where a resumable repack keeps its partial output and progress: beside the output, hidden."""
    head, tail = os.path.split(os.path.abspath(out_path))
    return os.path.join(head, f".{tail}.repack")


@dataclass
class ShardRepackResult:
    shards: int
    done: list[int]  # indices (in split order) of the shards repacked so far
    complete: bool  # the output is in place
    written_bytes: int  # this run
    seconds: float


@dataclass
class _State:
    fingerprint: str
    done: list[int] = field(default_factory=list)
    resident_sums: dict[int, int] = field(default_factory=dict)  # plan.resident index → xxh3 of its bytes
    written: set[tuple[int, int]] = field(default_factory=set)  # (expert layer index, projection) written
    layer_sums: dict[int, list[int]] = field(default_factory=dict)  # expert layer index → record checksums
    files: dict[str, int] = field(default_factory=dict)  # shard name → size (for shards deleted since)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "done": sorted(self.done),
            "resident_sums": {str(k): str(v) for k, v in self.resident_sums.items()},
            "written": sorted([li, p] for li, p in self.written),
            "layer_sums": {str(k): [str(x) for x in v] for k, v in self.layer_sums.items()},
            "files": self.files,
        }

    @classmethod
    def from_json(cls, data: Any) -> _State | None:
        try:
            if data["version"] != STATE_VERSION:
                return None
            return cls(
                str(data["fingerprint"]),
                [int(i) for i in data["done"]],
                {int(k): int(v) for k, v in data["resident_sums"].items()},
                {(int(a), int(b)) for a, b in data["written"]},
                {int(k): [int(x) for x in v] for k, v in data["layer_sums"].items()},
                {str(k): int(v) for k, v in data["files"].items()},
            )
        except (KeyError, TypeError, ValueError):
            return None


def repack_shards(
    shards: list[ManifestShard],
    out_path: str,
    *,
    delete_source: bool = False,
    show_progress: bool = True,
    log: Callable[[str], None] = lambda line: None,
) -> ShardRepackResult:
    """Repacks the shards that are there now (see the module docstring); the output appears with the last."""
    t0 = time.monotonic()
    sd = state_dir(out_path)
    directory = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(directory):
        raise BadInputError(f"output folder {directory} does not exist")
    if os.path.isdir(out_path):
        raise BadInputError(f"output {out_path} is a folder")
    os.makedirs(os.path.join(sd, "headers"), exist_ok=True)
    saved = _load_state(sd)
    shards = _with_saved_headers(shards, sd, saved)
    source = open_manifest(shards)
    order = {p: i for i, p in enumerate(source.paths)}  # split order
    shards = sorted(shards, key=lambda s: order[s.path])
    if any(os.path.abspath(p) == os.path.abspath(out_path) for p in source.paths):
        raise BadInputError("the output would overwrite the source")
    plan = plan_repack(source)
    fingerprint = _fingerprint(plan, source)
    partial = os.path.join(sd, "partial")
    state = (
        saved if saved is not None and saved.fingerprint == fingerprint and _size(partial) == plan.file_size else None
    )
    if state is None:
        if saved is not None:
            log("the saved progress is for other shards or was damaged: starting this repack over")
        sizes = source.shard_sizes()
        state = _State(fingerprint, files={os.path.basename(p): n for p, n in zip(source.paths, sizes, strict=True)})
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        with open(partial, "wb") as f:
            f.truncate(plan.file_size)  # sparse: the drive holds only what is written
        _save_state(sd, state)
    for s in shards:
        _keep_header(s, sd)

    todo = [i for i, s in enumerate(shards) if i not in state.done and s.present]
    missing = [i for i, s in enumerate(shards) if i not in state.done and not s.present]
    by_shard = _tensors_by_shard(plan, source)
    _check_space(directory, plan, by_shard, todo, shards, delete_source)
    total = sum(_shard_payload(plan, by_shard[i]) for i in range(len(shards)))
    progress = Progress("repacking", 2 * total, enabled=show_progress)
    progress.advance(2 * sum(_shard_payload(plan, by_shard[i]) for i in state.done))
    written = 0
    fd = os.open(partial, os.O_RDWR)
    try:
        out = _Output(fd)
        for i in todo:
            written += _repack_one(plan, state, i, by_shard[i], shards[i], out, fd, progress)
            _save_state(sd, state)
            if delete_source:
                os.unlink(shards[i].path)
                fsync_dir(os.path.dirname(os.path.abspath(shards[i].path)))
            log(f"shard {i + 1} of {len(shards)} repacked and verified" + (", then deleted" if delete_source else ""))
        for i in state.done:  # a run killed between saving and deleting
            if delete_source and i not in todo and shards[i].present:
                os.unlink(shards[i].path)
        complete = not missing
        if complete:
            _finish(plan, state, out, fd)
    finally:
        os.close(fd)
    progress.finish()
    if complete:
        os.replace(partial, out_path)
        fsync_dir(directory)
        shutil.rmtree(sd, ignore_errors=True)
    return ShardRepackResult(len(shards), sorted(state.done), complete, written, time.monotonic() - t0)


# ---------------------------------------------------------------------------------------------- one shard


@dataclass
class _ShardTensors:
    resident: list[int] = field(default_factory=list)  # plan.resident indices
    experts: list[tuple[int, int]] = field(default_factory=list)  # (expert layer index, projection)


def _tensors_by_shard(plan: Plan, source: SourceModel) -> list[_ShardTensors]:
    index = {p: i for i, p in enumerate(source.paths)}
    out = [_ShardTensors() for _ in source.paths]
    for r, (_, st) in enumerate(plan.resident):
        out[index[st.path]].resident.append(r)
    for li, el in enumerate(plan.experts.layers):
        for p, proj in enumerate(L.PROJECTIONS):
            out[index[plan.expert_sources[(el.layer, proj)].path]].experts.append((li, p))
    return out


def _shard_payload(plan: Plan, t: _ShardTensors) -> int:
    n = plan.experts.n_expert
    return sum(plan.resident[r][0].nbytes for r in t.resident) + sum(
        plan.experts.layers[li].proj_size[p] * n for li, p in t.experts
    )


def _repack_one(
    plan: Plan,
    state: _State,
    i: int,
    t: _ShardTensors,
    shard: ManifestShard,
    out: _Output,
    fd: int,
    progress: Progress,
) -> int:
    """Writes shard i's tensors, reads them back against the source's hashes, records the checksums."""
    src = _Sources([shard.path])
    ex = plan.experts
    written = 0
    source_sums: dict[tuple[str, int, int], int] = {}
    try:
        for r in t.resident:
            source_sums[("r", r, 0)] = copy_resident(plan, r, src, out, progress)
            written += plan.resident[r][0].nbytes
        for li, p in t.experts:
            el = ex.layers[li]
            st = plan.expert_sources[(el.layer, L.PROJECTIONS[p])]
            size = el.proj_size[p]
            h = xxhash.xxh3_64()
            for e in range(ex.n_expert):
                data = src.read(st.path, st.expert_offset(e, size), size)
                h.update(data)
                out.write(data, el.expert_offset(e) + el.proj_offset[p])
                progress.advance(size)
            source_sums[("x", li, p)] = h.intdigest()
            written += size * ex.n_expert
    finally:
        src.close()
    out.flush()
    _test_pause(i)
    _verify_shard(plan, state, t, source_sums, fd, progress)
    state.done.append(i)
    return written


def _verify_shard(
    plan: Plan,
    state: _State,
    t: _ShardTensors,
    source_sums: dict[tuple[str, int, int], int],
    fd: int,
    progress: Progress,
) -> None:
    """Reads back what the shard wrote: every tensor must hash as its source did. Layers whose last projection
    arrived get their records' checksums from the same reads."""
    ex = plan.experts
    for r in t.resident:
        info, _ = plan.resident[r]
        h = xxhash.xxh3_64()
        pos = plan.data_start + info.offset
        for start in range(0, info.nbytes, READ_CHUNK):
            n = min(READ_CHUNK, info.nbytes - start)
            h.update(_pread(fd, n, pos + start))
            progress.advance(n)
        _expect(h.intdigest() == source_sums[("r", r, 0)], info.name)
        state.resident_sums[r] = h.intdigest()
    layers = sorted({li for li, _ in t.experts})
    for li in layers:
        el = ex.layers[li]
        mine = [p for lj, p in t.experts if lj == li]
        state.written.update((li, p) for p in mine)
        complete = all((li, p) in state.written for p in range(3))
        hashes = {p: xxhash.xxh3_64() for p in mine}
        sums: list[int] = []
        for e in range(ex.n_expert):
            if complete:  # one read of the whole record: the checks and the record's checksum
                record = _pread(fd, el.record_size, el.expert_offset(e))
                sums.append(xxhash.xxh3_64_intdigest(record))
                for p in mine:
                    start = el.proj_offset[p]
                    hashes[p].update(record[start : start + el.proj_size[p]])
            else:
                for p in mine:
                    hashes[p].update(_pread(fd, el.proj_size[p], el.expert_offset(e) + el.proj_offset[p]))
            progress.advance(sum(el.proj_size[p] for p in mine))
        for p in mine:
            _expect(
                hashes[p].intdigest() == source_sums[("x", li, p)], L.source_expert_name(el.layer, L.PROJECTIONS[p])
            )
        if complete:
            state.layer_sums[li] = sums
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _finish(plan: Plan, state: _State, out: _Output, fd: int) -> None:
    """The final header, with every checksum, at the start of the file; then checked as a reader will."""
    ex = plan.experts
    n_resident = len(plan.resident)
    if sorted(state.resident_sums) != list(range(n_resident)) or sorted(state.layer_sums) != list(
        range(len(ex.layers))
    ):
        raise BadInputError("the saved progress lacks checksums of some tensors: delete .*.repack and start over")
    resident_sums = np.array([state.resident_sums[r] for r in range(n_resident)], dtype=np.uint64)
    ex.checksums = np.array([state.layer_sums[li] for li in range(len(ex.layers))], dtype=np.uint64)
    header = final_header(plan, resident_sums)
    out.write(header, 0)
    out.flush()
    os.fsync(fd)
    _expect(_pread(fd, len(header), 0) == header, "the header")


# ---------------------------------------------------------------------------------------------- files and state


def _pread(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise BadInputError(f"the partial output ends early at offset {offset + len(data)}")
    return data


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise BadInputError(f"{what} reads back different from what was written (a failing drive?); nothing kept")


def _fingerprint(plan: Plan, source: SourceModel) -> str:
    """The plan's identity: its header with placeholder checksums, and the shards' names and sizes."""
    header, _ = encode_header(plan.kv, plan.tensors, L.ALIGNMENT)
    names = json.dumps([[os.path.basename(p), n] for p, n in zip(source.paths, source.shard_sizes(), strict=True)])
    return hashlib.sha256(header + names.encode()).hexdigest()


def _load_state(sd: str) -> _State | None:
    try:
        with open(os.path.join(sd, "state.json"), encoding="utf-8") as f:
            return _State.from_json(json.load(f))
    except (OSError, ValueError):
        return None


def _save_state(sd: str, state: _State) -> None:
    path = os.path.join(sd, "state.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state.to_json(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(sd)


def _with_saved_headers(shards: list[ManifestShard], sd: str, saved: _State | None) -> list[ManifestShard]:
    """Shards gone since an earlier run (deleted once repacked) are planned from the header copies kept here."""
    out = []
    for s in shards:
        copy = os.path.join(sd, "headers", os.path.basename(s.path))
        if not s.present and os.path.isfile(copy):
            s = ManifestShard(s.path, s.size, copy)
        out.append(s)
    return out


def _keep_header(s: ManifestShard, sd: str) -> None:
    """A copy of a present shard's header, so that the plan can be made again once the shard is deleted."""
    copy = os.path.join(sd, "headers", os.path.basename(s.path))
    if os.path.exists(copy) or not s.present:
        return
    n = read_header(s.path).data_start
    with open(s.path, "rb") as f:
        data = f.read(n)
    tmp = copy + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, copy)


def _check_space(
    directory: str,
    plan: Plan,
    by_shard: list[_ShardTensors],
    todo: list[int],
    shards: list[ManifestShard],
    delete_source: bool,
) -> None:
    """The peak of this run: each shard adds its output bytes, and frees its own bytes once deleted."""
    peak = level = 0
    for i in todo:
        level += _shard_payload(plan, by_shard[i])
        peak = max(peak, level)
        if delete_source:
            level -= shards[i].size
    if not todo:
        return
    free = shutil.disk_usage(directory).free
    if free < peak + SPACE_MARGIN:
        raise DiskSpaceError(
            f"not enough free space in {directory}: repacking these shards needs {human_bytes(peak)}, "
            f"{human_bytes(free)} free"
        )


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _test_pause(shard: int) -> None:
    """Tests kill a run at a known point: after shard N's data is written, before it is verified and saved."""
    if os.environ.get(PAUSE_ENV) != f"shard:{shard + 1}":
        return
    marker = os.environ.get(PAUSE_FILE_ENV)
    if marker:
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
    while True:
        # Short sleeps: a signal that lands just before a sleep starts runs its handler only when the sleep ends
        # (CPython checks for signals between bytecodes), and one long sleep then held an interrupt for an hour.
        time.sleep(0.05)
