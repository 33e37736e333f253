"""KV bytes per token: one number per model, from its family's own rule (models/<family>.py `kv_layer` and
`kv_bytes_per_token`), and it is what the runtime's KV cache allocates. `inspect` (and through it the app's
estimate) and the memory plan use that number; before, inspect counted every layer of Qwen3-Next, whose linear
layers keep a recurrent state instead (4x too much)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ModelFactory
from tokenwing.format.inspect import inspect_model
from tokenwing.models import FAMILIES
from tokenwing.runtime.session import Session, SessionOptions

# every family the engine runs (GLM-4.5 runs with its shared expert only; the linear-attention families with 8
# layers, 2 of them full attention), and the older form of DeepSeek's attention (no MLA: every head's K and V)
EXTRA: dict[str, dict[str, object]] = {
    "glm4moe": {"n_shared_exp": 1},
    **{arch: {"n_layer": 8} for arch in ("qwen3next", "qwen35moe", "bailingmoe3")},
}
CASES = [{"arch": arch, **EXTRA.get(arch, {})} for arch in sorted(FAMILIES)]
CASES.append({"arch": "deepseek2", "legacy_kv_b": True})


def _session(model: Path, n_ctx: int, kv_type: str = "f16") -> Session:
    opts = SessionOptions(n_ctx=n_ctx, kv_type=kv_type, lookahead=0, usage_table=False, prompt_cache=False)
    return Session(str(model), opts, log=lambda line: None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_the_number_is_what_the_cache_allocates(repacked_factory: ModelFactory, case: dict[str, object]) -> None:
    model = repacked_factory(type="F16", **case)
    said = inspect_model([str(model)])["kv_bytes_per_token"]
    s = _session(model, 64)
    try:
        assert s.kv.nbytes == 64 * s.model.kv_bytes_per_token(s.hp, 2) == 64 * said
        assert s.prompt_memory.kv_per_token == said  # the memory plan's number is the same one
    finally:
        s.close()


def test_qwen3next_caches_only_its_full_attention_layers(repacked_factory: ModelFactory) -> None:
    model = repacked_factory(arch="qwen3next", type="F16", n_layer=8, n_head_kv=2, head_dim=32)
    # layers 3 and 7 attend (every 4th), the other six keep a recurrent state: 2 layers x (K + V) x 2 KV heads x
    # 32 x 2 bytes (counting all 8 layers, as inspect did, is 4x this)
    assert inspect_model([str(model)])["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 2


def test_glm_5_2_number_is_its_cache_and_its_picks(repacked_factory: ModelFactory) -> None:
    """GLM-5.2's shared layers read the last full layer's picks from a buffer of the model's (F32, top-k a position),
    beside the cache: the number inspect, the memory plan and the app's estimate use is both (here 896 + 32 bytes a
    token), and what the session allocates for them."""
    model = repacked_factory(arch="glm-dsa", type="F16", n_layer=4, indexer_types=(1, 0, 1, 0), indexer_top_k=8)
    said = inspect_model([str(model)])["kv_bytes_per_token"]
    s = _session(model, 64)
    try:
        s.forward([1, 2, 3, 4, 5])  # (the picks buffer is made with the first graph that reads it)
        buffers: dict[Any, Any] = s.model._picks  # type: ignore[attr-defined]
        picks = sum(4 * int(t.contents.ne[0]) * int(t.contents.ne[1]) for t in buffers.values())  # (F32)
        assert picks == 64 * 4 * 8
        assert s.kv.nbytes + picks == 64 * said == 64 * s.prompt_memory.kv_per_token
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["gguf", "repacked"])
def test_inspect_counts_qwen4exps_table_as_read_sparsely(
    model_factory: ModelFactory, repacked_factory: ModelFactory, kind: str
) -> None:
    """Qwen3.8 Flash Next's n-gram table stays in the file (the engine reads the rows tokens name): inspect says so
    apart ("lazy"), so neither its resident bytes (what the estimate keeps in RAM) nor the bytes a token reads hold
    it — they held the whole table, for the released model ~27 GB always loaded and read by every token. Without a
    table nothing is lazy; the file's parameters still count it."""
    from tokenwing.format.reader import ModelFile

    path = (model_factory if kind == "gguf" else repacked_factory)(arch="qwen4exp", type="Q8_0")
    r = inspect_model([str(path)])
    assert r["lazy"]["names"] == ["per_layer_token_embd.weight"] and r["lazy"]["tensors"] == 1
    src = model_factory(arch="qwen4exp", type="Q8_0")
    with ModelFile.open(str(repacked_factory(arch="qwen4exp", type="Q8_0"))) as mf:
        table = next(t for t in mf.resident if t.name == "per_layer_token_embd.weight")
        everything = sum(t.nbytes for t in mf.resident)
    assert r["lazy"]["bytes"] == table.nbytes > 0
    assert r["resident"]["bytes"] == everything - table.nbytes
    assert r["resident"]["read_per_token_bytes"] < r["resident"]["bytes"]  # (less the embedding's other rows)
    plain = inspect_model([str(model_factory(arch="qwen4exp", type="Q8_0", ple_layer=-1))])
    assert plain["lazy"] == {"tensors": 0, "bytes": 0, "names": []}
    assert plain["parameters"] < inspect_model([str(src)])["parameters"]
