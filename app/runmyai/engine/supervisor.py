"""Runs `tokenwing serve` for the app: start, health, log, faults, restarts, and a stop that leaves no engine.

Life of one engine process:

* `tokenwing serve MODEL --host 127.0.0.1 --port P --watch-stdin FLAGS` in its own process group
  (`start_new_session`), a fresh API key in `TOKENWING_API_KEY` (never in argv, where `ps` shows it).
* stdout's first JSON line is the handshake (port, pid); stdout and stderr are then drained continuously into a
  bounded log (a full pipe would block the engine) and handed to `on_log`. stderr goes through a file, not a
  pipe (see `_open_engine_log`).
* `/health` is polled: 503 "loading" counts as alive, so the stall timer only runs out when the engine stops
  answering at all (SIGSTOP, a deadlock, a machine swapping itself to death); `load_timeout_s` bounds the load.
* An exit is classified (faults.py) into one sentence; a crash or a stall restarts the engine with exponential
  backoff, at most `max_restarts` times in a row (the count resets after a minute of being ready); a corrupt or
  unsupported model, bad input, out of memory and a failed start are final.
* `stop()`: close stdin (the engine exits by itself) -> wait -> SIGTERM the group -> wait -> SIGKILL the group.

No orphans: the engine's stdin is a pipe whose only writer is this process, and `--watch-stdin` makes the engine
exit when it reads EOF, which the kernel delivers when this process dies for any reason, SIGKILL included.
On Windows the same pipe rule holds; a Job Object with JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE would make it
independent of the engine's cooperation (not done yet: the stdin watch covers both platforms).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal

import httpx

from runmyai.engine.command import display_line, engine_command
from runmyai.engine.endpoint import Endpoint, http_client
from runmyai.engine.faults import EngineError, Fault, classify_exit, gave_up, oom_kill_count, stalled, start_failed

EngineState = Literal["stopped", "starting", "loading", "ready", "crashed", "restarting", "failed"]

API_KEY_ENV = "TOKENWING_API_KEY"
STABLE_S = 60.0  # ready this long, and the next crash counts as the first again
_MAX_LINE = 8192
_APP = "runmyai: "  # prefix of the supervisor's own lines in the log


class _Failure(Exception):
    def __init__(self, fault: Fault) -> None:
        super().__init__(fault.sentence)
        self.fault = fault


class _Lines:
    """Lines from a pipe or from a file being written (tailed until `finished()` says the writer is gone), without
    StreamReader's line-length limit: a long line is split, never fatal."""

    def __init__(
        self,
        stream: asyncio.StreamReader | None = None,
        file: BinaryIO | None = None,
        finished: Callable[[], bool] | None = None,
    ) -> None:
        self._stream = stream
        self._file = file
        self._finished = finished
        self._buf = b""

    async def _read(self) -> bytes:
        if self._stream is not None:
            return await self._stream.read(65536)
        assert self._file is not None
        while True:
            done = self._finished is None or self._finished()  # before the read: nothing written after it is lost
            chunk = self._file.read(65536)
            if chunk or done:
                return chunk
            await asyncio.sleep(0.1)

    async def next(self) -> str | None:
        while True:
            i = self._buf.find(b"\n")
            if i >= 0 or len(self._buf) >= _MAX_LINE:
                cut = i if 0 <= i < _MAX_LINE else _MAX_LINE
                line, self._buf = self._buf[:cut], self._buf[cut + 1 if cut == i else cut :]
                return line.decode("utf-8", "replace").rstrip("\r")
            chunk = await self._read()
            if not chunk:
                if self._buf:
                    line, self._buf = self._buf, b""
                    return line.decode("utf-8", "replace").rstrip("\r")
                return None
            self._buf += chunk


class EngineSupervisor:
    def __init__(
        self,
        model: Path,
        flags: Sequence[str] = (),
        *,
        on_state: Callable[[EngineState, Fault | None], None] | None = None,
        on_log: Callable[[str], None] | None = None,
        load_timeout_s: float = 600,
        max_restarts: int = 3,
        stall_timeout_s: float = 30,
        health_interval_s: float = 0.5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stop_grace_s: float = 5.0,
        log_lines: int = 2000,
        command: Sequence[str] | None = None,
        host: str = "127.0.0.1",
        log_dir: Path | None = None,
        keep_logs: int = 10,
        exit_codes: Mapping[str, int] | None = None,
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        """`command`: the argv prefix that runs tokenwing (default: engine_command(); tests and developers may
        wrap it). `log_dir`: keep each engine's log there (AppPaths.logs). `exit_codes`: the engine's names of its
        exit codes (`EngineInfo.exit_codes`), so that a fault is worded by its kind. The other timings are
        seconds. `port` and `api_key`: the local server the user turned on (Server page) — a fixed port other
        programs are pointed at, with the key they were given; by default any free port and a fresh key per start,
        known only to the app."""
        self.exit_codes = dict(exit_codes or {})
        self.model = Path(model)
        self.flags = list(flags)
        self.on_state = on_state
        self.on_log = on_log
        self.load_timeout_s = load_timeout_s
        self.max_restarts = max_restarts
        self.stall_timeout_s = stall_timeout_s
        self.health_interval_s = health_interval_s
        self.last_health: dict[str, Any] = {}  # the engine's last /health answer
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stop_grace_s = stop_grace_s
        self.command = list(command) if command is not None else engine_command()
        self.host = host
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.keep_logs = max(1, keep_logs)
        self.log_path: Path | None = None  # the current engine's log file, when kept

        self.state: EngineState = "stopped"
        self.endpoint: Endpoint | None = None
        self.fault: Fault | None = None  # the current fault (None while ready)
        self.last_fault: Fault | None = None  # the latest fault, kept after a successful restart
        self.restarts = 0  # restarts in a row (reset after STABLE_S ready)
        self.handshake: dict[str, Any] | None = None

        self._log: deque[str] = deque(maxlen=max(10, log_lines))
        self._launch_log: deque[str] = deque(maxlen=400)  # this process's lines only, for classification
        self._proc: asyncio.subprocess.Process | None = None
        self._drains: list[asyncio.Task[None]] = []
        self._watch_task: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None
        self._key: str | None = None
        self._port = port
        self.fixed_port = port != 0  # the user's port: if it is taken, say so (another port would reach nobody)
        self.api_key = api_key
        self._ready_at: float | None = None
        self._traceback_at: float | None = None
        self._stopping = False
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------------------------------ public
    @property
    def log(self) -> list[str]:
        return list(self._log)

    @property
    def pid(self) -> int | None:
        """The engine process's id while one runs."""
        p = self._proc
        return p.pid if p is not None and p.returncode is None else None

    async def start(self) -> Endpoint:
        """Starts the engine and returns once /health says ok. Raises EngineError(sentence) when it cannot
        (after the allowed restarts for a crash). Calling it while ready returns the current endpoint."""
        if self.state == "ready" and self.endpoint is not None:
            return self.endpoint
        await self._cancel_watch()  # an automatic restart in progress gives way to this fresh start
        async with self._lock:
            if self.state == "ready" and self.endpoint is not None:
                return self.endpoint
            await self._stop_process()
            self._stopping = False
            self.restarts = 0
            self.fault = None
            self._key = self.api_key or secrets.token_urlsafe(32)
            if self._http is None:
                self._http = await http_client(None, httpx.Timeout(2.0))
            try:
                endpoint = await self._launch_with_retries()
            except BaseException:
                if self._http is not None:
                    await self._http.aclose()
                    self._http = None
                raise
            if self._stopping:  # stop() was called meanwhile: it stops this engine as soon as it gets the lock
                raise EngineError("The engine was stopped before it was ready.", None)
            self._watch_task = asyncio.create_task(self._watch(), name="tokenwing-watch")
            return endpoint

    async def stop(self) -> None:
        """Stops the engine in stages (stdin EOF, SIGTERM, SIGKILL of its group) and waits until it is gone."""
        self._stopping = True
        await self._cancel_watch()
        await self._stop_process()  # a start() in progress sees its engine go and gives up
        async with self._lock:
            await self._cancel_watch()
            await self._stop_process()  # one that start() spawned after the first pass
            if self._http is not None:
                await self._http.aclose()
                self._http = None
            self.endpoint = None
            if self.state != "stopped":
                self._set_state("stopped", None)

    async def _cancel_watch(self) -> None:
        task, self._watch_task = self._watch_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------------------------------------ launching
    async def _launch_with_retries(self) -> Endpoint:
        while True:
            if self._stopping:
                raise EngineError("The engine was stopped before it was ready.", self.fault)
            try:
                return await self._launch()
            except _Failure as f:
                fault = f.fault
            self.fault = self.last_fault = fault
            if self._stopping:
                raise EngineError("The engine was stopped before it was ready.", fault)
            if not fault.restartable or self.restarts >= self.max_restarts:
                if fault.restartable:
                    fault = self.fault = self.last_fault = gave_up(fault, self.restarts)
                self._set_state("failed", fault)
                raise EngineError(fault.sentence, fault)
            self._set_state("crashed", fault)
            await self._backoff(fault)

    async def _backoff(self, fault: Fault) -> None:
        self.restarts += 1
        delay = min(self.backoff_s * 2 ** (self.restarts - 1), self.max_backoff_s)
        self._emit(f"{_APP}restarting the engine in {delay:.1f} s (attempt {self.restarts} of {self.max_restarts})")
        self._set_state("restarting", fault)
        await asyncio.sleep(delay)

    async def _launch(self) -> Endpoint:
        try:
            return await self._launch_once(self._port)
        except _Failure as f:
            # the old port was taken while the engine was down: any free port will do
            taken = f.fault.kind == "bad_input" and "cannot listen on" in (f.fault.detail or "")
            if self._port != 0 and not self.fixed_port and taken:
                self._port = 0
                return await self._launch_once(0)
            raise

    async def _launch_once(self, port: int) -> Endpoint:
        self._set_state("starting", self.fault)
        self.endpoint = None
        self.handshake = None
        self._ready_at = None
        self._traceback_at = None
        self._launch_log.clear()
        argv = [*self.command, "serve", str(self.model), "--host", self.host, "--port", str(port), "--watch-stdin"]
        argv += self.flags
        env = dict(os.environ)
        env[API_KEY_ENV] = self._key or secrets.token_urlsafe(32)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._emit(f"{_APP}starting the engine: {display_line(argv)}")
        oom_before = oom_kill_count()
        # Windows: CREATE_NEW_PROCESS_GROUP | CREATE_NO_WINDOW (the console engine opens no window of its own)
        extra: dict[str, Any] = (
            {"creationflags": 0x00000200 | 0x08000000} if os.name == "nt" else {"start_new_session": True}
        )
        try:
            err_write, err_read = self._open_engine_log()
        except OSError as e:
            raise _Failure(start_failed(f"cannot create the engine's log file: {e.strerror or e}")) from None
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err_write,
                env=env,
                **extra,
            )
        except OSError as e:
            err_read.close()
            reason = f"{argv[0]}: {e.strerror or e}"
            self._emit(f"{_APP}{reason}")
            raise _Failure(start_failed(reason)) from None
        finally:
            err_write.close()  # the engine has its own copy
        self._proc = proc
        assert proc.stdout is not None
        stdout = _Lines(proc.stdout)
        stderr = _Lines(file=err_read, finished=lambda: proc.returncode is not None)
        self._drains = [asyncio.create_task(self._drain(stderr, err_read), name="tokenwing-stderr")]
        exited = asyncio.ensure_future(proc.wait())
        try:
            started = time.monotonic()
            handshake = await self._read_handshake(stdout, started)
            self._drains.append(asyncio.create_task(self._drain(stdout), name="tokenwing-stdout"))
            if handshake is None:
                raise _Failure(await self._exit_fault(proc, oom_before))
            self.handshake = handshake
            port = int(handshake["port"])
            self._port = port
            self._emit(f"{_APP}engine pid {proc.pid} listening on {self.host}:{port}; loading the model")
            self._set_state("loading", self.fault)
            await self._wait_ready(proc, exited, port, started, oom_before)
        except BaseException:
            if proc.returncode is None:
                await self._kill(proc)
            raise
        finally:
            exited.cancel()
        model = handshake.get("model")
        self.endpoint = Endpoint(
            f"http://{self._url_host()}:{port}/v1",
            env[API_KEY_ENV],
            model if isinstance(model, str) else None,
            local=True,
        )
        self.fault = None
        self._ready_at = time.monotonic()
        self._emit(f"{_APP}the engine is ready")
        self._set_state("ready", None)
        return self.endpoint

    def _url_host(self) -> str:
        """Where the app itself reaches the engine: listening on every address (the local network), at loopback."""
        if self.host in ("0.0.0.0", "::"):
            return "127.0.0.1" if self.host == "0.0.0.0" else "[::1]"
        return f"[{self.host}]" if ":" in self.host else self.host

    async def _read_handshake(self, stdout: _Lines, started: float) -> dict[str, Any] | None:
        """The handshake line; None when stdout ended first (the engine refused to start)."""
        while True:
            left = self.load_timeout_s - (time.monotonic() - started)
            try:
                line = await asyncio.wait_for(stdout.next(), timeout=max(left, 0.01))
            except TimeoutError:
                raise _Failure(stalled(self.load_timeout_s, loading=True)) from None
            if line is None:
                return None
            try:
                data = json.loads(line)
            except ValueError:
                data = None
            if isinstance(data, dict) and isinstance(data.get("port"), int):
                self._emit(line)
                return data
            self._emit(line)

    async def _wait_ready(
        self, proc: asyncio.subprocess.Process, exited: asyncio.Future[int], port: int, started: float, oom: int | None
    ) -> None:
        last_alive = time.monotonic()
        interval = 0.05
        while True:
            if proc.returncode is not None:
                raise _Failure(await self._exit_fault(proc, oom))
            status = await self._health(port)
            now = time.monotonic()
            if status is not None:
                last_alive = now
            if status == "ok":
                return
            if self._traceback_at is not None and now - self._traceback_at > 3 and proc.returncode is None:
                # the loading thread died with an exception and the server lingers "loading": not coming back
                self._emit(f"{_APP}the engine failed while loading the model; stopping it")
                await self._kill(proc)
                raise _Failure(await self._exit_fault(proc, oom, killed_by_us=True))
            if now - last_alive > self.stall_timeout_s:
                await self._kill(proc)
                raise _Failure(stalled(self.stall_timeout_s, loading=True))
            if now - started > self.load_timeout_s:
                await self._kill(proc)
                raise _Failure(stalled(self.load_timeout_s, loading=True))
            await asyncio.wait({exited}, timeout=interval)
            interval = min(interval * 1.5, self.health_interval_s)

    async def _health(self, port: int) -> str | None:
        """ "ok", "loading", "error" (any answer means alive), or None when nothing answered."""
        assert self._http is not None
        try:
            r = await self._http.get(f"http://{self._url_host()}:{port}/health")
        except httpx.HTTPError:
            return None
        try:
            body = r.json()
            status = body.get("status")
        except (ValueError, AttributeError):
            return "error"
        self.last_health = body  # (the engine's facts of the moment: its slots, the queue)
        return status if isinstance(status, str) else "error"

    # ------------------------------------------------------------------------------------------ running
    async def _watch(self) -> None:
        """While the engine runs: health polling and stall detection; on an exit, classify and restart."""
        while not self._stopping:
            proc = self._proc
            if proc is None:
                return
            fault = await self._monitor(proc)
            if self._stopping:
                return
            self.endpoint = None
            self.fault = self.last_fault = fault
            self._set_state("crashed", fault)
            if self._ready_at is not None and time.monotonic() - self._ready_at > STABLE_S:
                self.restarts = 0
            if not fault.restartable or self.restarts >= self.max_restarts:
                if fault.restartable:
                    fault = self.fault = self.last_fault = gave_up(fault, self.restarts)
                self._set_state("failed", fault)
                return
            await self._backoff(fault)
            try:
                async with self._lock:
                    if self._stopping:
                        return
                    await self._launch_with_retries()
            except EngineError:
                return

    async def _monitor(self, proc: asyncio.subprocess.Process) -> Fault:
        oom = oom_kill_count()
        exited = asyncio.ensure_future(proc.wait())
        last_alive = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({exited}, timeout=self.health_interval_s)
                if done:
                    return await self._exit_fault(proc, oom)
                status = await self._health(self._port)
                now = time.monotonic()
                if status is not None:
                    last_alive = now
                elif now - last_alive > self.stall_timeout_s and proc.returncode is None:
                    self._emit(f"{_APP}no answer from the engine for {now - last_alive:.0f} s: stopping it")
                    await self._kill(proc)
                    await self._exit_fault(proc, oom, killed_by_us=True)  # drains the log
                    return stalled(self.stall_timeout_s, loading=False)
        finally:
            exited.cancel()

    async def _exit_fault(
        self, proc: asyncio.subprocess.Process, oom_before: int | None, killed_by_us: bool = False
    ) -> Fault:
        try:
            await asyncio.wait_for(proc.wait(), timeout=10)
        except TimeoutError:
            await self._kill(proc)
        if self._drains:
            await asyncio.wait(self._drains, timeout=5)
        code = proc.returncode
        oom_after = oom_kill_count()
        sigkill = code in (-signal.SIGKILL, 137) if hasattr(signal, "SIGKILL") else False
        oom_killed = (
            sigkill and not killed_by_us and oom_before is not None and oom_after is not None and oom_after > oom_before
        )
        self._emit(f"{_APP}the engine exited with code {code}")
        return classify_exit(
            code if not killed_by_us else None,
            list(self._launch_log),
            oom_killed=oom_killed,
            exit_codes=self.exit_codes,
        )

    async def _drain(self, lines: _Lines, closing: BinaryIO | None = None) -> None:
        try:
            while (line := await lines.next()) is not None:
                self._emit(line)
        finally:
            if closing is not None:
                closing.close()

    def _open_engine_log(self) -> tuple[BinaryIO, BinaryIO]:
        """(the engine's stderr, our reader of it): a file, not a pipe. A pipe's reader dies with the app, and an
        engine that then writes to stderr gets EPIPE; the engine's stdin watcher logs "stdin closed" before it
        stops the server, so with a pipe it would die there and the engine would outlive the app. A file never
        breaks. With `log_dir` the file is kept (the newest `keep_logs`); else it is a nameless temporary file."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            old = sorted(self.log_dir.glob("engine-*.log"), key=lambda p: p.stat().st_mtime)
            for p in old[: max(0, len(old) - self.keep_logs + 1)]:
                with contextlib.suppress(OSError):
                    p.unlink()
            path = self.log_dir / f"engine-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}.log"
            self.log_path = path
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        else:
            fd, name = tempfile.mkstemp(prefix="tokenwing-", suffix=".log")
            path = Path(name)
            self.log_path = None
            os.close(fd)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        write = os.fdopen(fd, "ab")
        read = open(path, "rb")  # noqa: SIM115  # closed by the drain task
        if self.log_dir is None and os.name != "nt":
            path.unlink()  # both descriptors stay valid; nothing is left on disk
        return write, read

    # ------------------------------------------------------------------------------------------ stopping
    async def _stop_process(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            self._emit(f"{_APP}stopping the engine")
            if proc.stdin is not None:
                proc.stdin.close()  # --watch-stdin: the engine stops by itself
            if not await self._wait(proc, self.stop_grace_s):
                self._emit(f"{_APP}the engine did not stop within {self.stop_grace_s:g} s: SIGTERM")
                self._signal(proc, signal.SIGTERM)
                if not await self._wait(proc, self.stop_grace_s):
                    self._emit(f"{_APP}the engine did not stop within {self.stop_grace_s:g} s after SIGTERM: SIGKILL")
                    await self._kill(proc)
        self._signal(proc, signal.SIGKILL if hasattr(signal, "SIGKILL") else signal.SIGTERM)  # stragglers
        if self._drains:
            await asyncio.wait(self._drains, timeout=2)
        for t in self._drains:
            t.cancel()
        self._drains = []
        self._proc = None

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        self._signal(proc, signal.SIGKILL if hasattr(signal, "SIGKILL") else signal.SIGTERM)
        await self._wait(proc, 10)

    @staticmethod
    async def _wait(proc: asyncio.subprocess.Process, seconds: float) -> bool:
        try:
            await asyncio.wait_for(proc.wait(), timeout=seconds)
            return True
        except TimeoutError:
            return False

    @staticmethod
    def _signal(proc: asyncio.subprocess.Process, sig: int) -> None:
        """The signal to the engine's whole process group (anything it started goes with it)."""
        try:
            if os.name == "nt":
                if proc.returncode is None and sig == signal.SIGTERM:
                    proc.terminate()
                elif proc.returncode is None:
                    proc.kill()
            else:
                os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    # ------------------------------------------------------------------------------------------ callbacks
    def _set_state(self, state: EngineState, fault: Fault | None) -> None:
        self.state = state
        if self.on_state is not None:
            try:
                self.on_state(state, fault)
            except Exception as e:  # a UI bug must not take the supervisor down
                self._emit(f"{_APP}on_state callback failed: {type(e).__name__}: {e}")

    def _emit(self, line: str) -> None:
        if len(line) > _MAX_LINE:
            line = line[:_MAX_LINE]
        self._log.append(line)
        self._launch_log.append(line)
        if line.startswith(("Traceback (most recent call last)", "Exception in thread")) and self.state == "loading":
            self._traceback_at = time.monotonic()
        if self.on_log is not None:
            with contextlib.suppress(Exception):
                self.on_log(line)
