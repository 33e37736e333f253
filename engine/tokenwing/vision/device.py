"""Where an image encoder computes (issue 45 item 6): its graph through a ggml backend, on the GPU of the VRAM tier
when the tier has room left for the encoder's weights and its compute buffer for the largest image, else on the
CPU; and what the encoder takes in memory, for the memory plan (`encoder_bytes`).

The encoder's weights are dense and few (tens to hundreds of MiB): on the device they are copied once into one
buffer and stay there. A graph runs wholly on one backend (the VRAM tier's rule: no split graphs on lavapipe,
runtime/vram/tier.py), its intermediate tensors placed by ggml's graph allocator, which reuses memory between
layers: the compute buffer an image needs is what the allocator measures for its graph, one attention layer's
scores at most, not every layer's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing.compute.backend import Backend, DeviceError, DeviceGraph, DeviceTensors, GraphAllocator, get_tensor
from tokenwing.compute.devices import list_devices
from tokenwing.compute.ggml_lib import _TYPES, Tensor
from tokenwing.fsutil import human_bytes
from tokenwing.vision.image import Preprocessed, target_size

if TYPE_CHECKING:  # (the encoder imports this module: its class is only read here)
    from tokenwing.vision.encoder import MmprojEncoder


@dataclass
class GraphInputs:
    """What a family's graph builder is handed (`MmprojEncoder.run`'s `build`): the graph's ggml context and
    `input(array)`, a tensor the array is copied into once the graph is placed (the CPU `Graph`'s two members)."""

    graph: DeviceGraph
    values: list[tuple[Tensor, np.ndarray]] = field(default_factory=list)

    @property
    def ctx(self) -> Any:
        return self.graph.ctx

    def input(self, array: np.ndarray) -> Tensor:
        a = np.ascontiguousarray(array)
        t = self.graph.input(_TYPES[a.dtype], tuple(reversed(a.shape)) or (1,))
        self.values.append((t, a))
        return t


Build = Callable[[Any], Tensor]  # (a family's graph takes the CPU's Graph or GraphInputs: both have ctx and input)


class EncoderBackend:
    """An encoder's graphs on one ggml backend: ggml's CPU backend over the mmproj's mapped weights, or a device
    with the weights copied into a buffer of its own (`upload`)."""

    def __init__(self, backend: Backend, weights: dict[str, Tensor]) -> None:
        self.backend = backend
        self.weights = weights  # by name, as the family's graph reads them
        self._tensors: DeviceTensors | None = None
        self._allocator: GraphAllocator | None = None  # (the device's: its graphs' compute buffer)
        self.freed = False  # its backend closed (a session that dropped its failed GPU): encoders go to the CPU

    @classmethod
    def upload(cls, backend: Backend, raw: dict[str, tuple[np.ndarray, int, tuple[int, ...]]]) -> EncoderBackend:
        """The weights (name → (bytes, ggml type, GGUF shape)) copied into one device buffer."""
        dt = DeviceTensors(backend, len(raw) + 1)
        try:
            placed = {name: dt.new(kind, shape, name) for name, (_, kind, shape) in raw.items()}
            dt.allocate()
            for name, (data, _, _) in raw.items():
                dt.set(placed[name], np.ascontiguousarray(data))
        except Exception:
            dt.close()
            raise
        run = cls(backend, placed)
        run._tensors = dt
        # (one compute buffer for its graphs, kept while the weights are: a device buffer freed between two graphs
        # left lavapipe writing into freed memory at the VRAM tier's next graph — backend.py GraphAllocator)
        run._allocator = GraphAllocator(backend)
        return run

    @property
    def weight_bytes(self) -> int:
        """Device memory the weights take (0 on the CPU: the file's mapped pages)."""
        return self._tensors.nbytes if self._tensors is not None else 0

    def run(self, build: Build, n_nodes: int, check: bool) -> np.ndarray:
        """Builds, places and computes the graph; its output (contiguous F32), in numpy order."""
        g = DeviceGraph(self.backend, n_nodes, allocator=self._allocator)
        try:
            inputs = GraphInputs(g)
            out = build(inputs)
            g.finish(out, check=check)
            for t, a in inputs.values:
                g.set(t, a)
            g.compute()
            return get_tensor(out)
        finally:
            g.close()

    def measure(self, build: Build, n_nodes: int) -> int:
        """Bytes of the compute buffer the graph needs (nothing allocated, nothing computed)."""
        g = DeviceGraph(self.backend, n_nodes)
        allocator = GraphAllocator(self.backend)
        try:
            return g.measure(allocator, build(GraphInputs(g)))
        finally:
            allocator.close()
            g.close()

    def check(self, build: Build, n_nodes: int) -> None:
        """Raises DeviceError unless the backend runs every node of the graph with every weight in its memory."""
        g = DeviceGraph(self.backend, n_nodes)
        try:
            out = build(GraphInputs(g))
            g.expand(out)
            error = g.placement_error()
            if error:
                raise DeviceError(error)
        finally:
            g.close()

    def free(self) -> None:
        """Frees the device's buffers: only as its backend closes (`resident`)."""
        self.freed = True
        self.backend.synchronize()
        if self._allocator is not None:
            self._allocator.close()
            self._allocator = None
        if self._tensors is not None:
            self._tensors.close()
            self._tensors = None


@dataclass(frozen=True)
class EncoderBytes:
    """What an image encoder takes in memory: its weights, and the compute buffer of the largest image its
    preprocessing allows (`size`, in pixels)."""

    weights: int
    compute: int
    size: tuple[int, int]

    @property
    def total(self) -> int:
        return self.weights + self.compute

    @property
    def vram_keep(self) -> int:
        """VRAM the tier leaves free for it (VramOptions.keep): its total with a margin, since it is measured on the
        CPU's buffer type and a device's alignment and padding differ a little (Vulkan: by under 0.1 MiB here)."""
        return self.total + self.total // 64 + (1 << 20)

    def describe(self) -> str:
        w, h = self.size
        return (
            f"the image encoder {human_bytes(self.total)} ({human_bytes(self.weights)} of weights, "
            f"{human_bytes(self.compute)} to encode a {w}×{h} image, the largest)"
        )


def largest_image(enc: MmprojEncoder) -> Preprocessed:
    """A blank image of the largest size the encoder's preprocessing makes (a square, shrunk to its budget)."""
    w, h = target_size(1 << 15, 1 << 15, enc.limits())
    return Preprocessed(np.zeros((3, h, w), np.float32), w, h)


def compute_bytes(enc: MmprojEncoder, on: EncoderBackend, image: Preprocessed) -> int:
    """The compute buffer `on` needs for the encoder's graph of `image`, measured (nothing computed): the family's
    `encode` builds the graph, and `MmprojEncoder.run` measures it instead of running it."""
    enc.sizing = on
    try:
        enc.encode(image)
        return enc.sized
    finally:
        enc.sizing = None


@functools.cache
def cpu_backend(n_threads: int = 2) -> Backend:
    """ggml's CPU backend with `n_threads` threads (where encoders compute without a device, and whose buffer
    type sizes their compute buffers), one for the process."""
    return Backend(next(d for d in list_devices() if d.kind == "cpu"), n_threads)


def encoder_bytes(enc: MmprojEncoder) -> EncoderBytes:
    """What the encoder takes on the CPU: its weights (the file's tensors, mapped and read in full) and the
    compute buffer of the largest image."""
    image = largest_image(enc)
    weights = sum(raw.nbytes for raw, _ in enc._raw.values())
    compute = compute_bytes(enc, EncoderBackend(cpu_backend(enc.n_threads), enc._cpu_w), image)
    return EncoderBytes(weights, compute, (image.width, image.height))


# The encoders' weights on each backend, by file: they stay as long as the backend does. A device buffer freed
# while the VRAM tier goes on computing left lavapipe's heap corrupted at the tier's next prompt graph (measured:
# "double free or corruption" after `tokenwing run --mmproj` closed its encoder), and the tower is resident anyway.
_RESIDENT: dict[tuple[int, str], EncoderBackend] = {}


def resident(backend: Backend, enc: MmprojEncoder) -> EncoderBackend:
    """The encoder's weights in a buffer of `backend`: uploaded by the first encoder of its file, freed as the
    backend closes."""
    key = (id(backend), os.path.realpath(enc.path))
    device = _RESIDENT.get(key)
    if device is None:
        device = EncoderBackend.upload(
            backend, {name: (raw, kind, enc._shapes[name]) for name, (raw, kind) in enc._raw.items()}
        )
        _RESIDENT[key] = device

        def free(key: tuple[int, str] = key, device: EncoderBackend = device) -> None:
            _RESIDENT.pop(key, None)
            device.free()

        backend.on_close.append(free)
    return device


def place(enc: MmprojEncoder, backend: Backend, room: int) -> str:
    """Puts the encoder's weights and graphs on the device when its weights and the largest image's compute buffer
    fit in `room` (the VRAM budget the tier left) and the device runs every node of its graph; else it stays on
    the CPU. Never refuses: the line (`enc.where`) says where it computes and why."""
    enc.weights_on(_on_device(enc, backend, room), "")
    return enc.where


def _on_device(enc: MmprojEncoder, backend: Backend, room: int) -> EncoderBackend | None:
    image = largest_image(enc)
    weights = sum(raw.nbytes for raw, _ in enc._raw.values())
    label = backend.device.label()
    try:
        need = weights + compute_bytes(enc, EncoderBackend(backend, enc._cpu_w), image)
        placed = (id(backend), os.path.realpath(enc.path)) in _RESIDENT  # (its bytes are in the tier's count)
        if need > room and not placed:
            enc.where = (
                f"vision encoder on CPU: its {human_bytes(need)} (weights and a {image.width}×{image.height} image's "
                f"compute buffer) do not fit the {human_bytes(max(room, 0))} the VRAM tier left on {label}"
            )
            return None
        device = resident(backend, enc)
    except DeviceError as e:
        enc.where = f"vision encoder on CPU: {e}"
        return None
    # (every op on the device, every weight in its buffer: the graph of the smallest image tells)
    small = enc.limits().align
    enc.weights_on(device, "")
    enc.sizing = _Checking(device)
    try:
        enc.encode(Preprocessed(np.zeros((3, small, small), np.float32), small, small))
    except DeviceError as e:
        enc.where = f"vision encoder on CPU: {e}"
        return None
    finally:
        enc.sizing = None
    enc.where = f"vision encoder on {label}: {human_bytes(need)} of the VRAM budget"
    return device


class _Checking(EncoderBackend):
    """A backend whose `measure` checks the graph's placement instead (what `place` sizes the encoder with)."""

    def __init__(self, device: EncoderBackend) -> None:
        super().__init__(device.backend, device.weights)

    def measure(self, build: Build, n_nodes: int) -> int:
        self.check(build, n_nodes)
        return 0
