"""Issue 41: the families' own hyper-parameter checks are part of the one header validator. A crafted header whose
numbers pass every range but not its family's checks (head counts and sizes against the tensors the file holds,
an MLA cache's geometry, a linear-attention layer's widths) is refused by `inspect` (source and model file),
`repack` and `verify` alike, in the same line, each as a real subprocess under a 2 GiB address-space limit.
Before, only a start and `verify` ran these checks (models.check_model): `inspect` showed such a source as a
model and `repack` converted it, exit 0."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tests.conftest import ModelFactory, assert_clean_error
from tests.format.test_hostile_header import run_limited, set_int
from tokenwing.format.gguf_io import encode_header, read_header

# (family, key set, value, the refusal's words): each value within RANGES, each refused by its family only
CASES = [
    ("qwen3moe", "attention.key_length", 32, "tensor blk.0.attn_q.weight has shape (64, 64), the metadata implies"),
    ("deepseek2", "attention.head_count", 8, "tensor blk.0.attn_q_b.weight has shape (96, 192), the metadata implies"),
    ("deepseek2", "attention.key_length", 160, "an MLA cache needs head_count_kv 1 and key_length kv_lora_rank"),
    ("gpt-oss", "attention.head_count_kv", 4, "tensor blk.0.attn_k.weight has shape"),
    ("qwen3next", "ssm.inner_size", 128, "ssm.inner_size must be ssm.state_size × ssm.time_step_rank"),
    ("bailingmoe2", "attention.head_count_kv", 1, "tensor blk.0.attn_qkv.weight has shape (64, 128), the metadata"),
    ("bailingmoe2", "attention.head_count", 2, "bailingmoe2's query heads must fill embedding_length"),
    ("llama4", "interleave_moe_layer_step", 1, "tensor blk.0.ffn_gate_inp.weight is missing"),
    ("hy_v3", "rope.dimension_count", 8, "hy_v3 rotates whole heads of one size"),
    ("step35", "rope.dimension_count", 6, "step35's rotary dims (half of rope.dimension_count in the full layers"),
    ("step35", "attention.sliding_window", 0, "step35's sliding-window layers need attention.sliding_window"),
]


@pytest.mark.parametrize(("arch", "key", "value", "words"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_header_its_family_refuses_is_refused_by_every_command(
    model_factory: ModelFactory,
    repacked_factory: ModelFactory,
    tmp_path: Path,
    arch: str,
    key: str,
    value: int,
    words: str,
) -> None:
    src = set_int(model_factory(arch=arch), tmp_path / "m.gguf", f"{arch}.{key}", value)
    tw = set_int(repacked_factory(arch=arch), tmp_path / "m.tw.gguf", f"{arch}.{key}", value)
    out = tmp_path / "out"
    out.mkdir()
    runs = {
        "inspect gguf": run_limited("inspect", str(src)),
        "repack": run_limited("repack", str(src), "-o", str(out / "m.tw.gguf"), "-q"),
        "inspect tw": run_limited("inspect", str(tw)),
        "verify": run_limited("verify", str(tw)),
    }
    for what, r in runs.items():
        assert_clean_error(r, 2)
        assert words in r.stderr, (what, r.stderr)
    assert os.listdir(out) == []  # nothing written, not even a partial file
    # one validator: the same line from each command, but for the file's name
    assert len({r.stderr.replace(str(src), "FILE").replace(str(tw), "FILE") for r in runs.values()}) == 1, runs


def test_a_hy_v3_bias_under_the_other_families_name_is_refused(model_factory: ModelFactory, tmp_path: Path) -> None:
    """llama.cpp's hy_v3 loader reads the router's selection bias as a bare blk.N.exp_probs_b; under the name every
    other family's files give it (exp_probs_b.bias) llama.cpp finds one tensor too many and loads nothing. The
    engine refuses that file too, in one line naming the tensor, where it would otherwise run without the bias."""
    src = read_header(str(model_factory(arch="hy_v3")))
    renamed = [
        dataclasses.replace(t, name=t.name + ".bias") if t.name.endswith(".exp_probs_b") else t for t in src.tensors
    ]
    header, _ = encode_header(src.kv, renamed, src.alignment)
    bad = tmp_path / "bias.gguf"
    with open(src.path, "rb") as f:
        f.seek(src.data_start)
        bad.write_bytes(header + f.read())  # (the tensor table's offsets are relative to the data: unchanged)
    for r in (
        run_limited("inspect", str(bad)),
        run_limited("repack", str(bad), "-o", str(tmp_path / "b.tw.gguf"), "-q"),
    ):
        assert_clean_error(r, 2)
        assert "blk.1.exp_probs_b.bias: hy_v3's selection bias is named blk.N.exp_probs_b" in r.stderr, r.stderr
