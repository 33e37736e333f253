"""The TokenWing layout: which tensors are routed experts, where every expert lies, and the metadata keys.

Shared by the repacker (which plans the layout), the reader (which checks it) and `inspect`.
See docs/model-format.md for the normative description.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.format.gguf_io import GGUFHeader, TensorInfo

FORMAT_MAJOR = 1
FORMAT_MINOR = 1  # 1.1: tokenwing.resident.kept
ALIGNMENT = 4096  # direct reads need 4 KiB-aligned offsets, lengths and buffers

PROJECTIONS = ("gate", "up", "down")  # record order: gate and up land before down

K_MAJOR = "tokenwing.format.major"
K_MINOR = "tokenwing.format.minor"
K_RESIDENT_COUNT = "tokenwing.resident.count"
K_TENSOR_CHECKSUMS = "tokenwing.resident.checksums"
K_KEPT_COUNT = "tokenwing.resident.kept"  # the last K resident tensors: blocks kept in the file, never run
K_EXPERT_COUNT = "tokenwing.expert.count"
K_EXPERT_LAYERS = "tokenwing.expert.layers"
K_LAYER_OFFSET = "tokenwing.expert.layer_offset"
K_RECORD_SIZE = "tokenwing.expert.record_size"
K_PROJ_OFFSET = "tokenwing.expert.proj_offset"
K_PROJ_SIZE = "tokenwing.expert.proj_size"
K_EXPERT_CHECKSUMS = "tokenwing.expert.checksums"
K_SOURCE_FILES = "tokenwing.source.files"
K_SOURCE_SIZE = "tokenwing.source.size"
K_HEADER_CHECKSUM = "tokenwing.header.checksum"

# llama.cpp's other MoE architectures whose routed experts are its ffn_{gate,up,down}_exps tensors: repack and
# inspect lay them out, a start refuses them in its own line. With the families the engine runs (models.FAMILIES,
# the one family list; this module sits below it) they are the architectures repack takes: repack.check_architecture.
OTHER_MOE_ARCHS = frozenset(
    {
        "deepseek",
        "bailingmoe",
        "dots1",
        "hunyuan-moe",
        "olmoe",
        "granitemoe",
        "phimoe",
        "arctic",
        "grok",
        "dbrx",
        "llama",
        "mixtral",
        "seed_oss",
        "smallthinker",
        "afmoe",
        "grovemoe",
        "lfm2moe",
    }
)

_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_MERGED_RE = re.compile(r"^blk\.\d+\.ffn_gate_up_exps\.weight$")


def expert_tensor_name(layer: int, proj: str, expert: int) -> str:
    return f"blk.{layer}.ffn_{proj}_exps.{expert}.weight"


def source_expert_name(layer: int, proj: str) -> str:
    return f"blk.{layer}.ffn_{proj}_exps.weight"


@dataclass
class ExpertLayer:
    """One streamed layer: its experts' records lie back to back, `record_size` apart."""

    layer: int
    types: tuple[int, int, int]  # ggml type of gate, up, down
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]  # 2-D shape of one expert's projection
    proj_size: tuple[int, int, int]
    proj_offset: tuple[int, int, int] = (0, 0, 0)  # within the record, each 4 KiB-aligned
    record_size: int = 0
    offset: int = 0  # absolute file offset of expert 0's record

    def expert_offset(self, expert: int) -> int:
        return self.offset + expert * self.record_size

    @property
    def payload(self) -> int:
        return sum(self.proj_size)


@dataclass
class ExpertIndex:
    n_expert: int
    n_used: int
    layers: list[ExpertLayer]
    checksums: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.uint64))

    def layer(self, layer: int) -> ExpertLayer:
        for el in self.layers:
            if el.layer == layer:
                return el
        raise KeyError(f"layer {layer} has no streamed experts")

    @property
    def total_bytes(self) -> int:
        return sum(el.record_size for el in self.layers) * self.n_expert

    def total_payload(self) -> int:
        """Expert bytes without alignment padding."""
        return sum(el.payload for el in self.layers) * self.n_expert

    @property
    def miss_bytes_per_token(self) -> int:
        """What one token reads if every selected expert of every streamed layer misses."""
        return sum(el.record_size for el in self.layers) * self.n_used


def align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def arch_of(header: GGUFHeader) -> str:
    arch = header.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise BadInputError(f"{header.path}: no general.architecture in the metadata")
    return arch


def moe_counts(header: GGUFHeader, arch: str) -> tuple[int, int]:
    n_expert = header.get(f"{arch}.expert_count")
    n_used = header.get(f"{arch}.expert_used_count")
    if not isinstance(n_expert, int) or not isinstance(n_used, int):
        raise BadInputError(f"{header.path}: {arch}.expert_count/expert_used_count missing from the metadata")
    if not 0 < n_used <= n_expert:
        raise BadInputError(f"{header.path}: expert_used_count {n_used} does not fit expert_count {n_expert}")
    return n_expert, n_used


def mtp_layers(header: GGUFHeader, arch: str) -> set[int]:
    """Next-token-prediction blocks sit after the main ones: kept in the file, never streamed, loaded or run."""
    n_block = header.get(f"{arch}.block_count")
    n_mtp = header.get(f"{arch}.nextn_predict_layers", 0)
    if not isinstance(n_block, int) or not isinstance(n_mtp, int) or n_mtp <= 0:
        return set()
    return set(range(max(0, n_block - n_mtp), n_block))


def block_of(name: str) -> int | None:
    m = _BLOCK_RE.match(name)
    return int(m.group(1)) if m else None


def split_kept(tensors: list[TensorInfo], header: GGUFHeader) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """(tensors that run, tensors kept but never run): the second are those of next-token-prediction blocks,
    which the engine neither loads nor streams (models/hparams: n_layer = block_count - nextn_predict_layers)."""
    mtp = mtp_layers(header, arch_of(header))
    kept = [t for t in tensors if block_of(t.name) in mtp]
    return [t for t in tensors if block_of(t.name) not in mtp], kept


def plan_experts(
    tensors: list[TensorInfo], header: GGUFHeader
) -> tuple[list[TensorInfo], list[ExpertLayer], dict[tuple[int, str], TensorInfo], int, int]:
    """Splits a source GGUF's tensors into resident ones and streamed expert layers, checking every shape.

    Returns (resident tensors, expert layers, source expert tensors by (layer, projection), n_expert, n_used);
    resident tensors in source order, those of next-token-prediction blocks last (see split_kept).
    """
    arch = arch_of(header)  # (one repack takes: repack.check_architecture)
    n_expert, n_used = moe_counts(header, arch)
    keep = mtp_layers(header, arch)
    found: dict[tuple[int, str], TensorInfo] = {}
    resident: list[TensorInfo] = []
    for t in tensors:
        if _MERGED_RE.match(t.name) and block_of(t.name) not in keep:
            found[(block_of(t.name) or 0, "gate")] = found[(block_of(t.name) or 0, "up")] = merged_half(header.path, t)
            continue
        m = _EXPERT_RE.match(t.name)
        if m and int(m.group(1)) not in keep:
            found[(int(m.group(1)), m.group(2))] = t
        else:
            resident.append(t)
    if not found:
        raise UnsupportedError(f"{header.path}: no routed expert tensors (is this a MoE model?)")
    run, kept = split_kept(resident, header)
    resident = run + kept
    layers = []
    for layer in sorted({lyr for lyr, _ in found}):
        layers.append(_expert_layer(header.path, layer, found, n_expert))
    return resident, layers, found, n_expert, n_used


def merged_half(path: str, t: TensorInfo) -> TensorInfo:
    """A merged ffn_gate_up_exps tensor (llama.cpp's; today's converter writes Mistral Small 4's so) as its gate or
    its up experts: each expert's 2 x n_ff rows are its gate's n_ff rows, then its up's (build_moe_ffn's views),
    so each half is an expert tensor of half the bytes whose experts lie twice their size apart (merged_stride)."""
    if len(t.shape) != 3 or t.shape[1] % 2:
        raise BadInputError(f"{path}: {t.name} has shape {t.shape}: not [n_embd, 2 x n_ff, n_expert]")
    return TensorInfo(t.name, (t.shape[0], t.shape[1] // 2, t.shape[2]), t.type, 0, t.nbytes // 2)


def merged_stride(t: TensorInfo, proj: str, n_expert: int) -> tuple[int, int]:
    """(offset of expert 0's `proj` in its source tensor, bytes from one expert's to the next) of an expert tensor
    plan_experts found: (0, 0) for a whole one (contiguous experts); for a half of a merged gate_up tensor, the
    half's place in each expert's rows (gate first) and twice an expert's size."""
    if not _MERGED_RE.match(t.name):
        return 0, 0
    size = t.nbytes // n_expert
    return (0 if proj == "gate" else size), 2 * size


def _expert_layer(path: str, layer: int, found: dict[tuple[int, str], TensorInfo], n_expert: int) -> ExpertLayer:
    missing = [p for p in PROJECTIONS if (layer, p) not in found]
    if missing:
        raise BadInputError(f"{path}: layer {layer} lacks its {'/'.join(missing)} expert tensor")
    gate, up, down = (found[(layer, p)] for p in PROJECTIONS)
    for t in (gate, up, down):
        if len(t.shape) != 3 or t.shape[2] != n_expert:
            raise BadInputError(
                f"{path}: {t.name} has shape {t.shape}, which does not hold the {n_expert} experts "
                "the metadata declares"
            )
        if t.nbytes % n_expert:
            raise BadInputError(f"{path}: {t.name} does not split into {n_expert} equal experts")
    n_embd, n_ff = gate.shape[0], gate.shape[1]
    if up.shape[:2] != (n_embd, n_ff) or down.shape[:2] != (n_ff, n_embd):
        raise BadInputError(
            f"{path}: layer {layer} expert shapes disagree (gate {gate.shape}, up {up.shape}, down {down.shape})"
        )
    sizes = (gate.nbytes // n_expert, up.nbytes // n_expert, down.nbytes // n_expert)
    el = ExpertLayer(
        layer,
        (gate.type, up.type, down.type),
        ((n_embd, n_ff), (n_embd, n_ff), (n_ff, n_embd)),
        sizes,
    )
    offsets, pos = [], 0
    for s in sizes:
        offsets.append(pos)
        pos = align(pos + s)
    el.proj_offset = (offsets[0], offsets[1], offsets[2])
    el.record_size = pos
    return el
