"""Errors that reach a user as one clear line and an exit code, never a traceback."""


class TokenWingError(Exception):
    """Base for every error the CLI reports as one line."""

    exit_code = 1


class BadInputError(TokenWingError):
    """An input file or argument is wrong: unreadable, malformed, inconsistent."""

    exit_code = 2


class CorruptModelError(BadInputError):
    """A model file fails its own checksums or its index contradicts itself: stop before any output."""

    exit_code = 3


class UnsupportedError(BadInputError):
    """Valid input that this version cannot handle (newer format, unknown quant type or architecture)."""

    exit_code = 4


class DiskSpaceError(TokenWingError):
    """Not enough free space for an output; nothing was written."""

    exit_code = 5
