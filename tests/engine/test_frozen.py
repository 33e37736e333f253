"""Frozen outputs: greedy tokens and logits of a fixed generated model, saved once; refactors must keep them.

Regenerate (only for an intended change of output) with: TW_REFREEZE=1 pytest tests/engine/test_frozen.py
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from tests.conftest import ModelFactory
from tokenwing.runtime.generate import generate
from tokenwing.runtime.sampler import Sampler, SamplerSettings
from tokenwing.runtime.session import Session, SessionOptions

GOLDEN = Path(__file__).parent.parent / "golden" / "greedy-qwen3moe-q8_0.json"


def test_frozen_greedy_run(repacked_factory: ModelFactory) -> None:
    model = repacked_factory(type="Q8_0", n_layer=3, seed=11)
    s = Session(str(model), SessionOptions(kv_type="f32", n_ctx=256, ram_budget=1), log=lambda line: None)
    try:
        prompt = s.tokenizer.encode("The quick brown fox jumps over the lazy dog", special=False)
        logits = s.forward(prompt, all_logits=True)
        s.reset()
        gen = generate(s, prompt, 24, Sampler(SamplerSettings(temperature=0)))
    finally:
        s.close()
    got = {
        "prompt": prompt,
        "tokens": gen.tokens,
        "tokens_sha256": hashlib.sha256(json.dumps(gen.tokens).encode()).hexdigest(),
        "last_logits_head": [round(float(x), 4) for x in logits[-1, :16]],
        "logits_sum": round(float(logits.astype(np.float64).sum()), 2),
    }
    if os.environ.get("TW_REFREEZE"):
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert got["prompt"] == want["prompt"]
    assert got["tokens"] == want["tokens"] and got["tokens_sha256"] == want["tokens_sha256"]
    assert np.allclose(got["last_logits_head"], want["last_logits_head"], atol=2e-4)
    assert abs(got["logits_sum"] - want["logits_sum"]) < 0.05
