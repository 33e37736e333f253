"""Runs the device tests' graphs in ONE process, then the split (device + CPU) graph, N times over: on lavapipe
(Mesa 22.3.6) the split graph's compute crashes (SIGSEGV in lavapipe's worker thread) in about half of such runs,
while it never did in a fresh process (40 in a row). tests/compute runs it in a process of its own; this shows
whether a real driver does the same.

    python bench/split_stress.py [--runs 8] [--device NAME]     (prints "split: K of N runs crashed")
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_RUN = """
import sys
sys.path.insert(0, {root!r})
import tests.compute.conftest
from tests.compute import test_device_compute as T
from tokenwing.compute.backend import Backend
from tokenwing.compute.devices import list_devices
ds = list_devices()
gpu = Backend(next(d for d in ds if d.name == {name!r})); cpu = Backend(next(d for d in ds if d.kind == "cpu"))
for gt in (T.F32, T.Q8_0, T.Q4_K, T.MXFP4):
    T.test_mul_mat_matches_the_cpu_backend(gpu, cpu, gt)
T.test_expert_pool_in_vram_filled_from_a_ram_pool(gpu, cpu)
T.test_attention_block(gpu, cpu)
T.test_get_rows_and_top_k(gpu, cpu)
T.split_case({name!r})
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--device", help="a device name (default: every non-CPU device)")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    import tests.compute.conftest  # noqa: F401  (lavapipe visible where there is no GPU, as in the tests)
    from tokenwing.compute.devices import list_devices

    names = [a.device] if a.device else [d.name for d in list_devices() if d.kind != "cpu"]
    for name in names:
        crashed = 0
        for _ in range(a.runs):
            code = ONE_RUN.format(root=ROOT, name=name)
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
            crashed += r.returncode != 0 or not r.stdout.strip().endswith(b"ok")
        print(f"{name} split: {crashed} of {a.runs} runs crashed", flush=True)


if __name__ == "__main__":
    main()
