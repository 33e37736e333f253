"""Errors that reach a user as one clear line and an exit code, never a traceback.

Each class's `kind` names its exit code for programs that run the engine: `tokenwing info --json` reports them
(`exit_codes`), so the app words each one without keeping a copy of the numbers.
"""


class TokenWingError(Exception):
    """Base for every error the CLI reports as one line."""

    exit_code = 1
    kind = "error"
    # the same input fails the same way again: a program that runs the engine need not retry (a download
    # manager marks the job failed for good); a full disk or a fault of the engine's may pass
    permanent = False


class BadInputError(TokenWingError):
    """An input file or argument is wrong: unreadable, malformed, inconsistent."""

    exit_code = 2
    kind = "bad_input"
    permanent = True


class CorruptModelError(BadInputError):
    """A model file fails its own checksums or its index contradicts itself: stop before any output."""

    exit_code = 3
    kind = "corrupt_model"


class UnsupportedError(BadInputError):
    """Valid input that this version cannot handle (newer format, unknown quant type or architecture)."""

    exit_code = 4
    kind = "unsupported"


class DiskSpaceError(TokenWingError):
    """Not enough free space for an output; nothing was written."""

    exit_code = 5
    kind = "no_disk_space"


def exit_codes() -> dict[str, int]:
    """Every error's kind and its exit code (the CLI's `main` returns `exit_code` of the error it reports)."""
    out: dict[str, int] = {}
    todo: list[type[TokenWingError]] = [TokenWingError]
    while todo:
        cls = todo.pop()
        out[cls.kind] = cls.exit_code
        todo += cls.__subclasses__()
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def permanent_kinds() -> list[str]:
    """The kinds whose failure retrying the same input cannot change (`permanent`), sorted."""
    out: set[str] = set()
    todo: list[type[TokenWingError]] = [TokenWingError]
    while todo:
        cls = todo.pop()
        if cls.permanent:
            out.add(cls.kind)
        todo += cls.__subclasses__()
    return sorted(out)
