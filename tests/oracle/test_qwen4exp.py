"""Qwen3.8 Flash Next (`qwen4exp`) against llama.cpp on the same GGUF: hyper-connections, the sigmoid-gated DeltaNet,
QSA (its dense part, a query seeing at most budget + block - 1 cells, and past it the indexer's selection) and the
n-gram table, exact in F32 and at the quantised types' floor, streamed at 25 % of the experts, a prompt split into
passes; stream counts other than 4 refused.

Each prompt spans several layer-major chunks, the decode steps run past position 256 (a new decode window), and the
recurrent state and the streams carry across all of them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_batch_decode import PROMPTS, _alone, _options, _together
from tests.oracle.test_deepseek4_loads import long_probe
from tests.oracle.test_families import clear_top1, steps
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits
from tokenwing.compute import ggml_api as ggml
from tokenwing.compute.ggml_lib import Graph
from tokenwing.errors import UnsupportedError
from tokenwing.format.gguf_io import read_header
from tokenwing.format.reader import ModelFile
from tokenwing.models.glm_dsa import indexer_keys
from tokenwing.models.qwen4exp import NgramKeys, Qwen4Exp
from tokenwing.runtime.memory_plan import graph_bytes
from tokenwing.runtime.session import Session, SessionOptions

pytestmark = pytest.mark.oracle

A = "qwen4exp"
DENSE = {"arch": A, "indexer_top_k": 512}  # (QSA keeps 515 cells: every test prompt sees all)
VARIANTS: dict[str, dict[str, object]] = {
    # DeltaNet ×3 (2 key heads shared by 4 value heads), QSA attention ×1, the n-gram table on layer 0 (trigrams,
    # 2 heads each, a 4-tap convolution dilated by 3)
    "tiny": DENSE,
    "no-table": {**DENSE, "ple_layer": -1},
    # the table on a later layer, bigrams and 4-grams with more heads, a 2-tap convolution
    "table-later": {**DENSE, "n_layer": 8, "ple_layer": 6, "ple_ngram": 4, "ple_heads_per_ngram": 4, "n_embd": 96},
    "bigrams": {**DENSE, "ple_ngram": 2, "ple_heads_per_ngram": 8, "ple_conv_kernel": 2, "ple_head_rows": 50},
    # 8 layers with full attention every other one, a wider model, 10 of 16 experts, rank 64, 8 value heads
    "wide": {
        **DENSE, "n_layer": 8, "full_attention_interval": 2, "n_embd": 128, "n_head": 8, "head_dim": 32,
        "n_expert": 16, "n_expert_used": 10, "hc_low_rank": 64, "ssm_dt_rank": 8, "n_rot": 16,
        "rope_sections": (3, 3, 1, 1), "indexer_head_size": 32,
    },
    # a rank of 1, one key head for every value head, one full layer of 6 (the last), the table on layer 2
    "narrow": {
        **DENSE, "n_layer": 6, "full_attention_interval": 6, "hc_low_rank": 1, "ssm_n_group": 4, "ple_layer": 2,
    },
}  # fmt: skip
# QSA past its budget, on geometries no other test uses: blocks of 3 scored by 3 indexer heads; blocks of 1 (the
# tail always empty, the budget whole blocks); 4 QSA layers of 8-cell blocks, indexer heads of 32 with IMRoPE's
# fourth axis in use (a block's key turns at its first position on all four axes, a query's at 0 on the fourth:
# giving the blocks 0 there too is 0.05 off from position 88 on here)
QSA: dict[str, dict[str, object]] = {
    "odd-blocks": {"arch": A, "qsa_ratio": 3, "indexer_top_k": 12, "indexer_n_head": 3},
    "single-cells": {"arch": A, "qsa_ratio": 1, "indexer_top_k": 5, "indexer_n_head": 1, "indexer_head_size": 32},
    "wide": {**VARIANTS["wide"], "qsa_ratio": 8, "indexer_top_k": 32, "indexer_n_head": 4},
}  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """320 positions: a 200-token prompt (4 chunks), then 120 decode steps across position 256; an EOS in the
    prompt (the n-grams' window resets)."""
    src = model_factory(type="F32", **VARIANTS[variant])  # type: ignore[arg-type]
    tokens = _tokens(320, 512, seed=31)
    tokens[90] = read_header(str(src)).kv["tokenizer.ggml.eos_token_id"].value
    _f32_exact(src, tokens, tmp_path, 1e-4)


def _f32_exact(src: Path, tokens: np.ndarray, tmp_path: Path, max_diff: float) -> None:
    """The first 200 tokens as a prompt (in chunks), the rest as one-graph decode steps: llama.cpp's logits within
    max_diff, mean KL <= 1e-8."""
    ref = llama_logits(src, tokens, tmp_path)
    got, s = steps(_repacked(src, tmp_path), tokens, 200)
    assert s.one_graph_steps  # type: ignore[attr-defined]
    assert np.abs(ref - got).max() <= max_diff
    assert kl_per_position(ref, got).mean() <= 1e-8


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M"])
def test_quantized_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, type_name: str) -> None:
    """300 positions: mean KL <= 1e-4 and the same top-1 where llama.cpp's leads by more than 0.1 logit (weights at
    0.03, as test_families.py explains)."""
    shape = dict(VARIANTS["tiny"], weight_std=0.03)
    if type_name.startswith("Q4_K"):
        shape["preset"] = "kquant"
    src = model_factory(type=type_name, **shape)  # type: ignore[arg-type]
    tokens = _tokens(300, 512, seed=32)
    ref = llama_logits(src, tokens, tmp_path)
    got, _ = steps(_repacked(src, tmp_path), tokens, 200)
    kl = kl_per_position(ref, got)
    assert kl.mean() <= 1e-4, kl.mean()
    assert clear_top1(ref, got) >= 0.99, clear_top1(ref, got)


def test_streamed_at_a_quarter_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path) -> None:
    """25 % of the expert bytes in RAM, the rest read from the file, lookahead 2, QSA selecting past 39 cells:
    llama.cpp's logits (mean KL <= 1e-4) and, to the bit, those of every expert in RAM."""
    src = model_factory(type="Q8_0", **dict(QSA["wide"], weight_std=0.03))  # type: ignore[arg-type]
    model = _repacked(src, tmp_path)
    tokens = _tokens(200, 512, seed=33)
    with ModelFile.open(str(model)) as mf:
        budget = mf.index.total_bytes // 4
    resident, _ = steps(model, tokens, 120, cpu_repack=False)
    streamed, s = steps(model, tokens, 120, cpu_repack=False, ram_budget=budget, lookahead=2)
    assert s.slots_per_layer < s.hp.n_expert
    assert np.array_equal(resident, streamed)
    assert kl_per_position(llama_logits(src, tokens, tmp_path), streamed).mean() <= 1e-4


def test_prompt_split_into_passes_is_identical(model_factory: ModelFactory, tmp_path: Path) -> None:
    """A 2-slot cache and no prompt memory: a 120-token prompt as passes of one chunk, the streams, every layer's
    state and the indexer's keys (QSA selecting past 14 cells) carried between them — the same logits, to the bit,
    as one pass."""
    model = _repacked(model_factory(type="Q8_0", **QSA["odd-blocks"]), tmp_path)  # type: ignore[arg-type]
    tokens = _tokens(120, 512, seed=34).tolist()
    lines: list[str] = []
    opts = {"kv_type": "f32", "n_ctx": 512, "max_batch": 16}
    split = Session(str(model), SessionOptions(ram_budget=1, prompt_memory=0, **opts), lines.append)  # type: ignore[arg-type]
    one = Session(str(model), SessionOptions(**opts), log=lambda line: None)  # type: ignore[arg-type]
    try:
        assert np.array_equal(split.forward(tokens, all_logits=True), one.forward(tokens, all_logits=True))
        assert np.array_equal(split.forward([7]), one.forward([7]))
    finally:
        split.close()
        one.close()
    assert any("running it 16 tokens at a time" in line for line in lines), lines


@pytest.mark.parametrize("variant", QSA)
def test_qsa_selects_as_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """320 positions, far past the budget (14, 5 and 39 cells): a 200-token prompt in chunks, then 120 decode steps
    as one graph each; every query keeps its tail and the blocks llama.cpp's indexer picks, the block cut by the
    budget as its top-k cuts it (breaking the selection, e.g. attending densely, is 0.1 off from position 67 on the
    tiny preset)."""
    src = model_factory(type="F32", **QSA[variant])  # type: ignore[arg-type]
    _f32_exact(src, _tokens(320, 512, seed=39), tmp_path, 1e-5)


def test_qsa_over_a_longer_context(model_factory: ModelFactory, tmp_path: Path) -> None:
    """1,200 positions, a 1,000-token prompt in 16 chunks then 200 decode steps across 4 windows: blocks of 16, a
    budget of 64 scored by 4 heads, up to 75 blocks to pick from (llama.cpp's row its padded window, the engine's
    its own). The same geometry at 2,000 positions (1,500 of prompt): max |dlogit| 4.4e-6. The routers' margins
    are widened (router_scale 4): at the tiny preset's, a near-tie of two experts at position 755 went one way in
    llama.cpp and the other here on an AVX2 machine (0.051 at that position and 83 rows over 1e-5, KL 1.9e-7,
    where llama.cpp with an F16 KV cache is 6.9e-9 from itself with flips of its own; with the wider margins
    max |dlogit| 2.1e-6, KL 1.9e-14). This test is about QSA's selection, which the routers do not touch."""
    shape = {"arch": A, "qsa_ratio": 16, "indexer_top_k": 64, "indexer_n_head": 4, "context_length": 2048}
    shape["router_scale"] = 4.0
    src = model_factory(type="F32", **shape)  # type: ignore[arg-type]
    tokens = _tokens(1200, 512, seed=41)
    ref = llama_logits(src, tokens, tmp_path)
    got, _ = steps(_repacked(src, tmp_path), tokens, 1000)
    assert np.abs(ref - got).max() <= 1e-5
    assert kl_per_position(ref, got).mean() <= 1e-8


def test_the_context_is_the_files(model_factory: ModelFactory, tmp_path: Path) -> None:
    """With the indexer built the context is no longer capped at QSA's dense part (67 tokens in the tiny preset):
    the session takes the file's context length, and a QSA layer's cache holds the indexer's key beside K."""
    src = model_factory(type="F32", arch=A)
    model = _repacked(src, tmp_path)
    s = Session(str(model), SessionOptions(kv_type="f32"), log=lambda line: None)
    try:
        assert s.n_ctx == read_header(str(src)).kv[f"{A}.context_length"].value
        hp = s.hp
        full = [il for il in range(hp.n_layer) if not hp.is_recurrent(il)]
        spec = Qwen4Exp.kv_layer(hp, full[0])
        di = indexer_keys(hp).head_size
        assert spec.k == hp.head_dim * hp.n_head_kv + di and spec.v == hp.head_dim * hp.n_head_kv
    finally:
        s.close()


def test_the_memory_plan_holds_a_qsa_layers_graph(
    model_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt of 2,047 tokens in 64-token chunks, QSA selecting: every graph fits the context the memory plan
    reserves (`graph_bytes`) without its 64 MiB to spare. It did not before `Qwen4Exp.graph_extra_bytes` (the
    selection's [n_kv, 64] tensors: the last chunk's graph took 10.5 MB, the rule without them held 4 MB), and a
    fixed context that overflows aborts the process."""
    src = model_factory(type="F32", **QSA["odd-blocks"], context_length=2048)  # type: ignore[arg-type]
    used: list[int] = []
    compute = Graph.compute

    def measured(self: Graph, *args: Any, **kwargs: Any) -> Any:
        used.append(ggml.ggml_used_mem(self.ctx))
        return compute(self, *args, **kwargs)

    monkeypatch.setattr(Graph, "compute", measured)
    s = Session(str(_repacked(src, tmp_path)), SessionOptions(kv_type="f32", max_batch=64), log=lambda line: None)
    try:
        assert s.n_ctx == 2048
        s.forward(_tokens(2047, 512, seed=40).tolist())
        assert max(used) <= graph_bytes(s.hp, 64, s.n_ctx) - (64 << 20), max(used)
    finally:
        s.close()


def test_several_sequences_select_as_each_alone(repacked_factory: ModelFactory) -> None:
    """Three sequences' decode steps in one graph (the server's batch), QSA keeping 5 single cells of each one's
    own cache: each sequence's logits at every step, to the bit, are those it gets alone."""
    model = str(repacked_factory(type="Q8_0", **QSA["single-cells"]))
    want = [_alone(model, _options(1, None), p) for p in PROMPTS]
    got = _together(model, _options(len(PROMPTS), None), PROMPTS, "apart")
    for w, g in zip(want, got, strict=True):
        assert len(g) == len(w)
        for step, (a, b) in enumerate(zip(w, g, strict=True)):
            assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"


@pytest.mark.parametrize(
    ("shape", "message"),
    [({**DENSE, "hc_mult": 2}, "2 hyper-connection streams")],
)
def test_what_is_refused(model_factory: ModelFactory, tmp_path: Path, shape: dict[str, object], message: str) -> None:
    model = _repacked(model_factory(type="F32", **shape), tmp_path)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedError, match=message):
        Session(str(model), SessionOptions(kv_type="f32"), log=lambda line: None)


def test_ngram_rows_are_the_ones_llama_cpp_reads(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The engine's hash names the rows llama.cpp reads: with the table all zeros (no n-gram signal at all), setting
    only the rows `NgramKeys.rows` gives position p for its longest n-gram leaves llama.cpp's logits before p as
    they were and changes them at p — at the start (missing tokens read as EOS), right after an EOS (the window
    resets), and in the middle, where a wrong multiplier, order or reset would point elsewhere (each of those
    three broken on purpose fails here)."""
    src = model_factory(type="F32", arch=A, indexer_top_k=512)
    meta = {k: v.value for k, v in read_header(str(src)).kv.items()}
    keys = NgramKeys.of(meta, str(src))
    assert keys is not None
    tokens = [int(t) for t in _tokens(40, 490, seed=36)]
    tokens[15] = keys.eos
    # the longest n-gram's heads: each depends on every token of the window (a bigram head on two)
    rows = keys.rows(tokens, [])[:, -keys.heads_per_ngram :]
    targets = [0, 1, 2, 16, 17, 30]
    paths = []
    for name in ["zero", *map(str, targets)]:
        path = tmp_path / f"{name}.gguf"
        shutil.copyfile(src, path)
        t = next(x for x in gguf.GGUFReader(str(path), "r+").tensors if x.name == "per_layer_token_embd.weight")
        table = np.asarray(t.data)
        table[...] = 0
        if name != "zero":
            picked = rows[int(name)]
            table[picked] = np.random.default_rng(int(name)).standard_normal((len(picked), table.shape[1]))
        del t, table  # flush the memory map
        paths.append(path)
    long_probe(paths, tokens, 20, n_ctx=64)
    zero = np.load(str(paths[0]) + ".logits.npy")
    for p, path in zip(targets, paths[1:], strict=True):
        got = np.load(str(path) + ".logits.npy")
        first = min(q for q in range(len(tokens)) if set(rows[q]) & set(rows[p]))  # (p, but for a collision)
        assert np.abs(got[:first] - zero[:first]).max(initial=0.0) < 1e-6, p
        assert np.abs(got[first] - zero[first]).max() > 1e-3, p
    assert len({tuple(r) for r in rows[16:18]}) == 2 and rows[0].tolist() != rows[16].tolist()


@pytest.mark.parametrize("cache_pages", [2, 1 << 14])
def test_the_table_stays_in_the_file(
    model_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_pages: int
) -> None:
    """The n-gram table is never loaded: its rows are read as 4 KiB pages when tokens name them, by a streaming core
    of its own and kept in its slots (here 2, so that almost every row is read again, rows across two pages
    included, or 64 MiB: the whole table),
    and the logits are llama.cpp's either way; a token asks for heads rows, and the pages read are at most the
    rows' pages; with room for them, a graph's missing pages are read as one batch (`NgramRows.batches`)."""
    monkeypatch.setattr(Qwen4Exp, "ngram_cache_bytes", cache_pages * 4096)
    src = model_factory(type="F32", arch=A, indexer_top_k=512, ple_head_rows=3000)  # (12k rows of 64 B: 188 pages)
    model = _repacked(src, tmp_path)
    tokens = _tokens(160, 512, seed=37)
    ref = llama_logits(src, tokens, tmp_path)
    s = Session(str(model), SessionOptions(kv_type="f32", n_ctx=512), log=lambda line: None)
    try:
        got = np.concatenate(
            [s.forward(tokens[:100].tolist(), all_logits=True)]
            + [s.forward([int(t)]).reshape(1, -1) for t in tokens[100:]]
        )
        rows = s.model.ngram_rows  # type: ignore[attr-defined]
        assert not s.model.weights.has("per_layer_token_embd.weight")
        assert rows.rows_asked == 160 * 4  # (4 heads: trigrams and bigrams, 2 each)
        assert 0 < rows.page_reads <= 2 * rows.rows_asked
        if cache_pages > 200:  # everything fits: each page read once, a graph's misses issued together
            assert rows.page_reads <= 188
            assert rows.batches <= 1 + 60 < rows.page_reads
        # on the streaming core's reads, and in the session's statistics
        lazy = s.stats()["lazy_reads"]
        assert lazy["page_reads"] == rows.page_reads and lazy["bytes_read"] == 4096 * rows.page_reads
        assert lazy["rows"] == rows.rows_asked and "wait_ns" in lazy
    finally:
        s.close()
    assert kl_per_position(ref, got).mean() <= 1e-8


def test_the_tables_pages_share_the_expert_cache_budget(model_factory: ModelFactory, tmp_path: Path) -> None:
    """One memory limit: with half the expert bytes as the budget, the table's page cache takes a sixteenth of it
    and the expert cache is planned in what is left (without a table, it gets the whole budget)."""
    for ple_layer, share in ((0, True), (-1, False)):
        model = _repacked(model_factory(type="F32", arch=A, indexer_top_k=512, ple_layer=ple_layer), tmp_path)
        with ModelFile.open(str(model)) as mf:
            budget = mf.index.total_bytes // 2
        s = Session(str(model), SessionOptions(kv_type="f32", ram_budget=budget), log=lambda line: None)
        try:
            rows = s.model.ngram_rows  # type: ignore[attr-defined]
            taken = rows.capacity * 4096 if rows is not None else 0
            assert (rows is not None) == share
            if share:  # (never more pages than the table has)
                assert taken == min(budget // 16 // 4096, rows.n_pages) * 4096
            assert 0 < s.scheduler.capacity <= budget - taken
            assert s.scheduler.capacity > budget - taken - max(s.scheduler.record_sizes.values()) * len(s.streamed)
        finally:
            s.close()


@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_the_default_f16_cache_is_llama_cpps_f16_cache(
    model_factory: ModelFactory, tmp_path: Path, type_name: str
) -> None:
    """The engine's default KV type against llama.cpp's default (both caches F16, the indexer's keys too; the
    recurrent states F32 in both), with the table and QSA selecting past 14 cells, 300 positions across 256 (weights
    at 0.03, as the quantised tests): within llama.cpp's own floor, the distance between its F16 and F32 caches."""
    src = model_factory(type=type_name, **dict(QSA["odd-blocks"], weight_std=0.03))  # type: ignore[arg-type]
    tokens = _tokens(300, 512, seed=38)
    ref16 = llama_logits(src, tokens, tmp_path, f16_kv=True)
    floor = kl_per_position(llama_logits(src, tokens, tmp_path), ref16).mean()
    s = Session(str(_repacked(src, tmp_path)), SessionOptions(kv_type="f16", n_ctx=512), log=lambda line: None)
    try:
        got = np.concatenate(
            [s.forward(tokens[:200].tolist(), all_logits=True)]
            + [s.forward([int(t)]).reshape(1, -1) for t in tokens[200:]]
        )
    finally:
        s.close()
    kl = kl_per_position(ref16, got).mean()
    assert kl <= max(floor, 1e-8) and kl <= 1e-4, (kl, floor)
