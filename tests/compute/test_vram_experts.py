"""The VRAM tier's expert outputs against the CPU's, expert by expert, for every family's expert FFN (plain SwiGLU,
gpt-oss's biases and clamped swiglu_oai) and weight type: a decode token's experts from VRAM (`launch`/`collect`), a
prompt's pairs from VRAM (`from_vram`) and a prompt wave copied up from RAM (`from_ram`, both sets of places).

The logits tests cannot see a wrong expert on models tame enough to be compared with llama.cpp (a routed expert
moves their logits too little): this looks at the experts themselves. The CPU reference is ggml's CPU backend on the
RAM slot pool (`common.routed_experts`), which rounds activations to 8 bits for quantized weights (lavapipe computes
in float): relative error ≤ 3e-2, as the device tests allow; a wrong slot or weight is off by ~1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.compute.conftest import DEVICES, device
from tests.compute.references import model
from tests.compute.test_vram import CASES
from tests.conftest import ModelFactory
from tests.oracle.test_logits import _repacked
from tokenwing.compute.devices import DeviceOptions
from tokenwing.compute.ggml_lib import to_numpy
from tokenwing.compute.probe import choose_device
from tokenwing.models import common
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.runtime.vram import VramOptions

pytestmark = pytest.mark.own_process


def worst(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.skipif(not DEVICES, reason="no device (ggml built for the CPU only)")
@pytest.mark.parametrize("key", list(CASES))
def test_the_devices_experts_are_the_cpus(key: str, model_factory: ModelFactory, tmp_path: Path) -> None:
    type_name, shape, _ = CASES[key]
    src = model(key, lambda: model_factory(type=type_name, **shape))  # type: ignore[arg-type]
    path = _repacked(src, tmp_path)
    choice = choose_device(DeviceOptions(device(DEVICES[0]).kind, "256M"))
    options = SessionOptions(
        n_ctx=256, device=choice, usage_table=False, cpu_repack=False, vram=VramOptions(max_layers=0)
    )
    s = Session(str(path), options, log=lambda line: None)
    try:
        v = s.vram
        assert v is not None and v.experts is not None and v.experts.full and s.scheduler.slot_map is not None
        rng = np.random.default_rng(5)
        hp, k = s.hp, s.hp.n_expert_used
        for block in s.streamed:
            width = s.model.expert_width(hp, block)  # (Kimi K3's experts take a latent narrower than n_embd)
            cur = rng.standard_normal((6, width)).astype(np.float32)
            sel = np.stack([rng.permutation(hp.n_expert)[:k] for _ in range(6)]).astype(np.int32)
            w = rng.uniform(0.1, 1.0, sel.shape).astype(np.float32)
            tok, j = np.nonzero(np.ones_like(sel, bool))
            pairs = np.lexsort((tok, sel[tok, j]))  # sorted by expert, as a prompt's wave is
            tok, experts, weights = tok[pairs], sel[tok[pairs], j[pairs]], w[tok[pairs], j[pairs]]
            g = s.graph
            g.reset()
            ram = s.scheduler.slot_map[block]
            out = common.routed_experts(
                g, s.pools.views[block], cur, tok, ram[experts], weights, experts, s.experts.ffn[block]
            )
            g.compute(out)
            want = to_numpy(out).reshape(len(tok), -1)
            # a prompt's pairs from VRAM, and a wave copied up from RAM into the waves' places
            assert worst(v.from_vram(block, cur, tok, experts, weights), want) < 3e-2, (key, block)
            assert worst(v.from_ram(block, cur, tok, experts, weights, ram), want) < 3e-2, (key, block)
            # a decode token's experts queued on the device, at their ranks
            weighted = np.zeros((1, k, width), np.float32)
            v.collect(v.launch(block, cur[:1], sel[:1], w[:1], sel[0].tolist()), weighted)
            first = [int(np.flatnonzero((tok == 0) & (experts == e))[0]) for e in sel[0]]
            assert worst(weighted[0], want[first]) < 3e-2, (key, block)
    finally:
        s.close()
