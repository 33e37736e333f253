"""The HTTP API (docs/api.md): OpenAI-compatible completions, health, Prometheus metrics, stats stream."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenwing.errors import BadInputError
from tokenwing.runtime.session import SESSION_COUNTERS
from tokenwing.server import image_parts, jobs, messages, prompt_cache_routes, responses
from tokenwing.server.protocol import (
    MAX_BODY,
    GenerationRequest,
    RequestError,
    parse_apply_template,
    parse_chat,
    parse_completion,
)
from tokenwing.server.tokens import detokenize, parse_detokenize, parse_tokenize, tokenize
from tokenwing.server.worker import EngineWorker, Job
from tokenwing.text.tools.reply import prepare
from tokenwing.version import __version__

API_VERSION = "1"


def create_app(worker: EngineWorker, model_id: str, api_key: str | None) -> Starlette:
    created = int(time.time())

    def error(e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    def authorized(request: Request) -> bool:
        if not api_key:
            return True
        # the scheme is case-insensitive (RFC 9110 §11.1): `bearer KEY` is the same credential as `Bearer KEY`
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode()):
            return True
        # Anthropic's clients send the key as `x-api-key` (the anthropic SDK, Claude Code): the same key
        return hmac.compare_digest(request.headers.get("x-api-key", "").strip().encode(), api_key.encode())

    def guarded(
        handler: Callable[[Request], Awaitable[Response]],
        render: Callable[[RequestError], Response] = error,
    ) -> Callable[[Request], Awaitable[Response]]:
        """`render`: how the route's API spells an error (OpenAI's format by default; /v1/messages has its own)."""

        async def wrapped(request: Request) -> Response:
            if not authorized(request):
                return render(RequestError("invalid or missing API key", status=401, kind="authentication_error"))
            if worker.state == "loading":
                return render(RequestError("the model is still loading", status=503, kind="server_error"))
            if worker.state == "error":
                failed = f"the model failed to load: {worker.error}"
                return render(RequestError(failed, status=503, kind="server_error"))
            try:
                return await handler(request)
            except RequestError as e:
                return render(e)

        return wrapped

    async def read_json(request: Request) -> Any:
        # Read as it arrives and refused as soon as it passes the limit: a body read whole first (a 1,000 MB one
        # took the server to 2.49 GB) is memory any local program could take.
        too_large = RequestError(f"request body too large (the limit is {MAX_BODY >> 20} MiB)", status=413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:  # (gone before its body ended: an answer to no one, not a traceback in the log)
            raise RequestError("the client closed the connection before its request body ended") from None
        return parse_json_body(b"".join(chunks))

    async def health(request: Request) -> Response:
        status = 200 if worker.state in ("ok", "degraded") else 503  # degraded: up, but some requests fail
        return JSONResponse(
            {
                "status": worker.state,
                "error": worker.error,
                "version": __version__,
                "api_version": API_VERSION,
                "model": model_id,
                "queued": worker.queued,
                # the slots (requests served at once; --parallel) and how many are serving a request now
                "slots": worker.session.n_seq if worker.session is not None else None,
                "busy": len(worker.replies),
            },
            status_code=status,
        )

    async def models(request: Request) -> Response:
        fmt = worker.chat
        template = {"kind": "fallback" if fmt and fmt.fallback else "model", "name": fmt.fallback if fmt else None}
        entry = {"id": model_id, "object": "model", "created": created, "owned_by": "tokenwing"}
        # what it reads besides text, in llama.cpp's /props spelling: images with serve --mmproj (the app offers them)
        entry["modalities"] = {"vision": worker.vision is not None}
        return JSONResponse({"object": "list", "data": [{**entry, "chat_template": template}]})

    async def run(request: Request, req: GenerationRequest, chat: bool) -> Response:
        job = await jobs.submit(worker, req)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        accepted = await jobs.accepted(request, job)
        if accepted is None:
            return Response(status_code=499)
        if req.stream:
            return StreamingResponse(
                _stream(request, job, rid, model_id, chat, accepted.get("context_overflow")),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **jobs.unenforced_headers(req)},
            )
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        entries: list[dict[str, Any]] = []
        try:
            while True:
                ev = await jobs.next_event(request, job)
                if ev is None:
                    return Response(status_code=499)
                if ev["type"] == "text":
                    text.append(ev["text"])
                elif ev["type"] == "reasoning":
                    reasoning.append(ev["text"])
                elif ev["type"] == "tool_call":
                    calls.append(jobs.call(ev))
                elif ev["type"] in ("tool_call_head", "tool_call_args"):
                    continue  # a call's pieces, for streaming: the tool_call after them is whole
                elif ev["type"] == "logprob":
                    entries.append(ev["entry"])
                elif ev["type"] == "error":
                    raise jobs.event_error(ev)
                else:
                    break
        finally:
            job.cancelled.set()
        content = "".join(text)
        usage = jobs.usage(ev)
        logprobs = _logprobs(entries, chat, 0)[0] if req.logprobs is not None else None
        if chat:
            # OpenAI's: a reply of calls only has a null content
            message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            if calls:
                message["tool_calls"] = calls
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "finish_reason": ev["finish_reason"],
                "logprobs": logprobs,
            }
            body = {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_id,
                "choices": [choice],
                "usage": usage,
            }
        else:
            body = {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_id,
                "choices": [{"index": 0, "text": content, "finish_reason": ev["finish_reason"], "logprobs": logprobs}],
                "usage": usage,
            }
        extra: dict[str, Any] = dict(ev.get("stats", {}))
        if ev.get("context_overflow"):  # what was dropped to fit the context (server/overflow.py)
            extra["context_overflow"] = ev["context_overflow"]
        extra["unenforced"] = req.unenforced  # the schema keywords the grammar dropped (text/grammar.py)
        body["tokenwing"] = extra
        return JSONResponse(body, headers=jobs.unenforced_headers(req))

    async def chat_completions(request: Request) -> Response:
        return await run(request, parse_chat(await read_json(request)), chat=True)

    async def completions(request: Request) -> Response:
        return await run(request, parse_completion(await read_json(request)), chat=False)

    async def apply_template(request: Request) -> Response:
        # The prompt a chat request makes (llama.cpp's route): rendered beside the engine's thread, not in it.
        req = parse_apply_template(await read_json(request))
        assert worker.chat is not None and worker.syntax is not None  # set before the state turns ok (guarded)
        template = worker.chat.template
        try:
            # as the chat endpoint makes it: where the template shows no tools, the engine's words for them
            messages = prepare(worker.syntax, req.messages, req.tools)
            prompt = await asyncio.to_thread(
                template.render, messages, req.add_generation_prompt, tools=req.tools, **req.variables
            )
        except BadInputError as e:
            raise RequestError(str(e), "tools" if str(e).startswith("tools:") else "messages") from None
        return JSONResponse({"prompt": image_parts.shown(prompt)})  # (each image where <__media__> stands)

    async def chat_count(request: Request) -> Response:
        # A chat request's tokens as the engine would run them (before any overflow policy), and the tools' share
        # of them: the prompt rendered with the tools less the prompt rendered without. Beside the engine's thread.
        req = parse_apply_template(await read_json(request))
        assert worker.session is not None

        def count(tools: list[dict[str, Any]] | None) -> int:
            return jobs.prompt_tokens(worker, req.messages, tools, req.variables, req.add_generation_prompt, req.images)

        try:
            with_tools = await asyncio.to_thread(count, req.tools)
            without = await asyncio.to_thread(count, None) if req.tools else with_tools
        except BadInputError as e:
            raise RequestError(str(e), "tools" if str(e).startswith("tools:") else "messages") from None
        n_ctx = worker.session.n_ctx
        return JSONResponse({"prompt_tokens": with_tools, "tools_tokens": with_tools - without, "n_ctx": n_ctx})

    async def tokenize_route(request: Request) -> Response:
        req = parse_tokenize(await read_json(request))
        assert worker.session is not None  # loaded before the state turns ok (guarded)
        return JSONResponse(await asyncio.to_thread(tokenize, worker.session.tokenizer, req))

    async def detokenize_route(request: Request) -> Response:
        assert worker.session is not None
        tok = worker.session.tokenizer
        ids = parse_detokenize(await read_json(request), tok.vocab_size)
        return JSONResponse(await asyncio.to_thread(detokenize, tok, ids))

    async def stats(request: Request) -> Response:
        return JSONResponse(
            {
                "last_token": worker.last_token_stats,
                "totals": worker.totals,
                # the slots: how many, the queue, the last step's batch, and each busy one's reply so far
                "slots": {
                    "count": worker.session.n_seq if worker.session else None,
                    "queued": worker.queued,
                    "last_batch": worker.last_batch,
                    "busy": list(worker.slot_view),
                },
                "session": worker.session.stats() if worker.session else None,
            }
        )

    async def stats_stream(request: Request) -> Response:
        headers = {"Cache-Control": "no-cache"}
        if request.method == "HEAD":  # (Starlette routes HEAD to a GET route: the stream's headers, no endless body)
            return Response(media_type="text/event-stream", headers=headers)
        loop = asyncio.get_running_loop()
        q = worker.subscribe(loop)

        async def events() -> AsyncIterator[bytes]:
            try:
                yield b": tokenwing stats stream\n\n"
                while not await request.is_disconnected():
                    try:
                        ev = await asyncio.wait_for(q.get(), timeout=15)
                    except TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    yield b"event: token\ndata: " + json.dumps(ev).encode() + b"\n\n"
            finally:
                worker.unsubscribe(q)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def metrics(request: Request) -> Response:
        lines = [
            f'tokenwing_up{{version="{__version__}"}} {1 if worker.state == "ok" else 0}',
            f"tokenwing_queued_requests {worker.queued}",
            f"tokenwing_busy_slots {len(worker.replies)}",
        ]
        if worker.session is not None:
            lines.append(f"tokenwing_slots {worker.session.n_seq}")
        lines.append(f"tokenwing_last_batch {worker.last_batch}")
        for view in worker.slot_view:
            lines.append(f'tokenwing_slot_decoded_tokens{{slot="{view["slot"]}"}} {view["tokens"]}')
        for k, v in worker.totals.items():
            lines.append(f"tokenwing_{k}_total {v}")
        if worker.session is not None:
            c = worker.session.counters()
            for i, name in enumerate(SESSION_COUNTERS):
                for li, layer in enumerate(worker.session.streamed):
                    lines.append(f'tokenwing_expert_{name}_total{{layer="{layer}"}} {int(c[li, i])}')
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", guarded(models)),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        *responses.routes(worker, model_id, guarded, read_json),  # /v1/responses (server/responses.py)
        *messages.routes(worker, model_id, guarded, read_json),  # /v1/messages (server/messages.py)
        Route("/apply-template", guarded(apply_template), methods=["POST"]),
        Route("/v1/chat/count", guarded(chat_count), methods=["POST"]),
        Route("/tokenize", guarded(tokenize_route), methods=["POST"]),
        Route("/detokenize", guarded(detokenize_route), methods=["POST"]),
        Route("/v1/tokenwing/stats", guarded(stats)),
        Route("/v1/tokenwing/stats/stream", guarded(stats_stream)),
        *prompt_cache_routes.routes(worker, guarded, read_json),  # /v1/tokenwing/prompt-cache (its own module)
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})
    # a path with a slash too many is a 404 in the JSON format, not Starlette's 307 to the route (the HTTP fuzz
    # of issue 41: a POST redirected is a body sent twice, and 3xx is no answer an API client handles)
    app.router.redirect_slashes = False
    return app


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (404, 405 with its Allow header) in the one JSON error format."""
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    e = RequestError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code, kind=kind)
    if messages.routed(request.url.path):  # (Anthropic's clients read errors in their API's format)
        return messages.error(e, exc.headers)
    return JSONResponse(e.body(), status_code=exc.status_code, headers=exc.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A fault in the server itself: a 500 in the same JSON format (the traceback goes to the log, not the client)."""
    e = RequestError(f"internal error: {type(exc).__name__}", status=500, kind="server_error")
    if messages.routed(request.url.path):
        return messages.error(e)
    return JSONResponse(e.body(), status_code=500)


MAX_JSON_DEPTH = 64  # nesting a request may have (a chat request with tool schemas: about 10)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def parse_json_body(body: bytes) -> Any:
    """The body as JSON, its nesting limited first: 1,000 levels made `json.loads` raise a RecursionError (an
    unhandled 500), and deep values would reach the recursive code downstream (tool schemas, templates)."""
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and json_depth(body) > MAX_JSON_DEPTH:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(body)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, and an integer of over 4,300 digits (it was a 500)
        raise RequestError("the request body is not valid JSON") from None
    except RecursionError:  # (not reached below the depth limit; kept so that it is a 400 whatever the limit)
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (brackets inside strings do not count), in C
    speed: strings blanked by one regex, then a running sum over the brackets."""
    bare = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    steps = np.zeros(bare.size, dtype=np.int32)
    steps[(bare == ord("[")) | (bare == ord("{"))] = 1
    steps[(bare == ord("]")) | (bare == ord("}"))] = -1
    return int(np.cumsum(steps).max()) if steps.size else 0


def _logprobs(entries: list[dict[str, Any]], chat: bool, offset: int) -> tuple[dict[str, Any], int]:
    """The tokens' log-probabilities in OpenAI's shapes: chat `{"content": [...]}` (llama.cpp sends this shape
    for completions too, so completions carry it as well), completions also the legacy lists, whose
    `text_offset` goes on from `offset`. Returns (object, the offset after these tokens)."""
    out: dict[str, Any] = {"content": entries}
    if chat:
        return out, offset
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    out.update(
        tokens=[e["token"] for e in entries],
        token_logprobs=[e["logprob"] for e in entries],
        top_logprobs=[{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        text_offset=offsets,
    )
    return out, offset


async def _stream(
    request: Request, job: Job, rid: str, model: str, chat: bool, overflow: dict[str, Any] | None = None
) -> AsyncIterator[bytes]:
    """`overflow`: what was dropped to fit the context, said in the first chunk (a client can show it before the
    reply) and in the last."""
    created = int(time.time())
    want_logprobs = job.request.logprobs is not None
    pending: list[dict[str, Any]] = []  # log-probabilities of tokens whose text has not gone out yet
    offset = 0
    sent: dict[int, str] = {}  # each call whose head went out: the arguments sent so far

    def chunk(text: str | None, finish: str | None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        nonlocal pending, offset
        logprobs = None
        if want_logprobs and pending:
            logprobs, offset = _logprobs(pending, chat, offset)
            pending = []
        if chat:
            d = delta if delta is not None else ({"content": text} if text else {})
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": logprobs}
            body: dict[str, Any] = {"object": "chat.completion.chunk", "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            body = {"object": "text_completion", "choices": [choice]}
        return {"id": rid, **body, "created": created, "model": model}

    def sse(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    try:
        if chat:
            first = chunk(None, None, {"role": "assistant", "content": ""})
            if overflow:
                first["tokenwing"] = {"context_overflow": overflow}
            yield sse(first)
        while True:
            ev = await jobs.next_event(request, job)
            if ev is None:
                return
            if ev["type"] == "text":
                if not ev.get("streamed"):  # (a streamed call's block cut off: its pieces already went out)
                    yield sse(chunk(ev["text"], None))
            elif ev["type"] == "reasoning":
                yield sse(chunk(None, None, {"reasoning_content": ev["text"]}))
            elif ev["type"] in ("tool_call", "tool_call_head"):
                # as OpenAI streams a call: its id, type and name first (arguments empty), then the arguments: in
                # pieces as they are written (tool_call_args, under the calls' grammar), else whole when complete
                i = ev["index"]
                if i not in sent:
                    head = {"index": i, "id": ev["id"], "type": "function"}
                    head["function"] = {"name": ev["name"], "arguments": ""}
                    yield sse(chunk(None, None, {"tool_calls": [head]}))
                    sent[i] = ""
                if ev["type"] == "tool_call" and len(ev["arguments"]) > len(sent[i]):
                    rest = ev["arguments"][len(sent[i]) :]  # what its pieces did not send yet
                    yield sse(chunk(None, None, {"tool_calls": [{"index": i, "function": {"arguments": rest}}]}))
            elif ev["type"] == "tool_call_args":
                i = ev["index"]
                sent[i] += ev["text"]
                yield sse(chunk(None, None, {"tool_calls": [{"index": i, "function": {"arguments": ev["text"]}}]}))
            elif ev["type"] == "logprob":
                pending.append(ev["entry"])
            elif ev["type"] == "error":
                yield sse(jobs.event_error(ev).body())
                return
            else:
                last = chunk("", ev["finish_reason"], {})
                stats = ev.get("stats", {})
                last["tokenwing"] = {"finish_detail": stats.get("finish_detail"), "n_ctx": stats.get("n_ctx")}
                last["tokenwing"]["usage"] = jobs.usage(ev)  # (every stream's: the request log reads its tokens here)
                last["tokenwing"]["unenforced"] = job.request.unenforced
                last["tokenwing"].update(prompt_cache_routes.restored(stats))  # (its start read from the disk)
                if ev.get("context_overflow"):
                    last["tokenwing"]["context_overflow"] = ev["context_overflow"]
                yield sse(last)
                if job.request.include_usage:
                    usage: dict[str, Any] = {
                        "id": rid,
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": jobs.usage(ev),
                    }
                    yield sse(usage)
                yield b"data: [DONE]\n\n"
                return
    finally:
        job.cancelled.set()
