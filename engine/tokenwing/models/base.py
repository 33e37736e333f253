"""What every family module provides, and the checks and weight lookups they share.

A family is a subclass of `MoEModel` in `models/<arch>.py`: it checks that a file has the tensors it will use
(`check`), says how its router chooses (`router`), and builds one layer's graph (`layer`) from the pieces in
`models/common.py`. The runtime calls these and nothing else: it never knows a family by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np

from tokenwing.compute.ggml_lib import ROPE_NEOX, Tensor, ops
from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.models import common, specs
from tokenwing.models.factory import Factory
from tokenwing.models.hparams import HParams
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights


class TensorCheck:
    """Every tensor a layer will use exists with the shape the hyper-parameters imply.

    ggml aborts the process on a shape mismatch, so a crafted or inconsistent file must stop here, with one line.
    """

    def __init__(self, hp: HParams, shapes: dict[str, tuple[int, ...]], where: str) -> None:
        self.hp, self.shapes, self.where = hp, shapes, where

    def has(self, name: str) -> bool:
        return name in self.shapes

    def need(self, name: str, shape: tuple[int, ...]) -> None:
        got = self.shapes.get(name)
        if got is None:
            raise BadInputError(f"{self.where}: tensor {name} is missing")
        if _squeezed(tuple(got)) != _squeezed(shape):  # (llama.cpp's quantizer drops trailing 1s, as ggml may)
            raise BadInputError(f"{self.where}: tensor {name} has shape {tuple(got)}, the metadata implies {shape}")

    def specs(self, listed: list[TensorSpec], n_layer: int) -> None:
        """Every tensor the family lists (`MoEModel.tensors`) for the layers that run, its routed experts aside
        (streamed: the repack's record of them is checked by `experts`); an optional one where the file has it."""
        for t in listed:
            block = t.block
            if t.role == "expert" or (block is not None and block >= n_layer) or (t.optional and not self.has(t.name)):
                continue
            self.need(t.name, t.shape)

    def head(self) -> None:
        e = self.hp.n_embd
        self.need("token_embd.weight", (e, self.hp.vocab_size))
        self.need("output_norm.weight", (e,))
        if self.has("output.weight"):
            self.need("output.weight", (e, self.hp.vocab_size))

    def attention(self, il: int, qk_norm: bool, qkv_bias: bool) -> None:
        hp, p = self.hp, f"blk.{il}."
        e, q, kv = hp.n_embd, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        self.need(p + "attn_norm.weight", (e,))
        self.need(p + "attn_q.weight", (e, q))
        self.need(p + "attn_k.weight", (e, kv))
        self.need(p + "attn_v.weight", (e, kv))
        self.need(p + "attn_output.weight", (q, e))
        if qk_norm:
            self.need(p + "attn_q_norm.weight", (hp.head_dim,))
            self.need(p + "attn_k_norm.weight", (hp.head_dim,))
        if qkv_bias:
            self.need(p + "attn_q.bias", (q,))
            self.need(p + "attn_k.bias", (kv,))
            self.need(p + "attn_v.bias", (kv,))

    def dense_ffn(self, il: int) -> None:
        p, e = f"blk.{il}.", self.hp.n_embd
        ff = self.shapes.get(p + "ffn_gate.weight", (e, 0))[1]
        self.need(p + "ffn_gate.weight", (e, ff))
        self.need(p + "ffn_up.weight", (e, ff))
        self.need(p + "ffn_down.weight", (ff, e))

    def router(self, il: int, bias: bool | None) -> None:
        """The router, and its selection bias (True: required, None: where the file has it)."""
        p = f"blk.{il}."
        self.need(p + "ffn_gate_inp.weight", (self.hp.n_embd, self.hp.n_expert))
        if bias or (bias is None and self.has(p + "exp_probs_b.bias")):
            self.need(p + "exp_probs_b.bias", (self.hp.n_expert,))

    def experts(self, il: int, width: int, expected: int) -> None:
        """The width the repack recorded for layer il's experts is the one the family computes them at."""
        if width != expected:
            raise BadInputError(f"{self.where}: the experts of layer {il} have width {width}, not {expected}")

    def shared_expert(self, il: int, gated: bool) -> bool:
        """Checks the layer's shared expert, if the file has one; returns whether it has."""
        p, e = f"blk.{il}.", self.hp.n_embd
        if not self.has(p + "ffn_gate_shexp.weight"):
            return False
        sh = self.shapes[p + "ffn_gate_shexp.weight"][1]
        self.need(p + "ffn_gate_shexp.weight", (e, sh))
        self.need(p + "ffn_up_shexp.weight", (e, sh))
        self.need(p + "ffn_down_shexp.weight", (sh, e))
        if gated:
            self.need(p + "ffn_gate_inp_shexp.weight", (e,))
        return True


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return shape


class MoEModel:
    """A loaded model of one family: its hyper-parameters, resident weights by layer, router and layer graph.

    The default layer is the pre-norm MoE transformer block most families share (attention, residual, FFN norm,
    then a dense FFN or routed experts with an optional shared expert); a family sets its attention and router
    and overrides what differs.
    """

    arch: ClassVar[str]
    factory: ClassVar[Factory]  # what the test-model factory makes of it: each family declares its own
    rope_mode: ClassVar[int] = ROPE_NEOX
    ffn_norm: ClassVar[str] = "ffn_norm"  # the norm before a layer's FFN and router
    qk_norm: ClassVar[bool | None] = False  # per-head q/k RMSNorm (None: where the file has it)
    qkv_bias: ClassVar[bool] = False
    shared_gated: ClassVar[bool] = False  # shared expert scaled by sigmoid(ffn_gate_inp_shexp · x)
    # Shared experts: "required", "optional" or "none". Where llama.cpp computes a file without them (or with
    # them) differently from the model the file claims to be, the engine refuses it instead of guessing.
    shared_experts: ClassVar[str] = "none"
    # The shared experts are expert_shared_count routed experts wide (llama.cpp: n_ff_exp × n_expert_shared), not
    # expert_shared_feed_forward_length: the factory writes them so (`tensors` takes the width a file has)
    shared_as_experts: ClassVar[bool] = False
    sigmoid_router: ClassVar[bool] = False  # router probabilities by sigmoid (else softmax)
    normalize_weights: ClassVar[bool] = True  # renormalise the top-k weights
    routing_keys: ClassVar[bool] = False  # the file's expert_gating_func / _weights_norm / _weights_scale apply
    selection_bias: ClassVar[bool | None] = False  # top-k on probabilities + exp_probs_b (None: where the file has it)
    # The selection bias's name in a block, as llama.cpp's loader names it for the family (hy_v3: a bare exp_probs_b)
    bias_tensor: ClassVar[str] = "exp_probs_b.bias"
    softmax_selected: ClassVar[bool] = False  # weights: a softmax over the k selected logits (gpt-oss)
    recurrence: ClassVar[str] = "none"  # how the file marks linear-attention layers (hparams.RECURRENCE)
    # The layer graph depends on its first position (`Placement.pos0`) and cannot take it as an input: a graph per
    # step, never one reused across positions (the one-graph decode step, several sequences' steps in one graph);
    # several sequences' steps run per layer, each one's graph at its own position. (DeepSeek V4's compressed blocks
    # complete at given positions, but its reused decode graph takes their rows and masks as inputs: `set_inputs`.)
    position_graphs: ClassVar[bool] = False
    # Tokens before a chunk that its embedding reads (`token_input`; qwen4exp's n-grams): 0, none
    token_context: ClassVar[int] = 0
    # Graph nodes a layer may take in a whole decode step as one graph (runtime/token_graph.py), its experts aside
    graph_nodes: ClassVar[int] = 160

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        self.hp = hp
        self.weights = weights
        self.streamed = streamed  # layers with routed experts (streamed), in order
        self._moe = set(streamed)
        self.w: list[dict[str, Tensor]] = [{} for _ in range(hp.n_layer)]
        for name, t in weights.tensors.items():
            parts = name.split(".", 2)
            if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < hp.n_layer:
                self.w[int(parts[1])][parts[2].removesuffix(".weight")] = t
        self.router = self.make_router(hp, any(self.bias_tensor in w for w in self.w))
        self.rope = common.rope_of(hp, self.rope_mode, hp.rope_yarn_log_mul)

    @classmethod
    def make_router(cls, hp: HParams, has_bias: bool = True) -> common.Router:
        """The family's routing; for families whose routing keys llama.cpp reads (`routing_keys`), the file's
        expert_gating_func, expert_weights_norm and expert_weights_scale where it has them — the others' files
        are computed as llama.cpp computes them, whatever such keys say."""
        sigmoid, normalize, scale = cls.sigmoid_router, cls.normalize_weights, 1.0
        if cls.routing_keys:
            sigmoid = sigmoid if hp.gating == 0 else hp.gating == 2
            normalize = normalize if hp.expert_weights_norm is None else hp.expert_weights_norm
            scale = hp.expert_weights_scale
        bias = bool(cls.selection_bias) or (cls.selection_bias is None and has_bias)
        return common.Router(
            hp.n_expert_used,
            sigmoid,
            normalize,
            scale,
            bias,
            hp.n_expert_groups,
            hp.n_group_used,
            cls.softmax_selected,
        )

    # ------------------------------------------------------------------------------------------- tensors
    @classmethod
    def tensors(cls, hp: HParams, parts: Parts) -> list[TensorSpec]:
        """Every tensor of the family's files, in the converter's order (models/specs.py): the one list of them,
        which `check` requires of a file and the factory writes. Here the default block `layer` computes:
        attention (`attention_tensors`), then a dense FFN or the router, routed experts and shared experts."""
        first, last = specs.head(hp)
        out = first
        for il in range(hp.n_layer + hp.n_mtp):  # (the next-token-prediction blocks last: whole layers and more)
            out += cls.attention_tensors(hp, il, parts) + cls.ffn_tensors(hp, il, parts)
            out += cls.mtp_tensors(hp, il) if il >= hp.n_layer else []
        return out + last

    @classmethod
    def mtp_tensors(cls, hp: HParams, il: int) -> list[TensorSpec]:
        """A next-token-prediction block's own tensors beside its layer's (the check reads none: never run)."""
        return []

    @classmethod
    def ffn_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        """Layer il's FFN norm and dense FFN, or its router, routed experts and shared experts."""
        if il not in parts.moe_layers:
            return specs.dense(hp, il, parts.ff_dense, cls.ffn_norm)
        out = specs.routed(hp, il, parts, cls.ffn_norm)
        return out + specs.shared(hp, il, parts.ff_shexp, cls.shared_gated) if parts.ff_shexp else out

    @classmethod
    def attention_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        """Layer il's attention tensors, its input norm first (the default block: GQA)."""
        return specs.attention(hp, il, parts.qk_norm, cls.qkv_bias)

    @classmethod
    def file_parts(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int]) -> Parts:
        """The parts a file has (`Parts`), read off its tensors: the layers with experts are those the repack
        found; a part the family may leave out is there if any layer has it (then every layer must); the FFN
        widths are those of the first dense layer and of the first layer with shared experts."""

        def first(name: str, layers: Iterable[int]) -> str | None:
            return next((f"blk.{il}.{name}" for il in layers if f"blk.{il}.{name}" in shapes), None)

        dense = first("ffn_gate.weight", (il for il in range(hp.n_layer) if il not in streamed))
        shexp = first("ffn_gate_shexp.weight", sorted(streamed))
        has_bias = first(cls.bias_tensor, streamed) is not None
        return Parts(
            moe_layers=frozenset(streamed),
            ff_dense=shapes[dense][-1] if dense else 0,
            ff_shexp=shapes[shexp][-1] if shexp else 0,
            qk_norm=cls.qk_norm
            if cls.qk_norm is not None
            else first("attn_q_norm.weight", range(hp.n_layer)) is not None,
            exp_bias=bool(cls.selection_bias) or (cls.selection_bias is None and has_bias),
        )

    # -------------------------------------------------------------------------------------------- checks
    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        """Every tensor the layers use exists with its shape (streamed: layer → width of its experts): those
        `tensors` lists for the file's parts, and the shared experts the family requires or refuses."""
        if any("check_attention" in vars(k) for k in cls.__mro__ if k is not MoEModel):
            cls.check_layers(hp, shapes, streamed, where)  # (a family whose tensors are not listed yet)
            return
        c = TensorCheck(hp, shapes, where)
        parts = cls.file_parts(hp, shapes, streamed)
        cls.check_shared(parts.ff_shexp > 0, where)
        listed = cls.tensors(hp, parts)
        c.specs(listed, hp.n_layer)
        routed = {t.block for t in listed if t.role == "expert" and t.block is not None and t.block < hp.n_layer}
        if unrouted := sorted(routed - set(streamed)):
            raise BadInputError(f"{where}: layer {unrouted[0]} has no routed experts")
        for il, width in streamed.items():
            c.experts(il, width, cls.expert_width(hp, il))

    @classmethod
    def check_shared(cls, has: bool, where: str) -> None:
        """Shared experts where the family requires them, none where it has none (`shared_experts`)."""
        if has != (cls.shared_experts == "required") and cls.shared_experts != "optional":
            what = "without shared experts" if not has else "with shared experts"
            raise UnsupportedError(
                f"{where}: a {cls.arch} model {what} is not run: llama.cpp computes such a file unlike the "
                "model it claims to be, so there is no reference for its output"
            )

    @classmethod
    def check_layers(
        cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str
    ) -> None:
        """`check` layer by layer through `check_attention`, for the families whose `tensors` do not list their
        files yet (issue 42 item 1 moves them one by one)."""
        c = TensorCheck(hp, shapes, where)
        c.head()
        for il in range(hp.n_layer):
            cls.check_attention(c, il)
            c.need(f"blk.{il}.{cls.ffn_norm}.weight", (hp.n_embd,))
            if il not in streamed:
                c.dense_ffn(il)
                continue
            c.router(il, cls.selection_bias)
            c.experts(il, streamed[il], cls.expert_width(hp, il))
            cls.check_shared(c.shared_expert(il, cls.shared_gated), where)

    @classmethod
    def check_attention(cls, c: TensorCheck, il: int) -> None:
        qk_norm = cls.qk_norm if cls.qk_norm is not None else c.has(f"blk.{il}.attn_q_norm.weight")
        c.attention(il, qk_norm, cls.qkv_bias)

    # --------------------------------------------------------------------------------------------- graph
    def layer(self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache) -> common.LayerOut:
        """Layer il's graph on the residual state x (`state_width` floats a token; read through `mix_in`):
        attention (writing the cache; a linear-attention layer updates its recurrent state), then a dense FFN
        (`out`, the next state) or the FFN norm, shared expert and router of the routed experts (`routed`, which
        `tail` makes the next state)."""
        w = self.w[il]
        x = self.mix_in(ctx, il, x)
        attn, writes = self.attention(ctx, il, self.norm(ctx, x, w["attn_norm"]), at, kv)
        residual = ops.ggml_add(ctx, attn, x)
        cur = self.norm(ctx, residual, w[self.ffn_norm])
        limit = self.swiglu_limit(il)
        if il not in self._moe:
            return common.LayerOut(writes, out=ops.ggml_add(ctx, common.dense_ffn(ctx, w, cur, limit), residual))
        shared = common.shared_expert(ctx, w, cur, self.shared_gated, limit) if "ffn_gate_shexp" in w else None
        return common.LayerOut(writes, routed=self.routed(ctx, il, cur, residual, shared))

    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        w = self.w[il]
        qk_norm = self.qk_norm if self.qk_norm is not None else "attn_q_norm" in w
        return common.attention(ctx, self.hp, w, x, at, common.kv_cache(kv), self.rope, qk_norm, self.qkv_bias)

    def routed(self, ctx: Any, il: int, cur: Tensor, residual: Tensor, shared: Tensor | None) -> common.Routed:
        """The router of layer il on `cur` (its FFN input): the selected experts and their weights."""
        w = self.w[il]
        logits = ops.ggml_mul_mat(ctx, w["ffn_gate_inp"], cur)
        ids, weights = common.route(ctx, logits, self.router, w[self.bias_tensor] if self.router.bias else None)
        return common.Routed(cur, residual, ids, weights, shared)

    def expert_ffn(self, il: int) -> common.ExpertFFN:
        """How layer il's routed experts compute (SwiGLU here; a family may add biases or another activation)."""
        return common.SWIGLU

    def swiglu_limit(self, il: int) -> float:
        """The SwiGLU limit of layer il's dense FFN or shared expert (0: none)."""
        return 0.0

    @property
    def window(self) -> int:
        """The sliding window's span when some layers attend over one (their placement needs its mask)."""
        return 0

    @classmethod
    def kv_layer(cls, hp: HParams, il: int) -> common.KVSpec:
        """Layer il's cache widths from the hyper-parameters alone: K and V of every KV head here; a family whose
        layers cache otherwise (MLA's latent, none for a linear-attention layer) overrides it. A class method so
        that `tokenwing inspect` and `info` say what a file's cache takes without loading it."""
        return common.KVSpec(hp.head_dim * hp.n_head_kv, (hp.head_dim_v or hp.head_dim) * hp.n_head_kv)

    @classmethod
    def kv_bytes_per_token(cls, hp: HParams, elt: int = 2) -> int:
        """Bytes the KV cache takes per token of context over all layers, at `elt` bytes an element (2: F16, the
        default --kv-type). The one place this number is computed: the memory plan, `inspect`, `info` and the
        app's estimate all use it. A family whose cache does not grow by its layers' widths per position (one
        that compresses along the sequence) overrides this."""
        return sum(cls.kv_layer(hp, il).bytes_per_position(elt) for il in range(hp.n_layer))

    def kv_spec(self, il: int) -> common.KVSpec:
        """Layer il's cache widths (`kv_layer` of this model's hyper-parameters)."""
        return self.kv_layer(self.hp, il)

    def state_spec(self, il: int) -> common.StateSpec | None:
        """Layer il's recurrent state, if it is a linear-attention layer."""
        return self.layer_state(self.hp, self.weights.shapes, il)

    @classmethod
    def layer_state(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], il: int) -> common.StateSpec | None:
        """`state_spec` from the metadata and the tensors' shapes alone (a class method: `tokenwing info` sizes a
        server's slots before any weight is loaded)."""
        return None

    @property
    def position_axes(self) -> int:
        """Position values per token the graphs take: 4 with multi-axis RoPE (qwen35moe), else 1."""
        return 4 if self.rope.sections else 1

    # --------------------------------------------------------------- the residual state between layers
    # What passes from layer to layer is the family's own (docs/families/residual-state.md): one hidden vector a
    # token by default; a family with several streams or a stack of checkpoints (DeepSeek V4, Kimi K3) widens it.
    # The runtime only keeps `state_width` floats a token and hands them back: it never reads them.
    @classmethod
    def state_width(cls, hp: HParams) -> int:
        """Floats per token between layers (a class method: the memory plan sizes a prompt's by it)."""
        return hp.n_embd

    @classmethod
    def graph_extra_bytes(cls, hp: HParams, max_batch: int, n_ctx: int) -> int:
        """What a layer's graph of `max_batch` tokens over `n_ctx` positions takes beyond the memory plan's rule
        (`memory_plan.graph_bytes`): 0, but for a family that builds more [n_ctx, batch] tensors (qwen4exp's QSA)."""
        return 0

    @classmethod
    def expert_width(cls, hp: HParams, il: int) -> int:
        """The width of layer il's routed experts: their input, and the sum `tail` receives."""
        return hp.n_embd

    def embed(self, ctx: Any, ids: Tensor) -> Tensor:
        """The state [state_width, n] the first layer reads, from token ids."""
        return ops.ggml_get_rows(ctx, self.weights.get("token_embd.weight"), ids)

    @property
    def token_width(self) -> int:
        """Values `token_input` gives a token (the one-graph step's input is that wide)."""
        return 1

    def share_expert_budget(self, budget: int) -> int:
        """The expert cache's budget less what the family's own caches of streamed data take from it (qwen4exp's
        n-gram table pages): one memory limit for both."""
        return budget

    def lazy_reads(self) -> dict[str, int] | None:
        """The reads of the family's sparsely read tensors so far (`lazy_tensors`; qwen4exp: the n-gram table's
        `page_reads`, `bytes_read`, `wait_ns` and `rows`), for the session's statistics; None without any."""
        return None

    @classmethod
    def lazy_tensors(cls, hp: HParams) -> frozenset[str]:
        """Resident tensors the family reads sparsely from the file instead of loading (qwen4exp's n-gram table)."""
        return frozenset()

    def token_input(self, tokens: list[int], before: list[int]) -> np.ndarray:
        """What `embed` reads for these tokens (I32), `before` the last `token_context` tokens of the sequence
        ahead of them (fewer where it starts): their ids here; a family whose embedding depends on the tokens
        before appends what it needs (qwen4exp: each token's rows of its n-gram table)."""
        return np.asarray(tokens, np.int32)

    def mix_in(self, ctx: Any, il: int, state: Tensor) -> Tensor:
        """What layer il's block reads from the state (the default layer's input hook): the state itself here."""
        return state

    def tail(self, ctx: Any, il: int, experts: Tensor, shared: Tensor | None, residual: Tensor) -> Tensor:
        """The next state from layer il's weighted expert sum and its `Routed` shared and residual parts: here
        (experts + shared) + residual, as llama.cpp adds them. The decode paths call this in their graphs."""
        return common.moe_tail(ctx, experts, shared, residual)

    def tail_array(
        self, il: int, experts: np.ndarray, shared: np.ndarray | None, residual: np.ndarray
    ) -> np.ndarray | None:
        """`tail` on the prompt path's arrays, with the same operations in the same order (in place in `experts`);
        None where the tail needs ggml (a matrix product): the runtime then computes `tail` in a graph."""
        return common.moe_tail_array(experts, shared, residual)

    def router_input(self, ctx: Any, lo: common.LayerOut) -> Tensor:
        """The hidden vector the router lookahead applies later layers' routers to (before their norm): a MoE
        layer's residual plus its shared expert (adding the shared expert cut misses by 11 % on Ling, spec §6);
        a dense layer's output (its FFN plays the shared expert's part)."""
        r = lo.routed
        if r is None:
            assert lo.out is not None
            return lo.out
        return r.residual if r.shared is None else ops.ggml_add(ctx, r.residual, r.shared)

    def set_inputs(self, at: common.Placement, pos: int) -> None:
        """A reused decode graph's inputs of the family's own that depend on the position, for its token at `pos`
        (runtime/token_graph.py; DeepSeek V4's masks and ring indices): none by default."""

    def one_graph_at(self, pos: int, n_ctx: int) -> bool:
        """Whether a reused decode graph may run the token at `pos` (else the step runs a graph per layer)."""
        return True

    def known_experts(self, token: int) -> dict[int, list[int]]:
        """Layers whose experts the token id alone decides (DeepSeek V4's hash layers), with those experts: the
        session reads them from the token's start."""
        return {}

    def head(self, ctx: Any, x: Tensor) -> Tensor:
        """Logits from the state (a wider state is folded here, before the output norm)."""
        out = self.norm(ctx, x, self.weights.get("output_norm.weight"))
        name = "output.weight" if self.weights.has("output.weight") else "token_embd.weight"
        return ops.ggml_mul_mat(ctx, self.weights.get(name), out)

    def norm(self, ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        return common.rms_norm(ctx, x, weight, self.hp.rms_eps)

    # ------------------------------------------------------------------ what the router lookahead needs
    def router_norm(self, il: int) -> Tensor:
        """The norm layer il applies before its router (the lookahead applies it to earlier hidden states)."""
        return self.w[il][self.ffn_norm]

    def router_weight_name(self, il: int) -> str:
        return f"blk.{il}.ffn_gate_inp.weight"

    def router_bias_name(self, il: int) -> str | None:
        return f"blk.{il}.{self.bias_tensor}" if self.router.bias else None
