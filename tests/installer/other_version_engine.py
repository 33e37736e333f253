"""A named stand-in for `tokenwing serve` of ANOTHER version (a real one cannot be produced from this checkout).

It speaks the start-up protocol of docs/api.md and nothing more: prints the handshake line with the version
from OTHER_ENGINE_VERSION (default 0.0.0-other), answers `GET /health` with `{"status": "ok"}`, and exits when
its stdin closes (as `--watch-stdin` does). Run as `python other_version_engine.py serve MODEL --host H --port P …`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.path.split("?")[0] == "/health"
        body = json.dumps({"status": "ok"} if ok else {"error": "not found"}).encode()
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main(argv: list[str]) -> int:
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 0
    server = ThreadingHTTPServer((host, port), _Health)
    handshake = {
        "port": server.server_address[1],
        "host": host,
        "pid": os.getpid(),
        "version": os.environ.get("OTHER_ENGINE_VERSION", "0.0.0-other"),
        "api_version": "1",
        "model": "other-version-stand-in",
    }
    print(json.dumps(handshake), flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stdin.buffer.read()  # until EOF: the supervisor closed our stdin (or died)
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
