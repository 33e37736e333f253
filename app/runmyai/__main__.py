"""Entry point of the desktop app. The window, library and chat arrive with the app issue."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from runmyai import __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runmyai", description="Run My AI desktop app")
    parser.add_argument("--version", action="version", version=f"runmyai {__version__}")
    parser.parse_args(argv)
    print(
        "runmyai: the desktop window is not part of this build yet; `tokenwing --help` lists what is.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
