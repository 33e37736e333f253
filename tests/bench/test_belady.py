"""bench/limits.py `belady_rows`, the fewest reads a cache of a given size could make over several sequences'
decode steps: against a count by hand, and never more than what an LRU cache of the same size reads."""

from __future__ import annotations

import numpy as np

from bench.limits import belady_rows


def test_belady_keeps_what_is_needed_soonest() -> None:
    """Two slots, one layer, one expert a row: 0 1 2 0 1 misses 0, 1, 2 (evicting 1, needed last), hits 0,
    misses 1: four reads where LRU makes five."""
    sel = np.array([0, 1, 2, 0, 1], np.int32).reshape(5, 1, 1)
    got = belady_rows(sel, 4, 2, [100], None)
    assert got["misses"] == 4
    assert got["bytes_per_token"] == 4 * 100 / 5


def test_a_warm_cache_and_several_layers() -> None:
    """What the layers held when decoding began is not read again; each layer's misses count at its own size."""
    sel = np.array([[[0, 1], [2, 3]], [[0, 2], [3, 1]]], np.int32)  # 2 rows, 2 layers, k = 2
    warm = np.array([[0, 1], [-1, -1]], np.int32)
    got = belady_rows(sel, 4, 2, [10, 1000], warm)
    # layer 0 holds 0 and 1: row 0 hits both; row 1 needs 2 (one read). Layer 1 starts empty: 2, 3 then 1 (one more)
    assert got["misses"] == 1 + 3
    assert got["bytes_per_token"] == (1 * 10 + 3 * 1000) / 2


def test_never_more_than_lru() -> None:
    rng = np.random.default_rng(0)
    sel = np.stack([np.stack([rng.choice(16, 4, replace=False) for _ in range(3)]) for _ in range(200)])
    fewest = belady_rows(sel.astype(np.int32), 16, 6, [1, 1, 1], None)["misses"]
    lru = 0
    for li in range(3):
        cache: list[int] = []
        for row in sel[:, li]:
            for e in row:
                if e in cache:
                    cache.remove(e)
                else:
                    lru += 1
                    if len(cache) == 6:
                        cache.pop(0)
                cache.append(int(e))
    assert fewest < lru
