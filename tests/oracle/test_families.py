"""DeepSeek-V3 / Kimi K2 / V2-Lite (deepseek2, MLA), gpt-oss, MiniMax M2 and Kimi K3 against llama.cpp on the same GGUF,
and streamed against resident: the families people stream from SSD.

Positions include a prompt and decode steps past a 256-position boundary (a new decode window) and, for
gpt-oss, past its 128-position sliding window.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits
from tokenwing.format.reader import ModelFile
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.streaming.settings import StreamSettings

pytestmark = pytest.mark.oracle

VARIANTS: dict[str, dict[str, object]] = {
    # DeepSeek-V3's form: q low-rank, split k_b/v_b, YaRN x40, sigmoid router with selection bias, 4 groups using 2
    "deepseek-v3": {"arch": "deepseek2", "n_layer": 4, "n_expert": 16, "n_expert_used": 4},
    "deepseek-legacy-kv-b": {"arch": "deepseek2", "n_layer": 3, "legacy_kv_b": True},
    "deepseek-v3-mtp": {"arch": "deepseek2", "n_layer": 3, "n_mtp": 1},
    "kimi-k2": {"preset": "kimi-tiny"},  # 384 experts, one group, top-8
    "gpt-oss": {"arch": "gpt-oss", "n_layer": 4},
    # MiniMax M2: whole-vector q/k norms, half of each head rotated, sigmoid router with selection bias
    "minimax-m2": {"arch": "minimax-m2", "n_layer": 4, "n_expert": 16, "n_expert_used": 4},
    # Kimi K3: KDA and gated nope-only MLA, a checkpoint of the residual every 2 layers, experts at half the width
    # between the latent projections, SiTU with both betas, the decay gate bounded below
    "kimi-k3": {"arch": "kimi-k3", "n_layer": 6, "n_expert": 16, "n_expert_used": 4},
    # ... and its other forms: a checkpoint every 3 of 7 layers, experts at full width (no latent projections),
    # kimi-linear's softplus decay gate (no lower bound), the up branch as it is (linear beta 0), a plain attn_q,
    # no shared expert
    "kimi-k3-plain": {
        "arch": "kimi-k3",
        "n_layer": 7,
        "attn_res_block": 3,
        "n_expert_latent": 0,
        "kda_gate_lower_bound": -math.inf,
        "situ_linear_beta": 0.0,
        "q_lora_rank": 0,
        "n_shared_exp": 0,
    },
    # ... and without the residual's checkpoints (block size 0: one vector a token, no mix) or a dense layer, MLA in
    # every other layer
    "kimi-k3-unmixed": {
        "arch": "kimi-k3",
        "n_layer": 4,
        "attn_res_block": 0,
        "n_dense_lead": 0,
        "full_attention_interval": 2,
    },
}
# The weights' std of the quantized tests (0.03 by default): Kimi K3's Q4_K_M shape at 0.03 is chaotic enough that
# llama.cpp disagrees with itself by KL 2.2e-4 when only its weight layout changes (plain against repacked; we were
# 2.1e-4 from it); at 0.02 that noise is 3e-6, and llama.cpp with an F16 KV cache 3e-5 from itself.
QUANT_STD: dict[str, float] = {"kimi-k3": 0.02}
V2_LITE = {"arch": "deepseek2", "n_layer": 26, "q_lora_rank": 0}  # llama.cpp reads no q_lora_rank at 26 layers


def clear_top1(ref: np.ndarray, got: np.ndarray, margin: float = 0.1) -> float:
    """Top-1 agreement where llama.cpp's best token leads its second by more than `margin` logits."""
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > margin
    return float((ref.argmax(axis=1) == got.argmax(axis=1))[clear].mean())


def steps(model: Path, tokens: np.ndarray, n_prompt: int, **opts: object) -> tuple[np.ndarray, Session]:
    """Logits of every position: a prompt in one pass, then one decode step per token. (The session is returned
    closed; `s.one_graph_steps` says whether decode ran as one graph per token.)"""
    options = SessionOptions(kv_type="f32", n_ctx=max(512, len(tokens) + 8), **opts)  # type: ignore[arg-type]
    s = Session(str(model), options, log=lambda line: None)
    try:
        first = s.forward(tokens[:n_prompt].tolist(), all_logits=True)
        rest = [s.forward([int(t)]).reshape(1, -1) for t in tokens[n_prompt:]]
        s.one_graph_steps = s._token_graph is not None  # type: ignore[attr-defined]
        return np.concatenate([first, *rest], axis=0), s
    finally:
        s.close()


@pytest.mark.parametrize("variant", [*VARIANTS, "deepseek-v2-lite"])
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    shape = V2_LITE if variant == "deepseek-v2-lite" else VARIANTS[variant]
    src = model_factory(type="F32", **shape)  # type: ignore[arg-type]
    f32_matches_llama_cpp(src, tmp_path, 40 if variant == "deepseek-v2-lite" else 160)


def f32_matches_llama_cpp(src: Path, tmp_path: Path, n: int = 160, rounding: bool = False) -> None:
    """An F32 file's n positions (a prompt of half, then one decode step a token): within 1e-4 of llama.cpp's
    logits, mean KL <= 1e-8. `rounding`: past 1e-4, within twice llama.cpp's own distance when only its batch
    changes (512 or 1 token a pass), for graphs whose rounding is coarser than F32's: ggml's GELU reads an F16 table
    (GGML_GELU_FP16), so an input one ulp apart can land on the next entry (Gemma 4's default model: llama.cpp
    9.6e-5 from itself, ours batched 1.3e-4 from ours one token at a time, and 1.3e-4 from llama.cpp)."""
    tokens = _tokens(n, 512, seed=11)
    ref = llama_logits(src, tokens, tmp_path)
    got, _ = steps(_repacked(src, tmp_path), tokens, n // 2)
    diff = np.abs(ref - got).max()
    if rounding and diff > 1e-4:  # (llama.cpp run again only where 1e-4 is exceeded)
        own = np.abs(ref - llama_logits(src, tokens, tmp_path, n_batch=1)).max()
        assert diff <= 2 * own, (diff, own)
    else:
        assert diff <= 1e-4
    assert kl_per_position(ref, got).mean() <= 1e-8


@pytest.mark.parametrize(
    ("variant", "type_name"),
    [
        ("deepseek-v3", "Q8_0"),
        ("deepseek-v3", "Q4_K_M"),
        ("kimi-k2", "Q8_0"),
        ("gpt-oss", "Q8_0"),
        ("gpt-oss", "MXFP4_MOE"),
        ("gpt-oss", "Q4_K_M"),
        ("minimax-m2", "Q8_0"),
        ("minimax-m2", "Q4_K_M"),
        ("kimi-k3", "Q8_0"),
        ("kimi-k3", "Q4_K_M"),
    ],
)
def test_quantized_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str, type_name: str) -> None:
    """300 positions (a 200-token prompt, then 100 decode steps across position 256): mean KL ≤ 1e-4, and the same
    top-1 token on ≥ 99 % of the positions where llama.cpp's top-1 leads by more than 0.1 logit (near-ties flip
    with any rounding: llama.cpp's own repacked and plain kernels disagree on 1 % of all positions here).

    Weights at half the usual 1/√fan_in: with the default, random deep MoEs are chaotic enough that llama.cpp
    disagrees with itself by KL 4e-3 on Q4_K_M when only its weight layout changes — no bar can be checked
    there; at half they are tame (llama.cpp against itself: KL 5e-6)."""
    shape = dict(VARIANTS[variant], weight_std=QUANT_STD.get(variant, 0.03))
    if type_name.startswith("Q4_K"):
        shape["preset"] = "kquant"  # row lengths that are multiples of 256
    quantized_matches_llama_cpp(model_factory(type=type_name, **shape), tmp_path)  # type: ignore[arg-type]


def family_quantized_matches(
    factory: ModelFactory, tmp_path: Path, shape: dict[str, object], kquant: dict[str, object], type_name: str
) -> None:
    """A family module's quantized case (its VARIANTS entry `shape`): at the tame weights (std 0.03), a K-quant on
    the `kquant` preset with the module's KQUANT changes (rows of multiples of 256), against llama.cpp as
    `quantized_matches_llama_cpp` measures it."""
    shape = dict(shape, weight_std=0.03)
    if type_name.startswith("Q4_K"):
        shape |= {"preset": "kquant", **kquant}
    quantized_matches_llama_cpp(factory(type=type_name, **shape), tmp_path)  # type: ignore[arg-type]


def family_streamed_matches(factory: ModelFactory, tmp_path: Path, shape: dict[str, object], percent: int) -> None:
    """A family module's streamed case: its Q8_0 file repacked, `percent` of the expert bytes against resident
    (`streamed_matches_resident`) over 160 positions."""
    model = _repacked(factory(type="Q8_0", **shape), tmp_path)  # type: ignore[arg-type]
    streamed_matches_resident(model, _tokens(160, 512, seed=13), percent=percent)


def quantized_matches_llama_cpp(src: Path, tmp_path: Path) -> None:
    """A quantized file's 300 positions (a 200-token prompt, then 100 decode steps across position 256): mean KL
    ≤ 1e-4 from llama.cpp's, and its top-1 on ≥ 99 % of the positions where llama.cpp's leads by > 0.1 logit
    (llama.cpp's own plain layout against its default, its noise, said where the bar fails)."""
    tokens = _tokens(300, 512, seed=12)
    ref = llama_logits(src, tokens, tmp_path)
    own = llama_logits(src, tokens, tmp_path, plain=True)
    got, _ = steps(_repacked(src, tmp_path), tokens, 200)
    kl, noise = kl_per_position(ref, got), kl_per_position(ref, own).mean()
    top1 = (ref.argmax(axis=1) == got.argmax(axis=1)).mean()
    assert kl.mean() <= 1e-4, (kl.mean(), noise)
    assert clear_top1(ref, got) >= 0.99, (clear_top1(ref, got), top1)


@pytest.mark.parametrize("variant", ["deepseek-v3", "kimi-k2", "gpt-oss", "minimax-m2", "kimi-k3", "kimi-k3-plain"])
def test_streamed_is_bit_identical_to_resident(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """A 10 % expert budget (prompt experts in waves, decode experts read as they are selected or predicted),
    lookahead 0 and 2: the same logits as every expert in RAM (decode as one graph per token there)."""
    model = _repacked(model_factory(type="Q8_0", **VARIANTS[variant]), tmp_path)  # type: ignore[arg-type]
    streamed_matches_resident(model, _tokens(160, 512, seed=13))


def streamed_matches_resident(model: Path, tokens: np.ndarray, percent: int = 10) -> None:
    """`percent` of the expert bytes, lookahead 0 and 2, against every expert in RAM (a 100-token prompt, then
    decode steps): bit-identical, and the lookahead's predictions made and scored."""
    with ModelFile.open(str(model)) as mf:
        budget = mf.index.total_bytes * percent // 100
    resident, s = steps(model, tokens, 100, cpu_repack=False)
    assert s.slots_per_layer == s.hp.n_expert and s.one_graph_steps  # type: ignore[attr-defined]
    split = StreamSettings(split_demand=True)  # gate/up (and their biases) computed before down lands
    for lookahead, stream in ((0, StreamSettings()), (2, StreamSettings()), (2, split)):
        streamed, s = steps(model, tokens, 100, cpu_repack=False, ram_budget=budget, lookahead=lookahead, stream=stream)
        assert s.slots_per_layer < s.hp.n_expert
        assert np.array_equal(resident, streamed), (lookahead, stream)
        assert (s.lookahead.recall()[0] is not None) == bool(lookahead)


def test_mtp_block_is_neither_loaded_nor_streamed(model_factory: ModelFactory, tmp_path: Path) -> None:
    """DeepSeek-V3's next-token-prediction block: kept in the file, never read — no tensor of it in memory, no
    slots or reads for its experts — and the output is llama.cpp's (which runs the main model without it)."""
    model = _repacked(model_factory(type="Q8_0", **VARIANTS["deepseek-v3-mtp"]), tmp_path)  # type: ignore[arg-type]
    _, s = steps(model, _tokens(40, 512, seed=14), 20)
    mtp = s.hp.n_layer
    assert s.hp.n_mtp == 1
    assert not [name for name in s.model.weights.tensors if name.startswith(f"blk.{mtp}.")]
    assert mtp not in s.scheduler.layers and s.counters().shape[0] == len(s.streamed)
    with ModelFile.open(str(model)) as mf:
        assert any(t.name.startswith(f"blk.{mtp}.") for t in mf.kept)
        assert s.scheduler.capacity == s.slots_per_layer * sum(
            el.record_size for el in mf.index.layers if el.layer < mtp
        )
