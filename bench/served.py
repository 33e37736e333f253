"""One `tokenwing serve` for a bench, as a real subprocess: the one home of the benches' server start (port from
the line it prints, wait for /health, stderr kept for the tracebacks check, stopped at the end).

    with Served(model, key, ["--ctx", "512"]) as s:
        httpx.get(s.url + "/health")
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from types import TracebackType

import httpx


class Served:
    def __init__(self, model: str, key: str, flags: list[str], stop_timeout: float = 60) -> None:
        self.model, self.key, self.flags, self.stop_timeout = model, key, flags, stop_timeout
        self.log: list[str] = []
        self.url = ""
        self.pid = 0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Served:
        env = {**os.environ, "TOKENWING_API_KEY": self.key}
        argv = [sys.executable, "-m", "tokenwing", "serve", self.model, "--no-usage-table", *self.flags]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self._proc, self.pid = proc, proc.pid
        assert proc.stdout is not None and proc.stderr is not None
        threading.Thread(target=lambda: self.log.extend(proc.stderr or ()), daemon=True).start()
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            raise SystemExit(f"the server stopped (exit {proc.returncode}): {''.join(self.log[-5:])}")
        self.url = f"http://127.0.0.1:{json.loads(line)['port']}"
        # A bench, not a test: polling /health until the server answers is how a client would wait too.
        while True:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the server stopped (exit {proc.returncode})")
            time.sleep(0.05)
        return self

    def tracebacks(self) -> int:
        """Lines of the server's log so far that open a traceback."""
        return sum("Traceback" in line for line in self.log)

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=self.stop_timeout)
