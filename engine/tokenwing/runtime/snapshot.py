"""A sequence's state on disk (issue 44): its KV cache up to its position, its recurrent states and their
checkpoints, and the tokens they hold, in one file that is refused unless it is whole and made by this engine
build for this model file, this cache layout and this chat template. docs/prompt-cache.md is the file format.

`capture` takes views of a sequence's memory (no copy): valid while the sequence is left alone, which is the
writer's caller's to ensure (server/prompt_disk_cache.py waits for a slot's write before reusing the slot).
`read` loads and checks a whole file before `apply` writes any of it into a sequence: a damaged file changes
nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

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
READ_CHUNK, READ_THREADS = 4 << 20, 16  # a snapshot's reads: requests and how many at once (a deep queue)


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


def read(path: str, tags: Tags) -> Loaded:
    """Reads and checks a whole snapshot (tags, size, every section's CRC) before anything is used."""
    with open(path, "rb") as f:
        header = read_header(f)
        why = mismatch(header, tags)
        if why is not None:
            raise SnapshotError(why)
        payload = _read_payload(f, sum(int(s["bytes"]) for s in header["sections"]))
    offset = 0
    for s in header["sections"]:
        n = int(s["bytes"])
        if zlib.crc32(payload[offset : offset + n].data) != s["crc32"]:
            raise SnapshotError(f"section {s['kind']} {s['index']} fails its checksum")
        offset += n
    return Loaded(header, payload)


def _read_payload(f: BinaryIO, size: int) -> np.ndarray:
    """The `size` bytes after the header, which must end the file, read by several threads at once: one reader
    at a time got 300-450 MB/s from a drive that gives 2 GB/s to a deep queue (bench/prompt_restore_bench.py)."""
    start, fd = f.tell(), f.fileno()
    end = os.fstat(fd).st_size
    if end != start + size:
        raise SnapshotError("truncated" if end < start + size else "longer than its header says")
    payload = np.empty(size, dtype=np.uint8)
    view = payload.data

    def one(offset: int) -> bool:
        n = min(READ_CHUNK, size - offset)
        return os.preadv(fd, [view[offset : offset + n]], start + offset) == n

    with ThreadPoolExecutor(READ_THREADS) as pool:
        if not all(pool.map(one, range(0, size, READ_CHUNK))):
            raise SnapshotError("truncated")  # (shortened while it was read)
    return payload


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
