"""`build.py export` and `context`: the GGUF (qwen3moe, Q8_0) with its header, and its context keys in place."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from bpe import Codec
from golden import record_golden
from model import build_model, gguf_tensors, load_tensors
from recipe import (
    CFG,
    ENDOFTEXT,
    EXPORT_TYPE,
    IM_END,
    OUTPUT,
    ROPE_FACTOR,
    ROPE_SCALING,
    SPECIALS,
    WORK,
)
from train import heldout_loss, tokens


def shape() -> Any:
    from tokenwing.testmodel.shapes import ModelShape

    return ModelShape(
        arch="qwen3moe",
        n_layer=CFG.n_layer,
        n_embd=CFG.n_embd,
        n_head=CFG.n_head,
        n_head_kv=CFG.n_head_kv,
        head_dim=CFG.head_dim,
        n_expert=CFG.n_expert,
        n_expert_used=CFG.n_expert_used,
        n_ff_exp=CFG.n_ff_exp,
        vocab_size=CFG.vocab_size,
        context_length=CFG.seq_len,
        rope_base=CFG.rope_base,
        rms_eps=CFG.rms_eps,
    )


def quantize(tensors: dict[str, np.ndarray], type_name: str) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    """name -> (ggml type, file bytes, dequantised values). Vectors and routers stay F32, as llama.cpp keeps them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as q

    out: dict[str, tuple[int, np.ndarray, np.ndarray]] = {}
    for name, x in tensors.items():
        if x.ndim == 1 or "ffn_gate_inp" in name or type_name == "F32":
            qt = GGMLQuantizationType.F32
        else:
            qt = GGMLQuantizationType[type_name]
        data = q(x, qt)
        out[name] = (int(qt), data, dequantize(data, qt).reshape(x.shape).astype(np.float32))
    return out


def gguf_metadata(codec: Codec, type_name: str) -> dict[str, Any]:
    from tokenwing.format.gguf_io import KV, ValueType
    from tokenwing.testmodel.architectures import architecture
    from tokenwing.testmodel.tokenizer import CHATML_TEMPLATE, TOKEN_CONTROL, TOKEN_NORMAL

    model = json.loads(codec.tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TOKEN_NORMAL] * len(tokens) + [TOKEN_CONTROL] * len(SPECIALS)
    tokens += SPECIALS
    if len(tokens) != CFG.vocab_size:
        raise RuntimeError(f"vocabulary has {len(tokens)} tokens, the model {CFG.vocab_size}")
    s = shape()
    kv: dict[str, Any] = {
        "general.architecture": KV.string("qwen3moe"),
        "general.name": KV.string("TokenWing demo MoE"),
        "general.description": KV.string(
            "A 22M-parameter Qwen3-MoE trained from scratch on the King James Bible, Shakespeare's plays, "
            "the Devil's Dictionary, the Jargon File and the Python 3.11 documentation (resources/demo-model)."
        ),
        "general.license": KV.string("see docs/demo-model.md"),
        "general.file_type": KV.u32({"F32": 0, "F16": 1, "Q8_0": 7}[type_name]),
        "general.quantization_version": KV.u32(2),
    }
    kv.update(architecture("qwen3moe").metadata(s))
    kv.update(
        {
            "tokenizer.ggml.model": KV.string("gpt2"),
            "tokenizer.ggml.pre": KV.string("qwen2"),
            "tokenizer.ggml.tokens": KV.strings(tokens),
            "tokenizer.ggml.token_type": KV.array(ValueType.INT32, types),
            "tokenizer.ggml.merges": KV.strings(merges),
            "tokenizer.ggml.eos_token_id": KV.u32(codec.special[ENDOFTEXT]),
            "tokenizer.ggml.eot_token_id": KV.u32(codec.special[IM_END]),
            "tokenizer.ggml.padding_token_id": KV.u32(codec.special[ENDOFTEXT]),
            "tokenizer.ggml.bos_token_id": KV.u32(codec.special[ENDOFTEXT]),
            "tokenizer.ggml.add_bos_token": KV.boolean(False),
            "tokenizer.chat_template": KV.string(CHATML_TEMPLATE),
        }
    )
    return kv


def context_kv(kv: dict[str, Any], scaling: str = ROPE_SCALING, factor: float = ROPE_FACTOR) -> dict[str, Any]:
    """`kv` with its context keys set: context_length = factor x the training windows, and llama.cpp's
    rope.scaling keys (type, factor, original_context_length; `none`: the training context and no keys). The
    scaling keys follow the architecture's own, so `export` and `context` (the shipped file's header rewritten)
    write the same bytes."""
    from tokenwing.format.gguf_io import KV

    a = "qwen3moe"
    n_ctx = CFG.seq_len if scaling == "none" else round(CFG.seq_len * factor)
    scaling_kv = {}
    if scaling != "none":
        scaling_kv = {
            f"{a}.rope.scaling.type": KV.string(scaling),
            f"{a}.rope.scaling.factor": KV.f32(factor),
            f"{a}.rope.scaling.original_context_length": KV.u32(CFG.seq_len),
        }
    keep = {k: v for k, v in kv.items() if not k.startswith(f"{a}.rope.scaling.")}
    last = [k for k in keep if k.startswith(f"{a}.")][-1]
    out: dict[str, Any] = {}
    for k, v in keep.items():
        out[k] = KV.u32(n_ctx) if k == f"{a}.context_length" else v
        if k == last:
            out.update(scaling_kv)
    return out


def write_gguf(path: Path, kv: dict[str, Any], tensors: dict[str, tuple[int, np.ndarray, np.ndarray]]) -> None:
    from tokenwing.format.gguf_io import TensorInfo, encode_header, layout_tensors, tensor_nbytes
    from tokenwing.fsutil import atomic_output
    from tokenwing.testmodel.architectures import architecture

    specs = architecture("qwen3moe").tensors(shape())
    if [s.name for s in specs] != list(tensors):
        raise RuntimeError("tensor names differ from the qwen3moe layout")
    infos = []
    for spec in specs:
        qt, data, _ = tensors[spec.name]
        info = TensorInfo(spec.name, spec.shape, qt, 0, tensor_nbytes(spec.shape, qt))
        if info.nbytes != data.nbytes:
            raise RuntimeError(f"{spec.name}: {data.nbytes} bytes, expected {info.nbytes}")
        infos.append(info)
    alignment = 32
    size = layout_tensors(infos, alignment)
    header, _ = encode_header(kv, infos, alignment)
    with atomic_output(str(path), len(header) + size) as tmp, open(tmp, "wb") as f:
        f.write(header)
        for info in infos:
            f.seek(len(header) + info.offset)
            f.write(tensors[info.name][1].tobytes())
        f.truncate(len(header) + size)


def cmd_export(_: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(2)
    state = torch.load(WORK / "checkpoint.pt", weights_only=False)
    codec = Codec()
    model = build_model(CFG)
    model.load_state_dict(state["model"])
    model.eval()
    held = tokens("heldout")
    loss_f32 = heldout_loss(model, held, windows=64)
    quant = quantize(gguf_tensors(model), EXPORT_TYPE)
    write_gguf(OUTPUT, context_kv(gguf_metadata(codec, EXPORT_TYPE)), quant)
    # From here on: exactly the file's weights, and ggml's rounding of the activations.
    model = build_model(CFG, ROPE_SCALING, ROPE_FACTOR)
    load_tensors(model, {k: v[2] for k, v in quant.items()})
    model.eval()
    model.act_q8["on"] = EXPORT_TYPE == "Q8_0"
    # Held-out loss over the training windows (positions 0..511), with the file's RoPE scaling.
    loss_q = heldout_loss(model, held, windows=64)
    training = {
        "steps": state["step"],
        "tokens": state["tokens"],
        "minutes": round(state["elapsed"] / 60, 1),
        "heldout_loss_f32": round(loss_f32, 4),
        f"heldout_loss_{EXPORT_TYPE.lower()}": round(loss_q, 4),
    }
    record_golden(model, codec, training)


def cmd_context(_: argparse.Namespace) -> None:
    """The shipped file's context keys set to ROPE_SCALING / ROPE_FACTOR in place; tensors byte for byte."""
    from tokenwing.format.gguf_io import read_header, rewrite_metadata

    h = rewrite_metadata(str(OUTPUT), str(OUTPUT), context_kv(read_header(str(OUTPUT)).kv))
    print(f"wrote {OUTPUT} ({h.file_size} bytes): context {h.get('qwen3moe.context_length')}, {ROPE_SCALING}")
