"""TokenWing: an inference engine that streams the routed experts of MoE models from NVMe."""

from tokenwing.version import __version__

__all__ = ["__version__"]
