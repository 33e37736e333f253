"""Fuzzing the GGUF and model-file readers with random corruptions and truncations: only clean errors."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenwing.errors import TokenWingError
from tokenwing.format.gguf_io import read_header
from tokenwing.format.reader import ModelFile
from tokenwing.format.repack import plan_repack
from tokenwing.format.source import open_source

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
Flip = tuple[int, int]


def _mutate(data: bytes, flips: list[Flip], cut: int | None) -> bytes:
    buf = bytearray(data)
    for pos, value in flips:
        buf[pos % len(buf)] ^= value or 1
    if cut is not None:
        del buf[cut % len(buf) :]
    return bytes(buf)


flips_st = st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 255)), min_size=0, max_size=6)
cut_st = st.one_of(st.none(), st.integers(0, 1 << 40))


@pytest.fixture(scope="module")
def source_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    from tokenwing.testmodel import preset_shape, write_test_model

    p = tmp_path_factory.mktemp("fz") / "s.gguf"
    write_test_model(str(p), preset_shape("tiny").with_(n_layer=1, vocab_size=300), "Q8_0")
    return p.read_bytes()


@FUZZ
@given(flips=flips_st, cut=cut_st, header_only=st.booleans())
def test_source_reader_only_clean_errors(
    source_bytes: bytes, tmp_path: Path, flips: list[Flip], cut: int | None, header_only: bool
) -> None:
    hdr = read_header_size(source_bytes)
    if header_only:  # aim most flips at the header, where the parser works
        flips = [(pos % hdr, v) for pos, v in flips]
    p = tmp_path / "f.gguf"
    p.write_bytes(_mutate(source_bytes, flips, cut))
    with contextlib.suppress(TokenWingError):  # anything else fails the test
        plan_repack(open_source([str(p)]))


def read_header_size(data: bytes) -> int:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        return read_header(f.name).data_start


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, source_bytes: bytes) -> tuple[bytes, list[tuple[int, int]]]:
    from tokenwing.format.repack import repack

    d = tmp_path_factory.mktemp("fzp")
    (d / "s.gguf").write_bytes(source_bytes)
    repack([str(d / "s.gguf")], str(d / "p.tw.gguf"), show_progress=False)
    data = (d / "p.tw.gguf").read_bytes()
    with ModelFile.open(str(d / "p.tw.gguf")) as mf:
        covered = [(0, mf.header.data_start)]
        covered += [(mf.tensor_offset(t), mf.tensor_offset(t) + t.nbytes) for t in mf.resident]
        covered += [(el.offset, el.offset + el.record_size * mf.index.n_expert) for el in mf.index.layers]
    return data, covered


@FUZZ
@given(flips=flips_st, cut=cut_st)
def test_model_file_corruption_is_always_caught(
    packed: tuple[bytes, list[tuple[int, int]]], tmp_path: Path, flips: list[Flip], cut: int | None
) -> None:
    data, covered = packed
    mutated = _mutate(data, flips, cut)
    p = tmp_path / "f.tw.gguf"
    p.write_bytes(mutated)
    changed = [i for i in range(min(len(data), len(mutated))) if data[i] != mutated[i]]
    try:
        with ModelFile.open(str(p)) as mf:
            mf.verify(full=True)
    except TokenWingError:
        return
    # Only a change confined to alignment padding between resident tensors may pass unnoticed.
    assert len(mutated) == len(data) or (cut is not None and cut % len(data) >= covered[-1][1])
    assert not any(lo <= i < hi for i in changed for lo, hi in covered)


def test_fuzz_examples_hit_both_outcomes(source_bytes: bytes, tmp_path: Path) -> None:
    """The fuzz target is not vacuous: an untouched file passes, a touched header fails."""
    p = tmp_path / "ok.gguf"
    p.write_bytes(source_bytes)
    plan_repack(open_source([str(p)]))
    p.write_bytes(_mutate(source_bytes, [(5, 0xFF)], None))
    with pytest.raises(TokenWingError):
        plan_repack(open_source([str(p)]))
    shutil.rmtree(tmp_path, ignore_errors=True)
