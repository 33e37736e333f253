"""Shared fixtures: generated models (cached per session) and a runner for the real CLI."""

from __future__ import annotations

import atexit
import gc
import glob
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings


def _use_core_from(path: str) -> None:
    """`./dev sanitize` points TW_CORE_PATH at a sanitizer build of the native core: test that one."""
    found = glob.glob(os.path.join(path, "_core*.so"))
    if not found:
        raise RuntimeError(f"no _core module in {path}")
    spec = importlib.util.spec_from_file_location("tokenwing._core", found[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tokenwing._core"] = module
    spec.loader.exec_module(module)


if os.environ.get("TW_CORE_PATH"):
    _use_core_from(os.environ["TW_CORE_PATH"])

from tokenwing.format.repack import repack  # noqa: E402
from tokenwing.testmodel import ModelShape, preset_shape, write_test_model  # noqa: E402

os.environ.setdefault("GGML_NO_BACKTRACE", "1")
# The servers' prompt cache on disk (serve's default folder is under the user's cache folder): the tests' own, empty
# at each run, never the user's (and each module's and test's own: the fixtures below); Mesa's shader cache
# (lavapipe) stays where it was, warm.
_user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
os.environ.setdefault("MESA_SHADER_CACHE_DIR", _user_cache)
os.environ["XDG_CACHE_HOME"] = _test_cache = tempfile.mkdtemp(prefix="tokenwing-tests-cache-")
atexit.register(shutil.rmtree, _test_cache, True)

# Property tests draw the same inputs on every run and machine, with no per-example deadline (a busy machine made
# examples "too slow"): a red run is a real failure that reproduces. HYPOTHESIS_PROFILE=explore draws new ones.
settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str, timeout: float = 300, cwd: str | None = None) -> CliResult:
    """Runs `python -m tokenwing ARGS` as a real subprocess."""
    proc = subprocess.run(
        [sys.executable, "-m", "tokenwing", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def _as_a_terminal_starts_it() -> None:
    """SIGINT at its default in the child, as in a terminal's foreground job, whatever this process inherited
    (a shell runs background jobs with SIGINT ignored, and an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Starts `python -m tokenwing ARGS` (stdout and stderr piped) for a test that signals it."""
    return subprocess.Popen(
        [sys.executable, "-m", "tokenwing", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_as_a_terminal_starts_it,  # no threads run in the tests that use it
    )


def assert_clean_error(r: CliResult, code: int | None = None) -> None:
    """A failure is one line on stderr, a non-zero exit and no traceback."""
    assert r.returncode != 0, r.stdout
    if code is not None:
        assert r.returncode == code, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("tokenwing: error: "), r.stderr
    assert "Traceback" not in r.stderr


ModelFactory = Callable[..., Path]


def _mount(mnt: Path, fstype: str, options: str | None = None) -> Path:
    """A real file system of `fstype` at `mnt` (created). Mounting needs root, as on our machines and CI; where it
    cannot be done the test is skipped with the reason, never run against a stand-in."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {fstype} needs root")
    mnt.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} here: {r.stderr.strip() or f'mount exited {r.returncode}'}")
    return mnt


def _unmount(mnt: Path) -> None:
    subprocess.run(["umount", "--lazy", str(mnt)], check=False)  # lazily: a file a failed test left open stays


@pytest.fixture(scope="module", autouse=True)
def a_prompt_cache_of_the_modules_own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test module's servers (its module-scoped ones, started before any test's own fixtures) keep their
    prompt cache on disk in a folder of the module's own. With one folder for the run, a server restored what
    another module's server had written for the same factory model (its template's prefix at least), and tests
    that compare a cold server's logprobs with the engine's one-pass logits, or count a prompt's cached tokens,
    saw a warm one (test_server_requests after test_server: logprobs 0.018 off, the restored rows having been
    computed in another batch shape)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(autouse=True)
def a_prompt_cache_of_the_tests_own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """... and each test's own servers in a folder of the test's own: a server a test starts is cold, as it was
    before the cache on disk, unless the test points two at one folder itself."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(autouse=True)
def qt_garbage_on_the_main_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used Qt, its garbage (windows and their timers, closed qasync loops) is freed here, on the
    thread that owns it: freed later by whichever thread collects next, a QObject with a running timer leaves that
    timer registered, and it crashes the process when it fires (tests/qtloop.py)."""
    yield
    if {"qapp", "qtbot"} & set(request.fixturenames):
        gc.collect()


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A real file system that refuses O_DIRECT (ramfs)."""
    mnt = _mount(tmp_path / "ramfs", "ramfs")
    yield mnt
    _unmount(mnt)


Mount = Callable[[int], Path]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """mount(size) -> a fresh tmpfs of `size` bytes (as root, as on our machines and CI): a disk that fills up
    for real, with ENOSPC from the kernel."""
    done: list[Path] = []

    def mount(size: int) -> Path:
        mnt = _mount(tmp_path / f"tmpfs{len(done)}", "tmpfs", f"size={size}")
        done.append(mnt)
        return mnt

    yield mount
    for mnt in done:
        _unmount(mnt)


def fill_disk(directory: Path, leave: int, name: str = "filler") -> Path:
    """Another file grows until `leave` bytes are free on `directory`'s file system; returns it."""
    path = directory / name
    with open(path, "ab") as f:
        while (free := shutil.disk_usage(directory).free) > leave:
            f.write(bytes(min(free - leave, 1 << 20)))
            f.flush()
    return path


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    """make(arch=..., type=..., preset=..., shards=..., expert_type=..., **shape) -> path of a generated GGUF
    (cached); the architecture defaults to the preset's (qwen3moe for the size presets)."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[tuple[object, ...], Path] = {}

    def make(
        arch: str | None = None,
        type: str = "F32",
        preset: str = "tiny",
        shards: int = 1,
        seed: int = 0,
        expert_type: str | None = None,
        **shape: object,
    ) -> Path:
        key = (arch, type, preset, shards, seed, expert_type, tuple(sorted(shape.items())))
        if key not in cache:
            s: ModelShape = preset_shape(preset, arch).with_(**shape)
            name = f"m{len(cache)}-{s.arch}-{type}.gguf"
            paths = write_test_model(str(root / name), s, type, seed, shards, expert_type=expert_type)
            cache[key] = Path(paths[0])
        return cache[key]

    return make


@pytest.fixture(scope="session")
def repacked_factory(model_factory: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    root = tmp_path_factory.mktemp("repacked")
    cache: dict[Path, Path] = {}

    def make(**kw: object) -> Path:
        src = model_factory(**kw)
        if src not in cache:
            out = root / (src.name.removesuffix(".gguf") + ".tw.gguf")
            repack([str(src)], str(out), show_progress=False)
            cache[src] = out
        return cache[src]

    return make
