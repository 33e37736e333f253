"""Generation: prompt, decode loop, stop on EOS or stop strings, UTF-8-safe streamed text, statistics."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwing import testpause
from tokenwing.errors import BadInputError
from tokenwing.runtime.sampler import Sampler
from tokenwing.runtime.session import SESSION_COUNTERS, Session
from tokenwing.text.grammar import Constraint


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of the raw logits, before any sampling
    setting: what llama.cpp's server reports), and the `top` most likely tokens at that step."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Generation:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    # why it ended: "eos", "stop" (a stop string), "grammar" (a response format's end), "cancelled",
    # "max_tokens" or "context_full" (finish_reason is "length" for the last two: OpenAI's one word for both)
    finish_detail: str = "max_tokens"
    stop_string: str | None = None  # the stop string that ended it (finish_detail "stop"): Anthropic's stop_sequence
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, already in the KV cache from the previous request
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    # after each decode step: seconds since decoding began, and the SSD wait so far (ns); the steady rate is read
    # from their later half (`steady_rate`)
    marks: list[tuple[float, int]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


class TextStream:
    """Turns token bytes into text without splitting a UTF-8 character, holding back a possible stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = b""
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string found (the earliest in the text, where several are)

    def push(self, data: bytes) -> str:
        self.pending += data
        try:
            self.text += self.pending.decode("utf-8")
            self.pending = b""
        except UnicodeDecodeError as e:
            if e.reason == "unexpected end of data":
                self.text += self.pending[: e.start].decode("utf-8")
                self.pending = self.pending[e.start :]
            else:
                self.text += self.pending.decode("utf-8", errors="replace")
                self.pending = b""
        for s in self.stops:
            i = self.text.find(s, max(0, self.emitted - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                self.stopped = True
                self.matched = s
        hold = 0 if self.stopped else max((self._prefix_len(s) for s in self.stops), default=0)
        ready = len(self.text) - hold
        out = self.text[self.emitted : ready] if ready > self.emitted else ""
        self.emitted = max(self.emitted, ready)
        return out

    def _prefix_len(self, stop: str) -> int:
        for n in range(min(len(stop) - 1, len(self.text)), 0, -1):
            if self.text.endswith(stop[:n]):
                return n
        return 0

    def flush(self) -> str:
        if self.pending:
            self.text += self.pending.decode("utf-8", errors="replace")
            self.pending = b""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


class Decoding:
    """One reply, token by token: its sampling, stop strings, grammar, log-probabilities and streamed text. The
    driver computes; this decides. `first(logits)` takes the prompt's logits, `step(logits)` each decode step's;
    both return the token to compute next, or None when the reply has ended (`gen` says why). `generate` drives
    one sequence; the server's batch (server/worker.py) drives several, each with its own."""

    def __init__(
        self,
        session: Session,
        prompt: list[int],
        max_tokens: int,
        sampler: Sampler,
        stops: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        cached: int = 0,
        logprobs: int | None = None,
        on_logprob: Callable[[TokenLogprob], None] | None = None,
        constraint: Constraint | None = None,
        ignore_eos: bool = False,
        shown: frozenset[int] = frozenset(),
    ) -> None:
        room = session.n_ctx - len(prompt)
        if room <= 0:
            raise BadInputError(
                f"the prompt ({len(prompt)} tokens) does not fit the context ({session.n_ctx} tokens): shorten it"
                " or use a longer context"
            )
        self.session, self.max_tokens, self.sampler = session, max_tokens, sampler
        self.limit = min(max_tokens, room)
        self.on_text, self.should_stop = on_text, should_stop
        self.logprobs, self.on_logprob, self.constraint = logprobs, on_logprob, constraint
        self.shown = shown  # control tokens printed as their text: a chat format's markers (llama.cpp's preserved)
        # the end-of-generation tokens never sampled (llama.cpp's ignore_eos): a reply of max_tokens, as benchmarks
        # and load tests ask for; log-probabilities stay the model's own
        eog = sorted(i for i in session.tokenizer.eos_ids if 0 <= i < session.hp.vocab_size)
        self.banned = np.array(eog, np.int64) if ignore_eos else None
        self.gen = Generation(prompt_tokens=len(prompt), cached_tokens=cached)
        self.stream = TextStream(stops)
        self.history = list(prompt)
        self.script = testpause.scripted_tokens()  # tests only: a reply of known tokens through the real pipeline
        self.done = False

    def step(self, logits: np.ndarray) -> int | None:
        """The next token from these logits; None when the reply ends here (then `finish`)."""
        gen, script, constraint = self.gen, self.script, self.constraint
        if len(gen.tokens) >= self.limit:
            self.done = True
            return None
        if script is not None:
            tok = script[min(len(gen.tokens), len(script) - 1)]
        else:
            allowed = logits
            if self.banned is not None and self.banned.size:
                allowed = logits.copy()
                allowed[self.banned] = -np.inf
            tok = self.sampler.sample(allowed if constraint is None else constraint.apply(allowed), self.history)
        if tok in self.session.tokenizer.eos_ids:
            gen.finish_reason, gen.finish_detail = "stop", "eos"
            self.done = True
            return None
        if constraint is not None and script is None:
            constraint.accept(tok)
        gen.tokens.append(tok)
        self.history.append(tok)
        if self.logprobs is not None:
            lp = token_logprob(logits, tok, self.logprobs)
            gen.logprobs.append(lp)
            if self.on_logprob:
                self.on_logprob(lp)
        tokenizer = self.session.tokenizer
        piece = self.stream.push(tokenizer.piece_bytes(tok) if tok in self.shown else tokenizer.token_bytes(tok))
        if piece and self.on_text:
            self.on_text(piece)
        if self.stream.stopped:
            gen.finish_reason, gen.finish_detail = "stop", "stop"
            gen.stop_string = self.stream.matched
            self.done = True
            return None
        if constraint is not None and script is None and constraint.finished:
            gen.finish_reason, gen.finish_detail = "stop", "grammar"  # nothing may follow but an end token
            self.done = True
            return None
        if self.should_stop is not None and self.should_stop():
            gen.finish_reason, gen.finish_detail = "stop", "cancelled"
            self.done = True
            return None
        if len(gen.tokens) == self.limit:
            gen.finish_detail = "max_tokens" if self.limit == self.max_tokens else "context_full"
            self.done = True
            return None  # the last token needs no forward pass
        if constraint is not None and script is None:
            constraint.prepare()  # the next mask, while the forward pass runs
        return tok

    def close(self) -> None:
        """Lets go of what the reply holds (its grammar's mask thread); `finish` does it too."""
        if self.constraint is not None:
            self.constraint.close()

    def finish(self) -> Generation:
        """The reply's text and end (after `step` returned None, or to end it here)."""
        self.close()
        tail = self.stream.flush() if not self.stream.stopped else ""
        if tail and self.on_text:
            self.on_text(tail)
        self.gen.text = self.stream.text
        return self.gen


def generate(
    session: Session,
    prompt: list[int],
    max_tokens: int,
    sampler: Sampler,
    stops: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
    on_token: Callable[[int, np.ndarray], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    cached: int = 0,
    logprobs: int | None = None,
    on_logprob: Callable[[TokenLogprob], None] | None = None,
    constraint: Constraint | None = None,
) -> Generation:
    """Generates after `prompt`, whose first `cached` tokens are already in the session's KV cache
    (`Session.reuse_prefix`); the whole prompt still counts for repetition penalties.

    At most `max_tokens`, and never past the context: prompt and reply together fill it at most (then
    `finish_detail` is "context_full"). With `logprobs` (a count of alternatives, 0 for none), every token's
    log-probability goes to `gen.logprobs` and `on_logprob`, before its text goes to `on_text`. With a
    `constraint` (a response format), only the tokens its grammar allows are sampled, and the reply ends where
    the grammar does (`finish_detail` "grammar"); log-probabilities stay the model's own."""
    d = Decoding(
        session, prompt, max_tokens, sampler, stops, on_text, should_stop, cached, logprobs, on_logprob, constraint
    )
    gen = d.gen
    before = session.counters()
    try:
        t0 = time.perf_counter()
        logits = session.forward(prompt[cached:], prompt=True)
        gen.prompt_seconds = time.perf_counter() - t0
        after_prompt = session.counters()
        t1 = time.perf_counter()
        tok = d.step(logits)
        wait_col, waited = SESSION_COUNTERS.index("wait_ns"), 0
        while tok is not None:
            before_tok = session.counters()
            logits = session.forward([tok])
            step = session.counters() - before_tok
            if on_token:
                on_token(tok, step)
            tok = d.step(logits)
            waited += int(step[:, wait_col].sum())
            gen.marks.append((time.perf_counter() - t1, waited))
        gen.decode_seconds = time.perf_counter() - t1
    except BaseException:
        d.close()
        raise
    d.finish()
    gen.stats = run_stats(session, before, after_prompt, session.counters(), gen)
    return gen


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """log-softmax of the logits (in float64) at `token`, and the `top` highest (ties: the lower id first)."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = float(z.max())
    lse = m + float(np.log(np.exp(z - m).sum()))
    best: list[tuple[int, float]] = []
    if top > 0:
        k = min(top, z.size)
        part = np.argpartition(-z, k - 1)[:k]
        order = part[np.lexsort((part, -z[part]))]
        best = [(int(i), float(z[i] - lse)) for i in order]
    return TokenLogprob(token, float(z[token] - lse), best)


STEADY_MIN_STEPS = 4


def steady_rate(marks: Sequence[tuple[float, int]]) -> tuple[float, float] | None:
    """Decode tokens per second and SSD wait (ms) per token over the later half of the steps, or None with fewer
    than STEADY_MIN_STEPS. The first steps carry page faults, graph set-up and a cold expert cache: over a short
    run they pull the whole run's rate down (32 tokens of the built-in model ran at a third of its rate over 128),
    and the app's estimate wants the rate a chat settles at."""
    if len(marks) < STEADY_MIN_STEPS:
        return None
    half = len(marks) // 2
    (t0, w0), (t1, w1) = marks[half - 1], marks[-1]
    n = len(marks) - half
    return (n / (t1 - t0) if t1 > t0 else 0.0), (w1 - w0) / 1e6 / n


def run_stats(
    session: Session, before: np.ndarray, mid: np.ndarray, end: np.ndarray, gen: Generation
) -> dict[str, Any]:
    c = {name: i for i, name in enumerate(SESSION_COUNTERS)}
    decode = end - mid
    n_dec = max(len(gen.tokens) - 1, 1) if gen.tokens else 1
    hits, misses = decode[:, c["hits"]], decode[:, c["misses"]]
    total = hits + misses
    vram = decode[:, c["vram_hits"]]
    selected = vram + total  # every selected expert of a decode step: from VRAM, from RAM, or read from the drive
    s = session.stats()
    steady = steady_rate(gen.marks)
    return {
        "prompt_tokens": gen.prompt_tokens,
        "prompt_cached_tokens": gen.cached_tokens,
        "prompt_tokens_per_s": (gen.prompt_tokens - gen.cached_tokens) / gen.prompt_seconds
        if gen.prompt_seconds
        else 0.0,
        "decode_tokens": len(gen.tokens),
        "decode_tokens_per_s": len(gen.tokens) / gen.decode_seconds if gen.decode_seconds else 0.0,
        "ssd_wait_ms_per_token": float(decode[:, c["wait_ns"]].sum()) / 1e6 / n_dec,
        "decode_steady_tokens_per_s": steady[0] if steady else None,
        "ssd_wait_ms_per_token_steady": steady[1] if steady else None,
        "bytes_read_per_token": float(decode[:, c["bytes_read"]].sum()) / n_dec,
        "prompt_bytes_read": int((mid - before)[:, c["bytes_read"]].sum()),
        "hit_rate": float(hits.sum() / total.sum()) if total.sum() else None,
        "hit_rate_per_layer": [float(h / t) if t else None for h, t in zip(hits, total, strict=True)],
        "prediction_recall": s["prediction_recall"],
        "vram": s["vram"],
        "vram_hit_rate": float(vram.sum() / selected.sum()) if selected.sum() else None,
        "vram_swaps_per_token": float(decode[:, c["vram_swaps_in"]].sum()) / n_dec,
        "vram_bytes_up_per_token": float(decode[:, c["vram_bytes_up"]].sum()) / n_dec,
        "prompt_vram_bytes_up": int((mid - before)[:, c["vram_bytes_up"]].sum()),
        "tiers_per_layer": {
            tier: [float(x / t) if t else None for x, t in zip(part, selected, strict=True)]
            for tier, part in (("vram", vram), ("ram", hits), ("drive", misses))
        },
        "expert_cache_bytes": s["expert_cache_bytes"],
        "lazy_reads": s["lazy_reads"],
        "slots_per_layer": s["slots_per_layer"],
        "counters": {name: int(decode[:, i].sum()) for name, i in c.items()},
        "finish_reason": gen.finish_reason,
        "finish_detail": gen.finish_detail,
        "stop_string": gen.stop_string,
        "n_ctx": session.n_ctx,
    }
