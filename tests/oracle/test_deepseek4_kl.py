"""DeepSeek V4 (`deepseek4`, models/deepseek4.py) against llama.cpp on the factory's files: the logits of a prompt and
of decode steps after it, in RAM and streamed, and the compressors' carried rows across passes and checkpoints.

Every test runs 300 positions: a 200-token prompt in chunks of 64 (blocks complete across chunk ends, the carried
rows cross them), then 100 decode steps past a full HCA block (128) and past position 256 (a wider attention view);
the window (16 on the tiny preset) is far shorter, so most of the history reaches the queries only through the
compressed blocks (tests/oracle/test_deepseek4_loads.py shows llama.cpp's logits depend on them there).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_families import clear_top1, steps
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits
from tokenwing.format.reader import ModelFile
from tokenwing.runtime.session import Session, SessionOptions

pytestmark = pytest.mark.oracle

A = "deepseek4"
N, PROMPT, BATCH = 300, 200, 64
# The tiny preset (window, window, CSA, HCA; two hash layers), and one whose layer kinds, hash layers, output
# groups, indexer and head differ from it: HCA first, a CSA layer whose indexer keeps a single block, one output
# group, one hash layer, YaRN on the compressing layers, a head of 64 as wide as the indexer's (llama.cpp then
# rotates every cache by its Hadamard matrix, the engine none: equal up to rounding).
GEOMETRIES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "hca-first-yarn": {
        "compress_ratios": (128, 4, 0, 4, 4), "n_layer": 5, "hash_layer_count": 1, "o_group_count": 1,
        "indexer_n_head": 2, "indexer_top_k": 1, "head_dim": 64, "n_rot": 32, "sliding_window": 24,
        "yarn_factor": 4.0, "yarn_orig_ctx": 128, "n_expert_used": 3,
    },
}  # fmt: skip


def _session(model: Path, **opts: Any) -> Session:
    options = {"kv_type": "f32", "n_ctx": 512, "max_batch": BATCH, **opts}
    return Session(str(model), SessionOptions(**options), log=lambda line: None)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, geometry: str) -> None:
    """The prompt's logits and each decode step's: max |Δ| ≤ 1e-4 (std 1) and mean KL ≤ 1e-8 (measured ~3e-6 and
    ~1e-13: rounding); decode as one graph per step, reused across positions (its blocks' rows and masks are
    inputs)."""
    src = model_factory(arch=A, type="F32", **GEOMETRIES[geometry])
    tokens = _tokens(N, 512, seed=31)
    ref = llama_logits(src, tokens, tmp_path)
    got, s = steps(_repacked(src, tmp_path), tokens, PROMPT, max_batch=BATCH)
    assert s.one_graph_steps  # type: ignore[attr-defined]
    assert np.abs(ref - got).max() <= 1e-4
    assert kl_per_position(ref, got).mean() <= 1e-8


@pytest.mark.parametrize("type_name", ["Q8_0", "MXFP4_MOE"])
def test_quantized_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, type_name: str) -> None:
    """Q8_0, and the real files' MXFP4 experts with Q8_0 elsewhere, weights at std 0.03 (well-conditioned, as
    test_families.py explains): mean KL ≤ 1e-4 and no larger than llama.cpp's own with an F16 KV cache instead of
    F32 (measured: 0, bit-exact, against 4e-7), the same top-1 wherever llama.cpp's is clear."""
    src = model_factory(arch=A, type=type_name, weight_std=0.03, **GEOMETRIES["hca-first-yarn"])
    tokens = _tokens(N, 512, seed=34)
    ref = llama_logits(src, tokens, tmp_path)
    floor = kl_per_position(ref, llama_logits(src, tokens, tmp_path, f16_kv=True)).mean()
    got, _ = steps(_repacked(src, tmp_path), tokens, PROMPT, max_batch=BATCH)
    kl = kl_per_position(ref, got).mean()
    assert kl <= 1e-4 and kl <= floor, (kl, floor)
    assert clear_top1(ref, got) >= 0.99


def test_f16_cache_is_within_llama_cpps_own_f16_floor(model_factory: ModelFactory, tmp_path: Path) -> None:
    """With an F16 KV cache (the compressed blocks in F16; the raw keys' ring and the compressors' rows are F32
    state): KL against llama.cpp's F32 cache no larger than llama.cpp's own F16 cache's (measured 1e-9 against
    5e-8). (Where an F16 indexer key flips a block choice, both runs share the flip and land within 0.1 % of each
    other: the tiny preset with 4 indexer heads gives 4.9637e-5 against 4.9625e-5.)"""
    shape = {"compress_ratios": (128, 4, 0, 4), "o_group_count": 1, "indexer_n_head": 1, "indexer_top_k": 1}
    src = model_factory(arch=A, type="F32", **shape)
    tokens = _tokens(N, 512, seed=21)
    ref = llama_logits(src, tokens, tmp_path)
    floor = kl_per_position(ref, llama_logits(src, tokens, tmp_path, f16_kv=True)).mean()
    s = _session(_repacked(src, tmp_path), kv_type="f16")
    try:
        first = s.forward(tokens[:PROMPT].tolist(), all_logits=True)
        got = np.concatenate([first, *(s.forward([int(t)]).reshape(1, -1) for t in tokens[PROMPT:])])
    finally:
        s.close()
    kl = kl_per_position(ref, got).mean()
    assert kl <= floor, (kl, floor)


def test_f32_past_the_raw_keys_ring(model_factory: ModelFactory, tmp_path: Path) -> None:
    """820 positions, past the ring of raw keys (768 slots on the tiny preset: its window of 16 plus 512, padded to
    256): a 720-token prompt, then 100 decode steps, as exact as before the ring turned over (slots hold the
    latest position of their residue; the window mask follows them)."""
    src = model_factory(arch=A, type="F32")
    tokens = _tokens(820, 512, seed=37)
    ref = llama_logits(src, tokens, tmp_path)
    got, s = steps(_repacked(src, tmp_path), tokens, 720, max_batch=BATCH)
    assert s.model.ring == 768  # type: ignore[attr-defined]
    assert np.abs(ref - got).max() <= 1e-4
    assert kl_per_position(ref, got).mean() <= 1e-8


def test_streamed_at_a_quarter_is_bit_identical_to_resident(model_factory: ModelFactory, tmp_path: Path) -> None:
    """25 % of the expert bytes (a prompt's experts in waves, decode experts read as selected or predicted, the
    hash layers' from the token's table), lookahead 0 and 2: the same logits as every expert in RAM."""
    model = _repacked(model_factory(arch=A, type="Q8_0", **GEOMETRIES["hca-first-yarn"]), tmp_path)
    with ModelFile.open(str(model)) as mf:
        budget = mf.index.total_bytes // 4
    tokens = _tokens(N, 512, seed=32)
    resident, s = steps(model, tokens, PROMPT, max_batch=BATCH)
    assert s.slots_per_layer == s.hp.n_expert
    for lookahead in (0, 2):
        streamed, s = steps(model, tokens, PROMPT, max_batch=BATCH, ram_budget=budget, lookahead=lookahead)
        assert s.slots_per_layer < s.hp.n_expert
        assert np.array_equal(resident, streamed), lookahead


@pytest.mark.parametrize(("geometry", "kv_type", "n_ctx"), [("tiny", "f16", 512), ("hca-first-yarn", "f32", 300)])
def test_the_reused_decode_graph_is_a_graph_built_for_each_position(
    model_factory: ModelFactory, tmp_path: Path, geometry: str, kv_type: str, n_ctx: int
) -> None:
    """Decode as one graph reused over each 64-position window (the compressors pool the block in progress at every
    step, into a row no query sees until the block completes) against a graph per layer built for each position:
    the same logits, bit for bit, over 200 steps across HCA and CSA blocks, windows and the F16 cache. A context of
    300 ends inside an HCA block that can never complete: from 256 on, steps run a graph per layer. The inputs of
    the graphs rebuilt at each window are let go with them."""
    model = _repacked(model_factory(arch=A, type="Q8_0", **GEOMETRIES[geometry]), tmp_path)
    tokens = _tokens(N, 512, seed=37).tolist()
    got = {}
    for one_graph in (True, False):
        s = _session(model, kv_type=kv_type, n_ctx=n_ctx, token_graph=one_graph)
        reused = []
        try:
            out = [s.forward(tokens[:100])]
            for t in tokens[100:]:
                out.append(s.forward([t]))
                reused.append(s._token_graph is not None and s.model.one_graph_at(s.pos - 1, s.n_ctx))
            gc.collect()
            assert len(s.model._inputs) == one_graph  # type: ignore[attr-defined]  # (the live graph's only)
        finally:
            s.close()
        assert any(reused) == one_graph and all(reused) == (one_graph and n_ctx % 128 == 0)
        got[one_graph] = np.stack(out)
    assert np.array_equal(got[True], got[False])


def test_prompt_resumed_from_checkpoints_is_identical(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The compressors' carried rows are a recurrent state: a prompt split into passes of one chunk, a request that
    repeats a prompt (resumed from the checkpoint one token before its end) and one that shares only its start
    (resumed from a chunk-end checkpoint) give the logits of one fresh pass, to the bit."""
    model = _repacked(model_factory(arch=A, type="Q8_0"), tmp_path)
    tokens = _tokens(N, 512, seed=33).tolist()
    fresh = _session(model)
    try:
        want = fresh.forward(tokens[:PROMPT], all_logits=True)
        want_next = fresh.forward(tokens[PROMPT : PROMPT + 1])
        other = tokens[:130] + tokens[150 : PROMPT + 20]
        fresh.reset()
        want_other = fresh.forward(other, all_logits=True)
    finally:
        fresh.close()
    s = _session(model, checkpoint_interval=BATCH)
    try:
        assert np.array_equal(s.forward(tokens[:PROMPT], all_logits=True), want)
        assert np.array_equal(s.forward(tokens[PROMPT : PROMPT + 1]), want_next)
        kept = s.reuse_prefix(tokens[:PROMPT])  # the same prompt again: from the checkpoint before its last token
        assert kept == PROMPT - 1
        assert np.array_equal(s.forward(tokens[kept:PROMPT], all_logits=True), want[kept:])
        kept = s.reuse_prefix(other)  # diverges at 130: the last chunk end before it
        assert kept == 128
        assert np.array_equal(s.forward(other[kept:], all_logits=True), want_other[kept:])
    finally:
        s.close()


def test_kv_bytes_per_token_counts_the_raw_keys_and_the_compressed_blocks(model_factory: ModelFactory) -> None:
    """The study's §3 rule (what the cache allocates a position): a CSA layer's blocks and its indexer's every 4
    positions and an HCA layer's every 128, at 2 bytes an element (F16); the raw keys' ring is fixed state."""
    from tokenwing.format.gguf_io import read_header
    from tokenwing.models import kv_bytes_per_token

    path = model_factory(arch=A, type="F32")
    meta = {k: v.value for k, v in read_header(str(path)).kv.items()}
    d, di = 128, 64  # the tiny preset's head and indexer head; layers: window, window, CSA, HCA
    want = 2 * ((d // 4 + di // 4) + d // 128)
    assert kv_bytes_per_token(meta, A, str(path)) == want


def test_hash_layers_experts_are_read_from_the_tokens_start(model_factory: ModelFactory, tmp_path: Path) -> None:
    """A hash layer's experts are the table's row for the token id: each decode token reads them for every hash
    layer, in layer order, before its first layer begins (`read_known`), the lookahead never guesses them, and
    the logits are those of the same run without these reads (measured on the wide geometry at 25 %, MXFP4: demand
    reads in the three hash layers 594/594/600 over 160 tokens without, 0/0/0 with)."""
    src = model_factory(arch=A, type="Q8_0")
    model = _repacked(src, tmp_path)
    with ModelFile.open(str(model)) as mf:
        budget = mf.index.total_bytes // 4
    tokens = _tokens(160, 512, seed=36).tolist()

    def run(known: bool) -> tuple[np.ndarray, list[tuple[str, int, list[int], list[float]]]]:
        s = _session(model, ram_budget=budget, lookahead=2)
        events: list[tuple[str, int, list[int], list[float]]] = []
        predict, begin, read_known = s.scheduler.predict, s.scheduler.begin_layer, s.scheduler.read_known

        def on_predict(block: int, experts: Any, distance: int, probs: Any = (), predictors: int = 0) -> None:
            events.append(("predict", block, list(experts), list(probs)))
            predict(block, experts, distance, probs, predictors)

        def on_known(block: int, experts: Any) -> None:
            events.append(("known", block, list(experts), []))
            read_known(block, experts)

        def on_begin(block: int, experts: Any, keep: Any = ()) -> list[bool]:
            events.append(("begin", block, list(experts), []))
            return begin(block, experts, keep)

        s.scheduler.predict, s.scheduler.begin_layer = on_predict, on_begin  # type: ignore[method-assign]
        s.scheduler.read_known = on_known  # type: ignore[method-assign]
        if not known:
            s.model.known_experts = lambda token: {}  # type: ignore[method-assign]
        try:
            s.forward(tokens[:100])
            events.clear()
            out = np.stack([s.forward([t]) for t in tokens[100:]])
        finally:
            s.close()
        return out, events

    got, events = run(True)
    want, _ = run(False)
    assert np.array_equal(got, want)
    table = _hash_tables(src)
    hashed = len(table)
    assert hashed == 2
    starts = [i for i, e in enumerate(events) if e[0] == "begin" and e[1] == 0]
    assert len(starts) == len(tokens) - 100
    for token, start in zip(tokens[100:], starts, strict=True):
        before = [e for e in events[max(0, start - hashed) : start] if e[0] == "known"]
        assert [(b, ex) for _, b, ex, _ in before] == [(il, table[il][token].tolist()) for il in range(hashed)]
    assert sum(e[0] == "known" for e in events) == hashed * len(starts)
    guessed = [e for e in events if e[0] == "predict" and e[1] < hashed]
    assert not guessed


def _hash_tables(src: Path) -> dict[int, np.ndarray]:
    """Each hash layer's token → experts table [vocab, k], read from the source GGUF by the gguf package."""
    tables = {}
    for t in gguf.GGUFReader(str(src)).tensors:
        if t.name.endswith(".ffn_gate_tid2eid.weight"):
            tables[int(t.name.split(".")[1])] = np.asarray(t.data).copy()
    return tables


def test_the_lookahead_ranks_experts_as_the_graph_selects_them() -> None:
    """The lookahead's numpy ranking of a layer's router logits is the graph's: sqrt(softplus) + bias (a sigmoid +
    bias ranks these two the other way)."""
    from tokenwing.models.deepseek4 import DeepSeek4
    from tokenwing.models.hparams import HParams

    hp = HParams("deepseek4", 1, 8, 1, 1, 8, 64, 1e-6, 1e4, 2, 1, 0, 16, 8, expert_weights_scale=1.5)
    router = DeepSeek4.make_router(hp)
    logits, bias = np.array([3.0, 0.0]), np.array([0.0, 0.6])
    scores = router.selection_scores(logits, bias)
    np.testing.assert_allclose(scores, np.sqrt(np.log1p(np.exp(logits))) + bias)
    assert int(np.argmax(scores)) == 0 and int(np.argmax(1 / (1 + np.exp(-logits)) + bias)) == 1


@pytest.mark.parametrize(("window", "span"), [(16, 768), (128, 768), (24, 768)])
def test_a_graph_attends_over_its_windows_raw_keys_only(window: int, span: int) -> None:
    """The raw keys a graph attends over (models/deepseek4.py `_raw_keys`): for every query exactly the positions
    of its window, each once, read from the slot that holds it; from a base and in a count that are multiples of
    64 (the keys' SIMD lanes, what keeps the bits of the whole ring), and a decode step's far fewer than the ring's
    slots. Prompt chunks up to the longest a graph takes (span - window + 1 tokens), past the ring's turns."""
    from tokenwing.models.deepseek4 import LANES, _raw_base, _raw_mask, _raw_size, _raw_slots

    decode = _raw_size(window + LANES - 1)
    assert decode <= window + 2 * LANES and decode < span // 3
    for n in (1, 5, 64, span - window + 1):
        for p0 in range(0, 3 * span, 37):
            base = _raw_base(p0, window)
            size = decode if n == 1 else _raw_size(p0 + n - base)
            assert base % LANES == 0 and size % LANES == 0
            slots, mask = _raw_slots(p0, size, span, window), _raw_mask(p0, n, size, span, window)
            q = base + np.arange(size)
            assert np.array_equal(slots, q % span)
            for i, p in enumerate(range(p0, p0 + n)):
                seen = q[mask[i] == 0]
                assert np.array_equal(seen, np.arange(max(0, p - window + 1), p + 1)), (n, p0, p)


def test_a_decode_step_as_one_graph_never_copies_the_state(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The state between layers (streams, mixes, token id) is one tensor for the runtime's graph per layer; in a
    decode step as one graph each layer takes the parts the one before made, so no node of that graph is a state
    or reads one (each was a copy of every stream, and nodes the threads meet at a barrier)."""
    from tokenwing.compute import ggml_api as ggml
    from tokenwing.models.deepseek4 import _TAG

    model = _repacked(model_factory(arch=A, type="Q8_0"), tmp_path)
    tokens = _tokens(24, 512, seed=38).tolist()
    s = _session(model)
    try:
        s.forward(tokens[:16])
        s.forward([tokens[16]])
        assert s._token_graph is not None
        gf = s._token_graph.g.gf
        nodes = [ggml.ggml_graph_node(gf, i) for i in range(ggml.ggml_graph_n_nodes(gf))]
        assert len(nodes) > 100
        for t in nodes:
            names = [bytes(t.contents.name)] + [bytes(src.contents.name) for src in t.contents.src if src]
            assert not any(name.startswith(_TAG) for name in names), names
    finally:
        s.close()
