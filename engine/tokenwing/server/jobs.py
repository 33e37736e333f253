"""A request's life in the engine, shared by every API route (chat and text completions, Responses, Messages):
submitted to the worker, accepted or refused, then its events (text, reasoning, tool_call_head, tool_call_args,
tool_call, logprob, error, and the final one with `finish_reason`, usage and stats) until the end or the client
leaves."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from tokenwing.errors import BadInputError
from tokenwing.server.image_parts import ImageSource
from tokenwing.server.images import decode_ahead, request_images
from tokenwing.server.protocol import GenerationRequest, RequestError
from tokenwing.server.worker import EngineWorker, Job
from tokenwing.text.tools.reply import prepare


async def submit(worker: EngineWorker, req: GenerationRequest) -> Job:
    """The request queued for the engine; a 503 at once where it asked not to wait and every slot is busy. Its
    images are fetched and decoded first, on a thread of their own (images.decode_ahead): never on the engine
    thread, which only encodes them; a bad one is the same 400 the engine thread would give."""
    if not req.wait and worker.free_slots() <= 0:
        n = worker.session.n_seq if worker.session is not None else 1
        raise RequestError(f"all {n} slots are busy (the request asked not to wait)", "wait", status=503)
    if req.images:
        try:
            req.images[:] = await asyncio.to_thread(decode_ahead, worker.vision, req.images)
        except BadInputError as e:
            raise RequestError(str(e)) from None
    job = Job(req, asyncio.get_running_loop(), asyncio.Queue())
    worker.submit(job)
    return job


async def next_event(request: Request, job: Job) -> dict[str, Any] | None:
    """The job's next event; None when the client went away (the job is then cancelled)."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=0.5)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                return None


async def accepted(request: Request, job: Job) -> dict[str, Any] | None:
    """Waits until the engine takes the job (its "accepted" event); raises its refusal as a RequestError. A
    refused job, one whose client left (None: the route answers 499) or whose handler was cancelled is cancelled
    for the engine too. Every route asks this before it answers: a refusal (a prompt longer than the context, a
    template error) gets its status before any stream starts."""
    try:
        ev = await next_event(request, job)
        if ev is None:
            job.cancelled.set()
        elif ev["type"] == "error":
            raise event_error(ev)
    except BaseException:
        job.cancelled.set()
        raise
    return ev


def event_error(ev: dict[str, Any]) -> RequestError:
    status = int(ev.get("status", 400))
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return RequestError(ev["message"], ev.get("param"), status=status, kind=kind, code=ev.get("code"))


def call(ev: dict[str, Any]) -> dict[str, Any]:
    return {"id": ev["id"], "type": "function", "function": {"name": ev["name"], "arguments": ev["arguments"]}}


def usage(ev: dict[str, Any]) -> dict[str, int]:
    p, c = int(ev.get("prompt_tokens", 0)), int(ev.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


UNENFORCED_HEADER = "X-TokenWing-Unenforced"


def unenforced_headers(req: GenerationRequest) -> dict[str, str]:
    """The response header that names the schema keywords the request's grammar did not enforce (none where all
    was): `X-TokenWing-Unenforced: kw1,kw2`. A name comes from the client's schema (an unknown format's): printable
    ASCII only, so that no name can break or add a header line."""
    names = ("".join(c if " " <= c <= "~" and c != "," else "?" for c in k) for k in req.unenforced)
    return {UNENFORCED_HEADER: ",".join(names)} if req.unenforced else {}


def prompt_tokens(
    worker: EngineWorker,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    variables: dict[str, Any],
    add_generation_prompt: bool = True,
    images: list[ImageSource] | None = None,
) -> int:
    """The tokens of the prompt a chat makes, as the engine would run it (before any overflow policy): the model's
    own template, the tools shown as the worker shows them (/v1/chat/count, /v1/messages/count_tokens). It renders
    and tokenizes: call it beside the engine's thread (asyncio.to_thread). Raises BadInputError for a conversation
    the template refuses. `images`: the messages' image parts (their rows counted as the engine places them)."""
    assert worker.chat is not None and worker.syntax is not None and worker.session is not None  # (state ok)
    shown = prepare(worker.syntax, messages, tools)
    text = worker.chat.template.render(shown, add_generation_prompt, tools=tools, **variables)
    counted = request_images(worker.vision, worker.session, images or [], encode=False)
    return len(counted.encode(text) if counted is not None else worker.session.tokenizer.encode(text, special=True))
