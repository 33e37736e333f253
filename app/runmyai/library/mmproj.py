"""A vision model's image encoder, its `mmproj` GGUF (issue 45 item 5): downloaded from the model's repository with
its quant, kept beside the model's file (`<models>/<owner>/<repo>/mmproj-F16.gguf`), given to the engine with
`--mmproj` when the model is started, and deleted with the last model of its folder.

One encoder serves every quant of a repository (the text model's quant does not change it), so it is one file per
folder. Which of the repository's mmproj files: the preset's where it names one (`[gguf] mmproj`), else F16 (what
the publishers' model cards use), BF16, Q8_0, F32, then any.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from runmyai.engine.info import EngineInfo
from runmyai.library.downloads import DownloadManager
from runmyai.library.hub import HubClient, HubFile
from runmyai.library.presets import Preset
from runmyai.library.quants import is_mmproj

_PREFERRED = ("F16", "BF16", "Q8_0", "F32")


class MmprojError(Exception):
    """The encoder could not be fetched: one sentence (the model itself is in the library, for text)."""


def mmproj_beside(model: Path) -> Path | None:
    """The image encoder kept with a model: an mmproj GGUF in its folder (None: a text-only model)."""
    try:
        found = sorted(p for p in model.parent.iterdir() if p.is_file() and is_mmproj(p.name))
    except OSError:
        return None
    return found[0] if found else None


def mmproj_flags(model: Path, arch: str | None, engine: EngineInfo) -> list[str]:
    """`--mmproj FILE` for a model with an encoder beside it whose architecture the engine's server reads images
    for (`tokenwing info --json`'s `images`); nothing otherwise (the model chats in text)."""
    found = mmproj_beside(model)
    if found is None or arch is None or arch not in engine.image_architectures:
        return []
    return ["--mmproj", str(found)]


def choose_mmproj(files: Sequence[HubFile], preferred: str | None = None) -> HubFile | None:
    """The repository's mmproj file to download: `preferred` (a preset's name for it) where it is there, else
    the first of F16, BF16, Q8_0, F32 the names say, else the first; None for a repository without one."""
    candidates = [f for f in files if is_mmproj(f.path)]
    if preferred:
        named = [f for f in candidates if f.path.rsplit("/", 1)[-1] == preferred]
        if named:
            return named[0]
    for kind in _PREFERRED:
        pattern = re.compile(rf"(?<![A-Za-z0-9]){kind}(?![A-Za-z0-9])", re.IGNORECASE)
        for f in candidates:
            if pattern.search(f.path.rsplit("/", 1)[-1]):
                return f
    return candidates[0] if candidates else None


async def fetch_mmproj(downloads: DownloadManager, f: HubFile, folder: Path) -> Path:
    """Downloads the encoder into the model's folder (resumable and sha256-checked, as any download); a file
    already there at its size is kept."""
    dest = folder / f.path.rsplit("/", 1)[-1]
    if f.size is not None and dest.is_file() and dest.stat().st_size == f.size:
        return dest
    id_ = downloads.enqueue(f.repo, f.path, f.revision, f.sha256, f.size, dest=dest)
    status = await downloads.wait(id_)
    if status.state != "done":
        raise MmprojError(f"The image encoder {dest.name} did not download: {status.message}")
    return dest


async def get_mmproj(
    hub: HubClient, downloads: DownloadManager, repo: str, revision: str, folder: Path, presets: Sequence[Preset]
) -> Path | None:
    """A model's encoder from its repository into its folder (the preset's choice of file where one names the
    repository); None for a repository without one (a text model)."""
    files = await hub.list_files(repo, revision)
    named = next((p.gguf.mmproj for p in presets if p.gguf is not None and p.gguf.repo == repo), None)
    f = choose_mmproj(files, named)
    return await fetch_mmproj(downloads, f, folder) if f is not None else None


def remove_mmproj_with(model: Path) -> None:
    """After a model is deleted: its folder's encoder goes with the last model there (another quant keeps it)."""
    found = mmproj_beside(model)
    if found is None or any(model.parent.glob("*.tw.gguf")):
        return
    found.unlink(missing_ok=True)
