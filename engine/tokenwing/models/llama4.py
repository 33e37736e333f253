"""Llama 4 (`llama4`): Llama-4-Scout-17B-16E (109B, 16 experts) and Llama-4-Maverick-17B-128E (400B, 128 experts).

A layer (llama.cpp: src/models/llama4.cpp, its loader llama_model_llama4): RMSNorm → attention (GQA from separate
q, k, v) → residual → RMSNorm → a dense SwiGLU FFN, or, in every interleave_moe_layer_step-th layer, routed SwiGLU
experts plus one shared expert as wide as a routed one → residual. Attention comes in two kinds, in llama.cpp's
pattern of 4: three layers rotate q and k (NORM RoPE, with the file's rope_freqs factors where it has them), then
L2-normalise them (a weightless RMSNorm; not in Maverick, which llama.cpp tells by its 128 experts), and attend
within chunks of 8,192 positions (a query sees the keys from its chunk's start: llama.cpp's chunked mask); every
fourth layer rotates nothing, attends over everything and scales its queries by llama.cpp's temperature rule,
log(floor((p + 1) / 8192) + 1) · 0.1 + 1 (1 below position 8,191). llama.cpp fixes the chunk at 8,192 and the
rule's constants whatever the file says.

The router: the top-k of the raw logits, each weighted by the sigmoid of its logit, and the weight scales the
expert's INPUT, not its output (llama.cpp's build_moe_ffn for LLM_ARCH_LLAMA4). With one expert a token, as both
Llama 4 models route, that is the token's FFN input times its weight, given to the expert at weight 1: here the
routed part's input is so weighted (`routed`) and a file routing more experts a token is refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing.compute.ggml_lib import F32, I32, ROPE_NORM, Tensor, ops
from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.format.gguf_io import KV
from tokenwing.models import common, specs
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv
from tokenwing.models.hparams import HParams
from tokenwing.models.keys import Key, read_keys, write_keys
from tokenwing.models.placement import Chunks
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape

CHUNK = 8192  # llama.cpp's n_swa for Llama 4, whatever attention.sliding_window says (llama4.cpp: hard-coded)
PATTERN = 4  # three chunked RoPE layers, then one full NoPE layer (load_swa_pattern(ml, 4), n_no_rope_layer_step 4)
TEMP_FLOOR, TEMP_SCALE, TEMP_OFFSET = 8192, 0.1, 1.0  # n_attn_temp_floor_scale, f_attn_temp_scale, _offset
MAX_POSITIONS = 1 << 24  # positions an F32 holds exactly: the temperature table covers them

# The family's own keys (models/keys.py): the factory writes KEYS; rope.freq_base_swa, which llama.cpp's RoPE
# (chunked) layers take where a file has it, is read only (0: rope.freq_base; Llama 4's converter writes none)
KEYS = {"moe_layer_step": Key("interleave_moe_layer_step", "u32")}
ROPE_BASE_SWA = Key("rope.freq_base_swa", "f32", 0.0)
TEMPERATURES = "llama4.attn_temperature"  # the temperature table's name among the resident weights (not the file's)


def rope_layer(il: int) -> bool:
    """Whether layer il rotates q and k (and attends within its chunk): all but every PATTERN-th."""
    return (il + 1) % PATTERN != 0


def moe_step(hp: HParams, where: str = "the model") -> int:
    """interleave_moe_layer_step (Scout: 1, every layer; Maverick: 2): required, as llama.cpp's loader has it."""
    return int(read_keys(KEYS, hp, where)["moe_layer_step"])


def moe_layer(hp: HParams, il: int) -> bool:
    """Whether layer il routes experts (llama.cpp's loader: (il + 1) % interleave_moe_layer_step == 0)."""
    step = moe_step(hp)
    return step > 0 and (il + 1) % step == 0


def temperature(positions: np.ndarray) -> np.ndarray:
    """llama.cpp's query scale of its temperature tuning at these positions (llm_graph_input_attn_temp): float
    position plus offset over the floor scale in float, the logarithm and the rest in double, stored as float."""
    f = np.float32
    block = np.floor((positions.astype(f) + f(TEMP_OFFSET)) / f(TEMP_FLOOR)).astype(np.float64)
    out: np.ndarray = (np.log(block + 1.0) * float(f(TEMP_SCALE)) + 1.0).astype(f)
    return out


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Llama 4 (Llama4Model): the dense layers' FFN width, the experts' (the shared
    expert's too), the MoE layers' interleave step, whole heads rotated; no sliding_window (llama.cpp then chunks
    attention at 8,192 positions whatever it would say)."""
    a = "llama4"
    kv = common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_dense)
    kv.update(write_keys(KEYS, a, {"moe_layer_step": s.moe_layer_step}))
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.head_dim)
    return kv


def _check(s: ModelShape) -> None:
    """What llama.cpp's Llama 4 loader and graph take (and what this engine runs of it: one expert a token)."""
    if s.n_expert_used != 1:
        raise ValueError("llama4 routes one expert a token here: --n-expert-used 1")
    if s.n_shared_exp != 1 or s.n_ff_shexp != s.n_ff_exp:
        raise ValueError(
            "llama4 has one shared expert as wide as a routed one: --n-shared-exp 1, --n-ff-shexp n_ff_exp"
        )
    if s.moe_layer_step < 1 or s.n_layer < s.moe_layer_step:
        raise ValueError("llama4's --moe-layer-step must be at least 1 and at most --n-layer")
    if s.q_lora_rank or s.kv_lora_rank or s.n_rot not in (0, s.head_dim) or s.v_head_dim or s.n_mtp:
        raise ValueError("llama4 rotates whole heads and has no MLA ranks, head splits or MTP blocks")
    if s.n_expert_group or s.n_group_used:
        raise ValueError("llama4's router has no expert groups")


class Llama4(MoEModel):
    arch = "llama4"
    factory = Factory(
        "Llama 4 (Scout, Maverick): chunked attention with RoPE and L2-normed q/k in 3 of 4 layers, NoPE with "
        "temperature tuning in the 4th, interleaved MoE layers, a top-1 sigmoid router weighting the expert's "
        "input, a shared expert",
        _kv,
        _check,
        takes=frozenset({"n_rot", "moe_layer_step"}),
    )
    rope_mode = ROPE_NORM
    shared_experts = "required"
    sigmoid_router = True
    normalize_weights = False

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.kq_norm = hp.n_expert != 128  # (llama.cpp: use_kq_norm unless the 17B-128E type, Maverick)
        # RoPE layers take rope.freq_base_swa where the file has it (llama.cpp: they are its SWA layers)
        base = dataclasses.replace(hp, rope_base=ROPE_BASE_SWA.read(hp, "the model") or hp.rope_base)
        self.rope_chunked = common.rope_of(base, self.rope_mode, hp.rope_yarn_log_mul)
        # The temperature of each 8,192-position block as a table the graph indexes by (p + 1) // 8192: the scale
        # is llama.cpp's double-precision value, which no float op of the graph would round alike. A resident
        # tensor of its own (outside the layers: the VRAM tier uploads it with the head, `weights.py`'s view)
        table = temperature(np.arange(0, MAX_POSITIONS + TEMP_FLOOR, TEMP_FLOOR, dtype=np.int64))
        if not weights.has(TEMPERATURES):
            weights.tensors[TEMPERATURES] = weights.arena.wrap(np.ascontiguousarray(table), F32, (1, len(table)))
            weights.shapes[TEMPERATURES], weights.types[TEMPERATURES] = (1, len(table)), F32

    @property
    def window(self) -> int:
        return Chunks(CHUNK)

    # ------------------------------------------------------------------------------------------- tensors
    @classmethod
    def tensors(cls, hp: HParams, parts: Parts) -> list[TensorSpec]:
        """llama.cpp's loader: the layers with experts are those interleave_moe_layer_step says (not the file's);
        the shared expert as wide as a routed one; the RoPE factors once, optional (llama3-style scaling)."""
        first, last = specs.head(hp)
        out = [*first, TensorSpec("rope_freqs.weight", (hp.n_rot // 2,), "norm", optional=True)]
        for il in range(hp.n_layer):
            out += specs.attention(hp, il, qk_norm=False, bias=False)
            if not moe_layer(hp, il):
                out += specs.dense(hp, il, parts.ff_dense)
                continue
            out += specs.routed(hp, il, parts)
            out += specs.shared(hp, il, parts.ff_shexp, gated=False)
        return out + last

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        if moe_step(hp, where) <= 0:
            raise BadInputError(f"{where}: {cls.arch}.interleave_moe_layer_step must be positive")
        if ROPE_BASE_SWA.read(hp, where) < 0:
            raise BadInputError(f"{where}: {cls.arch}.rope.freq_base_swa must be positive")
        if hp.n_rot != hp.head_dim:  # (llama.cpp's graph asserts it)
            raise BadInputError(f"{where}: {cls.arch} rotates whole heads: rope.dimension_count must be head size")
        if hp.n_expert_used != 1:
            raise UnsupportedError(
                f"{where}: {cls.arch} with {hp.n_expert_used} experts a token is not run (its router weights the "
                "experts' input; Llama 4 routes one)"
            )
        super().check(hp, shapes, streamed, where)
        if set(streamed) != {il for il in range(hp.n_layer) if moe_layer(hp, il)}:
            raise BadInputError(f"{where}: the layers with experts are not those interleave_moe_layer_step says")

    # ------------------------------------------------------------------------------------------ attention
    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        """llama4.cpp's order: q, k, v; RoPE (or, on a NoPE layer, the queries times their temperature); the L2
        norms after RoPE; attention at 1/√head_dim, within the chunk on RoPE layers."""
        hp, w, n, d = self.hp, self.w[il], at.n, self.hp.head_dim
        q = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_q"], x), d, hp.n_head, n)
        k = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_k"], x), d, hp.n_head_kv, n)
        v = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_v"], x), d, hp.n_head_kv, n)
        chunked = rope_layer(il)
        if chunked:
            q, k = self._rope(ctx, q, at.positions), self._rope(ctx, k, at.positions)
            if self.kq_norm:
                q, k = ops.ggml_rms_norm(ctx, q, hp.rms_eps), ops.ggml_rms_norm(ctx, k, hp.rms_eps)
        else:
            q = ops.ggml_mul(ctx, q, self._temperature(ctx, at.positions, n))
        mask = at.mask_swa if chunked else None
        cur, writes = common.attend(ctx, q, k, v, at, common.kv_cache(kv), 1.0 / math.sqrt(d), mask=mask)
        return ops.ggml_mul_mat(ctx, w["attn_output"], cur), writes

    def _rope(self, ctx: Any, x: Tensor, positions: Tensor) -> Tensor:
        r = self.rope_chunked
        scaling = (r.n_ctx_orig, r.base, r.freq_scale, r.ext_factor, r.attn_factor, r.beta_fast, r.beta_slow)
        factors = self.weights.get("rope_freqs.weight") if self.weights.has("rope_freqs.weight") else None
        return ops.ggml_rope_ext(ctx, x, positions, factors, r.n_rot, r.mode, *scaling)

    def _temperature(self, ctx: Any, positions: Tensor, n: int) -> Tensor:
        """[1, 1, n]: each token's temperature, the table's row (p + 1) // 8192 (exact in F32 below 2^24)."""
        p = ops.ggml_cast(ctx, positions, F32)
        block = ops.ggml_scale_bias(ctx, p, 1.0 / TEMP_FLOOR, TEMP_OFFSET / TEMP_FLOOR)
        # (F32 → I32 truncates, which is the floor of these non-negative values)
        rows = ops.ggml_get_rows(ctx, self.weights.get(TEMPERATURES), ops.ggml_cast(ctx, block, I32))
        return ops.ggml_reshape_3d(ctx, rows, 1, 1, n)

    # -------------------------------------------------------------------------------------------- router
    def routed(self, ctx: Any, il: int, cur: Tensor, residual: Tensor, shared: Tensor | None) -> common.Routed:
        """build_moe_ffn for LLM_ARCH_LLAMA4: the top-k of the logits themselves, the weight the sigmoid of the
        chosen logit, multiplied into the expert's input; the experts then weigh their output by 1 (exact)."""
        logits = ops.ggml_mul_mat(ctx, self.w[il]["ffn_gate_inp"], cur)
        n_expert, n = int(logits.contents.ne[0]), int(logits.contents.ne[1])
        ids = ops.ggml_cont(ctx, ops.ggml_argsort_top_k(ctx, logits, 1))
        probs = ops.ggml_reshape_3d(ctx, ops.ggml_sigmoid(ctx, logits), 1, n_expert, n)
        weights = ops.ggml_reshape_2d(ctx, ops.ggml_get_rows(ctx, probs, ids), 1, n)
        weighted = ops.ggml_mul(ctx, cur, weights)
        ones = ops.ggml_fill(ctx, ops.ggml_new_tensor_2d(ctx, F32, 1, n), 1.0)
        return common.Routed(weighted, residual, ids, ones, shared)
