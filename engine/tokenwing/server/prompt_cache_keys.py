"""Which snapshots of the prompt cache on disk a client's `prompt_cache_key` tagged (issue 44): the app sends its
conversation's key, so that deleting the conversation deletes the snapshots its replies ended with.

A key's list is a file in the cache folder's `keys/` (named by the key's SHA-256: any string is a key, never a
path), holding the names of its snapshots one a line. Lines are appended (O_APPEND: servers sharing the folder
add whole lines), never rewritten; a name whose file has gone (evicted, replaced by a longer snapshot) is skipped
when the key is forgotten. A snapshot two keys list stays until both are forgotten.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

KEYS_DIR = "keys"
SUFFIX = ".names"


def key_path(folder: str, key: str) -> str:
    return os.path.join(folder, KEYS_DIR, hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX)


def tag(folder: str, key: str, name: str) -> None:
    """Lists a snapshot's file name under the key. Best effort: a key that cannot be written (a full disk) only
    means its snapshots stay until the cache's size evicts them."""
    with contextlib.suppress(OSError):
        path = key_path(folder, key)
        if name in _names(path):
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="ascii") as f:
            f.write(name + "\n")


def forget(folder: str, key: str) -> set[str]:
    """Removes the key's list; returns the snapshot names only it listed (to delete: no other key holds them)."""
    path = key_path(folder, key)
    mine = _names(path)
    with contextlib.suppress(OSError):
        os.unlink(path)
    keys = os.path.join(folder, KEYS_DIR)
    with contextlib.suppress(OSError):
        for other in os.listdir(keys):
            if other.endswith(SUFFIX):
                mine -= _names(os.path.join(keys, other))
    return mine


def forget_all(folder: str) -> None:
    """Every key's list goes (the cache was cleared)."""
    keys = os.path.join(folder, KEYS_DIR)
    with contextlib.suppress(OSError):
        for name in os.listdir(keys):
            if name.endswith(SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(keys, name))


def _names(path: str) -> set[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return {line.strip() for line in f if line.strip()}
    except OSError:
        return set()
