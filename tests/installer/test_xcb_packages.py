"""./dev installs what Qt's xcb platform plugin links (QT_XCB_PACKAGES): the list is checked against ldd on the
plugin PySide6 installed here, so a library a new Qt links cannot be missed on a plain desktop."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.installer.conftest import ROOT

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("dpkg") is None or shutil.which("ldd") is None,
    reason="the Qt xcb packages are Debian packages",
)

# Present on every Debian system with apt (apt itself links them): never installed by ./dev
BASE = {"libc6", "libgcc-s1", "libstdc++6"}


def dev_packages() -> set[str]:
    m = re.search(r'^QT_XCB_PACKAGES="([^"]*)"', (ROOT / "dev").read_text(), re.M)
    assert m, "./dev has no QT_XCB_PACKAGES"
    return set(m[1].split())


def plugin_packages() -> dict[str, str]:
    """{soname: Debian package} for each library Qt's xcb plugin and its libQt6XcbQpa link outside Qt itself."""
    from PySide6 import QtCore

    qt = Path(QtCore.__file__).parent / "Qt"
    libs = [qt / "plugins" / "platforms" / "libqxcb.so", qt / "lib" / "libQt6XcbQpa.so.6"]
    needed: set[str] = set()
    for lib in libs:
        dump = subprocess.run(["objdump", "-p", str(lib)], capture_output=True, text=True, check=True).stdout
        needed |= set(re.findall(r"NEEDED\s+(\S+)", dump))
    ldd = subprocess.run(
        ["ldd", *map(str, libs)], capture_output=True, text=True, check=True, env={"LD_LIBRARY_PATH": str(qt / "lib")}
    ).stdout
    where = dict(re.findall(r"^\s*(\S+) => (\S+)", ldd, re.M))
    found: dict[str, str] = {}
    for soname in sorted(needed):
        if soname.startswith("libQt6"):
            continue
        path = where.get(soname, "not")
        assert path != "not", f"ldd: {soname} (linked by Qt's xcb plugin) is not installed here: ./dev installs it"
        real = Path(path).resolve()
        owners = ""
        for candidate in (str(real), str(real).replace("/usr/lib/", "/lib/", 1), f"/usr{real}"):
            r = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True, check=False)
            if r.returncode == 0:
                owners = r.stdout
                break
        assert owners, f"no Debian package owns {real} ({soname})"
        found[soname] = owners.split(":", 1)[0]
    return found


def test_dev_installs_every_package_qt_xcb_plugin_links() -> None:
    found = plugin_packages()
    assert "libxcb-icccm.so.4" in found and "libxkbcommon-x11.so.0" in found  # the plugin was read
    missing = {soname: pkg for soname, pkg in found.items() if pkg not in dev_packages() | BASE}
    assert not missing, f"./dev's QT_XCB_PACKAGES lacks {missing}"
