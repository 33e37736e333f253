"""Model geometry for generated models, with named presets from tiny (tests) to realistic (benchmarks).

Size presets (tiny, kquant, small, bench) apply to every architecture: `preset_shape(name, arch)` fills in what
a family needs beyond them (deepseek2's MLA ranks, routing groups and YaRN; gpt-oss's YaRN and sliding
window; deepseek4's attention, indexer and hyper-connections; glm-dsa's MLA and indexer), as the real models have
them. Family presets (`kimi-*`, `ds-bench`, `oss-bench`, `ds4-bench`, `glm5-bench`, ...) fix their family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    arch: str = "qwen3moe"
    n_layer: int = 2  # blocks that run (next-token-prediction blocks come on top: n_mtp)
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16  # query/key head size (deepseek2: qk_nope + qk_rope, llama.cpp's key_length_mla)
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_dense_lead: int = 0  # leading dense FFN layers (deepseek2-style archs)
    n_ff_dense: int = 96
    n_shared_exp: int = 0  # shared experts (qwen2moe has one, gated)
    n_ff_shexp: int = 64
    moe_layer_step: int = 1  # llama4: every n-th layer routes experts, the others are dense (Maverick: 2)
    vocab_size: int = 512
    context_length: int = 4096
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    embd_std: float = 1.0  # ~1.0 spreads random routing; real models' 0.02 makes it collapse
    weight_std: float = 0.0  # 0: 1/sqrt(fan_in) per matrix
    router_scale: float = 1.0  # routers' std × this: larger margins between the k-th and (k+1)-th expert
    # deepseek2 (MLA): ranks of the query and KV compressions (q_lora_rank 0: a plain attn_q, as DeepSeek-V2-Lite)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    n_rot: int = 0  # rotary dimensions per head (0: all; deepseek2: qk_rope_head_dim, glm4moe: half)
    v_head_dim: int = 0  # value head size (0: head_dim)
    legacy_kv_b: bool = False  # deepseek2: the older combined attn_kv_b instead of attn_k_b/attn_v_b
    fused_gate_up: bool = False  # mistral4: each layer's gate and up experts as one ffn_gate_up_exps (its converter)
    n_expert_group: int = 0  # group-limited routing: expert groups (0: no key written) and groups used
    n_group_used: int = 0
    expert_weights_scale: float = 2.5  # routing weights × this (glm4moe, deepseek2)
    n_mtp: int = 0  # next-token-prediction blocks after the n_layer main ones (nextn_predict_layers)
    yarn_factor: float = 0.0  # YaRN rope scaling factor (0: no rope scaling keys)
    yarn_orig_ctx: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_log_mul: float = 0.1  # deepseek2: 0.1 × mscale_all_dim, as llama.cpp's converter writes it
    sliding_window: int = 128  # gpt-oss, gemma4: the window of its sliding-window layers
    # gemma4: its full layers' head size and KV heads (0: twice head_dim, half n_head_kv); its sliding-window layers
    # take head_dim, n_head_kv and n_rot; every full_attention_interval-th layer is a full one
    head_dim_full: int = 0
    head_kv_full: int = 0  # (not n_: 0 is a default)
    # linear attention: gated DeltaNet (qwen3next, qwen35moe) and KDA (bailingmoe3, whose heads are n_head)
    ssm_d_conv: int = 4  # the short convolution's width
    ssm_d_state: int = 16  # a linear layer's key and value head size (bailingmoe3: kda.head_dim)
    ssm_n_group: int = 2  # qwen: key heads of the linear layers
    ssm_dt_rank: int = 4  # qwen: value heads of the linear layers
    full_attention_interval: int = 4  # every n-th layer attends fully (bailingmoe3: its layer_group_size)
    kda_gate_lower_bound: float = -5.0
    rope_sections: tuple[int, ...] = ()  # qwen35moe: IMRoPE's rotary pairs per axis (4 counts)
    legacy_ssm_in: bool = False  # qwen3next: the older converter's joint ssm_in instead of attn_qkv + attn_gate
    swiglu_limit: float = 0.0  # SwiGLU limit of experts and shared expert (bailingmoe3: last layer; deepseek4: all)
    # deepseek4 (DeepSeek V4), by llama.cpp's hparams (dsv4_*, indexer_*); 0 or () for the other families
    hc_mult: int = 0  # hyper-connection streams (llama.cpp's graph takes exactly 4)
    hc_sinkhorn_iters: int = 0  # Sinkhorn normalisations of the streams' mixing matrix
    hc_eps: float = 0.0
    compress_ratios: tuple[int, ...] = ()  # per layer: 0 window only, 4 CSA + indexer, 128 HCA (): V4's pattern
    compress_rope_base: float = 0.0  # rope base of the compressing layers (the window-only ones take rope_base)
    indexer_n_head: int = 0  # the lightning indexer's heads, head size and top-k (compressed blocks; glm-dsa: tokens)
    indexer_head_size: int = 0
    indexer_top_k: int = 0
    # glm-dsa (GLM-5.2): per layer 1 where the layer runs its own indexer, 0 where it reuses the top-k of the last
    # layer that did (attention.indexer.types); (): no key, every layer its own (GLM-5, 5.1)
    indexer_types: tuple[int, ...] = ()
    o_group_count: int = 0  # grouped low-rank output projection: head groups and each group's rank
    o_lora_rank: int = 0
    hash_layer_count: int = 0  # leading layers whose experts come from a token-id table (ffn_gate_tid2eid)
    # kimi-k3 (Kimi K3): routed experts in a latent space of this width (0: n_embd), a checkpoint of the residual
    # every attn_res_block layers (0: none), SiTU's betas (linear beta 0: the up branch as it is)
    n_expert_latent: int = 0
    attn_res_block: int = 0
    situ_beta: float = 0.0
    situ_linear_beta: float = 0.0
    # qwen4exp (Qwen3.8 Flash Next; hc_mult and the indexer's sizes above): the hyper-connections' low rank, QSA's
    # block of cells (compress_ratios on full layers), the n-gram table's layer (-1: none), n-gram size, heads per
    # n-gram, its convolution's taps, and each head's rows (consecutive primes from this)
    hc_low_rank: int = 0
    qsa_ratio: int = 0
    ple_layer: int = -1
    ple_ngram: int = 3
    ple_heads_per_ngram: int = 2
    ple_conv_kernel: int = 4
    ple_head_rows: int = 1000
    tokenizer: str = "qwen2"  # the vocabulary's family, by llama.cpp's pre-tokenizer name
    chat_template: bool = True  # False: no tokenizer.chat_template (as some GGUFs on the hub)

    def with_(self, **changes: object) -> ModelShape:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def rot(self) -> int:
        return self.n_rot or self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def n_block(self) -> int:
        """Blocks in the file: the ones that run, then the next-token-prediction ones."""
        return self.n_layer + self.n_mtp


# What each family-specific field of the shape gives a model, for the factory's one-line refusal where a family
# takes no such thing (`check_shape`: the families whose factory entry `takes` the field are named, from the registry)
FEATURES: dict[str, str] = {
    "n_dense_lead": "leading dense layers",
    "n_shared_exp": "shared experts",
    "moe_layer_step": "interleave step of MoE layers",
    "q_lora_rank": "MLA ranks",
    "kv_lora_rank": "MLA ranks",
    "n_rot": "partial RoPE",
    "v_head_dim": "head splits (a value head size of its own)",
    "legacy_kv_b": "combined attn_kv_b (the older DeepSeek-V2/V3 converter's form)",
    "fused_gate_up": "fused gate_up experts",
    "n_mtp": "next-token-prediction blocks",
    "n_expert_group": "expert groups",
    "n_group_used": "expert groups",
    "legacy_ssm_in": "joint ssm_in projection (the older converter's)",
    "hc_mult": "hyper-connections",
    "hc_sinkhorn_iters": "hyper-connections",
    "hc_eps": "hyper-connections",
    "compress_ratios": "compression ratios",
    "compress_rope_base": "compression ratios",
    "o_group_count": "output groups",
    "o_lora_rank": "output groups",
    "hash_layer_count": "hash layers",
    "indexer_n_head": "lightning indexer",
    "indexer_head_size": "lightning indexer",
    "indexer_top_k": "lightning indexer",
    "indexer_types": "per-layer indexer types",
    "n_expert_latent": "latent experts",
    "attn_res_block": "residual checkpoints",
    "situ_beta": "SiTU",
    "situ_linear_beta": "SiTU",
    "hc_low_rank": "low-rank hyper-connections",
    "qsa_ratio": "QSA",
    "ple_layer": "n-gram table",
}

PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(),
    # Row lengths that are multiples of 256, so llama.cpp's K-quants apply to every matrix.
    "kquant": ModelShape(
        n_layer=2,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        n_ff_dense=512,
        n_ff_shexp=256,
        vocab_size=512,
    ),
    "small": ModelShape(
        n_layer=4,
        n_embd=512,
        n_head=8,
        n_head_kv=4,
        head_dim=64,
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=256,
        n_ff_dense=1024,
        n_ff_shexp=512,
        vocab_size=2048,
    ),
    # The benchmark geometry of the engine issue: Qwen3-30B-like experts, ~4.5 GB at Q4_K_M.
    "bench": ModelShape(
        n_layer=12,
        n_embd=2048,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=768,
        n_ff_dense=6144,
        n_ff_shexp=768,
        vocab_size=32000,
    ),
}

# DeepSeek-V3 as its GGUF has it: YaRN x40 from 4,096 positions, sigmoid routing in groups, one shared expert.
_DEEPSEEK_V3 = {
    "context_length": 163840,
    "rope_base": 10000.0,
    "yarn_factor": 40.0,
    "yarn_orig_ctx": 4096,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_log_mul": 0.1,
    "expert_weights_scale": 2.5,
    "tokenizer": "deepseek-v3",
}

# MLA geometry per size preset (DeepSeek-V3: nope 128 + rope 64, v 128, kv rank 512, q rank 1536), chosen so
# every row is a multiple of 32 (Q8_0) and, in `kquant`, of 256 where the real model's is (attn_k_b's rows are
# qk_nope long: llama.cpp's quantizer falls back for them, as it does for DeepSeek-V3).
_MLA: dict[str, dict[str, int]] = {
    "tiny": {"head_dim": 48, "n_rot": 16, "v_head_dim": 32, "kv_lora_rank": 64, "q_lora_rank": 96},
    "kquant": {"head_dim": 96, "n_rot": 32, "v_head_dim": 64, "kv_lora_rank": 256, "q_lora_rank": 512},
    "small": {"head_dim": 96, "n_rot": 32, "v_head_dim": 64, "kv_lora_rank": 256, "q_lora_rank": 768},
    "bench": {"head_dim": 192, "n_rot": 64, "v_head_dim": 128, "kv_lora_rank": 256, "q_lora_rank": 512},
}

# Mistral Small 4 as its GGUF has it, as far as known here (its config.json was not read from here: YaRN x32 from
# 8,192 positions to 256k, mscale_all_dim 1, one shared expert, no dense layer, Mistral's softmax router): assumed;
# its gate and up experts fused, as Mistral4Model converts them (the checkpoint's gate_up_proj).
_MISTRAL4 = {
    "context_length": 262144,
    "rope_base": 10000.0,
    "yarn_factor": 32.0,
    "yarn_orig_ctx": 8192,
    "yarn_log_mul": 0.1,
    "expert_weights_scale": 1.0,
    "fused_gate_up": True,
    "tokenizer": "tekken",
}

# gpt-oss as its GGUF has it: YaRN x32 from 4,096 positions, rope base 150,000, RMS eps 1e-5.
_GPT_OSS = {
    "context_length": 131072,
    "rope_base": 150000.0,
    "rms_eps": 1e-5,
    "yarn_factor": 32.0,
    "yarn_orig_ctx": 4096,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "sliding_window": 128,
    "tokenizer": "gpt-4o",
}

# Kimi K2: DeepSeek-V3's architecture with 384 experts in one group, 64 heads, one dense layer, its own
# tokenizer; YaRN x32 with beta_fast 1 in its config (llama.cpp does not read the betas: it uses 32 and 1).
_KIMI_K2 = {
    **_DEEPSEEK_V3,
    "n_expert": 384,
    "n_expert_used": 8,
    "n_expert_group": 1,
    "n_group_used": 1,
    "n_dense_lead": 1,
    "n_shared_exp": 1,
    "context_length": 131072,
    "rope_base": 50000.0,
    "yarn_factor": 32.0,
    "yarn_beta_fast": 1.0,
    "expert_weights_scale": 2.827,
    "tokenizer": "kimi-k2",
}

# MiniMax M2 as its GGUF has it: half of each 128-wide head rotated (rotary_dim 64), rope base 5,000,000, its
# own tokenizer.
_MINIMAX_M2 = {"rope_base": 5_000_000.0, "rms_eps": 1e-6, "tokenizer": "minimax-m2"}

# DeepSeek V4 Flash as its GGUF has it (43 layers, hidden 4096, 64 query heads of 512 sharing one KV head, 64
# rotated; q rank 1024; output in 8 groups of rank 1024; 4 hyper-connection streams, 20 Sinkhorn steps; 256 experts
# of 2048, top-6 by sqrt(softplus), weights x1.5, SwiGLU clamped at 10; one shared expert; the first 3 layers
# hash-routed; a window of 128; the indexer's 64 heads of 128 keep 512 blocks; YaRN x16 from 65,536 positions).
_DEEPSEEK_V4 = {
    "n_head_kv": 1,
    "n_shared_exp": 1,
    "context_length": 1048576,
    "rope_base": 10000.0,
    "compress_rope_base": 160000.0,
    "yarn_factor": 16.0,
    "yarn_orig_ctx": 65536,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "expert_weights_scale": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "tokenizer": "joyai-llm",  # llama.cpp's converter names V4's pre-tokenizer so (testmodel/tokenizer.py)
}

# DeepSeek V4's attention per size preset, its proportions kept where they fit (the head 8x its rotated part, 2-4x
# the indexer's head): every row is a multiple of 32 (Q8_0), of 256 in `kquant` where the real model's is; the
# indexer's head is a multiple of 64 (llama.cpp rotates it by a Hadamard matrix of 64 or more); the window and
# top-k are small enough that a few hundred tokens pass both; the real model's pattern of layers (see
# architectures.dsv4_compress_ratios) needs 4 layers for all three kinds.
_DSV4: dict[str, dict[str, int]] = {
    "tiny": {
        "n_layer": 4, "head_dim": 128, "n_rot": 16, "q_lora_rank": 32, "o_group_count": 2, "o_lora_rank": 32,
        "indexer_n_head": 4, "indexer_head_size": 64, "indexer_top_k": 8, "sliding_window": 16,
        "hash_layer_count": 2,
    },
    "kquant": {
        "n_layer": 4, "head_dim": 256, "n_rot": 32, "q_lora_rank": 256, "o_group_count": 2, "o_lora_rank": 256,
        "indexer_n_head": 4, "indexer_head_size": 128, "indexer_top_k": 16, "sliding_window": 32,
        "hash_layer_count": 2,
    },
    "small": {
        "n_layer": 6, "head_dim": 256, "n_rot": 32, "q_lora_rank": 256, "o_group_count": 4, "o_lora_rank": 256,
        "indexer_n_head": 8, "indexer_head_size": 128, "indexer_top_k": 32, "sliding_window": 64,
        "hash_layer_count": 2,
    },
    "bench": {
        "n_layer": 12, "head_dim": 512, "n_rot": 64, "q_lora_rank": 512, "o_group_count": 8, "o_lora_rank": 512,
        "indexer_n_head": 32, "indexer_head_size": 128, "indexer_top_k": 128, "sliding_window": 128,
        "hash_layer_count": 2,
    },
}  # fmt: skip

# GLM-5 as its GGUF has it (zai-org/GLM-5's config: 78 layers, hidden 6144, 64 heads of nope 192 + rope 64, values
# of 256, q rank 2048, kv rank 512; the indexer's 32 heads of 128 keep 2048 tokens; 256 experts of 2048, top-8,
# sigmoid with a selection bias, weights normalised and x2.5; 3 dense layers; one shared expert; rope base 1e6, no
# scaling; RMS eps 1e-5; GLM-4.7's vocabulary, whose pre-tokenizer the converter names glm4).
_GLM5 = {
    "n_head_kv": 1,
    "n_shared_exp": 1,
    "context_length": 202752,
    "rope_base": 1_000_000.0,
    "rms_eps": 1e-5,
    "expert_weights_scale": 2.5,
    "tokenizer": "glm4",
}

# The indexer per size preset: its head a power of two of 64 or more (llama.cpp rotates q and k by a Hadamard
# matrix as wide as the head, ggml_mul_mat asserts the widths equal), at least the rope dims (its head is
# [rope | nope]); a top-k far below a few hundred tokens, so the selection matters in the tests.
_GLM_DSA: dict[str, dict[str, int]] = {
    "tiny": {"indexer_n_head": 4, "indexer_head_size": 64, "indexer_top_k": 8},
    "kquant": {"indexer_n_head": 4, "indexer_head_size": 128, "indexer_top_k": 16},
    "small": {"indexer_n_head": 8, "indexer_head_size": 128, "indexer_top_k": 32},
    "bench": {"indexer_n_head": 32, "indexer_head_size": 128, "indexer_top_k": 256},
}

# Kimi K3 (llama.cpp's converter and graph): KDA in most layers, nope-only MLA with an output gate in every
# full_attention_interval-th and the last, one dense layer first, a latent MoE (experts at half the width here)
# with one shared expert, a checkpoint of the residual every attn_res_block layers, SiTU with both betas set,
# KDA's decay gate bounded below at -5, its own tokenizer (K2's vocabulary: the converter borrows kimi-linear's).
_KIMI_K3 = {
    "n_head_kv": 1,
    "n_shared_exp": 1,
    "full_attention_interval": 4,
    "attn_res_block": 2,
    "situ_beta": 2.0,
    "situ_linear_beta": 4.0,
    "kda_gate_lower_bound": -5.0,
    "expert_weights_scale": 2.5,
    "context_length": 262144,
    "tokenizer": "kimi-k2",
}

# Ling 2.0 as its config has it (inclusionAI/Ling-mini-2.0, Ling-flash-2.0: partial_rotary_factor 0.5, one dense
# layer first, one shared expert as wide as a routed one, a sigmoid router with an expert bias in 8 groups using 4,
# weights normalised and x2.5, RMS eps 1e-6), its own vocabulary; groups here: 4 using 2.
_LING2 = {"n_shared_exp": 1, "expert_weights_scale": 2.5, "rms_eps": 1e-6, "tokenizer": "bailingmoe2"}

# Llama 4 as its config has it (meta-llama/Llama-4-Scout-17B-16E: one shared expert as wide as a routed one, top-1,
# RMS eps 1e-5, rope theta 5e5; Maverick interleaves dense and MoE layers, step 2: the factory's shapes take that)
_LLAMA4 = {"n_shared_exp": 1, "n_expert_used": 1, "moe_layer_step": 2, "rms_eps": 1e-5, "rope_base": 500000.0}

# MiMo-V2-Flash as its config has it (XiaomiMiMo/MiMo-V2-Flash: rope theta 5e6 in the full layers, 10,000 in the
# sliding-window ones, a window of 128, RMS eps 1e-5; Qwen2's vocabulary, whose pre-tokenizer llama.cpp names qwen2)
_MIMO2 = {"rope_base": 5_000_000.0, "rms_eps": 1e-5, "sliding_window": 128, "tokenizer": "qwen2"}

# Hy3 as llama.cpp's converter and loader have it (tencent/Hy3: a dense layer first, one shared expert as wide as a
# routed one, a sigmoid router with a selection bias, top-k weights normalised and scaled; its config.json was not
# reachable from here: RMS eps 1e-5 and the router's scale (2.5 here) are the factory's to check)
_HY3 = {"n_shared_exp": 1, "rms_eps": 1e-5}

# Step-3.5-Flash as its config has it (stepfun-ai/Step-3.5-Flash: rope theta 5e6 in the full layers, 10,000 in the
# sliding-window ones, RMS eps 1e-5, a window of 512 (128 here: the tests pass it), one shared expert as wide as a
# routed one; its SwiGLU limits sit in its last layers: 7 here, in the last; the limits' values are the factory's)
_STEP35 = {"rope_base": 5_000_000.0, "rms_eps": 1e-5, "sliding_window": 128, "n_shared_exp": 1, "swiglu_limit": 7.0}

FAMILY_PRESETS: dict[str, ModelShape] = {
    "kimi-tiny": PRESETS["tiny"].with_(arch="deepseek2", n_layer=3, **_MLA["tiny"], **_KIMI_K2),
    # Ling 3.0 Flash (bailingmoe3: 42 layers, hidden 2560, 512 experts, top-8, KDA:MLA 5:1, one shared expert,
    # MTP block) scaled to this machine: hidden 1024, 512 experts of 256, top-8, 18 layers in Ling's pattern
    # (layer_group_size 6: MLA in layers 5, 11, 17, KDA in the others), one leading dense layer, 16 KDA heads
    # of 64, MLA with the bench ranks: ~4.4 GB at Q4_K_M, 17 MoE layers of 512 experts.
    "ling-bench": ModelShape(
        arch="bailingmoe3",
        n_layer=18,
        n_embd=1024,
        n_head=16,
        n_head_kv=1,
        n_expert=512,
        n_expert_used=8,
        n_ff_exp=256,
        n_dense_lead=1,
        n_ff_dense=3072,
        n_shared_exp=1,
        n_ff_shexp=256,
        vocab_size=32000,
        ssm_d_state=64,
        full_attention_interval=6,
        expert_weights_scale=2.5,
        context_length=262144,
    ).with_(**_MLA["bench"]),
    # DeepSeek-V3 scaled to this machine (issue 13 §4): hidden 2048, 256 experts of 512, top-8 in 8 groups
    # using 4, 2 leading dense layers, one shared expert, 32 heads of V3's head sizes, MLA ranks 512/256;
    # 9 MoE layers: ~4.5 GB at Q4_K_M.
    "ds-bench": ModelShape(
        arch="deepseek2",
        n_layer=11,
        n_embd=2048,
        n_head=32,
        n_head_kv=1,
        n_expert=256,
        n_expert_used=8,
        n_ff_exp=512,
        n_dense_lead=2,
        n_ff_dense=5376,
        n_shared_exp=1,
        vocab_size=32000,
        n_expert_group=8,
        n_group_used=4,
    ).with_(**_MLA["bench"], **_DEEPSEEK_V3),
    # gpt-oss-20b's layer (hidden 2880, 32 experts of 2880, top-4, 64 query heads of 64, 8 KV heads) over 10
    # layers: ~4.7 GB with MXFP4 experts and the rest in Q8_0 (`--type MXFP4_MOE`).
    "oss-bench": ModelShape(
        arch="gpt-oss",
        n_layer=10,
        n_embd=2880,
        n_head=64,
        n_head_kv=8,
        head_dim=64,
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=2880,
        vocab_size=32000,
    ).with_(**_GPT_OSS),
    # MiniMax M2 (62 layers, hidden 3072, 48 query heads and 8 KV heads of 128, 256 experts of 1536, top-8)
    # scaled to this machine: hidden 1536, 256 experts of 768, top-8, 24 query heads and 4 KV heads of 128,
    # 8 layers: ~4.0 GB at Q4_K_M.
    "mm-bench": ModelShape(
        arch="minimax-m2",
        n_layer=8,
        n_embd=1536,
        n_head=24,
        n_head_kv=4,
        head_dim=128,
        n_rot=64,
        n_expert=256,
        n_expert_used=8,
        n_ff_exp=768,
        vocab_size=32000,
    ).with_(**_MINIMAX_M2),
    # Kimi K3 (93 layers, hidden 7168, 896 experts of 3072 in a 3584-wide latent, top-16, KDA:MLA 3:1, a
    # checkpoint every 12 layers) scaled to this machine: hidden 2048, experts of 768 in a 1024-wide latent, 288
    # of them, top-8, 12 layers (MLA in layers 3, 7, 11, KDA of 16 heads of 128 in the others), one dense layer, a
    # checkpoint every 4 layers (the head mixes 3 and the sum), MXFP4 experts as K3 ships them and the rest in
    # Q8_0 (`--type MXFP4_MOE`): ~4.3 GB.
    "k3-bench": ModelShape(
        arch="kimi-k3",
        n_layer=12,
        n_embd=2048,
        n_head=16,
        n_expert=288,
        n_expert_used=8,
        n_ff_exp=768,
        n_dense_lead=1,
        n_ff_dense=4096,
        vocab_size=32000,
        ssm_d_state=128,
        n_expert_latent=1024,
    ).with_(**_MLA["bench"], **{**_KIMI_K3, "attn_res_block": 4}),
    # DeepSeek V4 Flash scaled to this machine: hidden 2048, 256 experts of 512, top-6, one shared expert, 32
    # query heads of 256 in 8 output groups, V4's layer pattern over 10 layers (window-only, then CSA and HCA in
    # turn), the first 3 hash-routed: ~4.6 GB with MXFP4 experts and the rest in Q8_0 (`--type MXFP4_MOE`, as the
    # converter writes V4's experts).
    "ds4-bench": ModelShape(
        arch="deepseek4",
        n_layer=10,
        n_embd=2048,
        n_head=32,
        head_dim=256,
        n_rot=32,
        n_expert=256,
        n_expert_used=6,
        n_ff_exp=512,
        vocab_size=32000,
        q_lora_rank=512,
        o_group_count=8,
        o_lora_rank=256,
        indexer_n_head=32,
        indexer_head_size=128,
        indexer_top_k=128,
        sliding_window=128,
        hash_layer_count=3,
    ).with_(**_DEEPSEEK_V4),
    # GLM-5 scaled to this machine: hidden 2048, 256 experts of 512, top-8, one shared expert, 2 dense layers, 32
    # heads of MLA's bench sizes, the indexer's 32 heads of 128 keeping 256 tokens, 10 layers with GLM-5.2's
    # shared indexers (its own in layers 0, 1, 2, 6; the others reuse the last top-k): ~4.3 GB at Q4_K_M.
    "glm5-bench": ModelShape(
        arch="glm-dsa",
        n_layer=10,
        n_embd=2048,
        n_head=32,
        n_expert=256,
        n_expert_used=8,
        n_ff_exp=512,
        n_dense_lead=2,
        n_ff_dense=5376,
        vocab_size=32000,
        indexer_types=(1, 1, 1, 0, 0, 0, 1, 0, 0, 0),
    ).with_(**_MLA["bench"], **_GLM5, **_GLM_DSA["bench"]),
}


# Qwen3-Next / Qwen3.5: gated full attention with a quarter of each head rotated (partial_rotary_factor 0.25),
# one gated shared expert; Qwen3.5's IMRoPE splits the rotary pairs over three axes ([11, 11, 10] of 32).
_QWEN_NEXT = {"n_shared_exp": 1, "rms_eps": 1e-6, "rope_base": 10_000_000.0}


def _imrope_sections(n_rot: int) -> tuple[int, ...]:
    pairs = n_rot // 2
    first = -(-pairs // 3)
    second = -(-(pairs - first) // 2)
    return (first, second, pairs - first - second, 0)


def _family_defaults(s: ModelShape, size: str) -> ModelShape:
    """What a size preset lacks for the family of `s.arch`, as the real models of that family have it."""
    if s.arch == "qwen4exp" and s.hc_mult == 0:
        return _qwen4exp_defaults(s, size)
    if s.arch in ("qwen3next", "qwen35moe") and s.n_rot == 0:
        n_rot = max(2, s.head_dim // 4 // 2 * 2)
        sections = _imrope_sections(n_rot) if s.arch == "qwen35moe" else ()
        # (one full-attention layer in four: llama.cpp allocates no KV cache, and aborts, for a model without one)
        return s.with_(**_QWEN_NEXT, n_layer=max(s.n_layer, 4), n_rot=n_rot, rope_sections=sections)
    if s.arch == "bailingmoe3" and s.kv_lora_rank == 0:
        return s.with_(
            **_MLA.get(size, _MLA["small"]),
            n_layer=max(s.n_layer, 4),  # a dense layer, then KDA, KDA, MLA (a model without MLA has no KV cache)
            n_head_kv=1,
            n_shared_exp=s.n_shared_exp or 1,
            n_dense_lead=s.n_dense_lead or 1,
            full_attention_interval=3,
            ssm_d_state=s.head_dim,  # KDA heads as wide as the preset's attention heads
            expert_weights_scale=2.5,
        )
    if s.arch == "kimi-k3" and s.kv_lora_rank == 0:
        mla = _MLA.get(size, _MLA["small"])
        return s.with_(
            **mla,
            **_KIMI_K3,
            n_layer=max(s.n_layer, 5),  # room for three checkpoints, a dense layer and both attentions
            n_dense_lead=s.n_dense_lead or 1,
            n_expert_latent=s.n_embd if size == "kquant" else s.n_embd // 2,  # (K-quant rows: multiples of 256)
            ssm_d_state=s.head_dim,  # KDA heads as wide as the preset's attention heads
        )

    if s.arch == "deepseek2" and s.kv_lora_rank == 0:
        groups = 4 if s.n_expert >= 8 and s.n_expert % 4 == 0 else 1
        return s.with_(
            **_MLA.get(size, _MLA["small"]),
            **_DEEPSEEK_V3,
            n_head_kv=1,
            n_shared_exp=s.n_shared_exp or 1,
            n_dense_lead=s.n_dense_lead or (1 if s.n_layer > 1 else 0),
            n_expert_group=groups,
            n_group_used=groups // 2 if groups > 1 else 1,
        )
    if s.arch == "mistral4" and s.kv_lora_rank == 0:
        return s.with_(**_MLA.get(size, _MLA["small"]), **_MISTRAL4, n_head_kv=1, n_shared_exp=s.n_shared_exp or 1)
    if s.arch == "deepseek4" and s.hc_mult == 0:
        geometry = _DSV4.get(size, _DSV4["small"])
        return s.with_(**_DEEPSEEK_V4, **{**geometry, "n_layer": max(s.n_layer, geometry["n_layer"])})
    if s.arch == "glm-dsa" and s.kv_lora_rank == 0:
        return s.with_(
            **_MLA.get(size, _MLA["small"]),
            **_GLM5,
            **_GLM_DSA.get(size, _GLM_DSA["small"]),
            n_dense_lead=s.n_dense_lead or (1 if s.n_layer > 1 else 0),
        )
    if s.arch == "glm4moe" and s.n_shared_exp == 0:
        # GLM-4.5's: a shared expert (the engine refuses a glm4moe without one), a dense layer first
        return s.with_(n_shared_exp=1, n_dense_lead=s.n_dense_lead or (1 if s.n_layer > 1 else 0))
    if s.arch == "gpt-oss" and s.yarn_factor == 0:
        return s.with_(**_GPT_OSS)
    if s.arch == "qwen3vlmoe" and not s.rope_sections:
        # Qwen3-VL's split of the rotary pairs over time, height and width: [24, 20, 20] of 64
        h = s.head_dim // 2 * 20 // 64
        return s.with_(rope_sections=(s.head_dim // 2 - 2 * h, h, h, 0), rope_base=5_000_000.0)
    if s.arch == "minimax-m2" and s.n_rot == 0:
        return s.with_(**_MINIMAX_M2, n_rot=s.head_dim // 2)
    if s.arch == "llama4" and s.n_shared_exp == 0:
        # (a NoPE layer every fourth: with none, llama.cpp's iSWA cache has no full part and aborts)
        return s.with_(**_LLAMA4, n_layer=max(s.n_layer, 4), n_ff_shexp=s.n_ff_exp)
    if s.arch == "gemma4" and not s.fused_gate_up:
        # (Gemma4Model converts the checkpoint's gate_up_proj so); a full layer every fourth: without one, llama.cpp
        # refuses the file (it reads rope_freqs only for the full layers)
        return s.with_(fused_gate_up=True, n_layer=max(s.n_layer, s.full_attention_interval))
    if s.arch == "mimo2" and s.v_head_dim == 0:
        # MiMo-V2-Flash's proportions: keys 3/2 of the values (192 / 128), a third of a key rotated (64), half as
        # many KV heads in the full layers, a dense first layer; 4 layers: full, two sliding-window, full
        hd = s.head_dim * 3 // 2
        return s.with_(
            **_MIMO2,
            n_layer=max(s.n_layer, 4),
            head_dim=hd,
            v_head_dim=s.head_dim,
            n_rot=max(2, hd // 3 // 2 * 2),
            n_dense_lead=s.n_dense_lead or 1,
            full_attention_interval=4,
        )
    if s.arch == "hy_v3" and s.n_shared_exp == 0:
        return s.with_(**_HY3, n_ff_shexp=s.n_ff_exp, n_dense_lead=s.n_dense_lead or (1 if s.n_layer > 1 else 0))
    if s.arch == "step35" and s.n_shared_exp == 0:
        # Step 3.5's proportions: the sliding-window layers have 3/2 of the full layers' query heads (96 / 64), the
        # same KV heads; a full layer, then three sliding-window ones; a dense first layer
        return s.with_(
            **_STEP35,
            n_head=s.n_head * 3 // 2,
            n_layer=max(s.n_layer, 4),
            n_ff_shexp=s.n_ff_exp,
            n_dense_lead=s.n_dense_lead or 1,
            full_attention_interval=4,
        )
    if s.arch == "bailingmoe2" and s.n_rot == 0:
        groups = 4 if s.n_expert >= 8 and s.n_expert % 4 == 0 else 0
        return s.with_(
            **_LING2,
            n_rot=s.head_dim // 2,
            n_ff_shexp=s.n_ff_exp,
            n_dense_lead=s.n_dense_lead or (1 if s.n_layer > 1 else 0),
            n_expert_group=groups,
            n_group_used=groups // 2,
        )
    return s


def preset_names() -> list[str]:
    return [*PRESETS, *FAMILY_PRESETS]


def preset_shape(name: str, arch: str | None = None) -> ModelShape:
    """A preset, for `arch` when given (size presets fit any architecture; family presets only their own)."""
    if name in FAMILY_PRESETS:
        s = FAMILY_PRESETS[name]
        if arch is not None and arch != s.arch:
            raise ValueError(f"preset {name!r} is a {s.arch} model (drop --arch or use --arch {s.arch})")
        return s
    try:
        s = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r} (choose from {', '.join(preset_names())})") from None
    return _family_defaults(s.with_(arch=arch) if arch else s, name)


# Qwen3.8 Flash Next (transformers' Qwen4ExpTextConfig: hidden 2048, 16 heads and 2 KV heads of 256, a quarter
# rotated; DeltaNet of 16 key and 32 value heads of 128; 512 experts of 512, top-10, a shared expert of 512; 4
# streams mixed at rank 320; the n-gram table of 3-grams, 8 heads each, on one linear layer) per size preset: the
# indexer's head at least the rotated part; its budget above every prompt the tests write unless they set it lower
# (QSA is dense attention up to budget + ratio - 2 positions).
_QWEN4EXP: dict[str, dict[str, int]] = {
    "tiny": {"hc_low_rank": 32, "indexer_n_head": 2, "indexer_head_size": 16, "indexer_top_k": 64, "qsa_ratio": 4},
    "kquant": {"hc_low_rank": 256, "indexer_n_head": 4, "indexer_head_size": 64, "indexer_top_k": 128, "qsa_ratio": 8},
    "small": {"hc_low_rank": 64, "indexer_n_head": 4, "indexer_head_size": 64, "indexer_top_k": 256, "qsa_ratio": 16},
    "bench": {"hc_low_rank": 320, "indexer_n_head": 8, "indexer_head_size": 128, "indexer_top_k": 512, "qsa_ratio": 64},
}  # fmt: skip


def _qwen4exp_defaults(s: ModelShape, size: str) -> ModelShape:
    n_rot = s.n_rot or max(2, s.head_dim // 4 // 2 * 2)
    return s.with_(
        **_QWEN_NEXT,
        **_QWEN4EXP.get(size, _QWEN4EXP["small"]),
        n_layer=max(s.n_layer, 4),  # (one full-attention layer in four)
        n_rot=n_rot,
        rope_sections=_imrope_sections(n_rot),
        hc_mult=4,
        ple_layer=0,
        tokenizer="qwen35",
    )


# Qwen3.8 Flash Next scaled to this machine: its hidden size, heads, DeltaNet and experts (512 of 512, top-10)
# over 4 layers (3 linear, 1 full), the n-gram table on layer 0 with 16 heads of ~500k rows (8.0M rows of 128:
# 1.1 GB at Q8_0, read 16 rows a token): 7.8B weights, 6.4B of them in experts.
FAMILY_PRESETS["q4x-bench"] = _qwen4exp_defaults(
    ModelShape(
        arch="qwen4exp",
        n_layer=4,
        n_embd=2048,
        n_head=16,
        n_head_kv=2,
        head_dim=256,
        n_expert=512,
        n_expert_used=10,
        n_ff_exp=512,
        n_ff_shexp=512,
        vocab_size=32000,
        ssm_d_state=128,
        ssm_n_group=16,
        ssm_dt_rank=32,
    ),
    "bench",
).with_(ple_heads_per_ngram=8, ple_head_rows=500_000, context_length=262144)
