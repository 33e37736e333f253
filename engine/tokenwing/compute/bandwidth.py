"""Host↔device copy speed of a device, measured as the VRAM tier copies: expert-sized blocks between pinned host
memory (where the device has it) and a device buffer. What a swap or a prompt's GPU wave costs per byte
(`tokenwing autotune`; bench/device_copy_bench.py measures more shapes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenwing.compute import ggml_lib
from tokenwing.compute.backend import Backend, DeviceTensors, HostBuffer

ggml = ggml_lib.ops


@dataclass(frozen=True)
class CopySpeed:
    up_gb_per_s: float  # host → device
    down_gb_per_s: float  # device → host
    pinned: bool  # the host side was pinned memory

    def as_dict(self) -> dict[str, float | bool]:
        return {"up_gb_per_s": self.up_gb_per_s, "down_gb_per_s": self.down_gb_per_s, "pinned": self.pinned}


def copy_speed(backend: Backend, block: int = 4 << 20, blocks: int = 16, rounds: int = 3) -> CopySpeed:
    """The best of `rounds` copies of `blocks` blocks of `block` bytes each way (64 MiB by default)."""
    pool = DeviceTensors(backend, 1, weights=False)
    t = pool.new(ggml.GGML_TYPE_I8, (block, 1, blocks))
    pool.allocate()
    host = HostBuffer(backend, block * blocks)
    host.array[:] = 1
    try:
        best_up = best_down = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for s in range(blocks):
                pool.set_slot(t, s, host.address + s * block, wait=False)
            backend.synchronize()
            best_up = min(best_up, time.perf_counter() - start)
            start = time.perf_counter()
            ggml.ggml_backend_tensor_get(t, host.address, 0, block * blocks)
            best_down = min(best_down, time.perf_counter() - start)
        total = block * blocks
        return CopySpeed(total / best_up / 1e9, total / best_down / 1e9, host.pinned)
    finally:
        host.close()
        pool.close()
