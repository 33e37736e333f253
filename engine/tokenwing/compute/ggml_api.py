"""ggml's C API as the engine uses it: our own ctypes declarations over the ggml that engine/ggml/ builds.

Every function, struct and constant of ggml the engine touches is declared here once, with its C spelling.
tests/compute/test_ggml_abi.py compiles those spellings against the build's own headers: a changed signature,
struct layout or enum value fails that test, not a user's run. No other module loads ggml.

The build (engine/ggml/build.sh) is found in `TOKENWING_GGML_DIR`, else beside a frozen bundle's files
(`_internal/ggml`), else in the Python environment (`lib/tokenwing-ggml`, where ./dev installs it). At import:
  * libggml-base and libggml from its lib/;
  * the CPU backend: one module per x86-64 level in backends/cpu/; the best this CPU runs, by the score each
    module computes for it (what ggml's own loader does), or the one `TOKENWING_CPU_VARIANT` names (`haswell`,
    `skylakex`, … : a test runs the portable one anywhere). Its module is also opened here for the CPU-only API
    (graph plans, thread pools, type traits), which ggml does not route through the registry.
GPU backends (backends/cuda, backends/vulkan) are loaded by `load_gpu_backends`, at the first device query
(compute/ggml_lib.start_registry_quietly): a process that never asks never starts a Vulkan instance.
`TOKENWING_VULKAN=0` leaves Vulkan out.

Why ctypes and not a native module: the engine builds a decode step's graph once and computes it many times
(runtime/token_graph.py), so a token makes a handful of ggml calls; bench/ggml_call_bench.py measures what a call
costs and how many a token makes (docs/results.md).

Traps kept here: ggml holds raw pointers (every array handed to it is kept alive by its owner); a failed ggml
assert aborts the process (GGML_NO_BACKTRACE is set before the library loads, so it does not attach a debugger).
"""

from __future__ import annotations

import _ctypes
import ctypes
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar, overload

from tokenwing import _core  # (it calls ggml only through addresses this module hands it: no load order)

os.environ.setdefault("GGML_NO_BACKTRACE", "1")

ENV_DIR = "TOKENWING_GGML_DIR"
ENV_CPU = "TOKENWING_CPU_VARIANT"
ENV_VULKAN = "TOKENWING_VULKAN"
GPU_KINDS = ("cuda", "vulkan")  # loaded in this order: the registry lists their devices before the CPU's


# How the build names its files here (engine/ggml/build.sh: real files named by soname; ggml's own module names)
if sys.platform == "win32":
    CORE_LIBS, MODULE_PREFIX, MODULE_SUFFIX = ("ggml-base.dll", "ggml.dll"), "ggml-", ".dll"
elif sys.platform == "darwin":
    CORE_LIBS, MODULE_PREFIX, MODULE_SUFFIX = ("libggml-base.0.dylib", "libggml.0.dylib"), "libggml-", ".so"
else:
    CORE_LIBS, MODULE_PREFIX, MODULE_SUFFIX = ("libggml-base.so.0", "libggml.so.0"), "libggml-", ".so"


class GgmlMissing(RuntimeError):
    """No ggml build where the engine looks for one (one line for the user)."""


def home() -> Path:
    """The ggml build this process uses."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    if getattr(sys, "frozen", False):
        return Path(getattr(sys, "_MEIPASS", os.path.dirname(sys.executable))) / "ggml"
    return Path(sys.prefix) / "lib" / "tokenwing-ggml"


def build_info(root: Path | None = None) -> dict[str, Any]:
    """What the build holds (engine/ggml/build.sh writes it): ggml's version, its source, the backends built."""
    info: dict[str, Any] = json.loads(((root or HOME) / "build.json").read_text())
    return info


# ------------------------------------------------------------------------------------------------------ C types
R = TypeVar("R")
A1 = TypeVar("A1")
A2 = TypeVar("A2")
A3 = TypeVar("A3")
A4 = TypeVar("A4")
A5 = TypeVar("A5")
A6 = TypeVar("A6")
A7 = TypeVar("A7")
A8 = TypeVar("A8")
A9 = TypeVar("A9")
A10 = TypeVar("A10")


class C(Generic[R]):
    """A C type: how ctypes passes it (`ctype`) and how ggml's headers spell it (`spelling`); R is what Python sees."""

    __slots__ = ("ctype", "spelling")

    def __init__(self, ctype: Any, spelling: str) -> None:
        self.ctype = ctype
        self.spelling = spelling


GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64
GGML_MAX_N_THREADS = 512
GGML_MROPE_SECTIONS = 4


class ggml_tensor(ctypes.Structure):
    if TYPE_CHECKING:
        type: int
        buffer: int  # (the pointers read None when NULL)
        ne: ctypes.Array[ctypes.c_int64]
        nb: ctypes.Array[ctypes.c_size_t]
        op: int
        op_params: ctypes.Array[ctypes.c_int32]
        flags: int
        src: ctypes.Array[ctypes._Pointer[ggml_tensor]]
        view_src: ctypes._Pointer[ggml_tensor]
        view_offs: int
        data: int
        name: bytes
        extra: int


ggml_tensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
    ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(ggml_tensor) * GGML_MAX_SRC),
    ("view_src", ctypes.POINTER(ggml_tensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * GGML_MAX_NAME),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


class ggml_init_params(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]
    if TYPE_CHECKING:

        def __init__(self, mem_size: int = 0, mem_buffer: int | None = None, no_alloc: bool = False) -> None: ...


class ggml_threadpool_params(ctypes.Structure):
    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]
    if TYPE_CHECKING:
        n_threads: int
        poll: int


class ggml_cplan(ctypes.Structure):
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]
    if TYPE_CHECKING:
        work_size: int
        work_data: int


ggml_to_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class ggml_type_traits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ggml_to_float_t),
        ("from_float_ref", ctypes.c_void_p),
    ]
    if TYPE_CHECKING:
        type_name: bytes
        blck_size: int
        type_size: int
        is_quantized: bool
        to_float: Callable[[int, Any, int], None]


class ggml_type_traits_cpu(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]
    if TYPE_CHECKING:
        from_float: int | None
        vec_dot: int | None
        vec_dot_type: int
        nrows: int


# (struct, its C name) for the ABI test: every field's offset and size, and the struct's size
STRUCTS: list[tuple[type[ctypes.Structure], str]] = [
    (ggml_tensor, "struct ggml_tensor"),
    (ggml_init_params, "struct ggml_init_params"),
    (ggml_threadpool_params, "struct ggml_threadpool_params"),
    (ggml_cplan, "struct ggml_cplan"),
    (ggml_type_traits, "struct ggml_type_traits"),
    (ggml_type_traits_cpu, "struct ggml_type_traits_cpu"),
]

ggml_log_callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def log_callback(fn: Callable[[int, bytes | None, int | None], None] | int) -> Any:
    """A ggml_log_callback: a Python function (keep the result alive while ggml may call it) or a C function's
    address."""
    if isinstance(fn, int):
        return ctypes.cast(fn, ggml_log_callback)
    return ggml_log_callback(fn)


if TYPE_CHECKING:
    Tensor: TypeAlias = ctypes._Pointer[ggml_tensor]
else:
    Tensor = Any
# An opaque pointer (context, graph, backend, buffer, …) as ctypes hands it out: an int, or None for NULL, which
# callers test with `not` (typed int: every NULL result is a failure the caller checks for).
Handle: TypeAlias = int

VOID: C[None] = C(None, "void")
BOOL: C[bool] = C(ctypes.c_bool, "bool")
INT: C[int] = C(ctypes.c_int, "int")
INT32: C[int] = C(ctypes.c_int32, "int32_t")
INT64: C[int] = C(ctypes.c_int64, "int64_t")
UINT8: C[int] = C(ctypes.c_uint8, "uint8_t")
UINT32: C[int] = C(ctypes.c_uint32, "uint32_t")
SIZE: C[int] = C(ctypes.c_size_t, "size_t")
FLOAT: C[float] = C(ctypes.c_float, "float")
STR: C[bytes] = C(ctypes.c_char_p, "const char *")
OPT_STR: C[bytes | None] = C(ctypes.c_char_p, "const char *")
PTR: C[Handle] = C(ctypes.c_void_p, "void *")
OPT_PTR: C[Handle | None] = C(ctypes.c_void_p, "void *")
CPTR: C[Handle] = C(ctypes.c_void_p, "const void *")
CFLOATS: C[Any] = C(ctypes.POINTER(ctypes.c_float), "const float *")
CINTS: C[Any] = C(ctypes.POINTER(ctypes.c_int), "const int *")
SIZES: C[Any] = C(ctypes.POINTER(ctypes.c_size_t), "size_t *")
SECTIONS: C[Any] = C(ctypes.POINTER(ctypes.c_int), "int *")  # int sections[GGML_MROPE_SECTIONS]
TYPE: C[int] = C(ctypes.c_int, "enum ggml_type")
PREC: C[int] = C(ctypes.c_int, "enum ggml_prec")
POOL: C[int] = C(ctypes.c_int, "enum ggml_op_pool")
STATUS: C[int] = C(ctypes.c_int, "enum ggml_status")
USAGE: C[int] = C(ctypes.c_int, "enum ggml_backend_buffer_usage")
DEV_TYPE: C[int] = C(ctypes.c_int, "enum ggml_backend_dev_type")
TENSOR: C[Tensor] = C(ctypes.POINTER(ggml_tensor), "struct ggml_tensor *")
CTENSOR: C[Tensor] = C(ctypes.POINTER(ggml_tensor), "const struct ggml_tensor *")
CONTEXT: C[Handle] = C(ctypes.c_void_p, "struct ggml_context *")
CCONTEXT: C[Handle] = C(ctypes.c_void_p, "const struct ggml_context *")
CGRAPH: C[Handle] = C(ctypes.c_void_p, "struct ggml_cgraph *")
CCGRAPH: C[Handle] = C(ctypes.c_void_p, "const struct ggml_cgraph *")
THREADPOOL: C[Handle] = C(ctypes.c_void_p, "struct ggml_threadpool *")
BACKEND: C[Handle] = C(ctypes.c_void_p, "ggml_backend_t")
BACKENDS: C[Any] = C(ctypes.POINTER(ctypes.c_void_p), "ggml_backend_t *")
BUFFER: C[Handle] = C(ctypes.c_void_p, "ggml_backend_buffer_t")
SBUFFER: C[Handle] = C(ctypes.c_void_p, "struct ggml_backend_buffer *")
BUFT: C[Handle] = C(ctypes.c_void_p, "ggml_backend_buffer_type_t")
BUFTS: C[Any] = C(ctypes.POINTER(ctypes.c_void_p), "ggml_backend_buffer_type_t *")
DEVICE: C[Handle] = C(ctypes.c_void_p, "ggml_backend_dev_t")
REG: C[Handle] = C(ctypes.c_void_p, "ggml_backend_reg_t")
SCHED: C[Handle] = C(ctypes.c_void_p, "ggml_backend_sched_t")
GALLOCR: C[Handle] = C(ctypes.c_void_p, "ggml_gallocr_t")
INIT_PARAMS: C[ggml_init_params] = C(ggml_init_params, "struct ggml_init_params")
TP_PARAMS: C[ggml_threadpool_params] = C(ggml_threadpool_params, "struct ggml_threadpool_params")
TP_PARAMS_P: C[Any] = C(ctypes.POINTER(ggml_threadpool_params), "struct ggml_threadpool_params *")
CPLAN: C[ggml_cplan] = C(ggml_cplan, "struct ggml_cplan")
CPLAN_P: C[Any] = C(ctypes.POINTER(ggml_cplan), "struct ggml_cplan *")
TRAITS: C[ctypes._Pointer[ggml_type_traits]] = C(ctypes.POINTER(ggml_type_traits), "const struct ggml_type_traits *")
TRAITS_CPU: C[ctypes._Pointer[ggml_type_traits_cpu]] = C(
    ctypes.POINTER(ggml_type_traits_cpu), "const struct ggml_type_traits_cpu *"
)
LOG_CALLBACK: C[Any] = C(ggml_log_callback, "ggml_log_callback")


# ------------------------------------------------------------------------------------------------ constants
# Every constant the engine uses, with its value: the ABI test checks each against the headers.
CONSTANTS: dict[str, int] = {
    "GGML_TYPE_F32": 0,
    "GGML_TYPE_F16": 1,
    "GGML_TYPE_Q4_0": 2,
    "GGML_TYPE_Q8_0": 8,
    "GGML_TYPE_Q4_K": 12,
    "GGML_TYPE_Q6_K": 14,
    "GGML_TYPE_I8": 24,
    "GGML_TYPE_I32": 26,
    "GGML_TYPE_I64": 27,
    "GGML_TYPE_BF16": 30,
    "GGML_TYPE_MXFP4": 39,
    "GGML_TYPE_COUNT": 43,
    "GGML_OP_NONE": 0,
    "GGML_PREC_F32": 10,
    "GGML_OP_POOL_AVG": 1,
    "GGML_ROPE_TYPE_NORMAL": 0,
    "GGML_ROPE_TYPE_NEOX": 2,
    "GGML_ROPE_TYPE_IMROPE": 40,
    "GGML_ROPE_TYPE_VISION": 24,
    "GGML_SCALE_MODE_BILINEAR": 1,
    "GGML_SCALE_FLAG_ALIGN_CORNERS": 256,
    "GGML_STATUS_SUCCESS": 0,
    "GGML_LOG_LEVEL_DEBUG": 1,
    "GGML_BACKEND_BUFFER_USAGE_WEIGHTS": 1,
    "GGML_BACKEND_BUFFER_USAGE_COMPUTE": 2,
    "GGML_BACKEND_DEVICE_TYPE_CPU": 0,
    "GGML_BACKEND_DEVICE_TYPE_GPU": 1,
    "GGML_BACKEND_DEVICE_TYPE_IGPU": 2,
    "GGML_BACKEND_DEVICE_TYPE_ACCEL": 3,
    "GGML_MAX_DIMS": GGML_MAX_DIMS,
    "GGML_MAX_SRC": GGML_MAX_SRC,
    "GGML_MAX_OP_PARAMS": GGML_MAX_OP_PARAMS,
    "GGML_MAX_NAME": GGML_MAX_NAME,
    "GGML_MAX_N_THREADS": GGML_MAX_N_THREADS,
    "GGML_MROPE_SECTIONS": GGML_MROPE_SECTIONS,
}
GGML_TYPE_F32 = CONSTANTS["GGML_TYPE_F32"]
GGML_TYPE_F16 = CONSTANTS["GGML_TYPE_F16"]
GGML_TYPE_Q4_0 = CONSTANTS["GGML_TYPE_Q4_0"]
GGML_TYPE_Q8_0 = CONSTANTS["GGML_TYPE_Q8_0"]
GGML_TYPE_Q4_K = CONSTANTS["GGML_TYPE_Q4_K"]
GGML_TYPE_Q6_K = CONSTANTS["GGML_TYPE_Q6_K"]
GGML_TYPE_I8 = CONSTANTS["GGML_TYPE_I8"]
GGML_TYPE_I32 = CONSTANTS["GGML_TYPE_I32"]
GGML_TYPE_I64 = CONSTANTS["GGML_TYPE_I64"]
GGML_TYPE_BF16 = CONSTANTS["GGML_TYPE_BF16"]
GGML_TYPE_MXFP4 = CONSTANTS["GGML_TYPE_MXFP4"]
GGML_TYPE_COUNT = CONSTANTS["GGML_TYPE_COUNT"]
GGML_OP_NONE = CONSTANTS["GGML_OP_NONE"]
GGML_PREC_F32 = CONSTANTS["GGML_PREC_F32"]
GGML_OP_POOL_AVG = CONSTANTS["GGML_OP_POOL_AVG"]
GGML_ROPE_TYPE_NORMAL = CONSTANTS["GGML_ROPE_TYPE_NORMAL"]
GGML_ROPE_TYPE_NEOX = CONSTANTS["GGML_ROPE_TYPE_NEOX"]
GGML_ROPE_TYPE_IMROPE = CONSTANTS["GGML_ROPE_TYPE_IMROPE"]
GGML_ROPE_TYPE_VISION = CONSTANTS["GGML_ROPE_TYPE_VISION"]  # 2-D RoPE of image patches (Qwen-VL encoders)
GGML_SCALE_MODE_BILINEAR = CONSTANTS["GGML_SCALE_MODE_BILINEAR"]
GGML_SCALE_FLAG_ALIGN_CORNERS = CONSTANTS["GGML_SCALE_FLAG_ALIGN_CORNERS"]
GGML_STATUS_SUCCESS = CONSTANTS["GGML_STATUS_SUCCESS"]
GGML_LOG_LEVEL_DEBUG = CONSTANTS["GGML_LOG_LEVEL_DEBUG"]
GGML_BACKEND_BUFFER_USAGE_WEIGHTS = CONSTANTS["GGML_BACKEND_BUFFER_USAGE_WEIGHTS"]
GGML_BACKEND_BUFFER_USAGE_COMPUTE = CONSTANTS["GGML_BACKEND_BUFFER_USAGE_COMPUTE"]
DEVICE_TYPES = {
    CONSTANTS["GGML_BACKEND_DEVICE_TYPE_CPU"]: "cpu",
    CONSTANTS["GGML_BACKEND_DEVICE_TYPE_GPU"]: "gpu",
    CONSTANTS["GGML_BACKEND_DEVICE_TYPE_IGPU"]: "igpu",
    CONSTANTS["GGML_BACKEND_DEVICE_TYPE_ACCEL"]: "accel",
}


# ------------------------------------------------------------------------------------------------- loading
def _load(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise GgmlMissing(f"cannot load ggml ({path}): {e}") from e


HOME = home()
if not (HOME / "lib" / CORE_LIBS[1]).is_file():
    raise GgmlMissing(f"ggml is not built here ({HOME}): run ./dev setup (or engine/ggml/build.sh {HOME})")
_base = _load(HOME / "lib" / CORE_LIBS[0])
_ggml = _load(HOME / "lib" / CORE_LIBS[1])
# ------------------------------------------------------------------------------------------------ declarations
# name -> (library, return spelling, argument spellings): what the ABI test compiles
DECLARED: dict[str, tuple[str, str, tuple[str, ...]]] = {}


class _Lib:
    def __init__(self, tag: str, lib: ctypes.CDLL) -> None:
        self.tag, self.lib = tag, lib

    @overload
    def fn(self, name: str, ret: C[R], /) -> Callable[[], R]: ...
    @overload
    def fn(self, name: str, ret: C[R], a1: C[A1], /) -> Callable[[A1], R]: ...
    @overload
    def fn(self, name: str, ret: C[R], a1: C[A1], a2: C[A2], /) -> Callable[[A1, A2], R]: ...
    @overload
    def fn(self, name: str, ret: C[R], a1: C[A1], a2: C[A2], a3: C[A3], /) -> Callable[[A1, A2, A3], R]: ...
    @overload
    def fn(
        self, name: str, ret: C[R], a1: C[A1], a2: C[A2], a3: C[A3], a4: C[A4], /
    ) -> Callable[[A1, A2, A3, A4], R]: ...
    @overload
    def fn(
        self, name: str, ret: C[R], a1: C[A1], a2: C[A2], a3: C[A3], a4: C[A4], a5: C[A5], /
    ) -> Callable[[A1, A2, A3, A4, A5], R]: ...
    @overload
    def fn(
        self, name: str, ret: C[R], a1: C[A1], a2: C[A2], a3: C[A3], a4: C[A4], a5: C[A5], a6: C[A6], /
    ) -> Callable[[A1, A2, A3, A4, A5, A6], R]: ...
    @overload
    def fn(
        self, name: str, ret: C[R], a1: C[A1], a2: C[A2], a3: C[A3], a4: C[A4], a5: C[A5], a6: C[A6], a7: C[A7], /
    ) -> Callable[[A1, A2, A3, A4, A5, A6, A7], R]: ...
    @overload
    def fn(
        self,
        name: str,
        ret: C[R],
        a1: C[A1],
        a2: C[A2],
        a3: C[A3],
        a4: C[A4],
        a5: C[A5],
        a6: C[A6],
        a7: C[A7],
        a8: C[A8],
        /,
    ) -> Callable[[A1, A2, A3, A4, A5, A6, A7, A8], R]: ...
    @overload
    def fn(
        self,
        name: str,
        ret: C[R],
        a1: C[A1],
        a2: C[A2],
        a3: C[A3],
        a4: C[A4],
        a5: C[A5],
        a6: C[A6],
        a7: C[A7],
        a8: C[A8],
        a9: C[A9],
        /,
    ) -> Callable[[A1, A2, A3, A4, A5, A6, A7, A8, A9], R]: ...
    @overload
    def fn(
        self,
        name: str,
        ret: C[R],
        a1: C[A1],
        a2: C[A2],
        a3: C[A3],
        a4: C[A4],
        a5: C[A5],
        a6: C[A6],
        a7: C[A7],
        a8: C[A8],
        a9: C[A9],
        a10: C[A10],
        /,
    ) -> Callable[[A1, A2, A3, A4, A5, A6, A7, A8, A9, A10], R]: ...
    @overload
    def fn(self, name: str, ret: C[R], /, *args: C[Any]) -> Callable[..., R]: ...

    def fn(self, name: str, ret: C[Any], /, *args: C[Any]) -> Callable[..., Any]:
        f = getattr(self.lib, name)
        f.restype = ret.ctype
        f.argtypes = [a.ctype for a in args]
        DECLARED[name] = (self.tag, ret.spelling, tuple(a.spelling for a in args))
        return f  # type: ignore[no-any-return]


_g = _Lib("ggml", _ggml)  # ggml.h, ggml-alloc.h, ggml-backend.h (libggml and the libggml-base it links)

# ---- contexts, tensors, types (ggml.h)
ggml_init = _g.fn("ggml_init", CONTEXT, INIT_PARAMS)
ggml_free = _g.fn("ggml_free", VOID, CONTEXT)
ggml_used_mem = _g.fn("ggml_used_mem", SIZE, CCONTEXT)  # (tests: what a graph took of its context)
ggml_reset = _g.fn("ggml_reset", VOID, CONTEXT)
ggml_tensor_overhead = _g.fn("ggml_tensor_overhead", SIZE)
ggml_graph_overhead_custom = _g.fn("ggml_graph_overhead_custom", SIZE, SIZE, BOOL)
ggml_new_tensor_1d = _g.fn("ggml_new_tensor_1d", TENSOR, CONTEXT, TYPE, INT64)
ggml_new_tensor_2d = _g.fn("ggml_new_tensor_2d", TENSOR, CONTEXT, TYPE, INT64, INT64)
ggml_new_tensor_3d = _g.fn("ggml_new_tensor_3d", TENSOR, CONTEXT, TYPE, INT64, INT64, INT64)
ggml_new_tensor_4d = _g.fn("ggml_new_tensor_4d", TENSOR, CONTEXT, TYPE, INT64, INT64, INT64, INT64)
ggml_nbytes = _g.fn("ggml_nbytes", SIZE, CTENSOR)
ggml_row_size = _g.fn("ggml_row_size", SIZE, TYPE, INT64)
ggml_type_name = _g.fn("ggml_type_name", STR, TYPE)
ggml_op_desc = _g.fn("ggml_op_desc", STR, CTENSOR)
ggml_is_contiguous = _g.fn("ggml_is_contiguous", BOOL, CTENSOR)
ggml_set_name = _g.fn("ggml_set_name", TENSOR, TENSOR, STR)
ggml_set_input = _g.fn("ggml_set_input", VOID, TENSOR)
ggml_set_output = _g.fn("ggml_set_output", VOID, TENSOR)
ggml_get_type_traits = _g.fn("ggml_get_type_traits", TRAITS, TYPE)
ggml_quantize_chunk = _g.fn("ggml_quantize_chunk", SIZE, TYPE, CFLOATS, PTR, INT64, INT64, INT64, CFLOATS)
ggml_log_set = _g.fn("ggml_log_set", VOID, LOG_CALLBACK, OPT_PTR)
ggml_status_to_string = _g.fn("ggml_status_to_string", STR, STATUS)

# ---- graphs
ggml_new_graph_custom = _g.fn("ggml_new_graph_custom", CGRAPH, CONTEXT, SIZE, BOOL)
ggml_build_forward_expand = _g.fn("ggml_build_forward_expand", VOID, CGRAPH, TENSOR)
ggml_graph_n_nodes = _g.fn("ggml_graph_n_nodes", INT, CGRAPH)
ggml_graph_node = _g.fn("ggml_graph_node", TENSOR, CGRAPH, INT)
ggml_threadpool_params_default = _g.fn("ggml_threadpool_params_default", TP_PARAMS, INT)

# ---- operations
ggml_add = _g.fn("ggml_add", TENSOR, CONTEXT, TENSOR, TENSOR)
ggml_add_id = _g.fn("ggml_add_id", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR)
ggml_sub = _g.fn("ggml_sub", TENSOR, CONTEXT, TENSOR, TENSOR)  # (Gemma 4's encoder: x − std_bias)
ggml_mul = _g.fn("ggml_mul", TENSOR, CONTEXT, TENSOR, TENSOR)
ggml_div = _g.fn("ggml_div", TENSOR, CONTEXT, TENSOR, TENSOR)
ggml_scale = _g.fn("ggml_scale", TENSOR, CONTEXT, TENSOR, FLOAT)
ggml_clamp = _g.fn("ggml_clamp", TENSOR, CONTEXT, TENSOR, FLOAT, FLOAT)
ggml_sum_rows = _g.fn("ggml_sum_rows", TENSOR, CONTEXT, TENSOR)
ggml_sigmoid = _g.fn("ggml_sigmoid", TENSOR, CONTEXT, TENSOR)
ggml_silu = _g.fn("ggml_silu", TENSOR, CONTEXT, TENSOR)
ggml_softplus = _g.fn("ggml_softplus", TENSOR, CONTEXT, TENSOR)
ggml_sqrt = _g.fn("ggml_sqrt", TENSOR, CONTEXT, TENSOR)  # (DeepSeek V4's sqrt-softplus router)
ggml_abs = _g.fn("ggml_abs", TENSOR, CONTEXT, TENSOR)  # (qwen4exp's n-gram gate: a signed square root)
ggml_sgn = _g.fn("ggml_sgn", TENSOR, CONTEXT, TENSOR)
ggml_relu = _g.fn("ggml_relu", TENSOR, CONTEXT, TENSOR)  # (qwen4exp's QSA indexer: each head's scores)
ggml_scale_bias = _g.fn("ggml_scale_bias", TENSOR, CONTEXT, TENSOR, FLOAT, FLOAT)  # a·s + b
ggml_tanh = _g.fn("ggml_tanh", TENSOR, CONTEXT, TENSOR)
ggml_swiglu_split = _g.fn("ggml_swiglu_split", TENSOR, CONTEXT, TENSOR, TENSOR)
ggml_geglu_split = _g.fn("ggml_geglu_split", TENSOR, CONTEXT, TENSOR, TENSOR)
ggml_swiglu_oai = _g.fn("ggml_swiglu_oai", TENSOR, CONTEXT, TENSOR, TENSOR, FLOAT, FLOAT)
# silu(min(gate, limit)) · clamp(up, ±limit): the gate clamped before the SiLU (DeepSeek V4)
ggml_swiglu_clamp = _g.fn("ggml_swiglu_clamp", TENSOR, CONTEXT, TENSOR, TENSOR, FLOAT)
ggml_rms_norm = _g.fn("ggml_rms_norm", TENSOR, CONTEXT, TENSOR, FLOAT)
ggml_norm = _g.fn("ggml_norm", TENSOR, CONTEXT, TENSOR, FLOAT)  # LayerNorm (GLM-5's indexer keys)
# image encoders (vision/): the patch convolution, the ViT's activation, learned positions resized to the grid
ggml_conv_2d = _g.fn("ggml_conv_2d", TENSOR, CONTEXT, TENSOR, TENSOR, INT, INT, INT, INT, INT, INT)
ggml_gelu = _g.fn("ggml_gelu", TENSOR, CONTEXT, TENSOR)
# (Gemma 4's encoder: clip's default activation, gelu_quick, gated; its pooler's average over n×n patches)
ggml_geglu_quick_split = _g.fn("ggml_geglu_quick_split", TENSOR, CONTEXT, TENSOR, TENSOR)
ggml_pool_2d = _g.fn("ggml_pool_2d", TENSOR, CONTEXT, TENSOR, POOL, INT, INT, INT, INT, FLOAT, FLOAT)
ggml_interpolate = _g.fn("ggml_interpolate", TENSOR, CONTEXT, TENSOR, INT64, INT64, INT64, INT64, UINT32)
ggml_mul_mat = _g.fn("ggml_mul_mat", TENSOR, CONTEXT, TENSOR, TENSOR)
ggml_mul_mat_id = _g.fn("ggml_mul_mat_id", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR)
ggml_prec_set_acc = _g.fn("ggml_prec_set_acc", BOOL, TENSOR, PREC)
ggml_get_rows = _g.fn("ggml_get_rows", TENSOR, CONTEXT, TENSOR, TENSOR)
ggml_set_rows = _g.fn("ggml_set_rows", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR)
ggml_cpy = _g.fn("ggml_cpy", TENSOR, CONTEXT, TENSOR, TENSOR)
ggml_cast = _g.fn("ggml_cast", TENSOR, CONTEXT, TENSOR, TYPE)
ggml_cont = _g.fn("ggml_cont", TENSOR, CONTEXT, TENSOR)
ggml_cont_2d = _g.fn("ggml_cont_2d", TENSOR, CONTEXT, TENSOR, INT64, INT64)
ggml_cont_3d = _g.fn("ggml_cont_3d", TENSOR, CONTEXT, TENSOR, INT64, INT64, INT64)
ggml_concat = _g.fn("ggml_concat", TENSOR, CONTEXT, TENSOR, TENSOR, INT)
ggml_repeat_4d = _g.fn("ggml_repeat_4d", TENSOR, CONTEXT, TENSOR, INT64, INT64, INT64, INT64)
ggml_pad = _g.fn("ggml_pad", TENSOR, CONTEXT, TENSOR, INT, INT, INT, INT)
ggml_fill = _g.fn("ggml_fill", TENSOR, CONTEXT, TENSOR, FLOAT)
ggml_arange = _g.fn("ggml_arange", TENSOR, CONTEXT, FLOAT, FLOAT, FLOAT)  # F32 start, start + step, … < stop
ggml_reshape_2d = _g.fn("ggml_reshape_2d", TENSOR, CONTEXT, TENSOR, INT64, INT64)
ggml_reshape_3d = _g.fn("ggml_reshape_3d", TENSOR, CONTEXT, TENSOR, INT64, INT64, INT64)
ggml_reshape_4d = _g.fn("ggml_reshape_4d", TENSOR, CONTEXT, TENSOR, INT64, INT64, INT64, INT64)
ggml_view_1d = _g.fn("ggml_view_1d", TENSOR, CONTEXT, TENSOR, INT64, SIZE)
ggml_view_2d = _g.fn("ggml_view_2d", TENSOR, CONTEXT, TENSOR, INT64, INT64, SIZE, SIZE)
ggml_view_3d = _g.fn("ggml_view_3d", TENSOR, CONTEXT, TENSOR, INT64, INT64, INT64, SIZE, SIZE, SIZE)
ggml_view_4d = _g.fn("ggml_view_4d", TENSOR, CONTEXT, TENSOR, INT64, INT64, INT64, INT64, SIZE, SIZE, SIZE, SIZE)
ggml_permute = _g.fn("ggml_permute", TENSOR, CONTEXT, TENSOR, INT, INT, INT, INT)
ggml_transpose = _g.fn("ggml_transpose", TENSOR, CONTEXT, TENSOR)
ggml_soft_max = _g.fn("ggml_soft_max", TENSOR, CONTEXT, TENSOR)
ggml_soft_max_ext = _g.fn("ggml_soft_max_ext", TENSOR, CONTEXT, TENSOR, TENSOR, FLOAT, FLOAT)
ggml_soft_max_ext_inplace = _g.fn("ggml_soft_max_ext_inplace", TENSOR, CONTEXT, TENSOR, TENSOR, FLOAT, FLOAT)
ggml_soft_max_add_sinks = _g.fn("ggml_soft_max_add_sinks", VOID, TENSOR, TENSOR)
ggml_argsort_top_k = _g.fn("ggml_argsort_top_k", TENSOR, CONTEXT, TENSOR, INT)
# the k largest of each row, in no particular order (the DSA indexer's picks)
ggml_top_k = _g.fn("ggml_top_k", TENSOR, CONTEXT, TENSOR, INT)
# DSA's indexer scores: sum over heads of weight · relu(q · k) plus an F16 mask (q, k, weights, mask)
ggml_lightning_indexer = _g.fn("ggml_lightning_indexer", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR, TENSOR)
# [n_embd, hc, n] weighted by [hc, n] and summed over hc (DeepSeek V4's hyper-connections; Kimi K3's residual mix)
ggml_dsv4_hc_pre = _g.fn("ggml_dsv4_hc_pre", TENSOR, CONTEXT, TENSOR, TENSOR)
# the Sinkhorn-normalised stream mix [hc, hc, n] from the mixes [(2 + hc) hc, n], scale [3], base, eps, iterations
ggml_dsv4_hc_comb = _g.fn("ggml_dsv4_hc_comb", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR, FLOAT, INT32)
# the streams [n_embd, hc, n] after a sublayer: out [n_embd, n] · post [hc, n] + residual mixed by comb
ggml_dsv4_hc_post = _g.fn("ggml_dsv4_hc_post", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR, TENSOR)
# RoPE's scaling arguments after n_ctx_orig: freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow
_ROPE_SCALING = (FLOAT,) * 6
ggml_rope_ext = _g.fn("ggml_rope_ext", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR, INT, INT, INT, *_ROPE_SCALING)
ggml_rope_ext_back = _g.fn(  # the inverse rotation (DeepSeek V4 de-ropes its attention output)
    "ggml_rope_ext_back", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR, INT, INT, INT, *_ROPE_SCALING
)
# a rope node rotates dims [offset, offset + n_dims) instead of the first n_dims
ggml_rope_set_offset = _g.fn("ggml_rope_set_offset", TENSOR, TENSOR, INT)
ggml_rope_multi = _g.fn(
    "ggml_rope_multi", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR, INT, SECTIONS, INT, INT, *_ROPE_SCALING
)
ggml_flash_attn_ext = _g.fn("ggml_flash_attn_ext", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR, TENSOR, FLOAT, FLOAT, FLOAT)
ggml_flash_attn_ext_add_sinks = _g.fn("ggml_flash_attn_ext_add_sinks", VOID, TENSOR, TENSOR)
ggml_ssm_conv = _g.fn("ggml_ssm_conv", TENSOR, CONTEXT, TENSOR, TENSOR)
ggml_gated_delta_net = _g.fn(
    "ggml_gated_delta_net", TENSOR, CONTEXT, TENSOR, TENSOR, TENSOR, TENSOR, TENSOR, TENSOR, INT64
)

# ---- graph allocation (ggml-alloc.h)
ggml_gallocr_new = _g.fn("ggml_gallocr_new", GALLOCR, BUFT)
ggml_gallocr_free = _g.fn("ggml_gallocr_free", VOID, GALLOCR)
ggml_gallocr_reserve = _g.fn("ggml_gallocr_reserve", BOOL, GALLOCR, CGRAPH)
ggml_gallocr_reserve_n_size = _g.fn("ggml_gallocr_reserve_n_size", VOID, GALLOCR, CGRAPH, CINTS, CINTS, SIZES)
ggml_gallocr_alloc_graph = _g.fn("ggml_gallocr_alloc_graph", BOOL, GALLOCR, CGRAPH)
ggml_gallocr_get_buffer_size = _g.fn("ggml_gallocr_get_buffer_size", SIZE, GALLOCR, INT)
ggml_backend_alloc_ctx_tensors_from_buft = _g.fn("ggml_backend_alloc_ctx_tensors_from_buft", SBUFFER, CONTEXT, BUFT)
ggml_backend_alloc_ctx_tensors_from_buft_size = _g.fn(
    "ggml_backend_alloc_ctx_tensors_from_buft_size", SIZE, CONTEXT, BUFT
)

# ---- buffers, tensors' data, backends (ggml-backend.h)
ggml_backend_buft_name = _g.fn("ggml_backend_buft_name", STR, BUFT)
ggml_backend_buft_alloc_buffer = _g.fn("ggml_backend_buft_alloc_buffer", BUFFER, BUFT, SIZE)
ggml_backend_buffer_free = _g.fn("ggml_backend_buffer_free", VOID, BUFFER)
ggml_backend_buffer_get_base = _g.fn("ggml_backend_buffer_get_base", PTR, BUFFER)
ggml_backend_buffer_get_size = _g.fn("ggml_backend_buffer_get_size", SIZE, BUFFER)
ggml_backend_buffer_get_alignment = _g.fn("ggml_backend_buffer_get_alignment", SIZE, BUFFER)
ggml_backend_buffer_get_alloc_size = _g.fn("ggml_backend_buffer_get_alloc_size", SIZE, BUFFER, CTENSOR)
ggml_backend_buffer_init_tensor = _g.fn("ggml_backend_buffer_init_tensor", STATUS, BUFFER, TENSOR)
ggml_backend_buffer_clear = _g.fn("ggml_backend_buffer_clear", VOID, BUFFER, UINT8)
ggml_backend_buffer_set_usage = _g.fn("ggml_backend_buffer_set_usage", VOID, BUFFER, USAGE)
ggml_backend_buffer_get_usage = _g.fn("ggml_backend_buffer_get_usage", USAGE, BUFFER)
ggml_backend_tensor_alloc = _g.fn("ggml_backend_tensor_alloc", STATUS, BUFFER, TENSOR, PTR)
ggml_backend_tensor_set = _g.fn("ggml_backend_tensor_set", VOID, TENSOR, CPTR, SIZE, SIZE)
ggml_backend_tensor_get = _g.fn("ggml_backend_tensor_get", VOID, CTENSOR, PTR, SIZE, SIZE)
ggml_backend_tensor_set_async = _g.fn("ggml_backend_tensor_set_async", VOID, BACKEND, TENSOR, CPTR, SIZE, SIZE)
ggml_backend_tensor_get_async = _g.fn("ggml_backend_tensor_get_async", VOID, BACKEND, CTENSOR, PTR, SIZE, SIZE)
ggml_backend_free = _g.fn("ggml_backend_free", VOID, BACKEND)
ggml_backend_synchronize = _g.fn("ggml_backend_synchronize", VOID, BACKEND)
ggml_backend_graph_compute = _g.fn("ggml_backend_graph_compute", STATUS, BACKEND, CGRAPH)
ggml_backend_graph_compute_async = _g.fn("ggml_backend_graph_compute_async", STATUS, BACKEND, CGRAPH)
ggml_backend_sched_new = _g.fn("ggml_backend_sched_new", SCHED, BACKENDS, BUFTS, INT, SIZE, BOOL, BOOL)
ggml_backend_sched_free = _g.fn("ggml_backend_sched_free", VOID, SCHED)
ggml_backend_sched_alloc_graph = _g.fn("ggml_backend_sched_alloc_graph", BOOL, SCHED, CGRAPH)
ggml_backend_sched_graph_compute = _g.fn("ggml_backend_sched_graph_compute", STATUS, SCHED, CGRAPH)
ggml_backend_sched_set_tensor_backend = _g.fn("ggml_backend_sched_set_tensor_backend", VOID, SCHED, TENSOR, BACKEND)
ggml_backend_sched_get_n_splits = _g.fn("ggml_backend_sched_get_n_splits", INT, SCHED)
ggml_backend_sched_get_buffer_size = _g.fn("ggml_backend_sched_get_buffer_size", SIZE, SCHED, BACKEND)

# ---- the registry: backends' modules and their devices
ggml_backend_load = _g.fn("ggml_backend_load", REG, STR)
ggml_backend_reg_name = _g.fn("ggml_backend_reg_name", STR, REG)
ggml_backend_reg_dev_get = _g.fn("ggml_backend_reg_dev_get", DEVICE, REG, SIZE)
ggml_backend_reg_get_proc_address = _g.fn("ggml_backend_reg_get_proc_address", PTR, REG, STR)
ggml_backend_dev_count = _g.fn("ggml_backend_dev_count", SIZE)
ggml_backend_dev_get = _g.fn("ggml_backend_dev_get", DEVICE, SIZE)
ggml_backend_dev_name = _g.fn("ggml_backend_dev_name", STR, DEVICE)
ggml_backend_dev_description = _g.fn("ggml_backend_dev_description", STR, DEVICE)
ggml_backend_dev_memory = _g.fn("ggml_backend_dev_memory", VOID, DEVICE, SIZES, SIZES)
ggml_backend_dev_type = _g.fn("ggml_backend_dev_type", DEV_TYPE, DEVICE)
ggml_backend_dev_backend_reg = _g.fn("ggml_backend_dev_backend_reg", REG, DEVICE)
ggml_backend_dev_init = _g.fn("ggml_backend_dev_init", BACKEND, DEVICE, OPT_STR)
ggml_backend_dev_buffer_type = _g.fn("ggml_backend_dev_buffer_type", BUFT, DEVICE)
ggml_backend_dev_host_buffer_type = _g.fn("ggml_backend_dev_host_buffer_type", BUFT, DEVICE)
ggml_backend_dev_supports_op = _g.fn("ggml_backend_dev_supports_op", BOOL, DEVICE, CTENSOR)
ggml_backend_cpu_buffer_from_ptr = _g.fn("ggml_backend_cpu_buffer_from_ptr", BUFFER, PTR, SIZE)
ggml_backend_cpu_buffer_type = _g.fn("ggml_backend_cpu_buffer_type", BUFT)


# ---- loading the backends
def cpu_variants(root: Path | None = None) -> dict[str, Path]:
    """The CPU backend's modules in the build, by level name (`haswell`: libggml-cpu-haswell.so)."""
    folder = (root or HOME) / "backends" / "cpu"
    prefix = f"{MODULE_PREFIX}cpu-"
    return {p.name[len(prefix) : -len(MODULE_SUFFIX)]: p for p in sorted(folder.glob(f"{prefix}*{MODULE_SUFFIX}"))}


def score(path: Path) -> int:
    """ggml's score of a CPU backend module on this CPU (0: it cannot run here), as ggml's loader reads it: the
    module is opened, asked and closed (its code for this level is never run)."""
    lib = ctypes.CDLL(str(path))
    try:
        fn = lib.ggml_backend_score
        fn.restype, fn.argtypes = ctypes.c_int, []
        return int(fn())
    finally:
        _ctypes.dlclose(lib._handle)


def choose_cpu_variant(variants: dict[str, Path], wanted: str | None) -> tuple[str, str]:
    """(level, why): the CPU backend to load. `wanted` (TOKENWING_CPU_VARIANT) is taken if it runs here."""
    if not variants:
        raise GgmlMissing(f"the ggml build in {HOME} has no CPU backend (backends/cpu/{MODULE_PREFIX}cpu-*)")
    scores = {name: score(path) for name, path in variants.items()}
    if wanted:
        if wanted not in variants:
            raise GgmlMissing(f"{ENV_CPU}={wanted} is not one of {', '.join(variants)}")
        if scores[wanted] == 0:
            raise GgmlMissing(f"{ENV_CPU}={wanted}: this CPU cannot run that level")
        return wanted, f"{ENV_CPU}={wanted}"
    best = max(scores, key=lambda n: scores[n])
    if scores[best] == 0:
        raise GgmlMissing("this CPU runs none of ggml's CPU backends (TokenWing needs an x86-64 CPU)")
    return best, "the best level this CPU runs"


LOAD_LOG: list[str] = []  # what ggml said while loading backends (why a GPU backend did not load, say)


def _capture_text(level: int, text: bytes | None, user: int | None) -> None:
    if text and level > GGML_LOG_LEVEL_DEBUG:
        LOAD_LOG.append(text.decode(errors="replace").strip())


_capture = log_callback(_capture_text)


def _quiet() -> None:
    """ggml's log from now on: everything but debug messages (one per repacked tensor, from I/O threads too),
    through a filter in the native core (a Python callback would need the GIL on ggml's threads)."""
    ggml_log_set(log_callback(_core.ggml_log_filter()), None)


def _load_backend(path: Path) -> int:
    """Registers a backend module with ggml, its messages captured in LOAD_LOG (0: it did not load)."""
    ggml_log_set(_capture, None)
    try:
        return int(ggml_backend_load(str(path).encode()) or 0)
    finally:
        _quiet()


CPU_VARIANT, CPU_VARIANT_WHY = choose_cpu_variant(cpu_variants(), os.environ.get(ENV_CPU, "").strip() or None)
CPU_REG = _load_backend(cpu_variants()[CPU_VARIANT])
if not CPU_REG:
    raise GgmlMissing(f"ggml could not load its CPU backend {cpu_variants()[CPU_VARIANT]}: {'; '.join(LOAD_LOG)}")
_cpu = _load(cpu_variants()[CPU_VARIANT])  # the same module ggml loaded (one copy): its CPU-only API


def available_gpu_backends(root: Path | None = None) -> list[str]:
    """GPU backends in the build (whether or not this machine has a device or driver for them)."""
    return [k for k in GPU_KINDS if list(((root or HOME) / "backends" / k).glob(f"{MODULE_PREFIX}*{MODULE_SUFFIX}"))]


_gpu_loaded: dict[str, bool] = {}


def load_gpu_backends() -> dict[str, bool]:
    """Registers the build's GPU backends with ggml, once: {kind: loaded}. A backend whose module cannot load
    (no Vulkan loader, no CUDA driver) is left out; ggml says nothing, the device list simply lacks it."""
    if not _gpu_loaded:
        for kind in available_gpu_backends():
            if kind == "vulkan" and os.environ.get(ENV_VULKAN, "").strip() == "0":
                _gpu_loaded[kind] = False
                continue
            path = next(iter((HOME / "backends" / kind).glob(f"{MODULE_PREFIX}*{MODULE_SUFFIX}")))
            _gpu_loaded[kind] = bool(_load_backend(path))
        _gpu_loaded.setdefault("", False)  # (asked once, even where the build has none)
    return {k: v for k, v in _gpu_loaded.items() if k}


_c = _Lib("cpu", _cpu)  # ggml-cpu.h: the CPU backend module

# ---- the CPU backend (ggml-cpu.h, in the CPU module)
ggml_threadpool_new = _c.fn("ggml_threadpool_new", THREADPOOL, TP_PARAMS_P)
ggml_threadpool_free = _c.fn("ggml_threadpool_free", VOID, THREADPOOL)
ggml_graph_plan = _c.fn("ggml_graph_plan", CPLAN, CCGRAPH, INT, THREADPOOL)
ggml_graph_compute = _c.fn("ggml_graph_compute", STATUS, CGRAPH, CPLAN_P)
ggml_get_type_traits_cpu = _c.fn("ggml_get_type_traits_cpu", TRAITS_CPU, TYPE)
ggml_backend_cpu_init = _c.fn("ggml_backend_cpu_init", BACKEND)
ggml_backend_cpu_reg = _c.fn("ggml_backend_cpu_reg", REG)
ggml_backend_cpu_set_n_threads = _c.fn("ggml_backend_cpu_set_n_threads", VOID, BACKEND, INT)


def address_of(name: str) -> int:
    """The address of a declared ggml function, for native code that calls it (the streaming core's I/O threads
    repack experts through ggml_backend_tensor_set)."""
    lib = _cpu if DECLARED[name][0] == "cpu" else _ggml
    return int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0)


def c_declarations() -> str:
    """Every declared function as a C prototype: compiled after ggml's headers, a prototype that does not match
    the header's is an error ("conflicting types")."""
    return "\n".join(f"{ret} {name}({', '.join(args) or 'void'});" for name, (_, ret, args) in DECLARED.items())
