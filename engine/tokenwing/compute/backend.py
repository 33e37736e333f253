"""Computing on a device (Vulkan, CUDA; the CPU too, for references) through ggml's backend API.

The pieces the VRAM tier places its work with:
* `Backend`: one device of the registry, initialised, with ggml's CPU backend beside it for split graphs;
* `DeviceTensors`: tensors declared in a no-alloc context, then allocated together in one device buffer
  (`ggml_backend_alloc_ctx_tensors_from_buft`) and filled with `set` — a layer's resident weights, or a pool of
  expert slots (a 3-D tensor, one slot per index of its last dimension) that experts are copied into;
* `HostBuffer`: host memory the device copies from fastest (pinned, where the backend has a host buffer type),
  a ggml CPU buffer either way, so the CPU backend and the scheduler compute on tensors placed in it;
* `Readback`: a graph's outputs copied into pinned memory on the device's own stream, waited for once;
* `DeviceGraph`: one graph, computed wholly on the device (ggml's graph allocator on the device's buffer type)
  or split between the device and the CPU by `ggml_backend_sched`; built once, allocated once, computed many
  times with new inputs. Each split graph owns its scheduler and is never re-allocated: re-allocating a graph
  after `ggml_backend_sched_reset` silently computes wrong results (ggml issue 892) — build a new graph instead.

A failure of the device (allocation, compute) raises `DeviceError`: the caller falls back to the CPU path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tokenwing.compute import ggml_lib
from tokenwing.compute.devices import Device
from tokenwing.compute.ggml_lib import Tensor, aligned_bytes

ggml = ggml_lib.ops
_NUMPY = {ggml_lib.F32: np.float32, ggml_lib.F16: np.float16, ggml_lib.I32: np.int32, ggml_lib.I64: np.int64}


class DeviceError(RuntimeError):
    """The device failed (init, allocation, compute): fall back to the CPU path and say why in one line."""


class DeviceMemoryError(DeviceError):
    """The device could not allocate a buffer (less free memory than it reported, or a budget too large)."""


class Backend:
    """An initialised ggml backend for one registry device, and a CPU backend for the CPU side of split graphs."""

    def __init__(self, device: Device, n_threads: int = 0) -> None:
        self.device = device
        self._dev = ggml.ggml_backend_dev_get(device.index)
        self.handle = ggml.ggml_backend_dev_init(self._dev, None)
        if not self.handle:
            raise DeviceError(f"{device.name} failed to initialise")
        self.buft = ggml.ggml_backend_dev_buffer_type(self._dev)
        self.host_buft = ggml.ggml_backend_dev_host_buffer_type(self._dev) or None  # None: no pinned memory
        self.is_cpu = device.kind == "cpu"
        self.cpu = self.handle if self.is_cpu else ggml.ggml_backend_cpu_init()
        if n_threads > 0:
            ggml.ggml_backend_cpu_set_n_threads(self.cpu, n_threads)
        # Device memory held in buffers of this backend (`DeviceTensors` on the device, `GraphAllocator`s), and the
        # most ever held: what a VRAM budget is kept against (ggml's own counts are per buffer, never a sum)
        self.held_bytes = 0
        self.peak_bytes = 0
        # what frees buffers that live as long as the backend (an image encoder's weights: vision/device.py),
        # called by `close` before the backend goes
        self.on_close: list[Callable[[], None]] = []

    def account(self, nbytes: int) -> None:
        """A device buffer of `nbytes` allocated (freed: negative)."""
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def synchronize(self) -> None:
        """Waits for the device's queued copies and graphs (`set(..., wait=False)`)."""
        ggml.ggml_backend_synchronize(self.handle)

    def supports(self, t: Tensor) -> bool:
        """Whether the device has a kernel for the operation that computes `t` (its type and shapes)."""
        return bool(ggml.ggml_backend_dev_supports_op(self._dev, t))

    def close(self) -> None:
        while self.on_close:
            self.on_close.pop()()
        if self.cpu and not self.is_cpu:
            ggml.ggml_backend_free(self.cpu)
        if self.handle:
            ggml.ggml_backend_free(self.handle)
        self.handle = self.cpu = 0


def _new_ctx(n_tensors: int, graph_nodes: int = 0) -> Any:
    size = ggml.ggml_tensor_overhead() * n_tensors + 1024
    if graph_nodes:
        size += ggml.ggml_graph_overhead_custom(graph_nodes, False)
    return ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))


def _address(data: np.ndarray | int) -> int:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError("device copies need contiguous arrays")
        return int(data.ctypes.data)
    return int(data)


def set_tensor(t: Tensor, data: np.ndarray | int, nbytes: int | None = None, offset: int = 0) -> None:
    """Copies host memory (an array, or an address) into `t` at byte `offset`, wherever `t` lives."""
    n = nbytes if nbytes is not None else (data.nbytes if isinstance(data, np.ndarray) else ggml.ggml_nbytes(t))
    if offset < 0 or offset + n > ggml.ggml_nbytes(t):
        raise ValueError(f"copy of {n} bytes at {offset} does not fit a tensor of {ggml.ggml_nbytes(t)}")
    ggml.ggml_backend_tensor_set(t, _address(data), offset, n)


def _layout(t: Tensor) -> tuple[list[int], Any]:
    """The numpy shape (reversed GGUF shape) and dtype of a tensor that can be read as an array."""
    if not ggml.ggml_is_contiguous(t):  # a view (ggml_argsort_top_k's result is one): ggml_cont it in the graph
        raise ValueError("cannot read a non-contiguous tensor: ggml_cont it in the graph first")
    c = t.contents
    dtype = _NUMPY.get(int(c.type))
    if dtype is None:
        raise ValueError(f"cannot read a {ggml.ggml_type_name(c.type).decode()} tensor as an array")
    dims = [int(c.ne[3]), int(c.ne[2]), int(c.ne[1]), int(c.ne[0])]
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    return dims, dtype


def get_tensor(t: Tensor) -> np.ndarray:
    """A copy of a contiguous F32/F16/I32/I64 tensor's data, in numpy order (reversed GGUF shape)."""
    dims, dtype = _layout(t)
    out = np.empty(dims, dtype=dtype)
    ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
    return out


class DeviceTensors:
    """Tensors that live in one buffer of the device (or of its pinned host memory, `host=True`): declared with
    `new`, allocated together by `allocate`, then filled with `set`. Weights are uploaded once; a slot pool is a
    tensor whose last dimension is the slot, refilled one slot at a time with `set_slot`."""

    def __init__(self, backend: Backend, max_tensors: int, host: bool = False, weights: bool = True) -> None:
        self.backend = backend
        self.buft = backend.host_buft if host and backend.host_buft else backend.buft
        self.ctx = _new_ctx(max_tensors)
        self.buffer: int | None = None  # the buffer `allocate` made (never one `place_in` uses: not ours)
        self._weights = weights  # tells the scheduler these are weights: ops run where they live
        self._declared: list[Tensor] = []
        self._placed = False

    def new(self, gtype: int, shape: Sequence[int], name: str | None = None) -> Tensor:
        """A tensor of GGUF shape `shape` (fastest dimension first), placed by `allocate`."""
        if self.buffer is not None or self._placed:
            raise RuntimeError("tensors are declared before allocate()")
        t = ggml_lib._new_tensor(self.ctx, gtype, shape)
        if name:
            ggml.ggml_set_name(t, name.encode()[:63])
        self._declared.append(t)
        return t

    def size(self) -> int:
        """Bytes `allocate` will take (alignment and padding included)."""
        return int(ggml.ggml_backend_alloc_ctx_tensors_from_buft_size(self.ctx, self.buft))

    def allocate(self) -> None:
        if self.size() == 0:  # nothing declared (ggml would answer NULL, as for a failure)
            return
        buf = ggml.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, self.buft)
        if not buf:
            raise DeviceMemoryError(
                f"{self.backend.device.name} could not allocate {self.size() / (1 << 20):.0f} MiB "
                f"({self.backend.device.free / (1 << 20):.0f} MiB were free)"
            )
        if self._weights:
            ggml.ggml_backend_buffer_set_usage(buf, ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        self.buffer = buf
        if self._on_device:
            self.backend.account(self.nbytes)

    def place_in(self, buffer: int, offset: int) -> int:
        """Places the tensors in another device buffer from byte `offset` on (it stays the owner's: `close` never
        frees it), each at the buffer's alignment; returns the offset after the last. DeviceMemoryError when they
        do not fit."""
        align = int(ggml.ggml_backend_buffer_get_alignment(buffer))
        base, size = int(ggml.ggml_backend_buffer_get_base(buffer)), int(ggml.ggml_backend_buffer_get_size(buffer))
        at, spots = offset, []
        for t in self._declared:
            at = -(-at // align) * align
            spots.append(at)
            at += int(ggml.ggml_backend_buffer_get_alloc_size(buffer, t))
        if at > size:
            raise DeviceMemoryError(f"{at - offset} bytes of tensors do not fit the {size - offset} left in a buffer")
        for t, spot in zip(self._declared, spots, strict=True):
            if ggml.ggml_backend_tensor_alloc(buffer, t, base + spot) != 0:
                raise DeviceError("ggml refused a tensor in a device buffer")
        self._placed = True
        return at

    @property
    def _on_device(self) -> bool:
        return bool(self.buft == self.backend.buft)

    @property
    def nbytes(self) -> int:
        return int(ggml.ggml_backend_buffer_get_size(self.buffer)) if self.buffer else 0

    def set(self, t: Tensor, data: np.ndarray | int, nbytes: int | None = None, offset: int = 0) -> None:
        """Copies host memory into `t` (the copy is complete when this returns)."""
        set_tensor(t, data, nbytes, offset)

    def set_slot(self, pool: Tensor, slot: int, data: np.ndarray | int, wait: bool = True, dim: int = 2) -> None:
        """Copies one slot's worth of host memory (an expert's bytes, as ggml lays them) into slot `slot` of `pool`,
        whose dimension `dim` is the slot (2 for the [cols, rows, slots] matrices of ggml_mul_mat_id, 1 for biases).

        `wait=False` queues the copy on the device (`Backend.synchronize` waits for it); `data` must stay
        untouched until then — pinned memory (`HostBuffer`) makes such copies truly asynchronous on CUDA.
        """
        c = pool.contents
        n_slots, stride = int(c.ne[dim]), int(c.nb[dim])
        if not 0 <= slot < n_slots:
            raise IndexError(f"slot {slot} of {n_slots}")
        if wait:
            set_tensor(pool, data, stride, slot * stride)
        else:
            ggml.ggml_backend_tensor_set_async(self.backend.handle, pool, _address(data), slot * stride, stride)

    def get_slot(self, pool: Tensor, slot: int, address: int, dim: int = 2) -> None:
        """Copies slot `slot` of `pool` (see `set_slot`) into host memory at `address` (complete on return)."""
        c = pool.contents
        n_slots, stride = int(c.ne[dim]), int(c.nb[dim])
        if not 0 <= slot < n_slots:
            raise IndexError(f"slot {slot} of {n_slots}")
        ggml.ggml_backend_tensor_get(pool, address, slot * stride, stride)

    def clear(self) -> None:
        """Zeroes the whole buffer (a KV cache: masked positions are multiplied by 0, which a NaN would survive)."""
        if self.buffer:
            ggml.ggml_backend_buffer_clear(self.buffer, 0)

    def close(self) -> None:
        if self.buffer:
            if self._on_device:
                self.backend.account(-self.nbytes)
            ggml.ggml_backend_buffer_free(self.buffer)
            self.buffer = None
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None


class HostBuffer:
    """Host memory for the RAM side of the tier (slot pools, router outputs the CPU reads): pinned when the device
    offers a host buffer type (`pinned`), else memory of ours; page-aligned either way (tested on each device), so
    the streaming core's direct reads can land in it. Either way a ggml CPU buffer, so tensors
    placed in it (`tensor`) are computed by the CPU backend in split graphs and copied to the device at full speed.
    """

    def __init__(self, backend: Backend | None, nbytes: int) -> None:
        self.nbytes = nbytes
        self._keep: np.ndarray | None = None
        self.buffer: int | None = None
        if backend is not None and backend.host_buft:
            self.buffer = ggml.ggml_backend_buft_alloc_buffer(backend.host_buft, nbytes) or None
        self.pinned = self.buffer is not None
        if self.buffer is None:  # no pinned memory here (or it ran out): ordinary memory, still a ggml buffer
            self._keep = aligned_bytes(nbytes)
            self.buffer = ggml.ggml_backend_cpu_buffer_from_ptr(self._keep.ctypes.data, nbytes)
        self.address = int(ggml.ggml_backend_buffer_get_base(self.buffer))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.address))
        self._ctx = _new_ctx(256)

    def tensor(self, gtype: int, shape: Sequence[int], offset: int) -> Tensor:
        """A tensor over this memory at byte `offset` (aligned to 64), GGUF shape order."""
        t = ggml_lib._new_tensor(self._ctx, gtype, shape)
        if offset % 64 or offset + ggml.ggml_nbytes(t) > self.nbytes:
            raise ValueError(f"a tensor of {ggml.ggml_nbytes(t)} bytes does not fit at {offset} of {self.nbytes}")
        assert self.buffer, "the host buffer is closed"
        if ggml.ggml_backend_tensor_alloc(self.buffer, t, self.address + offset) != 0:
            raise DeviceError("ggml refused a tensor in a host buffer")
        return t

    def close(self) -> None:
        if self.buffer:
            ggml.ggml_backend_buffer_free(self.buffer)
            self.buffer = None
        if self._ctx:
            ggml.ggml_free(self._ctx)
            self._ctx = None
        self._keep = None


class Readback:
    """A decode step's outputs read into pinned host memory (design §9: the router's top-k reaches the CPU side
    through pinned memory without a device-wide sync). `queue` puts one copy per output on the device's stream,
    behind the graph that computes them (`ggml_backend_tensor_get_async`), and `wait` waits for that stream once
    (`Backend.synchronize`: on CUDA the backend's stream, not the device) and hands out copies. `get_tensor` instead
    makes one synchronous copy per output into pageable memory — staged through a driver buffer, a round trip to
    the device each, after a synchronous compute — and a decode step reads 3–5 outputs per layer.

    One read at a time (a read queued and never waited for — its caller failed — is dropped by the next); the
    memory grows to the largest read and is reused.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.host: HostBuffer | None = None
        self._queued: list[tuple[int, list[int], Any]] | None = None

    def queue(self, tensors: Sequence[Tensor]) -> None:
        if self._queued is not None:  # abandoned: its copies must land before the memory is reused
            self.backend.synchronize()
            self._queued = None
        layout, end = [], 0
        for t in tensors:
            dims, dtype = _layout(t)
            layout.append((end, dims, dtype))
            end += -(-int(ggml.ggml_nbytes(t)) // 64) * 64  # (HostBuffer tensors and numpy views: 64-aligned)
        if self.host is None or self.host.nbytes < end:
            if self.host is not None:
                self.host.close()
            self.host = HostBuffer(self.backend, max(end, 4096))
        for t, (off, _, _) in zip(tensors, layout, strict=True):
            ggml.ggml_backend_tensor_get_async(
                self.backend.handle, t, self.host.address + off, 0, int(ggml.ggml_nbytes(t))
            )
        self._queued = layout

    def wait(self) -> list[np.ndarray]:
        """The queued outputs, in order, once the device has computed and copied them."""
        if self._queued is None:
            raise RuntimeError("nothing queued")
        layout, self._queued = self._queued, None
        self.backend.synchronize()
        assert self.host is not None
        out = []
        for off, dims, dtype in layout:
            n = int(np.prod(dims)) * np.dtype(dtype).itemsize
            out.append(self.host.array[off : off + n].view(dtype).reshape(dims).copy())
        return out

    def close(self) -> None:
        if self._queued is not None:  # copies into the memory may be in flight
            self.backend.synchronize()
            self._queued = None
        if self.host is not None:
            self.host.close()
            self.host = None


class GraphAllocator:
    """One compute buffer for device graphs that run one after another (their intermediate tensors share it), and
    a buffer is never freed while the allocator lives.

    ggml's graph allocator frees its buffer when a graph needs a bigger one; a graph computed on the freed buffer
    left ggml-vulkan on lavapipe writing into freed memory at a later graph (measured: heap corruption after a
    layer graph, an expert graph whose buffer was then freed, and the output head; none when the free came one
    graph later). So the size a graph needs is measured first (`ggml_gallocr_reserve_n_size`, nothing
    allocated), and a graph that needs more gets a new buffer: the old one stays until `close`, and every graph
    placed in it stays valid. Reserve the largest graphs first (`finish` them once) and none grows later.

    `limit`: the most device memory its buffers may take together; a graph that would need more raises
    `DeviceMemoryError` before anything is allocated (a prompt's allocator in memory lent by the expert cache).
    """

    def __init__(self, backend: Backend, limit: int | None = None) -> None:
        self.backend = backend
        self.limit = limit
        self._probe = ggml.ggml_gallocr_new(backend.buft)
        self.handle: int | None = None
        self._size = 0
        self._kept: list[int] = []
        self.grown = 0  # new buffers after the first
        self.held = 0  # bytes of the buffers it made (`nbytes` asks ggml: they differ if ggml re-allocated one)

    @property
    def nbytes(self) -> int:
        """Bytes of compute memory held (the current buffer and the ones kept)."""
        return sum(int(ggml.ggml_gallocr_get_buffer_size(h, 0)) for h in [*self._kept, self.handle] if h)

    def place(self, gf: Any) -> int:
        """The allocator to place graph `gf` with: the current one when its buffer is large enough."""
        size = self.measure(gf)
        if self.handle is None or size > self._size:
            if self.limit is not None and self.nbytes + size > self.limit:
                raise DeviceMemoryError(
                    f"a compute buffer of {size / (1 << 20):.1f} MiB does not fit the "
                    f"{max(self.limit - self.nbytes, 0) / (1 << 20):.1f} MiB left to it"
                )
            fresh = ggml.ggml_gallocr_new(self.backend.buft)
            if not ggml.ggml_gallocr_reserve(fresh, gf):
                ggml.ggml_gallocr_free(fresh)
                mib = size / (1 << 20)
                raise DeviceMemoryError(
                    f"{self.backend.device.name} could not allocate a compute buffer of {mib:.1f} MiB"
                )
            if self.handle is not None:
                self._kept.append(self.handle)
                self.grown += 1
            self.handle = fresh
            self._size = int(ggml.ggml_gallocr_get_buffer_size(fresh, 0))
            self.backend.account(self._size)
            self.held += self._size
        return self.handle

    def measure(self, gf: Any) -> int:
        """Bytes a buffer for graph `gf` alone takes (nothing is allocated)."""
        size = ctypes.c_size_t(0)
        ggml.ggml_gallocr_reserve_n_size(self._probe, gf, None, None, ctypes.byref(size))
        return int(size.value)

    def close(self) -> None:
        self.backend.account(-self.held)
        self.held = 0
        for h in [*self._kept, self.handle, self._probe]:
            if h:
                ggml.ggml_gallocr_free(h)
        self._kept, self.handle, self._probe = [], None, 0


class DeviceGraph:
    """One compute graph on a `Backend`: build it with ggml ops on `ctx` (weights from `DeviceTensors` or
    `HostBuffer`, inputs from `input`), `finish` it once, then `set` inputs / `compute` / `get` outputs as often as
    needed. `split=False`: every node runs on the device. `split=True`: ggml's scheduler runs each node where its
    weights live (device buffers on the device, host buffers on the CPU) and copies between them.
    """

    def __init__(
        self,
        backend: Backend,
        max_nodes: int = 2048,
        split: bool = False,
        op_offload: bool = False,
        allocator: GraphAllocator | None = None,
    ) -> None:
        """`allocator`: a compute buffer shared with other graphs that are computed and read one after another
        (each `finish` re-plans it; it grows when a graph needs more); by default the graph has its own."""
        self.backend = backend
        self._shared = allocator
        self.split = split
        self.op_offload = op_offload  # let the scheduler move big batches of CPU-weight products to the device
        self.max_nodes = max_nodes
        self.ctx = _new_ctx(max_nodes * 2, max_nodes)
        self.gf = ggml.ggml_new_graph_custom(self.ctx, max_nodes, False)
        self._galloc: int | None = None
        self._sched: int | None = None
        self._on_cpu: list[Tensor] = []
        self._ready = False

    def input(self, gtype: int, shape: Sequence[int], name: str | None = None) -> Tensor:
        """A tensor written before each run with `set`, GGUF shape order."""
        t = ggml_lib._new_tensor(self.ctx, gtype, shape)
        ggml.ggml_set_input(t)
        if name:
            ggml.ggml_set_name(t, name.encode()[:63])
        return t

    def expand(self, t: Tensor) -> None:
        ggml.ggml_build_forward_expand(self.gf, t)

    def on_cpu(self, t: Tensor) -> Tensor:
        """Runs the node `t` on the CPU in a split graph. Needed for products over pinned host memory: the device can
        read that memory itself, so the scheduler would otherwise compute them on the device, pulling every weight
        over the bus (the design computes the experts held in RAM on the CPU, beside the device)."""
        if not self.split:
            raise RuntimeError("on_cpu needs a split graph (DeviceGraph(..., split=True))")
        self._on_cpu.append(t)
        return t

    def finish(self, *outputs: Tensor, check: bool = False) -> None:
        """Adds the outputs and places every node's memory; the graph cannot change after this. `check`: first
        makes sure the device can run every node and every weight lives in a backend buffer (`placement_error`)."""
        if self._ready:
            raise RuntimeError("a graph is finished once: build a new DeviceGraph (ggml issue 892)")
        for out in outputs:
            ggml.ggml_set_output(out)
            self.expand(out)
        if check:
            error = self.placement_error()
            if error:
                raise DeviceError(error)
        if self.split and not self.backend.is_cpu:
            backends = (ctypes.c_void_p * 2)(self.backend.handle, self.backend.cpu)
            self._sched = ggml.ggml_backend_sched_new(backends, None, 2, self.max_nodes, False, self.op_offload)
            for t in self._on_cpu:
                ggml.ggml_backend_sched_set_tensor_backend(self._sched, t, self.backend.cpu)
            if not self._sched or not ggml.ggml_backend_sched_alloc_graph(self._sched, self.gf):
                raise DeviceMemoryError(f"{self.backend.device.name}: the scheduler could not place a graph")
        else:
            self._galloc = (
                self._shared.place(self.gf) if self._shared is not None else ggml.ggml_gallocr_new(self.backend.buft)
            )
            if not ggml.ggml_gallocr_alloc_graph(self._galloc, self.gf):
                raise DeviceMemoryError(f"{self.backend.device.name} could not allocate a graph's compute buffer")
            if self._shared is not None and self._shared.nbytes != self._shared.held:
                # (ggml re-allocated the shared buffer itself: tensors placed in it are gone. `place` sizes each
                # graph first so that it never does)
                raise DeviceError("a shared compute buffer was re-allocated")
        self._ready = True

    def measure(self, allocator: GraphAllocator, *outputs: Tensor) -> int:
        """Bytes `allocator` would need for this graph with these outputs; nothing is allocated and the graph is
        not finished (a graph built only to size a buffer)."""
        for out in outputs:
            ggml.ggml_set_output(out)
            self.expand(out)
        return allocator.measure(self.gf)

    def placement_error(self) -> str | None:
        """Why this graph cannot run wholly on the device, or None: a node the device has no kernel for, or a
        weight outside every backend buffer (memory of ours that only the CPU can read: a tensor a device graph
        must not use, such as a host-side state a family keeps beside its KV cache)."""
        seen: set[int] = set()
        for i in range(ggml.ggml_graph_n_nodes(self.gf)):
            node = ggml.ggml_graph_node(self.gf, i)
            if not self.backend.supports(node):
                return f"{self.backend.device.name} has no kernel for {ggml.ggml_op_desc(node).decode()}"
            for src in node.contents.src:
                if not src or ctypes.addressof(src.contents) in seen:
                    continue
                seen.add(ctypes.addressof(src.contents))
                c = src.contents
                leaf = int(c.op) == ggml.GGML_OP_NONE and not c.view_src
                if leaf and c.data and not c.buffer:
                    name = c.name.decode(errors="replace")
                    return f"tensor {name} is in host memory, not on {self.backend.device.name}"
        return None

    @property
    def compute_buffer(self) -> int | None:
        """The device buffer its intermediate tensors were placed in (None: it has none)."""
        for i in range(ggml.ggml_graph_n_nodes(self.gf)):
            c = ggml.ggml_graph_node(self.gf, i).contents
            compute = (
                c.buffer and ggml.ggml_backend_buffer_get_usage(c.buffer) == ggml.GGML_BACKEND_BUFFER_USAGE_COMPUTE
            )
            if compute and not c.view_src:
                return int(ctypes.cast(c.buffer, ctypes.c_void_p).value or 0)
        return None

    @property
    def n_splits(self) -> int:
        """Parts the scheduler cut the graph into (1 when it runs on one backend)."""
        return int(ggml.ggml_backend_sched_get_n_splits(self._sched)) if self._sched else 1

    @property
    def compute_bytes(self) -> int:
        """Device memory the graph's intermediate tensors take."""
        if self._sched:
            return int(ggml.ggml_backend_sched_get_buffer_size(self._sched, self.backend.handle))
        return int(ggml.ggml_gallocr_get_buffer_size(self._galloc, 0)) if self._galloc else 0

    @staticmethod
    def set(t: Tensor, data: np.ndarray | int, nbytes: int | None = None) -> None:
        set_tensor(t, data, nbytes)

    @staticmethod
    def get(t: Tensor) -> np.ndarray:
        return get_tensor(t)

    def compute_read(self, readback: Readback, outputs: Sequence[Tensor]) -> list[np.ndarray]:
        """Runs the graph and reads `outputs` through `readback`: one wait for the graph and the copies."""
        self.compute(wait=False)
        readback.queue(outputs)
        return readback.wait()

    def compute(self, wait: bool = True) -> None:
        """Runs the graph; `wait=False` only queues it on the device (the CPU goes on: `Backend.synchronize`, or
        reading an output, waits for it)."""
        if not self._ready:
            raise RuntimeError("finish() the graph before computing it")
        if self._sched:
            status = ggml.ggml_backend_sched_graph_compute(self._sched, self.gf)
        elif wait:
            status = ggml.ggml_backend_graph_compute(self.backend.handle, self.gf)
        else:
            status = ggml.ggml_backend_graph_compute_async(self.backend.handle, self.gf)
        if status != 0:
            raise DeviceError(f"{self.backend.device.name}: graph compute failed ({ggml_lib.status_text(status)})")

    def close(self) -> None:
        if self._sched:
            ggml.ggml_backend_sched_free(self._sched)
            self._sched = None
        if self._galloc and self._shared is None:
            ggml.ggml_gallocr_free(self._galloc)
        self._galloc = None
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None
