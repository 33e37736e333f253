"""The engine with a GPU that does not work out: no driver, a driver that fails at init or aborts in the probe,
a VRAM budget too small for even one layer, a device allocation that fails mid-run. Each gives the CPU path with
one line saying so, the run completes, nothing crashes; a prompt whose GPU tensors cannot be allocated whole is
split into calls that can be."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.compute.conftest import DEVICES, device
from tests.compute.test_device_faults import _point_loader_at, needs_vulkan
from tests.conftest import ModelFactory, run_cli
from tests.oracle.test_logits import kl_per_position
from tokenwing.compute.probe import FAULT_ENV
from tokenwing.runtime.vram import FAIL_ENV

PROMPT = ["--prompt", "The quick brown fox jumps over the lazy dog", "-n", "8", "--ctx", "512"]


def _generate(model: str, *extra: str) -> tuple[str, list[str]]:
    r = run_cli("run", model, *PROMPT, *extra)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout, [ln for ln in r.stderr.splitlines() if ln.strip()]


@needs_vulkan
@pytest.mark.parametrize("fault", ["no driver", "fails at init", "aborts in the probe", "too little VRAM"])
def test_a_gpu_that_does_not_work_gives_the_cpu(
    fault: str, repacked_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = str(repacked_factory(type="Q8_0", n_layer=2))
    on_cpu, _ = _generate(model, "--device", "cpu")
    budget = ["--vram-budget", "1M"] if fault == "too little VRAM" else []
    if fault == "no driver":
        (tmp_path / "empty").mkdir()
        _point_loader_at(monkeypatch, tmp_path / "empty")
    elif fault == "fails at init":
        monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "9")  # ggml's Vulkan start throws for a device not there
    elif fault == "aborts in the probe":
        monkeypatch.setenv(FAULT_ENV, "abort")  # test hook: the probe's child aborts as a driver would
    out, lines = _generate(model, "--device", "vulkan", *budget)
    where = [ln for ln in lines if "computing on" in ln]
    assert len(where) == 1 and "computing on the CPU" in where[0], lines
    assert out == on_cpu  # the same text as the CPU alone (greedy)


@pytest.mark.skipif(not DEVICES, reason="no device")
def test_a_device_allocation_failing_mid_run(repacked_factory: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mock (a driver cannot be made to run out of memory at a chosen moment): the tier's 2nd device graph after
    start (the first decode steps build theirs) fails to allocate. The session says so in one line, computes
    the tokens it had seen again on the CPU and goes on there; the text is the CPU's."""
    model = str(repacked_factory(type="Q8_0", n_layer=2))
    on_cpu, _ = _generate(model, "--device", "cpu")
    monkeypatch.setenv(FAIL_ENV, "2")
    out, lines = _generate(model, "--device", device(DEVICES[0]).kind)
    failed = [ln for ln in lines if "GPU failed" in ln]
    assert len(failed) == 1 and "computing on the CPU from here on" in failed[0], lines
    assert out == on_cpu


@pytest.mark.skipif(
    not DEVICES or device(DEVICES[0]).kind != "vulkan", reason="GGML_VK_FORCE_MAX_BUFFER_SIZE is ggml-vulkan's"
)
def test_a_prompt_whose_gpu_tensors_do_not_fit_is_split(
    repacked_factory: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real allocation failure: ggml-vulkan refuses buffers over GGML_VK_FORCE_MAX_BUFFER_SIZE (the device's own
    limit, lowered). Set between what a 64-token prompt chunk's compute buffer needs and what the weights' buffers
    need, the tier runs prompts in smaller chunks, with one line; the logits are those of the whole chunks."""
    model = str(repacked_factory(type="Q8_0", n_layer=2))
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(3).integers(0, 500, 100).astype(np.int64))

    def logits(name: str, *extra: str) -> tuple[np.ndarray, list[str]]:
        out = tmp_path / f"{name}.npy"
        r = run_cli("logits", model, "--tokens", str(tokens), "--out", str(out), "--ctx", "2048", *extra)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        return np.load(out), [ln for ln in r.stderr.splitlines() if ln.strip()]

    whole, lines = logits("whole", "--device", "vulkan")
    assert not [ln for ln in lines if "at a time" in ln], lines
    # a 64-token chunk over a 2048-token context needs ~4 MiB of compute buffer here; weights and cache < 1 MiB
    monkeypatch.setenv("GGML_VK_FORCE_MAX_BUFFER_SIZE", str(2 << 20))
    split, lines = logits("split", "--device", "vulkan")
    notes = [ln for ln in lines if "at a time on the GPU" in ln]
    assert len(notes) == 1 and "do not fit in VRAM" in notes[0], lines
    assert kl_per_position(whole, split).mean() <= 1e-6
