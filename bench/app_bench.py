"""How quickly the app answers: UI and event-loop stalls, download speed reporting, cancels and stops.

The correctness tests assert no such durations (a busy machine fails them without any fault in the code; they
keep only bounds 5x above the worst seen under load); this measures them. Run it on an idle machine:

    python bench/app_bench.py [--rounds 3] [--json]

Real parts throughout: the tests' local hub server (tests/app/hubserver.py), a generated model repacked by the
engine, the engine as a subprocess, the app's own DownloadManager, EngineSupervisor, ChatClient, LocalLibrary and
(offscreen) window. Each measurement runs `--rounds` times; a row gives the median, least and most.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' hub server and window helpers
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("GGML_NO_BACKTRACE", "1")

from runmyai.engine.client import ChatClient, ChatSettings  # noqa: E402
from runmyai.engine.supervisor import EngineSupervisor  # noqa: E402
from runmyai.library.downloads import DownloadManager  # noqa: E402
from runmyai.library.hub import HubClient, HubError  # noqa: E402
from runmyai.library.local import ImportCancelled, LocalLibrary  # noqa: E402
from tests.app.conftest import FILE, REPO  # noqa: E402
from tests.app.hubserver import HubServer  # noqa: E402
from tests.pauses import Pauses  # noqa: E402
from tokenwing.format.repack import repack  # noqa: E402
from tokenwing.testmodel import preset_shape, write_test_model  # noqa: E402

HELLO = [{"role": "user", "content": "Hello"}]
LONG = ChatSettings(temperature=1.5, seed=2, max_tokens=300)


class LoopLag:
    """The event loop's worst delay in running a 5 ms timer: what a blocking call shows up as."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append(time.perf_counter() - t - 0.005)

    async def stop(self) -> float:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return max(self.lags, default=0.0)


async def timed(action: Awaitable[Any]) -> float:
    t = time.perf_counter()
    with contextlib.suppress(asyncio.CancelledError, ImportCancelled, HubError):
        await action
    return time.perf_counter() - t


def models(folder: Path) -> tuple[Path, Path]:
    """A generated GGUF (for imports) and its repacked file (for the engine): the tests' tiny model."""
    gguf = folder / "m.gguf"
    write_test_model(str(gguf), preset_shape("tiny"), "Q8_0")
    out = folder / "m.tw.gguf"
    repack([str(gguf)], str(out), show_progress=False)
    return gguf, out


# ---------------------------------------------------------------------------------------------- measurements
async def download_lag_and_speed(tmp: Path) -> dict[str, float]:
    """A 12 MiB download with a dropped connection (loop lag), then a 3 MiB one throttled to 2 MB/s (the speed the
    app reports, against the real rate)."""
    big, small = os.urandom(12 << 20), os.urandom(3 << 20)
    with HubServer() as hub:
        hub.add_file(REPO, "big.tw.gguf", big)
        hub.add_file(REPO, "small.tw.gguf", small)
        hub.faults.drop_after = 5_000_000
        events: list[Any] = []
        manager = DownloadManager(HubClient(endpoint=hub.url), tmp / "state", tmp / "models", events.append)
        await manager.start()
        lag = LoopLag()
        await manager.wait(manager.enqueue(REPO, "big.tw.gguf"))
        worst = await lag.stop()
        hub.faults.throttle_bps = 2_000_000
        events.clear()
        await manager.wait(manager.enqueue(REPO, "small.tw.gguf"))
        await manager.close()
    speeds = [e.speed_bps for e in events if e.state == "downloading" and e.speed_bps > 0]
    late = speeds[len(speeds) // 2 :] or [0.0]
    return {"download loop lag, worst (ms)": worst * 1e3, "reported speed / real rate": statistics.median(late) / 2e6}


async def engine_stops(model: Path) -> dict[str, float]:
    """Closing a reply's stream, cancelling its task, and the supervisor's staged stop (stdin EOF)."""
    sup = EngineSupervisor(model, ["--ctx", "512"])
    lag = LoopLag()
    endpoint = await sup.start()
    client = ChatClient(endpoint)
    stream = client.stream_chat(HELLO, LONG)
    async for d in stream:
        if d.text:
            break
    close_s = await timed(stream.aclose())
    got_first = asyncio.Event()

    async def consume() -> None:
        async for d in client.stream_chat(HELLO, LONG):
            if d.text:
                got_first.set()

    task = asyncio.ensure_future(consume())
    await got_first.wait()
    task.cancel()
    cancel_s = await timed(task)
    await client.aclose()
    stop_s = await timed(sup.stop())
    return {
        "reply stream closed (ms)": close_s * 1e3,
        "reply task cancelled (ms)": cancel_s * 1e3,
        "supervisor stop (s)": stop_s,
        "supervisor loop lag, worst (ms)": await lag.stop() * 1e3,
    }


async def import_cancel(gguf: Path, tmp: Path) -> dict[str, float]:
    """An import cancelled while the engine writes: from the cancel to the import's end (nothing kept)."""
    pauses = Pauses(tmp / "pauses", "repack.write")
    os.environ.update(pauses.env({}))
    try:
        lib = LocalLibrary(tmp / "models")
        cancel = asyncio.Event()
        task = asyncio.ensure_future(lib.import_gguf([gguf], cancel=cancel))
        await pauses.wait_async("repack.write", alive=lambda: not task.done())
        cancel.set()
        took = await timed(task)
    finally:
        for key in pauses.env({}):
            os.environ.pop(key, None)
    return {"import cancel (ms)": took * 1e3}


async def hub_answers() -> dict[str, float]:
    offline = await timed(HubClient(endpoint="http://127.0.0.1:9", offline=True).search("qwen"))
    import socket

    with socket.socket() as s:  # accepts connections but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        client = HubClient(endpoint=f"http://127.0.0.1:{s.getsockname()[1]}", request_timeout_s=0.5)
        unresponsive = await timed(client.list_files("acme/x"))
    return {"hub offline answer (ms)": offline * 1e3, "unresponsive hub, 0.5 s timeout (s)": unresponsive}


def ui_stalls(tmp: Path, model: Path) -> dict[str, float]:
    """The window while a throttled download (with a dropped connection) runs, then two chat replies."""
    import qasync
    from PySide6.QtWidgets import QApplication

    from tests.app.test_app_scenario import make_controller
    from tests.app.watchdog import LoopWatchdog

    app = QApplication.instance() or QApplication([])
    data = model.read_bytes()
    with HubServer() as hub:
        hub.add_file(REPO, FILE, data, tags=["tokenwing"])
        hub.faults.throttle_bps = max(1, len(data) // 2)
        hub.faults.drop_after = len(data) // 3
        window, c = make_controller(tmp, hub, data)

        async def scenario() -> float:
            await c.start()
            dog = LoopWatchdog().start()
            window.library.select("preset:tiny")
            window.library.download_button.click()
            while not any(m.preset_id == "tiny" for m in c.local_models):
                await asyncio.sleep(0.05)
            installed = next(m for m in c.local_models if m.preset_id == "tiny")
            await c.use_model(f"local:{installed.path}")
            await c.chat_once("Hello there")
            await c.chat_once("And again")
            dog.stop()
            await c.shutdown()
            return dog.worst_ms

        loop = qasync.QEventLoop(app)
        asyncio.set_event_loop(loop)
        try:
            worst = loop.run_until_complete(asyncio.wait_for(scenario(), 600))
        finally:
            loop.close()
            asyncio.set_event_loop(None)
            window.close()
    return {"UI stall, worst (ms)": worst}


# ---------------------------------------------------------------------------------------------- main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    runs: dict[str, list[float]] = {}

    def add(result: dict[str, float]) -> None:
        for k, v in result.items():
            runs.setdefault(k, []).append(v)

    with tempfile.TemporaryDirectory(prefix="tw-app-bench-") as d:
        tmp = Path(d)
        gguf, model = models(tmp)
        for r in range(args.rounds):
            here = tmp / f"round{r}"
            for name in ("ui", "download", "import"):
                (here / name).mkdir(parents=True)
            add(ui_stalls(here / "ui", model))
            add(asyncio.run(download_lag_and_speed(here / "download")))
            add(asyncio.run(engine_stops(model)))
            add(asyncio.run(import_cancel(gguf, here / "import")))
            add(asyncio.run(hub_answers()))
    if args.json:
        print(json.dumps(runs, indent=1))
        return 0
    print(f"| measurement ({args.rounds} rounds) | median | min | max |")
    print("|---|---|---|---|")
    for name, values in runs.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
