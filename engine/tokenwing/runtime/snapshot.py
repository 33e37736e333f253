"""A sequence's state on disk (issue 44): its KV cache up to its position, its recurrent states and their
checkpoints, and the tokens they hold, in one file that is refused unless it is whole and made by this engine
build for this model file, this cache layout and this chat template. docs/prompt-cache.md is the file format.

`capture` takes views of a sequence's memory (no copy): valid while the sequence is left alone, which is the
writer's caller's to ensure (server/prompt_disk_cache.py waits for a slot's write before reusing the slot).
`read` loads and checks a whole file before `apply` writes any of it into a sequence: a damaged file changes
nothing. Its payload is read with the native core's direct reads: through a streaming core's readers where the
session has one (`core_reads`: behind every expert read, so a restore never delays a demand read by more than
the reads already on the drive), else by threads of its own (`thread_reads`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from tokenwing import _core
from tokenwing.compute import ggml_api as ggml
from tokenwing.fsutil import write_atomic
from tokenwing.runtime.recurrent import Checkpoint
from tokenwing.runtime.sequences import SeqState
from tokenwing.text.chat import ChatTemplate
from tokenwing.version import __version__

MAGIC = b"TWSNAP01"
FORMAT = 1
SUFFIX = ".twsnap"
_HEAD = struct.Struct("<8sII")  # magic, header length, header CRC-32
READ_CHUNK, READ_THREADS = 4 << 20, 16  # thread_reads: requests and how many at once (a deep queue)
OTHER_CHUNK = 1 << 20  # core_reads: a request's bytes (a demand expert read waits behind at most those in service)
PIECE = 16 << 20  # the payload is checked piece by piece as the pieces land (the CRCs overlap the reads)
ALIGN = _core.DIRECT_ALIGNMENT

# Starts reading len(dst) bytes at an offset of a file into dst; returns what waits for them (raises OSError).
ReadStart = Callable[[_core.DirectFile, int, np.ndarray], Callable[[], None]]


class SnapshotError(Exception):
    """A snapshot that is not whole, or not this engine's for this model: refused (its reason is the message)."""


def token_hash(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def model_identity(path: str) -> str:
    """The model file's identity: its size, modification time and the hash of its first MiB (the GGUF header and
    metadata). A file rewritten or replaced (a repack, another quant) is another model."""
    st = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:32]
    return f"{st.st_size}:{st.st_mtime_ns}:{head}"


def engine_build() -> str:
    """This engine's build as far as a cache's bits go: the version, ggml's, and the CPU backend module that
    computed them (another one may round differently)."""
    return f"tokenwing {__version__}; ggml {ggml.build_info().get('ggml')}; cpu {ggml.CPU_VARIANT}"


@dataclass(frozen=True)
class Tags:
    """What a snapshot must match to be used: model file, engine build, chat template, and the cache's layout
    (element type and every layer's widths)."""

    model: str
    build: str
    template: str
    layout: str

    def as_dict(self) -> dict[str, str]:
        return {"model": self.model, "build": self.build, "template": self.template, "layout": self.layout}


def layout_of(seq: SeqState, kv_type: str) -> str:
    """The hash of a sequence's cache layout: per attention layer its bytes per position of K and V, per
    recurrent layer its arrays' shapes."""
    kv = seq.kv
    parts: list[Any] = [kv_type]
    for k_mem, v_mem in kv._memory:
        parts.append(["kv", k_mem.nbytes // kv.n_ctx, 0 if v_mem is None else v_mem.nbytes // kv.n_ctx])
    if kv.states is not None:
        for il, (conv, state) in sorted(kv.states.arrays.items()):
            parts.append(["state", il, list(conv.shape), list(state.shape)])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def make_tags(model_path: str, template: ChatTemplate | None, seq: SeqState, kv_type: str) -> Tags:
    """The tags of a session's sequences (`template`: the model's chat template, whose text and special tokens
    made the prompts: a changed one renders a conversation into other tokens)."""
    rendered = [template.source, template.bos_token, template.eos_token] if template is not None else []
    return Tags(
        model_identity(model_path),
        engine_build(),
        hashlib.sha256(json.dumps(rendered).encode()).hexdigest()[:32],
        layout_of(seq, kv_type),
    )


@dataclass
class Capture:
    """A sequence's state as views of its memory, in the file's order (see module docstring)."""

    tokens: list[int]
    sections: list[tuple[str, int, memoryview]]  # (kind, layer or checkpoint position, bytes)
    points: list[int] | None  # positions a restore may resume at (recurrent: checkpoints and the end)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for _, _, m in self.sections)


def _bytes(a: np.ndarray) -> memoryview:
    return a.data.cast("B")


def capture(seq: SeqState, elt: int) -> Capture:
    """Views of what a sequence holds (`elt`: bytes per cache element): every attention layer's K rows and V
    columns of its positions, the live recurrent states (if they are whole) and their checkpoints."""
    kv, pos = seq.kv, seq.pos
    assert pos == len(seq.history), "a sequence's position is its history's length"
    sections: list[tuple[str, int, memoryview]] = []
    for i, (k_mem, v_mem) in enumerate(kv._memory):  # (uint8 arrays: runtime/kvcache.py)
        sections.append(("k", i, _bytes(k_mem[: pos * (k_mem.nbytes // kv.n_ctx)])))
        if v_mem is not None:  # V transposed: a row per element, its positions first (copied: not contiguous)
            rows = _v_rows(v_mem, kv.n_ctx, elt)
            sections.append(("v", i, _bytes(np.ascontiguousarray(rows[:, : pos * elt]))))
    points: list[int] | None = None
    if kv.states is not None:
        points = []
        if not seq.state_dirty:
            points.append(pos)
            for il, (conv, state) in sorted(kv.states.arrays.items()):
                sections += [("conv", il, _bytes(conv)), ("state", il, _bytes(state))]
        for cp in seq.checkpoints.saved:
            points.append(cp.pos)
            for il, (conv, state) in sorted(cp.layers.items()):
                sections += [(f"cp{cp.pos}.conv", il, _bytes(conv)), (f"cp{cp.pos}.state", il, _bytes(state))]
    return Capture(list(seq.history), sections, points)


def _v_rows(v_mem: np.ndarray, n_ctx: int, elt: int) -> np.ndarray:
    """A transposed V cache's bytes as [element, position bytes]."""
    return v_mem.reshape(v_mem.nbytes // (n_ctx * elt), n_ctx * elt)


def write(path: str, tags: Tags, cap: Capture) -> int:
    """Writes a snapshot atomically (fsutil.write_atomic: aside, fsync, rename); returns its bytes. An OSError
    or a full disk raises (fsutil's DiskSpaceError, BadInputError) and leaves no file under `path`."""
    header = {
        "format": FORMAT,
        **tags.as_dict(),
        "tokens_sha256": token_hash(cap.tokens),
        "tokens": cap.tokens,
        "points": cap.points,
        "sections": [
            {"kind": kind, "index": index, "bytes": m.nbytes, "crc32": zlib.crc32(m)} for kind, index, m in cap.sections
        ],
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(_HEAD.size + len(text)) % ALIGN)  # (JSON's spaces) the payload starts aligned: direct reads
    total = _HEAD.size + len(text) + cap.nbytes

    def body(f: BinaryIO) -> None:
        f.write(_HEAD.pack(MAGIC, len(text), zlib.crc32(text)))
        f.write(text)
        for _, _, m in cap.sections:
            f.write(m)

    write_atomic(path, body, total)
    return total


def read_header(f: BinaryIO) -> dict[str, Any]:
    """A snapshot's header, checked (magic, CRC, format); the file is left at its payload."""
    head = f.read(_HEAD.size)
    if len(head) < _HEAD.size:
        raise SnapshotError("truncated header")
    magic, n, crc = _HEAD.unpack(head)
    if magic != MAGIC:
        raise SnapshotError("not a snapshot (bad magic)")
    text = f.read(n)
    if len(text) < n or zlib.crc32(text) != crc:
        raise SnapshotError("damaged header")
    header: dict[str, Any] = json.loads(text)
    if header.get("format") != FORMAT:
        raise SnapshotError(f"format {header.get('format')}, not {FORMAT}")
    if token_hash(header["tokens"]) != header["tokens_sha256"]:
        raise SnapshotError("its tokens do not match their hash")
    return header


def mismatch(header: dict[str, Any], tags: Tags) -> str | None:
    """Why a snapshot is not for this model, build, template and layout (None: it is)."""
    for key, value in tags.as_dict().items():
        if header.get(key) != value:
            return f"another {key}"
    return None


@dataclass
class Loaded:
    header: dict[str, Any]
    payload: np.ndarray  # every section, checked

    @property
    def tokens(self) -> list[int]:
        return list(self.header["tokens"])


def read(path: str, tags: Tags, reads: ReadStart | None = None) -> Loaded:
    """Reads and checks a whole snapshot (tags, size, every section's CRC) before anything is used. `reads`: how
    its payload is read (default: `thread_reads`)."""
    with open(path, "rb") as f:
        header = read_header(f)
        start = f.tell()
    why = mismatch(header, tags)
    if why is not None:
        raise SnapshotError(why)
    sizes = [int(s["bytes"]) for s in header["sections"]]
    crcs = [0] * len(sizes)
    bounds = np.cumsum([0, *sizes]).tolist()

    def landed(payload: np.ndarray, lo: int, hi: int) -> None:  # (in order: each section's CRC runs on)
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            x, y = max(a, lo), min(b, hi)
            if x < y:
                crcs[i] = zlib.crc32(payload[x:y].data, crcs[i])

    payload = _read_payload(path, start, bounds[-1], reads or thread_reads, landed)
    for s, crc in zip(header["sections"], crcs, strict=True):
        if crc != s["crc32"]:
            raise SnapshotError(f"section {s['kind']} {s['index']} fails its checksum")
    return Loaded(header, payload)


def _read_payload(
    path: str, start: int, size: int, reads: ReadStart, landed: Callable[[np.ndarray, int, int], None]
) -> np.ndarray:
    """The `size` bytes at `start`, which must end the file: the aligned part in PIECE pieces with direct reads
    (all started at once: a deep queue; one buffered reader got 300-450 MB/s from a drive that gives 2 GB/s to a
    deep queue, bench/prompt_restore_bench.py), the last partial block with a plain read; `landed(payload, lo, hi)`
    as each piece lands, in order."""
    with _core.DirectFile(path, True) as f:
        end = start + size
        if f.size != end:
            raise SnapshotError("truncated" if f.size < end else "longer than its header says")
        lo = start - start % ALIGN if f.direct else start
        hi = max(lo, end - end % ALIGN) if f.direct else end
        raw = np.empty(end - lo + ALIGN, dtype=np.uint8)
        skip = -raw.ctypes.data % ALIGN
        buf = raw[skip : skip + end - lo]
        payload = buf[start - lo :]
        waits = [(a, reads(f, a, buf[a - lo : min(a + PIECE, hi) - lo])) for a in range(lo, hi, PIECE)]
        try:
            if hi < end:  # (the file's last partial block: not a direct read)
                with open(path, "rb") as tail:
                    if os.preadv(tail.fileno(), [buf[hi - lo :].data], hi) != end - hi:
                        raise SnapshotError("truncated")  # (shortened while it was read)
            for a, wait in waits:
                wait()
                landed(payload, max(a, start) - start, min(a + PIECE, hi) - start)
        finally:
            for _, wait in waits:  # (a failed piece: the others land before their buffer goes)
                with contextlib.suppress(OSError):
                    wait()
        if hi < end:
            landed(payload, max(hi, start) - start, size)
    return payload


def thread_reads(f: _core.DirectFile, offset: int, dst: np.ndarray) -> Callable[[], None]:
    """Reads by threads of their own, READ_CHUNK at a time (a session without a streaming core)."""
    pool = ThreadPoolExecutor(READ_THREADS)
    futures = [pool.submit(f.read_into, offset + a, dst[a : a + READ_CHUNK]) for a in range(0, dst.size, READ_CHUNK)]
    pool.shutdown(wait=False)

    def wait() -> None:
        for fut in futures:
            fut.result()

    return wait


def core_reads(core: _core.StreamCore) -> ReadStart:
    """Reads through a streaming core's readers, behind its expert reads (`StreamCore.start_other`)."""

    def start(f: _core.DirectFile, offset: int, dst: np.ndarray) -> Callable[[], None]:
        job = core.start_other(f, offset, dst, OTHER_CHUNK)
        done = False

        def wait() -> None:
            nonlocal done
            if not done:
                done = True
                core.wait_other(job)

        return wait

    return start


def apply(loaded: Loaded, seq: SeqState, elt: int) -> None:
    """Puts a checked snapshot into a sequence (of the same layout: the tags said so): its positions' K and V, its
    recurrent states and checkpoints, its history and position."""
    kv = seq.kv
    tokens = loaded.tokens
    pos = len(tokens)
    if pos >= kv.n_ctx:
        raise SnapshotError(f"{pos} tokens do not fit this context ({kv.n_ctx})")
    data: dict[tuple[str, int], np.ndarray] = {}
    offset = 0
    for s in loaded.header["sections"]:
        n = int(s["bytes"])
        data[s["kind"], int(s["index"])] = loaded.payload[offset : offset + n]
        offset += n
    for i, (k_mem, v_mem) in enumerate(kv._memory):
        k = data[("k", i)]
        k_mem[: k.size] = k
        if v_mem is not None:
            rows = _v_rows(v_mem, kv.n_ctx, elt)
            rows[:, : pos * elt] = data[("v", i)].reshape(rows.shape[0], pos * elt)
    if kv.states is not None:
        arrays = kv.states.arrays

        def floats(kind: str, il: int, like: np.ndarray) -> np.ndarray:
            return data[(kind, il)].view(np.float32).reshape(like.shape)

        live = ("conv", next(iter(arrays), -1)) in data
        if live:
            for il, (conv, state) in arrays.items():
                np.copyto(conv, floats("conv", il, conv))
                np.copyto(state, floats("state", il, state))
        seq.checkpoints.saved = [
            Checkpoint(
                p,
                {
                    il: (floats(f"cp{p}.conv", il, conv).copy(), floats(f"cp{p}.state", il, state).copy())
                    for il, (conv, state) in arrays.items()
                },
            )
            for p in sorted(p for p in loaded.header["points"] if (f"cp{p}.conv", next(iter(arrays))) in data)
        ]
        seq.checkpoints.abandon()
        # without the live state (it was half-updated when captured), the sequence resumes from a checkpoint
        seq.state_dirty = not live
    if kv.spilled:
        kv.write_back()
    seq.history = tokens
    seq.pos = pos
    seq.kv_high = max(seq.kv_high, pos)
