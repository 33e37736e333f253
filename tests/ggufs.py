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


def with_metadata(src: Path, dst: Path, kv: dict[str, KV]) -> Path:
    """A copy of the plain GGUF `src` with the metadata `kv` instead of its own: the same tensor table and data
    (offsets in a GGUF are relative to the data section, which moves with the header's new length)."""
    from tokenwing.format.gguf_io import read_header

    h = read_header(str(src))
    header, _ = encode_header(kv, h.tensors, h.alignment)
    with open(src, "rb") as f_in, open(dst, "wb") as f_out:
        f_out.write(header)
        f_in.seek(h.data_start)
        while chunk := f_in.read(1 << 20):
            f_out.write(chunk)
    return dst
