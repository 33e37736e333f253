"""AutotuneRunner with the real `tokenwing autotune --json`: result, per model + machine files, overrides merged into
serve flags that the real server accepts, progress, cancellation, failures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from runmyai.engine.autotune import MEMORY_RULE, AutotuneError, AutotuneRunner, nvidia_vram
from runmyai.engine.settings import DEFAULT_CONTEXT
from runmyai.engine.supervisor import EngineSupervisor
from runmyai.library.estimate import calibration_for
from runmyai.machine import MachineFingerprint, machine_fingerprint, probe_machine
from runmyai.paths import AppPaths
from tests.conftest import ModelFactory


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Path:
    return repacked_factory(type="Q8_0", n_layer=3)


def test_run_save_load_override_and_serve(model: Path, tmp_path: Path) -> None:
    paths = AppPaths(tmp_path / "home").ensure()
    runner = AutotuneRunner(paths, probe_bytes="4M", ctx=512)
    lines: list[str] = []
    result = asyncio.run(runner.run(model, lines.append))
    assert any("measuring the drive: 16 I/O threads (5/5)" in line for line in lines), lines  # progress shown

    # what it measured
    assert result.ram_total > 0 and 0 < result.ram_usable <= result.ram_total and result.ram_limit > 0
    assert result.cores >= 1 and result.machine == machine_fingerprint() and result.machine.cpu_model
    assert result.drive is not None and set(result.drive.mb_per_s_by_threads) == {1, 2, 4, 8, 16}
    assert result.drive.best_mb_per_s > 0 and result.drive.best_threads in result.drive.mb_per_s_by_threads
    assert result.settings["threads"] >= 1 and set(result.reasons) == set(result.settings)
    # memory follows the machine: the share and the rule are kept, not the bytes that were free at tuning time
    assert "ram_budget" not in result.settings and 0 < result.settings["expert_cache_share"] <= 1
    assert result.settings["memory_rule"] == MEMORY_RULE and "at every start" in result.reasons["memory_rule"]
    assert any(line.startswith("Drive:") for line in result.machine_lines())

    # a short decode measured after it: the estimate's calibration for this machine
    assert result.decode is not None and result.decode["tokens"] > 0 and result.decode["compute_s"] > 0
    assert result.decode["layers"] == 3 and result.decode["active_bytes"] > 0
    assert result.decode["steady"]  # the rate after the first steps, not the whole short run's
    assert any(line.startswith("measuring decode speed") for line in lines)
    probe = probe_machine(paths.models, autotune_dir=paths.settings).decode_probe
    assert probe is not None and probe.compute_s == pytest.approx(result.decode["compute_s"])
    machine = probe_machine(paths.models, autotune_dir=paths.settings)
    assert "calibrated on autotune here" in calibration_for(machine).source
    # and it joins the measurements the estimate stands on (issue 50: several runs, not the newest alone)
    [speed] = machine.speeds
    assert (speed.source, speed.model, speed.tokens_per_s) == ("autotune", str(model), result.decode["tokens_per_s"])
    assert speed.compute_s == pytest.approx(result.decode["compute_s"]) and speed.slowdown is not None

    # saved per model and machine, loaded back
    files = list(paths.settings.glob("autotune-*.json"))
    assert len(files) == 1 and result.machine.id in files[0].name and model.name.split(".")[0] in files[0].name
    again = runner.saved(model)
    assert again is not None and again.settings == result.settings and again.drive == result.drive
    assert again.decode == result.decode
    assert AutotuneRunner(paths, machine=MachineFingerprint("other", "cpu", 1)).saved(model) is None
    from runmyai.machine import saved_drive_speed  # the library's reader of the same files

    assert saved_drive_speed(paths.settings) == pytest.approx(result.drive.best_mb_per_s * 1e6)

    # chosen flags, then overrides on top (kept in their own file)
    flags = runner.serve_flags(model)
    assert "--ram-budget" not in flags and "--memory-rule" not in flags  # the engine sizes its cache itself
    assert "--expert-cache-share" not in flags  # informational, not a flag
    assert flags[flags.index("--ctx") + 1] == str(DEFAULT_CONTEXT)  # the chat context, chosen
    assert runner.serve_flags(model, model_context=512)[-2:] == ["--ctx", "512"]  # never beyond the model's
    runner.set_overrides(model, {"threads": "1", "--moe-stream-direct": "false", "lookahead": " "})
    assert runner.overrides(model) == {"threads": "1", "moe_stream_direct": False}
    runner.set_override(model, "moe-stream-chunk-kib", 256)
    flags = runner.serve_flags(model)
    assert flags[flags.index("--threads") + 1] == "1" and "--no-moe-stream-direct" in flags
    assert "--moe-stream-direct" not in flags and flags[flags.index("--lookahead") + 1] == "2"
    assert flags[flags.index("--moe-stream-chunk-kib") + 1] == "256"
    asyncio.run(runner.run(model))  # measuring again keeps the overrides
    assert runner.overrides(model)["threads"] == "1"
    for reserved in ("port", "--host", "watch-stdin"):
        with pytest.raises(ValueError):
            runner.set_override(model, reserved, "1")
    with pytest.raises(ValueError):
        runner.set_override(model, "rm -rf", "1")

    # the real server takes them
    async def serve() -> list[str]:
        runner.set_override(model, "ctx", "512")  # the user raises (here: lowers) the context
        sup = EngineSupervisor(model, runner.serve_flags(model), backoff_s=0.1)
        await sup.start()
        assert sup.pid is not None
        cmdline = psutil.Process(sup.pid).cmdline()
        await sup.stop()
        return cmdline

    cmdline = asyncio.run(serve())
    assert "--no-moe-stream-direct" in cmdline and cmdline[cmdline.index("--threads") + 1] == "1"
    assert cmdline[cmdline.index("--ctx") + 1] == "512"


def test_damaged_settings_files_are_ignored(model: Path, tmp_path: Path) -> None:
    runner = AutotuneRunner(tmp_path)
    runner.files.autotune_path(model).write_text("{ not json")
    runner.files.overrides_path(model).write_text('{"overrides": {"threads": [1], "port": 3, "lookahead": 1}}')
    assert runner.saved(model) is None
    assert runner.serve_flags(model) == ["--lookahead", "1", "--ctx", str(DEFAULT_CONTEXT)]  # bad ones dropped


def test_progress_lines_and_cancel_kills_the_process(model: Path) -> None:
    # The real autotune prints no progress on stderr yet; this wrapper prints some, then waits, so that there is
    # a live process group to cancel (sh and its sleep).
    wrapper = ["sh", "-c", 'echo "probing the drive" >&2; printf "50%%\\r60%%\\n" >&2; sleep 3600; exec "$0" "$@"']
    runner = AutotuneRunner(Path("/nonexistent-settings"), command=[*wrapper, sys.executable, "-m", "tokenwing"])
    progress: list[str] = []

    async def main() -> int:
        task = asyncio.create_task(runner.run(model, progress.append))
        deadline = time.monotonic() + 30
        while len(progress) < 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        pid = runner.pid
        assert pid is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task  # the hour-long sleep was killed, not waited for (or the guard below fails the test)
        return pid

    pid = asyncio.run(asyncio.wait_for(main(), 120))
    assert progress == ["probing the drive", "50%", "60%"]  # \r-updated progress becomes lines too
    assert runner.pid is None
    with contextlib.suppress(psutil.NoSuchProcess):
        assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_failures_are_one_sentence(model: Path, tmp_path: Path) -> None:
    corrupt = tmp_path / "c.tw.gguf"
    data = bytearray(model.read_bytes())
    data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)
    corrupt.write_bytes(bytes(data[:100]))
    garbage = tmp_path / "g.tw.gguf"
    garbage.write_bytes(b"hello" * 100)
    runner = AutotuneRunner(tmp_path / "settings", probe_bytes="4M")

    async def main() -> None:
        for path in (corrupt, garbage, tmp_path / "missing.tw.gguf"):
            with pytest.raises(AutotuneError) as e:
                await runner.run(path)
            assert "\n" not in str(e.value) and str(e.value).endswith(".")
        with pytest.raises(AutotuneError, match="not a GGUF file"):
            await runner.run(garbage)
        broken = AutotuneRunner(tmp_path, command=[str(tmp_path / "no-tokenwing")])
        with pytest.raises(AutotuneError, match="could not be started"):
            await broken.run(model)

    asyncio.run(main())
    assert not (tmp_path / "settings").exists() or not list((tmp_path / "settings").glob("autotune-*"))


def test_no_gpu_is_a_normal_answer() -> None:
    report = nvidia_vram()
    if report.gpus:
        assert all(g.vram_total > 0 for g in report.gpus)
    else:
        assert report.note.startswith("no NVIDIA GPU")


def test_saved_settings_start_under_less_memory_than_at_tuning(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    """Tuned with the whole machine free (every expert fits), started in a cgroup with far less: the engine sizes
    its cache from what is free then, starts and answers, with no OOM kill (a byte budget would not fit)."""
    base = "/sys/fs/cgroup/memory"
    if os.geteuid() != 0 or not os.access(base, os.W_OK):
        pytest.skip("needs root and the cgroup v1 memory controller")
    big = repacked_factory(type="F32", n_layer=2, n_embd=512, n_ff_exp=512, n_expert=64, n_expert_used=4)
    paths = AppPaths(tmp_path / "home").ensure()
    tuned = asyncio.run(AutotuneRunner(paths, probe_bytes="4M").run(big))
    assert tuned.settings["expert_cache_share"] == 1.0  # at tuning time, all 400 MB of experts fitted
    cap = 400 << 20  # the engine process, the resident weights and a part of the experts (not all: OOM)
    script = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from runmyai.engine.autotune import AutotuneRunner\n"
        "from runmyai.engine.client import ChatClient, ChatSettings\n"
        "from runmyai.engine.supervisor import EngineSupervisor\n"
        "from runmyai.paths import AppPaths\n"
        "async def main():\n"
        f"    model = Path({str(big)!r})\n"
        f"    flags = AutotuneRunner(AppPaths(Path({str(paths.home)!r}))).serve_flags(model, 512)\n"
        "    sup = EngineSupervisor(model, flags, load_timeout_s=120)\n"
        "    client = ChatClient(await sup.start())\n"
        "    text = ''\n"
        "    async for d in client.stream_chat([{'role': 'user', 'content': 'Hi'}], ChatSettings(max_tokens=8)):\n"
        "        text += d.text\n"
        "    await client.aclose()\n"
        "    fault = sup.last_fault\n"
        "    await sup.stop()\n"
        "    print('FLAGS', flags, 'FAULT', fault and fault.kind, 'TEXT', bool(text))\n"
        "asyncio.run(main())\n"
    )
    group = f"{base}/runmyai-autotune-{os.getpid()}"
    os.mkdir(group)
    try:
        Path(group, "memory.limit_in_bytes").write_text(str(cap))
        r = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        oom = Path(group, "memory.oom_control").read_text()
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(group)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FAULT None TEXT True" in r.stdout, r.stdout
    assert "--ram-budget" not in r.stdout
    assert "oom_kill 0" in oom or "oom_kill" not in oom, oom
