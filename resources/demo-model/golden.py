"""golden.json: greedy continuations of the PyTorch model on the file's weights (`build.py export`, or `golden`
from the shipped file alone)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
from bpe import Codec
from corpus import chat
from model import build_model, load_tensors
from recipe import (
    CFG,
    ENDOFTEXT,
    EXPORT_TYPE,
    GOLDEN,
    IM_END,
    OUTPUT,
    ROPE_FACTOR,
    ROPE_SCALING,
    read_docs,
)
from train import heldout_loss, tokens

GOLDEN_TOKENS = 32
# Logits. ggml rounds activations to Q8_0 blocks; emulated here, but a tiny difference upstream can still move a
# value across a rounding boundary, and a router near-tie (4th vs 5th expert within ~1e-4, frequent with 32
# experts) then picks another expert: later logits move by up to ~0.3. Golden tokens need a larger margin.
MIN_MARGIN = 0.1
# Greedy continuations recorded at export time: (name, prompt, wrap in the chat template).
GOLDEN_PROMPTS = [  # the first three that give >= 5 safe tokens are recorded
    ("genesis", "In the beginning God created", False),
    ("hamlet", "HAMLET:\nTo be, or not to be", False),
    ("define-love", "Define love.", True),
    ("quote-john", "Quote John 3:16.", True),
    ("lord-shepherd", "The LORD is my shepherd", False),
    ("who", "Who are you?", True),
    ("json", "What does the json module do?", True),
    ("import", "The json module", False),
    ("god-said", "And God said", False),
    ("psalm", "Quote Psalms 23:1.", True),
    ("lawyer", "Define lawyer.", True),
    ("romeo", "ROMEO:\n", False),
    ("hacker", "What does hacker mean in hacker jargon?", True),
    ("verse-psalms", "Give me a verse from Psalms.", True),
    ("define-war", "Define war.", True),
    ("kjv-lord", "And the LORD said unto Moses", False),
]
ROUTER_GAP = 2e-4  # 4th minus 5th router probability: below it, the expert choice may differ between engines


def greedy(model: Any, prompt: list[int], n: int, stop: set[int]) -> tuple[list[int], list[float]]:
    """Greedy continuation (full recompute per token) and each step's top-1 minus top-2 logit margin."""
    import torch

    ids = list(prompt)
    out: list[int] = []
    margins: list[float] = []
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids]))
            top = logits[0, -1].double().topk(2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(out[-1])
            if out[-1] in stop:
                break
    return out, margins


def first_router_tie(model: Any, ids: list[int]) -> int:
    """The first position where some layer's 4th and 5th router probabilities are within ROUTER_GAP."""
    import torch

    gaps: list[Any] = []

    def hook(_: Any, __: Any, out: Any) -> None:
        top = torch.softmax(out.float(), -1).topk(CFG.n_expert_used + 1, -1).values
        gaps.append((top[..., -2] - top[..., -1]).reshape(-1))

    handles = [b.moe.router.register_forward_hook(hook) for b in model.blocks]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    tied = (torch.stack(gaps).min(0).values < ROUTER_GAP).nonzero()
    return int(tied[0]) if len(tied) else len(ids)


def sample(model: Any, prompt: list[int], n: int, stop: set[int], temp: float, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids[-CFG.seq_len :]]))
            nxt = int(torch.multinomial(torch.softmax(logits[0, -1] / temp, -1), 1, generator=g))
            ids.append(nxt)
            if nxt in stop:
                break
    return ids[len(prompt) :]


def file_model() -> Any:
    """The PyTorch model on the shipped file's dequantised weights, with its RoPE scaling and ggml's Q8_0 rounding
    of the activations (what `export` records the golden tokens with, rebuilt without the checkpoint)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(OUTPUT))
    arrays = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    field = reader.fields.get("qwen3moe.rope.scaling.type")
    scaling = field.contents() if field else "none"
    factor = reader.fields["qwen3moe.rope.scaling.factor"].contents() if field else 1.0
    model = build_model(CFG, scaling, factor)
    load_tensors(model, arrays)
    model.eval()
    model.act_q8["on"] = EXPORT_TYPE == "Q8_0"
    return model


def cmd_golden(_: argparse.Namespace) -> None:
    """golden.json again from the shipped file (after `context`): no checkpoint needed; the training figures
    are kept from the old golden.json, the Q8_0 held-out loss measured again with the file's RoPE scaling."""
    import torch

    torch.set_num_threads(2)
    training = json.loads(GOLDEN.read_text(encoding="utf-8"))["training"]
    model = file_model()
    training[f"heldout_loss_{EXPORT_TYPE.lower()}"] = round(heldout_loss(model, tokens("heldout"), windows=64), 4)
    record_golden(model, Codec(), training)


def record_golden(model: Any, codec: Codec, training: dict[str, Any]) -> None:
    import hashlib

    stop = {codec.special[ENDOFTEXT], codec.special[IM_END]}
    cases = []
    for name, prompt, as_chat in GOLDEN_PROMPTS:
        text = chat(prompt, "")[: -len(IM_END + "\n")] if as_chat else prompt
        ids = codec.encode(text)
        out, margins = greedy(model, ids, GOLDEN_TOKENS, stop)
        # A near-tie could flip under another engine's rounding: the golden sequence ends before the first one.
        close = [i for i, m in enumerate(margins) if m < MIN_MARGIN]
        if close:
            out, margins = out[: close[0]], margins[: close[0]]
        if len(out) < 5:
            print(f"[{name}] skipped: a near-tie after {len(out)} tokens")
            continue
        cases.append(
            {
                "name": name,
                "prompt": prompt,
                "chat": as_chat,
                "prompt_text": text,
                "prompt_tokens": ids,
                "tokens": out,
                "text": codec.decode([t for t in out if t not in stop]),
                "min_margin": round(min(margins), 4),
            }
        )
        print(f"[{name}] {text!r} -> {cases[-1]['text']!r} (min margin {min(margins):.3f})")
        if len(cases) == 3:
            break
    if len(cases) < 2 or all(c["chat"] for c in cases) or not any(c["chat"] for c in cases):
        raise RuntimeError("too few golden prompts without near-ties: add candidates to GOLDEN_PROMPTS")
    docs = read_docs("heldout.jsonl")
    passage: list[int] = []
    for d in (docs[0], docs[len(docs) // 2], docs[-1]):
        passage += [*codec.encode(d)[:160], codec.special[ENDOFTEXT]]
    passage_tie = first_router_tie(model, passage)
    # Held-out text over the whole extended context (the tests compare TokenWing with llama.cpp past the 512
    # trained positions on it): the middle of the held-out stream, 8 positions short of the context.
    stream = codec.stream(docs)
    mid, n_long = len(stream) // 2, round(CFG.seq_len * ROPE_FACTOR) - 8
    long_passage = [int(t) for t in stream[mid : mid + n_long]]
    digest = hashlib.sha256(OUTPUT.read_bytes()).hexdigest()
    golden = {
        "model": OUTPUT.name,
        "sha256": digest,
        "type": EXPORT_TYPE,
        "note": "greedy continuations of the PyTorch model run on the file's dequantised weights (build.py export)",
        "context": {"length": round(CFG.seq_len * ROPE_FACTOR), "rope_scaling": ROPE_SCALING, "factor": ROPE_FACTOR},
        "training": training,
        "cases": cases,
        "heldout_passage": {"text": codec.decode(passage), "tokens": passage, "first_router_tie": passage_tie},
        "long_passage": {"text": codec.decode(long_passage), "tokens": long_passage},
    }
    GOLDEN.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN} for {OUTPUT} ({OUTPUT.stat().st_size} bytes); {json.dumps(training)}")
    for i, (prompt, as_chat) in enumerate([("KING RICHARD III:\n", False), ("Define happiness.", True)]):
        ids = codec.encode(chat(prompt, "")[: -len(IM_END + "\n")] if as_chat else prompt)
        print(f"sample T=0.8 {prompt!r}: {codec.decode(sample(model, ids, 60, stop, 0.8, i))!r}")
