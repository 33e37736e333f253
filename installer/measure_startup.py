"""Start times of an unpacked bundle: the frozen engine to its handshake and to ready, and the frozen app's
--self-test, each cold (the bundle's files dropped from the page cache with posix_fadvise, only those files) and
warm. Prints a Markdown table. Linux only.

    python installer/measure_startup.py BUNDLE_DIR MODEL.tw.gguf [--runs 3] [--variant avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from memcap import evict_from_page_cache


def drop_from_page_cache(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            evict_from_page_cache(str(p))


def engine_start(bundle: Path, model: Path, env: dict[str, str]) -> tuple[float, float]:
    """(seconds to the handshake line, seconds to /health ok)."""
    t = time.monotonic()
    proc = subprocess.Popen(
        [str(bundle / "tokenwing"), "serve", str(model), "--port", "0", "--watch-stdin"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    handshake = json.loads(proc.stdout.readline())
    shake = time.monotonic() - t
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{handshake['port']}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.02)
    ready = time.monotonic() - t
    proc.stdin.close()
    proc.wait(timeout=30)
    return shake, ready


def app_self_test(bundle: Path, model: Path, env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as home:
        t = time.monotonic()
        subprocess.run(
            [str(bundle / "runmyai"), "--offscreen", "--self-test", "--model", str(model), "--home", home],
            env=env,
            check=True,
            capture_output=True,
            timeout=400,
        )
        return time.monotonic() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("model", type=Path)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--variant", default="avx2")
    a = p.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "LD_", "QT_"))}
    env["TOKENWING_CPU_VARIANT"] = a.variant
    env["TOKENWING_API_KEY"] = "measure"
    rows: dict[str, list[float]] = {}
    for cache in ("cold", "warm"):
        for _ in range(a.runs):
            if cache == "cold":
                drop_from_page_cache(a.bundle)
            shake, ready = engine_start(a.bundle, a.model, env)
            rows.setdefault(f"engine to handshake, {cache}", []).append(shake)
            rows.setdefault(f"engine to ready (/health ok), {cache}", []).append(ready)
            if cache == "cold":
                drop_from_page_cache(a.bundle)
            rows.setdefault(f"app --self-test (open, engine, one reply, close), {cache}", []).append(
                app_self_test(a.bundle, a.model, env)
            )
    print(f"| {a.runs} runs each, TOKENWING_CPU_VARIANT={a.variant} | median s | min s | max s |")
    print("|---|---|---|---|")
    for name in sorted(rows, key=lambda n: (n.split(",")[0], n.endswith("warm"))):
        v = rows[name]
        print(f"| {name} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
