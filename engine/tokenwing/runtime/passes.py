"""A session's forward pass over the layers, with the experts streamed and predicted (`Passes`, which `Session`
is): a prompt layer-major in chunks, a decode step per layer (a layer's experts fused with the next layer's graph
when they are all in RAM) or as one graph (runtime/token_graph.py), the embedding and the output head, and a
prompt's memory (how long a pass fits). The state it computes on is the current sequence's
(runtime/sequences.py); the session (runtime/session.py) builds the parts."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing.compute.ggml_lib import Graph, Tensor, to_numpy
from tokenwing.errors import BadInputError
from tokenwing.models import common
from tokenwing.models.base import MoEModel
from tokenwing.models.hparams import HParams
from tokenwing.runtime.experts import ExpertCompute
from tokenwing.runtime.lookahead import Ahead, Lookahead
from tokenwing.runtime.memory_plan import PromptMemory, graph_bytes
from tokenwing.runtime.sequences import SequenceState
from tokenwing.runtime.token_graph import TokenGraph
from tokenwing.runtime.vram.tier import VramTier
from tokenwing.runtime.vram.weights import Place

if TYPE_CHECKING:  # (the session's options: only their fields are read)
    from tokenwing.runtime.session import SessionOptions

Parts = dict[str, np.ndarray]  # a layer graph's results by name (common.Routed's fields, "ahead", or "out")


def _put(r: Parts, key: str, v: np.ndarray, h: np.ndarray, c: slice) -> None:
    """A chunk's result into the prompt-long array of its name (the layer output or residual replaces h in place)."""
    if key not in r:
        r[key] = h if key in ("residual", "out") else np.empty((h.shape[0], v.shape[1]), v.dtype)
    r[key][c] = v


class Passes(SequenceState):
    """The forward pass; `Session.__init__` sets what it computes with."""

    options: SessionOptions
    log: Callable[[str], None]
    hp: HParams
    model: MoEModel
    n_ctx: int
    graph: Graph
    experts: ExpertCompute
    lookahead: Lookahead
    vram: VramTier | None
    prompt_memory: PromptMemory
    trace: list[tuple[np.ndarray, np.ndarray, int]] | None
    batch_graph: tuple[tuple[object, ...], TokenGraph] | None
    _v_width: int
    _token_graph: TokenGraph | None
    _token_graph_on: bool
    _cuts: list[int]
    _snap_at: int | None
    _warned_prompt: bool
    _prompt_memory_held: bool
    _known: dict[int, list[int]]
    # (`media`, the current sequence's images: their rows' inputs, positions and deepstack parts, vision/prompt.py)

    def _forward_all(self, tokens: list[int], all_logits: bool, prompt: bool, end: bool = True) -> np.ndarray:
        hp, n = self.hp, len(tokens)
        if not tokens:
            raise BadInputError("nothing to evaluate")
        ids = self.media.text_ids(tokens, self.pos) if self.media is not None else tokens  # (image rows: keyed)
        if any(not 0 <= t < hp.vocab_size for t in ids):
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
            # (chunks end at multiples of max_batch whatever the passes: the numbers are those of one pass)
            outs = [
                self._forward(tokens[i : i + span], all_logits, snapshot=end and i + span >= n, prompt=True)
                for i in range(0, n, span)
            ]
            return np.concatenate(outs, axis=0) if all_logits else outs[-1]
        return self._forward(tokens, all_logits, snapshot=end and (n > 1 or prompt), prompt=prompt)

    def _forward(self, tokens: list[int], all_logits: bool, snapshot: bool, prompt: bool) -> np.ndarray:
        """One pass; `snapshot`: the request's prompt ends with it (its state one token before the end is kept
        as a checkpoint). A pass that fails leaves no half-updated recurrent state behind."""
        try:
            out = self._pass(tokens, all_logits, snapshot, prompt)
        except BaseException:
            if self.kv.states is not None:
                self.checkpoints.abandon()
                self._state_dirty = True
            raise
        self.checkpoints.commit()
        return out

    def _pass(self, tokens: list[int], all_logits: bool, snapshot: bool, prompt: bool) -> np.ndarray:
        n, pos0 = len(tokens), self.pos
        decode = n == 1 and not prompt
        self._open_pass(tokens, snapshot, decode)
        one_graph = decode and self.scheduler.slot_map is not None and self.media is None  # (its positions: text's)
        logits = self._token_step(tokens[0]) if one_graph else None
        if logits is not None:
            self._advance(tokens)
            return logits.reshape(1, -1) if all_logits else logits
        h = self._pass_input(self.media.text_ids(tokens, pos0) if self.media is not None else tokens)
        if self.media is not None:
            self.media.inputs(h, pos0)
        sel_rows: list[np.ndarray] = []
        pred_rows: list[np.ndarray] = []
        carry: Parts | None = None  # layer il's graph results, computed with the layer before's experts
        for il in range(self.hp.n_layer):
            out, sel, preds, carry = self._layer(il, h, decode, carry)
            h = out if out is not None else h  # (None: fused into the next layer's graph)
            if self.media is not None and out is not None:
                self.media.after_layer(il, h, pos0)
            if self.kv.spilled and not decode:  # a prompt writes a layer's positions at once: reclaimable now
                self.kv.write_back(il)
            if self.trace is not None and sel is not None and preds is not None:
                sel_rows.append(sel)
                pred_rows.append(preds)
        if self.trace is not None and sel_rows:
            self.trace.append((np.stack(sel_rows, axis=1), np.stack(pred_rows, axis=1), 0 if decode else n))
        self._advance(tokens)
        if not all_logits:
            last: np.ndarray = self._logits(h[-1:])[-1]
            return last
        return np.concatenate([self._logits(h[c]) for c in self._chunks(n, pos0)], axis=0)

    def _open_pass(self, tokens: list[int], snapshot: bool, decode: bool, others: int = 0) -> None:
        """A pass's start for this sequence: its checkpoint positions, the prompt's memory (lent by the cache) or
        the decode's (given back), the core's token clock (`others`: decode tokens of other sequences computed
        in the same pass, runtime/batch.py), and the experts known from the token id alone."""
        n, pos0 = len(tokens), self.pos
        if self.vram is not None:  # (a prompt borrows VRAM here, decode takes it back and moves swaps in)
            self.vram.begin_pass(decode)
        self._cuts = self.checkpoints.boundaries(pos0, n) if not decode else []
        self._snap_at = pos0 + n - 1 if snapshot and self.checkpoints.enabled else None
        if self._snap_at is not None and (self.checkpoints.has(self._snap_at) or self._snap_at == 0):
            self._snap_at = None
        if n == 1 and self._snap_at is not None:  # the last pass of a prompt is one token: the state before it
            for il in self.kv.states.layers if self.kv.states is not None else []:
                self.checkpoints.record(il, self._snap_at)
        if decode and self._prompt_memory_held:
            self.graph.release()  # what the prompt's graphs touched: the reply needs a few MB of it
            self._prompt_memory_held = False
        elif not decode:
            self._prompt_memory_held = True
        if decode:
            self.scheduler.after_prompt()
        else:
            self.scheduler.lend(self.prompt_memory.to_borrow(n, self._free_room()))
        self.scheduler.begin_token(0 if decode and not others else n + others)
        # Layers routed by the token id alone (DeepSeek V4's hash layers): their experts are read from the token's
        # start, in layer order, as demand reads ahead of every prediction (`read_known`), and the lookahead's
        # guesses for them are dropped. As predictions (probability 1) they were read under the prefetch cap, and on
        # ds4-bench at 25 % one or two a token in each hash layer had not started when its layer began: demand reads.
        self._known = self.model.known_experts(tokens[0]) if decode else {}
        for block, experts in sorted(self._known.items()):
            known = Ahead(block, experts, block + 1, [1.0] * len(experts), 1)
            if self.vram is not None:  # (experts in VRAM are never read into RAM)
                known = self.vram.not_held(known)
            self.scheduler.read_known(known.target, known.experts)

    def _pass_input(self, tokens: list[int]) -> np.ndarray:
        """The pass's first state: its tokens' embeddings, chunk by chunk (each reads the few tokens before it
        that the family's embedding needs)."""
        self.lookahead.made.clear()
        k = self.model.token_context  # (the tokens before a chunk its embedding reads: few, never all)
        return np.concatenate(
            [
                self._embed(tokens[c], (self.history[-k:] + tokens[max(0, c.start - k) : c.start])[-k:] if k else [])
                for c in self._chunks(len(tokens), self.pos)
            ],
            axis=0,
        )

    def _layer(
        self, il: int, h: np.ndarray, decode: bool, carry: Parts | None
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, Parts | None]:
        """One layer. Returns its output (None when a decode step fused it into the next layer's graph), the
        selected experts, the predictions, and the next layer's graph results when fused."""
        n = h.shape[0]
        if not decode:
            self.scheduler.read_ahead(il, n)
        r = carry if carry is not None else self._layer_parts(il, h, decode)
        if "out" in r:  # a dense layer: it predicts the streamed layers after it, as a MoE layer does
            for a in self.lookahead.predict(il, r["ahead"]) if "ahead" in r else []:
                self.scheduler.predict(a.target, a.experts, a.distance, a.probs, a.predictors)
            return r["out"], None, None, None
        sel, weights = r["ids"], r["weights"]
        self.scheduler.observe(il, sel)
        self.lookahead.score(il, sel)
        preds = np.full((n, max(self.options.lookahead, 0), self.hp.n_expert_used), -1, np.int32)
        fused = None
        if decode:
            out, fused = self._decode_experts(il, r, self.lookahead.predict(il, r["ahead"]) if "ahead" in r else [])
        else:
            out = self.experts.prompt(il, r["cur"], sel, weights, self.vram)
        if out is not None:
            out = self._tail(il, out, r)
        preds[-1] = self.lookahead.row(il)
        return out, sel, preds, fused

    def _tail(self, il: int, experts: np.ndarray, r: Parts) -> np.ndarray:
        """The layer's next state from its experts' sum (the family's `tail`): on the arrays where the family has
        a numpy twin, else a graph per chunk, written over the residual (which `_put` made `h`: a chunk reads only
        its own rows)."""
        shared, residual = r.get("shared"), r["residual"]
        out = self.model.tail_array(il, experts, shared, residual)
        if out is not None:
            return out
        g = self.graph
        for c in self._chunks(experts.shape[0], self.pos):
            ctx = g.reset()
            sh = g.input(shared[c]) if shared is not None else None
            x = self.model.tail(ctx, il, g.input(experts[c]), sh, g.input(residual[c]))
            g.compute(x)
            residual[c] = to_numpy(x).reshape(c.stop - c.start, -1)
        return residual

    def _decode_experts(self, il: int, r: Parts, ahead: list[Ahead]) -> tuple[np.ndarray | None, Parts | None]:
        """One token's experts: handed to the scheduler (demand reads), then the lookahead's predictions.

        All in RAM: the experts, their sum, the residual and the next layer's graph in one graph (one graph per
        layer instead of two, no round trip through numpy; the same ggml additions in the same order, so
        bit-identical, tested) — returns (None, the next layer's results). Otherwise the resident experts are
        computed while the others are read — returns (the experts' sum, None).
        """
        sel, weights = r["ids"], r["weights"]
        wave = list(dict.fromkeys(sel[0].tolist()))  # k ≤ the usable slots: a loan keeps k per layer
        vram = self.vram
        held = vram.held(il, wave) if vram is not None else []
        if held:  # in VRAM: computed there, never read into RAM
            wave = [e for e in wave if e not in set(held)]
        ready = self.scheduler.begin_layer(il, wave)
        for a in ahead:  # (experts in VRAM are never read into RAM)
            if a.target in self._known:
                continue
            if vram is not None:
                a = vram.not_held(a)
            self.scheduler.predict(a.target, a.experts, a.distance, a.probs, a.predictors)
        if vram is not None and vram.experts is not None:
            vram.experts.observe(il, [*held, *wave], len(held))
        next_on_cpu = vram is None or not vram.has_layer(il + 1)
        if not held and all(ready) and il + 1 < self.hp.n_layer and next_on_cpu:
            fused = self._fused_step(il, r, wave)
            self.scheduler.end_layer(il)
            return None, fused
        launch = vram.launch(il, r["cur"], sel, weights, held) if vram is not None and held else None
        weighted = self.experts.decode_weighted(il, r["cur"], sel, weights, wave, ready)  # GPU ‖ CPU
        if launch is not None:
            assert vram is not None
            vram.collect(launch, weighted)
        self.scheduler.end_layer(il)
        return common.sum_experts(weighted), None

    def _fused_step(self, il: int, r: Parts, wave: list[int]) -> Parts:
        g, sel = self.graph, r["ids"]
        slot_of = np.zeros(self.hp.n_expert, np.int32)
        slot_of[wave] = self.scheduler.wait_all(il, wave)
        ctx = g.reset()
        slots = g.input(slot_of[sel[0]].reshape(1, -1))  # I32 [k, 1]
        ids = g.input(sel[0].astype(np.int32).reshape(1, -1)) if self.experts.needs_ids(il) else None
        total = self.experts.token(ctx, il, g.input(r["cur"][0]), slots, g.input(r["weights"][0]), ids)
        shared = g.input(r["shared"]) if "shared" in r else None
        x = self.model.tail(ctx, il, total, shared, g.input(r["residual"]))
        out, writes = self._layer_graph(ctx, il + 1, x, self._placement(self.pos, 1, True), True)
        g.compute(*writes, *out.values())
        return {name: to_numpy(t).reshape(1, -1) for name, t in out.items()}

    def _layer_graph(
        self,
        ctx: Any,
        il: int,
        x: Tensor,
        at: common.Placement,
        lookahead: bool,
        place: Place | None = None,
        cache: common.LayerCache | None = None,
    ) -> tuple[dict[str, Tensor], list[Tensor]]:
        """The family's layer graph on x (an input, or the previous layer's output when a decode step computes a
        layer's experts and the next layer in one graph), with the lookahead's router logits in decode; `place`:
        the device's weights and cache (the VRAM tier builds its graphs here too)."""
        model = self.model if place is None else place.model
        if cache is None:
            cache = self.kv[il] if place is None else place.kv[il]
        lo = model.layer(ctx, il, x, at, cache)
        if lo.routed is None:
            assert lo.out is not None
            out = {"out": lo.out}
        else:
            out = lo.routed.outputs()
        routers = place.routers.get(il) if place is not None and place.routers is not None else None
        ahead = self.lookahead.graph(ctx, il, lo, routers) if lookahead else None
        if ahead is not None:
            out["ahead"] = ahead
        return out, lo.writes

    def _layer_parts(self, il: int, h: np.ndarray, decode: bool) -> Parts:
        """The layer's graph over `h` in chunks. A prompt's working memory is what a layer keeps per token
        (`prompt_bytes_per_token`): the layer output or residual replaces `h` in place, chunk by chunk (each
        chunk reads only its own rows), and the other results go straight into arrays of the prompt's length,
        not into per-chunk lists that are then joined."""
        n = h.shape[0]
        r: Parts = {}
        states = self.kv.states
        tracked = not decode and states is not None and il in states.layers and self.checkpoints.enabled
        on_device = self.vram is not None and self.vram.has_layer(il)  # (never a layer with a recurrent state)
        for c in self._chunks(n, self.pos):
            g, m = self.graph, c.stop - c.start
            if on_device:
                assert self.vram is not None
                for key, v in self.vram.layer_chunk(il, h[c], self.pos + c.start, decode).items():
                    _put(r, key, v, h, c)
                continue
            end, cache = self.pos + c.stop, self.kv[il]
            snap = tracked and end - 1 == self._snap_at
            if snap and m == 1:  # the state before this chunk is the one a token before the prompt's end
                self.checkpoints.record(il, end - 1)
            elif snap:  # the graph writes it too
                assert isinstance(cache, common.RecurrentCache)
                cache = dataclasses.replace(cache, snapshot=self.checkpoints.snapshot.layers[il])
            g.reset()
            out, writes = self._layer_graph(
                g.ctx, il, g.input(h[c]), self._placement(self.pos + c.start, m, decode), decode, cache=cache
            )
            g.compute(*writes, *out.values())
            if snap and m > 1:
                self.checkpoints.record_snapshot(il, end - 1)
            if tracked and end in self._cuts:
                self.checkpoints.record(il, end)
            for key, t in out.items():
                _put(r, key, to_numpy(t).reshape(m, -1), h, c)
        return r

    def _placement(self, pos0: int, n: int, decode: bool) -> common.Placement:
        """Where a graph's tokens go and what they attend over: the KV cache rounded up to DECODE_WINDOW positions
        and masked, for decode and prompt chunks alike (as llama.cpp pads its KV view). Every sum over keys then
        has the same length pattern whatever chunk, pass or cached prefix a token came in (masked keys add exact
        zeros): a token's numbers do not depend on how its prompt was split (tested). `--prompt-attention flash`:
        prompt chunks through F32 tiled flash attention."""
        n_kv = common.decode_window(pos0 + n - 1, self.n_ctx)
        flash = not decode and self.options.prompt_attention == "flash"
        axes = self.model.position_axes
        # (a prompt's bidirectional images: their rows see one another, vision/prompt.py)
        unmask = None if self.media is None else functools.partial(self.media.unmask, pos0=pos0)
        at = common.placement(
            self.graph, pos0, n, n_kv, self.n_ctx, self._v_width, self.model.window, axes, flash, unmask
        )
        if self.media is not None:  # image rows' positions, and the text's after them
            at = dataclasses.replace(at, positions=self.graph.input(self.media.positions(pos0, n)))
        return at

    # ------------------------------------------------------------------------- a decode step as one graph
    def _token_step(self, token: int) -> np.ndarray | None:
        """A decode step as one graph (every expert resident: nothing to stream or predict); None when that
        graph is off or could not be built (the per-layer path runs instead). The scheduler still sees each
        layer's experts, so hit counts, usage and traces are as in the per-layer path."""
        if not self._token_graph_on or not self.model.one_graph_at(self.pos, self.n_ctx):
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
        k = self.model.token_context
        logits, routed = tg.run(token, self.pos, self.history[-k:] if k else [])
        k, d = self.hp.n_expert_used, max(self.options.lookahead, 0)
        sel_rows = []
        for il, experts in routed:
            self.scheduler.touch(il, experts.tolist())
            sel = experts.reshape(1, k)
            self.scheduler.observe(il, sel)
            sel_rows.append(sel)
        if self.trace is not None and sel_rows:
            no_predictions = np.full((1, len(sel_rows), d, k), -1, np.int32)
            self.trace.append((np.stack(sel_rows, axis=1), no_predictions, 0))
        return logits

    def _build_token_graph(self, window: int) -> TokenGraph:
        slot_map = self.scheduler.slot_map
        assert slot_map is not None
        return TokenGraph(self.model, [self.kv], [window], self.experts, slot_map, self.graph)

    def _drop_graphs(self) -> None:
        self._drop_token_graph()
        if self.batch_graph is not None:
            self.batch_graph[1].close()
            self.batch_graph = None

    def _drop_token_graph(self) -> None:
        if self._token_graph is not None:
            self._token_graph.close()
            self._token_graph = None

    # ------------------------------------------------------------------------------------ a prompt's memory
    def _free_room(self) -> int:
        s = self.scheduler
        written = sum(q.kv_high for q in self.seqs) // len(self.seqs)  # (the promise is per position of every one)
        return self.prompt_memory.free_room(written, s.cache_filled(), s.loaned, self.checkpoints.held)

    def _prompt_span(self) -> int:
        """The longest prompt pass whose working memory fits: free memory plus what the cache can lend."""
        s = self.scheduler
        return self.prompt_memory.span(self._free_room(), s.lendable, s.loaned, self.options.max_batch)

    def _chunks(self, n: int, pos0: int) -> list[slice]:
        """A pass of n tokens from pos0 in chunks of at most max_batch that end at multiples of it (checkpoint
        positions are such multiples too): a token lands in the same chunk, so its attention sums over the same
        span and rounds the same, whether the prompt runs in one pass, several, or after a cached prefix."""
        b, out, i = self.options.max_batch, [], 0
        while i < n:
            stop = min(n, (pos0 + i) // b * b + b - pos0)
            out.append(slice(i, stop))
            i = stop
        if self.media is None:
            return out
        out = self.media.whole(out, pos0)  # (an image whose rows attend both ways: in one chunk)
        # What a layer's graph of m tokens needs, as the memory plan counts it: without the logits (a layer's graph
        # has none) and the plan's room to spare (graph_bytes of nothing)
        hp = dataclasses.replace(self.hp, vocab_size=0)
        fixed = graph_bytes(hp, 0, 0)
        for c in out:
            m, n_kv = c.stop - c.start, common.decode_window(pos0 + c.stop - 1, self.n_ctx)
            if m > b and graph_bytes(hp, m, n_kv) - fixed > self.graph.mem_bytes:
                raise BadInputError(
                    f"an image's rows attend to one another, so its {m}-token chunk at position {pos0 + c.start} "
                    f"runs at once, which this session's graph memory ({self.graph.mem_bytes >> 20} MiB) cannot hold: "
                    "send it smaller"
                )
        return out

    # ----------------------------------------------------------------------------------- embedding, head
    def _embed(self, tokens: list[int], before: list[int] | None = None) -> np.ndarray:
        """The state of these tokens, `before` the last `token_context` tokens ahead of them (by default the
        history's)."""
        g = self.graph
        ctx = g.reset()
        if before is None:
            k = self.model.token_context
            before = self.history[-k:] if k else []
        x = self.model.embed(ctx, g.input(self.model.token_input(tokens, before)))
        g.compute(x)
        return to_numpy(x).reshape(len(tokens), self.model.state_width(self.hp))

    def _logits(self, h: np.ndarray) -> np.ndarray:
        if self.vram is not None and self.vram.head:
            return self.vram.logits(h)
        g = self.graph
        ctx = g.reset()
        logits = self.model.head(ctx, g.input(h))
        g.compute(logits)
        return to_numpy(logits).reshape(-1, self.hp.vocab_size)
