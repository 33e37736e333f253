"""Round trip: every tensor and every expert slice of the repacked file is byte-identical to the source."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import xxhash

from tests.conftest import ModelFactory
from tokenwing.format import layout as L
from tokenwing.format.inspect import format_report, inspect_model
from tokenwing.format.reader import ModelFile
from tokenwing.format.repack import repack

CASES = [
    ("qwen3moe", "F32", {}),
    ("qwen3moe", "F16", {}),
    ("qwen3moe", "BF16", {}),
    ("qwen3moe", "Q8_0", {}),
    ("qwen3moe", "Q4_0", {}),
    ("qwen2moe", "Q8_0", {"n_shared_exp": 1}),
    ("ernie4_5-moe", "F16", {"n_layer": 3, "n_dense_lead": 1, "n_shared_exp": 1}),
    ("glm4moe", "Q8_0", {"n_layer": 3, "n_dense_lead": 1, "n_shared_exp": 1}),
    ("deepseek2", "F32", {}),
    ("deepseek2", "Q8_0", {"n_mtp": 1}),
    ("deepseek2", "F16", {"legacy_kv_b": True}),
    ("deepseek2", "Q8_0", {"q_lora_rank": 0, "n_layer": 27}),
    (None, "Q8_0", {"preset": "kimi-tiny"}),
    ("gpt-oss", "F32", {}),
    ("gpt-oss", "Q8_0", {}),
    ("gpt-oss", "MXFP4_MOE", {}),
    ("gpt-oss", "BF16", {"expert_type": "MXFP4"}),
]


def _raw(reader: gguf.GGUFReader, path: Path) -> dict[str, bytes]:
    data = path.read_bytes()
    return {t.name: data[t.data_offset : t.data_offset + t.n_bytes] for t in reader.tensors}


def _check_round_trip(src_paths: list[Path], out: Path) -> None:
    source: dict[str, bytes] = {}
    src_kv: dict[str, object] = {}
    for p in src_paths:
        r = gguf.GGUFReader(str(p))
        source.update(_raw(r, p))
        for k, f in r.fields.items():
            if not k.startswith(("GGUF.", "split.")):
                src_kv[k] = f.contents()
    reader = gguf.GGUFReader(str(out))  # a standard GGUF reader reads the repacked file
    packed = _raw(reader, out)
    out_kv = {k: f.contents() for k, f in reader.fields.items()}
    for k, v in src_kv.items():
        if k != "general.alignment":
            assert out_kv[k] == v, k
    assert out_kv["general.alignment"] == L.ALIGNMENT
    file_bytes = out.read_bytes()
    with ModelFile.open(str(out)) as mf:
        n_expert = mf.index.n_expert
        for t in mf.resident:
            assert packed[t.name] == source[t.name], t.name
            assert (
                mf.header.data_start + t.offset
                == reader.get_tensor([x.name for x in reader.tensors].index(t.name)).data_offset
            )
        for i, t in enumerate([*mf.resident, *mf.kept]):  # kept tensors last
            assert packed[t.name] == source[t.name], t.name
            assert int(mf.resident_checksums[i]) == xxhash.xxh3_64_intdigest(source[t.name])
        assert len(mf.index.layers) > 0
        for li, el in enumerate(mf.index.layers):
            for p, proj in enumerate(L.PROJECTIONS):
                whole = source[L.source_expert_name(el.layer, proj)]
                size = len(whole) // n_expert
                assert size == el.proj_size[p]
                for e in range(n_expert):
                    start = el.expert_offset(e) + el.proj_offset[p]
                    assert start % L.ALIGNMENT == 0
                    assert file_bytes[start : start + size] == whole[e * size : (e + 1) * size]
                    assert packed[L.expert_tensor_name(el.layer, proj, e)] == whole[e * size : (e + 1) * size]
            for e in range(n_expert):
                off = el.expert_offset(e)
                assert off % L.ALIGNMENT == 0 and el.record_size % L.ALIGNMENT == 0
                record = file_bytes[off : off + el.record_size]
                assert xxhash.xxh3_64_intdigest(record) == int(mf.index.checksums[li, e])
                assert mf.read_expert(el.layer, e) == record
            # gate and up come before down, so the engine can start on them first
            assert el.proj_offset[0] < el.proj_offset[1] < el.proj_offset[2] < el.record_size
        report = mf.verify(full=True)
        assert report.experts_checked == len(mf.index.layers) * n_expert
        assert report.tensors_checked == len(mf.resident) + len(mf.kept)
        # every source tensor is in the file: resident, kept or as experts
        experts = {L.source_expert_name(el.layer, p) for el in mf.index.layers for p in L.PROJECTIONS}
        assert {t.name for t in [*mf.resident, *mf.kept]} | experts == set(source)
    # No second copy of the experts: the file is about the size of the source (plus up to 4 KiB of alignment
    # per tensor, which is what tiny models with many layers are made of).
    src_size = sum(p.stat().st_size for p in src_paths)
    assert out.stat().st_size < src_size * 1.35 + (1 << 20) + L.ALIGNMENT * len(reader.tensors)


@pytest.mark.parametrize(
    ("arch", "type_name", "shape"), CASES, ids=[f"{a or s['preset']}-{t}-{len(s)}" for a, t, s in CASES]
)
def test_round_trip_is_byte_identical(
    model_factory: ModelFactory, tmp_path: Path, arch: str | None, type_name: str, shape: dict[str, object]
) -> None:
    src = model_factory(arch=arch, type=type_name, **shape)
    out = tmp_path / "out.tw.gguf"
    repack([str(src)], str(out), show_progress=False)
    _check_round_trip([src], out)


@pytest.mark.oracle
@pytest.mark.parametrize(
    ("arch", "type_name"),
    [("qwen3moe", "Q4_K_M"), ("qwen3moe", "Q6_K"), ("deepseek2", "Q4_K_M"), ("gpt-oss", "Q4_K_M")],
)
def test_round_trip_kquant(model_factory: ModelFactory, tmp_path: Path, arch: str, type_name: str) -> None:
    src = model_factory(arch=arch, preset="kquant", type=type_name)
    out = tmp_path / "out.tw.gguf"
    repack([str(src)], str(out), show_progress=False)
    _check_round_trip([src], out)
    with ModelFile.open(str(out)) as mf:
        kinds = {gguf.GGMLQuantizationType(t).name for el in mf.index.layers for t in el.types}
    assert kinds & {"Q4_K", "Q5_K", "Q6_K"}, kinds


def test_split_source_round_trip(model_factory: ModelFactory, tmp_path: Path) -> None:
    first = model_factory(type="Q8_0", shards=3, n_layer=3)
    shards = sorted(first.parent.glob(first.name.replace("-00001-of-00003", "-*-of-00003")))
    assert len(shards) == 3
    out = tmp_path / "split.tw.gguf"
    repack([str(first)], str(out), show_progress=False)  # the first shard stands for all
    _check_round_trip(shards, out)
    out2 = tmp_path / "split2.tw.gguf"
    repack([str(p) for p in reversed(shards)], str(out2), show_progress=False)  # or all, in any order
    assert out2.read_bytes() == out.read_bytes()


def test_repack_is_deterministic(model_factory: ModelFactory, tmp_path: Path) -> None:
    src = model_factory(type="Q4_0")
    a, b = tmp_path / "a.tw.gguf", tmp_path / "b.tw.gguf"
    repack([str(src)], str(a), show_progress=False)
    repack([str(src)], str(b), show_progress=False)
    assert a.read_bytes() == b.read_bytes()


def test_index_geometry(repacked_factory: ModelFactory) -> None:
    out = repacked_factory(type="Q8_0", n_layer=3)
    with ModelFile.open(str(out)) as mf:
        ex = mf.index
        assert [el.layer for el in ex.layers] == [0, 1, 2]
        assert ex.n_expert == 8 and ex.n_used == 2
        for el in ex.layers:
            assert el.shapes == ((64, 32), (64, 32), (32, 64))
            assert el.proj_size == (64 * 32 // 32 * 34,) * 3
        assert ex.miss_bytes_per_token == sum(el.record_size for el in ex.layers) * 2
        assert ex.layers[1].offset == ex.layers[0].offset + ex.layers[0].record_size * ex.n_expert
        assert np.unique(ex.checksums).size == ex.checksums.size  # random experts: all different


def test_mtp_block_is_kept_not_loaded(model_factory: ModelFactory, tmp_path: Path) -> None:
    """DeepSeek-V3's next-token-prediction block stays in the file, marked, and is neither streamed nor loaded."""
    src = model_factory(arch="deepseek2", type="Q8_0", n_mtp=1)
    out = tmp_path / "mtp.tw.gguf"
    repack([str(src)], str(out), show_progress=False)
    with ModelFile.open(str(out)) as mf:
        n_layer = mf.header.get("deepseek2.block_count") - 1
        assert mf.header.get("deepseek2.nextn_predict_layers") == 1
        assert [el.layer for el in mf.index.layers] == list(range(1, n_layer))  # the first is dense
        kept = {t.name for t in mf.kept}
        assert kept and all(name.startswith(f"blk.{n_layer}.") for name in kept)
        assert {f"blk.{n_layer}.nextn.eh_proj.weight", f"blk.{n_layer}.ffn_down_exps.weight"} <= kept
        assert not any(t.name.startswith(f"blk.{n_layer}.") for t in mf.resident)
        assert {info.name for info, _ in mf.iter_resident()} == {t.name for t in mf.resident}
        assert mf.header.get(L.K_KEPT_COUNT) == len(kept)
        assert len(mf.read_tensor(f"blk.{n_layer}.nextn.enorm.weight")) == 4 * 64  # still readable, checked
    report = inspect_model([str(out)])
    assert report["kept"]["tensors"] == len(kept) and report["kept"]["blocks"] == [n_layer]
    assert inspect_model([str(src)])["kept"] == report["kept"]  # the plain GGUF shows what a repack keeps
    assert "next-token-prediction block 2" in format_report(report)


def test_mxfp4_experts_and_their_biases(model_factory: ModelFactory, tmp_path: Path) -> None:
    """gpt-oss: MXFP4 projections each on a 4 KiB boundary of their record (direct reads per projection), the
    experts' biases resident beside the router's."""
    src = model_factory(arch="gpt-oss", type="MXFP4_MOE", n_ff_exp=96)
    out = tmp_path / "oss.tw.gguf"
    repack([str(src)], str(out), show_progress=False)
    with ModelFile.open(str(out)) as mf:
        names = {t.name for t in mf.resident}
        for el in mf.index.layers:
            assert {gguf.GGMLQuantizationType(t).name for t in el.types} == {"MXFP4"}
            assert el.shapes == ((64, 96), (64, 96), (96, 64))
            assert el.proj_size == (96 * 2 * 17, 96 * 2 * 17, 64 * 3 * 17)  # 17-byte blocks of 32 values
            assert all(o % L.ALIGNMENT == 0 for o in el.proj_offset) and el.record_size % L.ALIGNMENT == 0
            for p in ("gate", "up", "down"):
                assert f"blk.{el.layer}.ffn_{p}_exps.bias" in names
            assert f"blk.{el.layer}.ffn_gate_inp.bias" in names and f"blk.{el.layer}.attn_sinks.weight" in names
    report = inspect_model([str(out)])
    assert report["experts"]["expert_quant_types"] == {"MXFP4": 6}
    assert report["resident"]["quant_types"]["Q8_0"] > 0 and not report["kept"]["tensors"]
