"""A source GGUF model, single file or llama.cpp split shards (`-00001-of-0000N.gguf`), as one tensor table.

The shards may also be named by a manifest (`tokenwing repack --shards MANIFEST.json`): each shard's path, its
size and, for a shard not downloaded yet, a file with its first bytes (its header, fetched with a range
request), so that a model can be planned before its data exists and repacked shard by shard as it arrives.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field

from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import MAX_HEADER, GGUFHeader, TensorInfo, TruncatedHeaderError, read_header
from tokenwing.format.validate import check_header

_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass
class SourceTensor:
    info: TensorInfo
    path: str
    file_offset: int  # absolute offset of the tensor's data in `path`
    expert_stride: int = 0  # bytes from one expert's data to the next (0: the expert's size; layout.merged_stride)

    def expert_offset(self, expert: int, size: int) -> int:
        """Where the `size` bytes of one expert of this expert tensor start in `path`."""
        return self.file_offset + expert * (self.expert_stride or size)


@dataclass
class SourceModel:
    paths: list[str]
    header: GGUFHeader  # the first shard's: it carries the metadata
    tensors: list[SourceTensor]
    sizes: list[int] = field(default_factory=list)  # per shard, in `paths` order (from the files when empty)
    header_bytes: list[int] = field(default_factory=list)  # per shard: where its tensor data starts

    @property
    def size(self) -> int:
        return sum(self.shard_sizes())

    def shard_sizes(self) -> list[int]:
        return self.sizes if self.sizes else [os.path.getsize(p) for p in self.paths]

    def infos(self) -> list[TensorInfo]:
        return [t.info for t in self.tensors]

    def by_name(self) -> dict[str, SourceTensor]:
        return {t.info.name: t for t in self.tensors}


def expand_shard_names(paths: list[str]) -> list[str]:
    """A single `-00001-of-0000N.gguf` path stands for all of its shards (which may not all exist)."""
    if len(paths) != 1:
        return paths
    m = _SHARD_RE.match(paths[0])
    if not m:
        return paths
    count = int(m.group("count"))
    return [f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def expand_shards(paths: list[str]) -> list[str]:
    """A single `-00001-of-0000N.gguf` path stands for all of its shards, which must all exist."""
    expected = expand_shard_names(paths)
    if expected == paths:
        return paths
    m = _SHARD_RE.match(paths[0])
    assert m is not None
    missing = [p for p in expected if not os.path.exists(p)]
    if missing:
        near = sorted(glob.glob(glob.escape(m.group("stem")) + "-*-of-*.gguf"))
        hint = f" (found {len(near)} shard files)" if near else ""
        raise BadInputError(f"split model is missing {os.path.basename(missing[0])}{hint}")
    return expected


@dataclass(frozen=True)
class ManifestShard:
    path: str  # where the shard is (or will be, once downloaded)
    size: int
    header: str | None  # a file with the shard's first bytes, for when `path` is not there yet

    @property
    def present(self) -> bool:
        """The whole shard is at `path` (a downloader renames a shard into place only once it is complete)."""
        try:
            return os.path.getsize(self.path) == self.size
        except OSError:
            return False


def read_manifest(path: str) -> list[ManifestShard]:
    """`{"shards": [{"path": …, "size": …, "header": … or null}, …]}`, checked; relative paths are relative to
    the manifest's folder."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise BadInputError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError:
        raise BadInputError(f"{path}: not a JSON shard manifest") from None
    shards = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(shards, list) or not shards:
        raise BadInputError(f'{path}: no shards listed (expected {{"shards": [...]}})')
    base = os.path.dirname(os.path.abspath(path))
    out: list[ManifestShard] = []
    for i, entry in enumerate(shards):
        p, size, header = (entry.get(k) for k in ("path", "size", "header")) if isinstance(entry, dict) else [None] * 3
        if not isinstance(p, str) or not p or isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise BadInputError(f"{path}: shard {i + 1} needs a path and a positive size")
        if header is not None and not isinstance(header, str):
            raise BadInputError(f"{path}: shard {i + 1}: header must be a path or null")
        out.append(
            ManifestShard(os.path.join(base, p), size, os.path.join(base, header) if header is not None else None)
        )
    if len({s.path for s in out}) != len(out):
        raise BadInputError(f"{path}: a shard is listed twice")
    return out


class HeadersIncomplete(BadInputError):
    """Header files that end inside their header: fetch more of those shards' first bytes."""

    def __init__(self, shards: list[int], paths: list[str]) -> None:
        names = ", ".join(os.path.basename(paths[i]) for i in shards)
        super().__init__(f"the header files of {names} end inside the header: fetch more of their first bytes")
        self.shards = shards


def open_manifest(shards: list[ManifestShard]) -> SourceModel:
    """The model the shards form, from each shard's own header when it is there, else from its header file
    (HeadersIncomplete names the shards whose header file was cut too short)."""
    headers: list[GGUFHeader] = []
    short: list[int] = []
    for i, s in enumerate(shards):
        if s.present:
            headers.append(read_header(s.path))
            continue
        if s.header is None:
            raise BadInputError(f"{s.path} is not there yet and the manifest gives no header file for it")
        try:
            h = read_header(s.header, declared_size=s.size)
        except TruncatedHeaderError:
            if os.path.getsize(s.header) >= min(s.size, MAX_HEADER):
                raise
            short.append(i)
            continue
        h.path = s.path  # tensors are read from the shard itself once it arrives
        headers.append(h)
    if short:
        raise HeadersIncomplete(short, [s.path for s in shards])
    sizes = {s.path: s.size for s in shards}
    return _assemble(headers, [sizes[h.path] for h in headers])


def open_source(paths: list[str]) -> SourceModel:
    paths = expand_shards(paths)
    return _assemble([read_header(p) for p in paths], [])


def _assemble(headers: list[GGUFHeader], sizes: list[int]) -> SourceModel:
    paths = [h.path for h in headers]
    first = headers[0]
    count = first.get("split.count")
    if count is None:
        if len(paths) > 1:
            raise BadInputError(f"{paths[0]} is not part of a split model, but {len(paths)} files were given")
    else:
        if count != len(paths):
            raise BadInputError(f"{paths[0]}: the split model has {count} shards but {len(paths)} were given")
        order = [h.get("split.no") for h in headers]
        if sorted(order) != list(range(count)):
            raise BadInputError(f"shards do not form one split model (split.no {order})")
        if sizes:
            by_path = dict(zip(paths, sizes, strict=True))
        headers.sort(key=lambda h: h.get("split.no"))
        if sizes:
            sizes = [by_path[h.path] for h in headers]
        first = headers[0]
    tensors: list[SourceTensor] = []
    seen: set[str] = set()
    for h in headers:
        for t in h.tensors:
            if t.name in seen:
                raise BadInputError(f"tensor {t.name!r} appears in more than one shard")
            seen.add(t.name)
            tensors.append(SourceTensor(t, h.path, h.data_start + t.offset))
    declared = first.get("split.tensors.count")
    if declared is not None and declared != len(tensors):
        raise BadInputError(f"split model declares {declared} tensors but its shards hold {len(tensors)}")
    check_header(first, [t.info for t in tensors])  # before anything is planned from its numbers
    return SourceModel([h.path for h in headers], first, tensors, sizes, [h.data_start for h in headers])
