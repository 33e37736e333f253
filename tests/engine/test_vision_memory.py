"""The image encoder in the memory plan (issue 45 item 6): `--mmproj` counts its weights and the compute buffer of
the largest image its preprocessing allows before the expert cache is sized, names it in one line, and the CPU
encoder's compute buffer is what ggml's allocator reuses between layers (measured, not estimated)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.oracle.test_qwen3vl_images import factory_files, image
from tokenwing.runtime import session as session_module
from tokenwing.runtime.placement import LayerCost, plan_keeping, plan_vram
from tokenwing.runtime.session import Session, SessionOptions, session_memory
from tokenwing.streaming.memory import HEADROOM, MemoryInfo
from tokenwing.vision.device import EncoderBackend, compute_bytes, cpu_backend
from tokenwing.vision.logits import encoder_memory
from tokenwing.vision.qwen3vl import Qwen3VLEncoder

GiB = 1 << 30


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return factory_files(tmp_path_factory.mktemp("vision_memory"), "qwen3vlmoe")


def test_the_plan_counts_the_encoder_before_the_expert_cache(
    files: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, mmproj, model = files
    memory = encoder_memory(str(mmproj))
    # the factory's encoder: 378 KiB of weights; a 1024×1024 image (4,096 merged patches, 16,384 patches) needs one
    # layer's attention scores at a time, 2 heads × 16,384² floats, and more beside them
    assert memory.size == (1024, 1024) and memory.weights == 387456
    assert 2 * 16384**2 * 4 <= memory.compute < 3 * 16384**2 * 4
    info = MemoryInfo(16 * GiB, 8 * GiB, 6 * GiB, 0)  # (a memory cap under the free RAM)
    monkeypatch.setattr(session_module, "memory_info", lambda: info)
    held = ((memory.describe(), memory.total),)
    s = Session(str(model), SessionOptions(n_ctx=512, also_held=held), log=lambda line: None)
    try:
        specs = [s.model.state_spec(il) for il in range(s.hp.n_layer)]
        args = (type(s.model), s.hp, specs, s.model.weights.bytes)
        without = session_memory(*args, SessionOptions(n_ctx=512), info, 1)
        with_it = session_memory(*args, SessionOptions(n_ctx=512, also_held=held), info, 1)
        # the session's one-line report (the server's "ready:" line) names it
        assert s.describe().endswith(f"; the memory plan counts {memory.describe()}")
        assert s.scheduler.capacity <= with_it.budget
    finally:
        s.close()
    assert without.budget - with_it.budget == memory.total  # the expert cache gets the encoder's bytes less
    assert (with_it.n_ctx, with_it.kv_bytes, with_it.graph_mem) == (without.n_ctx, without.kv_bytes, without.graph_mem)
    # under the cap, all that the plan holds (the encoder too) beside what the process had
    planned = with_it.budget + with_it.kv_bytes + with_it.graph_mem + memory.total
    assert planned <= min(info.available - HEADROOM, info.limit - info.used_in_group)


def test_the_cpu_encoder_s_compute_buffer_is_measured_and_its_rows_unchanged(files: tuple[Path, Path, Path]) -> None:
    """The CPU encoder runs on ggml's CPU backend with its graph allocator: the buffer an image's graph takes is
    what `compute_bytes` measures, growing with the image's patches as one layer's scores do, not with the layers."""
    _, mmproj, _ = files
    enc = Qwen3VLEncoder(str(mmproj))
    try:
        on = EncoderBackend(cpu_backend(enc.n_threads), enc._cpu_w)
        small, large = (enc.preprocess(image(h, w, seed=1)) for h, w in ((48, 64), (192, 256)))
        a, b = compute_bytes(enc, on, small), compute_bytes(enc, on, large)
        assert 0 < a < b
        # 16× the patches: the scores 256× (n_pos²), the rest 16×; bounded by one layer's, not n_layer's
        n_pos = (256 // 8) * (192 // 8)
        assert b < 4 * enc.hp.n_head * n_pos * n_pos * 4 + 64 * enc.hp.n_embd * n_pos * 4
        rows = enc.encode(small)
        assert rows.shape == (12, enc.width) and np.isfinite(rows).all()
    finally:
        enc.close()


def test_the_vram_plan_keeps_room_for_the_encoder_out_of_the_expert_cache() -> None:
    """With a device, the tier leaves the encoder's bytes free, taken from its expert slots, where its layers and
    head still fit beside them; where they would not, it keeps nothing (the encoder then computes on the CPU)."""
    MiB = 1 << 20
    layers = [LayerCost(100 * MiB, 20 * MiB)] * 4
    args = (2000 * MiB, 200 * MiB, layers, 50 * MiB, [10 * MiB] * 4, 64)  # 1,270 MiB left for 40 MiB expert rows
    plain = plan_vram(*args)
    kept = plan_keeping(*args, keep=300 * MiB)
    assert (plain.layers, plain.head, plain.expert_slots) == ((0, 1, 2, 3), True, 31)
    assert (kept.layers, kept.head, kept.expert_slots, kept.kept) == ((0, 1, 2, 3), True, 24, 300 * MiB)
    assert kept.reserve == plain.reserve and kept.budget - kept.used >= 300 * MiB
    assert kept.describe().endswith("300.00 MiB kept for the image encoder")
    # a keep the layers would have to make room for: nothing kept, the text model placed as before
    assert plan_keeping(*args, keep=1300 * MiB) == plain
    assert plan_keeping(*args, keep=0) == plain
