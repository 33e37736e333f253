"""What the live graphs cost the app: CPU of the UI process while the stats stream runs at 20 tokens/s.

A separate process serves the engine's stats stream (docs/api.md: one `event: token` per token, one entry per
streamed layer) at a steady rate; this process runs the real StatsClient and GraphsPanel on the qasync loop,
shown on the offscreen platform, and measures its own CPU time (all threads) against an idle baseline.

    python bench/graphs_bench.py [--rate 20] [--layers 94] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import qasync
from PySide6.QtWidgets import QApplication

from runmyai.engine.endpoint import Endpoint
from runmyai.engine.stats import StatsClient
from runmyai.ui.graphs import GraphsPanel

EMITTER = r"""
import json, random, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
rate, layers = float(sys.argv[1]), int(sys.argv[2])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        t, start = 0, time.monotonic()
        while True:
            t += 1
            ev = {"token": t, "layers": [{"layer": i, "hits": random.randint(4, 8), "misses": random.randint(0, 4)}
                  for i in range(layers)], "ssd_wait_ms": random.random() * 5, "bytes_read": random.randint(0, 9 << 20),
                  "prefetch_issued": 8, "prefetch_used": 6, "vram_swaps": 0, "prediction_recall": [0.7, 0.55],
                  "tokens_per_s": rate}
            try:
                self.wfile.write(f"event: token\ndata: {json.dumps(ev)}\n\n".encode()); self.wfile.flush()
            except OSError:
                return
            time.sleep(max(0.0, start + t / rate - time.monotonic()))
srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure(panel: GraphsPanel, seconds: float, port: int | None) -> tuple[float, int]:
    received = 0

    async def follow() -> None:
        nonlocal received
        assert port is not None
        async for event in StatsClient(Endpoint(f"http://127.0.0.1:{port}/v1", None)).events():
            panel.add(event)
            received += 1

    task = asyncio.ensure_future(follow()) if port is not None else None
    await asyncio.sleep(1.0)  # connect and warm up
    start_cpu, start = cpu_seconds(), time.monotonic()
    before = received
    await asyncio.sleep(seconds)
    used = (cpu_seconds() - start_cpu) / (time.monotonic() - start)
    if task is not None:
        task.cancel()
    return used, received - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20.0, help="tokens per second")
    ap.add_argument("--layers", type=int, default=94, help="streamed layers per event (Qwen3-235B: 94)")
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    emitter = subprocess.Popen(
        [sys.executable, "-c", EMITTER, str(args.rate), str(args.layers)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert emitter.stdout is not None
        port = int(emitter.stdout.readline())
        app = QApplication([])
        loop = qasync.QEventLoop(app)
        asyncio.set_event_loop(loop)
        panel = GraphsPanel()
        panel.resize(420, 900)
        panel.show()
        with loop:
            idle, _ = loop.run_until_complete(measure(panel, args.seconds, None))
            busy, events = loop.run_until_complete(measure(panel, args.seconds, port))
        print(f"stats stream at {args.rate:g} tokens/s, {args.layers} layers, {args.seconds:g} s per phase")
        print(f"events drawn: {events} ({events / args.seconds:.1f}/s)")
        print(f"app CPU idle (window shown, no stream): {idle * 100:.2f} % of one core")
        print(f"app CPU with the live graphs:           {busy * 100:.2f} % of one core")
        print(f"cost of the graphs:                     {(busy - idle) * 100:.2f} % of one core (bar: < 5 %)")
    finally:
        emitter.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
