"""Files of llama.cpp's source distribution, the one the project pins for ggml (engine/ggml/source.txt): fetched
by package name and hash-checked by engine/ggml/build.sh, read here straight from the tarball, never copied
into the project."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = "vendor/llama.cpp/models/templates/"


@functools.cache
def sdist() -> Path:
    """The pinned source distribution's tarball: build/ggml/sdist/VERSION/…, fetched through pip if not there yet
    (`./dev` fetched it to build ggml, so normally it is)."""
    env = dict(os.environ)
    # build.sh runs `python -m pip`: the interpreter running the tests, with its pip
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(
        [str(ROOT / "engine/ggml/build.sh"), "--source"], capture_output=True, text=True, env=env, timeout=600
    )
    if r.returncode != 0:
        raise RuntimeError(f"could not fetch llama.cpp's pinned source distribution:\n{r.stderr}")
    return Path(r.stdout.strip().splitlines()[-1])


@functools.cache
def chat_templates() -> dict[str, str]:
    """The publishers' chat templates llama.cpp ships (models/templates/NAME.jinja), by file name."""
    out: dict[str, str] = {}
    with tarfile.open(sdist(), "r|gz") as tar:  # one pass over the stream: about a second
        for member in tar:
            name = member.name.partition("/")[2]  # under llama_cpp_python-VERSION/
            if name.startswith(TEMPLATES) and name.endswith(".jinja") and member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                out[name.removeprefix(TEMPLATES)] = f.read().decode("utf-8")
    if not out:
        raise RuntimeError(f"{sdist()} holds no {TEMPLATES}*.jinja")
    return out
