"""The .deb installed into a fresh minimal Debian, as a user's double-click would install it, and the app started
there on Qt's xcb platform (not offscreen): the proof that the package's Depends name what Qt's X11 plugin loads.

A minimal root (debootstrap --variant=minbase, this machine's Debian suite, from the Debian archive its apt sources
name) is unpacked into a scratch folder; in a chroot, `apt-get install --no-install-recommends ./runmyai_*.deb`
resolves the Depends from the archive; the bundle's own copies of what Qt's xcb plugin links are removed (PyInstaller
takes them where the build machine has them) and ldd must find each in the system; then Xvfb (installed after the
.deb, so its own dependencies cannot stand in for ours) runs `runmyai --self-test` with QT_QPA_PLATFORM=xcb.

Cached in build/debootstrap/: the minimal root as a tarball (with its apt lists) and the packages apt downloads
into it, so a rerun fetches nothing. Needs root (chroot, mounts) and debootstrap (./dev test installs it).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.installer.conftest import ROOT, Installers
from tokenwing.version import __version__

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or platform.machine() != "x86_64" or shutil.which("dpkg-deb") is None,
        reason="the .deb is built and installed on x86-64 Debian-like systems",
    ),
    pytest.mark.skipif(
        sys.platform.startswith("linux") and os.geteuid() != 0,
        reason="installing the .deb into a fresh Debian needs root (debootstrap, chroot, mounts)",
    ),
    pytest.mark.skipif(
        shutil.which("debootstrap") is None, reason="no debootstrap here (./dev test installs it as root)"
    ),
]

CACHE = ROOT / "build" / "debootstrap"
RECORD = ROOT / "build" / "installer" / "deb_install.json"
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
timings: dict[str, float] = {}


def _suite_and_archive() -> tuple[str, str]:
    """This machine's Debian suite and the archive its apt sources name for it (main), as ./dev's debian_archive."""
    codename = ""
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            codename = line.split("=", 1)[1].strip('"')
    uri = ""
    if codename:
        r = subprocess.run(
            ["apt-get", "indextargets", "--format", "$(REPO_URI)", f"Release: {codename}", "Component: main"],
            capture_output=True,
            text=True,
            check=False,
        )
        uri = next(iter(r.stdout.split()), "")
    if not uri:
        pytest.skip("no Debian suite and archive among this machine's apt sources (debootstrap needs one)")
    return codename, uri.rstrip("/")


def _run(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Runs a command in a process group of its own: on a timeout the whole group goes (Xvfb, the app, its
    engine), not only the first process."""
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(args)} ran past {timeout:.0f} s:\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _chroot(
    root: Path, *cmd: str, timeout: float = 900, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return _run(
        ["chroot", str(root), "env", "-i", *(f"{k}={v}" for k, v in {**ENV, **(env or {})}.items()), *cmd], timeout
    )


def _check(r: subprocess.CompletedProcess[str], what: str) -> str:
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _minimal_root_tarball() -> Path:
    """build/debootstrap/SUITE-minbase.tar: a fresh minimal Debian with its apt lists, made once."""
    suite, archive = _suite_and_archive()
    tar = CACHE / f"{suite}-minbase.tar"
    if tar.is_file():
        return tar
    started = time.monotonic()
    work = CACHE / f"{suite}-minbase.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _check(_run(["debootstrap", "--variant=minbase", suite, str(work), archive], 1800), "debootstrap")
    shutil.copy("/etc/resolv.conf", work / "etc" / "resolv.conf")
    _check(_chroot(work, "apt-get", "update", "-q"), "apt-get update in the fresh Debian")
    _check(_run(["tar", "-C", str(work), "--numeric-owner", "-cf", f"{tar}.partial", "."]), "tar")
    os.replace(f"{tar}.partial", tar)
    shutil.rmtree(work)
    timings["debootstrap_s"] = round(time.monotonic() - started, 1)
    return tar


def _mounted_under(root: Path) -> list[str]:
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if p == str(root) or p.startswith(f"{root}/")]


@pytest.fixture(scope="module", autouse=True)
def record_timings() -> Iterator[None]:
    yield
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(timings, indent=1) + "\n")
    print(f"\n.deb install timings: {json.dumps(timings)}")


@pytest.fixture
def fresh_debian(tmp_path: Path) -> Iterator[Path]:
    """A fresh minimal Debian unpacked into a scratch folder, with /proc and the cached apt archives mounted."""
    tar = _minimal_root_tarball()
    started = time.monotonic()
    root = tmp_path / "root"
    root.mkdir()
    _check(_run(["tar", "-C", str(root), "--numeric-owner", "-xf", str(tar)]), "unpacking the minimal Debian")
    shutil.copy("/etc/resolv.conf", root / "etc" / "resolv.conf")
    archives = CACHE / "archives"
    (archives / "partial").mkdir(parents=True, exist_ok=True)
    mounts = [
        ["mount", "-t", "proc", "proc", str(root / "proc")],
        ["mount", "--bind", str(archives), str(root / "var/cache/apt/archives")],
    ]
    done: list[Path] = []
    try:
        for m in mounts:
            _check(_run(m), " ".join(m[:-1]))
            done.append(Path(m[-1]))
        timings["unpack_s"] = round(time.monotonic() - started, 1)
        yield root
    finally:
        for point in reversed(done):
            _run(["umount", "-l", str(point)])
        left = _mounted_under(root)
        # never delete through a mount (the cached archives): the scratch root stays if anything is still mounted
        assert not left, f"still mounted under the scratch root: {left}"
        shutil.rmtree(root)


def _apt_install(root: Path, *packages: str) -> None:
    args = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    r = _chroot(root, *args)
    if r.returncode != 0 and ("Failed to fetch" in r.stderr or "Unable to locate" in r.stderr or "404" in r.stderr):
        _check(_chroot(root, "apt-get", "update", "-q"), "apt-get update")  # the cached lists are stale
        r = _chroot(root, *args)
    _check(r, f"apt-get install {' '.join(packages)} in a fresh Debian")


def test_deb_installs_and_self_tests_on_xcb_in_a_fresh_debian(installers: Installers, fresh_debian: Path) -> None:
    root = fresh_debian
    # nothing of X11 or Qt's xcb libraries in the minimal root: the .deb's Depends must bring them
    assert not list((root / "usr/lib/x86_64-linux-gnu").glob("libxcb-icccm.so*"))
    shutil.copy(installers.deb, root / "tmp" / installers.deb.name)
    started = time.monotonic()
    _apt_install(root, f"/tmp/{installers.deb.name}")
    timings["install_deb_s"] = round(time.monotonic() - started, 1)
    status = _check(_chroot(root, "dpkg-query", "-W", "-f", "${Status} ${Version}", "runmyai"), "dpkg-query")
    assert status == f"install ok installed {__version__}"

    # What Qt's xcb plugin and its libQt6XcbQpa link must come from the system, through the Depends: PyInstaller
    # copies such libraries into the bundle where the build machine has them, so their copies are removed here
    # (with them the app would start whatever the Depends say)
    internal = root / "opt" / "runmyai" / "_internal"
    qt = internal / "PySide6" / "Qt"
    needed: set[str] = set()
    for lib in (qt / "plugins" / "platforms" / "libqxcb.so", qt / "lib" / "libQt6XcbQpa.so.6"):
        dump = _check(_run(["objdump", "-p", str(lib)]), "objdump")
        needed |= {n for n in re.findall(r"NEEDED\s+(\S+)", dump) if not n.startswith("libQt6")}
    assert "libxcb-icccm.so.4" in needed and "libxkbcommon-x11.so.0" in needed, needed
    for soname in needed:
        (internal / soname).unlink(missing_ok=True)
    # every library of Qt's xcb plugin is found as the app loads it (the bundle's folder first, then the system)
    ldd = _check(
        _chroot(
            root,
            "ldd",
            "/opt/runmyai/_internal/PySide6/Qt/plugins/platforms/libqxcb.so",
            env={"LD_LIBRARY_PATH": "/opt/runmyai/_internal"},
        ),
        "ldd on Qt's xcb plugin",
    )
    assert "not found" not in ldd, ldd
    found = dict(re.findall(r"^\s*(\S+) => (\S+)", ldd, re.M))
    assert all(not found[n].startswith("/opt/") for n in needed), ldd

    started = time.monotonic()
    _apt_install(root, "xvfb", "xauth")
    timings["install_xvfb_s"] = round(time.monotonic() - started, 1)
    started = time.monotonic()
    r = _chroot(
        root,
        "xvfb-run",
        "-a",
        "-s",
        "-screen 0 1280x800x24",
        "runmyai",  # /usr/bin/runmyai, the .deb's link
        "--self-test",
        "--home",
        "/root/runmyai-home",
        env={"QT_QPA_PLATFORM": "xcb"},
        timeout=600,
    )
    timings["self_test_s"] = round(time.monotonic() - started, 1)
    out = _check(r, "runmyai --self-test on xcb under Xvfb")
    assert "runmyai self-test: ok" in out and f"engine {__version__}" in out, out
    assert "on the xcb platform" in out, out
