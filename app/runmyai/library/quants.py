"""The quants of a GGUF repository: which files form one model, at which quant, and how big it is.

Real GGUF repositories hold a dozen quants of one model, most of them split by llama.cpp's gguf-split into
`NAME-00001-of-000NN.gguf` shards, the larger ones in a sub-folder per quant (`Q4_K_M/NAME-Q4_K_M-00001-of-…`).
Downloading "the model" means one quant's shards, never the repository: for DeepSeek-V3 the repository is
several terabytes. Pure functions over the hub's file listing (`HubClient.list_files`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runmyai.library.hub import HubFile

_SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# llama.cpp's type names as they appear in file names (unsloth's dynamic "UD-" quants included); the longest
# alternatives first so that Q4_K_M is not read as Q4_K.
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])(?P<q>(?:UD-)?(?:IQ\d_(?:XXS|XS|S|M|NL|K_[SMLX]L?)|IQ\d_[A-Z]+|Q\d_K_(?:XL|[SML])|Q\d_K"
    r"|Q\d_\d|TQ\d_\d|MXFP4(?:_MOE)?|BF16|F16|F32))(?![A-Za-z0-9])",
    re.IGNORECASE,
)
# Files that are GGUFs but not a model to chat with: vision projectors, imatrix data, LoRA adapters.
_NOT_A_MODEL = re.compile(r"(?:^|[-_./])(?:mmproj|imatrix|lora|adapter)(?:[-_./]|$)", re.IGNORECASE)
_MMPROJ = re.compile(r"(?:^|[-_.])mmproj(?:[-_.]|$)", re.IGNORECASE)


def is_mmproj(path: str) -> bool:
    """A vision model's image encoder (`mmproj-F16.gguf`, `mmproj-Qwen3VL-30B-A3B-Instruct-F16.gguf`): a GGUF the
    library keeps beside the model (library/mmproj.py), never a model of its own."""
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and _MMPROJ.search(name) is not None


@dataclass(frozen=True)
class Quant:
    """One downloadable model in a repository: its shards in order (one file when not split)."""

    name: str  # "Q4_K_M", "UD-Q2_K_XL", or the file stem when no quant name is recognised
    files: tuple[HubFile, ...]

    @property
    def size(self) -> int | None:
        """Bytes of all shards; None when the hub did not say the size of one."""
        sizes = [f.size for f in self.files]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)

    @property
    def largest_shard(self) -> int:
        return max((f.size or 0 for f in self.files), default=0)

    @property
    def first(self) -> HubFile:
        return self.files[0]

    @property
    def split(self) -> bool:
        return len(self.files) > 1


class QuantError(ValueError):
    """A repository whose files cannot be read as quants (one sentence)."""


def quant_name(path: str) -> str | None:
    """The quant type named in a file's path (its name first, then its folder), upper-case; None if none."""
    name = path.rsplit("/", 1)[-1]
    for text in (name, path):
        found = _QUANT.findall(text)
        if found:
            return str(found[-1]).upper().replace("UD-", "UD-")
    return None


def group_quants(files: list[HubFile] | tuple[HubFile, ...]) -> list[Quant]:
    """The repository's quants, smallest first. A split set must be complete (`-00001-of-N` … `-N-of-N`, each
    once); an incomplete set is left out (it cannot be run), as are projector and imatrix files."""
    singles: list[HubFile] = []
    sets: dict[tuple[str, int], dict[int, HubFile]] = {}
    for f in files:
        if not f.path.endswith(".gguf") or f.path.endswith(".tw.gguf") or _NOT_A_MODEL.search(f.path):
            continue
        m = _SHARD.match(f.path)
        if m is None:
            singles.append(f)
            continue
        count, no = int(m.group("count")), int(m.group("no"))
        if not 1 <= no <= count:
            continue
        sets.setdefault((m.group("stem"), count), {})[no] = f
    quants = [Quant(quant_name(f.path) or _stem(f.path), (f,)) for f in singles]
    for (stem, count), shards in sets.items():
        if sorted(shards) != list(range(1, count + 1)):
            continue  # a missing shard: not a usable model
        ordered = tuple(shards[i] for i in range(1, count + 1))
        quants.append(Quant(quant_name(ordered[0].path) or _stem(stem + ".gguf"), ordered))
    # two files naming the same quant (e.g. a model and its "-imat" twin): tell them apart by their stem
    names = [q.name for q in quants]
    quants = [
        q if names.count(q.name) == 1 else Quant(_stem(_SHARD.sub(r"\g<stem>.gguf", q.first.path)), q.files)
        for q in quants
    ]
    return sorted(quants, key=lambda q: (q.size is None, q.size or 0, q.name))


def find_quant(quants: list[Quant], wanted: str) -> Quant:
    """The quant called `wanted` (case-insensitive; a unique prefix such as "Q4_K" for "Q4_K_M" also works)."""
    w = wanted.strip().upper()
    exact = [q for q in quants if q.name.upper() == w]
    if exact:
        return exact[0]
    partial = [q for q in quants if q.name.upper().startswith(w)]
    if len(partial) == 1:
        return partial[0]
    names = ", ".join(q.name for q in quants) or "none"
    if partial:
        raise QuantError(f"“{wanted}” matches several quants ({', '.join(q.name for q in partial)}); pick one.")
    raise QuantError(f"This repository has no quant “{wanted}” (it has: {names}).")


def _stem(path: str) -> str:
    return path.rsplit("/", 1)[-1].removesuffix(".gguf")
