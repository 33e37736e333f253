"""VRAM expert swaps (spec §5): the rule (every 8 decode tokens, at most 64 experts, a newcomer's recent count
beating 1.25 × the leaver's + 4), a routing shift moving experts into VRAM on the device, and a swap never
holding up a token: the copy is staged by a helper thread and moved in between two steps."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.compute.conftest import DEVICES, device
from tests.conftest import ModelFactory
from tests.oracle.test_logits import _repacked
from tokenwing import testpause
from tokenwing.compute.devices import DeviceOptions
from tokenwing.compute.probe import choose_device
from tokenwing.runtime.session import SESSION_COUNTERS, Session, SessionOptions
from tokenwing.runtime.vram import VramOptions
from tokenwing.runtime.vram.experts import PAUSE_STAGE, SWAP_EVERY, SWAP_MARGIN, SWAP_RATIO, plan_swaps


def all_in_ram(row: int, experts: list[int]) -> list[bool]:
    return [True] * len(experts)


def test_the_swap_rule() -> None:
    recent = np.zeros((2, 8))
    recent[0] = [10, 0, 0, 20, 17, 16.5, 0, 0]  # layer 0 holds experts 0 and 1 (counts 10 and 0)
    recent[1] = [0, 0, 0, 0, 0, 0, 3, 1]  # layer 1: slot 1 is empty
    expert_in = np.array([[0, 1], [2, -1]], np.int32)
    swaps = plan_swaps(recent, expert_in, all_in_ram)
    got = {(s.row, s.expert, s.slot, s.leaver) for s in swaps}
    # layer 0: expert 3 (20) replaces expert 1 (0 < 20 - 4); expert 4 (17) beats 1.25 · 10 + 4 = 16.5, expert 5
    # (16.5) does not; layer 1: the empty slot takes the most used outsider, and 7 then needs more than 1.25 · 0 + 4
    assert got == {(0, 3, 1, 1), (0, 4, 0, 0), (1, 6, 1, -1)}
    for s in swaps:
        assert s.leaver < 0 or s.count > SWAP_RATIO * s.leaver_count + SWAP_MARGIN
    # the best gains first, at most `limit`; only experts in RAM (a swap copies from the RAM slot)
    assert [(s.row, s.expert) for s in plan_swaps(recent, expert_in, all_in_ram, limit=2)] == [(0, 3), (0, 4)]
    assert {s.expert for s in plan_swaps(recent, expert_in, lambda row, ex: [e != 3 for e in ex])} == {4, 6}


def test_at_most_64_swaps_per_decision() -> None:
    recent = np.zeros((4, 128))
    recent[:, 64:] = 100.0  # every layer wants its other 64 experts
    expert_in = np.tile(np.arange(64, dtype=np.int32), (4, 1))
    swaps = plan_swaps(recent, expert_in, all_in_ram)
    assert len(swaps) == 64 and len({(s.row, s.slot) for s in swaps}) == 64


# 16 experts, top-2, 3 layers: a VRAM cache of 4 per layer; the attention stays on the CPU (faster on lavapipe)
SHAPE = {"arch": "qwen3moe", "n_layer": 3, "n_expert": 16, "n_expert_used": 2}
TEXT_A, TEXT_B = [11, 12, 13, 14, 15, 16], [301, 302, 303]  # two texts of different character, each repeated


def session(path: Path, kind: str, log: list[str]) -> Session:
    choice = choose_device(DeviceOptions(kind, "256M"))
    probe = Session(str(path), SessionOptions(n_ctx=512, device=choice, usage_table=False), log=log.append)
    assert probe.vram is not None
    row, reserve, head = probe.vram.expert_row, probe.vram.plan.reserve, probe.vram.head_bytes
    probe.close()
    choice = choose_device(DeviceOptions(kind, str(reserve + head + 4 * row)))
    options = SessionOptions(n_ctx=512, device=choice, usage_table=False, vram=VramOptions(max_layers=0))
    s = Session(str(path), options, log=log.append)
    assert s.vram is not None and s.vram.experts is not None and s.vram.experts.n_slots == 4
    return s


@pytest.fixture(params=DEVICES or ["none"])
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "none":
        pytest.skip("no device (ggml built for the CPU only)")
    return device(request.param).kind


def decode(s: Session, text: list[int], n: int) -> None:
    for i in range(n):
        s.forward([text[i % len(text)]])


@pytest.mark.own_process
def test_a_routing_shift_moves_experts_into_vram(kind: str, model_factory: ModelFactory, tmp_path: Path) -> None:
    path = _repacked(model_factory(type="Q8_0", **SHAPE), tmp_path)  # type: ignore[arg-type]
    s = session(path, kind, [])
    try:
        ex = s.vram.experts  # type: ignore[union-attr]
        assert ex is not None and (ex.expert_in < 0).all()  # no usage table: empty until decode fills it
        s.forward([1, 2, 3, 4])
        decode(s, TEXT_A, 64)
        after_a = ex.expert_in.copy()
        assert (after_a >= 0).all()  # A filled every slot
        counts_before_b = s.scheduler.usage.counts.copy()
        swaps_before_b = len(ex.swap_log)
        decode(s, TEXT_B, 96)
        used_by_b = s.scheduler.usage.counts - counts_before_b
        c = s.counters()
        vram_hits = c[:, SESSION_COUNTERS.index("vram_hits")]
    finally:
        s.close()
    # A filled the cache; B moved its experts in, in place of A's
    assert swaps_before_b > 0 and any(sw.leaver >= 0 for _, sw in ex.swap_log[swaps_before_b:])
    # within the bounds: decisions every SWAP_EVERY decode tokens, at most 64 each, each by the rule
    assert all(t % SWAP_EVERY == 0 and 0 <= n <= 64 for t, n in ex.decisions)
    for _, sw in ex.swap_log:
        assert sw.leaver < 0 or sw.count > SWAP_RATIO * sw.leaver_count + SWAP_MARGIN
    # the experts B uses most are in VRAM after it, more of them than after A
    top_b = [set(np.argsort(-used_by_b[row], kind="stable")[:2].tolist()) for row in range(used_by_b.shape[0])]
    before = sum(len(top & set(after_a[row].tolist())) for row, top in enumerate(top_b))
    after = sum(len(top & set(ex.expert_in[row].tolist())) for row, top in enumerate(top_b))
    assert after > before and after >= len(top_b), (before, after, top_b, ex.expert_in)
    assert vram_hits.sum() > 0


@pytest.mark.own_process
def test_a_swap_never_holds_up_a_token(
    kind: str, model_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper thread that stages swaps is held at its first swap (a test pause): decode goes on regardless,
    token after token, with the swaps pending; let go, they move in at the next step boundaries."""
    path = _repacked(model_factory(type="Q8_0", **SHAPE), tmp_path)  # type: ignore[arg-type]
    monkeypatch.setattr(testpause, "_armed", frozenset({PAUSE_STAGE}))
    monkeypatch.setenv(testpause.DIR_ENV, str(tmp_path))
    s = session(path, kind, [])
    try:
        ex = s.vram.experts  # type: ignore[union-attr]
        assert ex is not None
        s.forward([1, 2, 3, 4])
        decode(s, TEXT_A, 3 * SWAP_EVERY)
        assert (tmp_path / (PAUSE_STAGE + testpause.REACHED)).exists()  # the helper is held
        assert ex.pending > 0 and not ex.swap_log  # swaps decided, none staged: and the tokens came anyway
        assert int(s.counters()[:, SESSION_COUNTERS.index("vram_swaps_in")].sum()) == 0
        (tmp_path / (PAUSE_STAGE + testpause.GO)).touch()
        for _ in range(400):  # (the helper stages in its own time: steps go on until it has)
            decode(s, TEXT_A, 1)
            if ex.swap_log:
                break
        assert ex.swap_log, "the released swaps never moved in"
        tokens_at_commit = {t for t, _ in ex.swap_log}
        # moved in at step boundaries (`between_steps`, before a step), never during one
        assert tokens_at_commit <= set(range(3 * SWAP_EVERY, ex.decode_tokens + 1))
        assert int(s.counters()[:, SESSION_COUNTERS.index("vram_swaps_in")].sum()) == len(ex.swap_log)
    finally:
        s.close()
    assert os.path.exists(tmp_path / (PAUSE_STAGE + testpause.REACHED))
