"""Typed keys for what the library lists: an installed file, a catalog preset, a hub repository (and a quant).

The widgets carry keys as text (`local:/path`, `preset:id`, `hub:owner/name`, `hub:owner/name:Q4_K_M`); this is
the one place that writes and reads that text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LocalKey:
    path: Path

    def __str__(self) -> str:
        return f"local:{self.path}"


@dataclass(frozen=True)
class PresetKey:
    id: str

    def __str__(self) -> str:
        return f"preset:{self.id}"


@dataclass(frozen=True)
class HubKey:
    repo: str
    quant: str | None = None  # None: the repository (the best quant is chosen when downloading)

    def __str__(self) -> str:
        return f"hub:{self.repo}" + (f":{self.quant}" if self.quant else "")


LibraryKey = LocalKey | PresetKey | HubKey


def parse_key(text: str) -> LibraryKey | None:
    """The key a widget sent back; None for text that is not one (a widget never makes such text)."""
    kind, sep, rest = text.partition(":")
    if not sep or not rest:
        return None
    if kind == "local":
        return LocalKey(Path(rest))
    if kind == "preset":
        return PresetKey(rest)
    if kind == "hub":
        repo, _, quant = rest.partition(":")
        return HubKey(repo, quant or None) if repo.count("/") == 1 else None
    return None


def parse_model_ref(text: str) -> HubKey:
    """`owner/name[:QUANT]` as typed on the command line (`runmyai get`); ValueError when it is not one."""
    repo, _, quant = text.strip().partition(":")
    owner, slash, name = repo.partition("/")
    if not slash or not owner or not name or "/" in name:
        raise ValueError(f"“{text}” is not a repository (expected owner/name, optionally :QUANT)")
    return HubKey(repo, quant.strip() or None)
