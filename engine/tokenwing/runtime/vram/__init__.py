"""The VRAM tier: the layers, output head and hot experts a GPU holds (tier.py: how its parts fit together)."""

from tokenwing.runtime.vram.decode_experts import Launch
from tokenwing.runtime.vram.graphs import LayerGraph
from tokenwing.runtime.vram.prompt_waves import WAVE_MIN_TOKENS
from tokenwing.runtime.vram.source import FAIL_ENV
from tokenwing.runtime.vram.tier import VramOptions, VramTier
from tokenwing.runtime.vram.weights import Place, device_view

__all__ = ["FAIL_ENV", "WAVE_MIN_TOKENS", "Launch", "LayerGraph", "Place", "VramOptions", "VramTier", "device_view"]
