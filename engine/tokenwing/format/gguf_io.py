"""Defensive GGUF v3 header reading and writing.

Model files and their metadata are untrusted input: every length, count and offset is checked against the
file and against limits before anything is allocated, and every problem becomes a one-line BadInputError.
Tensor data is never read here; callers stream it with pread (no mapping of the whole file).
"""

from __future__ import annotations

import enum
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.fsutil import atomic_output

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

# Limits far above any real model, low enough that a corrupt count cannot exhaust memory.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 22
MAX_STRING = 1 << 26
MAX_ARRAY = 1 << 26
MAX_DIMS = 4
MAX_HEADER = 1 << 31


class ValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_DTYPES: dict[ValueType, str] = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4",
    ValueType.BOOL: "<u1",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT64: "<f8",
}


@dataclass
class KV:
    """One metadata value with its GGUF type. Arrays of numbers are numpy arrays, of strings lists."""

    type: ValueType
    value: Any
    item_type: ValueType | None = None  # for arrays

    @staticmethod
    def u32(v: int) -> KV:
        return KV(ValueType.UINT32, int(v))

    @staticmethod
    def u64(v: int) -> KV:
        return KV(ValueType.UINT64, int(v))

    @staticmethod
    def i32(v: int) -> KV:
        return KV(ValueType.INT32, int(v))

    @staticmethod
    def f32(v: float) -> KV:
        return KV(ValueType.FLOAT32, float(v))

    @staticmethod
    def string(v: str) -> KV:
        return KV(ValueType.STRING, v)

    @staticmethod
    def boolean(v: bool) -> KV:
        return KV(ValueType.BOOL, bool(v))

    @staticmethod
    def strings(v: Sequence[str]) -> KV:
        return KV(ValueType.ARRAY, list(v), ValueType.STRING)

    @staticmethod
    def array(item_type: ValueType, values: Iterable[Any]) -> KV:
        return KV(ValueType.ARRAY, np.asarray(list(values), dtype=_SCALAR_DTYPES[item_type]), item_type)

    @staticmethod
    def ndarray(item_type: ValueType, values: np.ndarray) -> KV:
        return KV(ValueType.ARRAY, np.ascontiguousarray(values, dtype=_SCALAR_DTYPES[item_type]), item_type)


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (row length) first
    type: int  # ggml type id
    offset: int  # relative to the data section
    nbytes: int = 0

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.type)


@dataclass
class GGUFHeader:
    path: str
    version: int
    kv: dict[str, KV]
    tensors: list[TensorInfo]
    alignment: int
    data_start: int
    file_size: int
    header_end: int  # end of the tensor infos, before padding
    value_offsets: dict[str, int] = field(default_factory=dict)  # file offset of each scalar KV value

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kv.get(key)
        return default if kv is None else kv.value

    def tensor(self, name: str) -> TensorInfo | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None


def shown(name: str, most: int = 80) -> str:
    """A name from a file, quoted for a one-line message: a crafted name may be 64 MiB of any bytes."""
    return repr(name if len(name) <= most else name[:most] + "…")


def ggml_type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type{type_id}"


def tensor_nbytes(shape: Sequence[int], type_id: int) -> int:
    """Bytes of a tensor; UnsupportedError for an unknown type, BadInputError for an impossible shape."""
    try:
        qtype = GGMLQuantizationType(type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise UnsupportedError(f"unsupported tensor type id {type_id}") from None
    if not shape or any(d <= 0 for d in shape):
        raise BadInputError(f"tensor has an empty or negative dimension {tuple(shape)}")
    if shape[0] % block:
        raise BadInputError(f"row length {shape[0]} is not a multiple of {qtype.name}'s block of {block}")
    n = 1
    for d in shape[1:]:
        n *= d
    return n * (shape[0] // block) * type_size


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class _Cursor:
    """Bounded sequential reader over the header of an open file."""

    def __init__(self, f: BinaryIO, path: str, file_size: int, truncated: bool = False) -> None:
        self.f = f
        self.path = path
        self.size = file_size
        self.whole = file_size  # the whole file's size where only a prefix of it is here (set by _parse)
        self.pos = 0
        self._buf = b""
        self._buf_start = 0
        self._error = TruncatedHeaderError if truncated else BadInputError  # a short prefix, or a short file

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise self._error(f"{self.path}: truncated GGUF header (needs {n} bytes at offset {self.pos})")
        rel = self.pos - self._buf_start
        if rel + n > len(self._buf):
            self.f.seek(self.pos)
            self._buf = self.f.read(max(n, 1 << 20))
            self._buf_start = self.pos
            rel = 0
            if len(self._buf) < n:
                raise self._error(f"{self.path}: truncated GGUF header")
        out = self._buf[rel : rel + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q")
        if n > MAX_STRING:
            raise BadInputError(f"{self.path}: {what} claims a string of {n} bytes")
        return self.take(n).decode("utf-8", errors="surrogateescape")


def _read_value(cur: _Cursor, vtype: int, key: str) -> KV:
    try:
        vt = ValueType(vtype)
    except ValueError:
        raise BadInputError(f"{cur.path}: metadata {shown(key)} has unknown value type {vtype}") from None
    if vt == ValueType.STRING:
        return KV(vt, cur.string(key))
    if vt == ValueType.ARRAY:
        item = cur.unpack("<I")
        count = cur.unpack("<Q")
        if count > MAX_ARRAY:
            raise BadInputError(f"{cur.path}: metadata {shown(key)} claims {count} array items")
        try:
            it = ValueType(item)
        except ValueError:
            raise BadInputError(f"{cur.path}: metadata {shown(key)} has unknown array type {item}") from None
        least = 8 if it == ValueType.STRING else np.dtype(_SCALAR_DTYPES.get(it, "<u1")).itemsize
        if count * least > cur.whole - cur.pos:
            raise BadInputError(f"{cur.path}: metadata {shown(key)} claims {count:,} items, more than the file holds")
        if it == ValueType.STRING:
            return KV(vt, [cur.string(key) for _ in range(count)], it)
        if it == ValueType.ARRAY:
            raise BadInputError(f"{cur.path}: metadata {shown(key)} nests arrays, which GGUF models do not use")
        dtype = np.dtype(_SCALAR_DTYPES[it])
        raw = cur.take(count * dtype.itemsize)
        return KV(vt, np.frombuffer(raw, dtype=dtype).copy(), it)
    dtype = np.dtype(_SCALAR_DTYPES[vt])
    value = np.frombuffer(cur.take(dtype.itemsize), dtype=dtype)[0].item()
    if vt == ValueType.BOOL:
        value = bool(value)
    return KV(vt, value)


class TruncatedHeaderError(BadInputError):
    """The bytes end inside the header: a header prefix (`declared_size`) that was cut too short."""


def read_header(path: str, declared_size: int | None = None) -> GGUFHeader:
    """Parses and validates a GGUF file's header and tensor table. Reads no tensor data.

    `declared_size`: `path` holds only the first bytes of a file of that size (its header, fetched with a range
    request before the file itself); tensors are checked against the declared size, and a prefix that ends
    inside the header raises TruncatedHeaderError."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; must map OSError to a clean message
    except OSError as e:
        raise BadInputError(f"cannot open {path}: {e.strerror or e}") from None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            if declared_size is None:
                return _parse(f, path, size, size)
            if size > declared_size:
                raise BadInputError(f"{path}: {size} bytes, more than the declared {declared_size}")
            return _parse(f, path, declared_size, size)
        except OSError as e:
            raise BadInputError(f"cannot read {path}: {e.strerror or e}") from None


def _parse(f: BinaryIO, path: str, size: int, readable: int) -> GGUFHeader:
    cur = _Cursor(f, path, min(readable, MAX_HEADER), truncated=readable < size)
    cur.whole = size
    if size < 24:
        raise BadInputError(f"{path}: not a GGUF file (only {size} bytes)")
    magic = cur.take(4)
    if magic != GGUF_MAGIC:
        raise BadInputError(f"{path}: not a GGUF file (magic {magic!r})")
    version = cur.unpack("<I")
    if version != GGUF_VERSION:
        raise UnsupportedError(f"{path}: GGUF version {version} is not supported (only {GGUF_VERSION})")
    n_tensors = cur.unpack("<Q")
    n_kv = cur.unpack("<Q")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise BadInputError(f"{path}: implausible header ({n_tensors} tensors, {n_kv} metadata keys)")
    # the smallest a key and its value (13 bytes) and a tensor's entry (32) can be: counts the file cannot hold
    # are refused before the loops build anything from them
    if n_kv * 13 + n_tensors * 32 > size - cur.pos:
        raise BadInputError(
            f"{path}: the header claims {n_tensors:,} tensors and {n_kv:,} metadata keys, more than its "
            f"{size:,} bytes can hold"
        )
    kv: dict[str, KV] = {}
    value_offsets: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        vtype = cur.unpack("<I")
        value_offsets[key] = cur.pos
        if key in kv:
            raise BadInputError(f"{path}: metadata key {shown(key)} appears twice")
        kv[key] = _read_value(cur, vtype, key)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in kv:
        a = kv["general.alignment"]
        if a.type != ValueType.UINT32 or a.value <= 0 or a.value & (a.value - 1):
            raise BadInputError(f"{path}: general.alignment must be a power-of-two uint32")
        alignment = int(a.value)
    tensors: list[TensorInfo] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = cur.string("tensor name")
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise BadInputError(f"{path}: tensor {shown(name)} has {n_dims} dimensions")
        shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
        if any(d == 0 or d > 1 << 40 for d in shape):
            raise BadInputError(f"{path}: tensor {shown(name)} has an impossible shape {shape}")
        ttype = cur.unpack("<I")
        offset = cur.unpack("<Q")
        if name in names:
            raise BadInputError(f"{path}: tensor {shown(name)} appears twice")
        names.add(name)
        try:
            nbytes = tensor_nbytes(shape, ttype)
        except BadInputError as e:
            raise type(e)(f"{path}: tensor {shown(name)}: {e}") from None
        if offset % alignment:
            raise BadInputError(f"{path}: tensor {shown(name)} is not aligned to {alignment} bytes")
        tensors.append(TensorInfo(name, shape, ttype, offset, nbytes))
    header_end = cur.pos
    data_start = align_up(header_end, alignment)
    for t in tensors:
        if data_start + t.offset + t.nbytes > size:
            raise BadInputError(f"{path}: tensor {shown(t.name)} ends past the end of the file (truncated file?)")
    return GGUFHeader(path, version, kv, tensors, alignment, data_start, size, header_end, value_offsets)


# ----------------------------------------------------------------------------------------------- writing


def _encode_string(s: str) -> bytes:
    b = s.encode("utf-8", errors="surrogateescape")
    return struct.pack("<Q", len(b)) + b


def _encode_value(kv: KV) -> bytes:
    if kv.type == ValueType.STRING:
        return _encode_string(kv.value)
    if kv.type == ValueType.ARRAY:
        assert kv.item_type is not None
        if kv.item_type == ValueType.STRING:
            body = b"".join(_encode_string(s) for s in kv.value)
            return struct.pack("<IQ", int(kv.item_type), len(kv.value)) + body
        arr = np.ascontiguousarray(kv.value, dtype=_SCALAR_DTYPES[kv.item_type])
        return struct.pack("<IQ", int(kv.item_type), arr.size) + arr.tobytes()
    return np.asarray(kv.value, dtype=_SCALAR_DTYPES[kv.type]).tobytes()


def encode_header(kv: dict[str, KV], tensors: Sequence[TensorInfo], alignment: int) -> tuple[bytes, dict[str, int]]:
    """Serialises a header, padded to `alignment`; also returns each KV value's offset in it."""
    parts = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kv))]
    pos = sum(len(p) for p in parts)
    offsets: dict[str, int] = {}
    for key, value in kv.items():
        head = _encode_string(key) + struct.pack("<I", int(value.type))
        body = _encode_value(value)
        offsets[key] = pos + len(head)
        parts += [head, body]
        pos += len(head) + len(body)
    for t in tensors:
        parts.append(_encode_string(t.name))
        parts.append(struct.pack("<I", len(t.shape)) + struct.pack(f"<{len(t.shape)}Q", *t.shape))
        parts.append(struct.pack("<IQ", t.type, t.offset))
    raw = b"".join(parts)
    return raw + b"\0" * (align_up(len(raw), alignment) - len(raw)), offsets


def layout_tensors(tensors: Sequence[TensorInfo], alignment: int) -> int:
    """Assigns data-relative offsets in order; returns the data section's size."""
    pos = 0
    for t in tensors:
        t.offset = pos
        pos = align_up(pos + t.nbytes, alignment)
    return pos


def rewrite_metadata(src: str, dst: str, kv: dict[str, KV]) -> GGUFHeader:
    """Writes `src` to `dst` (atomically; `dst` may be `src`) with the metadata `kv` in place of its own: the same
    tensor table and the tensor data copied byte for byte, so only the header changes (its length too: the data
    section moves, each tensor's offset within it does not). Returns the new file's header."""
    old = read_header(src)
    header, _ = encode_header(kv, old.tensors, old.alignment)
    data_size = old.file_size - old.data_start
    with open(src, "rb") as f_in:
        f_in.seek(old.data_start)
        with atomic_output(dst, len(header) + data_size) as tmp, open(tmp, "wb") as f_out:
            f_out.write(header)
            left = data_size
            while left:
                chunk = f_in.read(min(left, 1 << 24))
                if not chunk:
                    raise BadInputError(f"{src}: the file ends inside its tensor data")
                f_out.write(chunk)
                left -= len(chunk)
    return read_header(dst)
