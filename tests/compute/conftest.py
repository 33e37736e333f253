"""Devices for the device tests: every non-CPU device ggml shows here, each checked against ggml's CPU backend.

Without a GPU that is Mesa's lavapipe, which ggml shows only when GGML_VK_VISIBLE_DEVICES names it; its fp16
path rounds to ~1 % (field notes), so GGML_VK_DISABLE_F16 is set too. Both are set before anything here lists
devices (ggml reads them once, when its registry starts), and only where the caller has not chosen already
(bench/gpu_check.sh sets TOKENWING_TEST_VK_DEFAULT=1 on a GPU machine: ggml then shows its GPUs only).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

if not os.environ.get("TOKENWING_TEST_VK_DEFAULT"):  # bench/gpu_check.sh: ggml's own choice (the real GPUs)
    os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
os.environ.setdefault("GGML_VK_DISABLE_F16", "1")

from tokenwing.compute.backend import Backend
from tokenwing.compute.devices import Device, built_backends, list_devices


def device_names() -> list[str]:
    return [d.name for d in list_devices() if d.kind != "cpu"]


DEVICES = device_names()


@pytest.fixture(scope="module", params=DEVICES or ["none"])
def gpu(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Each device ggml shows (lavapipe here); none is a failure where ggml has a GPU backend built in."""
    if request.param == "none":
        if len(built_backends()) == 1:
            pytest.skip("ggml was built for the CPU only (./dev builds Vulkan where apt-get works as root)")
        pytest.fail(f"ggml has {built_backends()} but shows no device: is mesa-vulkan-drivers (lavapipe) installed?")
    b = Backend(device(request.param))
    yield b
    b.close()


def device(name: str) -> Device:
    return next(d for d in list_devices() if d.name == name)


@pytest.fixture(scope="module")
def cpu() -> Iterator[Backend]:
    """ggml's CPU backend through the same API: the reference every device is compared with."""
    b = Backend(next(d for d in list_devices() if d.kind == "cpu"))
    yield b
    b.close()


# Tests marked `own_process` run in a pytest child of their own. lavapipe (Mesa 22.3.6) crashed in its queue thread
# (SIGSEGV, or a corrupted heap) at a VRAM tier session's first graph once the device compute tests had run in the
# same process, and only then — with or without Khronos' validation layer, which reports nothing — so the sessions'
# tests keep to processes of their own, where they ran clean every time (docs/results.md).
CHILD_ENV = "TOKENWING_TEST_IN_CHILD"


def _run_in_child(item: pytest.Item) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", item.nodeid]
    r = subprocess.run(
        cmd, cwd=item.config.rootpath, env={**os.environ, CHILD_ENV: "1"}, capture_output=True, text=True, check=False
    )
    tail = (r.stdout + r.stderr)[-4000:]
    if r.returncode == 0 and " skipped" in r.stdout and " passed" not in r.stdout:
        pytest.skip(f"in its own process: {tail.strip().splitlines()[-1]}")
    if r.returncode != 0:
        pytest.fail(f"in its own process (exit {r.returncode}):\n{tail}", pytrace=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get(CHILD_ENV):
        return
    for item in items:
        if item.get_closest_marker("own_process") is not None:
            item.runtest = functools.partial(_run_in_child, item)  # type: ignore[method-assign]
