"""Test-model factory: GGUFs of real MoE architectures with random weights, any size and quant type.

No hub is reachable from our machines, so tests and benchmarks make their own models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenwing.testmodel.shapes import ModelShape, preset_shape

if TYPE_CHECKING:
    from tokenwing.testmodel.writer import write_test_model

__all__ = ["ModelShape", "preset_shape", "write_test_model"]


def __getattr__(name: str) -> Any:
    if name == "write_test_model":
        # (the writer imports numpy, the GGUF writer and every family's module, over a second; the shapes alone,
        # which `tokenwing testmodel`'s flags read at every start, take milliseconds: lazy)
        from tokenwing.testmodel.writer import write_test_model

        return write_test_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
