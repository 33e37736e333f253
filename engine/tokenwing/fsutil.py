"""Output files that never look complete unless they are: temporary names, free-space checks, atomic renames."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import BinaryIO

from tokenwing.errors import BadInputError, DiskSpaceError
from tokenwing.testpause import pause

SPACE_MARGIN = 16 << 20


def check_free_space(directory: str, needed: int) -> None:
    try:
        free = shutil.disk_usage(directory).free
    except OSError as e:
        raise BadInputError(f"cannot use output folder {directory}: {e.strerror or e}") from None
    if free < needed + SPACE_MARGIN:
        # (the margin named: "need 100 MiB, 110 MiB free" alone reads as if it should have fit)
        raise DiskSpaceError(
            f"not enough free space in {directory}: need {human_bytes(needed + SPACE_MARGIN)} "
            f"({human_bytes(needed)} and a margin of {human_bytes(SPACE_MARGIN)}), {human_bytes(free)} free"
        )


def partial_name(path: str) -> str:
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.partial-{os.getpid()}")


def remove_stale_partials(path: str) -> list[str]:
    """Removes the `.NAME.partial-PID` files of earlier writes of `path` whose process is gone (a SIGKILL or a
    power cut leaves one, 100s of MB for a model, for good); returns their paths. A PID that is alive — the
    writer itself, or another process now holding a reused PID — keeps its file: a stale file kept is safe, a
    live writer's file removed is not."""
    head, tail = os.path.split(os.path.abspath(path))
    prefix = f".{tail}.partial-"
    removed: list[str] = []
    try:
        names = os.listdir(head)
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(prefix) :] if name.startswith(prefix) else ""
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _alive(int(pid_text)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(head, name))
            removed.append(os.path.join(head, name))
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # (not a process's: kill(0) would ask about our own group; keep the file)
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or beyond any PID
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def atomic_output(path: str, needed: int) -> Iterator[str]:
    """Yields a temporary path beside `path`; renames it into place only if the block completes.

    Ctrl-C, SIGTERM (through `interrupts`) or an error leaves no partial file and no new file under `path`, even
    one that lands between the rename and the end of the block (a file that replaced an older one stays: it is
    complete, and the older one is gone); a crash (SIGKILL, power loss) may leave a `.partial-PID`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise BadInputError(f"output folder {directory} does not exist")
    if os.path.isdir(path):
        raise BadInputError(f"output {path} is a folder")
    remove_stale_partials(path)  # before the space check: what they held counts as free
    check_free_space(directory, needed)
    tmp = partial_name(path)
    try:
        yield tmp
        pause("output.fsync")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        pause("output.rename")
        replacing = os.path.lexists(path)
        os.replace(tmp, path)
        try:
            pause("output.renamed")
            fsync_dir(directory)
        except BaseException:  # interrupted before the block ended: the caller never learnt of a new output
            if not replacing:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
    except OSError as e:
        if e.errno == 28:  # ENOSPC: the space went while we wrote
            raise DiskSpaceError(f"the disk filled up while writing {path}; nothing was kept") from None
        raise BadInputError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_atomic(path: str, write: Callable[[BinaryIO], object], needed: int = 0) -> None:
    """Writes a file through `write(f)` under a temporary name, then fsyncs and renames it into place
    (`atomic_output`): a reader sees the old file or the whole new one, never a part."""
    with atomic_output(path, needed) as tmp, open(tmp, "wb") as f:
        write(f)


def write_json_atomic(path: str, data: object, indent: int | None = None) -> None:
    text = json.dumps(data, indent=indent).encode()
    write_atomic(path, lambda f: f.write(text), len(text))


def fsync_dir(directory: str) -> None:
    """Makes a rename or an unlink in `directory` survive a power cut (where the OS lets a folder be synced)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def parse_size(text: str, percent_of: int | None = None) -> int:
    """`2G`, `512M`, `1.5GiB`, `123456` (bytes) or `10%` (of `percent_of`)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if t.endswith("%"):
            if percent_of is None:
                raise ValueError
            share = float(t[:-1])
            if not 0 <= share <= 100:
                raise ValueError
            return int(share / 100 * percent_of)
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
        n = int(float(t[:-1] if mult > 1 else t) * mult)
        if n < 0:
            raise ValueError
        return n
    except (ValueError, IndexError, OverflowError):
        raise BadInputError(f"not a size: {text!r} (examples: 2G, 512M, 10%)") from None
