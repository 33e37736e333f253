"""GGUF header encoding and defensive parsing."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.ggufs import write_gguf
from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.format.gguf_io import KV, ValueType, read_header, rewrite_metadata, tensor_nbytes


def test_every_value_type_round_trips(tmp_path: Path) -> None:
    kv = {
        "a.u8": KV(ValueType.UINT8, 200),
        "a.i8": KV(ValueType.INT8, -100),
        "a.u16": KV(ValueType.UINT16, 60000),
        "a.i16": KV(ValueType.INT16, -30000),
        "a.u32": KV.u32(4_000_000_000),
        "a.i32": KV.i32(-2_000_000_000),
        "a.f32": KV.f32(0.5),
        "a.bool": KV.boolean(True),
        "a.str": KV.string("héllo\nwörld"),
        "a.u64": KV.u64(1 << 63),
        "a.i64": KV(ValueType.INT64, -(1 << 62)),
        "a.f64": KV(ValueType.FLOAT64, 1e-300),
        "a.strs": KV.strings(["", "x", "日本"]),
        "a.ints": KV.array(ValueType.INT32, [1, -2, 3]),
        "a.floats": KV.array(ValueType.FLOAT32, [0.25, -1.5]),
    }
    p = write_gguf(tmp_path / "kv.gguf", kv, [("t", (32, 2), 0, bytes(256))])
    h = read_header(str(p))
    for key, value in kv.items():
        got = h.kv[key]
        assert got.type == value.type
        if isinstance(value.value, np.ndarray):
            assert np.array_equal(got.value, value.value)
        else:
            assert got.value == value.value, key
    # the standard reader agrees
    r = gguf.GGUFReader(str(p))
    assert r.fields["a.strs"].contents() == ["", "x", "日本"]
    assert r.fields["a.u64"].contents() == 1 << 63
    t = h.tensors[0]
    assert (t.name, t.shape, t.nbytes) == ("t", (32, 2), 256)


@pytest.mark.parametrize(
    ("shape", "type_id", "nbytes"),
    [((32, 3), 0, 384), ((32, 3), 1, 192), ((64, 2), 8, 136), ((64, 2), 2, 72), ((256, 2, 3), 12, 864)],
)
def test_tensor_sizes(shape: tuple[int, ...], type_id: int, nbytes: int) -> None:
    assert tensor_nbytes(shape, type_id) == nbytes


def test_tensor_size_errors() -> None:
    with pytest.raises(UnsupportedError):
        tensor_nbytes((32,), 1234)
    with pytest.raises(BadInputError):
        tensor_nbytes((33,), 8)
    with pytest.raises(BadInputError):
        tensor_nbytes((0, 4), 0)


def test_duplicate_keys_and_tensors_are_rejected(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "d.gguf", {"k": KV.u32(1)}, [("t", (32,), 0, bytes(128)), ("u", (32,), 0, bytes(128))])
    data = bytearray(p.read_bytes())
    i = data.index(b"u", 40)  # second tensor name: rename it to the first's
    data[i : i + 1] = b"t"
    p.write_bytes(bytes(data))
    with pytest.raises(BadInputError, match="appears twice"):
        read_header(str(p))


def test_huge_counts_do_not_allocate(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "h.gguf", {"k": KV.strings(["a"])}, [])
    data = bytearray(p.read_bytes())
    # the string array's count field sits after key, type and item type: claim 2**40 items
    pos = data.index(b"k") + 1 + 4 + 4
    data[pos : pos + 8] = (1 << 40).to_bytes(8, "little")
    p.write_bytes(bytes(data))
    with pytest.raises(BadInputError, match="array items"):
        read_header(str(p))


def test_rewrite_metadata_keeps_the_tensor_bytes(tmp_path: Path) -> None:
    """New metadata (a longer header: the data section moves) with every tensor's bytes and offset unchanged, also
    rewritten in place; a source whose data is cut short is refused in one line and leaves no output."""
    data = [bytes(range(i, i + 128)) * 2 for i in range(3)]
    src = write_gguf(
        tmp_path / "m.gguf",
        {"a.n": KV.u32(512), "a.s": KV.string("x")},
        [(f"t{i}", (64, 1), 0, d[:256]) for i, d in enumerate(data)],
    )
    old = read_header(str(src))
    kv = {"a.n": KV.u32(2048), "a.s": KV.string("x"), "a.scaling.type": KV.string("yarn"), "a.f": KV.f32(4.0)}
    for dst in (tmp_path / "out.gguf", src):
        new = rewrite_metadata(str(src), str(dst), kv)
        assert new.get("a.n") == 2048 and new.get("a.scaling.type") == "yarn" and new.data_start > old.data_start
        assert [(t.name, t.shape, t.type, t.offset) for t in new.tensors] == [
            (t.name, t.shape, t.type, t.offset) for t in old.tensors
        ]
        raw = dst.read_bytes()
        for t, d in zip(new.tensors, data, strict=True):
            assert raw[new.data_start + t.offset : new.data_start + t.offset + t.nbytes] == d[:256]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[:-100])
    with pytest.raises(BadInputError, match="ends past the end of the file"):
        rewrite_metadata(str(cut), str(tmp_path / "cut-out.gguf"), kv)
    assert not (tmp_path / "cut-out.gguf").exists()
