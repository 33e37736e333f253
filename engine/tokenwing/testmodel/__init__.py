"""Test-model factory: GGUFs of real MoE architectures with random weights, any size and quant type.

No hub is reachable from our machines, so tests and benchmarks make their own models.
"""

from tokenwing.testmodel.shapes import ModelShape, preset_shape
from tokenwing.testmodel.writer import write_test_model

__all__ = ["ModelShape", "preset_shape", "write_test_model"]
