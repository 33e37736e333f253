"""The installed engine's facts (`tokenwing info --json`), asked once per test process, and the shipped presets
sized by them, as the app holds its catalog once the engine has answered (`Catalog.bind_engine`)."""

from __future__ import annotations

import asyncio
import functools
import tempfile
from pathlib import Path

from runmyai.engine.info import EngineInfo, ask_engine
from runmyai.library.presets import Catalog, load_catalog
from runmyai.paths import bundled_dir


@functools.cache
def installed_engine() -> EngineInfo:
    with tempfile.TemporaryDirectory() as settings:
        info = asyncio.run(ask_engine(Path(settings)))
    assert info.known, info.error
    return info


def sized_catalog(directory: Path | None = None) -> Catalog:
    catalog = load_catalog(directory or bundled_dir("presets"))
    catalog.bind_engine(installed_engine())
    return catalog
