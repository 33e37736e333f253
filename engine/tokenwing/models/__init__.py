"""One module per architecture family: how its weights map and how a layer computes (no I/O here)."""

from __future__ import annotations


def supported_architectures() -> list[str]:
    """The GGUF architecture names this engine runs."""
    from tokenwing.models.qwen3moe import FAMILIES

    return sorted(FAMILIES)
