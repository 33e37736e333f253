"""Compute devices, as ggml's backend registry sees them, and the one a run uses (`--device`, `--vram-budget`).

Enumeration goes through the registry (`ggml_backend_dev_*`) only: ggml's Vulkan backend catches a missing or
broken driver there, while `ggml_backend_vk_get_device_count()` aborts the process without one. CPU-type Vulkan
drivers (Mesa's lavapipe) are listed only when GGML_VK_VISIBLE_DEVICES names them, as ggml itself does, and
`auto` never picks one: lavapipe computes ~50× slower than ggml's CPU backend (field notes).

A device is used only after `probe` (compute/probe.py) has initialised it and run a small product on it in a
child process: a driver that aborts there costs the run its GPU, not the run itself.
"""

from __future__ import annotations

import argparse
import ctypes
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tokenwing.compute import ggml_api as ggml
from tokenwing.compute import ggml_lib
from tokenwing.fsutil import human_bytes, parse_size

KINDS = ("auto", "cpu", "vulkan", "cuda")
# Kept free on the device beyond the budget: the driver's own allocations and the compute buffers' growth, and
# what other programs (a desktop, a browser) take after we measured. 1/16 of the memory, 256 MiB to 1 GiB.
HEADROOM_MIN, HEADROOM_MAX = 256 << 20, 1 << 30
HEADROOM_DIVISOR = 16
# Under this the VRAM tier cannot hold a useful share of even a small model's always-used weights.
MIN_BUDGET = 256 << 20
_SOFTWARE = ("llvmpipe", "lavapipe", "swiftshader")


@dataclass(frozen=True)
class Device:
    """One device of ggml's registry."""

    index: int  # in the registry (ggml_backend_dev_get)
    kind: str  # "cpu", "vulkan", "cuda": the backend's name, lower case
    name: str  # ggml's: "CPU", "Vulkan0", "CUDA0"
    description: str  # "NVIDIA H200", "llvmpipe (LLVM 15.0.6, 256 bits)"
    type: str  # cpu, gpu, igpu or accel
    free: int
    total: int

    @property
    def software(self) -> bool:
        """A driver that computes on the CPU (lavapipe): slower than ggml's own CPU backend."""
        return any(s in self.description.lower() for s in _SOFTWARE)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "software": self.software}

    def label(self) -> str:
        return f"{self.name} ({self.description})"


def headroom(total: int) -> int:
    return min(HEADROOM_MAX, max(HEADROOM_MIN, total // HEADROOM_DIVISOR))


def list_devices() -> list[Device]:
    """Every device ggml can use here (the CPU first: its backend is loaded with ggml), with its memory now."""
    ggml_lib.start_registry_quietly()
    out = []
    for i in range(ggml.ggml_backend_dev_count()):
        d = ggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        ggml.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        reg = ggml.ggml_backend_dev_backend_reg(d)
        out.append(
            Device(
                index=i,
                kind=(ggml.ggml_backend_reg_name(reg) or b"?").decode(errors="replace").lower(),
                name=(ggml.ggml_backend_dev_name(d) or b"?").decode(errors="replace"),
                description=(ggml.ggml_backend_dev_description(d) or b"").decode(errors="replace").strip(),
                type=ggml.DEVICE_TYPES.get(int(ggml.ggml_backend_dev_type(d)), "other"),
                free=int(free.value),
                total=int(total.value),
            )
        )
    return out


def built_backends() -> list[str]:
    """Backends this ggml was built with (lower case), whether or not they found a device."""
    return ["cpu", *ggml.available_gpu_backends()]


@dataclass(frozen=True)
class DeviceOptions:
    """`--device` and `--vram-budget` as given on the command line (resolved by `choose`)."""

    device: str = "auto"
    vram_budget: str | None = None  # a size (8G) or a share of the VRAM free at start (80%)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DeviceOptions:
        return cls(getattr(args, "device", "auto") or "auto", getattr(args, "vram_budget", None))

    def check(self) -> None:
        """Rejects a malformed budget before anything is loaded (one line, exit code 2)."""
        if self.vram_budget is not None:
            parse_size(self.vram_budget, 1 << 30)


@dataclass(frozen=True)
class DeviceChoice:
    """Where a run computes: a device with a VRAM budget, or the CPU (device None); `reason` is the one line."""

    device: Device | None
    vram_budget: int
    reason: str

    @property
    def on_cpu(self) -> bool:
        return self.device is None


def resolve_budget(text: str | None, dev: Device) -> tuple[int, str]:
    """Bytes the VRAM tier may take on `dev`, and how they were reached."""
    if text is None:
        kept = headroom(dev.total)
        budget = max(0, dev.free - kept)
        return budget, f"{human_bytes(budget)} of {human_bytes(dev.free)} free ({human_bytes(kept)} kept)"
    budget = parse_size(text, dev.free)
    if budget > dev.free:
        return dev.free, f"--vram-budget {text} is more than the {human_bytes(dev.free)} free: using that"
    return budget, f"--vram-budget {text}: {human_bytes(budget)}"


def choose(
    options: DeviceOptions,
    devices: list[Device] | None,
    probe: Callable[[Device], str | None],
) -> DeviceChoice:
    """The device for this run: CUDA, else Vulkan, else the CPU (`auto`), or the one asked for. Never fails: no
    such device, a device that fails its probe, or too little VRAM all give the CPU, with the reason.

    `probe(device) -> str | None`: an error, or None when the device works (compute/probe.py's child process, as
    `probe.choose_device` passes it; the tests pass their own).
    """
    options.check()
    if options.device == "cpu":
        return DeviceChoice(None, 0, "computing on the CPU (--device cpu)")
    try:
        found = list_devices() if devices is None else devices
    except Exception as e:  # a registry that cannot even be listed: the CPU path is always there
        return DeviceChoice(None, 0, f"computing on the CPU: listing devices failed ({e})")
    gpus = [d for d in found if d.kind != "cpu"]
    if options.device == "auto":
        candidates = [d for d in gpus if d.kind == "cuda"] + [d for d in gpus if d.kind == "vulkan" and not d.software]
        if not candidates:
            return DeviceChoice(None, 0, "computing on the CPU: " + _why_none(gpus))
    else:
        candidates = [d for d in gpus if d.kind == options.device]
        if not candidates:
            why = (
                f"this engine was built without {options.device}"
                if options.device not in built_backends()
                else f"no {options.device} device found ({_driver_hint(options.device)})"
            )
            return DeviceChoice(None, 0, f"computing on the CPU: --device {options.device}: {why}")
    failures = []
    for dev in candidates:  # the first that works; most machines have one
        budget, how = resolve_budget(options.vram_budget, dev)
        # (a budget given on the command line is taken as it is: the tier's plan says whether it holds anything)
        if budget < (MIN_BUDGET if options.vram_budget is None else 1):
            failures.append(f"{dev.name} has too little VRAM ({how}; the tier needs {human_bytes(MIN_BUDGET)})")
            continue
        error = probe(dev)
        if error:
            failures.append(f"{dev.name} failed to start ({error})")
            continue
        why = "--device " + options.device if options.device != "auto" else f"auto: {_auto_why(dev)}"
        return DeviceChoice(dev, budget, f"computing on {dev.label()}, VRAM budget {how} ({why})")
    return DeviceChoice(None, 0, "computing on the CPU: " + "; ".join(failures))


def _auto_why(dev: Device) -> str:
    return "CUDA first" if dev.kind == "cuda" else "no CUDA device, Vulkan next"


def _why_none(gpus: list[Device]) -> str:
    if gpus:  # only software Vulkan drivers
        return "no GPU found (" + ", ".join(d.label() for d in gpus) + " computes on the CPU, slower than it)"
    built = [b for b in built_backends() if b != "cpu"]
    if not built:
        return "this engine was built for the CPU only"
    return "no GPU found (" + "; ".join(f"{b}: {_driver_hint(b)}" for b in built) + ")"


def _driver_hint(kind: str) -> str:
    if kind == "vulkan":
        return "no Vulkan driver with a GPU; a CPU-only driver shows only when GGML_VK_VISIBLE_DEVICES names it"
    if kind == "cuda":
        return "no NVIDIA driver or GPU"
    return "no device"
