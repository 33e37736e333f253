"""A sequence's state on disk (issue 44): its KV cache up to its position, its recurrent states and their
checkpoints, and the tokens they hold, in one file that is refused unless it is whole and made by this engine
build for this model file, this cache layout and this chat template. docs/prompt-cache.md is the file format.

`capture` takes views of a sequence's memory (no copy): valid while the sequence is left alone, which is the
writer's caller's to ensure (server/prompt_disk_cache.py waits for a slot's write before reusing the slot).
`restore` checks a file's header, tags, length and layout before it writes anything into a sequence, then copies
its payload into the sequence piece by piece as the pieces land (IN_FLIGHT pieces in memory, never the whole
file), each section's CRC checked as it ends; a failed read or check empties the sequence. The payload is read
with the native core's direct reads: through a streaming core's readers where the session has one
(`core_reads`: behind every expert read, so a restore never delays a demand read by more than the reads already
on the drive), else by threads of its own (`thread_reads`).
"""

from __future__ import annotations

import collections
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
# the payload is checked and copied piece by piece as the pieces land (the CRCs overlap the reads); a server's
# tests make them small (TOKENWING_TEST_SNAPSHOT_PIECE) to damage a late piece of a small model's snapshot
PIECE = int(os.environ.get("TOKENWING_TEST_SNAPSHOT_PIECE") or 16 << 20)
IN_FLIGHT = 4  # pieces read at once, each into a buffer of its own: all a restore allocates besides the slot
ALIGN = _core.DIRECT_ALIGNMENT

# Starts reading len(dst) bytes at an offset of a file into dst; returns what waits for them (raises OSError).
ReadStart = Callable[[_core.DirectFile, int, np.ndarray], Callable[[], None]]


class SnapshotError(Exception):
    """A snapshot that is not whole, or not this engine's for this model: refused (its reason is the message)."""


class DoesNotFit(SnapshotError):
    """A snapshot longer than this sequence's context (kept: a server whose context is longer may use it)."""


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


def _checked_header(path: str, tags: Tags) -> tuple[dict[str, Any], int]:
    """A snapshot's header, refused unless it is for these tags; and where its payload starts."""
    with open(path, "rb") as f:
        header = read_header(f)
        start = f.tell()
    why = mismatch(header, tags)
    if why is not None:
        raise SnapshotError(why)
    return header, start


class _Sections:
    """Each section's CRC-32, run on as its bytes land in order (`landed`), checked as each section ends."""

    def __init__(self, header: dict[str, Any]) -> None:
        self.sections: list[dict[str, Any]] = header["sections"]
        self.bounds: list[int] = np.cumsum([0, *(int(s["bytes"]) for s in self.sections)]).tolist()
        self.crcs = [0] * len(self.sections)

    def landed(self, lo: int, data: np.ndarray) -> None:
        hi = lo + data.size
        for i, (a, b) in enumerate(itertools.pairwise(self.bounds)):
            x, y = max(a, lo), min(b, hi)
            if x < y:
                self.crcs[i] = zlib.crc32(data[x - lo : y - lo].data, self.crcs[i])
                if y == b and self.crcs[i] != self.sections[i]["crc32"]:
                    s = self.sections[i]
                    raise SnapshotError(f"section {s['kind']} {s['index']} fails its checksum")


def read(path: str, tags: Tags, reads: ReadStart | None = None) -> Loaded:
    """Reads and checks a whole snapshot (tags, size, every section's CRC) into one buffer of its size (tests and
    tools; the server restores piece by piece: `restore`). `reads`: how its payload is read (default:
    `thread_reads`)."""
    header, start = _checked_header(path, tags)
    sections = _Sections(header)
    payload = np.empty(sections.bounds[-1], dtype=np.uint8)

    def landed(lo: int, data: np.ndarray) -> None:
        sections.landed(lo, data)
        payload[lo : lo + data.size] = data

    _stream_payload(path, start, payload.size, reads or thread_reads, landed)
    return Loaded(header, payload)


def restore(path: str, tags: Tags, seq: SeqState, elt: int, reads: ReadStart | None = None) -> int:
    """Reads a snapshot into a sequence (`elt`: bytes per cache element) piece by piece as the pieces land, each
    section's CRC checked as it ends: a restore's extra memory is IN_FLIGHT pieces, not the snapshot's size.
    Returns its tokens. What is refused before any payload is read (header, tags, length, context, layout) leaves
    the sequence unchanged; a failed read or check after that leaves it empty (never half-restored)."""
    header, start = _checked_header(path, tags)
    sections = _Sections(header)
    slot = _Slot(header, seq, elt)

    def landed(lo: int, data: np.ndarray) -> None:
        sections.landed(lo, data)
        slot.put(lo, data)

    try:
        _stream_payload(path, start, sections.bounds[-1], reads or thread_reads, landed, slot.begin)
    except BaseException:
        if slot.begun:
            slot.empty()
        raise
    slot.finish()
    return len(header["tokens"])


def _aligned(n: int) -> np.ndarray:
    """n bytes at a direct-read-aligned address (a restore's only buffers: tests count them)."""
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + n]


def _stream_payload(
    path: str,
    start: int,
    size: int,
    reads: ReadStart,
    landed: Callable[[int, np.ndarray], None],
    begin: Callable[[], None] | None = None,
) -> None:
    """The `size` bytes at `start`, which must end the file, given to `landed(offset, bytes)` in order: the
    aligned part in PIECE pieces with direct reads, IN_FLIGHT of them queued at once in as many buffers (a deep
    queue: one buffered reader got 300-450 MB/s from a drive that gives 2 GB/s to a deep queue,
    bench/prompt_restore_bench.py), each buffer read again once its piece is given; the last partial block with
    a plain read. `begin()` once the length is checked, before any piece is given."""
    with _core.DirectFile(path, True) as f:
        end = start + size
        if f.size != end:
            raise SnapshotError("truncated" if f.size < end else "longer than its header says")
        lo = start - start % ALIGN if f.direct else start
        hi = max(lo, end - end % ALIGN) if f.direct else end
        pieces = [(a, min(a + PIECE, hi)) for a in range(lo, hi, PIECE)]
        free = [_aligned(PIECE) for _ in range(min(IN_FLIGHT, len(pieces)))]
        queued: collections.deque[tuple[int, int, np.ndarray, Callable[[], None]]] = collections.deque()
        todo = iter(pieces)

        def queue() -> None:
            for a, b in itertools.islice(todo, len(free)):
                buf = free.pop()
                queued.append((a, b, buf, reads(f, a, buf[: b - a])))

        if begin is not None:
            begin()
        try:
            queue()
            while queued:
                a, b, buf, wait = queued.popleft()
                wait()
                landed(max(a, start) - start, buf[max(a, start) - a : b - a])
                free.append(buf)
                queue()
        finally:
            for _, _, _, wait in queued:  # (a failed piece: the others land before their buffer goes)
                with contextlib.suppress(OSError):
                    wait()
        if hi < end:  # (the file's last partial block: not a direct read)
            tail = np.empty(end - hi, dtype=np.uint8)
            with open(path, "rb") as t:
                if os.preadv(t.fileno(), [tail.data], hi) != end - hi:
                    raise SnapshotError("truncated")  # (shortened while it was read)
            landed(max(hi, start) - start, tail[max(hi, start) - hi :])


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


class _Slot:
    """Where each section of a snapshot goes in a sequence (of the same layout: the tags said so), checked before
    anything is written: its positions' K and V, its live recurrent states, new arrays for its checkpoints."""

    def __init__(self, header: dict[str, Any], seq: SeqState, elt: int) -> None:
        kv = self.kv = seq.kv
        self.seq, self.header, self.begun = seq, header, False
        self.tokens: list[int] = list(header["tokens"])
        pos = self.pos = len(self.tokens)
        if pos >= kv.n_ctx:
            raise DoesNotFit(f"{pos} tokens do not fit this context ({kv.n_ctx})")
        # each section's bytes as rows of a 2-D view (one row where the memory is contiguous)
        dst: dict[tuple[str, int], np.ndarray] = {}
        for i, (k_mem, v_mem) in enumerate(kv._memory):
            dst["k", i] = k_mem[: pos * (k_mem.nbytes // kv.n_ctx)].reshape(1, -1)
            if v_mem is not None:
                dst["v", i] = _v_rows(v_mem, kv.n_ctx, elt)[:, : pos * elt]
        kinds = {s["kind"] for s in header["sections"]}
        arrays = kv.states.arrays if kv.states is not None else {}
        self.live = "conv" in kinds
        self.points = [p for p in header["points"] or [] if f"cp{p}.conv" in kinds]
        self.saved: list[Checkpoint] = []
        for il, (conv, state) in sorted(arrays.items()):
            if self.live:
                dst["conv", il], dst["state", il] = (
                    conv.view(np.uint8).reshape(1, -1),
                    state.view(np.uint8).reshape(1, -1),
                )
        for p in self.points:
            layers = {il: (np.empty_like(conv), np.empty_like(state)) for il, (conv, state) in arrays.items()}
            self.saved.append(Checkpoint(p, layers))
            for il, (conv, state) in layers.items():
                dst[f"cp{p}.conv", il] = conv.view(np.uint8).reshape(1, -1)
                dst[f"cp{p}.state", il] = state.view(np.uint8).reshape(1, -1)
        self.places: list[tuple[int, np.ndarray]] = []  # (payload offset, destination) in file order
        offset = 0
        for s in header["sections"]:
            d = dst.pop((s["kind"], int(s["index"])), None)
            if d is None or d.size != int(s["bytes"]):
                raise SnapshotError(f"section {s['kind']} {s['index']} is not this cache's layout")
            self.places.append((offset, d))
            offset += d.size
        if dst:
            raise SnapshotError(f"no section {next(iter(dst))}")

    def begin(self) -> None:
        """The slot's memory is about to be written: it holds nothing until `finish`."""
        self.begun = True
        self.empty()
        self.seq.kv_high = max(self.seq.kv_high, self.pos)

    def put(self, lo: int, data: np.ndarray) -> None:
        """The payload's bytes from `lo` into their places."""
        hi = lo + data.size
        for at, d in self.places:
            x, y = max(at, lo), min(at + d.size, hi)
            if x >= y:
                continue
            src, w = data[x - lo : y - lo], d.shape[1]
            r, c = divmod(x - at, w)
            if c:  # (a row's end)
                n = min(w - c, src.size)
                d[r, c : c + n] = src[:n]
                src, r = src[n:], r + 1
            whole = src.size // w
            d[r : r + whole] = src[: whole * w].reshape(whole, w)
            if src.size > whole * w:  # (a row's start)
                d[r + whole, : src.size - whole * w] = src[whole * w :]

    def empty(self) -> None:
        """Holds nothing (what the session's reset leaves): a failed restore is never used."""
        seq = self.seq
        seq.history, seq.pos, seq.state_dirty, seq.media = [], 0, False, None
        seq.checkpoints.clear()
        seq.checkpoints.abandon()
        if self.kv.states is not None:
            self.kv.states.zero()

    def finish(self) -> None:
        """Every section is in place and checked: the sequence holds the snapshot's tokens."""
        seq = self.seq
        if self.kv.states is not None:
            seq.checkpoints.saved = sorted(self.saved, key=lambda cp: cp.pos)
            seq.checkpoints.abandon()
            # without the live state (it was half-updated when captured), the sequence resumes from a checkpoint
            seq.state_dirty = not self.live
        if self.kv.spilled:
            self.kv.write_back()
        seq.history = list(self.tokens)
        seq.pos = self.pos


def apply(loaded: Loaded, seq: SeqState, elt: int) -> None:
    """Puts a checked snapshot read whole (`read`) into a sequence."""
    slot = _Slot(loaded.header, seq, elt)
    slot.begin()
    slot.put(0, loaded.payload)
    slot.finish()
