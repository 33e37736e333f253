"""Encoded images by their content: a conversation that sends the same image again does not run the encoder again
(issue 45). Keyed by the SHA-256 of the RGB bytes and their size, so two files of one picture (PNG and its JPEG
re-encode aside) share an entry; the newest `capacity` bytes of embeddings are kept."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

import numpy as np


def image_key(rgb: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(np.asarray(rgb.shape, np.int64).tobytes())
    h.update(np.ascontiguousarray(rgb).tobytes())
    return h.hexdigest()


class EncodedImages:
    """A least-recently-used map from an image's key to its embeddings, within `capacity` bytes."""

    def __init__(self, capacity: int = 256 << 20) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, np.ndarray] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, rgb: np.ndarray, encode: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """The image's embeddings: from the cache, or `encode(rgb)` once and kept (read-only: entries are shared)."""
        key = image_key(rgb)
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        embd = encode(rgb)
        embd.setflags(write=False)
        self._entries[key] = embd
        self._bytes += embd.nbytes
        while self._bytes > self.capacity and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
        return embd
