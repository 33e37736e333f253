"""The engine thread: loads the model, runs one generation at a time in arrival order, publishes stats.

HTTP handlers never touch the session: they submit a job and read its events from an asyncio queue.
A client that goes away sets the job's cancel flag, which the decode loop checks every token.
"""

from __future__ import annotations

import asyncio
import errno
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwing import testpause
from tokenwing.errors import CorruptModelError, TokenWingError
from tokenwing.runtime.generate import TokenLogprob, generate
from tokenwing.runtime.sampler import Sampler
from tokenwing.runtime.session import SESSION_COUNTERS, Session, SessionOptions
from tokenwing.server.protocol import GenerationRequest, RequestError
from tokenwing.text.chat import FALLBACK_NOTICE, ChatFormat, chat_format
from tokenwing.text.grammar import Constraint
from tokenwing.text.tokenizer import TextTokenizer
from tokenwing.text.tools.base import Event, Tools
from tokenwing.text.tools.reply import ReplyReader, Syntax, call_grammar, prepare, syntax

_C = {name: i for i, name in enumerate(SESSION_COUNTERS)}
# A stats event's counts per streamed layer (docs/api.md): where the selected experts came from (VRAM, RAM, the
# drive), and the VRAM cache's swaps in and out with the bytes they copied up.
LAYER_FIELDS = ("hits", "misses", "vram_hits", "vram_swaps_in", "vram_swaps_out", "vram_bytes_up")


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[dict[str, Any]]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineWorker:
    def __init__(self, model_path: str, options: SessionOptions, log: Callable[[str], None]) -> None:
        self.model_path = model_path
        self.options = options
        self.log = log
        self.session: Session | None = None
        self.chat: ChatFormat | None = None
        self.syntax: Syntax | None = None  # how the chat template writes tools and calls
        self.state = "loading"  # then "ok", "error" (loading failed), or "degraded" (below)
        self.error: str | None = None
        self.load_error: TokenWingError | None = None
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.subscribers: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue[dict[str, Any]]]] = set()
        self.lock = threading.Lock()
        self.totals = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "errors": 0}
        self.last_token_stats: dict[str, Any] = {}
        self.queued = 0
        self.on_fatal: Callable[[], None] = lambda: None
        self.thread = threading.Thread(target=self._run, name="tokenwing-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ends the engine thread after the job in progress and waits for it (up to `timeout`): it closes the
        session and drops it, so the native objects it holds (`tokenwing._core`'s StreamCore and DirectFile) are
        gone before the interpreter exits, where nanobind reports every one still alive as leaked (two dozen
        lines on the app's log at every stop)."""
        self.jobs.put(None)
        if self.thread.is_alive():
            self.thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self.lock:
            self.queued += 1
        self.jobs.put(job)

    # --------------------------------------------------------------------------------------- stats fan-out
    def subscribe(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=256)
        with self.lock:
            self.subscribers.add((loop, q))
        return q

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        with self.lock:
            self.subscribers = {s for s in self.subscribers if s[1] is not q}

    def _publish(self, event: dict[str, Any]) -> None:
        self.last_token_stats = event
        with self.lock:
            subs = list(self.subscribers)
        for loop, q in subs:
            loop.call_soon_threadsafe(_offer, q, event)

    # ------------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self.session = Session(self.model_path, self.options, log=self.log)
            if self.session.device_line:
                self.log(self.session.device_line)  # where it computes: the GPU's share, or why the CPU
            self.chat = chat_format(self.session.chat_template)
            self.syntax = syntax(self.chat.template.source)
            if self.chat.fallback:
                self.log(FALLBACK_NOTICE)
            self.state = "ok"
            self.log(f"ready: {self.session.describe()}")
        except TokenWingError as e:
            self.state, self.error = "error", str(e)
            self.load_error = e  # its exit code is the process's: a corrupt file is final, not a crash to retry
            self.on_fatal()
            return
        except MemoryError:
            self.state, self.error = "error", "out of memory while loading the model"
            self.on_fatal()
            return
        except OSError as e:  # mmap/madvise under a memory limit: ENOMEM is out of memory too
            reason = "out of memory while loading the model" if e.errno == errno.ENOMEM else f"loading failed: {e}"
            self.state, self.error = "error", reason
            self.on_fatal()
            return
        except Exception as e:  # anything else must not leave /health saying "loading" forever
            self.state, self.error = "error", f"loading failed: {type(e).__name__}: {e}"
            self.on_fatal()
            return
        while True:
            job = self.jobs.get()
            if job is None:
                break
            with self.lock:
                self.queued -= 1
            if job.cancelled.is_set():
                continue
            try:
                self._serve(job)
                self.session.save_usage()  # after each request: a crash later keeps what was learnt
            except CorruptModelError as e:
                # The model file went bad under a running server (a flipped bit on the drive, a file rewritten in
                # place): this request fails, the server stays up and /health says what is wrong.
                self.totals["errors"] += 1
                self.state, self.error = "degraded", f"the model file is damaged: {e}"
                self.log(f"error: {self.error}")
                self.session.reset()  # the failed pass left the KV cache half-written: no prefix to reuse
                job.emit({"type": "error", "message": self.error, "status": 500})
            except (TokenWingError, RequestError) as e:
                self.totals["errors"] += 1
                job.emit({"type": "error", "message": str(e)})
            except Exception as e:
                self.totals["errors"] += 1
                self.session.reset()
                self.log("internal error:\n" + traceback.format_exc())
                job.emit({"type": "error", "message": f"internal error: {type(e).__name__}: {e}", "status": 500})
        if self.session is not None:
            self.session.close()
            self.session = None

    def _serve(self, job: Job) -> None:
        s, fmt, syn = self.session, self.chat, self.syntax
        assert s is not None and fmt is not None and syn is not None
        req = job.request
        stops = list(req.stop)
        reader: ReplyReader | None = None
        grammar = req.grammar
        if req.messages:
            # tool_choice none: the model is not shown the tools (OpenAI's meaning) and nothing is read as a call
            tools = req.tools if req.tools and req.tool_choice != "none" else None
            messages = prepare(syn, req.messages, tools)
            text = fmt.template.render(messages, tools=tools, **req.variables)
            prompt = s.tokenizer.encode(text, special=True)
            stops += fmt.stops
            # the reply read back: reasoning (harmony's analysis channel, think tags) and the family's calls
            reader = ReplyReader(syn, text, Tools(tools, req.tool_name) if tools else None, req.parallel_tool_calls)
            if tools and req.tool_choice in ("required", "function"):
                # the reply is calls, in the family's format, to allowed functions with valid arguments: a model of
                # any quality writes a valid call (a response_format is for content, which such a reply has none of)
                names = [req.tool_name] if req.tool_name else [t["function"]["name"] for t in tools]
                parallel = req.parallel_tool_calls and req.tool_name is None
                grammar = call_grammar(syn, s.tokenizer, text, Tools(tools, req.tool_name), names, parallel)
        else:
            prompt = s.tokenizer.encode(req.prompt or "", special=False)
        if not prompt:
            raise RequestError("the prompt is empty")
        if len(prompt) >= s.n_ctx:
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) does not fit the context ({s.n_ctx} tokens)", "messages"
            )
        # a response format's matcher (the vocabulary's trie is built once per model, on the first such request)
        constraint = Constraint(s.tokenizer, grammar) if grammar is not None else None
        job.emit({"type": "accepted"})  # the HTTP status can be sent: nothing below is the request's fault
        if self.options.prompt_cache:
            cached = s.reuse_prefix(prompt)  # a chat's next turn: only the new tokens are computed
        else:
            s.reset()
            cached = 0
        start = time.perf_counter()
        n = [0]

        def on_token(tok: int, delta: np.ndarray) -> None:
            n[0] += 1
            self._publish(_token_event(s, delta, n[0], time.perf_counter() - start))

        pieces = [0]

        def emit(events: list[Event]) -> None:
            for e in events:
                if e.call is not None:
                    c = e.call
                    job.emit(
                        {"type": "tool_call", "index": e.index, "id": c.id, "name": c.name, "arguments": c.arguments}
                    )
                elif e.text:
                    job.emit({"type": "reasoning" if e.kind == "reasoning" else "text", "text": e.text})

        def on_text(piece: str) -> None:
            pieces[0] += 1
            point = f"serve.piece{pieces[0]}" if testpause.armed else ""
            holding = testpause.arrive(point)  # tests: marked before the client can see the piece ...
            emit(reader.push(piece) if reader is not None else [Event("content", piece)])
            if holding:  # ... then held mid-reply until the client goes (or this process dies)
                testpause.hold(point, until=job.cancelled.is_set)

        gen = generate(
            s,
            prompt,
            req.max_tokens,
            Sampler(req.sampler),
            stops,
            on_text=on_text,
            on_token=on_token,
            should_stop=job.cancelled.is_set,
            cached=cached,
            logprobs=req.logprobs,
            on_logprob=lambda lp: job.emit({"type": "logprob", "entry": logprob_entry(s.tokenizer, lp)}),
            constraint=constraint,
        )
        finish_reason = gen.finish_reason
        if reader is not None:
            emit(reader.finish())
            if reader.calls and finish_reason == "stop":
                finish_reason = "tool_calls"  # OpenAI's: the reply ended in calls to run
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += len(prompt)
        self.totals["completion_tokens"] += len(gen.tokens)
        job.emit(
            {
                "type": "done",
                "finish_reason": finish_reason,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(gen.tokens),
                "stats": gen.stats,
            }
        )


def logprob_entry(tok: TextTokenizer, lp: TokenLogprob) -> dict[str, Any]:
    """One token in llama.cpp's and OpenAI's chat shape: id, text (whole UTF-8 characters only, as llama.cpp
    sends; `bytes` has every byte), bytes, logprob, and the alternatives in the same shape."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        data = tok.piece_bytes(token)
        return {"id": token, "token": _whole_chars(data), "bytes": list(data), "logprob": logprob}

    return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


def _whole_chars(data: bytes) -> str:
    return data.decode("utf-8", errors="ignore")


def _offer(q: asyncio.Queue[dict[str, Any]], event: dict[str, Any]) -> None:
    if q.full():  # a slow reader loses the oldest event, never blocks the engine
        q.get_nowait()
    q.put_nowait(event)


def _token_event(s: Session, delta: np.ndarray, index: int, elapsed: float) -> dict[str, Any]:
    recall = s.stats()["prediction_recall"]
    return {
        "token": index,
        "layers": [
            {"layer": layer, **{name: int(delta[row, _C[name]]) for name in LAYER_FIELDS}}
            for row, layer in enumerate(s.streamed)
        ],
        "ssd_wait_ms": float(delta[:, _C["wait_ns"]].sum()) / 1e6,
        "bytes_read": int(delta[:, _C["bytes_read"]].sum()),
        "prefetch_issued": int(delta[:, _C["prefetch_issued"]].sum()),
        "prefetch_used": int(delta[:, _C["prefetch_used"]].sum()),
        # the per-layer swaps' totals, kept for readers of the first version of this event
        "vram_swaps": int(delta[:, _C["vram_swaps_in"]].sum()),  # experts moved into VRAM before this token
        "vram_bytes_up": int(delta[:, _C["vram_bytes_up"]].sum()),
        "prediction_recall": recall,
        "tokens_per_s": index / elapsed if elapsed > 0 else 0.0,
    }
