"""Does a device work? Asked in a child process before the engine uses it.

ggml's Vulkan backend throws C++ exceptions out of `ggml_backend_dev_init` when the driver fails to create the
device (std::terminate: the process aborts), and broken drivers also crash at their first compute. The child
initialises the device, uploads a Q8_0 matrix, multiplies it on the device and checks the product: any failure
there — an error, an abort, a hang — costs the engine its GPU, never the run.

Test hook (a fault a real driver cannot be made to produce on demand): TOKENWING_TEST_DEVICE_FAULT=abort makes the
child abort where the driver would, =hang makes it stop answering.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tokenwing.compute import ggml_lib
from tokenwing.compute.backend import Backend, DeviceError, DeviceGraph, DeviceTensors
from tokenwing.compute.devices import Device, DeviceChoice, DeviceOptions, choose, list_devices

ARG = "__device_probe"  # `tokenwing __device_probe NAME` (the frozen engine has no `-m`)
FAULT_ENV = "TOKENWING_TEST_DEVICE_FAULT"
# lavapipe compiles each shader on first use (up to ~1.3 s each, field notes); a real GPU answers in well under 5 s.
TIMEOUT_S = 60.0


def _command(name: str) -> list[str]:
    if getattr(sys, "frozen", False):
        return [sys.executable, ARG, name]
    return [sys.executable, "-m", "tokenwing", ARG, name]


def probe_device(device: Device, timeout: float = TIMEOUT_S) -> str | None:
    """None when `device` initialises and computes correctly in a child process, else why not (one phrase)."""
    try:
        r = subprocess.run(_command(device.name), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:.0f} s"
    except OSError as e:
        return f"could not start the probe: {e}"
    if r.returncode == 0:
        return None
    last = (r.stdout.strip().splitlines() or r.stderr.strip().splitlines() or [""])[-1]
    if r.returncode < 0:
        return f"the driver crashed (signal {-r.returncode})" + (f": {last}" if last else "")
    return last or f"exit code {r.returncode}"


def choose_device(options: DeviceOptions, devices: list[Device] | None = None) -> DeviceChoice:
    """`devices.choose` with each candidate probed in a child process (the engine's choice of device)."""
    return choose(options, devices, probe_device)


def run_probe(name: str) -> int:
    """The child's side: 0 when the device named `name` computes a Q8_0 product right."""
    ggml = ggml_lib.ops
    fault = os.environ.get(FAULT_ENV, "")
    dev = next((d for d in list_devices() if d.name == name), None)
    if dev is None:
        print(f"{name} is not in ggml's device list")
        return 1
    if fault == "abort":
        os.abort()
    if fault == "hang":
        import time

        time.sleep(1e6)
    try:
        backend = Backend(dev)
        k, n = 64, 16
        w = (np.arange(n * k, dtype=np.float32).reshape(n, k) % 7 - 3) / 4
        weights = DeviceTensors(backend, 1)
        wt = weights.new(ggml.GGML_TYPE_Q8_0, (k, n))
        weights.allocate()
        q = ggml_lib.quantize(w, ggml.GGML_TYPE_Q8_0)
        weights.set(wt, q)
        g = DeviceGraph(backend, 16)
        x = g.input(ggml_lib.F32, (k, 1))
        y = ggml.ggml_mul_mat(g.ctx, wt, x)
        g.finish(y)
        xs = np.ones((1, k), np.float32)
        g.set(x, xs)
        g.compute()
        got = g.get(y)
        want = ggml_lib.dequantize(q, ggml.GGML_TYPE_Q8_0, n, k).sum(axis=1)  # ones: exact in any activation type
        if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
            print(f"a test product came out wrong (off by {float(np.abs(got - want).max()):.3g})")
            return 1
        g.close()
        weights.close()
        backend.close()
    except DeviceError as e:
        print(str(e))
        return 1
    return 0
