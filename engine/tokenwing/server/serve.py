"""`tokenwing serve`: binds first (port 0 = any free port), prints the one-line JSON handshake, loads the model
in the engine thread while /health says "loading", then serves until SIGTERM/SIGINT (or stdin EOF when asked).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from collections.abc import Sequence

import uvicorn

from tokenwing import testpause
from tokenwing.errors import BadInputError, TokenWingError
from tokenwing.format.reader import ModelFile
from tokenwing.runtime.preflight import preflight
from tokenwing.runtime.session import SessionOptions
from tokenwing.server.access_log import AccessLog
from tokenwing.server.app import API_VERSION, create_app
from tokenwing.server.guard import Access, Guard
from tokenwing.server.http_protocol import JsonErrorH11Protocol
from tokenwing.server.prompt_disk_cache import DiskCacheSettings
from tokenwing.server.worker import EngineWorker
from tokenwing.text import render_worker
from tokenwing.version import __version__

API_KEY_ENV = "TOKENWING_API_KEY"
STOP_JOIN_S = 10.0  # the engine thread's time to finish a token and close the session (past it: exit anyway)


def serve(
    model: str,
    options: SessionOptions,
    host: str,
    port: int,
    watch_stdin: bool,
    notes: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
    cors_origins: Sequence[str] = (),
    context_overflow: str = "rolling",
    request_log: bool = False,
    prompt_cache_dir: str | None = None,
    prompt_cache_size: str | None = None,
    mmproj: str | None = None,
    allow_image_urls: bool = False,
) -> int:
    """Serves until stopped; `notes` (the device line) are logged once the model and the port are known good.
    `allowed_hosts` and `cors_origins` are who else may call it (server/guard.py); `context_overflow` is what a
    chat request that does not fit the context gets where it names no policy (server/overflow.py);
    `prompt_cache_dir` and `_size` the prompt cache on disk (server/prompt_disk_cache.py); `mmproj` the image encoder
    of a model that takes images, `allow_image_urls` whether an image_url may name a remote image (server/images.py)."""

    def log(line: str) -> None:
        print(f"tokenwing: {line}", file=sys.stderr, flush=True)

    access = Access(host, allowed_hosts, cors_origins)  # a bad flag stops here, before the model is read
    api_key = os.environ.get(API_KEY_ENV) or None
    # A file that is not a model, corrupt or of an architecture we cannot run stops here, before the
    # handshake: the supervisor sees a one-line error and an exit code, not a server that never gets ready.
    with ModelFile.open(model) as mf:
        mf.verify()
        preflight(mf, probe_template=True)
    if mmproj is not None and not os.path.isfile(mmproj):  # (its contents are checked as the model loads)
        raise BadInputError(f"--mmproj {mmproj}: no such file")
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise BadInputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)

    for note in [*notes, *access.notes(keyed=api_key is not None)]:
        log(note)
    disk_cache = DiskCacheSettings(prompt_cache_dir, prompt_cache_size)  # (opened once the model is loaded)
    worker = EngineWorker(
        model,
        options,
        log,
        context_overflow=context_overflow,
        disk_cache=disk_cache,
        mmproj=mmproj,
        allow_image_urls=allow_image_urls,
    )
    model_id = os.path.basename(model).removesuffix(".gguf").removesuffix(".tw")
    app = create_app(worker, model_id, api_key)
    bound = sock.getsockname()
    print(
        json.dumps(
            {
                "port": bound[1],
                "host": host,
                "pid": os.getpid(),
                "version": __version__,
                "api_version": API_VERSION,
                "model": model_id,
            }
        ),
        flush=True,
    )
    worker.start()
    server = _Server(
        worker,
        # (a reply still streaming when SIGTERM comes is cut after a second, not waited for: the stop takes < 2 s)
        uvicorn.Config(
            # (uvicorn's own access log is off: with --request-log, AccessLog writes one line per API request)
            AccessLog(Guard(app, access, log), log) if request_log else Guard(app, access, log),
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=1,
            http=JsonErrorH11Protocol,  # (an unparseable request's 400 in the JSON error format too)
        ),
    )
    if watch_stdin:

        def wait_eof() -> None:
            while os.read(sys.stdin.fileno(), 4096):
                pass
            server.should_exit = True  # first: the log below fails if the app (our stderr) is gone
            with contextlib.suppress(OSError):
                log("stdin closed: stopping")

        threading.Thread(target=wait_eof, daemon=True).start()
    worker.on_fatal = lambda: setattr(server, "should_exit", True)
    try:
        server.run(sockets=[sock])
    finally:
        # a render in progress ends now (the engine thread gets an error), SIGTERM's Interrupted too, which uvicorn
        # raises again as server.run returns: the stop waits on no template
        render_worker.stop()
        testpause.pause("serve.stopped")  # tests: the server's loop has closed, the engine thread not yet joined
        # here too, not after the try: on SIGTERM/SIGINT uvicorn raises its Interrupted again as server.run
        # returns, and a stop placed after this block was skipped, so the engine thread's StreamCore and
        # DirectFile were alive at the interpreter's exit (nanobind's ~17-line leak report at every stop)
        worker.stop(timeout=STOP_JOIN_S)
    if worker.state == "error":
        kind = type(worker.load_error) if worker.load_error is not None else TokenWingError
        raise kind(f"the model failed to load: {worker.error}")
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server whose shutdown answers the requests still open first (EngineWorker.stop_soon): a 503 in
    the JSON error format within the grace period, not a handler cancelled after it."""

    def __init__(self, worker: EngineWorker, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.worker = worker

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.worker.stop_soon()
        await super().shutdown(sockets)
