"""App tests run Qt offscreen (no display needed)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.app.hubserver import HubServer
from tests.conftest import ModelFactory

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

REPO, FILE = "runmyai/tiny-TW", "tiny-qwen3moe.tw.gguf"


@pytest.fixture
def tiny_hub(repacked_factory: ModelFactory) -> Iterator[tuple[HubServer, bytes]]:
    data = repacked_factory(type="Q8_0").read_bytes()
    with HubServer() as server:
        server.add_file(REPO, FILE, data, tags=["tokenwing"])
        server.faults.throttle_bps = max(1, len(data) // 2)  # a two-second download: the UI must stay live
        server.faults.drop_after = len(data) // 3  # and the connection drops once: the download resumes
        yield server, data
