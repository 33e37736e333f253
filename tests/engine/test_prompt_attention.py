"""A prompt token's result does not depend on how its prompt was split (chunk size, several calls, a one-token
rest): with the two matrix products over a KV window rounded up to 256 positions (the default), and with F32
tiled flash attention (`--prompt-attention flash`); both agree with the attention of before to rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tokenwing.models import common
from tokenwing.runtime.session import Session, SessionOptions


def _logits(
    model: Path, tokens: list[int], splits: list[int], max_batch: int, kv_type: str = "f16", attention: str = "products"
) -> np.ndarray:
    """Logits of every prompt position, the prompt given to `forward` in pieces of these lengths."""
    opts = SessionOptions(n_ctx=300, max_batch=max_batch, kv_type=kv_type, prompt_attention=attention)
    s = Session(str(model), opts, log=lambda line: None)
    try:
        out, at = [], 0
        for n in splits:
            out.append(s.forward(tokens[at : at + n], all_logits=True, prompt=True).reshape(n, -1))
            at += n
        assert at == len(tokens)
        return np.concatenate(out)
    finally:
        s.close()


SHAPES = [{"type": "F32"}, {"type": "Q8_0"}, {"type": "F32", "arch": "gpt-oss", "preset": "tiny"}]


@pytest.mark.parametrize("attention", ["products", "flash"])
@pytest.mark.parametrize("shape", SHAPES, ids=["qwen3moe-f32", "qwen3moe-q8_0", "gpt-oss"])
def test_a_prompt_token_does_not_depend_on_the_chunking(
    repacked_factory: ModelFactory, shape: dict[str, object], attention: str
) -> None:
    model = repacked_factory(n_layer=2, **shape)
    tokens = np.random.default_rng(7).integers(0, 200, 280).tolist()
    whole = _logits(model, tokens, [280], 64, attention=attention)  # chunks of 64 … 24, keys past 256
    assert np.array_equal(whole, _logits(model, tokens, [280], 16, attention=attention))
    assert np.array_equal(whole, _logits(model, tokens, [70, 1, 1, 208], 64, attention=attention))
    assert np.array_equal(whole, _logits(model, tokens, [3, 277], 40, attention=attention))


def test_both_agree_with_the_attention_of_before(
    repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the two products over exactly the keys written so far (before: a sum's length depended on the
    chunk), F32 cache: rounding apart."""
    model = repacked_factory(type="F32", n_layer=2)
    tokens = np.random.default_rng(8).integers(0, 200, 130).tolist()
    products = _logits(model, tokens, [130], 64, "f32")
    flash = _logits(model, tokens, [130], 64, "f32", "flash")

    def unpadded(self: Session, pos0: int, n: int, decode: bool) -> common.Placement:
        n_kv = common.decode_window(pos0, self.n_ctx) if decode else pos0 + n
        return common.placement(self.graph, pos0, n, n_kv, self.n_ctx, self._v_width, self.model.window)

    monkeypatch.setattr(Session, "_placement", unpadded)
    before = _logits(model, tokens, [130], 64, "f32")
    assert not np.array_equal(flash, before)  # (the paths really differ)
    for got in (products, flash):
        assert np.abs(got - before).max() <= 1e-4 * np.abs(before).max()


LAST_CHUNK = r"""
import sys
from tokenwing.runtime.session import Session, SessionOptions
s = Session(sys.argv[1], SessionOptions(n_ctx=int(sys.argv[2]), prompt_attention=sys.argv[3]), log=lambda line: None)
# the last chunk a full context can hold attends over every position: the largest prompt graph there is
s.pos = s.n_ctx - 64
s.history = [0] * s.pos
s.forward(list(range(64)), prompt=True)
print("fits")
if len(sys.argv) > 4:  # then a reply token: the prompt's graph memory is given back first
    def rss():
        return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmRSS"))
    s.pos, s.history = s.n_ctx - 128, [0] * (s.n_ctx - 128)
    s.forward(list(range(64)), prompt=True)
    before = rss()
    s.forward([1])
    print(before - rss())
"""


def test_a_chunk_at_the_end_of_a_long_context_fits_the_graph_reserve(repacked_factory: ModelFactory) -> None:
    """A 16k-token prompt on the bench model aborted in ggml's context ("not enough space in the context's memory
    pool") near its end: a chunk's attention scores and their softmax were two copies of 4 · heads · 64 · n_ctx
    bytes, the reserve counted one. Here the scores are 16 heads × 64 × 65,536 × 4 = 268 MB, so a second copy
    overflows the reserve's slack. (In a child process: ggml aborts on overflow.)"""
    import subprocess
    import sys

    model = repacked_factory(n_layer=1, n_head=16, n_head_kv=2, context_length=65536)
    r = subprocess.run(
        [sys.executable, "-c", LAST_CHUNK, str(model), "65536", "products"], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-500:]
    assert r.stdout.strip() == "fits"


def test_a_reply_gives_back_what_the_prompt_graphs_touched(repacked_factory: ModelFactory) -> None:
    """After a long prompt its graphs' memory (here 268 MB of attention scores, with the products) is charged to
    the memory limit until given back; the first reply token gives it back (Graph.release): under a cap, a
    spilled KV cache's pages need that room (docs/results.md)."""
    import subprocess
    import sys

    model = repacked_factory(n_layer=1, n_head=16, n_head_kv=2, context_length=65536)
    r = subprocess.run(
        [sys.executable, "-c", LAST_CHUNK, str(model), "65536", "products", "reply"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-500:]
    fits, given_back = r.stdout.split()
    assert fits == "fits"
    assert int(given_back) > 200 << 20
