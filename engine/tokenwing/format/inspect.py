"""`tokenwing inspect`: what a model file holds and what a token must read when every expert misses.

Works on TokenWing model files and on plain GGUFs (showing what a repack would produce).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from tokenwing.errors import TokenWingError
from tokenwing.format import layout as L
from tokenwing.format.gguf_io import GGUFHeader, ggml_type_name
from tokenwing.format.reader import ModelFile
from tokenwing.format.repack import check_family, plan_repack
from tokenwing.format.source import SourceModel, open_source
from tokenwing.fsutil import human_bytes
from tokenwing.models import family, kv_bytes_per_token
from tokenwing.models.hparams import read_hparams
from tokenwing.runtime.memory_plan import graph_bytes
from tokenwing.runtime.session import SessionOptions


def inspect_model(paths: list[str]) -> dict[str, Any]:
    return inspect_source(open_source(paths))


def inspect_source(source: SourceModel) -> dict[str, Any]:
    """What `inspect_model` says, for a source already opened (a manifest's shards may not all be there yet)."""
    header = source.header
    paths = source.paths
    if header.get(L.K_MAJOR) is not None:
        with ModelFile.open(paths[0], announce_fallback=False) as mf:
            index, resident, kept = mf.index, mf.resident, mf.kept
        check_family(header, resident, index.layers)  # (a source's is in plan_repack)
        kind = "tokenwing"
    else:
        plan = plan_repack(source)
        index = plan.experts
        resident, kept = L.split_kept([info for info, _ in plan.resident], header)
        kind = "gguf"
    arch = L.arch_of(header)
    params = sum(math.prod(t.shape) for t in resident)
    params += sum(math.prod(shape) for el in index.layers for shape in el.shapes) * index.n_expert

    def meta(key: str) -> Any:
        value = header.get(f"{arch}.{key}")
        return value if isinstance(value, int | float | str) else None

    types = Counter(ggml_type_name(t) for el in index.layers for t in el.types)
    # tensors the family reads a few rows of from the file instead of loading (qwen4exp's n-gram table: 51B weights
    # in the released model, ~29 GB at Q4_K, of which a token reads 16 rows): neither in memory nor read whole
    sparse = _lazy_tensors(header, arch)
    graph = _graph_reserve(header, arch, {t.name: t.shape for t in resident})
    lazy = [t for t in resident if t.name in sparse]
    resident = [t for t in resident if t.name not in sparse]
    resident_bytes = sum(t.nbytes for t in resident)
    # a token reads one row of the token embedding, and every other resident weight
    embedding = next((t.nbytes for t in resident if t.name == "token_embd.weight"), 0)
    return {
        "file": paths[0] if len(paths) == 1 else paths,
        "kind": kind,
        "format_version": f"{header.get(L.K_MAJOR)}.{header.get(L.K_MINOR)}" if kind == "tokenwing" else None,
        "file_bytes": source.size,
        "architecture": arch,
        "name": header.get("general.name"),
        "basename": header.get("general.basename"),  # a converter's family name ("Qwen3"), and its size ("30B-A3B")
        "size_label": header.get("general.size_label"),
        "parameters": params,
        "block_count": meta("block_count"),
        "embedding_length": meta("embedding_length"),
        "context_length": meta("context_length"),
        "head_count": meta("attention.head_count"),
        "head_count_kv": meta("attention.head_count_kv"),
        "vocab_size": len(header.get("tokenizer.ggml.tokens") or []),
        "has_chat_template": header.get("tokenizer.chat_template") is not None,
        "shared_experts": meta("expert_shared_count") or 0,
        "kv_bytes_per_token": _kv_bytes_per_token(header, arch),
        "graph_reserve": graph,
        "experts": {
            "count": index.n_expert,
            "used_per_token": index.n_used,
            "streamed_layers": [el.layer for el in index.layers],
            "expert_quant_types": dict(types),
            "total_bytes": index.total_bytes,
            "miss_bytes_per_token": index.miss_bytes_per_token,
            "layers": [
                {
                    "layer": el.layer,
                    "types": [ggml_type_name(t) for t in el.types],
                    "gate_shape": list(el.shapes[0]),
                    "record_bytes": el.record_size,
                    "layer_bytes": el.record_size * index.n_expert,
                    "projection_offsets": list(el.proj_offset),
                    "projection_bytes": list(el.proj_size),
                }
                for el in index.layers
            ],
        },
        "resident": {
            "tensors": len(resident),
            "bytes": resident_bytes,
            "read_per_token_bytes": resident_bytes - embedding,
            "quant_types": dict(Counter(t.type_name for t in resident)),
        },
        # read sparsely from the file (rows as tokens name them), not loaded: not in `resident`
        "lazy": {"tensors": len(lazy), "bytes": sum(t.nbytes for t in lazy), "names": sorted(t.name for t in lazy)},
        # next-token-prediction blocks: in the file, never loaded, streamed or run
        "kept": {
            "tensors": len(kept),
            "bytes": sum(t.nbytes for t in kept),
            "blocks": sorted({b for t in kept if (b := L.block_of(t.name)) is not None}),
        },
    }


def _kv_bytes_per_token(header: GGUFHeader, arch: str) -> int | None:
    """An F16 KV cache's bytes per token of context over all layers, by the model family's own rule (the number
    the runtime allocates); None for an architecture the engine does not run or metadata it cannot read."""
    try:
        return kv_bytes_per_token({k: v.value for k, v in header.kv.items()}, arch, header.path)
    except TokenWingError:
        return None


def _graph_reserve(header: GGUFHeader, arch: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, int] | None:
    """The compute graph's reserve the session plans for this model (`memory_plan.graph_bytes`) at the default
    prompt batch: `bytes` plus `per_context_token` for each position of the context (the attention scores grow
    with it, nothing else does); None for an architecture the engine does not run or metadata it cannot read."""
    try:
        cls = family(arch)
        hp = read_hparams({k: v.value for k, v in header.kv.items()}, arch, header.path, cls.recurrence)
        specs = [cls.layer_state(hp, shapes, il) for il in range(hp.n_layer)]
    except (TokenWingError, KeyError):  # (a tensor the family sizes its state by is missing: `verify` names it)
        return None
    batch = SessionOptions().max_batch
    base = graph_bytes(hp, batch, 0, specs)
    return {"max_batch": batch, "bytes": base, "per_context_token": graph_bytes(hp, batch, 1, specs) - base}


def _lazy_tensors(header: GGUFHeader, arch: str) -> frozenset[str]:
    """The names the family of `arch` reads sparsely from the file (`MoEModel.lazy_tensors`); none for an
    architecture the engine does not run or metadata it cannot read."""
    try:
        cls = family(arch)
        return cls.lazy_tensors(read_hparams({k: v.value for k, v in header.kv.items()}, arch, "", cls.recurrence))
    except TokenWingError:
        return frozenset()


def format_report(r: dict[str, Any]) -> str:
    ex = r["experts"]
    kind = f"TokenWing model file v{r['format_version']}" if r["kind"] == "tokenwing" else "GGUF (not repacked)"
    lines = [
        f"{r['file']}",
        f"  kind           {kind}",
        f"  size           {human_bytes(r['file_bytes'])}",
        f"  architecture   {r['architecture']} ({r['name']})",
        f"  layers         {r['block_count']}, width {r['embedding_length']}, heads {r['head_count']}/"
        f"{r['head_count_kv']}, context {r['context_length']}, vocabulary {r['vocab_size']}",
        f"  experts        {ex['count']} per layer, {ex['used_per_token']} used per token, "
        f"{len(ex['streamed_layers'])} streamed layers",
        f"  expert types   {', '.join(f'{k} x{v}' for k, v in ex['expert_quant_types'].items())}",
        f"  expert bytes   {human_bytes(ex['total_bytes'])} streamed, "
        f"{human_bytes(r['resident']['bytes'])} always resident ({r['resident']['tensors']} tensors)",
        f"  all-miss token reads {human_bytes(ex['miss_bytes_per_token'])} "
        f"({ex['used_per_token']} experts x {len(ex['streamed_layers'])} layers)",
    ]
    if r["lazy"]["tensors"]:
        lines.append(
            f"  read sparsely  {human_bytes(r['lazy']['bytes'])} in {', '.join(r['lazy']['names'])} (rows read from "
            "the file as tokens name them, never loaded whole)"
        )
    if r["kept"]["tensors"]:
        blocks = ", ".join(map(str, r["kept"]["blocks"]))
        lines.append(
            f"  not run        {human_bytes(r['kept']['bytes'])} in {r['kept']['tensors']} tensors of "
            f"next-token-prediction block {blocks} (kept in the file, never loaded)"
        )
    lines.append("  per layer:")
    for el in ex["layers"]:
        lines.append(
            f"    {el['layer']:>4}  {'/'.join(el['types']):<18} {el['gate_shape'][0]}x{el['gate_shape'][1]:<6}"
            f" expert {human_bytes(el['record_bytes']):>11}  layer {human_bytes(el['layer_bytes']):>11}"
        )
    return "\n".join(lines)
