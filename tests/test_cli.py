"""The `tokenwing` command line end to end, as a real subprocess."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ModelFactory, assert_clean_error, run_cli


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


def test_interrupt_leaves_no_output(model_factory: ModelFactory, tmp_path: Path) -> None:
    src = model_factory(type="Q4_0", n_layer=4, n_embd=1024, n_ff_exp=512, n_expert=64)
    out = tmp_path / "x.tw.gguf"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenwing", "repack", str(src), "-o", str(out), "-q"], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".x.tw.gguf.partial") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "repack ended before it could be interrupted"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


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
