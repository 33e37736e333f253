"""`runmyai get` and `runmyai list`: the library without the window (as LM Studio's `lms get`).

`get` runs the very code path of the window's Download button (`library.acquire.Acquirer`) with a progress bar
on stderr; Ctrl-C stops it with everything resumable (running the same command again continues). `list` prints
the installed models with their "Will it run here?" estimate. Neither needs a display or imports Qt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from runmyai.engine.autotune import AutotuneRunner
from runmyai.engine.info import EngineInfo, ask_engine
from runmyai.library.acquire import AcquireError, Acquirer, GetProgress, RepoQuants
from runmyai.library.downloads import DownloadManager
from runmyai.library.estimate import installed_estimate, speed_range, speed_words
from runmyai.library.hub import HubClient, HubError
from runmyai.library.keys import parse_model_ref
from runmyai.library.launch import launch_flags
from runmyai.library.local import LibraryError, LocalLibrary, LocalModel
from runmyai.library.presets import Catalog, load_catalog
from runmyai.machine import MachineInfo, probe_machine_async
from runmyai.paths import AppPaths, bundled_dir
from runmyai.ui.render import VERDICT_WORDS, quant_label
from runmyai.units import human_bytes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="runmyai", description="Run My AI's model library from a terminal")
    p.add_argument("--home", type=Path, help="where models, downloads and settings live (env RUNMYAI_HOME)")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("get", help="download a model from the hub into the library (one quant, repacked)")
    g.add_argument("model", help="owner/name, or owner/name:QUANT (e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M)")
    g.add_argument("--hub", help="Hugging Face hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    g.add_argument("--quants", action="store_true", help="list the repository's quants and stop")
    g.add_argument("--offline", action="store_true", help="use only what is on disk (also HF_HUB_OFFLINE=1)")
    ls = sub.add_parser("list", help="the models in the library, with whether they run well here")
    ls.add_argument("--json", action="store_true")
    return p


class Bar:
    """One progress line on a terminal (redrawn in place), or a line every few seconds otherwise."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last = 0.0
        self.last_message = ""

    def __call__(self, p: GetProgress) -> None:
        now = time.monotonic()
        if now - self.last < (0.2 if self.tty else 5.0) and p.message == self.last_message and p.phase != "done":
            return
        self.last, self.last_message = now, p.message
        filled = int(p.fraction * 30)
        line = f"[{'#' * filled}{' ' * (30 - filled)}] {p.fraction * 100:5.1f}% {p.message}"
        if self.tty:
            self.stream.write("\r" + line[:160] + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self.tty and self.last:
            self.stream.write("\n")
            self.stream.flush()


async def _context(home: AppPaths) -> tuple[Catalog, LocalLibrary, MachineInfo, EngineInfo]:
    catalog = load_catalog(bundled_dir("presets"))
    library = LocalLibrary(home.models, bundled_dir("resources"), presets=catalog.presets)
    machine = await probe_machine_async(home.models, autotune_dir=home.settings)
    engine = await ask_engine(home.settings)
    catalog.bind_engine(engine)  # (its error lines are the catalog's, as a bad preset's)
    return catalog, library, machine, engine


async def cmd_get(args: argparse.Namespace, home: AppPaths) -> int:
    try:
        key = parse_model_ref(args.model)
    except ValueError as e:
        print(f"runmyai: error: {e}", file=sys.stderr)
        return 2
    catalog, library, machine, engine = await _context(home)
    if not engine.known:
        print(f"runmyai: warning: {engine.error}", file=sys.stderr)
    hub = HubClient(endpoint=args.hub, offline=args.offline)
    downloads = DownloadManager(hub, home.downloads, home.models)
    acquirer = Acquirer(hub, downloads, library, home.jobs, engine=lambda: engine, machine=lambda: machine)
    if args.quants:
        quants = await acquirer.quants(key.repo)
        _print_quants(quants)
        return 0
    bar = Bar()
    await downloads.start()
    try:
        model = await acquirer.get(key, bar)
    finally:
        bar.end()
        await downloads.close()
    print(_model_line(model, catalog, machine, engine, AutotuneRunner(home)))
    return 0


def _print_quants(q: RepoQuants) -> None:
    best = q.best()
    if q.note:
        print(q.note)
    elif best is None and q.choices:
        print(q.why_none())
    for c in q.choices:
        print(quant_label(c, c is best))


async def cmd_list(args: argparse.Namespace, home: AppPaths) -> int:
    catalog, library, machine, engine = await _context(home)
    models = await library.scan()
    autotune = AutotuneRunner(home)
    if args.json:
        print(json.dumps([_model_json(m, catalog, machine, engine, autotune) for m in models], indent=1))
        return 0
    if not models:
        print(f"No models in {home.models} yet (runmyai get OWNER/NAME adds one).")
    for m in models:
        print(_model_line(m, catalog, machine, engine, autotune))
    return 0


def _model_json(
    m: LocalModel, catalog: Catalog, machine: MachineInfo, engine: EngineInfo, autotune: AutotuneRunner
) -> dict[str, Any]:
    # the window's estimate, for the flags the window starts the engine with (library/launch.py)
    preset = catalog.get(m.preset_id) if m.preset_id else None
    flags = launch_flags(m.path, m, preset, autotune, engine)
    est = installed_estimate(m, preset, machine, engine, flags)
    return {
        "name": m.name,
        "path": str(m.path),
        "bytes": m.size_bytes,
        "architecture": m.arch,
        "preset": m.preset_id,
        "error": m.error,
        "estimate": None
        if est is None
        else {
            "tokens_per_s": round(est.tokens_per_s, 2),
            "verdict": est.verdict,
            # the range the window shows and where it came from ("measured: 3 chats", "estimated from its shape")
            "low_tokens_per_s": round(est.low_tokens_per_s, 2),
            "high_tokens_per_s": round(est.high_tokens_per_s, 2),
            "basis": est.basis,
        },
    }


def _model_line(
    m: LocalModel, catalog: Catalog, machine: MachineInfo, engine: EngineInfo, autotune: AutotuneRunner
) -> str:
    d = _model_json(m, catalog, machine, engine, autotune)
    est = d["estimate"]
    if m.error:
        how = f"cannot be used: {m.error}"
    elif est is None:
        how = "no estimate"
    else:
        speed = speed_range(est["low_tokens_per_s"], est["high_tokens_per_s"])
        basis = f"({speed.removeprefix('~')}; {est['basis']})"
        how = f"{VERDICT_WORDS[est['verdict']]}, {speed_words(est['tokens_per_s'])} {basis}"
    return f"{m.name}  {human_bytes(m.size_bytes)}  {m.arch or '?'}  {how}\n    {m.path}"


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.home is not None:
        os.environ["RUNMYAI_HOME"] = str(args.home)
    home = AppPaths.default().ensure()
    run = cmd_get if args.command == "get" else cmd_list
    try:
        return asyncio.run(run(args, home))
    except KeyboardInterrupt:
        print("runmyai: interrupted; run the same command again to continue where it stopped", file=sys.stderr)
        return 130
    except (AcquireError, HubError, LibraryError) as e:
        print(f"runmyai: error: {e}", file=sys.stderr)
        return 1
