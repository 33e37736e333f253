"""The one check of a model's header numbers, before anything is sized from them.

A model file comes from a public hub: each count in its metadata is an attacker's number until checked. Code
downstream builds per-layer tuples, per-expert lists and graph reserves from these numbers (a `block_count` of
2**31 once made `inspect` allocate until the OOM killer came), so every start path runs this first:
`inspect` and `repack` on the source (`check_header` from `open_source`), `verify`, `run` and `serve` on the
model file (`check_header` from `ModelFile.open`), and the families' own hyper-parameter checks
(`models/hparams.read_hparams`) call `check_ranges` before they build anything per layer.

The ranges are far beyond any released model (DeepSeek-V3: 61 blocks, 256 experts, 129,280 tokens, 163,840
context; Llama 4 Scout's context: 10 M) and far below what would exhaust memory when a per-layer or per-position
structure is made from them. Each refusal is one line naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import GGUFHeader, TensorInfo

MAX_BLOCKS = 4096
MAX_CONTEXT = 1 << 24  # 16,777,216 tokens
MAX_VOCAB = 1 << 22
MAX_WIDTH = 1 << 17  # an embedding or a latent
MAX_FF = 1 << 20
MAX_EXPERTS = 1 << 14
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 14

# `{arch}.KEY` → (least, most) for each integer key a family reads; a per-layer list is checked item by item.
RANGES: dict[str, tuple[int, int]] = {
    "block_count": (1, MAX_BLOCKS),
    "context_length": (1, MAX_CONTEXT),
    "embedding_length": (1, MAX_WIDTH),
    "feed_forward_length": (0, MAX_FF),
    "expert_feed_forward_length": (1, MAX_FF),
    "expert_shared_feed_forward_length": (0, MAX_FF),
    "expert_count": (1, MAX_EXPERTS),
    "expert_used_count": (1, MAX_EXPERTS),
    "expert_shared_count": (0, MAX_EXPERTS),
    "expert_group_count": (0, MAX_EXPERTS),
    "expert_group_used_count": (0, MAX_EXPERTS),
    "expert_latent_length": (0, MAX_WIDTH),
    "leading_dense_block_count": (0, MAX_BLOCKS),
    "nextn_predict_layers": (0, MAX_BLOCKS),
    "full_attention_interval": (1, MAX_BLOCKS),
    "vocab_size": (1, MAX_VOCAB),
    "attention.head_count": (1, MAX_HEADS),
    "attention.head_count_kv": (0, MAX_HEADS),  # (per layer: 0 marks a linear-attention layer in Ling 3.0)
    "attention.key_length": (1, MAX_HEAD_DIM),
    "attention.value_length": (1, MAX_HEAD_DIM),
    "attention.key_length_mla": (0, MAX_HEAD_DIM),
    "attention.value_length_mla": (0, MAX_HEAD_DIM),
    "attention.q_lora_rank": (0, MAX_WIDTH),
    "attention.kv_lora_rank": (0, MAX_WIDTH),
    "attention.sliding_window": (0, MAX_CONTEXT),
    "attention.indexer.head_count": (0, MAX_HEADS),
    "attention.indexer.key_length": (0, MAX_HEAD_DIM),
    "attention.indexer.top_k": (0, MAX_CONTEXT),
    "rope.dimension_count": (0, MAX_HEAD_DIM),
    "rope.scaling.original_context_length": (0, MAX_CONTEXT),
    "ssm.conv_kernel": (0, 1 << 10),
    "ssm.inner_size": (0, MAX_FF),
    "ssm.state_size": (0, MAX_HEAD_DIM),
    "ssm.time_step_rank": (0, MAX_HEADS),
    "ssm.group_count": (0, MAX_HEADS),
    "kda.head_dim": (0, MAX_HEAD_DIM),
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def check_ranges(meta: Mapping[str, Any], arch: str, where: str) -> None:
    """Each integer key a family reads lies in its range (RANGES); one line naming the first that does not."""
    for key, (least, most) in RANGES.items():
        name = f"{arch}.{key}"
        value = meta.get(name)
        if value is None:
            continue
        items = value.tolist() if isinstance(value, np.ndarray) else value
        if isinstance(items, list):
            if len(items) > MAX_BLOCKS + 1:
                raise BadInputError(f"{where}: {name} lists {len(items):,} values, more than any model has layers")
        else:
            items = [items]
        for v in items:
            if isinstance(v, bool) or not isinstance(v, int):
                raise BadInputError(f"{where}: {name} must be an integer (or one per layer)")
            if not least <= v <= most:
                raise BadInputError(f"{where}: {name} is {v:,}, outside the range {least:,} to {most:,}")
    used, count = meta.get(f"{arch}.expert_used_count"), meta.get(f"{arch}.expert_count")
    if isinstance(used, int) and isinstance(count, int) and used > count:
        raise BadInputError(f"{where}: {arch}.expert_used_count {used} is more than expert_count {count}")
    blocks = meta.get(f"{arch}.block_count")
    for key in ("nextn_predict_layers", "leading_dense_block_count"):
        n = meta.get(f"{arch}.{key}")
        if isinstance(blocks, int) and isinstance(n, int) and n >= blocks:
            raise BadInputError(f"{where}: {arch}.{key} {n} leaves none of the {blocks} blocks (block_count)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > MAX_VOCAB:
        raise BadInputError(f"{where}: the vocabulary has {len(tokens):,} tokens, more than {MAX_VOCAB:,}")


def check_header(header: GGUFHeader, tensors: Sequence[TensorInfo] | None = None) -> None:
    """A model's header against itself and its tensors (`tensors`: every shard's; the header's own by default):
    the ranges, then block_count, the vocabulary and the width against the tensors the file actually holds."""
    where = header.path
    arch = header.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise BadInputError(f"{where}: no general.architecture in the metadata")
    meta = {k: v.value for k, v in header.kv.items()}
    check_ranges(meta, arch, where)
    infos = header.tensors if tensors is None else tensors
    blocks = meta.get(f"{arch}.block_count")
    present = {int(m.group(1)) for t in infos if (m := _BLOCK_RE.match(t.name))}
    if isinstance(blocks, int) and present:
        if max(present) >= blocks:
            raise BadInputError(
                f"{where}: {arch}.block_count is {blocks:,}, but the file holds tensors of block {max(present)}"
            )
        if len(present) < blocks:
            raise BadInputError(
                f"{where}: {arch}.block_count is {blocks:,}, but the file holds tensors of {len(present)} blocks"
            )
    embd = next((t for t in infos if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2:
        return
    width = meta.get(f"{arch}.embedding_length")
    if isinstance(width, int) and embd.shape[0] != width:
        raise BadInputError(
            f"{where}: {arch}.embedding_length is {width:,}, but token_embd.weight is {embd.shape[0]:,} wide"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens and len(tokens) > embd.shape[1]:
        raise BadInputError(
            f"{where}: the vocabulary has {len(tokens):,} tokens, but token_embd.weight has {embd.shape[1]:,} rows"
        )
