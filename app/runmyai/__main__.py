"""Entry point of the desktop app."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from runmyai import __version__


def _has_display() -> bool:
    if os.environ.get("QT_QPA_PLATFORM") or sys.platform in ("win32", "darwin"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="runmyai",
        description="Run My AI: chat with large MoE models on this machine. Without a window: "
        "`runmyai get OWNER/NAME[:QUANT]` adds a model from the hub, `runmyai list` shows the library.",
    )
    p.add_argument("--version", action="version", version=f"runmyai {__version__}")
    p.add_argument("--home", type=Path, help="where models, downloads and conversations live (env RUNMYAI_HOME)")
    p.add_argument("--model", type=Path, help="start chatting with this model file (.tw.gguf)")
    p.add_argument(
        "--endpoint",
        help="use this OpenAI-compatible endpoint instead of a local engine (key from env RUNMYAI_ENDPOINT_KEY)",
    )
    p.add_argument("--hub", help="Hugging Face hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    p.add_argument("--offline", action="store_true", help="use only what is on disk (also HF_HUB_OFFLINE=1)")
    p.add_argument(
        "--self-test",
        action="store_true",
        help="open the window, start the engine on the built-in model, chat one reply, close; exit 0 if all worked",
    )
    p.add_argument("--screenshot", type=Path, help="with --self-test: save a screenshot of the screen (PNG) first")
    p.add_argument(
        "--screenshots",
        type=Path,
        metavar="DIR",
        help="with --self-test: every page at 1280x800, 1600x1000 and 1920x1080 in light and dark, checked for "
        "clipped text and charts, saved as PNGs in DIR (docs/screenshots); exit 1 on a clipped widget",
    )
    p.add_argument("--offscreen", action="store_true", help="no window on screen (QT_QPA_PLATFORM=offscreen)")
    return p.parse_args(argv)


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand (`get`, `list`) if the arguments name one after the options they share."""
    i = 0
    while i < len(argv) and argv[i].startswith("--home"):
        i += 1 if "=" in argv[i] else 2
    return argv[i] if i < len(argv) else None


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if _command(args_list) in ("get", "list"):  # runmyai.cli: no window, no Qt
        from runmyai.cli import main as cli_main  # (lazy: these commands start without Qt and the window's code)

        return cli_main(args_list)
    args = parse_args(argv)
    if args.offscreen:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    if not _has_display():
        print(
            "runmyai: no display found; run with --offscreen, or try the engine's command-line demo (./dev demo)",
            file=sys.stderr,
        )
        return 2
    if args.home is not None:
        os.environ["RUNMYAI_HOME"] = str(args.home)
    from runmyai.ui.app import run_app  # (lazy: Qt is imported only after QT_QPA_PLATFORM is chosen above)

    return run_app(args)


if __name__ == "__main__":
    raise SystemExit(main())
