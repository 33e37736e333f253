"""Run My AI: the desktop app around TokenWing (it talks to the engine only through its CLI and HTTP API)."""

from tokenwing.version import __version__

__all__ = ["__version__"]
