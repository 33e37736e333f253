"""The image encoder on the VRAM tier's device (issue 45 item 6; lavapipe here, F16 path off): its weights and graph
on the device when the room the tier left holds them with the largest image's compute buffer, exact within
llama.cpp's own distance (flash attention on against off) against the CPU path and libmtmd; without room, the CPU
with one line. Lavapipe is slow (tens of seconds a graph): one small image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.compute.conftest import DEVICES, device
from tests.oracle.test_qwen3vl_images import factory_files, image, mtmd_run, write_png
from tokenwing.compute.backend import Backend
from tokenwing.compute.devices import DeviceOptions
from tokenwing.compute.probe import choose_device
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.runtime.vram import VramOptions
from tokenwing.vision.device import encoder_bytes, place
from tokenwing.vision.logits import encoder_memory, image_prompt
from tokenwing.vision.qwen3vl import Qwen3VLEncoder

pytestmark = [pytest.mark.oracle, pytest.mark.own_process]


@pytest.fixture(scope="module")
def gpu() -> Backend:
    if not DEVICES:
        pytest.skip("no device (ggml built for the CPU only)")
    return Backend(device(DEVICES[0]))


def test_the_qwen3vl_encoder_on_the_device_matches_the_cpu_and_llama_cpp(gpu: Backend, tmp_path: Path) -> None:
    model, mmproj, _ = factory_files(tmp_path, "qwen3vlmoe")
    rgb = image(48, 64, seed=3)  # 4×3 merged patches: 12 rows
    mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "ref")
    ref = np.load(tmp_path / "ref" / "embd.npy")
    mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "flash", "flash")
    bar = np.abs(np.load(tmp_path / "flash" / "embd.npy") - ref).max()  # llama.cpp's own distance

    enc = Qwen3VLEncoder(str(mmproj))
    try:
        pre = enc.preprocess(rgb)
        cpu = enc.encode(pre)
        need = encoder_bytes(enc)
        held = gpu.held_bytes
        line = place(enc, gpu, 8 << 30)  # (room as a number: the factory's largest image needs 2 GiB of it)
        assert line.startswith(f"vision encoder on {gpu.device.name} "), line
        assert enc.device is not None and gpu.held_bytes - held >= need.weights  # its weights in a device buffer
        got = enc.encode(pre)
    finally:
        enc.close()
    # resident while the device is: the next encoder of the file (the next image_prompt) uses the same copy
    on_device = gpu.held_bytes
    again = Qwen3VLEncoder(str(mmproj))
    try:
        assert place(again, gpu, 0).startswith(f"vision encoder on {gpu.device.name} ")
        assert gpu.held_bytes == on_device
    finally:
        again.close()
    assert got.shape == cpu.shape == ref.shape
    assert 0 < np.abs(got - cpu).max() <= bar, (np.abs(got - cpu).max(), bar)  # (0: it did not run on the device)
    assert np.abs(got - ref).max() <= bar, (np.abs(got - ref).max(), bar)


def test_an_encoder_without_room_stays_on_the_cpu(gpu: Backend, tmp_path: Path) -> None:
    _, mmproj, _ = factory_files(tmp_path, "qwen3vlmoe")
    rgb = image(48, 64, seed=3)
    enc = Qwen3VLEncoder(str(mmproj))
    try:
        need = encoder_bytes(enc).total
        pre = enc.preprocess(rgb)
        cpu = enc.encode(pre)
        line = place(enc, gpu, need - 1)
        assert line.startswith("vision encoder on CPU: its 2.02 GiB") and "do not fit" in line, line
        assert enc.device is None and enc.where == line
        assert np.array_equal(enc.encode(pre), cpu)
    finally:
        enc.close()


def test_a_session_on_the_device_puts_its_encoder_there(tmp_path: Path) -> None:
    """Pixtral's (mistral4) encoder, 131 MiB for its largest image, beside the factory model on a 1 GiB budget: the
    session plans for it (RAM and VRAM: the tier keeps its bytes free), places it on the device, and the image's
    logits are the CPU session's within the bar."""
    if not DEVICES:
        pytest.skip("no device (ggml built for the CPU only)")
    _, mmproj, model = factory_files(tmp_path, "mistral4")
    png = tmp_path / "i.png"
    write_png(png, image(48, 64, seed=5))
    memory = encoder_memory(str(mmproj))
    held = ((memory.describe(), memory.total),)
    logits, lines = [], []
    for choice in (choose_device(DeviceOptions(device(DEVICES[0]).kind, "1G")), None):
        vram = VramOptions(keep=memory.vram_keep if choice else 0)  # (what run and serve pass)
        options = SessionOptions(kv_type="f32", n_ctx=512, device=choice, also_held=held, vram=vram)
        log: list[str] = []
        s = Session(str(model), options, log=log.append)
        try:  # (image_prompt opens the encoder as run and serve do: vision/logits.open_encoder)
            assert s.describe().endswith(f"; the memory plan counts {memory.describe()}")
            if choice is not None:
                assert s.vram is not None and s.vram.plan.kept == memory.vram_keep
                assert s.device_line is not None and "kept for the image encoder" in s.device_line
            ids, s.media = image_prompt(s, str(mmproj), str(png), "look <__media__> here")
            logits.append(np.asarray(s.forward(ids), np.float32).reshape(-1))
        finally:
            s.close()
        lines.append(log)
    assert any(line.startswith(f"vision encoder on {DEVICES[0]} ") for line in lines[0]), lines[0]
    assert not any(line.startswith("vision encoder") for line in lines[1])  # (no tier: the CPU, nothing to say)
    diff = np.abs(logits[0] - logits[1]).max()
    print("device session against the CPU's: max |diff| of the last logits", diff)
    assert diff <= 2e-3, diff


def test_an_encoder_whose_device_closed_goes_to_the_cpu(tmp_path: Path) -> None:
    """A session that gives its failed GPU up closes the tier's backend, which frees the encoder's copy
    (Backend.on_close): the server's encoder then computes on the CPU, with one line, instead of reading freed
    buffers."""
    if not DEVICES:
        pytest.skip("no device (ggml built for the CPU only)")
    _, mmproj, _ = factory_files(tmp_path, "qwen3vlmoe")
    backend = Backend(device(DEVICES[0]))
    enc = Qwen3VLEncoder(str(mmproj))
    lines: list[str] = []
    enc.log = lines.append
    try:
        pre = enc.preprocess(image(48, 64, seed=3))
        cpu = enc.encode(pre)
        assert place(enc, backend, 8 << 30).startswith(f"vision encoder on {DEVICES[0]} ")
        backend.close()
        assert np.array_equal(enc.encode(pre), cpu)
        assert lines == ["vision encoder on CPU: the GPU was given up"] and enc.device is None
    finally:
        enc.close()
        backend.close()
