"""Hand-made GGUFs for bad-input tests (the factory only writes valid models)."""

from __future__ import annotations

from pathlib import Path

from tokenwing.format.gguf_io import KV, TensorInfo, encode_header, layout_tensors


def write_gguf(
    path: Path, kv: dict[str, KV], tensors: list[tuple[str, tuple[int, ...], int, bytes]], alignment: int = 32
) -> Path:
    infos = [TensorInfo(name, shape, ttype, 0, len(data)) for name, shape, ttype, data in tensors]
    size = layout_tensors(infos, alignment)
    header, _ = encode_header(kv, infos, alignment)
    buf = bytearray(len(header) + size)
    buf[: len(header)] = header
    for info, (_, _, _, data) in zip(infos, tensors, strict=True):
        buf[len(header) + info.offset : len(header) + info.offset + len(data)] = data
    path.write_bytes(bytes(buf))
    return path


def moe_kv(arch: str = "qwen3moe", n_expert: int = 4, n_used: int = 2, **extra: KV) -> dict[str, KV]:
    kv = {
        "general.architecture": KV.string(arch),
        f"{arch}.block_count": KV.u32(1),
        f"{arch}.expert_count": KV.u32(n_expert),
        f"{arch}.expert_used_count": KV.u32(n_used),
    }
    kv.update(extra)
    return kv


def f32(n: int, fill: int = 1) -> bytes:
    return bytes([fill]) * (4 * n)


def expert_tensors(layer: int, n_embd: int, n_ff: int, n_expert: int) -> list[tuple[str, tuple[int, ...], int, bytes]]:
    n = n_embd * n_ff * n_expert
    return [
        (f"blk.{layer}.ffn_gate_exps.weight", (n_embd, n_ff, n_expert), 0, f32(n, 1 + layer)),
        (f"blk.{layer}.ffn_up_exps.weight", (n_embd, n_ff, n_expert), 0, f32(n, 2 + layer)),
        (f"blk.{layer}.ffn_down_exps.weight", (n_ff, n_embd, n_expert), 0, f32(n, 3 + layer)),
    ]
