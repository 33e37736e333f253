"""The usage table: how often each expert was chosen on real text, kept next to the model file.

`MODEL.tw.gguf.usage.json` holds per streamed layer one count per expert, tied to its model by the header
checksum (a table of another model, or a damaged one, is ignored with one line). The engine seeds the cache's
idle fill from it (the most used experts first) and adds what it saw when it closes, halving the old counts
once they pass `HALVE_AT` tokens so the table follows how the model is used now.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from tokenwing.fsutil import write_json_atomic

FORMAT = "tokenwing-usage"
VERSION = 1
HALVE_AT = 1 << 20  # tokens: beyond this, old counts are halved before new ones are added
MAX_BYTES = 64 << 20  # a usage file larger than this is not ours


def usage_path(model_path: str) -> str:
    return model_path + ".usage.json"


class UsageTable:
    def __init__(self, layers: Sequence[int], n_expert: int, model_checksum: int) -> None:
        self.layers = list(layers)
        self.n_expert = n_expert
        self.model_checksum = model_checksum
        self.counts = np.zeros((len(self.layers), n_expert), np.float64)
        self.tokens = 0

    def ranked(self, row: int) -> list[int]:
        """Experts of streamed layer `row` that were ever used, most used first (ties: lower id)."""
        c = self.counts[row]
        order = np.lexsort((np.arange(self.n_expert), -c))
        return [int(e) for e in order if c[e] > 0]

    def add(self, row: int, experts: np.ndarray) -> None:
        np.add.at(self.counts[row], experts.ravel(), 1.0)

    def merge_into(self, older: UsageTable | None) -> UsageTable:
        """This session's counts added to the table on disk (halved first once it is large)."""
        if older is None or older.counts.shape != self.counts.shape:
            return self
        out = UsageTable(self.layers, self.n_expert, self.model_checksum)
        scale = 0.5 if older.tokens > HALVE_AT else 1.0
        out.counts = older.counts * scale + self.counts
        out.tokens = int(older.tokens * scale) + self.tokens
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model_checksum": self.model_checksum,
            "tokens": self.tokens,
            "layers": {
                str(layer): [round(float(c), 3) for c in row]
                for layer, row in zip(self.layers, self.counts, strict=True)
            },
        }


def load_usage(
    path: str, layers: Sequence[int], n_expert: int, model_checksum: int, log: Callable[[str], None]
) -> UsageTable | None:
    """The table at `path` if it belongs to this model; None (with one line when it exists but is unusable)."""
    try:
        if os.path.getsize(path) > MAX_BYTES:
            raise ValueError("too large")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        table = _parse(data, layers, n_expert, model_checksum)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        log(f"ignoring the usage table {path}: {e}")
        return None
    return table


def _parse(data: object, layers: Sequence[int], n_expert: int, model_checksum: int) -> UsageTable:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not a TokenWing usage table")
    if data.get("version") != VERSION:
        raise ValueError(f"unknown version {data.get('version')!r}")
    if data.get("model_checksum") != model_checksum:
        raise ValueError("it belongs to another model (or another version of this one)")
    rows = data.get("layers")
    tokens = data.get("tokens")
    if not isinstance(rows, dict) or not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError("malformed")
    table = UsageTable(layers, n_expert, model_checksum)
    table.tokens = tokens
    for i, layer in enumerate(layers):
        row = rows.get(str(layer))
        if row is None:
            continue
        if not isinstance(row, list) or len(row) != n_expert:
            raise ValueError(f"layer {layer} has the wrong number of experts")
        values = np.array([v if isinstance(v, int | float) and not isinstance(v, bool) else np.nan for v in row])
        if not np.isfinite(values).all() or (values < 0).any():
            raise ValueError(f"layer {layer} has counts that are not finite non-negative numbers")
        table.counts[i] = values
    return table


def save_usage(path: str, table: UsageTable) -> None:
    """Atomically (temporary file, then rename); raises TokenWingError (a read-only model folder, a full disk),
    which the caller reports in one line: not an error worth stopping for."""
    write_json_atomic(path, table.to_json())
