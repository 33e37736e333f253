"""Linear attention with a recurrent state (llama.cpp: src/models/delta-net-base.cpp and the linear layers of
qwen3next.cpp, qwen35moe.cpp and bailingmoe3.cpp): a short causal convolution over the projected inputs, then the
gated delta rule, both through ggml's own ops (`ggml_ssm_conv`, `ggml_gated_delta_net`).

A layer keeps, per sequence, the last d_conv - 1 inputs of its convolution and one S × S state matrix per value
head; each graph reads them and writes them back (the writes must be in the graph, as the KV cache's are). The
delta rule runs token by token inside one op (llama.cpp's fused path, the one its CPU backend takes), and the
state after a chunk is exactly the state the next chunk starts from: a prompt computed in chunks, layer-major,
gives the numbers of one pass (tested), and decode continues from the prompt's state.

The engine's ggml is the one llama-cpp-python 0.3.36 vendors (engine/ggml): both ops are the oracle's own kernels,
including the K snapshot slots of gated_delta_net.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import Tensor, ops
from tokenwing.models import common


def l2_norm(ctx: Any, x: Tensor, eps: float) -> Tensor:
    """x / ‖x‖ per row, as llama.cpp writes it (build_gdn_l2_norm): an RMS norm with eps / n, scaled by 1 / √n
    (both in float32, as C computes them)."""
    n = np.float32(int(x.contents.ne[0]))
    return ops.ggml_scale(
        ctx, ops.ggml_rms_norm(ctx, x, float(np.float32(eps) / n)), float(np.float32(1.0) / np.sqrt(n))
    )


def short_conv(
    ctx: Any, cache: common.RecurrentCache, x: Tensor, kernel: Tensor, slot: int = 0
) -> tuple[Tensor, list[Tensor]]:
    """The causal convolution of x [channels, n] over its kernel [d_conv, channels], continuing from slot `slot`
    of the cache's convolution states (the previous d_conv - 1 inputs, oldest first). Returns the convolution's
    output [channels, n, 1] (before its activation) and the writes of the last d_conv - 1 inputs into the cache
    (and of those one token earlier into its snapshot, if asked)."""
    channels, n = int(x.contents.ne[0]), int(x.contents.ne[1])
    states = conv_states(ctx, cache.conv, slot)
    keep = int(states.contents.ne[0])
    window = ops.ggml_concat(ctx, states, ops.ggml_transpose(ctx, ops.ggml_reshape_3d(ctx, x, channels, n, 1)), 0)
    nb = window.contents.nb

    def inputs_before(end: int) -> Tensor:  # the d_conv - 1 inputs before window column `end`
        return ops.ggml_view_3d(ctx, window, keep, channels, 1, int(nb[1]), int(nb[2]), int(nb[0]) * (end - keep))

    writes = [ops.ggml_cpy(ctx, inputs_before(keep + n), states)]
    if cache.snapshot is not None:
        assert n >= 2, "a snapshot one token back needs a graph of two tokens or more"
        writes.append(ops.ggml_cpy(ctx, inputs_before(keep + n - 1), conv_states(ctx, cache.snapshot.conv, slot)))
    return ops.ggml_ssm_conv(ctx, window, kernel), writes


def delta_rule(
    ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cache: common.RecurrentCache
) -> tuple[Tensor, list[Tensor]]:
    """The gated delta rule over n tokens (q, k [S, H_k, n, 1], v [S, H_v, n, 1], g [1 or S, H_v, n, 1], beta
    [1, H_v, n, 1]) from the cache's state [S, S, H_v, 1]: the output [S, H_v, n, 1] and the write of the new state
    into the cache (and of the state one token earlier into its snapshot, if asked: the op's second snapshot
    slot, as llama.cpp's rollback uses it). Key heads serve value heads h, h + H_k, … (ggml's broadcast, Qwen3.5's
    layout)."""
    s, h, n = int(v.contents.ne[0]), int(v.contents.ne[1]), int(v.contents.ne[2])
    slots = 1 if cache.snapshot is None else 2
    result = ops.ggml_gated_delta_net(ctx, q, k, v, g, beta, cache.state, slots)
    f = int(result.contents.nb[0])
    out = ops.ggml_view_4d(ctx, result, s, h, n, 1, f * s, f * s * h, f * s * h * n, 0)

    def state(slot: int) -> Tensor:
        offset = f * s * h * n + slot * f * s * s * h
        return ops.ggml_view_4d(ctx, result, s, s, h, 1, f * s, f * s * s, f * s * s * h, offset)

    writes = [ops.ggml_cpy(ctx, state(0), cache.state)]
    if cache.snapshot is not None:
        assert n >= 2, "a snapshot one token back needs a graph of two tokens or more"
        writes.append(ops.ggml_cpy(ctx, state(1), cache.snapshot.state))
    return out, writes


# Kimi Delta Attention's three projections and their convolutions, in the order of the layer's convolution
# states (llama.cpp's: q, k, v)
KDA_PROJECTIONS = (("attn_q", "ssm_conv1d_q"), ("attn_k", "ssm_conv1d_k"), ("attn_v", "ssm_conv1d_v"))


def kda_qkv(
    ctx: Any, w: dict[str, Tensor], x: Tensor, cache: common.RecurrentCache, d_conv: int, hd: int, nh: int
) -> tuple[list[Tensor], list[Tensor]]:
    """KDA's q, k and v [hd, nh, n, 1] from the normed input x [n_embd, n]: each projection through its own short
    convolution (slot 0, 1, 2 of the layer's states) and SiLU (Ling 3.0 and Kimi K3 alike); and the state writes."""
    n, d_inner = int(x.contents.ne[1]), hd * nh
    qkv, writes = [], []
    for slot, (proj, conv) in enumerate(KDA_PROJECTIONS):
        kernel = ops.ggml_reshape_2d(ctx, w[conv], d_conv, d_inner)
        out, conv_writes = short_conv(ctx, cache, ops.ggml_mul_mat(ctx, w[proj], x), kernel, slot)
        out = ops.ggml_silu(ctx, ops.ggml_reshape_2d(ctx, out, d_inner, n))
        qkv.append(ops.ggml_reshape_4d(ctx, out, hd, nh, n, 1))
        writes += conv_writes
    return qkv, writes


def kda_out(
    ctx: Any,
    w: dict[str, Tensor],
    qkv: list[Tensor],
    gate: Tensor,
    beta: Tensor,
    out_gate: Tensor,
    cache: common.RecurrentCache,
    eps: float,
) -> tuple[Tensor, list[Tensor]]:
    """The rest of a KDA layer once its decay gate [hd, nh, n, 1] and write strength β [1, nh, n, 1] are known: q and
    k L2-normalised, the gated delta rule over the state, each head's output RMS-normed (ssm_norm) times
    sigmoid(out_gate [hd · nh, n]), then attn_output: [n_embd, n], and the state writes."""
    q, k, v = qkv
    hd, nh, n = int(v.contents.ne[0]), int(v.contents.ne[1]), int(v.contents.ne[2])
    q, k = l2_norm(ctx, q, eps), l2_norm(ctx, k, eps)
    out, writes = delta_rule(ctx, q, k, v, gate, beta, cache)
    out = ops.ggml_reshape_3d(ctx, ops.ggml_cont(ctx, out), hd, nh, n)
    out_gate = ops.ggml_reshape_3d(ctx, out_gate, hd, nh, n)
    out = ops.ggml_mul(ctx, common.rms_norm(ctx, out, w["ssm_norm"], eps), ops.ggml_sigmoid(ctx, out_gate))
    return ops.ggml_mul_mat(ctx, w["attn_output"], ops.ggml_cont_2d(ctx, out, hd * nh, n)), writes


def repeat_interleaved(ctx: Any, x: Tensor, times: int) -> Tensor:
    """[S, H, n, 1] → [S, H · times, n, 1] with each head repeated `times` times in a row (Qwen3-Next's key heads
    serve value heads h·times … h·times + times - 1), as llama.cpp builds it before the delta rule."""
    s, h, n = int(x.contents.ne[0]), int(x.contents.ne[1]), int(x.contents.ne[2])
    grouped = ops.ggml_reshape_4d(ctx, x, s, 1, h, n)
    return ops.ggml_reshape_4d(ctx, ops.ggml_repeat_4d(ctx, grouped, s, times, h, n), s, h * times, n, 1)


def gated_norm(ctx: Any, x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """RMSNorm(x) · weight · silu(gate) (Qwen's gated output norm)."""
    return ops.ggml_mul(ctx, common.rms_norm(ctx, x, weight, eps), ops.ggml_silu(ctx, gate))


def conv_states(ctx: Any, conv: Tensor, slot: int = 0) -> Tensor:
    """Slot `slot` of a cache's convolution states ([d_conv - 1, channels, slots]) as [d_conv - 1, channels, 1]."""
    c = conv.contents
    return ops.ggml_view_3d(ctx, conv, int(c.ne[0]), int(c.ne[1]), 1, int(c.nb[1]), int(c.nb[2]), slot * int(c.nb[2]))
