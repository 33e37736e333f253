"""Which device a run computes on (`--device`, `--vram-budget`): the rules on made-up device lists, then the
real registry and the real probe on this machine's devices (lavapipe without a GPU)."""

from __future__ import annotations

import pytest

from tests.compute.conftest import DEVICES, device
from tokenwing.compute.devices import Device, DeviceOptions, choose, headroom, list_devices, resolve_budget
from tokenwing.compute.probe import choose_device, probe_device
from tokenwing.errors import BadInputError

GiB = 1 << 30
CPU = Device(2, "cpu", "CPU", "Some CPU", "cpu", 32 * GiB, 64 * GiB)
CUDA = Device(0, "cuda", "CUDA0", "NVIDIA GeForce RTX 4090", "gpu", 22 * GiB, 24 * GiB)
VULKAN = Device(1, "vulkan", "Vulkan0", "AMD Radeon RX 7900 XTX (RADV NAVI31)", "gpu", 20 * GiB, 24 * GiB)
LAVAPIPE = Device(1, "vulkan", "Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "gpu", 2 * GiB, 2 * GiB)


def works(_: Device) -> str | None:
    return None


def test_auto_prefers_cuda_then_a_vulkan_gpu_then_the_cpu() -> None:
    c = choose(DeviceOptions(), [VULKAN, CUDA, CPU], works)
    assert c.device == CUDA and "CUDA first" in c.reason
    c = choose(DeviceOptions(), [VULKAN, CPU], works)
    assert c.device == VULKAN and "Vulkan next" in c.reason
    c = choose(DeviceOptions(), [CPU], works)
    assert c.on_cpu and c.reason.startswith("computing on the CPU: ")


def test_auto_never_picks_a_software_vulkan_driver() -> None:
    c = choose(DeviceOptions(), [LAVAPIPE, CPU], works)
    assert c.on_cpu and "llvmpipe" in c.reason and "slower" in c.reason
    assert LAVAPIPE.software and not VULKAN.software
    c = choose(DeviceOptions("vulkan"), [LAVAPIPE, CPU], works)  # asked for by name: used
    assert c.device == LAVAPIPE


def test_a_device_that_fails_its_probe_gives_the_next_or_the_cpu() -> None:
    def cuda_broken(d: Device) -> str | None:
        return "the driver crashed (signal 6)" if d.kind == "cuda" else None

    c = choose(DeviceOptions(), [CUDA, VULKAN, CPU], cuda_broken)
    assert c.device == VULKAN
    c = choose(DeviceOptions("cuda"), [CUDA, VULKAN, CPU], cuda_broken)
    assert c.on_cpu and "CUDA0 failed to start (the driver crashed (signal 6))" in c.reason


def test_asking_for_a_missing_backend_gives_the_cpu_with_the_reason() -> None:
    c = choose(DeviceOptions("cuda"), [VULKAN, CPU], works)
    assert c.on_cpu and "--device cuda" in c.reason
    assert choose(DeviceOptions("cpu"), [CUDA, CPU], works).reason == "computing on the CPU (--device cpu)"


def test_vram_budget() -> None:
    free = CUDA.free
    assert headroom(24 * GiB) == GiB and headroom(2 * GiB) == 256 << 20 and headroom(8 * GiB) == 512 << 20
    assert resolve_budget(None, CUDA)[0] == free - GiB
    assert resolve_budget("50%", CUDA)[0] == free // 2
    assert resolve_budget("8G", CUDA)[0] == 8 * GiB
    budget, how = resolve_budget("64G", CUDA)
    assert budget == free and "more than" in how
    c = choose(DeviceOptions("auto", "16G"), [CUDA, CPU], works)
    assert c.vram_budget == 16 * GiB and "16G" in c.reason
    for bad in ("lots", "-1G", "150%", "inf"):
        with pytest.raises(BadInputError, match="not a size"):
            choose(DeviceOptions("auto", bad), [CUDA, CPU], works)


def test_too_little_vram_gives_the_cpu() -> None:
    """Below MIN_BUDGET free the device is left alone; a budget given on the command line is the VRAM tier's plan
    to judge (it knows what the model needs), except nothing at all."""
    c = choose(DeviceOptions("auto", "0"), [CUDA, CPU], works)
    assert c.on_cpu and "too little VRAM" in c.reason
    c = choose(DeviceOptions("auto", "100M"), [CUDA, CPU], works)
    assert not c.on_cpu and c.vram_budget == 100 << 20
    small = Device(0, "cuda", "CUDA0", "NVIDIA GeForce GT 710", "gpu", 300 << 20, 1 * GiB)
    c = choose(DeviceOptions(), [small, CPU], works)  # 300 MiB free less 256 MiB kept
    assert c.on_cpu and "too little VRAM" in c.reason


def test_registry_lists_the_cpu_and_each_device_with_memory() -> None:
    found = list_devices()
    assert [d.kind for d in found].count("cpu") == 1
    for d in found:
        assert d.total > 0 and 0 <= d.free <= d.total and d.name and d.type in ("cpu", "gpu", "igpu", "accel")
    assert [d.name for d in found if d.kind != "cpu"] == DEVICES


@pytest.mark.parametrize("name", DEVICES)
def test_the_real_probe_passes_on_a_working_device(name: str) -> None:
    assert probe_device(device(name)) is None
    c = choose_device(DeviceOptions(device(name).kind))
    assert c.device is not None and c.device.name == name and c.vram_budget >= 256 << 20
