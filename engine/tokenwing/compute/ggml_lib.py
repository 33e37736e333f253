"""ggml (the kernels llama.cpp runs) as the engine computes with it: contexts, graphs and the CPU's thread pool,
over the declarations of compute/ggml_api.py (the one module that loads ggml).

Traps handled here: ggml keeps raw pointers (every array we hand it is kept alive by its owner object); buffers
must be 32/64-byte aligned (we hand it page-aligned memory).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenwing.compute import ggml_api as ggml

Tensor = ggml.Tensor  # a ctypes pointer to a ggml_tensor

F32 = ggml.GGML_TYPE_F32
F16 = ggml.GGML_TYPE_F16
I32 = ggml.GGML_TYPE_I32
I64 = ggml.GGML_TYPE_I64
_TYPES: dict[np.dtype[Any], int] = {
    np.dtype(np.float32): F32,
    np.dtype(np.float16): F16,
    np.dtype(np.int32): I32,
    np.dtype(np.int64): I64,
}
_DTYPES = {gtype: dtype for dtype, gtype in _TYPES.items()}
ROPE_NEOX = ggml.GGML_ROPE_TYPE_NEOX
ROPE_NORM = ggml.GGML_ROPE_TYPE_NORMAL
ROPE_IMROPE = ggml.GGML_ROPE_TYPE_IMROPE  # multi-axis RoPE with interleaved sections (Qwen3.5)


def aligned_bytes(n: int) -> np.ndarray:
    """Page-aligned zeroed memory as a uint8 array (anonymous mmap: freed with its last reference).

    Large blocks ask for transparent huge pages: weight sweeps then miss the TLB far less.
    """
    m = mmap.mmap(-1, max(n, 1))
    if n >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=np.uint8)


def file_backed_bytes(n: int, folder: str) -> tuple[np.ndarray, mmap.mmap]:
    """Zeroed memory backed by a file in `folder` that is unlinked at once (nothing is left behind, whatever ends
    the process), as a uint8 array and its mapping. Its pages are page cache: once written back (`mapping.flush()`)
    a memory limit reclaims them and they are read back from the drive when touched again — unlike anonymous
    shared memory, which no limit can reclaim without swap. The file's blocks are allocated up front, so a full
    disk is an OSError here, never a SIGBUS at a later write."""
    fd, path = tempfile.mkstemp(prefix=".tokenwing-spill-", dir=folder)
    try:
        os.unlink(path)
        os.posix_fallocate(fd, 0, max(n, 1))
        m = mmap.mmap(fd, max(n, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return np.frombuffer(m, dtype=np.uint8), m


class TensorArena:
    """Tensors whose data lives in memory we own (weights, KV cache, slot pools): metadata only in ggml."""

    def __init__(self, max_tensors: int) -> None:
        size = ggml.ggml_tensor_overhead() * max_tensors + 1024
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        self._owners: list[object] = []

    def wrap(
        self,
        data: np.ndarray | int,
        gtype: int,
        shape: Sequence[int],
        owner: object = None,
        strides: Sequence[int] | None = None,
    ) -> Tensor:
        """A ggml tensor over `data` (an array, or an address kept alive by `owner`), GGUF shape order."""
        t = _new_tensor(self.ctx, gtype, shape)
        if isinstance(data, np.ndarray):
            t.contents.data = data.ctypes.data
            self._owners.append(data)
        else:
            t.contents.data = data
        if owner is not None:
            self._owners.append(owner)
        if strides is not None:
            for i, s in enumerate(strides):
                t.contents.nb[i] = s
        return t

    def close(self) -> None:
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = 0
        self._owners.clear()


def _new_tensor(ctx: Any, gtype: int, shape: Sequence[int]) -> Tensor:
    n = len(shape)
    if n == 1:
        return ggml.ggml_new_tensor_1d(ctx, gtype, shape[0])
    if n == 2:
        return ggml.ggml_new_tensor_2d(ctx, gtype, shape[0], shape[1])
    if n == 3:
        return ggml.ggml_new_tensor_3d(ctx, gtype, shape[0], shape[1], shape[2])
    return ggml.ggml_new_tensor_4d(ctx, gtype, shape[0], shape[1], shape[2], shape[3])


WORK_START = 1 << 20  # a Graph's scratch memory at first (and after `release`): grown as a graph needs


class Graph:
    """One compute graph at a time in a reusable context: build with ggml ops, then `compute`."""

    def __init__(self, mem_bytes: int, n_threads: int, poll: int | None = None) -> None:
        self.mem_bytes = mem_bytes
        self.n_threads = n_threads
        # The context's memory is ours (an anonymous mapping), so that `release` can give its pages back
        self._mem = mmap.mmap(-1, max(mem_bytes, 1))
        self._mem_array = np.frombuffer(self._mem, dtype=np.uint8)
        address = int(self._mem_array.ctypes.data)
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem_bytes, mem_buffer=address, no_alloc=False))
        # One thread pool for the session: creating threads for every graph costs more than small graphs.
        params = ggml.ggml_threadpool_params_default(n_threads)
        if poll is not None:
            params.poll = poll
        self.pool = ggml.ggml_threadpool_new(ctypes.byref(params))
        self._work: np.ndarray | None = aligned_bytes(WORK_START)

    def reset(self) -> Any:
        ggml.ggml_reset(self.ctx)
        return self.ctx

    def release(self) -> None:
        """Gives the memory a long prompt's graphs touched back to the system (results of earlier graphs are
        gone: call it before building the next one). A 16k-token prompt touches the whole reserve (its attention
        scores alone are 4 · heads · 64 · n_ctx bytes) and the work buffer grows to twice its largest need; a
        decode step touches a few MB of them. Held, they were charged to the memory limit all through the reply,
        where a spilled KV cache's pages needed the room (docs/results.md: a long prompt, then the reply)."""
        ggml.ggml_reset(self.ctx)
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mem.madvise(mmap.MADV_DONTNEED)  # (private anonymous pages: zero-filled when touched again)
        self._work = aligned_bytes(WORK_START)

    def input(self, array: np.ndarray, gtype: int | None = None) -> Tensor:
        """A tensor holding a copy of a small numpy array (ids, positions, routing weights, hidden states)."""
        a = np.ascontiguousarray(array)
        if gtype is None:
            gtype = _TYPES[a.dtype]
        t = _new_tensor(self.ctx, gtype, tuple(reversed(a.shape)) or (1,))
        ctypes.memmove(t.contents.data, a.ctypes.data, a.nbytes)
        return t

    def gather(self, src: np.ndarray, index: np.ndarray) -> Tensor:
        """An F32 tensor [n, len(index)] holding the rows src[index] of src [rows, n], gathered straight into
        ggml's memory (one copy, where `input(src[index])` makes two)."""
        n = src.shape[1]
        t = _new_tensor(self.ctx, F32, (n, len(index)))
        rows = np.ctypeslib.as_array((ctypes.c_float * (n * len(index))).from_address(t.contents.data))
        np.take(np.ascontiguousarray(src, np.float32), index, axis=0, out=rows.reshape(len(index), n))
        return t

    def compute(self, *outputs: Tensor, n_nodes: int = 4096) -> None:
        gf = ggml.ggml_new_graph_custom(self.ctx, n_nodes, False)
        for out in outputs:
            ggml.ggml_build_forward_expand(gf, out)
        plan, self._work = _plan(gf, self.n_threads, self.pool, self._work)
        _compute(gf, plan)

    def close(self) -> None:
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = 0
        if self.pool:
            ggml.ggml_threadpool_free(self.pool)
            self.pool = 0


def _plan(gf: Any, n_threads: int, pool: Any, work: np.ndarray | None) -> tuple[Any, np.ndarray | None]:
    """The threads' plan for a graph, with its scratch memory (`work`, grown when too small)."""
    plan = ggml.ggml_graph_plan(gf, n_threads, pool)
    if plan.work_size:
        if work is None or plan.work_size > work.size:
            work = aligned_bytes(int(plan.work_size) * 2)
        plan.work_data = int(work.ctypes.data)
    return plan, work


def status_text(status: int) -> str:
    """ggml's words for a status code ("GGML status: error (operation failed)"), with the code."""
    return f"{ggml.ggml_status_to_string(status).decode(errors='replace')}, status {status}"


def _compute(gf: Any, plan: Any) -> None:
    rc = ggml.ggml_graph_compute(gf, ctypes.byref(plan))
    if rc != 0:
        raise RuntimeError(f"ggml graph compute failed ({status_text(rc)})")


class StaticGraph:
    """A graph built once and computed many times (a whole decode step): its tensors are placed by ggml's graph
    allocator, which reuses memory between nodes as llama.cpp does; inputs are rewritten before each run.

    Build order is execution order: `expand` a node (a KV cache write) before building the nodes that must
    see its effect. Runs on the thread pool of `pool_owner` (one pool per session).
    """

    def __init__(self, max_nodes: int, pool_owner: Graph) -> None:
        size = ggml.ggml_tensor_overhead() * max_nodes * 2 + ggml.ggml_graph_overhead_custom(max_nodes, False)
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        self.gf = ggml.ggml_new_graph_custom(self.ctx, max_nodes, False)
        self.n_threads, self._pool = pool_owner.n_threads, pool_owner.pool
        self._owners: list[object] = []
        self._galloc: int | None = None
        self._plan: Any = None
        self._work: np.ndarray | None = None
        self._arrays: dict[int, np.ndarray] = {}  # (`array`: a tensor's address -> a view of its memory)
        self.bytes = 0

    def input(self, gtype: int, shape: Sequence[int]) -> Tensor:
        """A tensor written before each run (`set`), GGUF shape order."""
        t = _new_tensor(self.ctx, gtype, shape)
        ops.ggml_set_input(t)
        return t

    def constant(self, array: np.ndarray) -> Tensor:
        """A tensor over a copy of `array`, kept for the graph's life (the allocator leaves it alone)."""
        a = np.ascontiguousarray(array).copy()
        gtype = _TYPES[a.dtype]
        t = _new_tensor(self.ctx, gtype, tuple(reversed(a.shape)) or (1,))
        t.contents.data = a.ctypes.data
        self._owners.append(a)
        return t

    def expand(self, t: Tensor) -> None:
        ggml.ggml_build_forward_expand(self.gf, t)

    def finish(self, *outputs: Tensor) -> None:
        """Adds the outputs, places every tensor and plans the threads' work: the graph is ready to run."""
        for out in outputs:
            ops.ggml_set_output(out)
            self.expand(out)
        self._galloc = ggml.ggml_gallocr_new(ggml.ggml_backend_cpu_buffer_type())
        if not ggml.ggml_gallocr_alloc_graph(self._galloc, self.gf):
            raise MemoryError("ggml could not allocate a decode graph")
        self.bytes = int(ggml.ggml_gallocr_get_buffer_size(self._galloc, 0))
        self._plan, self._work = _plan(self.gf, self.n_threads, self._pool, None)

    def array(self, t: Tensor) -> np.ndarray | None:
        """A numpy array over a placed tensor's memory (`_over`), made once per tensor: the graph is rerun every
        token and its tensors stay where `finish` placed them, so writing an input or copying an output is one
        numpy copy, not a ctypes round trip (the demo model's decode token spent ~90 µs in those, against ~420 in
        its graph). None for an input no node reads (ggml leaves it unplaced)."""
        key = ctypes.addressof(t.contents)
        got = self._arrays.get(key)
        if got is None:
            if not t.contents.data:
                return None
            got = self._arrays[key] = _over(t, _DTYPES[int(t.contents.type)])
        return got

    def compute(self) -> None:
        _compute(self.gf, self._plan)

    def close(self) -> None:
        self._arrays.clear()
        if self._galloc:
            ggml.ggml_gallocr_free(self._galloc)
            self._galloc = None
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = 0
        self._owners.clear()


class Repacker:
    """ggml's CPU repacked layouts (llama.cpp's default for Q4_K, Q4_0, IQ4_NL…: rows interleaved in groups
    so that one pass of its matrix kernels serves several rows): up to 1.3× faster matrix products.

    A tensor is marked as living in the CPU_REPACK buffer type (ggml finds its kernel through `extra`) and its
    bytes are rewritten in place. Only for weights used as the first operand of mul_mat; the repacked kernels
    round differently from the plain ones in the last bit, as llama.cpp's do.
    """

    def __init__(self) -> None:
        self.buffer: int | None = None
        reg = ggml.ggml_backend_cpu_reg()
        proc = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not proc:
            return
        get_bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(proc)
        bufts = get_bufts(ggml.ggml_backend_reg_dev_get(reg, 0))
        i = 0
        while bufts and bufts[i]:
            name = ggml.ggml_backend_buft_name(bufts[i])
            if name == b"CPU_REPACK":
                # only the buffer's type matters to ggml: the data stays in our memory
                self.buffer = ggml.ggml_backend_buft_alloc_buffer(bufts[i], 4096)
                break
            i += 1

    def prepare(self, t: Tensor) -> bool:
        """Marks `t` as repacked if this CPU has a repacked kernel for its type and shape; its bytes must then be
        in the repacked layout before it is used (`repack`, or the streaming core's transform)."""
        if self.buffer is None:
            return False
        ggml.ggml_backend_buffer_init_tensor(self.buffer, t)  # sets `extra` to the kernel, if there is one
        if not t.contents.extra:
            return False
        t.contents.buffer = self.buffer
        return True

    def repack(self, t: Tensor, nbytes: int) -> bool:
        """Rewrites the 2-D tensor `t` in place in ggml's repacked layout, if this CPU has one for it."""
        if not self.prepare(t):
            return False
        plain = ctypes.create_string_buffer(ctypes.string_at(t.contents.data, nbytes), nbytes)
        ggml.ggml_backend_tensor_set(t, ctypes.addressof(plain), 0, nbytes)
        return True

    @staticmethod
    def setter() -> int:
        """Address of ggml_backend_tensor_set(tensor, data, offset, size): it repacks a prepared tensor."""
        return ggml.address_of("ggml_backend_tensor_set")


def start_registry_quietly() -> None:
    """Registers the build's GPU backends (the first device query does), their messages kept out of stderr: the
    Vulkan backend reports "No devices found" and the like on every machine without a GPU, and the engine says
    in one line of its own which device it uses and why (ggml_api.LOAD_LOG keeps what ggml said)."""
    ggml.load_gpu_backends()


def to_numpy(t: Tensor) -> np.ndarray:
    """A copy of a contiguous F32 or I32 tensor's data, in numpy order (reversed GGUF shape). (Called ~50 times
    per decode token: one copy straight from ggml's memory, no intermediate bytes object.)"""
    return _over(t, np.dtype(np.int32 if t.contents.type == I32 else np.float32)).copy()


def _over(t: Tensor, dtype: np.dtype[Any]) -> np.ndarray:
    """A numpy array over a contiguous tensor's memory (no copy), in numpy order with leading 1s dropped."""
    c = t.contents
    dims = [int(c.ne[3]), int(c.ne[2]), int(c.ne[1]), int(c.ne[0])]
    n = dims[0] * dims[1] * dims[2] * dims[3]
    raw = (ctypes.c_char * (n * dtype.itemsize)).from_address(c.data)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    out: np.ndarray = np.frombuffer(memoryview(raw), dtype=dtype, count=n).reshape(dims)
    return out


ops = ggml


def quantize(rows: np.ndarray, gtype: int) -> np.ndarray:
    """Rows of float32 (numpy shape (n_rows, n_per_row)) in ggml type `gtype`, as ggml's own quantizer writes them."""
    a = np.ascontiguousarray(rows, dtype=np.float32)
    n_rows, n_per_row = a.shape
    out = np.zeros(ggml.ggml_row_size(gtype, n_per_row) * n_rows, np.uint8)
    src = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    ggml.ggml_quantize_chunk(gtype, src, out.ctypes.data, 0, n_rows, n_per_row, None)
    return out


def dequantize(raw: np.ndarray, gtype: int, n_rows: int, n_per_row: int) -> np.ndarray:
    """The float32 values ggml computes with for `raw` bytes of type `gtype`: numpy shape (n_rows, n_per_row)."""
    out = np.empty((n_rows, n_per_row), np.float32)
    src = np.ascontiguousarray(raw)
    ggml.ggml_get_type_traits(gtype).contents.to_float(
        src.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n_rows * n_per_row
    )
    return out
