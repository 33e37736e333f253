"""The `tokenwing` command line: the parser and the dispatch (each command group's flags and code are in
commands/). Every failure is one line on stderr and a non-zero exit code."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence

from tokenwing import interrupts
from tokenwing.commands import autotune, info, model, run, testmodel, tokenize, trace
from tokenwing.errors import TokenWingError
from tokenwing.testpause import pause
from tokenwing.version import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenwing", description="TokenWing: MoE inference that streams experts.")
    p.add_argument("--version", action="version", version=f"tokenwing {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for group in (testmodel, model, run, autotune, tokenize, info, trace):  # (the order --help lists them in)
        group.add_parsers(sub)
    return p


def _one_line(message: str, most: int = 2000) -> str:
    """An error as one line of bounded length, whatever a file's names or values put in it (a crafted tensor name
    may hold line breaks, or be megabytes long)."""
    flat = " ".join(message.splitlines())
    return flat if len(flat) <= most else flat[:most] + "…"


def main(argv: Sequence[str] | None = None) -> int:
    """The `tokenwing` process's entry point (it takes over SIGINT and SIGTERM: see interrupts.py)."""
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["__device_probe"] and len(argv) == 2:  # the child compute/probe.py starts (not for users)
        # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
        from tokenwing.compute.probe import run_probe

        return run_probe(argv[1])
    if argv == ["__render_worker"]:  # the chat templates' renderer child (text/render_worker.py; not for users)
        from tokenwing.text.render_child import run_worker  # (lazy: the child needs nothing else)

        return run_worker()
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    interrupts.install()
    try:
        try:
            return func(args)
        finally:
            interrupts.settle()
            pause("cli.decided")
    except TokenWingError as e:
        print(f"tokenwing: error: {_one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        by = f" by {e.args[0]}" if isinstance(e, interrupts.Interrupted) and e.signum != signal.SIGINT else ""
        print(f"tokenwing: interrupted{by}; nothing partial was kept", file=sys.stderr)
        return interrupts.exit_code(e)
    except MemoryError:
        print("tokenwing: error: out of memory", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
