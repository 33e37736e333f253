"""Qwen3.8 Flash Next (`qwen4exp`): Qwen3.5's gated DeltaNet and gated attention with hyper-connections in place of
every layer norm (llama.cpp: src/models/qwen4exp.cpp; docs/families/qwen4exp.md walks through it).

The state between layers is hc residual streams, [n_embd, hc] a token (the embedding copied hc times). Before its
attention and before its FFN a layer reads a mix of them (`hc_mix`): the streams RMS-normed one by one and scaled
by their gammas, gated by sigmoid of a low-rank projection of themselves (down, silu, up) and averaged; the
block's output goes back into every stream scaled by 2 · sigmoid(inject · normed / hc), one weight per stream
(`hc_combine`). The head mixes the streams once more, which is its only norm.

The DeltaNet differs from Qwen3.5's in one place: its output norm is gated by sigmoid(z), not silu(z). The full
layers' QSA is plain attention while a query sees at most top_k + block - 1 cells, which is the context the
engine gives these files (`hparams._qsa`); the indexer beyond it, and the n-gram table (PLE), are not built yet:
a file with the table is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import F32, Tensor, ops
from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.models import common, delta_net
from tokenwing.models.base import TensorCheck
from tokenwing.models.hparams import HParams
from tokenwing.models.qwen3next import Qwen35MoE
from tokenwing.models.weights import ModelWeights


class Qwen4Exp(Qwen35MoE):
    arch = "qwen4exp"
    ffn_norm = "ffn_norm"  # (absent: the router reads the FFN's mix as it is)

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.hc = self.streams(hp, weights.shapes)
        # the lookahead folds a norm into later routers: the router here reads the mix as it is
        self._ones = weights.arena.wrap(np.ones(hp.n_embd, np.float32), F32, (hp.n_embd,))

    @staticmethod
    def streams(hp: HParams, shapes: dict[str, tuple[int, ...]]) -> int:
        """hyper_connection.count, from the head's mix (its up-projection is [rank, hc · n_embd])."""
        return shapes.get("output_hc_up.weight", (0, 0))[1] // max(hp.n_embd, 1)

    # -------------------------------------------------------------------------------------------- checks
    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        if "per_layer_token_embd.weight" in shapes:
            raise UnsupportedError(
                f"{where}: the n-gram embedding table (qwen4exp's PLE) is not run yet: this file has one"
            )
        e = hp.n_embd
        hc = cls.streams(hp, shapes)
        rank = shapes.get("output_hc_down.weight", (0, 0))[1]
        if hc < 2 or rank < 1:
            raise BadInputError(f"{where}: qwen4exp needs output_hc_down and output_hc_up of 2 or more streams")
        if hc != 4:  # (the state's width is planned from the metadata, which does not carry the count we read)
            raise UnsupportedError(f"{where}: qwen4exp with {hc} hyper-connection streams is not run (4 are)")
        if len(streamed) != hp.n_layer:
            raise BadInputError(f"{where}: every qwen4exp layer has routed experts")
        c = TensorCheck(hp, shapes, where)
        c.need("token_embd.weight", (e, hp.vocab_size))
        if c.has("output.weight"):
            c.need("output.weight", (e, hp.vocab_size))
        mixes = [("output_hc", False)]
        mixes += [(f"blk.{il}.hc_{part}", True) for il in range(hp.n_layer) for part in ("attn", "ffn")]
        for prefix, inject in mixes:
            c.need(prefix + "_norm.weight", (hc * e,))
            c.need(prefix + "_down.weight", (hc * e, rank))
            c.need(prefix + "_up.weight", (rank, hc * e))
            if inject:
                c.need(prefix + "_inject.weight", (hc * e, hc))
        # Qwen3.5's checks of the rest, told of the norms the hyper-connections replace as if the file had them
        norms = ["output_norm"] + [f"blk.{il}.{n}" for il in range(hp.n_layer) for n in ("attn_norm", "ffn_norm")]
        super().check(hp, shapes | {f"{n}.weight": (e,) for n in norms}, streamed, where)

    # -------------------------------------------------------------------------- the state between layers
    @classmethod
    def state_width(cls, hp: HParams) -> int:
        # (a class method without the file's shapes: 4 streams, transformers' default and the only count the
        # released model has; __init__ refuses another)
        return 4 * hp.n_embd

    def _streams(self, ctx: Any, state: Tensor) -> Tensor:
        return ops.ggml_reshape_3d(ctx, state, self.hp.n_embd, self.hc, int(state.contents.ne[1]))

    def _flat(self, ctx: Any, st: Tensor) -> Tensor:
        return ops.ggml_reshape_2d(ctx, st, self.hp.n_embd * self.hc, int(st.contents.ne[2]))

    def embed(self, ctx: Any, ids: Tensor) -> Tensor:
        """hc copies of the token's embedding (qwen4exp.cpp:392)."""
        x = super().embed(ctx, ids)
        e, n = self.hp.n_embd, int(ids.contents.ne[0])
        return self._flat(ctx, ops.ggml_repeat_4d(ctx, ops.ggml_reshape_3d(ctx, x, e, 1, n), e, self.hc, n, 1))

    def _normed(self, ctx: Any, st: Tensor, gamma: Tensor) -> Tensor:
        """Each stream RMS-normed over its n_embd values, times its own gammas ([hc · n_embd] read as [n_embd, hc])."""
        g = ops.ggml_reshape_2d(ctx, gamma, self.hp.n_embd, self.hc)
        return ops.ggml_mul(ctx, ops.ggml_rms_norm(ctx, st, self.hp.rms_eps), g)

    def hc_mix(self, ctx: Any, st: Tensor, prefix: dict[str, Tensor], part: str) -> Tensor:
        """What a block reads from the streams st [n_embd, hc, n] (build_hc_mix, qwen4exp.cpp:270-324, its unfused
        form): the normed streams gated by sigmoid(up · silu(down · normed / hc)), averaged."""
        e, hc, n = self.hp.n_embd, self.hc, int(st.contents.ne[2])
        xn = ops.ggml_reshape_2d(ctx, self._normed(ctx, st, prefix[part + "_norm"]), hc * e, n)
        lo = ops.ggml_silu(ctx, ops.ggml_scale(ctx, ops.ggml_mul_mat(ctx, prefix[part + "_down"], xn), 1.0 / hc))
        gate = ops.ggml_mul_mat(ctx, prefix[part + "_up"], lo)
        gated = ops.ggml_reshape_3d(ctx, ops.ggml_mul(ctx, xn, ops.ggml_sigmoid(ctx, gate)), e, hc, n)
        row, stride = int(gated.contents.nb[1]), int(gated.contents.nb[2])
        mixed = ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, gated, e, n, stride, 0))
        for c in range(1, hc):
            mixed = ops.ggml_add(ctx, mixed, ops.ggml_view_2d(ctx, gated, e, n, stride, c * row))
        return ops.ggml_scale(ctx, mixed, 1.0 / hc)

    def hc_combine(self, ctx: Any, st: Tensor, block: Tensor, gamma: Tensor, inject: Tensor) -> Tensor:
        """The block's output [n_embd, n] added to every stream, scaled by 2 · sigmoid(inject · normed / hc)
        (build_hc_combine, qwen4exp.cpp:326-354: the weights come from the streams the block read)."""
        e, hc, n = self.hp.n_embd, self.hc, int(st.contents.ne[2])
        xn = ops.ggml_reshape_2d(ctx, self._normed(ctx, st, gamma), hc * e, n)
        raw = ops.ggml_scale(ctx, ops.ggml_mul_mat(ctx, inject, xn), 1.0 / hc)
        w = ops.ggml_scale(ctx, ops.ggml_sigmoid(ctx, raw), 2.0)
        b = ops.ggml_repeat_4d(ctx, ops.ggml_reshape_3d(ctx, block, e, 1, n), e, hc, n, 1)
        return ops.ggml_add(ctx, st, ops.ggml_mul(ctx, b, ops.ggml_reshape_3d(ctx, w, 1, hc, n)))

    # --------------------------------------------------------------------------------------------- graph
    def layer(self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache) -> common.LayerOut:
        w = self.w[il]
        st = self._streams(ctx, x)
        attn, writes = self.attention(ctx, il, self.hc_mix(ctx, st, w, "hc_attn"), at, kv)
        st = self.hc_combine(ctx, st, attn, w["hc_attn_norm"], w["hc_attn_inject"])
        cur = self.hc_mix(ctx, st, w, "hc_ffn")
        shared = common.shared_expert(ctx, w, cur, True)
        return common.LayerOut(writes, routed=self.routed(ctx, il, cur, self._flat(ctx, st), shared))

    def tail(self, ctx: Any, il: int, experts: Tensor, shared: Tensor | None, residual: Tensor) -> Tensor:
        """(experts + shared) combined into the streams the FFN read (its inject weights from them again: the same
        operations on the same values as when the layer computed its mix)."""
        w = self.w[il]
        out = experts if shared is None else ops.ggml_add(ctx, experts, shared)
        st = self.hc_combine(ctx, self._streams(ctx, residual), out, w["hc_ffn_norm"], w["hc_ffn_inject"])
        return self._flat(ctx, st)

    def tail_array(
        self, il: int, experts: np.ndarray, shared: np.ndarray | None, residual: np.ndarray
    ) -> np.ndarray | None:
        return None  # (a norm and matrix products: the session computes `tail` in a graph)

    def router_input(self, ctx: Any, lo: common.LayerOut) -> Tensor:
        """The FFN's mix plus the shared expert: what the lookahead's later routers score."""
        r = lo.routed
        assert r is not None
        return r.cur if r.shared is None else ops.ggml_add(ctx, r.cur, r.shared)

    def router_norm(self, il: int) -> Tensor:
        return self._ones

    def head(self, ctx: Any, x: Tensor) -> Tensor:
        """The head's mix of the streams (no inject), then the output matrix (qwen4exp.cpp:449-459)."""
        heads = {p: self.weights.get(f"output_hc_{p}.weight") for p in ("norm", "down", "up")}
        cur = self.hc_mix(ctx, self._streams(ctx, x), {f"h_{k}": v for k, v in heads.items()}, "h")
        name = "output.weight" if self.weights.has("output.weight") else "token_embd.weight"
        return ops.ggml_mul_mat(ctx, self.weights.get(name), cur)

    # ------------------------------------------------------------------------------------------ attention
    def linear_attention(
        self, ctx: Any, il: int, x: Tensor, n: int, cache: common.RecurrentCache
    ) -> tuple[Tensor, list[Tensor]]:
        """Qwen3.5's gated DeltaNet with the output norm gated by sigmoid(z) (build_norm_gated, :479-489)."""
        w, lin, eps = self.w[il], self.lin, self.hp.rms_eps
        qkv, z = self._qkvz(ctx, w, x, n)
        beta, g = self._beta_gate(ctx, w, x, n)
        conv, writes = delta_net.short_conv(ctx, cache, qkv, w["ssm_conv1d"])
        conv = ops.ggml_silu(ctx, conv)
        f = int(conv.contents.nb[0])
        row = f * lin.conv_dim
        q = ops.ggml_view_4d(ctx, conv, lin.s, lin.k_heads, n, 1, f * lin.s, row, row * n, 0)
        k = ops.ggml_view_4d(ctx, conv, lin.s, lin.k_heads, n, 1, f * lin.s, row, row * n, f * lin.key_dim)
        v = ops.ggml_view_4d(ctx, conv, lin.s, lin.v_heads, n, 1, f * lin.s, row, row * n, 2 * f * lin.key_dim)
        q, k = delta_net.l2_norm(ctx, q, eps), delta_net.l2_norm(ctx, k, eps)
        out, state_writes = delta_net.delta_rule(ctx, q, k, v, g, beta, cache)
        z = ops.ggml_reshape_4d(ctx, z, lin.s, lin.v_heads, n, 1)
        out = ops.ggml_mul(ctx, common.rms_norm(ctx, out, w["ssm_norm"], eps), ops.ggml_sigmoid(ctx, z))
        out = ops.ggml_mul_mat(ctx, w["ssm_out"], ops.ggml_reshape_2d(ctx, out, lin.value_dim, n))
        return out, writes + state_writes


# ---------------------------------------------------------------------------------------- the n-gram table
@dataclass(frozen=True)
class NgramKeys:
    """The n-gram table's hash (qwen4exp.ple.*; docs/families/qwen4exp.md 2.6): which rows a token reads."""

    ngram: int  # n-grams of 2 … ngram tokens
    heads_per_ngram: int
    eos: int  # resets the window: it and everything before it read as EOS
    multipliers: tuple[int, ...]  # one per position back, 0 the token itself
    offsets: tuple[int, ...]  # each head's first row in the table
    vocab_sizes: tuple[int, ...]  # each head's rows

    @classmethod
    def of(cls, meta: dict[str, Any], where: str) -> NgramKeys | None:
        """The file's keys; None where it has no table (no qwen4exp.ple.layers)."""
        a = "qwen4exp.ple."
        layers = meta.get(a + "layers")
        if layers is None or len(layers) == 0:
            return None

        def ints(key: str) -> tuple[int, ...]:
            v: Any = meta.get(a + key)
            if hasattr(v, "tolist"):
                v = v.tolist()
            if not isinstance(v, list) or not all(isinstance(x, int) and x >= 0 for x in v):
                raise BadInputError(f"{where}: {a}{key} must list non-negative integers")
            return tuple(int(x) for x in v)

        k = cls(
            int(meta.get(a + "ngram_size", 0)),
            int(meta.get(a + "heads_per_ngram", 0)),
            int(meta.get(a + "eos_token_id", 0)),
            ints("layer_multipliers"),
            ints("head_offsets"),
            ints("head_vocab_sizes"),
        )
        heads = (k.ngram - 1) * k.heads_per_ngram
        if k.ngram < 2 or heads < 1 or len(k.multipliers) < k.ngram or min(len(k.offsets), len(k.vocab_sizes)) < heads:
            raise BadInputError(f"{where}: the n-gram table's keys (qwen4exp.ple.*) do not fit together")
        if not all(k.vocab_sizes[:heads]):
            raise BadInputError(f"{where}: {a}head_vocab_sizes must be positive")
        return k

    @property
    def heads(self) -> int:
        return (self.ngram - 1) * self.heads_per_ngram

    def rows(self, tokens: list[int], before: list[int]) -> np.ndarray:
        """The table rows [len(tokens), heads] the tokens read, `before` the sequence's tokens ahead of them
        (oldest first; fewer than ngram - 1 where the sequence starts). Going back from a token, a missing one,
        an EOS and everything before it read as EOS; the token's own EOS counts as itself. The products stay
        below 2^63 (multipliers below 2^63 / vocab): uint64 as llama.cpp hashes, int64 as the reference does."""
        back = self.ngram - 1
        seq = [*before[-back:], *tokens] if back else list(tokens)
        first = len(seq) - len(tokens)
        m = [np.uint64(x) for x in self.multipliers[: self.ngram]]
        sizes = np.array(self.vocab_sizes[: self.heads], np.uint64)
        offsets = np.array(self.offsets[: self.heads], np.uint64)
        out = np.empty((len(tokens), self.heads), np.int64)
        for i in range(len(tokens)):
            at = first + i
            ctx = [seq[at]]
            cut = False
            for s in range(1, self.ngram):
                t = seq[at - s] if at - s >= 0 else -1
                cut = cut or t < 0 or t == self.eos
                ctx.append(self.eos if cut else t)
            for n in range(2, self.ngram + 1):  # the n-gram of the token and the n - 1 before it
                mixed = np.uint64(ctx[0]) * m[0]
                for j in range(1, n):
                    mixed ^= np.uint64(ctx[j]) * m[j]
                h = slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram)
                out[i, h] = (mixed % sizes[h] + offsets[h]).astype(np.int64)
        return out
