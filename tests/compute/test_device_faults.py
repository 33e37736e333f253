"""Device faults give the CPU path with one line, never a crash: no Vulkan driver, a broken one, a driver that
fails at init, a device that aborts or hangs in the probe, too little VRAM. `tokenwing info` works throughout.

The loader is pointed at other driver manifests with VK_DRIVER_FILES (and VK_ICD_FILENAMES, its older name)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compute.conftest import DEVICES, device
from tests.conftest import ModelFactory, run_cli
from tokenwing.compute.devices import DeviceOptions, built_backends
from tokenwing.compute.probe import FAULT_ENV, choose_device, probe_device

needs_vulkan = pytest.mark.skipif("vulkan" not in built_backends(), reason="ggml was built without Vulkan")


def _point_loader_at(monkeypatch: pytest.MonkeyPatch, manifests: Path) -> None:
    monkeypatch.setenv("VK_DRIVER_FILES", str(manifests))
    monkeypatch.setenv("VK_ICD_FILENAMES", str(manifests))


def _broken_driver(tmp_path: Path, library: str) -> Path:
    """A driver manifest whose library is not a Vulkan driver (or not there)."""
    d = tmp_path / "icd.d"
    d.mkdir()
    manifest = {"file_format_version": "1.0.0", "ICD": {"library_path": library, "api_version": "1.3.0"}}
    (d / "broken.json").write_text(json.dumps(manifest))
    return d


def _info_devices() -> list[dict[str, object]]:
    r = run_cli("info", "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    devices: list[dict[str, object]] = json.loads(r.stdout)["devices"]
    assert devices[0]["kind"] == "cpu"
    return devices


@needs_vulkan
@pytest.mark.parametrize("driver", ["none", "not a driver", "missing library"])
def test_no_working_vulkan_driver(driver: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if driver == "none":
        manifests = tmp_path / "empty"
        manifests.mkdir()
    else:
        manifests = _broken_driver(tmp_path, "libc.so.6" if driver == "not a driver" else str(tmp_path / "nope.so"))
    _point_loader_at(monkeypatch, manifests)
    assert [d["kind"] for d in _info_devices()] == ["cpu"]
    r = run_cli("info")
    assert r.returncode == 0 and "device: CPU" in r.stdout


@needs_vulkan
def test_vulkan_failing_at_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """ggml's Vulkan start throws (here: a device index that does not exist); the registry leaves Vulkan out."""
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "9")
    assert [d["kind"] for d in _info_devices()] == ["cpu"]


def test_info_lists_each_device_with_its_memory() -> None:
    devices = _info_devices()
    assert [d["name"] for d in devices if d["kind"] != "cpu"] == DEVICES
    for d in devices:
        assert isinstance(d["total"], int) and isinstance(d["free"], int) and 0 < d["free"] <= d["total"]


@pytest.mark.parametrize("name", DEVICES)
def test_a_device_that_crashes_or_hangs_in_the_probe(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Test hook: the probe's child aborts (as a driver does on a C++ exception) or stops answering."""
    monkeypatch.setenv(FAULT_ENV, "abort")
    error = probe_device(device(name))
    assert error is not None and "crashed (signal 6)" in error
    c = choose_device(DeviceOptions(device(name).kind))
    assert c.on_cpu and f"{name} failed to start (the driver crashed (signal 6))" in c.reason
    monkeypatch.setenv(FAULT_ENV, "hang")
    assert probe_device(device(name), timeout=3) == "no answer within 3 s"


@needs_vulkan
def test_engine_runs_on_the_cpu_with_one_line(
    repacked_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = str(repacked_factory(type="Q8_0", n_layer=2))
    r = run_cli("run", model, "--prompt", "Hi", "-n", "2", "--device", "vulkan", "--vram-budget", "1M")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "computing on" in ln]
    assert len(lines) == 1 and "computing on the CPU: the VRAM budget 1.00 MiB holds not even one layer" in lines[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    _point_loader_at(monkeypatch, empty)
    r = run_cli("run", model, "--prompt", "Hi", "-n", "2", "--device", "vulkan")
    assert r.returncode == 0, r.stderr
    assert "computing on the CPU: --device vulkan: no vulkan device found" in r.stderr
