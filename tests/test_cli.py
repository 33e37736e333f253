"""The `tokenwing` command line end to end, as a real subprocess."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli, start_cli
from tests.pauses import REPACK_STEPS, Pauses


def test_demo_flow(tmp_path: Path) -> None:
    src, out = tmp_path / "demo.gguf", tmp_path / "demo.tw.gguf"
    r = run_cli("testmodel", str(src), "--arch", "qwen2moe", "--n-shared-exp", "1", "--type", "Q4_0", "-q")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(src)
    r = run_cli("repack", str(src), "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "peak memory" in r.stdout
    r = run_cli("inspect", str(out), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["kind"] == "tokenwing" and info["format_version"] == "1.1"
    assert info["architecture"] == "qwen2moe"
    ex = info["experts"]
    assert ex["count"] == 8 and ex["used_per_token"] == 2 and ex["streamed_layers"] == [0, 1]
    assert ex["expert_quant_types"] == {"Q4_0": 6}
    per_layer = [layer["record_bytes"] for layer in ex["layers"]]
    assert ex["miss_bytes_per_token"] == 2 * sum(per_layer)
    assert info["resident"]["quant_types"]["F32"] > 0  # norms, routers, the shared-expert gate
    r = run_cli("inspect", str(out))
    assert "all-miss token reads" in r.stdout
    r = run_cli("inspect", str(src), "--json")  # a plain GGUF: what a repack would produce
    assert json.loads(r.stdout)["experts"] == ex
    r = run_cli("verify", str(out))
    assert r.returncode == 0 and r.stdout.startswith("ok: what every start checks"), r.stderr
    r = run_cli("verify", "--full", str(out), "-q")
    assert r.returncode == 0 and r.stdout.startswith("ok: all experts and tensors"), r.stderr


def test_default_output_name(model_factory: ModelFactory, tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(model_factory().read_bytes())
    assert run_cli("repack", str(src), "-q").returncode == 0
    assert (tmp_path / "m.tw.gguf").exists()


def test_bad_arguments_are_one_line(tmp_path: Path) -> None:
    r = run_cli("testmodel", str(tmp_path / "x.gguf"), "--arch", "llama")
    assert_clean_error(r, 2)
    r = run_cli("testmodel", str(tmp_path / "x.gguf"), "--type", "Q9_9")
    assert_clean_error(r, 2)
    r = run_cli("testmodel", str(tmp_path / "x.gguf"), "--n-dense-lead", "1")
    assert_clean_error(r, 2)
    assert "ernie4_5-moe" in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("step", REPACK_STEPS)
def test_interrupt_at_every_step_leaves_no_output(
    model_factory: ModelFactory, tmp_path: Path, step: str, sig: signal.Signals
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    pauses = Pauses(tmp_path / "pauses", step)
    proc = start_cli("repack", str(model_factory(type="Q4_0")), "-o", str(out / "x.tw.gguf"), "-q", env=pauses.env())
    assert pauses.wait(step, alive=lambda: proc.poll() is None) == proc.pid
    written = [p.name for p in out.iterdir()]
    assert written == (["x.tw.gguf"] if step == "output.renamed" else [f".x.tw.gguf.partial-{proc.pid}"])
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr
    by = "" if sig == signal.SIGINT else " by SIGTERM"
    assert stderr.splitlines() == [f"tokenwing: interrupted{by}; nothing partial was kept"] and stdout == ""
    assert list(out.iterdir()) == []


def test_an_interrupt_after_the_outcome_changes_nothing(model_factory: ModelFactory, tmp_path: Path) -> None:
    """Ctrl-C once the output is in place (the summary line still to print, the interpreter still to exit) is too
    late: the exit code and the output stand (before, such a signal could end the process by SIGINT)."""
    pauses = Pauses(tmp_path / "pauses", "cli.decided")
    out = tmp_path / "x.tw.gguf"
    proc = start_cli("repack", str(model_factory(type="Q4_0")), "-o", str(out), "-q", env=pauses.env())
    pauses.wait("cli.decided", alive=lambda: proc.poll() is None)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    pauses.release("cli.decided")
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and stdout.startswith(f"wrote {out}") and stderr == ""
    assert run_cli("verify", "--full", str(out), "-q").returncode == 0


def test_repack_steps_come_in_order_and_a_pause_changes_nothing(model_factory: ModelFactory, tmp_path: Path) -> None:
    """The control for the test above: every step is reached, in this order, and released the repack succeeds."""
    pauses = Pauses(tmp_path / "pauses", *REPACK_STEPS)
    out = tmp_path / "x.tw.gguf"
    proc = start_cli("repack", str(model_factory(type="Q4_0")), "-o", str(out), "-q", env=pauses.env())
    for step in REPACK_STEPS:
        pauses.wait(step, alive=lambda: proc.poll() is None)
        assert [s for s in REPACK_STEPS if pauses.reached(s)] == REPACK_STEPS[: REPACK_STEPS.index(step) + 1]
        pauses.release(step)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and stdout.startswith(f"wrote {out}"), stderr
    assert run_cli("verify", "--full", str(out), "-q").returncode == 0


def test_direct_read_fallback_is_one_line(repacked_factory: ModelFactory, ramfs: Path) -> None:
    p = ramfs / "m.tw.gguf"
    p.write_bytes(repacked_factory().read_bytes())
    r = run_cli("verify", "--full", str(p), "-q")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"tokenwing: the file system refuses O_DIRECT (Invalid argument): reading {p} through the file cache"
    ]


def test_version() -> None:
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("tokenwing ")
