"""The engine thread: loads the model, serves requests in the session's slots (several replies decoded in one
step, runtime/batch.py; a request waits in arrival order while every slot is busy), publishes stats.

HTTP handlers never touch the session: they submit a job and read its events from an asyncio queue.
A client that goes away sets the job's cancel flag, which the engine checks at every step: its slot is free
for the next one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from tokenwing import testpause
from tokenwing.errors import CorruptModelError, TokenWingError
from tokenwing.runtime.batch import PromptPart, joins, step
from tokenwing.runtime.generate import Decoding, TokenLogprob, run_stats
from tokenwing.runtime.sampler import Sampler
from tokenwing.runtime.session import SESSION_COUNTERS, Session, SessionOptions
from tokenwing.server.images import Vision, request_images
from tokenwing.server.overflow import fit_chat
from tokenwing.server.prompt_disk_cache import DiskCacheSettings, DiskPromptCache, Readying, Restored, open_cache
from tokenwing.server.protocol import CONTEXT_LENGTH_EXCEEDED, GenerationRequest, RequestError
from tokenwing.text.chat import FALLBACK_NOTICE, ChatFormat, chat_format
from tokenwing.text.grammar import Constraint, UnenforceableError
from tokenwing.text.tokenizer import TextTokenizer
from tokenwing.text.tools.base import Event, Tools
from tokenwing.text.tools.reply import ReplyReader, Syntax, call_grammar, prepare, preserved_ids, syntax
from tokenwing.vision.prompt import MediaPrompt

_C = {name: i for i, name in enumerate(SESSION_COUNTERS)}
# A stats event's counts per streamed layer (docs/api.md): where the selected experts came from (VRAM, RAM, the
# drive), and the VRAM cache's swaps in and out with the bytes they copied up.
LAYER_FIELDS = ("hits", "misses", "vram_hits", "vram_swaps_in", "vram_swaps_out", "vram_bytes_up")
STOPPING = {"type": "error", "message": "the server is stopping", "status": 503}
# a stats stream's token event (_token_event), as `tokenwing info --json` publishes it for its readers (the app)
TOKEN_FIELDS = (
    "token",
    "layers",
    "ssd_wait_ms",
    "bytes_read",
    "prefetch_issued",
    "prefetch_used",
    "vram_swaps",
    "vram_bytes_up",
    "prediction_recall",
    "batch",
    "slots",
    "tokens_per_s",
)


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[dict[str, Any]]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: dict[str, Any]) -> None:
        post(self.loop, self.events.put_nowait, event)


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    """Runs fn(*args) on the server's loop, from the engine thread; nothing once that loop has closed: the server
    has stopped and the event's reader with it. A step still running when the loop closed (a reply open at stdin's
    close or SIGTERM, its 503 already sent by stop_soon) then ends without a traceback, where its emit raised
    'Event loop is closed' twice over (the step's, then its failure report's) and killed the engine thread."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


class EngineWorker:
    def __init__(
        self,
        model_path: str,
        options: SessionOptions,
        log: Callable[[str], None],
        context_overflow: str = "rolling",
        disk_cache: DiskCacheSettings | None = None,
        mmproj: str | None = None,
        allow_image_urls: bool = False,
    ) -> None:
        self.model_path = model_path
        self.mmproj, self.allow_image_urls = mmproj, allow_image_urls  # images (server/images.py)
        self.vision: Vision | None = None
        self.disk_settings = disk_cache  # the prompt cache on disk (None: off)
        self.disk: DiskPromptCache | None = None
        self.options = options
        self.context_overflow = context_overflow  # a chat request's policy where it names none (server/overflow.py)
        self.log = log
        self.session: Session | None = None
        self.chat: ChatFormat | None = None
        self.syntax: Syntax | None = None  # how the chat template writes tools and calls
        self.shown: frozenset[int] = frozenset()  # control tokens its replies print (the syntax's markers)
        self.state = "loading"  # then "ok", "error" (loading failed), or "degraded" (below)
        self.error: str | None = None
        self.load_error: TokenWingError | None = None
        self.jobs: queue.Queue[Job | Literal["wake"] | None] = queue.Queue()  # ("wake": a slot was readied)
        # every request submitted and not yet collected (weakly: a finished one goes with its handler), so that a
        # stopping server can answer them all at once (stop_soon)
        self.open_jobs: weakref.WeakValueDictionary[int, Job] = weakref.WeakValueDictionary()
        self.subscribers: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue[dict[str, Any]]]] = set()
        self.lock = threading.Lock()
        self.totals = {
            "requests": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "errors": 0,
            # chat requests whose oldest or middle turns were dropped to fit the context, and what they lost
            "context_overflows": 0,
            "context_dropped_messages": 0,
            "context_dropped_tokens": 0,
        }
        self.last_token_stats: dict[str, Any] = {}
        self.queued = 0  # requests waiting for a slot
        self.replies: dict[int, Reply] = {}  # by slot: the requests being served
        # by slot: requests whose slot is readied off this thread (a restore from the disk cache), and the rest of
        # their admission
        self.readying: dict[int, tuple[Readying, Job, Callable[[Restored | None], Reply]]] = {}
        self._last_used: dict[int, float] = {}  # when each slot's last reply ended
        self._steps = 0  # decode steps since the engine was last idle
        # what each busy slot is doing, rebuilt by the engine thread after every step (HTTP handlers read it; a
        # tuple is replaced whole, never changed in place)
        self.slot_view: tuple[dict[str, Any], ...] = ()
        self.last_batch = 0  # replies in the last decode step
        self.on_fatal: Callable[[], None] = lambda: None
        self.thread = threading.Thread(target=self._run, name="tokenwing-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ends the engine thread at its next step (replies in progress end with an error) and waits for it (up
        to `timeout`): it closes the
        session and drops it, so the native objects it holds (`tokenwing._core`'s StreamCore and DirectFile) are
        gone before the interpreter exits, where nanobind reports every one still alive as leaked (two dozen
        lines on the app's log at every stop)."""
        self.jobs.put(None)
        if self.thread.is_alive():
            self.thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self.lock:
            self.queued += 1
            self.open_jobs[id(job)] = job
        self.jobs.put(job)

    def stop_soon(self) -> None:
        """The server is stopping (SIGTERM, SIGINT, its stdin closed): every request still open is answered now
        with a 503 'the server is stopping' (the JSON error, or a stream's error event), and the engine thread
        ends at its next step. Called on the server's loop as its shutdown begins, it does not wait for that step:
        uvicorn cancels a handler still running a second later (timeout_graceful_shutdown), and a cancelled
        handler was a plain-text 500 with a traceback in the log — a step of a model streamed from the drive can
        take that long."""
        with self.lock:
            open_jobs = list(self.open_jobs.values())
        for job in open_jobs:
            job.emit(dict(STOPPING))
        self.jobs.put(None)

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
            post(loop, _offer, q, event)

    # ------------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self.session = Session(self.model_path, self.options, log=self.log)
            if self.session.device_line:
                self.log(self.session.device_line)  # where it computes: the GPU's share, or why the CPU
            self.chat = chat_format(self.session.chat_template)
            self.syntax = syntax(self.chat.template.source)
            self.shown = preserved_ids(self.syntax, self.session.tokenizer)
            if self.chat.fallback:
                self.log(FALLBACK_NOTICE)
            if self.mmproj is not None:  # the image encoder, checked against the model (before /health says ok)
                self.vision = Vision(self.session, self.mmproj, self.allow_image_urls)
            if self.disk_settings is not None and self.options.prompt_cache:  # (before /health says ok)
                self.disk = open_cache(self.disk_settings, self.session, self.model_path, self.log)
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
        try:
            self._serve_all()
        finally:
            if self.disk is not None:
                self.disk.close()  # (its writes read the slots' memory: before the session goes)
            if self.vision is not None:
                self.vision.close()
            self.session.close()
            self.session = None

    # ---------------------------------------------------------------------------------------- the slots
    def _serve_all(self) -> None:
        """Serves the queue with the session's slots (continuous batching): a request takes a free slot as soon
        as there is one, its prompt runs between decode steps (a part of at most one chunk while others decode,
        so they are never stalled longer), and every reply past its prompt decodes in one step with the others
        (runtime/batch.py: each layer's union of experts read once). A reply that ends or whose client goes
        leaves its slot free for the next step."""
        s = self.session
        assert s is not None
        waiting: collections.deque[Job] = collections.deque()
        while True:
            jobs: list[Job | Literal["wake"] | None] = []
            if not self.replies and not waiting and not self._readied():
                jobs.append(self.jobs.get())  # idle: wait for one (or for a slot readied)
            with contextlib.suppress(queue.Empty):
                while True:
                    jobs.append(self.jobs.get_nowait())
            if any(j is None for j in jobs):
                self._stop_all(waiting)
                return
            waiting.extend(j for j in jobs if isinstance(j, Job))
            if waiting:
                testpause.pause("serve.admit")  # tests: requests gather in the queue, then start in one step
            while waiting and len(self.replies) + len(self.readying) < s.n_seq:
                job = waiting.popleft()
                with self.lock:
                    self.queued -= 1
                if not job.cancelled.is_set():
                    self._admit(job)
                    self._update_view()
            for job in [j for j in waiting if j.cancelled.is_set()]:  # a client that left frees its place
                waiting.remove(job)
                with self.lock:
                    self.queued -= 1
            self._take_readied()
            pending = [r for r in self.replies.values() if r.prompt_left][:1]
            decoding = [r for r in self.replies.values() if not r.prompt_left]
            if pending and decoding and joins(s, self._part(pending[0], True)):
                self._guarded(pending + decoding, self._step)  # (one pass: a failure is every one's)
            else:
                if pending:
                    self._guarded(pending, self._step)
                decoding = [r for r in self.replies.values() if not r.prompt_left]
                if decoding:
                    testpause.pause("serve.decode")  # tests: a decode step about to run, its replies open
                    self._guarded(decoding, self._step)
            if not self.replies:
                self._steps = 0
            self._update_view()

    def _update_view(self) -> None:
        self.slot_view = tuple(
            {
                "slot": r.slot,
                "prompt_tokens": len(r.prompt),
                "phase": "prompt" if r.prompt_left else "decode",
                "tokens": r.decoded,
                "largest_batch": r.largest_batch,
            }
            for r in sorted(self.replies.values(), key=lambda r: r.slot)
        )

    def _guarded(self, replies: list[Reply], work: Callable[[list[Reply]], None]) -> None:
        """Runs engine work for these replies; a failure ends them with an error (the others go on)."""
        try:
            work(replies)
        except CorruptModelError as e:
            # The model file went bad under a running server (a flipped bit on the drive, a file rewritten in
            # place): these requests fail, the server stays up and /health says what is wrong.
            self.state, self.error = "degraded", f"the model file is damaged: {e}"
            self.log(f"error: {self.error}")
            self._fail(replies, {"type": "error", "message": self.error, "status": 500}, reset=True)
        except (TokenWingError, RequestError) as e:
            self._fail(replies, {"type": "error", "message": str(e)}, reset=False)
        except Exception as e:
            self.log("internal error:\n" + traceback.format_exc())
            event = {"type": "error", "message": f"internal error: {type(e).__name__}: {e}", "status": 500}
            self._fail(replies, event, reset=True)

    def _fail(self, replies: list[Reply], event: dict[str, Any], reset: bool) -> None:
        s = self.session
        assert s is not None
        self.totals["errors"] += len(replies)
        for r in replies:
            r.decoding.close()
            if reset:  # the failed pass left the KV cache half-written: no prefix to reuse
                s.use(r.slot)
                s.reset()
            r.job.emit(dict(event))
            self.replies.pop(r.slot, None)

    def _stop_all(self, waiting: collections.deque[Job]) -> None:
        for r in self.replies.values():
            r.decoding.close()
            r.job.emit(dict(STOPPING))
        self.replies.clear()
        for _, job, _ in self.readying.values():  # (their threads end before the session goes: disk.close)
            job.emit(dict(STOPPING))
        self.readying.clear()
        for job in waiting:
            job.emit(dict(STOPPING))

    def free_slots(self) -> int:
        """Slots no request holds or waits for (a request that may not wait is refused when there are none)."""
        s = self.session
        with self.lock:
            return (s.n_seq if s is not None else 1) - len(self.replies) - len(self.readying) - self.queued

    def _admit(self, job: Job, readied: Callable[[], Reply] | None = None) -> None:
        """Starts a request in a free slot: its prompt (rendered, tokenized, checked), its reply's reader and
        grammar, and the slot whose cached tokens share the longest start with it (prompt caching per slot).
        `readied`: the rest of its admission, its slot readied off this thread (`_take_readied`)."""
        s, fmt, syn = self.session, self.chat, self.syntax
        assert s is not None and fmt is not None and syn is not None
        try:
            reply = self._prepare(job, s, fmt, syn) if readied is None else readied()
        except RequestError as e:
            self.totals["errors"] += 1
            job.emit({"type": "error", "message": e.message, "param": e.param, "code": e.code})
            return
        except TokenWingError as e:
            self.totals["errors"] += 1
            job.emit({"type": "error", "message": str(e)})
            return
        except Exception as e:
            self.totals["errors"] += 1
            self.log("internal error:\n" + traceback.format_exc())
            job.emit({"type": "error", "message": f"internal error: {type(e).__name__}: {e}", "status": 500})
            return
        if reply is not None:
            self.replies[reply.slot] = reply

    def _readied(self) -> bool:
        return any(r.done.is_set() for r, _, _ in self.readying.values())

    def _take_readied(self) -> None:
        """Requests whose slot was readied off this thread (server/prompt_disk_cache.py `ready`) start now."""
        s = self.session
        assert s is not None
        for slot, (r, job, admit) in list(self.readying.items()):
            if not r.done.is_set():
                continue
            del self.readying[slot]
            if r.failed:  # (logged by the cache) the slot may hold part of a snapshot: emptied
                s.use(slot)
                s.reset()
                self.totals["errors"] += 1
                job.emit({"type": "error", "message": "internal error: restoring the context failed", "status": 500})
            elif not job.cancelled.is_set():
                self._admit(job, functools.partial(admit, r.restored))

    def _prepare(self, job: Job, s: Session, fmt: ChatFormat, syn: Syntax) -> Reply | None:
        req = job.request
        stops = list(req.stop)
        reader: ReplyReader | None = None
        grammar = req.grammar
        overflow: dict[str, Any] | None = None
        media: MediaPrompt | None = None
        if req.messages:
            images = request_images(self.vision, s, req.images)  # (encoded here: their rows are prompt tokens)
            # tool_choice none: the model is not shown the tools (OpenAI's meaning) and nothing is read as a call
            tools = req.tools if req.tools and req.tool_choice != "none" else None

            def render(messages: Sequence[dict[str, Any]], with_tools: bool) -> str:
                shown = tools if with_tools else None
                return fmt.template.render(prepare(syn, messages, shown), tools=shown, **req.variables)

            # the conversation, less its oldest (or middle) turns where it leaves the reply no room
            fitted = fit_chat(
                req.messages,
                render,
                images.encode if images is not None else lambda text: s.tokenizer.encode(text, special=True),
                s.n_ctx,
                req.max_tokens if req.max_tokens_given else None,
                req.context_overflow or self.context_overflow,
                tools is not None,
            )
            text, prompt, overflow = fitted.text, fitted.prompt, fitted.report()
            if images is not None:
                media = images.tokens(text)[1]  # (the images the fitted prompt still has: their rows' places)
            if overflow is not None:
                self.totals["context_overflows"] += 1
                self.totals["context_dropped_messages"] += fitted.dropped_messages
                self.totals["context_dropped_tokens"] += fitted.dropped_tokens
            stops += fmt.stops
            # the reply read back: reasoning (harmony's analysis channel, think tags) and the family's calls
            # under the calls' grammar a streamed call goes out in pieces as it is written (it cannot turn out not
            # to be a call, as it can with auto, where it must then be text: auto sends each call whole)
            forced = bool(tools) and req.tool_choice in ("required", "function")
            chosen = Tools(tools, req.tool_name) if tools else None
            reader = ReplyReader(syn, text, chosen, req.parallel_tool_calls, stream_calls=forced and req.stream)
            if tools and chosen is not None and forced:
                # the reply is calls, in the family's format, to allowed functions with valid arguments: a model of
                # any quality writes a valid call (a response_format is for content, which such a reply has none of)
                names = [req.tool_name] if req.tool_name else [t["function"]["name"] for t in tools]
                parallel = req.parallel_tool_calls and req.tool_name is None
                calls = call_grammar(syn, s.tokenizer, text, chosen, names, parallel)
                # what it does not enforce of the functions' schemas, for the route to say (before "accepted")
                grammar, req.unenforced = calls.text, calls.unenforced
        else:
            prompt = s.tokenizer.encode(req.prompt or "", special=False)
        if not prompt:
            raise RequestError("the prompt is empty")
        if len(prompt) >= s.n_ctx:  # (a plain prompt: a chat's was made to fit, or refused, above)
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) does not fit the context ({s.n_ctx} tokens)",
                "prompt",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        # a response format's matcher (the vocabulary's trie is built once per model, on the first such request)
        constraint = Constraint(s.tokenizer, grammar) if grammar is not None else None
        slot = self._pick_slot(prompt)
        s.use(slot)
        # the HTTP status can be sent: nothing below is the request's fault
        # (its prompt's tokens: Anthropic's stream says them in its first event, before the reply)
        job.emit(
            {"type": "accepted", "prompt_tokens": len(prompt), **({"context_overflow": overflow} if overflow else {})}
        )

        def start(restored: Restored | None) -> Reply:
            """The rest of the admission, once the slot is ready: now, or when its restore is over."""
            s.use(slot)  # (other slots may have stepped meanwhile)
            s.media = media  # (kept with the slot's history: its cached image rows are this prompt's, row_ids)
            if self.options.prompt_cache:
                cached = s.reuse_prefix(prompt)  # a chat's next turn: only the new tokens are computed
            else:
                s.reset()
                cached = 0
            reply = Reply(job, slot, prompt, cached, reader, time.perf_counter(), s.counters(), overflow)
            if restored is not None:
                reply.restored, reply.prompt_seconds = restored, restored.seconds

            def on_text(piece: str) -> None:
                reply.pieces += 1
                point = f"serve.piece{reply.pieces}" if testpause.armed else ""
                holding = testpause.arrive(point)  # tests: marked before the client can see the piece ...
                reply.emit(reader.push(piece) if reader is not None else [Event("content", piece)])
                if holding:  # ... then held mid-reply until the client goes (or this process dies)
                    testpause.hold(point, until=job.cancelled.is_set)

            reply.decoding = Decoding(
                s,
                prompt,
                req.max_tokens,
                Sampler(req.sampler),
                stops,
                on_text=on_text,
                should_stop=job.cancelled.is_set,
                cached=cached,
                logprobs=req.logprobs,
                on_logprob=lambda lp: job.emit({"type": "logprob", "entry": logprob_entry(s.tokenizer, lp)}),
                constraint=constraint,
                ignore_eos=req.ignore_eos,
                shown=self.shown,
            )
            return reply

        readying = self._ready(slot, prompt)
        if readying is not None:  # (then started by _take_readied; meanwhile the other slots decode)
            self.readying[slot] = (readying, job, start)
            return None
        return start(None)

    def _ready(self, slot: int, prompt: list[int]) -> Readying | None:
        """The prompt cache on disk readies the slot off this thread where it must wait for the slot's write or
        restore a snapshot that gives more of the prompt than the slot holds (server/prompt_disk_cache.py); None:
        the slot is ready now."""
        s = self.session
        assert s is not None
        if self.disk is None:
            return None
        held = _shared(s.seqs[slot].history, prompt)
        return self.disk.ready(slot, s.seqs[slot], prompt, held, lambda: self.jobs.put("wake"))

    def _pick_slot(self, prompt: list[int]) -> int:
        """The free slot whose cached tokens share the longest start with the prompt; ties: the one used least
        recently (its cache is the least likely to be continued)."""
        s = self.session
        assert s is not None
        free = [i for i in range(s.n_seq) if i not in self.replies and i not in self.readying]

        return max(free, key=lambda i: (_shared(s.seqs[i].history, prompt), -self._last_used.get(i, 0.0)))

    def _step(self, replies: list[Reply]) -> None:
        """One step: the next part of the first reply's prompt if it has one left, and a decode token for every
        reply past its prompt, in one pass where the experts stream (runtime/batch.py `step`). The part is all of
        the prompt when nothing else decodes (its experts are read once per pass), else up to the next chunk
        boundary, so the others wait one chunk at most."""
        s = self.session
        assert s is not None
        r = replies[0] if replies[0].prompt_left else None
        decoding = replies[1:] if r is not None else replies
        part = None
        if r is not None and r.job.cancelled.is_set():
            r.decoding.gen.finish_reason, r.decoding.gen.finish_detail = "stop", "cancelled"
            self._end(r)
            r = None
        if r is not None:  # (others decoding, in this step or the next one: a chunk at most)
            part = self._part(r, any(not x.prompt_left for x in self.replies.values()))
        if part is None and not decoding:
            return
        before = s.counters()
        steps = [(d.slot, d.next) for d in decoding if d.next is not None]
        t0 = time.perf_counter()
        logits, last = step(s, steps, part)
        if r is not None and part is not None:
            # (a part computed with decode tokens is charged to the prompt whole: the step is one pass)
            r.prompt_seconds += time.perf_counter() - t0
            if part.end:
                r.after_prompt = s.counters()
                r.decode_start = time.perf_counter()
                assert last is not None
                if self._decoded(r, last) and r.next is None:
                    self._end(r)
        if not decoding:
            return
        delta = s.counters() - before
        self._steps += 1
        self.last_batch = len(steps)
        done: list[Reply] = []
        for d, lg in zip(decoding, logits, strict=True):
            d.decoded += 1
            d.largest_batch = max(d.largest_batch, len(decoding))
            if self._decoded(d, lg) and d.next is None:
                done.append(d)
        self._publish(_token_event(s, delta, self._steps, decoding, time.perf_counter()))
        for d in done:
            self._end(d)

    def _decoded(self, r: Reply, logits: np.ndarray) -> bool:
        """r's next token (r.next) from these logits; False where its grammar gave up mid-reply: that reply alone
        fails with the error (a 400), as the others in the same pass go on."""
        try:
            r.next = r.decoding.step(logits)
        except UnenforceableError as e:
            self._fail([r], {"type": "error", "message": str(e)}, reset=False)
            return False
        return True

    def _part(self, r: Reply, others: bool) -> PromptPart:
        """The next part of a reply's prompt: all of it when nothing else decodes (`others`), else up to the next
        chunk boundary."""
        s = self.session
        assert s is not None
        pos = s.seqs[r.slot].pos
        todo = r.prompt[pos:]
        b = self.options.max_batch
        n = len(todo) if not others else min(len(todo), b - pos % b)
        media = s.seqs[r.slot].media
        if media is not None and n < len(todo):  # (an image whose rows see one another is not split: `whole`)
            n = media.whole([slice(0, n), slice(n, len(todo))], pos)[0].stop
        return PromptPart(r.slot, todo[:n], end=n == len(todo))

    def _end(self, r: Reply) -> None:
        """A reply is over: its last text and calls, its statistics, its slot free."""
        s = self.session
        assert s is not None
        gen = r.decoding.finish()
        gen.prompt_seconds = r.prompt_seconds
        gen.decode_seconds = time.perf_counter() - r.decode_start if r.decode_start else 0.0
        after_prompt = r.after_prompt if r.after_prompt is not None else s.counters()
        gen.stats = run_stats(s, r.before, after_prompt, s.counters(), gen)
        # (the counters are the engine's: with several replies at once, every one's reads in those steps)
        gen.stats.update(slot=r.slot, largest_batch=r.largest_batch)
        if r.restored is not None:  # (its tokens are among prompt_cached_tokens)
            gen.stats.update(
                prompt_restored_tokens=r.restored.tokens,
                prompt_restore_ms=r.restored.seconds * 1e3,
                prompt_restore_bytes=r.restored.nbytes,
            )
        del self.replies[r.slot]
        if self.disk is not None:
            # in the background: the slot is left alone until it is written
            self.disk.save(r.slot, s.seqs[r.slot], r.job.request.prompt_cache_key)
        self._last_used[r.slot] = time.perf_counter()
        finish_reason = gen.finish_reason
        if r.reader is not None:
            r.emit(r.reader.finish())
            if r.reader.cut is not None:  # a call the reply's end cut off (docs/api.md, "Tool calls")
                gen.stats["cut_call"] = r.reader.cut
            if r.reader.calls and finish_reason == "stop" and r.reader.cut != "arguments":
                finish_reason = "tool_calls"  # OpenAI's: the reply ended in calls to run (whole ones)
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += len(r.prompt)
        self.totals["completion_tokens"] += len(gen.tokens)
        r.job.emit(
            {
                "type": "done",
                "finish_reason": finish_reason,
                "prompt_tokens": len(r.prompt),
                "completion_tokens": len(gen.tokens),
                "stats": gen.stats,
                **({"context_overflow": r.overflow} if r.overflow else {}),
            }
        )
        s.save_usage()  # after each request: a crash later keeps what was learnt


@dataclass(eq=False)
class Reply:
    """A request in a slot: its prompt (computed up to the slot's position), its decoding, and the counters
    its statistics are taken from."""

    job: Job
    slot: int
    prompt: list[int]
    cached: int
    reader: ReplyReader | None
    start: float
    before: np.ndarray
    overflow: dict[str, Any] | None = None  # what was dropped to fit the context (the response says so)
    decoding: Decoding = field(init=False)
    next: int | None = None  # the token the next decode step computes
    after_prompt: np.ndarray | None = None
    prompt_seconds: float = 0.0
    decode_start: float = 0.0
    decoded: int = 0
    largest_batch: int = 0  # the most replies its decode steps were computed with
    pieces: int = 0
    restored: Restored | None = None  # its prompt's start read from the disk cache

    @property
    def prompt_left(self) -> bool:
        return self.after_prompt is None

    def emit(self, events: list[Event]) -> None:
        for e in events:
            if e.kind == "call" and e.call is not None:
                c = e.call
                self.job.emit(
                    {"type": "tool_call", "index": e.index, "id": c.id, "name": c.name, "arguments": c.arguments}
                )
            elif e.kind == "call_head" and e.call is not None:
                self.job.emit({"type": "tool_call_head", "index": e.index, "id": e.call.id, "name": e.call.name})
            elif e.kind == "call_args":
                self.job.emit({"type": "tool_call_args", "index": e.index, "text": e.text})
            elif e.text:
                kind = "reasoning" if e.kind == "reasoning" else "text"
                self.job.emit({"type": kind, "text": e.text, **({"streamed": True} if e.streamed else {})})


def logprob_entry(tok: TextTokenizer, lp: TokenLogprob) -> dict[str, Any]:
    """One token in llama.cpp's and OpenAI's chat shape: id, text (whole UTF-8 characters only, as llama.cpp
    sends; `bytes` has every byte), bytes, logprob, and the alternatives in the same shape."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        data = tok.piece_bytes(token)
        return {"id": token, "token": _whole_chars(data), "bytes": list(data), "logprob": logprob}

    return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


def _shared(history: list[int], prompt: list[int]) -> int:
    """The tokens a slot's history and a prompt start with alike."""
    n, limit = 0, min(len(history), len(prompt))
    while n < limit and history[n] == prompt[n]:
        n += 1
    return n


def _whole_chars(data: bytes) -> str:
    return data.decode("utf-8", errors="ignore")


def _offer(q: asyncio.Queue[dict[str, Any]], event: dict[str, Any]) -> None:
    if q.full():  # a slow reader loses the oldest event, never blocks the engine
        q.get_nowait()
    q.put_nowait(event)


def _token_event(s: Session, delta: np.ndarray, index: int, replies: list[Reply], now: float) -> dict[str, Any]:
    """A decode step's event: its counters per layer (every sequence's experts: one union per layer), the
    step's number since the engine was last idle, and each slot's reply so far (docs/api.md)."""
    recall = s.stats()["prediction_recall"]
    slots = [
        {
            "slot": r.slot,
            "tokens": r.decoded,
            "tokens_per_s": r.decoded / (now - r.decode_start) if now > r.decode_start else 0.0,
        }
        for r in replies
    ]
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
        "batch": len(replies),  # sequences in this step
        "slots": slots,
        "tokens_per_s": sum(x["tokens_per_s"] for x in slots),  # all of them together
    }
