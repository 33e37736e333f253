"""MiMo-V2-Flash (mimo2) against llama.cpp on the same GGUF, and streamed at a 25 % budget against resident.

Two geometries, both past their sliding window: the factory's (MiMo's proportions: keys of 24 and values of 16, a
third of a key rotated, a dense first layer, full attention in layers 0 and 3 with half the KV heads, sliding-window
layers over 128 positions with their sinks, 160 positions) and another (a window of 32, full attention in layers 0,
2 and 5 with one KV head against four, keys of 48 and values of 32 with 16 rotated, 12 experts top-3): the
sliding-window layers' mask, rope base and sinks, the per-layer KV heads and the value scale each move the logits
far past the bar (the break-checks in docs/families/mimo2.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tests.oracle.test_families import family_quantized_matches, family_streamed_matches, steps
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import TensorInfo, encode_header, layout_tensors, read_header
from tokenwing.models.hparams import read_hparams
from tokenwing.models.mimo2 import Mimo2
from tokenwing.testmodel import preset_shape
from tokenwing.testmodel.architectures import architecture, tensor_specs

pytestmark = pytest.mark.oracle

VARIANTS: dict[str, dict[str, object]] = {
    "factory": {"arch": "mimo2"},
    "other": {
        "arch": "mimo2",
        "n_layer": 6,
        "n_embd": 128,
        "n_head": 4,
        "n_head_kv": 4,
        "head_kv_full": 1,
        "head_dim": 48,
        "v_head_dim": 32,
        "n_rot": 16,
        "full_attention_interval": 3,
        "sliding_window": 32,
        "n_expert": 12,
        "n_expert_used": 3,
        "rope_base": 1_000_000.0,
    },
}
# The quantized files' rows are multiples of 256 for the K-quants (the `kquant` preset)
KQUANT: dict[str, dict[str, object]] = {
    "factory": {},
    "other": {"n_embd": 256, "head_dim": 96, "v_head_dim": 64, "n_rot": 32},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str) -> None:
    """160 positions, an 80-token prompt then decode steps past the window: within 1e-4 of llama.cpp's logits."""
    src = model_factory(type="F32", **VARIANTS[variant])  # type: ignore[arg-type]
    tokens = _tokens(160, 512, seed=11)
    ref = llama_logits(src, tokens, tmp_path)
    got, _ = steps(_repacked(src, tmp_path), tokens, 80)
    assert np.abs(ref - got).max() <= 1e-4
    assert kl_per_position(ref, got).mean() <= 1e-8


def test_fused_qkv_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The factory's F32 model with each layer's q, k and v as one attn_qkv (MiMo-V2.5's form; llama.cpp views its
    rows), 160 positions: within 1e-4 of llama.cpp's logits, and the engine's the split file's to the bit."""
    src = model_factory(type="F32", **VARIANTS["other"])  # type: ignore[arg-type]
    fused = _fused_qkv(src, tmp_path / "fused.gguf")
    tokens = _tokens(160, 512, seed=11)
    ref = llama_logits(fused, tokens, tmp_path)
    got, s = steps(_repacked(fused, tmp_path), tokens, 80)
    assert "attn_qkv" in s.model.w[0] and "attn_q" not in s.model.w[0]
    assert np.abs(ref - got).max() <= 1e-4
    split, _ = steps(_repacked(src, tmp_path), tokens, 80)
    assert np.array_equal(got, split)


def _fused_qkv(src: Path, dst: Path) -> Path:
    """`src` with each layer's attn_q, attn_k and attn_v as one attn_qkv: their rows in turn (an F32 matrix's rows
    are its output features, so the three tensors' bytes one after another), where attn_q was."""
    h, raw = read_header(str(src)), src.read_bytes()

    def data(t: TensorInfo) -> bytes:
        return raw[h.data_start + t.offset : h.data_start + t.offset + t.nbytes]

    infos: list[TensorInfo] = []
    blobs: list[bytes] = []
    for t in h.tensors:
        if t.name.endswith(("attn_k.weight", "attn_v.weight")):
            continue
        if t.name.endswith("attn_q.weight"):
            block = t.name.removesuffix("attn_q.weight")
            qkv = [h.tensor(block + n) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]
            blob = b"".join(data(x) for x in qkv if x is not None)
            rows = sum(x.shape[1] for x in qkv if x is not None)
            infos.append(TensorInfo(block + "attn_qkv.weight", (t.shape[0], rows), t.type, 0, len(blob)))
        else:
            blob = data(t)
            infos.append(TensorInfo(t.name, t.shape, t.type, 0, t.nbytes))
        blobs.append(blob)
    size = layout_tensors(infos, h.alignment)
    header, _ = encode_header(h.kv, infos, h.alignment)
    out = bytearray(header) + bytearray(size)
    for info, blob in zip(infos, blobs, strict=True):
        out[len(header) + info.offset : len(header) + info.offset + len(blob)] = blob
    dst.write_bytes(bytes(out))
    return dst


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_matches_llama_cpp(model_factory: ModelFactory, tmp_path: Path, variant: str, type_name: str) -> None:
    """300 positions (a 200-token prompt, then 100 decode steps across position 256): mean KL <= 1e-4 and the same
    top-1 where llama.cpp's is clear, at test_families' tame weights (std 0.03)."""
    family_quantized_matches(model_factory, tmp_path, VARIANTS[variant], KQUANT[variant], type_name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_streamed_at_a_quarter_is_bit_identical_to_resident(
    model_factory: ModelFactory, tmp_path: Path, variant: str
) -> None:
    """25 % of the expert bytes, lookahead 0 and 2: the same logits as every expert in RAM."""
    family_streamed_matches(model_factory, tmp_path, VARIANTS[variant], percent=25)


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("attention.sliding_window_pattern", 6, "sliding_window_pattern must have one flag per layer"),
        ("attention.head_count_kv", [1, 3, 4, 1], "head_count_kv must divide head_count in every layer"),
        ("attention.value_scale", "0.7", "attention.value_scale must be a number"),
        ("rope.freq_base_swa", True, "rope.freq_base_swa must be a number"),
        ("attention.key_length_swa", 16, "key_length_swa: sliding-window layers of another size are not run"),
    ],
)
def test_a_file_it_cannot_run_is_refused_in_one_line(key: str, value: object, says: str) -> None:
    """A window pattern that is not per layer (llama.cpp's mimo2 loader requires the list), KV heads that do not
    divide the query heads, a key of the wrong type, sliding-window heads of another size: one line naming them."""
    s = preset_shape("tiny", "mimo2")
    tensors = {t.name: t.shape for t in tensor_specs(s) if t.role != "expert"}
    streamed = {il: s.n_embd for il in range(s.n_dense_lead, s.n_layer)}
    meta = {k: v.value for k, v in architecture("mimo2").metadata(s).items()} | {f"mimo2.{key}": value}
    meta["tokenizer.ggml.tokens"] = ["t"] * s.vocab_size
    with pytest.raises(BadInputError, match=says):
        Mimo2.check(read_hparams(meta, "mimo2", "m.gguf"), tensors, streamed, "m.gguf")
