"""Reading a TokenWing model file: header and index checks, resident tensors, experts, verification.

The file is never mapped whole: the header is read once, tensors and experts with direct reads (O_DIRECT)
into page-aligned buffers, falling back to cached reads with one line where the file system refuses.
"""

from __future__ import annotations

import mmap
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import xxhash

from tokenwing import _core
from tokenwing.errors import BadInputError, CorruptModelError, UnsupportedError
from tokenwing.format import layout as L
from tokenwing.format.gguf_io import GGUFHeader, TensorInfo, read_header
from tokenwing.format.validate import check_header
from tokenwing.progress import Progress
from tokenwing.testpause import pause

READ_CHUNK = 8 << 20
SAMPLE_EXPERTS = 24
SAMPLE_BYTES = 96 << 20


class AlignedBuffer:
    """Page-aligned memory (anonymous mmap) that direct reads can fill."""

    def __init__(self, size: int) -> None:
        self.size = max(L.align(size), L.ALIGNMENT)
        self._map = mmap.mmap(-1, self.size)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def view(self, n: int) -> np.ndarray:
        return self.array[:n]

    def close(self) -> None:
        # Views handed out may still be alive (e.g. in a traceback): let them keep the memory until freed.
        self.array = np.empty(0, dtype=np.uint8)
        self.size = 0


@dataclass
class VerifyReport:
    experts_checked: int
    tensors_checked: int
    bytes_checked: int
    seconds: float


class ModelFile:
    def __init__(self, header: GGUFHeader, index: L.ExpertIndex, fh: _core.DirectFile) -> None:
        self.header = header
        self.index = index
        self._file = fh
        n_res = int(header.get(L.K_RESIDENT_COUNT))
        stored = header.tensors[:n_res]
        # the tensors the engine loads; `kept` (next-token-prediction blocks) stay in the file, never read
        self.resident, self.kept = L.split_kept(stored, header)
        self._slot = {t.name: i for i, t in enumerate(stored)}  # position in the checksum array
        self.resident_checksums: np.ndarray = np.asarray(header.get(L.K_TENSOR_CHECKSUMS), dtype=np.uint64)
        self.arch = L.arch_of(header)
        self._buf: AlignedBuffer | None = None

    # -------------------------------------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str, direct: bool = True, announce_fallback: bool = True) -> ModelFile:
        header = read_header(path)
        check_version(header)
        _check_header_checksum(header)
        check_header(header)  # (a re-signed header's numbers are still untrusted)
        index = _load_index(header)
        try:
            fh = _core.DirectFile(path, direct)
        except OSError as e:
            raise BadInputError(str(e)) from None
        if direct and not fh.direct and announce_fallback:
            print(f"tokenwing: {fh.fallback_reason}: reading {path} through the file cache", file=sys.stderr)
        return cls(header, index, fh)

    def __enter__(self) -> ModelFile:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()
        if self._buf is not None:
            self._buf.close()
            self._buf = None

    @property
    def path(self) -> str:
        return self.header.path

    @property
    def direct(self) -> bool:
        return bool(self._file.direct)

    # -------------------------------------------------------------------------------------------- reading
    def _read(self, offset: int, n: int) -> np.ndarray:
        """Reads n bytes at an aligned offset into the shared scratch buffer (valid until the next read)."""
        length = L.align(n)
        if offset + length > self.header.file_size:
            raise CorruptModelError(f"{self.path}: data at {offset} runs past the end of the file")
        if self._buf is None or self._buf.size < length:
            if self._buf is not None:
                self._buf.close()
            self._buf = AlignedBuffer(max(length, READ_CHUNK))
        dst = self._buf.view(length)
        try:
            self._file.read_into(offset, dst)
        except OSError as e:
            raise CorruptModelError(f"{self.path}: {e}") from None
        return dst[:n]

    def tensor_offset(self, info: TensorInfo) -> int:
        return self.header.data_start + info.offset

    def read_tensor(self, name: str) -> bytes:
        """A resident (or kept) tensor's bytes, checked against its checksum."""
        for info in (*self.resident, *self.kept):
            if info.name == name:
                return self._read_resident(info)
        raise KeyError(f"no resident tensor {name!r}")

    def iter_resident(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[TensorInfo, bytes]]:
        """The tensors the engine loads (kept ones never, `skip` neither: read sparsely by their family), read and
        checked against their checksums."""
        for info in self.resident:
            if info.name not in skip:
                yield info, self._read_resident(info)

    def _read_resident(self, info: TensorInfo) -> bytes:
        i = self._slot[info.name]
        h = xxhash.xxh3_64()
        parts = []
        base = self.tensor_offset(info)
        for start in range(0, info.nbytes, READ_CHUNK):
            chunk = bytes(self._read(base + start, min(READ_CHUNK, info.nbytes - start)))
            h.update(chunk)
            parts.append(chunk)
        if h.intdigest() != int(self.resident_checksums[i]):
            raise CorruptModelError(f"{self.path}: tensor {info.name} fails its checksum (corrupt file)")
        return b"".join(parts)

    def read_expert(self, layer: int, expert: int) -> bytes:
        """One expert's whole record (gate, up, down at the layer's projection offsets), checked."""
        li, el = self._layer_pos(layer)
        if not 0 <= expert < self.index.n_expert:
            raise KeyError(f"layer {layer} has no expert {expert}")
        data = self._read(el.expert_offset(expert), el.record_size)
        if xxhash.xxh3_64_intdigest(data.data) != int(self.index.checksums[li, expert]):
            raise CorruptModelError(f"{self.path}: expert {expert} of layer {layer} fails its checksum")
        return bytes(data)

    def _layer_pos(self, layer: int) -> tuple[int, L.ExpertLayer]:
        for li, el in enumerate(self.index.layers):
            if el.layer == layer:
                return li, el
        raise KeyError(f"layer {layer} has no streamed experts")

    # ------------------------------------------------------------------------------------------ verifying
    def verify(
        self,
        full: bool = False,
        show_progress: bool = False,
        label: str = "verifying",
        seed: int | None = None,
        tensors: bool | None = None,
    ) -> VerifyReport:
        """Checks experts (a sample, or all with `full`) and, with `tensors` (default: `full`), every resident
        tensor (`full`: the kept ones too, which no start reads). The sample depends only on the file (its header
        checksum) unless `seed` picks another: a start (which checks the resident tensors as it loads them) and
        `tokenwing verify` check the same experts, so the one accepts exactly what the other does."""
        ex = self.index
        pairs = [(el.layer, e) for el in ex.layers for e in range(ex.n_expert)]
        if not full:
            rng = random.Random(seed if seed is not None else int(self.header.get(L.K_HEADER_CHECKSUM) or 0))
            pairs = _sample(pairs, ex, rng)
        with_tensors = full if tensors is None else tensors
        total = sum(ex.layer(layer).record_size for layer, _ in pairs)
        stored = [*self.resident, *self.kept] if full else self.resident
        if with_tensors:
            total += sum(t.nbytes for t in stored)
        progress = Progress(label, total, enabled=show_progress)
        n_tensors = 0
        if with_tensors:
            for info in stored:
                self._read_resident(info)
                progress.advance(info.nbytes)
                n_tensors += 1
        for layer, e in pairs:
            self.read_expert(layer, e)
            pause("verify")
            progress.advance(ex.layer(layer).record_size)
        seconds = progress.finish()
        return VerifyReport(len(pairs), n_tensors, progress.done, seconds)


def _sample(pairs: list[tuple[int, int]], ex: L.ExpertIndex, rng: random.Random) -> list[tuple[int, int]]:
    biggest = max(el.record_size for el in ex.layers)
    n = max(1, min(SAMPLE_EXPERTS, SAMPLE_BYTES // biggest, len(pairs)))
    return sorted(rng.sample(pairs, n))


def check_version(header: GGUFHeader) -> None:
    major = header.get(L.K_MAJOR)
    if major is None:
        raise BadInputError(
            f"{header.path} is not a TokenWing model file (a plain GGUF? convert it with `tokenwing repack`)"
        )
    if not isinstance(major, int) or major > L.FORMAT_MAJOR:
        raise UnsupportedError(
            f"{header.path} was written by a newer TokenWing (format {major}.x); "
            f"this version reads format {L.FORMAT_MAJOR}.x — please update"
        )
    if header.alignment != L.ALIGNMENT:
        raise CorruptModelError(f"{header.path}: alignment is {header.alignment}, expected {L.ALIGNMENT}")


def _check_header_checksum(header: GGUFHeader) -> None:
    stored = header.get(L.K_HEADER_CHECKSUM)
    pos = header.value_offsets.get(L.K_HEADER_CHECKSUM)
    if not isinstance(stored, int) or pos is None:
        raise CorruptModelError(f"{header.path}: the header has no checksum")
    with open(header.path, "rb") as f:
        raw = bytearray(f.read(header.data_start))
    if len(raw) != header.data_start:
        raise CorruptModelError(f"{header.path}: truncated header")
    raw[pos : pos + 8] = bytes(8)
    if xxhash.xxh3_64_intdigest(bytes(raw)) != stored:
        raise CorruptModelError(f"{header.path}: the header or index fails its checksum (corrupt file)")


def _array(header: GGUFHeader, key: str, length: int) -> np.ndarray:
    value = header.get(key)
    if not isinstance(value, np.ndarray) or value.size != length:
        raise CorruptModelError(f"{header.path}: index entry {key} is missing or has the wrong length")
    return value.astype(np.int64) if value.dtype != np.uint64 else value


def _load_index(header: GGUFHeader) -> L.ExpertIndex:
    """Rebuilds the expert index from the metadata and cross-checks it against the tensor table."""
    path = header.path
    arch = L.arch_of(header)
    n_expert, n_used = L.moe_counts(header, arch)
    if header.get(L.K_EXPERT_COUNT) != n_expert:
        raise CorruptModelError(f"{path}: the expert index and the metadata disagree on the expert count")
    n_res = header.get(L.K_RESIDENT_COUNT)
    if not isinstance(n_res, int) or not 0 <= n_res <= len(header.tensors):
        raise CorruptModelError(f"{path}: bad resident tensor count")
    layer_ids = header.get(L.K_EXPERT_LAYERS)
    if not isinstance(layer_ids, np.ndarray) or layer_ids.size == 0:
        raise CorruptModelError(f"{path}: the expert index lists no layers")
    n = int(layer_ids.size)
    offs = _array(header, L.K_LAYER_OFFSET, n)
    recs = _array(header, L.K_RECORD_SIZE, n)
    poffs = _array(header, L.K_PROJ_OFFSET, 3 * n).reshape(n, 3)
    psizes = _array(header, L.K_PROJ_SIZE, 3 * n).reshape(n, 3)
    checks = _array(header, L.K_EXPERT_CHECKSUMS, n * n_expert).reshape(n, n_expert).astype(np.uint64)
    _array(header, L.K_TENSOR_CHECKSUMS, n_res)
    kept = header.get(L.K_KEPT_COUNT)
    if kept is not None and kept != len(L.split_kept(header.tensors[:n_res], header)[1]):
        raise CorruptModelError(f"{path}: the kept tensors do not match {arch}.nextn_predict_layers")
    experts = header.tensors[n_res:]
    if len(experts) != 3 * n * n_expert:
        raise CorruptModelError(
            f"{path}: the tensor table holds {len(experts)} expert tensors, expected {3 * n * n_expert}"
        )
    layers: list[L.ExpertLayer] = []
    it = iter(experts)
    end = header.data_start
    for i in range(n):
        first: list[TensorInfo] = []
        el = L.ExpertLayer(
            int(layer_ids[i]),
            (0, 0, 0),
            ((0, 0), (0, 0), (0, 0)),
            (int(psizes[i, 0]), int(psizes[i, 1]), int(psizes[i, 2])),
            (int(poffs[i, 0]), int(poffs[i, 1]), int(poffs[i, 2])),
            int(recs[i]),
            int(offs[i]),
        )
        _check_layer_geometry(path, el, end)
        for e in range(n_expert):
            for p, proj in enumerate(L.PROJECTIONS):
                t = next(it)
                want = L.expert_tensor_name(el.layer, proj, e)
                at = header.data_start + t.offset
                if t.name != want or at != el.expert_offset(e) + el.proj_offset[p] or t.nbytes != el.proj_size[p]:
                    raise CorruptModelError(f"{path}: tensor {t.name} does not match the expert index")
                if e == 0:
                    first.append(t)
                elif (t.type, t.shape) != (first[p].type, first[p].shape):
                    raise CorruptModelError(f"{path}: experts of layer {el.layer} differ in type or shape")
        el.types = (first[0].type, first[1].type, first[2].type)
        el.shapes = tuple((t.shape[0], t.shape[1]) if len(t.shape) == 2 else (0, 0) for t in first)  # type: ignore[assignment]
        end = el.offset + el.record_size * n_expert
        layers.append(el)
    if end > header.file_size:
        raise CorruptModelError(f"{path}: the experts run past the end of the file (truncated file?)")
    return L.ExpertIndex(n_expert, n_used, layers, checks)


def _check_layer_geometry(path: str, el: L.ExpertLayer, min_offset: int) -> None:
    a = L.ALIGNMENT
    ok = el.offset % a == 0 and el.record_size % a == 0 and el.offset >= min_offset
    pos = 0
    for off, size in zip(el.proj_offset, el.proj_size, strict=True):
        ok = ok and off % a == 0 and off >= pos and size > 0
        pos = off + size
    if not ok or pos > el.record_size:
        raise CorruptModelError(f"{path}: the expert index of layer {el.layer} is inconsistent")
