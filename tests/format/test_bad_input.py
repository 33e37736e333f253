"""Bad input: each case is one clear line on stderr and a non-zero exit, and no partial output is left."""

from __future__ import annotations

import shutil
from pathlib import Path

import xxhash

from tests.conftest import ModelFactory, Mount, assert_clean_error, run_cli
from tests.ggufs import expert_tensors, f32, moe_kv, write_gguf
from tokenwing.format import layout as L
from tokenwing.format.gguf_io import read_header


def _outputs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _repack_fails(src: Path, tmp_path: Path, code: int, words: str) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    r = run_cli("repack", str(src), "-o", str(out_dir / "x.tw.gguf"), "-q")
    assert_clean_error(r, code)
    assert words in r.stderr
    assert _outputs(out_dir) == []


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _copy(src: Path, tmp_path: Path, name: str = "copy.tw.gguf") -> Path:
    dst = tmp_path / name
    shutil.copyfile(src, dst)
    return dst


# ---------------------------------------------------------------------------------------- source GGUFs


def test_missing_file(tmp_path: Path) -> None:
    _repack_fails(tmp_path / "nope.gguf", tmp_path, 2, "cannot open")


def test_folder_as_input(tmp_path: Path) -> None:
    d = tmp_path / "dir.gguf"
    d.mkdir()
    _repack_fails(d, tmp_path, 2, "dir.gguf")


def test_wrong_magic(tmp_path: Path) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + bytes(100))
    _repack_fails(p, tmp_path, 2, "not a GGUF file")


def test_empty_and_tiny_files(tmp_path: Path) -> None:
    for n in (0, 3, 20):
        p = tmp_path / f"t{n}.gguf"
        p.write_bytes(b"GGUF"[: min(n, 4)] + bytes(max(0, n - 4)))
        _repack_fails(p, tmp_path, 2, "GGUF")


def test_truncated_source(model_factory: ModelFactory, tmp_path: Path) -> None:
    src = model_factory(type="Q8_0")
    data = src.read_bytes()
    for cut in (10, 200, len(data) // 2, len(data) - 1):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        _repack_fails(p, tmp_path, 2, "truncated")


def test_newer_gguf_version(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "v4.gguf", moe_kv(), expert_tensors(0, 32, 32, 4))
    _patch(p, 4, (4).to_bytes(4, "little"))
    _repack_fails(p, tmp_path, 4, "GGUF version 4")


def test_unsupported_architecture(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "a.gguf", moe_kv(arch="mystery"), expert_tensors(0, 32, 32, 4))
    _repack_fails(p, tmp_path, 4, "architecture 'mystery' is not supported")


def test_dense_model_is_not_moe(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "dense.gguf", moe_kv(), [("blk.0.ffn_up.weight", (32, 32), 0, f32(1024))])
    _repack_fails(p, tmp_path, 4, "no routed expert tensors")


def test_unknown_quant_type(tmp_path: Path) -> None:
    tensors = expert_tensors(0, 32, 32, 4)
    tensors.append(("odd.weight", (32,), 99, f32(32)))
    p = write_gguf(tmp_path / "q.gguf", moe_kv(), tensors)
    _repack_fails(p, tmp_path, 4, "unsupported tensor type id 99")


def test_expert_count_disagrees_with_tensors(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "m.gguf", moe_kv(n_expert=16), expert_tensors(0, 32, 32, 4))
    _repack_fails(p, tmp_path, 2, "16 experts the metadata declares")


def test_missing_expert_metadata(tmp_path: Path) -> None:
    kv = moe_kv()
    del kv["qwen3moe.expert_used_count"]
    p = write_gguf(tmp_path / "m.gguf", kv, expert_tensors(0, 32, 32, 4))
    _repack_fails(p, tmp_path, 2, "expert_used_count missing")


def test_missing_projection(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "m.gguf", moe_kv(), expert_tensors(0, 32, 32, 4)[:2])
    _repack_fails(p, tmp_path, 2, "lacks its down expert tensor")


def test_mismatched_projection_shapes(tmp_path: Path) -> None:
    t = expert_tensors(0, 32, 32, 4)
    t[1] = ("blk.0.ffn_up_exps.weight", (32, 64, 4), 0, f32(32 * 64 * 4))
    p = write_gguf(tmp_path / "m.gguf", moe_kv(), t)
    _repack_fails(p, tmp_path, 2, "expert shapes disagree")


def test_row_not_multiple_of_block(tmp_path: Path) -> None:
    t = expert_tensors(0, 32, 32, 4)
    t.append(("bad.weight", (33, 2), 8, bytes(68)))  # Q8_0 needs rows of 32
    p = write_gguf(tmp_path / "m.gguf", moe_kv(), t)
    _repack_fails(p, tmp_path, 2, "not a multiple")


def test_missing_shard(model_factory: ModelFactory, tmp_path: Path) -> None:
    first = model_factory(type="Q8_0", shards=3, n_layer=3)
    for p in first.parent.glob(first.name.replace("-00001-of-00003", "-*-of-00003")):
        shutil.copyfile(p, tmp_path / p.name)
    (tmp_path / first.name.replace("00001-of", "00002-of")).unlink()
    _repack_fails(tmp_path / first.name, tmp_path, 2, "missing")


def test_repacking_a_repacked_file(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    _repack_fails(repacked_factory(), tmp_path, 2, "already a TokenWing model file")


def test_output_folder_missing(model_factory: ModelFactory, tmp_path: Path) -> None:
    r = run_cli("repack", str(model_factory()), "-o", str(tmp_path / "no" / "x.tw.gguf"), "-q")
    assert_clean_error(r, 2)


def test_mtp_layers_stay_resident(model_factory: ModelFactory, tmp_path: Path) -> None:
    # (a whole model: a file of expert tensors alone is refused by its family's checks, as a start refuses it)
    p = model_factory(arch="deepseek2", n_layer=1, n_mtp=1, n_dense_lead=0)
    out = tmp_path / "mtp.tw.gguf"
    r = run_cli("repack", str(p), "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    h = read_header(str(out))
    assert list(h.get(L.K_EXPERT_LAYERS)) == [0]
    assert h.tensor("blk.1.ffn_gate_exps.weight") is not None  # the MTP layer's experts, whole, in the file
    names = [t.name for t in h.tensors[: h.get(L.K_RESIDENT_COUNT)]]
    kept = names[len(names) - h.get(L.K_KEPT_COUNT) :]  # ... last, marked as kept, never loaded
    assert all(n.startswith("blk.1.") for n in kept)
    assert {f"blk.1.ffn_{p}_exps.weight" for p in ("gate", "up", "down")} <= set(kept)


def _restamp(p: Path) -> None:
    """Re-stamps the header checksum after an edit (what a writer of such a header would have done)."""
    h = read_header(str(p))
    raw = bytearray(p.read_bytes()[: h.data_start])
    pos = h.value_offsets[L.K_HEADER_CHECKSUM]
    raw[pos : pos + 8] = bytes(8)
    _patch(p, pos, xxhash.xxh3_64_intdigest(bytes(raw)).to_bytes(8, "little"))


def test_kept_count_must_match_the_mtp_blocks(model_factory: ModelFactory, tmp_path: Path) -> None:
    src = model_factory(arch="deepseek2", n_mtp=1)
    out = tmp_path / "mtp.tw.gguf"
    assert run_cli("repack", str(src), "-o", str(out), "-q").returncode == 0
    h = read_header(str(out))
    _patch(out, h.value_offsets[L.K_KEPT_COUNT], (h.get(L.K_KEPT_COUNT) - 1).to_bytes(4, "little"))
    _restamp(out)
    r = run_cli("verify", str(out))
    assert_clean_error(r, 3)
    assert "kept tensors do not match deepseek2.nextn_predict_layers" in r.stderr


# ------------------------------------------------------------------------------------- repacked files


def test_verify_plain_gguf_says_repack(model_factory: ModelFactory) -> None:
    r = run_cli("verify", str(model_factory()))
    assert_clean_error(r, 2)
    assert "tokenwing repack" in r.stderr


def test_newer_format_major_is_refused(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    p = _copy(repacked_factory(), tmp_path)
    h = read_header(str(p))
    _patch(p, h.value_offsets[L.K_MAJOR], (L.FORMAT_MAJOR + 1).to_bytes(4, "little"))
    _restamp(p)  # as a newer writer would have
    r = run_cli("verify", str(p))
    assert_clean_error(r, 4)
    assert "newer TokenWing (format 2.x)" in r.stderr


def test_corrupt_header_byte(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    p = _copy(repacked_factory(), tmp_path)
    h = read_header(str(p))
    pos = h.value_offsets["general.name"] + 8  # a character of the model's name
    _patch(p, pos, b"#")
    r = run_cli("verify", str(p))
    assert_clean_error(r, 3)
    assert "header or index fails its checksum" in r.stderr


def test_corrupt_expert_byte(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    p = _copy(repacked_factory(type="Q8_0"), tmp_path)
    h = read_header(str(p))
    offsets = h.get(L.K_LAYER_OFFSET)
    record = int(h.get(L.K_RECORD_SIZE)[1])
    _patch(p, int(offsets[1]) + 5 * record + 100, b"\xff\xfe")
    r = run_cli("verify", "--full", str(p))
    assert_clean_error(r, 3)
    assert "expert 5 of layer 1 fails its checksum" in r.stderr


def test_corrupt_resident_tensor(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    p = _copy(repacked_factory(type="Q8_0"), tmp_path)
    h = read_header(str(p))
    t = h.tensor("output_norm.weight")
    assert t is not None
    _patch(p, h.data_start + t.offset, b"\x00\x00\x00\x7f")
    r = run_cli("verify", "--full", str(p))
    assert_clean_error(r, 3)
    assert "output_norm.weight fails its checksum" in r.stderr


def test_truncated_repacked_file(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    src = repacked_factory(type="Q8_0")
    data = src.read_bytes()
    for cut in (100, len(data) // 2, len(data) - 4096):
        p = tmp_path / f"cut{cut}.tw.gguf"
        p.write_bytes(data[:cut])
        r = run_cli("verify", str(p))
        assert_clean_error(r)


def test_full_disk_leaves_nothing(model_factory: ModelFactory, tmpfs: Mount) -> None:
    """A real full disk: a 1 MiB tmpfs."""
    mnt = tmpfs(1 << 20)
    src = model_factory(type="F32", n_layer=4)  # ~1.3 MB: does not fit
    r = run_cli("repack", str(src), "-o", str(mnt / "x.tw.gguf"), "-q")
    assert_clean_error(r, 5)
    assert "not enough free space" in r.stderr
    # the numbers add up: the margin is named ("need 1.2 MiB, 1.0 MiB free" before, of a 16 MiB margin unsaid)
    assert "and a margin of 16.00 MiB)" in r.stderr
    assert _outputs(mnt) == []
    r = run_cli("testmodel", str(mnt / "big.gguf"), "--n-layer", "8", "-q")
    assert_clean_error(r, 5)
    assert _outputs(mnt) == []
