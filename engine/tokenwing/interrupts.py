"""SIGINT and SIGTERM end a command alike: an exception where the program is, so every `finally` and
`atomic_output` cleans up, and the CLI exits 128 + the signal's number with one line.

Python's default for SIGTERM kills the process without running any cleanup: a repack stopped that way (the app
cancelling an import, `kill`, a service manager) left its `.NAME.partial-PID` behind. A signal that whoever
started the process ignores stays ignored (the shell's rule for background jobs, which Python follows too).
"""

from __future__ import annotations

import signal
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The signal `signum` arrived; a KeyboardInterrupt, so code that cleans up after Ctrl-C does after both."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def install() -> None:
    """For a process's entry point: SIGINT and SIGTERM raise Interrupted in the main thread."""
    for sig in HANDLED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _raise)


def settle() -> None:
    """For a process's entry point once its outcome is decided: a late signal no longer changes it.

    Without this, Ctrl-C just after a repack renamed its output (while the summary prints, or while the
    interpreter exits) ended the process by SIGINT with the complete output in place.
    """
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)


def exit_code(e: KeyboardInterrupt) -> int:
    """128 + the signal's number, as a shell reports a process that the signal ended: 130 for Ctrl-C."""
    return 128 + (e.signum if isinstance(e, Interrupted) else int(signal.SIGINT))
