"""The Linux installers, built by installer/build-linux.sh (reused when its inputs are unchanged), as a user gets them:
the tarball unpacked and the .deb extracted (dpkg -x) into scratch folders, then the frozen engine serving a chat
completion to the official `openai` client on the portable AVX2 level of ggml's CPU backend, and the frozen app's
--self-test.

Timings (engine start to handshake, app self-test) are printed and written to build/installer/smoke.json.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ModelFactory
from tests.installer.conftest import Installers
from tokenwing.version import __version__

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or platform.machine() != "x86_64" or shutil.which("dpkg-deb") is None,
        reason="the Linux installers are built on x86-64 Debian-like systems",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "build" / "installer" / "smoke.json"
KEY = "smoke-test-key"
timings: dict[str, float] = {}


def _vulkan(bundle: Path) -> bool:
    """Whether the bundle's engine loads ggml's Vulkan backend here: the bundle has it and this system the Vulkan
    loader (./dev installs it as root; the bundle never carries one)."""
    import ctypes.util

    built = list((bundle / "_internal" / "ggml" / "backends" / "vulkan").glob("libggml-vulkan.so"))
    return bool(built and ctypes.util.find_library("vulkan"))


def _user_env(**extra: str) -> dict[str, str]:
    """An environment without this checkout's Python: the frozen programs must not need it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "LD_", "QT_"))}
    env["PATH"] = (
        os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and not p.startswith(str(ROOT)))
        or "/usr/bin:/bin"
    )
    env.update(extra)
    return env


@pytest.fixture(scope="module", autouse=True)
def record_timings() -> Iterator[None]:
    """Writes what the tests of this module measured, once they all ran (a record, not a check: no test)."""
    yield
    SMOKE.parent.mkdir(parents=True, exist_ok=True)
    SMOKE.write_text(json.dumps(timings, indent=1) + "\n")
    print(f"\ninstaller smoke timings: {json.dumps(timings)}")


@pytest.fixture(scope="module")
def artifacts(installers: Installers) -> tuple[Path, Path]:
    timings["build_s"] = installers.build_s
    timings["tarball_mb"] = round(installers.tarball.stat().st_size / 2**20, 1)
    timings["deb_mb"] = round(installers.deb.stat().st_size / 2**20, 1)
    return installers.tarball, installers.deb


@pytest.fixture(scope="module")
def unpacked(artifacts: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tarball unpacked as a user would: runmyai-VERSION/ in a scratch folder."""
    dest = tmp_path_factory.mktemp("tarball")
    with tarfile.open(artifacts[0]) as tf:
        names = tf.getnames()
        assert all(n == f"runmyai-{__version__}" or n.startswith(f"runmyai-{__version__}/") for n in names)
        tf.extractall(dest, filter="tar")
    top = dest / f"runmyai-{__version__}"
    r = subprocess.run(["du", "-sm", str(top)], capture_output=True, text=True, check=True)
    timings["bundle_mb"] = float(r.stdout.split()[0])
    return top


@pytest.fixture(scope="module")
def deb_root(artifacts: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The .deb extracted into a scratch root (dpkg -x: what dpkg would install, without installing it)."""
    root = tmp_path_factory.mktemp("debroot")
    subprocess.run(["dpkg-deb", "-x", str(artifacts[1]), str(root)], check=True)
    return root


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Path:
    return repacked_factory(type="Q8_0", n_layer=3)


def test_tarball_layout(unpacked: Path) -> None:
    for exe in ("runmyai", "tokenwing", "install-desktop-entry.sh"):
        assert os.access(unpacked / exe, os.X_OK), exe
    desktop = (unpacked / "runmyai.desktop").read_text()
    assert "Exec=runmyai" in desktop and "Icon=runmyai" in desktop and "Type=Application" in desktop
    internal = unpacked / "_internal"
    for rel in (
        "PySide6/Qt/plugins/platforms/libqxcb.so",
        "PySide6/Qt/plugins/platforms/libqoffscreen.so",
        "resources/icons/runmyai.png",
        "presets",
        "ggml/lib/libggml.so.0",
        "ggml/lib/libggml-base.so.0",
        "ggml/build.json",
        "ggml/LICENSE",
        *(f"ggml/backends/cpu/libggml-cpu-{level}.so" for level in ("x64", "haswell", "skylakex", "zen4")),
    ):
        assert (internal / rel).exists(), rel
    if (ROOT / "resources" / "demo-model" / "tokenwing-demo-moe.gguf").exists():
        assert (internal / "resources" / "demo-model" / "tokenwing-demo-moe.gguf").is_file()
    for unwanted in ("llama_cpp", "torch", "pytest", "hypothesis", "openai"):
        assert not (internal / unwanted).exists(), unwanted
    ggml_libs = [p for p in unpacked.rglob("libggml*") if not p.is_relative_to(internal / "ggml")]
    assert ggml_libs == []  # one copy of each, in _internal/ggml/ only
    assert not list(internal.rglob("ggml*.h"))  # (headers stay behind)
    for kind in json.loads((internal / "ggml" / "build.json").read_text())["backends"]:
        assert list((internal / "ggml" / "backends" / kind).glob("libggml-*.so")), kind
    assert list(unpacked.rglob("libvulkan.so*")) == []  # the user's system provides the loader


def test_deb_layout(artifacts: tuple[Path, Path], deb_root: Path) -> None:
    fields = subprocess.run(
        ["dpkg-deb", "-f", str(artifacts[1]), "Package", "Version", "Architecture"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Package: runmyai" in fields and f"Version: {__version__}" in fields and "Architecture: amd64" in fields
    listing = subprocess.run(["dpkg-deb", "-c", str(artifacts[1])], capture_output=True, text=True, check=True).stdout
    assert all(" root/root " in line for line in listing.splitlines() if line.strip())  # --root-owner-group
    for name in ("runmyai", "tokenwing"):
        link = deb_root / "usr" / "bin" / name
        assert link.is_symlink() and os.readlink(link) == f"/opt/runmyai/{name}"
        assert os.access(deb_root / "opt" / "runmyai" / name, os.X_OK)
    assert "Exec=runmyai" in (deb_root / "usr/share/applications/runmyai.desktop").read_text()
    assert (deb_root / "usr/share/icons/hicolor/256x256/apps/runmyai.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class FrozenEngine:
    """`tokenwing serve` from a bundle, on a free port, stopped by closing its stdin (--watch-stdin)."""

    def __init__(self, exe: Path, model: Path, **env: str) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [str(exe), "serve", str(model), "--port", "0", "--watch-stdin"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_user_env(TOKENWING_API_KEY=KEY, **env),
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.handshake_s = time.monotonic() - self.started
        assert line, self.proc.stderr.read() if self.proc.stderr else ""
        self.handshake = json.loads(line)
        self.base = f"http://127.0.0.1:{self.handshake['port']}"

    def wait_ready(self, timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("the frozen engine did not get ready")

    def ggml_cpu_libs(self) -> set[str]:
        """Every ggml CPU backend module mapped in the engine (ggml's loader opens each level only to score it)."""
        maps = Path(f"/proc/{self.proc.pid}/maps").read_text().splitlines()
        return {line.split()[-1] for line in maps if "/libggml-cpu-" in line and line.rstrip().endswith(".so")}

    def stop(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture
def engine_from_tarball(unpacked: Path, model: Path) -> Iterator[FrozenEngine]:
    engine = FrozenEngine(unpacked / "tokenwing", model, TOKENWING_CPU_VARIANT="haswell")
    try:
        yield engine
    finally:
        if engine.proc.poll() is None:
            engine.proc.kill()
            engine.proc.wait()


def test_frozen_engine_serves_a_chat_completion_on_the_portable_level(
    engine_from_tarball: FrozenEngine, unpacked: Path
) -> None:
    from openai import OpenAI

    e = engine_from_tarball
    assert e.handshake["version"] == __version__
    timings["engine_handshake_s"] = round(e.handshake_s, 2)
    timings["engine_ready_s"] = round(e.wait_ready(), 2)
    # exactly one CPU backend mapped, the AVX2 level asked for (two would mean two CPU backends in one process)
    assert e.ggml_cpu_libs() == {str(unpacked / "_internal/ggml/backends/cpu/libggml-cpu-haswell.so")}
    client = OpenAI(base_url=f"{e.base}/v1", api_key=KEY, timeout=120)
    reply = client.chat.completions.create(
        model=str(e.handshake.get("model") or "model"),
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content, reply
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    assert e.stop() == 0


def test_deb_engine_picks_the_best_level_for_this_cpu(deb_root: Path, model: Path) -> None:
    from tokenwing.compute import ggml_api

    engine = FrozenEngine(deb_root / "opt/runmyai/tokenwing", model)
    try:
        engine.wait_ready()
        bundled = deb_root / "opt/runmyai/_internal/ggml"
        best, _ = ggml_api.choose_cpu_variant(ggml_api.cpu_variants(bundled), None)  # by ggml's own score
        assert engine.ggml_cpu_libs() == {str(bundled / f"backends/cpu/libggml-cpu-{best}.so")}
        assert engine.stop() == 0
    finally:
        if engine.proc.poll() is None:
            engine.proc.kill()


def _self_test(exe: Path, model: Path, home: Path, **env: str) -> float:
    started = time.monotonic()
    r = subprocess.run(
        [str(exe), "--offscreen", "--self-test", "--model", str(model), "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=400,
        env=_user_env(**env),
        check=False,
    )
    took = time.monotonic() - started
    assert r.returncode == 0, f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-4000:]}"
    assert "runmyai self-test: ok" in r.stdout and f"engine {__version__}" in r.stdout, r.stdout
    # the engine it ran was the bundle's (there is no other: no Python on PATH, and the app runs `tokenwing`
    # beside its own executable); its stderr is kept in the home's logs
    engine_logs = [p.read_text(errors="replace") for p in (home / "logs").glob("engine-*.log")]
    assert any("tokenwing: ready" in text for text in engine_logs), engine_logs
    return took


def test_frozen_app_self_test_from_the_tarball(unpacked: Path, model: Path, tmp_path: Path) -> None:
    took = _self_test(unpacked / "runmyai", model, tmp_path / "home", TOKENWING_CPU_VARIANT="haswell")
    timings["app_self_test_s"] = round(took, 1)


def test_frozen_app_self_test_from_the_deb_through_a_link(deb_root: Path, model: Path, tmp_path: Path) -> None:
    """Started through a symbolic link, as /usr/bin/runmyai is: the app still finds its engine beside the real file."""
    link = tmp_path / "bin" / "runmyai"
    link.parent.mkdir()
    link.symlink_to(deb_root / "opt/runmyai/runmyai")
    _self_test(link, model, tmp_path / "home")


def test_frozen_engine_on_lavapipe(unpacked: Path, model: Path) -> None:
    """The bundle's Vulkan backend sees Mesa's lavapipe, and its device probe (a child of the frozen executable
    itself) passes; without a loader's drivers it computes on the CPU."""
    # (asked once the bundle is built: on a fresh clone the build comes after collection)
    if not _vulkan(unpacked):
        pytest.skip("no Vulkan backend in this ggml build (./dev setup as root builds it)")
    env = _user_env(GGML_VK_VISIBLE_DEVICES="0", GGML_VK_DISABLE_F16="1")
    exe = str(unpacked / "tokenwing")
    r = subprocess.run([exe, "info", "--json"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "Vulkan0" in [d["name"] for d in json.loads(r.stdout)["devices"]]
    run = [exe, "run", str(model), "--prompt", "Hi", "-n", "2", "--device", "vulkan"]
    r = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and "computing on Vulkan0 (llvmpipe" in r.stderr, r.stderr
    env["VK_DRIVER_FILES"] = env["VK_ICD_FILENAMES"] = "/nonexistent"
    r = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and "computing on the CPU: --device vulkan" in r.stderr, r.stderr
