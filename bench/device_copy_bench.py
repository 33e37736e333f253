"""Host→device copies of expert-sized blocks into a VRAM slot pool, from pinned and from ordinary memory, on every
device ggml shows: what one VRAM swap costs (the design swaps up to 64 experts every 8 tokens).

    python bench/device_copy_bench.py [--slot-mib 8] [--slots 64] [--rounds 3] [--json OUT]

Queued copies (`wait=False`, one synchronize per swap) against one blocking copy at a time. On lavapipe the
"device" is host memory: only a real GPU's numbers mean anything (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from tokenwing.compute import ggml_lib
from tokenwing.compute.backend import Backend, DeviceTensors, HostBuffer
from tokenwing.compute.devices import list_devices


def measure(backend: Backend, slot_bytes: int, n_slots: int, rounds: int) -> dict[str, float | bool]:
    pool = DeviceTensors(backend, 1)
    t = pool.new(ggml_lib.ops.GGML_TYPE_I8, (slot_bytes, 1, n_slots))
    pool.allocate()
    pinned = HostBuffer(backend, slot_bytes * n_slots)
    pinned.array[:] = 1
    plain = np.ones(slot_bytes * n_slots, np.uint8)
    out: dict[str, float | bool] = {"pinned_available": pinned.pinned}
    for name, base in (("pinned", pinned.address), ("plain", plain.ctypes.data)):
        for wait in (True, False):
            best = float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                for s in range(n_slots):
                    pool.set_slot(t, s, base + s * slot_bytes, wait=wait)
                backend.synchronize()
                best = min(best, time.perf_counter() - start)
            out[f"{name}_{'blocking' if wait else 'queued'}_gb_per_s"] = slot_bytes * n_slots / best / 1e9
    pinned.close()
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slot-mib", type=float, default=8)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    results = {}
    for dev in list_devices():
        if dev.kind == "cpu":
            continue
        backend = Backend(dev)
        r = measure(backend, int(a.slot_mib * (1 << 20)), a.slots, a.rounds)
        backend.close()
        results[f"{dev.name} ({dev.description})"] = r
        print(dev.name, dev.description, {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
    if a.json:
        with open(a.json + ".partial", "w") as f:
            json.dump(results, f, indent=2)
        os.replace(a.json + ".partial", a.json)


if __name__ == "__main__":
    main()
