"""Writes a generated model as a standard GGUF (optionally split into llama.cpp-style shards), streaming."""

from __future__ import annotations

import os
import tempfile
import zlib
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from tokenwing.format.gguf_io import KV, TensorInfo, ValueType, encode_header, layout_tensors, tensor_nbytes
from tokenwing.fsutil import atomic_output
from tokenwing.models.specs import TensorSpec
from tokenwing.progress import Progress
from tokenwing.testmodel import weights
from tokenwing.testmodel.architectures import architecture, check_shape
from tokenwing.testmodel.kquant import quantize_with_llama_cpp
from tokenwing.testmodel.shapes import ModelShape
from tokenwing.testmodel.tokenizer import build_vocabulary

ALIGNMENT = 32

# llama.cpp's llama_ftype numbers for the types the factory writes directly.
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "BF16": 32, "MXFP4_MOE": 38}
# Named like llama.cpp's ftype: routed experts in MXFP4, every other matrix in Q8_0 (as llama-quantize writes it).
MIXED_TYPES = {"MXFP4_MOE": ("Q8_0", "MXFP4")}
KQUANT_TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K")


@dataclass
class _Planned:
    spec: TensorSpec
    info: TensorInfo
    qtype: GGMLQuantizationType


def model_metadata(shape: ModelShape, type_name: str, name: str) -> dict[str, KV]:
    arch = architecture(shape.arch)
    vocab = build_vocabulary(shape.vocab_size, shape.tokenizer)
    kv: dict[str, KV] = {
        "general.architecture": KV.string(arch.name),
        "general.name": KV.string(name),
        "general.file_type": KV.u32(_FILE_TYPES.get(type_name, 0)),
        "general.quantization_version": KV.u32(2),
    }
    kv.update(arch.metadata(shape))
    kv.update(
        {
            "tokenizer.ggml.model": KV.string(vocab.model),
            "tokenizer.ggml.pre": KV.string(vocab.pre),
            "tokenizer.ggml.tokens": KV.strings(vocab.tokens),
            "tokenizer.ggml.token_type": KV.array(ValueType.INT32, vocab.token_types),
            "tokenizer.ggml.eos_token_id": KV.u32(vocab.eos_id),
            "tokenizer.ggml.padding_token_id": KV.u32(vocab.pad_id),
            "tokenizer.ggml.bos_token_id": KV.u32(vocab.bos_id),
            "tokenizer.ggml.add_bos_token": KV.boolean(vocab.add_bos),
        }
    )
    if vocab.scores is not None:  # SentencePiece: scores and a space before the text, no merges
        kv["tokenizer.ggml.scores"] = KV.array(ValueType.FLOAT32, vocab.scores)
        kv["tokenizer.ggml.add_space_prefix"] = KV.boolean(True)
    else:
        kv["tokenizer.ggml.merges"] = KV.strings(vocab.merges)
    if vocab.eot_id is not None:
        kv["tokenizer.ggml.eot_token_id"] = KV.u32(vocab.eot_id)
    if shape.chat_template:
        kv["tokenizer.chat_template"] = KV.string(vocab.chat_template)
    return kv


def _plan(
    shape: ModelShape, qtype: GGMLQuantizationType, experts: GGMLQuantizationType | None = None
) -> list[_Planned]:
    check_shape(shape)
    planned = []
    for spec in architecture(shape.arch).tensors(shape):
        t = weights.tensor_type(spec, qtype, experts)
        info = TensorInfo(spec.name, spec.shape, int(t), 0, tensor_nbytes(spec.shape, int(t)))
        planned.append(_Planned(spec, info, t))
    return planned


def _split(planned: list[_Planned], shards: int) -> list[list[_Planned]]:
    """Consecutive groups of roughly equal bytes; every shard gets at least one tensor."""
    shards = max(1, min(shards, len(planned)))
    total = sum(p.info.nbytes for p in planned)
    groups: list[list[_Planned]] = [[] for _ in range(shards)]
    acc = 0
    for p in planned:
        groups[min(shards - 1, acc * shards // max(total, 1))].append(p)
        acc += p.info.nbytes
    return [g for g in groups if g]


def shard_paths(path: str, count: int) -> list[str]:
    if count == 1:
        return [path]
    stem = path[:-5] if path.endswith(".gguf") else path
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.gguf" for i in range(count)]


def _write_file(
    path: str, kv: dict[str, KV], planned: list[_Planned], shape: ModelShape, seed: int, progress: Progress
) -> None:
    infos = [p.info for p in planned]
    data_size = layout_tensors(infos, ALIGNMENT)
    header, _ = encode_header(kv, infos, ALIGNMENT)
    with atomic_output(path, len(header) + data_size) as tmp, open(tmp, "wb") as f:
        f.write(header)
        for p in planned:
            f.seek(len(header) + p.info.offset)
            # Each tensor has its own stream, so a tensor's values do not depend on sharding or order.
            rng = np.random.default_rng([seed, zlib.crc32(p.spec.name.encode())])
            std = weights.tensor_std(p.spec, shape.embd_std, shape.weight_std, shape.router_scale)
            for chunk in weights.generate(p.spec, p.qtype, rng, std):
                f.write(chunk)
                progress.advance(len(chunk))
        f.truncate(len(header) + data_size)


def write_test_model(
    path: str,
    shape: ModelShape,
    type_name: str = "F32",
    seed: int = 0,
    shards: int = 1,
    show_progress: bool = False,
    expert_type: str | None = None,
) -> list[str]:
    """Writes a random-weight GGUF; returns the written path(s). K-quants go through llama.cpp.

    `expert_type` (MXFP4) stores the routed experts in that type and the rest in `type_name`, as llama.cpp's
    converter writes gpt-oss; `MXFP4_MOE` is that with Q8_0, as llama.cpp's quantizer writes it.
    """
    type_name = type_name.upper()
    if type_name in MIXED_TYPES:
        if expert_type is not None:
            raise ValueError(f"{type_name} fixes the experts' type: drop --expert-type")
        dense, expert_type = MIXED_TYPES[type_name]
    else:
        dense = type_name
    if type_name in KQUANT_TYPES:
        if expert_type is not None:
            raise ValueError("K-quant models take their experts' types from llama.cpp: drop --expert-type")
        return _write_kquant(path, shape, type_name, seed, shards, show_progress)
    if dense not in weights.DIRECT_TYPES:
        known = ", ".join([*weights.DIRECT_TYPES, *MIXED_TYPES, *KQUANT_TYPES])
        raise ValueError(f"unknown type {type_name!r} (choose from {known})")
    experts = None
    if expert_type is not None:
        if expert_type.upper() not in weights.EXPERT_TYPES:
            raise ValueError(f"unknown expert type {expert_type!r} (choose from {', '.join(weights.EXPERT_TYPES)})")
        experts = weights.EXPERT_TYPES[expert_type.upper()]
    qtype = weights.DIRECT_TYPES[dense]
    planned = _plan(shape, qtype, experts)
    name = os.path.basename(path).removesuffix(".gguf")
    kv = model_metadata(shape, type_name, name)
    groups = _split(planned, shards)
    paths = shard_paths(path, len(groups))
    progress = Progress(f"writing {os.path.basename(path)}", sum(p.info.nbytes for p in planned), enabled=show_progress)
    for i, (group, shard_path) in enumerate(zip(groups, paths, strict=True)):
        shard_kv = dict(kv) if i == 0 else {}
        if len(groups) > 1:
            shard_kv["split.no"] = KV(ValueType.UINT16, i)
            shard_kv["split.count"] = KV(ValueType.UINT16, len(groups))
            shard_kv["split.tensors.count"] = KV(ValueType.INT32, len(planned))
        _write_file(shard_path, shard_kv, group, shape, seed, progress)
    progress.finish()
    return paths


def _write_kquant(
    path: str, shape: ModelShape, type_name: str, seed: int, shards: int, show_progress: bool
) -> list[str]:
    if shards != 1:
        raise ValueError("K-quant models are written as one file (split them with llama.cpp's gguf-split)")
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.TemporaryDirectory(dir=directory, prefix=".tw-kquant-") as tmp:
        src = os.path.join(tmp, "source-q8_0.gguf")
        write_test_model(src, shape, "Q8_0", seed, 1, show_progress)
        with atomic_output(path, os.path.getsize(src)) as out:
            quantize_with_llama_cpp(src, out, type_name)
    return [path]
