"""A sequence's state on disk (runtime/snapshot.py, issue 44): written by one session, read by another, the logits
after the restore are those of the uninterrupted run to the bit — for attention, MLA, a sliding window, recurrent
layers (with their checkpoints), in RAM and streamed — and a snapshot that is damaged or not this model's is
refused before it changes anything."""

from __future__ import annotations

import json
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ModelFactory
from tokenwing.runtime import snapshot
from tokenwing.runtime.session import Session, SessionOptions

FAMILIES = {
    "qwen3moe": {},  # attention
    "deepseek2": {"arch": "deepseek2"},  # MLA: V in the latent
    "gpt-oss": {"arch": "gpt-oss"},  # sliding-window layers, sinks
    "ling": {"arch": "bailingmoe3", "n_layer": 4},  # KDA (recurrent) and MLA, with checkpoints
}
ELT = 4  # f32 caches


def _session(model: str, budget: int | None) -> Session:
    options = SessionOptions(
        kv_type="f32", n_ctx=256, max_batch=16, checkpoint_interval=32, ram_budget=budget, usage_table=False
    )
    return Session(model, options, log=lambda line: None)


def _tags(s: Session, model: str) -> snapshot.Tags:
    return snapshot.make_tags(model, s.chat_template, s.seqs[0], "f32")


def _save(s: Session, model: str, path: Path) -> None:
    snapshot.write(str(path), _tags(s, model), snapshot.capture(s.seqs[0], ELT))


def _continue(s: Session, prompt: list[int], steps: int = 3) -> tuple[int, list[np.ndarray]]:
    """The prompt from what the session holds (prompt caching), then greedy decode steps: every logit."""
    kept = s.reuse_prefix(prompt)
    out = [s.forward(prompt[kept:], all_logits=True, prompt=True)]
    for _ in range(steps):
        out.append(s.forward([int(out[-1][-1].argmax())]))
    return kept, out


@pytest.mark.parametrize("budget", [None, 1], ids=["ram", "streamed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_restored_state_gives_the_uninterrupted_logits(
    repacked_factory: ModelFactory, tmp_path: Path, family: str, budget: int | None
) -> None:
    model = str(repacked_factory(**FAMILIES[family]))  # F32 weights: differences would show
    rng = np.random.default_rng(7)
    first = [int(t) for t in rng.integers(0, 200, 100)]
    follow = first + [int(t) for t in rng.integers(0, 200, 20)]  # the conversation goes on
    branch = first[:70] + [int(t) for t in rng.integers(0, 200, 20)]  # shares 70 tokens, then differs
    path = tmp_path / f"a{snapshot.SUFFIX}"
    writer, reader = _session(model, budget), _session(model, budget)
    try:
        writer.forward(first, prompt=True)
        _save(writer, model, path)
        for prompt in (follow, branch):
            reader.reset()
            assert snapshot.restore(str(path), _tags(reader, model), reader.seqs[0], ELT) == len(first)
            got_kept, got = _continue(reader, prompt)
            writer.reuse_prefix(first)  # the uninterrupted run: back to what was saved (the same cut-back)
            writer.forward(first[writer.pos :], prompt=True)
            want_kept, want = _continue(writer, prompt)
            assert got_kept == want_kept > 0
            if prompt is follow:
                assert got_kept == len(first)  # nothing recomputed
            for g, w in zip(got, want, strict=True):
                assert np.array_equal(g, w)
    finally:
        writer.close()
        reader.close()


@pytest.fixture(scope="module")
def saved(repacked_factory: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, bytes]:
    model = str(repacked_factory(**FAMILIES["ling"]))
    s = _session(model, None)
    try:
        s.forward(list(range(3, 80)), prompt=True)
        path = tmp_path_factory.mktemp("snap") / f"good{snapshot.SUFFIX}"
        _save(s, model, path)
    finally:
        s.close()
    return model, path, path.read_bytes()


def _damaged(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / f"bad{snapshot.SUFFIX}"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    "damage",
    ["truncated", "header-byte", "payload-byte", "last-byte", "appended", "empty"],
)
def test_damaged_snapshot_is_refused_and_nothing_half_restored_is_used(
    saved: tuple[str, Path, bytes], tmp_path: Path, damage: str
) -> None:
    model, _, data = saved
    b = bytearray(data)
    if damage == "truncated":
        b = b[: len(b) // 2]
    elif damage == "header-byte":
        b[20] ^= 0x01
    elif damage == "payload-byte":
        b[len(b) // 2] ^= 0x10
    elif damage == "last-byte":
        b[-1] ^= 0x80
    elif damage == "appended":
        b += b"\0"
    else:
        b = bytearray()
    s = _session(model, None)
    try:
        prompt = [9, 8, 7, 6, 5, 4]
        s.forward(prompt, prompt=True)
        before = (list(s.history), s.pos, [c.pos for c in s.checkpoints.saved])
        with pytest.raises(snapshot.SnapshotError):
            snapshot.restore(_damaged(tmp_path, bytes(b)), _tags(s, model), s.seqs[0], ELT)
        # refused before any of it was copied: unchanged; a section's checksum fails once copying began: empty
        after = ([], 0, []) if damage.endswith("-byte") and damage != "header-byte" else before
        assert (list(s.history), s.pos, [c.pos for c in s.checkpoints.saved]) == after
    finally:
        s.close()


def test_snapshot_of_another_model_build_or_template_is_refused(
    saved: tuple[str, Path, bytes], repacked_factory: ModelFactory
) -> None:
    model, path, _ = saved
    s = _session(model, None)
    try:
        tags = _tags(s, model)
        assert snapshot.read(str(path), tags).tokens == list(range(3, 80))  # (whole and ours: taken)
        other = str(repacked_factory(**FAMILIES["ling"], seed=11))  # same shapes, other weights
        for wrong, why in [
            (snapshot.Tags(snapshot.model_identity(other), tags.build, tags.template, tags.layout), "another model"),
            (snapshot.Tags(tags.model, tags.build + "+1", tags.template, tags.layout), "another build"),
            (snapshot.Tags(tags.model, tags.build, "0" * 32, tags.layout), "another template"),
            (snapshot.Tags(tags.model, tags.build, tags.template, "f16"), "another layout"),
        ]:
            with pytest.raises(snapshot.SnapshotError, match=why):
                snapshot.read(str(path), wrong)
    finally:
        s.close()


@pytest.mark.parametrize("piece", [16 << 20, 8192], ids=["one-piece", "many-pieces"])
def test_read_through_the_streaming_core(
    saved: tuple[str, Path, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    """The server's read (snapshot.core_reads: the session's streaming core) gives what the threads' read gives;
    the payload starts 4 KiB-aligned (the header's padding), a file without the padding reads the same, and a
    flipped byte in any piece (each section's CRC runs on across pieces) or the unaligned tail is refused."""
    model, path, data = saved
    monkeypatch.setattr(snapshot, "PIECE", piece)
    n = int.from_bytes(data[8:12], "little")
    assert (16 + n) % snapshot.ALIGN == 0 and data[16 + n - 1 : 16 + n] == b" "
    header = snapshot.read_header(open(path, "rb"))  # noqa: SIM115 (read once)
    text = json.dumps(header, separators=(",", ":")).encode()
    unpadded = tmp_path / f"old{snapshot.SUFFIX}"
    unpadded.write_bytes(snapshot._HEAD.pack(snapshot.MAGIC, len(text), zlib.crc32(text)) + text + data[16 + n :])
    s = _session(model, None)
    try:
        tags, reads = _tags(s, model), snapshot.core_reads(s.scheduler.streamer.core)
        want = snapshot.read(str(path), tags).payload
        for p in (path, unpadded):
            assert np.array_equal(snapshot.read(str(p), tags, reads).payload, want)
        for at in (16 + n + 5, 16 + n + len(want) // 2, len(data) - 1):
            b = bytearray(data)
            b[at] ^= 0x08
            with pytest.raises(snapshot.SnapshotError, match="checksum"):
                snapshot.read(_damaged(tmp_path, bytes(b)), tags, reads)
    finally:
        s.close()


def test_a_late_pieces_flipped_byte_empties_the_slot(
    saved: tuple[str, Path, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flipped byte in the last piece, after the earlier pieces were copied into the slot, is refused and leaves
    the slot empty (what it held was overwritten): the next prompt is computed from scratch, with the logits of a
    fresh session."""
    model, _, data = saved
    monkeypatch.setattr(snapshot, "PIECE", 8192)
    b = bytearray(data)
    b[-3] ^= 0x20
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 200, 40)]
    s, fresh = _session(model, None), _session(model, None)
    try:
        s.forward(list(range(3, 60)), prompt=True)  # (held: the snapshot's first 57 tokens)
        assert len(data) > 4 * snapshot.PIECE
        with pytest.raises(snapshot.SnapshotError, match="checksum"):
            snapshot.restore(_damaged(tmp_path, bytes(b)), _tags(s, model), s.seqs[0], ELT)
        assert (s.history, s.pos, s.checkpoints.saved) == ([], 0, [])
        got_kept, got = _continue(s, prompt)
        want_kept, want = _continue(fresh, prompt)
        assert got_kept == want_kept == 0
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g, w)
    finally:
        s.close()
        fresh.close()


def test_a_restore_allocates_only_the_pieces_in_flight(
    saved: tuple[str, Path, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore's extra memory is its IN_FLIGHT piece buffers, not the snapshot's size (a 16k context's snapshot
    beside its KV cache went over the 25 % memory cap): with small pieces, the peak of what it allocates (numpy's
    buffers are traced) is the pieces and the checkpoints' new arrays (the slot's own), far below the payload; and
    the state restored is the snapshot's."""
    model = saved[0]
    monkeypatch.setattr(snapshot, "PIECE", snapshot.ALIGN)
    monkeypatch.setattr(snapshot, "IN_FLIGHT", 2)
    buffers: list[int] = []
    aligned = snapshot._aligned

    def counted(n: int) -> np.ndarray:
        buffers.append(n)
        return aligned(n)

    monkeypatch.setattr(snapshot, "_aligned", counted)
    options = SessionOptions(kv_type="f32", n_ctx=1024, max_batch=64, checkpoint_interval=32, usage_table=False)
    s = Session(model, options, log=lambda line: None)
    try:
        tokens = [int(t) for t in np.random.default_rng(5).integers(0, 200, 1000)]
        s.forward(tokens, prompt=True)
        path = tmp_path / f"long{snapshot.SUFFIX}"
        _save(s, model, path)
        tags, reads = _tags(s, model), snapshot.core_reads(s.scheduler.streamer.core)
        header = snapshot.read_header(open(path, "rb"))  # noqa: SIM115 (read once)
        payload = sum(int(x["bytes"]) for x in header["sections"])
        checkpoints = sum(int(x["bytes"]) for x in header["sections"] if x["kind"].startswith("cp"))  # (new arrays)
        pieces = snapshot.IN_FLIGHT * (snapshot.PIECE + snapshot.ALIGN)  # (each aligned within ALIGN more)
        bound = pieces + checkpoints + (96 << 10)  # (and the header, parsed: its tokens and sections)
        assert payload > 3 * bound  # (a whole-payload buffer would go far past it)
        s.reset()
        tracemalloc.start()
        try:
            assert snapshot.restore(str(path), tags, s.seqs[0], ELT, reads) == len(tokens)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert buffers == [snapshot.PIECE] * snapshot.IN_FLIGHT
        assert peak < bound, (peak, bound, payload)
        assert s.history == tokens and s.pos == len(tokens)
    finally:
        s.close()
