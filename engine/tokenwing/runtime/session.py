"""A loaded model and its state: the forward pass over the layers with expert streaming and router lookahead.

Per layer: one graph for attention, the shared expert, the router with its top-k, and the fused lookahead
routers of the next streamed layers; the selected experts go to the streaming core (demand reads), the
lookahead's top-k go to it as predictions; then one graph per wave of experts that fit the slots, reading the
experts straight from the slot pool. With every expert in RAM a decode step is one graph (token_graph.py).
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
from tokenwing.format.layout import K_HEADER_CHECKSUM
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import human_bytes
from tokenwing.models import common
from tokenwing.models.hparams import HParams, read_hparams
from tokenwing.models.qwen3moe import Family, check_tensors, family, routing
from tokenwing.models.weights import ModelWeights
from tokenwing.runtime.token_graph import TokenGraph
from tokenwing.streaming.memory import HEADROOM, expert_budget, memory_info
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS, ExpertStreamer, plan_slots
from tokenwing.streaming.usage import UsageTable, load_usage, save_usage, usage_path
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.tokenizer import TextTokenizer, tokenizer_from_metadata

RECENCY_HALF_LIFE = 128  # tokens: how fast a prompt's early expert uses fade when ordering its waves
READ_AHEAD_TOKENS = 4096  # from this prompt length, the next layers' most used experts are read ahead
READ_AHEAD_LAYERS = 2


@dataclass
class SessionOptions:
    ram_budget: int | None = None  # bytes for the expert cache; None: from free RAM and the memory limit
    lookahead: int = 2  # router lookahead distance (0: off)
    n_ctx: int = 0  # 0: the model's context length, capped by memory
    kv_type: str = "f16"
    n_threads: int = 0  # 0: the cores this process may use
    max_batch: int = 64  # prompt tokens per graph (longer prompts are split, never refused)
    prompt_memory: int | None = None  # free memory a prompt pass may take beyond the cache (None: measured)
    prompt_cache: bool = True  # the server keeps the previous request's KV cache for a shared prefix
    usage_table: bool = True  # seed idle fill from MODEL.usage.json and add this session's counts to it
    preload: bool | None = None  # read every expert at start (None: when the cache holds them all)
    cpu_repack: bool = True  # matrix weights and experts in ggml's repacked layouts, as llama.cpp runs them
    token_graph: bool = True  # with every expert in RAM, a decode step is one graph (runtime/token_graph.py)
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
        if any(layer >= hp.n_layer + hp.n_mtp for layer in streamed):
            raise BadInputError(f"{path}: experts of a layer beyond block_count")
        # (multi-token-prediction blocks come last: their experts stay in the file, never read)
        check_tensors(self.family, hp, shapes, {k: v for k, v in streamed.items() if k < hp.n_layer}, path)
        self.routing = routing(self.family, hp)
        self.weights = ModelWeights(self.mf, repack=opts.cpu_repack)
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
        self._kv_per_token, self._graph_mem = kv_per_token, graph_mem
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
        preload = opts.preload if opts.preload is not None else self.slots_per_layer >= hp.n_expert
        # Experts are repacked only when they are all read at start: repacking each streamed expert as it lands
        # costs ~0.9 ms of CPU per expert, which took 40 % of capped decode speed on a 2-core machine
        # (docs/results.md). (The debug mode that checksums delivered experts needs them as in the file.)
        repack_experts = opts.cpu_repack and preload and not opts.stream.verify
        self.views = self.weights.expert_views(self.streamer, repack=repack_experts)
        self.streamed = [el.layer for el in self.mf.index.layers if el.layer < hp.n_layer]
        self._layer_weights: list[dict[str, Tensor]] = [{} for _ in range(hp.n_layer)]
        for name, t in self.weights.tensors.items():
            parts = name.split(".", 2)
            if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < hp.n_layer:
                self._layer_weights[int(parts[1])][parts[2].removesuffix(".weight")] = t
        self.usage = UsageTable(self.streamed, hp.n_expert, int(self.mf.header.get(K_HEADER_CHECKSUM) or 0))
        self._preloaded = preload
        self._usage_seed: UsageTable | None = None  # the usage table read at start
        self._slot_map: dict[int, np.ndarray] | None = None  # every expert's slot, while all are resident
        self._token_graph: TokenGraph | None = None
        self._token_graph_on = opts.token_graph
        if preload:
            self._preload()
        elif opts.usage_table:
            self._seed_idle_fill()
        self._lookahead = self._fused_routers(opts.lookahead)
        self._biases: dict[int, np.ndarray] = {}  # selection biases of biased routers, for the lookahead
        n_threads = opts.n_threads or len(os.sched_getaffinity(0))
        self.graph = Graph(graph_mem, n_threads)
        self.pos = 0
        self._kv_high = 0  # KV positions ever written (their memory is touched, hence charged)
        self.history: list[int] = []  # the tokens whose keys and values are in the cache, positions 0..pos-1
        self._predictions: dict[tuple[int, int], list[int]] = {}
        self.recall_hits = np.zeros(max(opts.lookahead, 1), np.int64)
        self.recall_total = np.zeros(max(opts.lookahead, 1), np.int64)
        self.trace: list[tuple[np.ndarray, np.ndarray, int]] | None = None
        self._loaned = 0
        self._warned_prompt = False
        self._prompt_reserve = self._prompt_bytes(opts.max_batch)  # covered by the graph reserve

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
                # F16: predictions only rank experts (they never change which are used), and in RAM these
                # routers are read every token (F32: ~4 % of a decode token on the bench model)
                fused = self.weights.stacked([f"blk.{t}.ffn_gate_inp.weight" for t in targets], half=True)
                out[il] = (fused, targets)
        return out

    def _seed_idle_fill(self) -> None:
        """Empty slots fill with the most used experts (usage table) once the engine is idle."""
        table = load_usage(
            usage_path(self.mf.path), self.streamed, self.hp.n_expert, self.usage.model_checksum, self.log
        )
        if table is None:
            return
        self._usage_seed = table
        for row in range(len(self.streamed)):
            self.streamer.core.set_usage(row, table.ranked(row))

    def _preload(self) -> None:
        """Reads every expert that fits into the cache now, as llama.cpp loads its weights before the first
        token: a model that fits in RAM then runs at memory speed from the first token, not after warming."""
        n = min(self.slots_per_layer, self.hp.n_expert)
        slot_map = {}
        for il in self.streamed:
            experts = list(range(n))
            self.streamer.begin_layer(il, experts)
            slot_map[il] = np.array(self.streamer.wait_all(il, experts), np.int32)
            self.streamer.end_layer(il)
        self.streamer.token_delta()  # per-token statistics start after the load
        # Nothing evicts a cache that holds every expert, except slots lent to a long prompt (`_lend_for_prompt`)
        self._slot_map = slot_map if n == self.hp.n_expert else None
        self._drop_token_graph()

    def save_usage(self) -> None:
        """Adds this session's expert counts to the usage table next to the model (the server: after each request)."""
        if not self.options.usage_table or self.usage.tokens == 0:
            return
        path = usage_path(self.mf.path)
        u = self.usage
        merged = u.merge_into(load_usage(path, self.streamed, self.hp.n_expert, u.model_checksum, lambda line: None))
        try:
            save_usage(path, merged)
        except OSError as e:
            self.log(f"the usage table was not saved ({path}: {e.strerror or e})")
        self.usage = UsageTable(self.streamed, self.hp.n_expert, u.model_checksum)  # saved: start over

    def close(self) -> None:
        self.save_usage()
        self._drop_token_graph()
        self.streamer.close()
        self.graph.close()
        self.mf.close()

    def reset(self) -> None:
        self.pos = 0
        self.history = []

    def reuse_prefix(self, tokens: list[int]) -> int:
        """Prompt caching: keeps the cached tokens this prompt starts with and forgets the rest. Returns how many
        are kept (at most all but the last token, which must run to give logits); evaluate `tokens[kept:]`.

        A chat's next turn repeats the whole conversation: only the new part is computed. The cache holds
        exactly what a fresh pass would have put there (attention reads positions < pos only).
        """
        limit = min(len(tokens) - 1, len(self.history))
        kept = 0
        while kept < limit and self.history[kept] == tokens[kept]:
            kept += 1
        self.pos = kept
        del self.history[kept:]
        return kept

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Runs `tokens` from the current position; returns logits of the last token (or of every token).

        Layer-major: the whole prompt passes one layer before the next, so each layer's experts are read at
        most once per prompt (in waves that fit the slots); attention and expert graphs run in chunks of
        `max_batch` tokens, so a long prompt is split, never refused.
        """
        hp, n = self.hp, len(tokens)
        if not tokens:
            raise BadInputError("nothing to evaluate")
        if any(not 0 <= t < hp.vocab_size for t in tokens):
            raise BadInputError("token id outside the vocabulary")
        if self.pos + n > self.n_ctx:
            raise BadInputError(f"the context is full ({self.n_ctx} tokens)")
        # (a pass no longer than one batch always fits its reserve: decode never reads /proc for this)
        span = self._prompt_span() if n > self.options.max_batch else n
        if n > span:
            # The whole prompt's working memory would not fit even with the cache's slots on loan: run it as
            # several layer-major passes (experts may then be read once per pass). Slower, never refused.
            if not self._warned_prompt:
                self._warned_prompt = True
                self.log(f"a {n}-token prompt does not fit in memory in one pass: running it {span} tokens at a time")
            outs = [self.forward(tokens[i : i + span], all_logits) for i in range(0, n, span)]
            return np.concatenate(outs, axis=0) if all_logits else outs[-1]
        decode = n == 1
        if decode and self._loaned:
            self.streamer.core.unloan()  # the prompt's working memory is gone: the cache takes its slots back
            self._loaned = 0
            if self._preloaded:
                self._preload()  # read back the experts the loan evicted
        if not decode:
            self._lend_for_prompt(n)
        self.streamer.begin_token(0 if decode else n)
        logits = self._token_step(tokens[0]) if decode and self._slot_map is not None else None
        if logits is not None:
            self._advance(tokens)
            return logits.reshape(1, -1) if all_logits else logits
        self._predictions.clear()
        h = np.concatenate([self._embed(tokens[c]) for c in self._chunks(n)], axis=0)
        sel_rows, pred_rows = [], []
        ahead_of: dict[str, np.ndarray] | None = None  # layer il's attention results, from the step before
        for il in range(hp.n_layer):
            out, sel, preds, ahead_of = self._layer(il, h, decode, ahead_of)
            h = out if out is not None else h  # (None: fused into the next layer's graph)
            if self.trace is not None and sel is not None:
                sel_rows.append(sel)
                pred_rows.append(preds)
        if self.trace is not None and sel_rows:
            self.trace.append((np.stack(sel_rows, axis=1), np.stack(pred_rows, axis=1), 0 if decode else n))
        self._advance(tokens)
        if not all_logits:
            last: np.ndarray = self._logits(h[-1:])[-1]
            return last
        return np.concatenate([self._logits(h[c]) for c in self._chunks(n)], axis=0)

    def _advance(self, tokens: list[int]) -> None:
        self.pos += len(tokens)
        self._kv_high = max(self._kv_high, self.pos)
        self.history.extend(tokens)
        self.usage.tokens += len(tokens)

    def _token_step(self, token: int) -> np.ndarray | None:
        """A decode step as one graph (every expert resident: nothing to stream or predict); None when that
        graph is off or could not be built (the per-layer path runs instead). The core still sees each layer's
        experts, so hit counts, usage and traces are as in the per-layer path."""
        if not self._token_graph_on:
            return None
        window = common.decode_window(self.pos, self.n_ctx)
        tg = self._token_graph
        if tg is None or tg.window != window:
            self._drop_token_graph()
            try:
                tg = self._token_graph = self._build_token_graph(window)
            except MemoryError as e:
                self._token_graph_on = False
                self.log(f"decode runs one graph per layer: the one-graph step did not fit in memory ({e})")
                return None
        logits, routed = tg.run(token, self.pos)
        k, d = self.hp.n_expert_used, max(self.options.lookahead, 0)
        sel_rows = []
        for il, experts in routed:
            self.streamer.begin_layer(il, experts.tolist())
            self.streamer.end_layer(il)
            sel = experts.reshape(1, k)
            self.usage.add(self.streamer.li(il), sel)
            sel_rows.append(sel)
        if self.trace is not None and sel_rows:
            no_predictions = np.full((1, len(sel_rows), d, k), -1, np.int32)
            self.trace.append((np.stack(sel_rows, axis=1), no_predictions, 0))
        return logits

    def _build_token_graph(self, window: int) -> TokenGraph:
        assert self._slot_map is not None
        experts = {il: (self.views[il], self._slot_map[il]) for il in self.streamed}
        return TokenGraph(
            self.hp,
            window,
            self.n_ctx,
            self.weights.get("token_embd.weight"),
            lambda ctx, il, x, at: self._attention_graph(ctx, il, x, at, lookahead=False),
            self._head,
            experts,
            self.graph,
        )

    def _drop_token_graph(self) -> None:
        if self._token_graph is not None:
            self._token_graph.close()
            self._token_graph = None

    def _prompt_bytes(self, n: int) -> int:
        """Working memory of a prompt pass beyond the graph context, per token: the hidden state (which becomes
        the attention output plus residual), the FFN input, the running sum of the experts' outputs, the shared
        expert's output, router probabilities and their top-k sort, and a wave's (token, expert) index arrays."""
        hp = self.hp
        shared = any("ffn_gate_shexp" in w for w in self._layer_weights)
        floats = (4 if shared else 3) * hp.n_embd + 3 * hp.n_expert + 2 * hp.n_expert_used
        per_token = 4 * floats + 64 * hp.n_expert_used
        return n * per_token * 5 // 4  # + a quarter for numpy's temporaries

    def _free_room(self) -> int:
        """Memory a prompt pass can take without the cache's slots: free RAM under the limit, less the part
        of the expert cache not filled yet (it will be, as the prompt reads experts)."""
        if self.options.prompt_memory is not None:
            return self.options.prompt_memory
        capacity = self.slots_per_layer * sum(el.record_size for el in self.mf.index.layers)
        filled = min(capacity, int(self.streamer.counters()[:, COUNTERS.index("bytes_read")].sum()))
        # Memory already promised but not yet touched is not charged yet: the KV cache past the positions
        # written so far and (conservatively, all of) the graph context. Without this, a long first prompt
        # under a cap was OOM-killed (measured: 4,096 tokens at 25 %).
        promised = self._kv_per_token * (self.n_ctx - self._kv_high) + self._graph_mem
        return max(0, expert_budget(memory_info(), HEADROOM, promised) - (capacity - filled - self._loaned))

    def _prompt_span(self) -> int:
        """The longest prompt pass whose working memory fits: free memory plus what the cache can lend."""
        lendable = (self.slots_per_layer - self.hp.n_expert_used) * sum(el.record_size for el in self.mf.index.layers)
        room = self._free_room() + self._prompt_reserve + lendable - self._loaned
        return max(self.options.max_batch, room // self._prompt_bytes(1))

    def _lend_for_prompt(self, n: int) -> None:
        """A prompt's working memory counts against the memory limit: when free memory is short, the expert
        cache gives back slots for it (empty ones first, then the coldest) and takes them back at the first
        decode token."""
        need = self._prompt_bytes(n) - self._prompt_reserve - self._free_room()
        if need > self._loaned:
            self._loaned += int(self.streamer.core.loan(need - self._loaned, self.hp.n_expert_used))
            self._slot_map = None  # the loan may have evicted experts: per-layer decode until they are back

    def _chunks(self, n: int) -> list[slice]:
        b = self.options.max_batch
        return [slice(i, min(i + b, n)) for i in range(0, n, b)]

    def _embed(self, tokens: list[int]) -> np.ndarray:
        g = self.graph
        ctx = g.reset()
        x = ops.ggml_get_rows(ctx, self.weights.get("token_embd.weight"), g.input(np.array(tokens, np.int32)))
        g.compute(x)
        return to_numpy(x).reshape(len(tokens), self.hp.n_embd)

    def _logits(self, h: np.ndarray) -> np.ndarray:
        g = self.graph
        ctx = g.reset()
        logits = self._head(ctx, g.input(h))
        g.compute(logits)
        return to_numpy(logits).reshape(-1, self.hp.vocab_size)

    def _head(self, ctx: Any, x: Tensor) -> Tensor:
        out = common.rms_norm(ctx, x, self.weights.get("output_norm.weight"), self.hp.rms_eps)
        name = "output.weight" if self.weights.has("output.weight") else "token_embd.weight"
        return ops.ggml_mul_mat(ctx, self.weights.get(name), out)

    def _attention_part(self, il: int, h: np.ndarray, pos0: int, decode: bool) -> dict[str, np.ndarray]:
        """One chunk through attention (writing its K and V at pos0), the FFN norm, a dense FFN or the shared
        expert, the router and its top-k and, in decode, the lookahead routers. Returns the numpy results by
        name."""
        g, n = self.graph, h.shape[0]
        g.reset()
        out, writes = self._attention_graph(g.ctx, il, g.input(h), self._placement(pos0, n, decode), decode)
        g.compute(*writes, *out.values())
        return {k: to_numpy(t).reshape(n, -1) for k, t in out.items()}

    def _placement(self, pos0: int, n: int, decode: bool) -> common.Placement:
        n_kv = common.decode_window(pos0, self.n_ctx) if decode else pos0 + n
        return common.placement(self.graph, pos0, n, n_kv, self.n_ctx, self.hp.head_dim * self.hp.n_head_kv)

    def _attention_graph(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, lookahead: bool
    ) -> tuple[dict[str, Tensor], list[Tensor]]:
        """`_attention_part`'s graph on the hidden state x (an input, or the previous layer's output when a
        decode step computes a layer's experts and the next layer's attention in one graph)."""
        hp, fam = self.hp, self.family
        w = self._layer_weights[il]
        cur = common.rms_norm(ctx, x, w["attn_norm"], hp.rms_eps)
        attn, writes = common.attention(ctx, hp, fam.attention, w, cur, at, self.kv[il])
        ffn_inp = ops.ggml_add(ctx, attn, x)
        cur = common.rms_norm(ctx, ffn_inp, w[fam.ffn_norm], hp.rms_eps)
        out: dict[str, Tensor] = {}
        if il not in self.views:  # a dense layer
            ffn = common.swiglu_ffn(ctx, w["ffn_gate"], w["ffn_up"], w["ffn_down"], cur)
            out["dense"] = ops.ggml_add(ctx, ffn, ffn_inp)
        else:
            out["ffn_inp"], out["cur"] = ffn_inp, cur
            if "ffn_gate_shexp" in w:
                shared = common.swiglu_ffn(ctx, w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"], cur)
                if fam.shared_gate:
                    gate = ops.ggml_sigmoid(ctx, ops.ggml_mul_mat(ctx, w["ffn_gate_inp_shexp"], cur))
                    shared = ops.ggml_mul(ctx, shared, gate)
                out["shared"] = shared
            logits = ops.ggml_mul_mat(ctx, w["ffn_gate_inp"], cur)
            rt = self.routing
            bias = w["exp_probs_b.bias"] if rt.bias else None
            out["ids"], out["weights"] = common.route(
                ctx, logits, hp.n_expert_used, rt.normalize, rt.sigmoid, bias, rt.scale
            )
            la = self._lookahead.get(il) if lookahead else None
            if la is not None:
                pred_in = ffn_inp if "shared" not in out else ops.ggml_add(ctx, ffn_inp, out["shared"])
                norm = self.weights.get(f"blk.{la[1][0]}.{fam.ffn_norm}.weight")
                out["ahead"] = ops.ggml_mul_mat(ctx, la[0], common.rms_norm(ctx, pred_in, norm, hp.rms_eps))
        return out, writes

    def _layer(
        self, il: int, h: np.ndarray, decode: bool, ahead_of: dict[str, np.ndarray] | None
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray, dict[str, np.ndarray] | None]:
        """One layer. Returns its output (None when a decode step fused it into the next layer's graph), the
        selected experts, the predictions, and the next layer's attention results when fused."""
        hp, n = self.hp, h.shape[0]
        if not decode and n >= READ_AHEAD_TOKENS:
            self._read_ahead(il)
        r = ahead_of if ahead_of is not None else self._attention_parts(il, h, decode)
        if "dense" in r:
            return r["dense"], None, np.zeros((n, 0, 0), np.int32), None
        sel, weights = r.pop("ids"), r.pop("weights")
        self.usage.add(self.streamer.li(il), sel)
        self._score_predictions(il, sel)
        preds = np.full((n, max(self.options.lookahead, 0), hp.n_expert_used), -1, np.int32)
        ahead: list[tuple[int, list[int], int]] = []
        la = self._lookahead.get(il) if decode else None
        if la is not None:
            for d, target in enumerate(la[1]):
                part = self._selection_scores(target, r["ahead"][-1, d * hp.n_expert : (d + 1) * hp.n_expert])
                top = np.argsort(-part, kind="stable")[: hp.n_expert_used].tolist()
                self._predictions[(target, d)] = top
                ahead.append((target, top, d + 1))
        if decode:
            out, fused = self._decode_experts(il, r, sel, weights, ahead)
        else:
            out, fused = self._prompt_experts(il, r.pop("cur"), sel, weights), None
        if out is not None:  # a new array: add in place
            if "shared" in r:
                out += r["shared"]
            out += r["ffn_inp"]  # (moe + shared) + ffn_inp, as llama.cpp's graph adds them
        for d in range(preds.shape[1]):
            got = self._predictions.get((il, d))
            if got is not None:
                preds[-1, d] = got
        return out, sel, preds, fused

    def _decode_experts(
        self,
        il: int,
        r: dict[str, np.ndarray],
        sel: np.ndarray,
        weights: np.ndarray,
        ahead: list[tuple[int, list[int], int]],
    ) -> tuple[np.ndarray | None, dict[str, np.ndarray] | None]:
        """One token's experts: handed to the core (demand reads), then the lookahead's predictions.

        All in RAM: the experts, their sum, the residual and the next layer's attention part in one graph (one
        graph per layer instead of two, no round trip through numpy; the same ggml additions in the same order,
        so bit-identical, tested) — returns (None, the next layer's attention results). Otherwise the resident
        experts are computed while the others are read — returns (the experts' sum, None).
        """
        wave = list(dict.fromkeys(sel[0].tolist()))  # k ≤ the usable slots: a loan keeps k per layer
        self.streamer.begin_layer(il, wave)
        for target, top, distance in ahead:
            self.streamer.predict(target, top, distance)
        ready = self.streamer.ready(il, wave)
        if all(ready) and il + 1 < self.hp.n_layer:
            fused = self._fused_step(il, r, sel, weights, wave)
            self.streamer.end_layer(il)
            return None, fused
        weighted = np.zeros((1, sel.shape[1], self.hp.n_embd), np.float32)
        first = [e for e, ok in zip(wave, ready, strict=True) if ok]
        rest = [e for e, ok in zip(wave, ready, strict=True) if not ok]
        for part in (first, rest) if first and rest else (wave,):
            self._compute_experts(il, r["cur"], sel, weights, part, weighted)
        self.streamer.end_layer(il)
        return common.sum_experts(weighted), None

    def _fused_step(
        self, il: int, r: dict[str, np.ndarray], sel: np.ndarray, weights: np.ndarray, wave: list[int]
    ) -> dict[str, np.ndarray]:
        hp, g = self.hp, self.graph
        slot_of = np.zeros(hp.n_expert, np.int32)
        slot_of[wave] = self.streamer.wait_all(il, wave)
        ctx = g.reset()
        slots = g.input(slot_of[sel[0]].reshape(1, -1))  # I32 [k, 1]
        total = common.token_experts(ctx, self.views[il], g.input(r["cur"][0]), slots, g.input(weights[0]))
        if "shared" in r:
            total = ops.ggml_add(ctx, total, g.input(r["shared"]))
        x = ops.ggml_add(ctx, total, g.input(r["ffn_inp"]))
        out, writes = self._attention_graph(ctx, il + 1, x, self._placement(self.pos, 1, True), True)
        g.compute(*writes, *out.values())
        return {name: to_numpy(t).reshape(1, -1) for name, t in out.items()}

    def _attention_parts(self, il: int, h: np.ndarray, decode: bool) -> dict[str, np.ndarray]:
        """The layer's attention part over `h` in chunks. A prompt's working memory is what a layer keeps per
        token (`_prompt_bytes`): the attention output plus residual replaces `h` in place, chunk by chunk
        (each chunk reads only its own rows), and the other results go straight into arrays of the prompt's
        length, not into per-chunk lists that are then joined."""
        n = h.shape[0]
        r: dict[str, np.ndarray] = {}
        for c in self._chunks(n):
            for key, v in self._attention_part(il, h[c], self.pos + c.start, decode).items():
                if key not in r:
                    r[key] = h if key in ("ffn_inp", "dense") else np.empty((n, v.shape[1]), v.dtype)
                r[key][c] = v
        return r

    def _selection_scores(self, block: int, logits: np.ndarray) -> np.ndarray:
        """What the router of `block` ranks experts by, from its logits: the logits themselves for softmax
        (same order); sigmoid + the selection bias for biased sigmoid routers (the bias can change the order)."""
        if not self.routing.bias:
            return logits
        bias = self._biases.get(block)
        if bias is None:
            bias = self._biases[block] = to_numpy(self.weights.get(f"blk.{block}.exp_probs_b.bias")).reshape(-1)
        if self.routing.sigmoid:
            probs = 1.0 / (1.0 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
        scores: np.ndarray = probs + bias
        return scores

    def _score_predictions(self, il: int, sel: np.ndarray) -> None:
        chosen = set(sel[-1].tolist())
        for d in range(self.options.lookahead):
            pred = self._predictions.get((il, d))
            if pred is not None:
                self.recall_hits[d] += len(chosen & set(pred))
                self.recall_total[d] += len(chosen)

    def _prompt_experts(self, il: int, cur: np.ndarray, sel: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """A prompt's experts in waves, in recency order, summed as they come.

        Waves go from the experts the prompt used least recently to those its end used most (uses weighted by
        a 128-token half-life), so the last wave, which stays in the cache, holds what the first reply tokens
        are likely to need. Each token adds its experts' outputs in that same order whatever the number of
        waves, so the result does not depend on the budget, and the working memory is one running sum per
        token (not every token's k outputs). llama.cpp adds in rank order: the difference is rounding.
        """
        hp = self.hp
        n = sel.shape[0]
        recency = 0.5 ** ((n - 1 - np.arange(n)) / RECENCY_HALF_LIFE)
        score = np.zeros(hp.n_expert)
        np.add.at(score, sel, np.broadcast_to(recency[:, None], sel.shape))
        used = np.unique(sel)
        unique = used[np.lexsort((used, score[used]))].tolist()  # least recent first; ties by id
        place = np.zeros(hp.n_expert, np.int64)
        place[unique] = np.arange(len(unique))
        size = self.streamer.core.usable_slots(self.streamer.li(il)) if self._loaned else self.slots_per_layer
        acc = np.zeros((n, hp.n_embd), np.float32)
        rest = unique
        while rest:
            wave, keep = self._next_wave(il, rest, size)
            rest = rest[len(wave) :]
            self.streamer.begin_layer(il, wave, keep)
            slot_of = np.zeros(hp.n_expert, np.int32)
            slot_of[wave] = self.streamer.wait_all(il, wave)
            tok, j = np.nonzero(np.isin(sel, wave))
            order = np.lexsort((tok, place[sel[tok, j]]))  # by expert in wave order, then by token
            tok, j = tok[order], j[order]
            for group in self._expert_groups(sel[tok, j]):
                t, jj = tok[group], j[group]
                out = self._expert_matmuls(il, cur, t, slot_of[sel[t, jj]], weights[t, jj])
                # each token adds its outputs in wave order: one row per token per level
                by_token = np.lexsort((place[sel[t, jj]], t))
                t, out = t[by_token], out[by_token]
                occurrence = np.arange(len(t)) - np.searchsorted(t, t)
                for level in range(int(occurrence.max()) + 1 if len(t) else 0):
                    m = occurrence == level
                    acc[t[m]] += out[m]
            self.streamer.end_layer(il)
        return acc

    def _next_wave(self, il: int, rest: list[int], size: int) -> tuple[list[int], list[int]]:
        """The next wave: the longest run of `rest` (still to compute, in order) whose experts fit in `size`
        slots beside those of later waves already in RAM or on their way (read ahead, or left by an earlier
        pass), which stay where they are (`keep`) instead of being evicted and read again. Waves are runs of one
        order whatever their sizes, so results do not depend on them."""
        if len(rest) <= size:
            return rest, []
        held = self.streamer.holding(il, rest)
        room = max(1, size - sum(held))  # slots not holding an expert still to compute (at least one)
        end = new = 0
        while end < min(len(rest), size) and (held[end] or new < room):
            new += not held[end]
            end += 1
        keep = [e for e, h in zip(rest[end:], held[end:], strict=True) if h]
        return rest[:end], keep[: size - end]  # (none dropped unless every slot held a later expert)

    def _read_ahead(self, il: int) -> None:
        """Read-ahead window (prompts from READ_AHEAD_TOKENS): while layer il computes, the most used experts of
        the next streamed layers are read, half of each one's slots (the rest leaves room for its waves): at
        that length nearly all of them are needed. Predictions to the core: read when no demand read waits."""
        for distance, target in enumerate([b for b in self.streamed if b > il][:READ_AHEAD_LAYERS], 1):
            row = self.streamer.li(target)
            counts = self.usage.counts[row] + (self._usage_seed.counts[row] if self._usage_seed is not None else 0)
            ranked = np.lexsort((np.arange(self.hp.n_expert), -counts))  # most used first; ties: lower id
            n = self.streamer.core.usable_slots(row) // 2
            self.streamer.predict(target, ranked[:n].tolist(), distance)

    def _expert_groups(self, experts: np.ndarray) -> list[slice]:
        """Pairs sorted by expert → slices of whole experts (an expert's rows split into fixed blocks when it
        has more than a graph holds), at most `max_batch · k` rows each. The blocks of an expert depend only on
        its own rows, so ggml's batched kernels see the same columns whatever the waves: results do not
        depend on the budget."""
        limit = self.options.max_batch * self.hp.n_expert_used
        bounds = np.flatnonzero(np.diff(experts)) + 1
        units: list[tuple[int, int]] = []
        for lo, hi in zip(np.r_[0, bounds].tolist(), np.r_[bounds, len(experts)].tolist(), strict=True):
            units += [(b, min(b + limit, hi)) for b in range(lo, hi, limit)]
        groups: list[slice] = []
        for lo, hi in units:
            if groups and hi - groups[-1].start <= limit:
                groups[-1] = slice(groups[-1].start, hi)
            else:
                groups.append(slice(lo, hi))
        return groups

    def _expert_matmuls(
        self, il: int, cur: np.ndarray, tokens: np.ndarray, slots: np.ndarray, weights: np.ndarray
    ) -> np.ndarray:
        """Weighted outputs [m, n_embd] of m pairs sorted by slot: one plain matrix product per expert block
        (ggml's batched kernels read each expert's weights once for many tokens; mul_mat_id runs one token
        at a time through them)."""
        g, hp = self.graph, self.hp
        ctx = g.reset()
        mats = self.weights.slot_matrices[il]
        bounds = np.flatnonzero(np.diff(slots)) + 1
        outs = []
        for lo, hi in zip(np.r_[0, bounds].tolist(), np.r_[bounds, len(slots)].tolist(), strict=True):
            slot = int(slots[lo])
            x = g.input(cur[tokens[lo:hi]])
            down = common.swiglu_ffn(ctx, mats[0][slot], mats[1][slot], mats[2][slot], x)
            outs.append(ops.ggml_mul(ctx, down, g.input(weights[lo:hi].astype(np.float32).reshape(hi - lo, 1))))
        g.compute(*outs)
        return np.concatenate([to_numpy(o).reshape(-1, hp.n_embd) for o in outs], axis=0)

    def _pair_chunks(self, m: int) -> list[slice]:
        step = self.options.max_batch * self.hp.n_expert_used  # the graph reserve's size
        return [slice(i, min(i + step, m)) for i in range(0, m, step)]

    def _expert_rows(self, il: int, rows: np.ndarray, slots: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Weighted outputs [m, n_embd] of m (token input, slot, weight) pairs of layer il."""
        g = self.graph
        g.reset()
        moe = common.routed_experts(g, self.views[il], rows, slots, weights)
        g.compute(moe)
        return to_numpy(moe).reshape(-1, self.hp.n_embd)

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
        slot_of = np.zeros(self.hp.n_expert, np.int32)
        slot_of[part] = self.streamer.wait_all(il, part)
        tok, j = np.nonzero(np.isin(sel, part))
        for c in self._pair_chunks(len(tok)):
            t, jj = tok[c], j[c]
            weighted[t, jj] = self._expert_rows(il, cur[t], slot_of[sel[t, jj]], weights[t, jj])

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
