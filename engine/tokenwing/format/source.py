"""A source GGUF model, single file or llama.cpp split shards (`-00001-of-0000N.gguf`), as one tensor table."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import GGUFHeader, TensorInfo, read_header

_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass
class SourceTensor:
    info: TensorInfo
    path: str
    file_offset: int  # absolute offset of the tensor's data in `path`


@dataclass
class SourceModel:
    paths: list[str]
    header: GGUFHeader  # the first shard's: it carries the metadata
    tensors: list[SourceTensor]

    @property
    def size(self) -> int:
        return sum(os.path.getsize(p) for p in self.paths)

    def infos(self) -> list[TensorInfo]:
        return [t.info for t in self.tensors]

    def by_name(self) -> dict[str, SourceTensor]:
        return {t.info.name: t for t in self.tensors}


def expand_shards(paths: list[str]) -> list[str]:
    """A single `-00001-of-0000N.gguf` path stands for all of its shards, which must all exist."""
    if len(paths) != 1:
        return paths
    m = _SHARD_RE.match(paths[0])
    if not m:
        return paths
    count = int(m.group("count"))
    expected = [f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [p for p in expected if not os.path.exists(p)]
    if missing:
        near = sorted(glob.glob(glob.escape(m.group("stem")) + "-*-of-*.gguf"))
        hint = f" (found {len(near)} shard files)" if near else ""
        raise BadInputError(f"split model is missing {os.path.basename(missing[0])}{hint}")
    return expected


def open_source(paths: list[str]) -> SourceModel:
    paths = expand_shards(paths)
    headers = [read_header(p) for p in paths]
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
        headers.sort(key=lambda h: h.get("split.no"))
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
    return SourceModel([h.path for h in headers], first, tensors)
