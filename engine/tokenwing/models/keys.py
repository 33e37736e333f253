"""A family's own GGUF keys as one table (issue 42 item 1): each key's name after `<arch>.`, its type and its default.

The family's file reads its keys with it from the file's (`HParams.keys`), and the factory (testmodel/) writes them
from the same table, so a key's name and type are written once. The keys every family shares are `read_hparams`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import KV, ValueType
from tokenwing.models.hparams import HParams


@dataclass(frozen=True)
class Key:
    name: str  # after "<arch>."
    kind: str  # "u32", "f32", "bool", "i32[]" or "u64[]"
    default: Any = None  # where the file has no such key (None: it is required)

    def read(self, hp: HParams, where: str) -> Any:
        """The file's value, checked: one line naming the key where it is missing or of another type."""
        return self.value(hp.arch, hp.keys, where)

    def value(self, arch: str, keys: dict[str, Any], where: str) -> Any:
        """`read` from a file's `<arch>.` keys with the prefix dropped (`HParams.keys`), without the rest of its
        hparams (a family's helper that reads one group of keys from a file's metadata)."""
        full = f"{arch}.{self.name}"
        v = keys.get(self.name, self.default)
        if v is None:
            raise BadInputError(f"{where}: {full} is missing from the metadata")
        if self.kind == "u32":
            if isinstance(v, bool) or not isinstance(v, int):
                raise BadInputError(f"{where}: {full} must be an integer")
            return int(v)
        if self.kind == "f32":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise BadInputError(f"{where}: {full} must be a number")
            return float(v)
        if self.kind == "bool":
            if not isinstance(v, bool):
                raise BadInputError(f"{where}: {full} must be a boolean")
            return v
        items = v.tolist() if hasattr(v, "tolist") else v
        if not isinstance(items, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            raise BadInputError(f"{where}: {full} must list integers")
        if self.kind == "u64[]" and any(x < 0 for x in items):
            raise BadInputError(f"{where}: {full} must list non-negative integers")
        return tuple(items)

    def kv(self, value: Any) -> KV:
        """The key's value as the factory writes it."""
        if self.kind == "u32":
            return KV.u32(value)
        if self.kind == "f32":
            return KV.f32(value)
        if self.kind == "bool":
            return KV.boolean(value)
        return KV.array(ValueType.UINT64 if self.kind == "u64[]" else ValueType.INT32, list(value))


def read_keys(table: dict[str, Key], hp: HParams, where: str) -> dict[str, Any]:
    """Every key of a family's table (field → key), by field."""
    return {field: key.read(hp, where) for field, key in table.items()}


def write_keys(table: dict[str, Key], arch: str, values: dict[str, Any]) -> dict[str, KV]:
    """The table's keys with these values (by field), as the factory writes them."""
    return {f"{arch}.{key.name}": key.kv(values[field]) for field, key in table.items()}
