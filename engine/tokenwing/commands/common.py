"""What several `tokenwing` commands share: the one-line notes on stderr, and whether to show progress."""

from __future__ import annotations

import argparse
import sys


def stderr_line(line: str) -> None:
    print(f"tokenwing: {line}", file=sys.stderr, flush=True)


def progress(args: argparse.Namespace) -> bool:
    return not getattr(args, "quiet", False) or getattr(args, "progress_json", False)
