"""One home for the app's small JSON files: written so that a crash leaves the old file or the new one, never a
torn one, and read so that a damaged file counts as missing."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: object) -> None:
    """`data` as JSON, written by write_text_atomic. Raises OSError."""
    write_text_atomic(path, json.dumps(data, indent=1))


def write_text_atomic(path: Path, text: str) -> None:
    """Writes `text` (UTF-8, newlines as written) to a temporary file beside `path`, fsyncs it, renames it over
    `path` (atomic on POSIX and NTFS), then fsyncs the folder so the rename itself survives a power cut. Raises
    OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if os.name != "nt":  # a folder cannot be opened for fsync on Windows
        with contextlib.suppress(OSError):
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from a file; None when missing, unreadable or not an object (a damaged file is ignored)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
