"""What every image encoder shares (issue 45): an mmproj GGUF's clip keys and its F32/F16 weights mapped as ggml
tensors, the graph's run and its output rows, and the ViT pieces libmtmd's clip_graph builds for all of them
(tools/mtmd/clip.cpp: build_norm, build_attn without flash attention and without a mask, build_ffn). A family's
encoder (vision/qwen3vl.py, vision/pixtral.py, …) subclasses `MmprojEncoder` with its projector name, its token
budget and its graph."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.compute import ggml_api as ggml
from tokenwing.compute.backend import DeviceError
from tokenwing.compute.ggml_lib import F16, F32, Graph, Tensor, TensorArena
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import GGUFHeader, read_header
from tokenwing.vision.device import EncoderBackend, cpu_backend
from tokenwing.vision.image import ImageLimits, Preprocessed, preprocess, target_size


@dataclass(frozen=True)
class VisionHParams:
    n_embd: int
    n_head: int
    n_ff: int
    n_layer: int
    patch_size: int
    n_merge: int
    eps: float
    proj_dim: int  # the text model's width
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    gelu: bool  # clip.use_gelu: ggml_gelu (Qwen3-VL's)
    silu: bool  # clip.use_silu: SiLU, gated where the block has ffn_gate (Pixtral's); neither: gelu_quick


def read_hparams(h: GGUFHeader, default_merge: int) -> VisionHParams:
    def need(key: str) -> Any:
        v = h.get(key)
        if v is None:
            raise BadInputError(f"{h.path}: mmproj lacks {key}")
        return v

    mean = [float(x) for x in need("clip.vision.image_mean")]
    std = [float(x) for x in need("clip.vision.image_std")]
    return VisionHParams(
        n_embd=int(need("clip.vision.embedding_length")),
        n_head=int(need("clip.vision.attention.head_count")),
        n_ff=int(need("clip.vision.feed_forward_length")),
        n_layer=int(need("clip.vision.block_count")),
        patch_size=int(need("clip.vision.patch_size")),
        n_merge=int(h.get("clip.vision.spatial_merge_size", default_merge)),
        eps=float(need("clip.vision.attention.layer_norm_epsilon")),
        proj_dim=int(need("clip.vision.projection_dim")),
        mean=(mean[0], mean[1], mean[2]),
        std=(std[0], std[1], std[2]),
        gelu=bool(h.get("clip.use_gelu", False)),
        silu=bool(h.get("clip.use_silu", False)),
    )


def projector_of(h: GGUFHeader) -> str | None:
    kind = h.get("clip.projector_type") or h.get("clip.vision.projector_type")
    return str(kind) if kind is not None else None


class MmprojEncoder:
    """An mmproj file's weights (mapped, F32 or F16) and what runs its graph; `encode` gives the text model's input
    rows for a preprocessed image."""

    projector = ""  # clip.projector_type
    default_merge = 1  # clip.vision.spatial_merge_size when the file has none (llama.cpp's per projector)
    archs: tuple[str, ...] = ()  # the text families that take its rows
    # the texts libmtmd tokenizes before and after an image (each apart; "" none), and whether the text model
    # places the rows by M-RoPE (vision/positions.py) or as tokens, one position a row
    begin, end = "", ""
    mrope = False

    def bidirectional(self, n_embd_text: int) -> bool:
        """Whether the text model's rows of an image attend to one another both ways (mtmd_decode_use_non_causal)."""
        return False

    def __init__(self, path: str, n_threads: int = 2) -> None:
        h = read_header(path)
        kind = projector_of(h)
        if kind != self.projector:
            raise BadInputError(
                f"{path}: an mmproj of projector {kind!r}; {type(self).__name__} encodes {self.projector}"
            )
        self.hp = read_hparams(h, self.default_merge)
        if self.hp.n_head < 1 or self.hp.n_embd % self.hp.n_head:
            raise BadInputError(f"{path}: {self.hp.n_head} heads do not divide the encoder's width {self.hp.n_embd}")
        self.path = path
        self.n_threads = n_threads
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._arena = TensorArena(len(h.tensors) + 8)
        self._w: dict[str, Tensor] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._raw: dict[str, tuple[np.ndarray, int]] = {}
        for t in h.tensors:
            if t.type not in (F32, F16):
                raise BadInputError(f"{path}: {t.name} is {t.type_name}; the image encoder reads F32 and F16")
            start = h.data_start + t.offset
            raw = self._map[start : start + t.nbytes]
            self._w[t.name] = self._arena.wrap(np.asarray(raw), t.type, t.shape, owner=self._map)
            self._shapes[t.name] = t.shape
            self._raw[t.name] = (raw, t.type)
        self.width = self.hp.proj_dim  # a row's width (Qwen3-VL's deepstack widens it)
        # where it computes (vision/device.py): the device's copy of the weights, None: the CPU over the mapped
        # file; `sizing`: the backend a graph is measured on instead of computed (`sized`: its bytes)
        self.device: EncoderBackend | None = None
        self.where = "vision encoder on CPU"
        self.log: Callable[[str], None] = lambda line: None
        self._cpu_w = self._w
        self.sizing: EncoderBackend | None = None
        self.sized = 0

    def weights_on(self, device: EncoderBackend | None, where: str) -> None:
        """The graphs read `device`'s weights from now on (None: the mapped file's); `where`: the line saying so
        ("": the line as it is)."""
        self.device, self.where = device, where or self.where  # (the device's copy stays: vision/device.resident)
        self._w = device.weights if device is not None else self._cpu_w

    def to_cpu(self, why: str) -> None:
        self.weights_on(None, f"vision encoder on CPU: {why}")
        self.log(self.where)

    def need(self, *names: str) -> None:
        for name in names:
            if name not in self._w:
                raise BadInputError(f"{self.path}: the {self.projector} encoder needs {name}")

    def array(self, name: str) -> np.ndarray:
        """A weight's values as float32 (flat), read from the file."""
        raw, kind = self._raw[name]
        return np.asarray(raw).view(np.float16 if kind == F16 else np.float32).astype(np.float32)

    def limits(self) -> ImageLimits:
        raise NotImplementedError

    def preprocess(self, rgb: np.ndarray) -> Preprocessed:
        return preprocess(rgb, self.limits(), self.hp.mean, self.hp.std)

    def grid(self, image: Preprocessed) -> tuple[int, int]:
        """(nx, ny): the image's merged patches across and down."""
        side = self.hp.patch_size * self.hp.n_merge
        return image.width // side, image.height // side

    def grid_of(self, width: int, height: int) -> tuple[int, int]:
        """(nx, ny) for an image of width × height pixels, without preprocessing it."""
        side = self.hp.patch_size * self.hp.n_merge
        w, h = target_size(width, height, self.limits())
        return w // side, h // side

    def n_rows(self, nx: int, ny: int) -> int:
        """The image's rows in the text model (KV cells) for nx × ny merged patches."""
        return nx * ny

    def encode(self, image: Preprocessed) -> np.ndarray:
        raise NotImplementedError

    def run(self, image: Preprocessed, n_rows: int, build: Callable[[Graph], Tensor]) -> np.ndarray:
        """Builds and computes `build`'s graph for the image; its output as (n_rows, width) float32. On the device
        where vision/device.py placed the encoder (a device that fails: the CPU from then on, with one line), else
        on ggml's CPU backend, whose graph allocator reuses memory between layers (the results are the CPU `Graph`'s
        to the bit; its context held every layer's attention scores at once). Being sized (`sizing`): the graph's
        compute buffer measured, nothing computed."""
        n_nodes = 64 * (self.hp.n_layer + 4)
        if self.sizing is not None:
            self.sized = self.sizing.measure(build, n_nodes)
            return np.zeros((n_rows, self.width), np.float32)
        if self.device is not None and self.device.freed:
            self.to_cpu("the GPU was given up")
        if self.device is not None:
            try:
                return self.device.run(build, n_nodes, check=False).reshape(n_rows, self.width)
            except DeviceError as e:
                self.to_cpu(f"the GPU failed ({e})")
        cpu = EncoderBackend(cpu_backend(self.n_threads), self._cpu_w)
        return cpu.run(build, n_nodes, check=False).reshape(n_rows, self.width)

    # ------------------------------------------------------------------ clip_graph's pieces
    def norm(self, ctx: Any, x: Tensor, prefix: str, rms: bool = False) -> Tensor:
        """build_norm: LayerNorm (or RMS) times `prefix`.weight, plus `prefix`.bias where the file has one."""
        x = ggml.ggml_rms_norm(ctx, x, self.hp.eps) if rms else ggml.ggml_norm(ctx, x, self.hp.eps)
        x = ggml.ggml_mul(ctx, x, self._w[f"{prefix}.weight"])
        bias = self._w.get(f"{prefix}.bias")
        return ggml.ggml_add(ctx, x, bias) if bias is not None else x

    def linear(self, ctx: Any, x: Tensor, prefix: str) -> Tensor:
        """`prefix`.weight × x, plus `prefix`.bias where the file has one."""
        x = ggml.ggml_mul_mat(ctx, self._w[f"{prefix}.weight"], x)
        bias = self._w.get(f"{prefix}.bias")
        return ggml.ggml_add(ctx, x, bias) if bias is not None else x

    def ffn(self, ctx: Any, x: Tensor, up: str, down: str, gate: str | None = None, silu: bool = False) -> Tensor:
        """build_ffn: up (and gate) projections, GELU or SiLU (gated: SwiGLU), down projection."""
        y = self.linear(ctx, x, up)
        if gate is not None:
            y = ggml.ggml_swiglu_split(ctx, self.linear(ctx, x, gate), y)
        else:
            y = ggml.ggml_silu(ctx, y) if silu else ggml.ggml_gelu(ctx, y)
        return self.linear(ctx, y, down)

    def attention(self, ctx: Any, q: Tensor, k: Tensor, v: Tensor, n_pos: int, scale: float | None = None) -> Tensor:
        """build_attn without flash attention and without a mask (every patch sees every patch): q, k, v as
        [d_head, n_head, n_pos]; the heads' outputs as [n_embd, n_pos], before the output projection. `scale`:
        the scores' (kq_scale; 1/sqrt(d_head) unless the family sets it, as Gemma 4 does to 1)."""
        d_head = self.hp.n_embd // self.hp.n_head
        q = ggml.ggml_permute(ctx, q, 0, 2, 1, 3)
        k = ggml.ggml_permute(ctx, k, 0, 2, 1, 3)
        v = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, v, 1, 2, 0, 3))
        # (ggml takes a NULL mask, which the binding's type does not say)
        kq = ggml.ggml_soft_max_ext(
            ctx,
            ggml.ggml_mul_mat(ctx, k, q),
            None,  # type: ignore[arg-type]
            1.0 / math.sqrt(d_head) if scale is None else scale,
            0.0,
        )
        att = ggml.ggml_permute(ctx, ggml.ggml_mul_mat(ctx, v, kq), 0, 2, 1, 3)
        return ggml.ggml_cont_2d(ctx, att, self.hp.n_embd, n_pos)

    def close(self) -> None:
        self.weights_on(None, self.where)
        self._arena.close()
