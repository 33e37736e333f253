"""Hyper-parameters from metadata: the GLM-4.5 keys (partial RoPE, routing, MTP blocks), Kimi K3's, and bad values."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tokenwing.errors import BadInputError
from tokenwing.models import FAMILIES
from tokenwing.models.bailingmoe3 import kda_keys
from tokenwing.models.hparams import read_hparams


def glm_meta(**extra: Any) -> dict[str, Any]:
    a = "glm4moe"
    meta: dict[str, Any] = {
        f"{a}.block_count": 47,
        f"{a}.nextn_predict_layers": 1,
        f"{a}.embedding_length": 4096,
        f"{a}.attention.head_count": 96,
        f"{a}.attention.head_count_kv": 8,
        f"{a}.attention.key_length": 128,
        f"{a}.context_length": 131072,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{a}.rope.dimension_count": 64,
        f"{a}.expert_count": 128,
        f"{a}.expert_used_count": 8,
        f"{a}.leading_dense_block_count": 1,
        f"{a}.expert_weights_scale": 1.0,
        f"{a}.expert_weights_norm": True,
        f"{a}.expert_gating_func": 2,
        "tokenizer.ggml.tokens": ["a", "b"],
    }
    meta.update({f"{a}.{k}": v for k, v in extra.items()})
    return meta


def test_glm_keys() -> None:
    hp = read_hparams(glm_meta(), "glm4moe", "m.gguf")
    assert (hp.n_layer, hp.n_mtp, hp.n_rot, hp.head_dim) == (46, 1, 64, 128)  # the MTP block is not run
    r = FAMILIES["glm4moe"].make_router(hp)
    assert r.sigmoid and r.normalize and r.bias and r.scale == 1.0
    hp = read_hparams(glm_meta(expert_weights_scale=2.5, expert_gating_func=1), "glm4moe", "m.gguf")
    r = FAMILIES["glm4moe"].make_router(hp)
    assert not r.sigmoid and r.scale == 2.5  # the file's choice wins over the family's default
    plain = {k.replace("glm4moe", "qwen3moe"): v for k, v in glm_meta().items() if "expert_gating" not in k}
    q = read_hparams(plain, "qwen3moe", "m")
    assert not FAMILIES["qwen3moe"].make_router(q).sigmoid and q.n_rot == 64  # the family's default: softmax


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("nextn_predict_layers", 47),  # nothing left to run
        ("nextn_predict_layers", -1),
        ("expert_gating_func", 3),
        ("rope.dimension_count", 63),
        ("rope.dimension_count", 256),
        ("expert_weights_norm", 1),
        ("expert_weights_scale", "2.5"),
        ("block_count", True),
    ],
)
def test_bad_values_are_clean_errors(key: str, value: Any) -> None:
    with pytest.raises(BadInputError, match=r"m\.gguf"):
        read_hparams(glm_meta(**{key: value}), "glm4moe", "m.gguf")


def test_linear_attention_layers_as_each_family_marks_them() -> None:
    """Qwen3-Next / Qwen3.5: a recurrent_layers list, else every layer but each full_attention_interval-th (4 by
    default); Ling 3.0: head_count_kv 0 in a per-layer list. The MTP block is never one of them."""
    meta = glm_meta(block_count=9, nextn_predict_layers=1)
    qwen = {k.replace("glm4moe", "qwen3next"): v for k, v in meta.items()}
    hp = read_hparams(qwen, "qwen3next", "m", FAMILIES["qwen3next"].recurrence)
    assert hp.recurrent == (True, True, True, False, True, True, True, False)
    hp = read_hparams({**qwen, "qwen3next.full_attention_interval": 2}, "qwen3next", "m", "interval")
    assert hp.recurrent == (True, False) * 4
    listed = [False, True] * 4 + [False]
    hp = read_hparams({**qwen, "qwen3next.attention.recurrent_layers": listed}, "qwen3next", "m", "interval")
    assert hp.recurrent == tuple(listed[:8])
    ling = {k.replace("glm4moe", "bailingmoe3"): v for k, v in meta.items()}
    ling["bailingmoe3.attention.head_count_kv"] = np.array([0, 0, 1, 0, 0, 1, 0, 1, 1], np.uint32)
    hp = read_hparams(ling, "bailingmoe3", "m", FAMILIES["bailingmoe3"].recurrence)
    assert hp.recurrent == (True, True, False, True, True, False, True, False) and hp.n_head_kv == 1
    assert read_hparams(meta, "glm4moe", "m", FAMILIES["glm4moe"].recurrence).recurrent == ()


@pytest.mark.parametrize(
    ("arch", "recurrence", "key", "value"),
    [
        ("qwen3next", "interval", "full_attention_interval", 0),
        ("qwen3next", "interval", "attention.recurrent_layers", [True, False]),  # fewer flags than layers
        ("qwen3next", "interval", "rope.dimension_sections", [1, -1, 0, 0]),
        ("bailingmoe3", "kv_heads", "attention.head_count_kv", 1),  # one count: no layer is marked
        ("bailingmoe3", "kv_heads", "attention.head_count_kv", [0] * 47),  # no attention layer at all
        ("bailingmoe3", "kv_heads", "swiglu_clamp_exp", ["x"]),
    ],
)
def test_bad_linear_attention_values_are_clean_errors(arch: str, recurrence: str, key: str, value: Any) -> None:
    meta = {k.replace("glm4moe", arch): v for k, v in glm_meta(**{key: value}).items()}
    with pytest.raises(BadInputError, match=r"m\.gguf"):
        read_hparams(meta, arch, "m.gguf", recurrence)


def test_kimi_k3_keys_and_the_ones_it_cannot_run_without() -> None:
    """Kimi K3's own keys (the latent width, the residual's block size, SiTU's betas, a KDA bound only where set);
    a file without the keys llama.cpp requires, or with a SiTU beta it would divide by zero, is refused in one line
    before any tensor is looked at; the experts must have the latent width."""
    from tokenwing.models import kimi_k3
    from tokenwing.models.base import TensorCheck
    from tokenwing.models.kimi_k3 import KimiK3

    meta = {k.replace("glm4moe", "kimi-k3"): v for k, v in glm_meta(block_count=4, nextn_predict_layers=0).items()}
    meta["kimi-k3.attention.head_count_kv"] = np.array([0, 0, 0, 1], np.uint32)
    keys = {"expert_latent_length": 2048, "attn_res.block_size": 2, "activation.situ_beta": 2.0}
    meta.update({f"kimi-k3.{k}": v for k, v in {**keys, "activation.situ_linear_beta": 0.0}.items()})
    hp = read_hparams(meta, "kimi-k3", "m", KimiK3.recurrence)
    k = kimi_k3.keys(hp)  # (its own keys table, models/kimi_k3.py KEYS, which the factory writes)
    assert (k.n_expert_latent, k.attn_res_block, k.situ_beta, k.situ_linear_beta) == (2048, 2, 2.0, 0.0)
    assert hp.recurrent == (True, True, True, False) and kda_keys(hp).gate_lower_bound == -np.inf
    assert KimiK3.state_width(hp) == 3 * 4096 and KimiK3.expert_width(hp, 1) == 2048
    for key in ("attn_res.block_size", "activation.situ_beta", "activation.situ_linear_beta"):
        hp = read_hparams({k: v for k, v in meta.items() if k != f"kimi-k3.{key}"}, "kimi-k3", "m", "kv_heads")
        with pytest.raises(BadInputError, match="required"):
            KimiK3.check(hp, {}, {}, "m")
    # (the latent is optional: without it the experts run at the hidden width, as llama.cpp's loader does)
    hp = read_hparams({k: v for k, v in meta.items() if "latent" not in k}, "kimi-k3", "m", "kv_heads")
    assert KimiK3.expert_width(hp, 1) == 4096
    hp = read_hparams({**meta, "kimi-k3.activation.situ_beta": 0.0}, "kimi-k3", "m", "kv_heads")
    with pytest.raises(BadInputError, match="situ_beta must be positive"):
        KimiK3.check(hp, {}, {}, "m")
    hp = read_hparams(meta, "kimi-k3", "m", "kv_heads")
    with pytest.raises(BadInputError, match="width 4096, not 2048"):
        TensorCheck(hp, {}, "m").experts(1, 4096, KimiK3.expert_width(hp, 1))


def test_query_heads_per_layer() -> None:
    """attention.head_count as one count per layer (Step-3.5's sliding-window layers have more query heads): the
    most a layer has, the head size from the first layer's (llama.cpp: n_embd / n_head()); a short list refused."""
    heads = np.array([4, 6, 6, 6, 4] + [6] * 42, np.uint32)
    meta = glm_meta(**{"attention.head_count": heads, "attention.head_count_kv": 2})
    del meta["glm4moe.attention.key_length"]
    hp = read_hparams(meta, "glm4moe", "m.gguf")
    assert (hp.n_head, hp.head_dim) == (6, 4096 // 4)
    assert hp.keys["attention.head_count"].tolist()[:2] == [4, 6]
    with pytest.raises(BadInputError, match="head_count lists fewer layers"):
        read_hparams(glm_meta(**{"attention.head_count": [8, 8]}), "glm4moe", "m.gguf")
