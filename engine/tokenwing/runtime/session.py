"""A loaded model and its state: the forward pass over the layers with expert streaming and router lookahead.

Per layer: one graph for attention, the shared expert and the routers (the layer's own, and the fused
lookahead routers of the next streamed layers); top-k on the CPU; the selected experts go to the streaming
core (demand reads), the lookahead's top-k go to it as predictions; then one graph per wave of experts that
fit the slots, reading the experts straight from the slot pool.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import F16, F32, Graph, Tensor, aligned_bytes, ops, to_numpy
from tokenwing.errors import BadInputError
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import human_bytes
from tokenwing.models import common
from tokenwing.models.hparams import HParams, read_hparams
from tokenwing.models.qwen3moe import Family, check_tensors, family
from tokenwing.models.weights import ModelWeights
from tokenwing.streaming.memory import expert_budget, memory_info
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS, ExpertStreamer, plan_slots
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.tokenizer import TextTokenizer, tokenizer_from_metadata

HEADROOM = 512 << 20  # left for other programs (Run My AI's presets use 0.5 GB)


@dataclass
class SessionOptions:
    ram_budget: int | None = None  # bytes for the expert cache; None: from free RAM and the memory limit
    lookahead: int = 2  # router lookahead distance (0: off)
    n_ctx: int = 0  # 0: the model's context length, capped by memory
    kv_type: str = "f16"
    n_threads: int = 0  # 0: the cores this process may use
    max_batch: int = 64  # prompt tokens per forward call (longer prompts are split, never refused)
    stream: StreamSettings = field(default_factory=StreamSettings)


Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(f"tokenwing: {line}", file=sys.stderr)


class Session:
    def __init__(self, path: str, options: SessionOptions | None = None, log: Log = _stderr) -> None:
        self.options = opts = options or SessionOptions()
        self.log = log
        self.mf = ModelFile.open(path)
        self.mf.verify()  # sample experts against their checksums: a corrupt file stops here
        meta = {k: v.value for k, v in self.mf.header.kv.items()}
        self.meta = meta
        self.family: Family = family(self.mf.arch)
        self.hp: HParams = read_hparams(meta, self.mf.arch, path)
        self.tokenizer: TextTokenizer = tokenizer_from_metadata(meta, path)
        template = meta.get("tokenizer.chat_template")
        self.chat_template = ChatTemplate(template) if isinstance(template, str) else None
        hp = self.hp
        shapes = {t.name: t.shape for t in self.mf.resident}
        streamed = {el.layer: el.shapes[0] for el in self.mf.index.layers}
        if any(layer >= hp.n_layer for layer in streamed):
            raise BadInputError(f"{path}: experts of a layer beyond block_count")
        check_tensors(self.family, hp, shapes, streamed, path)
        self.weights = ModelWeights(self.mf)
        self.n_ctx = opts.n_ctx or hp.n_ctx_train
        self.kv_type = {"f16": F16, "f32": F32}.get(opts.kv_type)
        if self.kv_type is None:
            raise BadInputError("--kv-type must be f16 or f32")
        elt = 2 if self.kv_type == F16 else 4
        kv_row = hp.head_dim * hp.n_head_kv * elt
        kv_per_token = 2 * hp.n_layer * kv_row
        graph_mem = self._graph_bytes()
        info = memory_info()
        # The KV cache may take at most half of what is left after the weights; past that, a shorter context.
        room = max(info.usable - HEADROOM - graph_mem - self.weights.bytes, 0) // 2
        if kv_per_token * self.n_ctx > room and not opts.n_ctx:
            self.n_ctx = max(256, min(self.n_ctx, room // kv_per_token))
            log(f"context capped at {self.n_ctx} tokens so the KV cache fits in memory")
        kv_bytes = kv_per_token * self.n_ctx
        self.kv: list[tuple[Tensor, Tensor, int]] = []
        self._kv_mem = []
        for _ in range(hp.n_layer):
            k_mem, v_mem = aligned_bytes(kv_row * self.n_ctx), aligned_bytes(kv_row * self.n_ctx)
            self._kv_mem.append((k_mem, v_mem))
            kt = self.weights.arena.wrap(k_mem, self.kv_type, (hp.head_dim * hp.n_head_kv, self.n_ctx))
            vt = self.weights.arena.wrap(v_mem, self.kv_type, (self.n_ctx, hp.head_dim * hp.n_head_kv))
            self.kv.append((kt, vt, elt))
        budget = opts.ram_budget
        if budget is None:
            budget = expert_budget(info, HEADROOM, kv_bytes + graph_mem)
        plan = plan_slots(self.mf.index, budget, hp.n_expert_used)
        if plan.note:
            log(plan.note)
        self.streamer = ExpertStreamer(self.mf, plan.slots_per_layer, opts.stream)
        if self.streamer.fallback_line:
            log(self.streamer.fallback_line.removeprefix("tokenwing: "))
        self.slots_per_layer = plan.slots_per_layer
        self.views = self.weights.expert_views(self.streamer)
        self.streamed = [el.layer for el in self.mf.index.layers]
        self._layer_weights: list[dict[str, Tensor]] = [{} for _ in range(hp.n_layer)]
        for name, t in self.weights.tensors.items():
            parts = name.split(".", 2)
            if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < hp.n_layer:
                self._layer_weights[int(parts[1])][parts[2].removesuffix(".weight")] = t
        self._lookahead = self._fused_routers(opts.lookahead)
        n_threads = opts.n_threads or len(os.sched_getaffinity(0))
        self.graph = Graph(graph_mem, n_threads)
        self.pos = 0
        self._predictions: dict[tuple[int, int], list[int]] = {}
        self.recall_hits = np.zeros(max(opts.lookahead, 1), np.int64)
        self.recall_total = np.zeros(max(opts.lookahead, 1), np.int64)
        self.trace: list[tuple[np.ndarray, np.ndarray, int]] | None = None

    # ------------------------------------------------------------------------------------------ set-up
    def _graph_bytes(self) -> int:
        hp, b = self.hp, self.options.max_batch
        per_token = 4 * (
            8 * hp.n_embd
            + 3 * hp.n_head * hp.head_dim
            + 4 * hp.n_expert
            + 4 * hp.n_expert_used * max(hp.n_embd, 1)
            + hp.vocab_size
        )
        attn = 4 * hp.n_head * b * (self.options.n_ctx or hp.n_ctx_train)
        return int(b * per_token * 2 + attn + (64 << 20))

    def _fused_routers(self, distance: int) -> dict[int, tuple[Tensor, list[int]]]:
        """For each layer: the routers of the next `distance` streamed layers stacked into one matrix."""
        out: dict[int, tuple[Tensor, list[int]]] = {}
        if distance <= 0:
            return out
        for il in range(self.hp.n_layer):
            targets = [s for s in self.streamed if s > il][:distance]
            if targets and all(self.weights.types.get(f"blk.{t}.ffn_gate_inp.weight") == 0 for t in targets):
                fused = self.weights.stacked([f"blk.{t}.ffn_gate_inp.weight" for t in targets], f"la{il}")
                out[il] = (fused, targets)
        return out

    def close(self) -> None:
        self.streamer.close()
        self.graph.close()
        self.mf.close()

    def reset(self) -> None:
        self.pos = 0

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Runs `tokens` from the current position; returns logits of the last token (or of every token)."""
        if not tokens:
            raise BadInputError("nothing to evaluate")
        if any(not 0 <= t < self.hp.vocab_size for t in tokens):
            raise BadInputError("token id outside the vocabulary")
        outs = []
        for start in range(0, len(tokens), self.options.max_batch):
            batch = tokens[start : start + self.options.max_batch]
            outs.append(self._forward_batch(batch, all_logits))
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][-1]

    def _forward_batch(self, tokens: list[int], all_logits: bool) -> np.ndarray:
        hp, n = self.hp, len(tokens)
        if self.pos + n > self.n_ctx:
            raise BadInputError(f"the context is full ({self.n_ctx} tokens)")
        decode = n == 1
        self.streamer.begin_token(0 if decode else n)
        self._predictions.clear()
        g = self.graph
        ctx = g.reset()
        x = ops.ggml_get_rows(ctx, self.weights.get("token_embd.weight"), g.input(np.array(tokens, np.int32)))
        g.compute(x)
        h = to_numpy(x).reshape(n, hp.n_embd)
        sel_rows, pred_rows = [], []
        for il in range(hp.n_layer):
            h, sel, preds = self._layer(il, h, decode)
            if self.trace is not None and sel is not None:
                sel_rows.append(sel)
                pred_rows.append(preds)
        if self.trace is not None and sel_rows:
            self.trace.append((np.stack(sel_rows, axis=1), np.stack(pred_rows, axis=1), 0 if decode else n))
        self.pos += n
        ctx = g.reset()
        xin = g.input(h if all_logits else h[-1:])
        out = common.rms_norm(ctx, xin, self.weights.get("output_norm.weight"), hp.rms_eps)
        name = "output.weight" if self.weights.has("output.weight") else "token_embd.weight"
        logits = ops.ggml_mul_mat(ctx, self.weights.get(name), out)
        g.compute(logits)
        return to_numpy(logits).reshape(-1, hp.vocab_size)

    def _w(self, il: int) -> dict[str, Tensor]:
        prefix = f"blk.{il}."
        return {
            k[len(prefix) :].removesuffix(".weight"): t for k, t in self.weights.tensors.items() if k.startswith(prefix)
        }

    def _layer(self, il: int, h: np.ndarray, decode: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        hp, fam, g = self.hp, self.family, self.graph
        n = h.shape[0]
        w = self._w(il)
        ctx = g.reset()
        x = g.input(h)
        cur = common.rms_norm(ctx, x, w["attn_norm"], hp.rms_eps)
        positions = g.input(np.arange(self.pos, self.pos + n, dtype=np.int32))
        mask = g.input(common.causal_mask(self.pos, n))
        attn, writes = common.attention(g, hp, fam.attention, w, cur, positions, self.kv[il], self.pos, n, mask)
        ffn_inp = ops.ggml_add(ctx, attn, x)
        cur = common.rms_norm(ctx, ffn_inp, w["ffn_norm"], hp.rms_eps)
        if "ffn_gate_exps" not in w and il not in self.views:  # a dense layer
            out = ops.ggml_add(ctx, common.swiglu_ffn(ctx, w["ffn_gate"], w["ffn_up"], w["ffn_down"], cur), ffn_inp)
            g.compute(*writes, out)
            return to_numpy(out).reshape(n, hp.n_embd), None, np.zeros((n, 0, 0), np.int32)
        outputs: list[Tensor] = [ffn_inp, cur]
        shared = None
        if "ffn_gate_shexp" in w:
            shared = common.swiglu_ffn(ctx, w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"], cur)
            if fam.shared_gate:
                gate = ops.ggml_sigmoid(ctx, ops.ggml_mul_mat(ctx, w["ffn_gate_inp_shexp"], cur))
                shared = ops.ggml_mul(ctx, shared, gate)
            outputs.append(shared)
        probs = ops.ggml_soft_max(ctx, ops.ggml_mul_mat(ctx, w["ffn_gate_inp"], cur))
        outputs.append(probs)
        la = self._lookahead.get(il) if decode else None
        if la is not None:
            pred_in = ffn_inp if shared is None else ops.ggml_add(ctx, ffn_inp, shared)
            nxt = la[1][0]
            pred_in = common.rms_norm(ctx, pred_in, self.weights.get(f"blk.{nxt}.ffn_norm.weight"), hp.rms_eps)
            outputs.append(ops.ggml_mul_mat(ctx, la[0], pred_in))
        g.compute(*writes, *outputs)
        ffn_np = to_numpy(ffn_inp).reshape(n, hp.n_embd)
        cur_np = to_numpy(cur).reshape(n, hp.n_embd)
        shared_np = to_numpy(shared).reshape(n, hp.n_embd) if shared is not None else None
        probs_np = to_numpy(probs).reshape(n, hp.n_expert)
        sel, weights = common.select_experts(probs_np, hp.n_expert_used, fam.normalize_weights)
        self._score_predictions(il, sel)
        preds = np.full((n, max(self.options.lookahead, 0), hp.n_expert_used), -1, np.int32)
        if la is not None:
            logits = to_numpy(outputs[-1]).reshape(n, -1)
            for d, target in enumerate(la[1]):
                part = logits[:, d * hp.n_expert : (d + 1) * hp.n_expert]
                top = np.argsort(-part[-1], kind="stable")[: hp.n_expert_used].tolist()
                self._predictions[(target, d)] = top
        ahead = [(t, self._predictions[(t, d)], d + 1) for d, t in enumerate(la[1])] if la is not None else []
        moe = self._experts(il, cur_np, sel, weights, ahead)
        out = moe + ffn_np if shared_np is None else (moe + shared_np) + ffn_np
        for d in range(preds.shape[1]):
            got = self._predictions.get((il, d))
            if got is not None:
                preds[-1, d] = got
        return out.astype(np.float32), sel, preds

    def _score_predictions(self, il: int, sel: np.ndarray) -> None:
        chosen = set(sel[-1].tolist())
        for d in range(self.options.lookahead):
            pred = self._predictions.get((il, d))
            if pred is not None:
                self.recall_hits[d] += len(chosen & set(pred))
                self.recall_total[d] += len(chosen)

    def _experts(
        self, il: int, cur: np.ndarray, sel: np.ndarray, weights: np.ndarray, ahead: list[tuple[int, list[int], int]]
    ) -> np.ndarray:
        """Σ over waves of experts that fit the slots: each expert is read at most once per call.

        The lookahead's predictions go to the core right after this layer's demand reads.
        """
        hp = self.hp
        unique: list[int] = list(dict.fromkeys(sel.ravel().tolist()))
        waves = [unique[i : i + self.slots_per_layer] for i in range(0, len(unique), self.slots_per_layer)]
        k = sel.shape[1]
        weighted = np.zeros((cur.shape[0], k, hp.n_embd), np.float32)
        for wave in waves:
            self.streamer.begin_layer(il, wave)
            for target, top, distance in ahead:
                self.streamer.predict(target, top, distance)
            ahead = []
            # Experts already in RAM are computed while the others are still being read.
            ready = self.streamer.ready(il, wave)
            first = [e for e, r in zip(wave, ready, strict=True) if r]
            rest = [e for e, r in zip(wave, ready, strict=True) if not r]
            for part in (first, rest) if first and rest else (wave,):
                self._compute_experts(il, cur, sel, weights, part, weighted)
            self.streamer.end_layer(il)
        return common.sum_experts(weighted)

    def recorded_trace(self) -> Any:
        """The routing recorded since `self.trace = []` (last token of each batch), as a trace file object."""
        from tokenwing.streaming.trace import Trace

        rows = self.trace or []
        k = self.hp.n_expert_used
        d = max(self.options.lookahead, 0)
        n_layers = len(self.streamed)
        sel = np.full((len(rows), n_layers, k), -1, np.int32)
        pred = np.full((len(rows), n_layers, d, k), -1, np.int32)
        prompt = np.zeros(len(rows), np.int64)
        for i, (s_rows, p_rows, n) in enumerate(rows):
            sel[i] = s_rows[-1][-n_layers:]
            if d:
                pred[i] = p_rows[-1][-n_layers:]
            prompt[i] = n
        return Trace(sel, pred, prompt, np.array(self.streamed, np.int32), self.hp.n_expert)

    def _compute_experts(
        self, il: int, cur: np.ndarray, sel: np.ndarray, weights: np.ndarray, part: list[int], weighted: np.ndarray
    ) -> None:
        """Weighted outputs of the (token, expert) pairs whose expert is in `part`, into `weighted`."""
        hp, g = self.hp, self.graph
        slot_of = np.zeros(hp.n_expert, np.int32)
        slot_of[part] = self.streamer.wait_all(il, part)
        in_part = np.isin(sel, part)
        # experts outside this part take slot 0 with weight 0 (their share is computed with their own part)
        slots = np.where(in_part, slot_of[sel], 0).astype(np.int32)
        wts = np.where(in_part, weights, 0.0).astype(np.float32)
        g.reset()
        moe = common.routed_experts(g, self.views[il], g.input(cur), slots, wts, hp.n_embd)
        g.compute(moe)
        out = to_numpy(moe).reshape(cur.shape[0], sel.shape[1], hp.n_embd)
        weighted[in_part] = out[in_part]

    # ------------------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        c = self.streamer.counters()
        per_layer = {name: c[:, i].tolist() for i, name in enumerate(COUNTERS)}
        recall = [float(h / t) if t else None for h, t in zip(self.recall_hits, self.recall_total, strict=True)]
        return {
            "per_layer": per_layer,
            "prediction_recall": recall,
            "slots_per_layer": self.slots_per_layer,
            "expert_cache_bytes": self.slots_per_layer * sum(el.record_size for el in self.mf.index.layers),
            "resident_weight_bytes": self.weights.bytes,
        }

    def describe(self) -> str:
        hp = self.hp
        cache = self.slots_per_layer * sum(el.record_size for el in self.mf.index.layers)
        return (
            f"{hp.arch}: {hp.n_layer} layers, {hp.n_expert} experts (top-{hp.n_expert_used}); expert cache "
            f"{self.slots_per_layer}/{hp.n_expert} per layer ({human_bytes(cache)}), context {self.n_ctx}"
        )
