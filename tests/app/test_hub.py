"""HubClient: real huggingface_hub code (HfApi, get_hf_file_metadata, hf_hub_url) against the local hub server."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from runmyai.library.hub import HubClient, HubError, parse_content_range
from tests.app.hubserver import COMMIT, Faults, HubServer

T = TypeVar("T")
TW = os.urandom(300_000)
GGUF = os.urandom(200_000)


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_file("acme/qwen-tw", "qwen-q4.tw.gguf", TW, tags=["tokenwing", "gguf"], downloads=50, likes=3)
        server.add_file("acme/qwen-tw", "README.md", b"# qwen\n")
        server.add_file("acme/qwen-tw", "parts/qwen-2.tw.gguf", b"tiny")
        server.add_file("acme/llama-tw", "llama.tw.gguf", b"x" * 2000, tags=["tokenwing"], downloads=80)
        server.add_file("bob/qwen-gguf", "qwen.Q4_K_M.gguf", GGUF, tags=["gguf"], downloads=900, likes=12)
        server.add_file("bob/qwen-gguf", "config.json", b"{}")
        server.add_file("meta/gated-tw", "gated.tw.gguf", b"g" * 5000, tags=["tokenwing"], gated=True)
        server.accepted_tokens.add("hf_good")
        yield server


def run(coro: Coroutine[Any, Any, T]) -> T:
    async def main() -> T:
        return await asyncio.wait_for(coro, 60)  # a hang guard: a request that never ends fails the test

    return asyncio.run(main())


def expect_error(coro: Coroutine[Any, Any, object]) -> HubError:
    with pytest.raises(HubError) as info:
        run(coro)
    message = str(info.value)
    assert message and "\n" not in message and "Traceback" not in message
    return info.value


def test_search_repacked_and_gguf(hub: HubServer) -> None:
    client = HubClient(endpoint=hub.url)
    repacked = run(client.search("qwen"))
    assert [m.repo for m in repacked] == ["acme/qwen-tw"]  # tagged tokenwing and matching the query
    model = repacked[0]
    assert (model.downloads, model.likes) == (50, 3)
    assert "tokenwing" in model.tags
    assert sorted(f.path for f in model.files) == ["parts/qwen-2.tw.gguf", "qwen-q4.tw.gguf"]  # README filtered

    everything_repacked = run(client.search(""))
    assert [m.repo for m in everything_repacked] == ["acme/llama-tw", "acme/qwen-tw", "meta/gated-tw"]

    ggufs = run(client.search("qwen", kind="gguf", limit=10))
    assert [m.repo for m in ggufs] == ["bob/qwen-gguf", "acme/qwen-tw"]  # most downloaded first
    assert [f.path for f in ggufs[0].files] == ["qwen.Q4_K_M.gguf"]
    assert run(client.search("nothing-like-this")) == []


def test_search_limit_is_sent(hub: HubServer) -> None:
    client = HubClient(endpoint=hub.url)
    assert len(run(client.search("", limit=1))) == 1


def test_list_files_sizes_and_sha256(hub: HubServer) -> None:
    files = {f.path: f for f in run(HubClient(endpoint=hub.url).list_files("acme/qwen-tw"))}
    assert set(files) == {"README.md", "qwen-q4.tw.gguf", "parts/qwen-2.tw.gguf"}
    big = files["qwen-q4.tw.gguf"]
    assert big.size == len(TW) and big.sha256 == hashlib.sha256(TW).hexdigest()  # LFS size, not pointer size
    assert files["parts/qwen-2.tw.gguf"].sha256 == hashlib.sha256(b"tiny").hexdigest()
    readme = files["README.md"]
    assert readme.size == 7 and readme.sha256 is None  # plain git file: the hub publishes no sha256
    assert big.repo == "acme/qwen-tw" and big.revision == "main"


def test_file_info_from_head(hub: HubServer) -> None:
    client = HubClient(endpoint=hub.url)
    info = run(client.file_info("bob/qwen-gguf", "qwen.Q4_K_M.gguf", revision=COMMIT))
    assert info.size == len(GGUF) and info.sha256 == hashlib.sha256(GGUF).hexdigest()
    small = run(client.file_info("bob/qwen-gguf", "config.json"))
    assert small.size == 2 and small.sha256 is None
    assert hub.log[-1].method == "HEAD"


def test_file_info_with_cdn_redirect(hub: HubServer) -> None:
    hub.redirect_to_cdn = True
    info = run(HubClient(endpoint=hub.url).file_info("bob/qwen-gguf", "qwen.Q4_K_M.gguf"))
    assert info.size == len(GGUF) and info.sha256 == hashlib.sha256(GGUF).hexdigest()
    assert not any(r.path.startswith("/cdn/") for r in hub.log)  # metadata comes from the redirect itself


def test_not_found_errors(hub: HubServer) -> None:
    client = HubClient(endpoint=hub.url)
    assert expect_error(client.file_info("acme/qwen-tw", "missing.tw.gguf")).kind == "not_found"
    error = expect_error(client.list_files("acme/unknown"))
    assert error.kind == "not_found" and "acme/unknown" in str(error)
    error = expect_error(client.list_files("acme/qwen-tw", revision="nope"))
    assert error.kind == "not_found" and "revision" in str(error)
    assert expect_error(client.list_files("../etc")).kind == "not_found"  # never sent
    assert expect_error(client.file_info("acme/qwen-tw", "../../secret")).kind == "not_found"


def test_gated_repo_messages(hub: HubServer) -> None:
    for token in (None, "hf_not_accepted"):  # 401 without a token, 403 with one that lacks access
        client = HubClient(endpoint=hub.url, token=token)
        for call in (client.list_files("meta/gated-tw"), client.file_info("meta/gated-tw", "gated.tw.gguf")):
            error = expect_error(call)
            assert error.kind == "gated"
            assert "gated" in str(error) and "token" in str(error)
    statuses = [r.status for r in hub.log]
    assert 401 in statuses and 403 in statuses
    good = HubClient(endpoint=hub.url, token="hf_good")
    assert run(good.file_info("meta/gated-tw", "gated.tw.gguf")).size == 5000


def test_token_from_environment(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    info = run(HubClient(endpoint=hub.url).file_info("meta/gated-tw", "gated.tw.gguf"))
    assert info.size == 5000
    assert hub.log[-1].authorization == "Bearer hf_good"


def test_plain_401_and_server_error(hub: HubServer) -> None:
    client = HubClient(endpoint=hub.url, retry_backoff_s=0.01)
    hub.faults.status = 401
    error = expect_error(client.file_info("acme/qwen-tw", "README.md"))
    assert error.kind in ("auth", "not_found")
    assert len(hub.log) == 1  # refused: asking again would not change it
    hub.faults.status = 503
    error = expect_error(client.file_info("acme/qwen-tw", "README.md"))
    assert error.kind == "server" and error.retryable and str(error).endswith("(5 tries).")
    assert len(hub.log) == 1 + 5  # retried, a bounded number of times


def test_malformed_answers_become_clear_errors(hub: HubServer) -> None:
    client = HubClient(endpoint=hub.url)
    hub.faults.malformed_json = True
    assert expect_error(client.list_files("acme/qwen-tw")).kind == "malformed"
    assert expect_error(client.search("qwen")).kind == "malformed"
    hub.faults.malformed_json = False
    hub.faults.absurd_size = True
    error = expect_error(client.list_files("acme/qwen-tw"))
    assert error.kind == "malformed" and "size" in str(error)
    assert expect_error(client.file_info("acme/qwen-tw", "qwen-q4.tw.gguf")).kind == "malformed"
    hub.faults.absurd_size = False
    hub.faults.search_garbage = True  # broken entries are skipped or sanitised, good ones still come through
    models = run(client.search("", kind="gguf"))
    repos = [m.repo for m in models]
    assert "bob/qwen-gguf" in repos and "../../etc/passwd" not in repos
    odd = [m for m in models if m.repo == "bad/types"]
    assert odd and odd[0].downloads == 0 and odd[0].tags == ()


def test_offline_mode_answers_at_once(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for client in (HubClient(endpoint=hub.url, offline=True), None):
        if client is None:
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
            client = HubClient(endpoint=hub.url)
        assert client.offline
        error = expect_error(client.search("qwen"))
        assert error.kind == "offline" and "Offline" in str(error)
        assert expect_error(client.file_info("acme/qwen-tw", "README.md")).kind == "offline"
    assert hub.log == []  # nothing was sent: answered at once, without a timeout


def test_unreachable_hub(hub: HubServer) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # a port nobody listens on
    client = HubClient(endpoint=f"http://127.0.0.1:{port}", retry_backoff_s=0.01)
    error = expect_error(client.list_files("acme/qwen-tw"))
    assert error.kind == "network" and error.retryable and "(5 tries)" in str(error)


def test_unresponsive_hub_times_out() -> None:
    with socket.socket() as s:  # accepts connections (backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        client = HubClient(endpoint=f"http://127.0.0.1:{s.getsockname()[1]}", request_timeout_s=0.5, retries=1)
        error = expect_error(client.list_files("acme/qwen-tw"))  # not the guard's TimeoutError: its own timeout
        assert error.kind == "network"


def test_every_read_survives_a_hub_that_drops_connections(hub: HubServer) -> None:
    """Tree listing, search, a GGUF's header by range requests and the README: each connection the hub drops is
    tried again (issue 29: `runmyai get` failed three runs in a row on "Could not reach the hub … for the start
    of …"); a range read continues from the bytes it has, so every byte crosses the network once."""
    client = HubClient(endpoint=hub.url, retry_backoff_s=0.01)
    hub.faults.api_drop_times = 2
    assert {f.path for f in run(client.list_files("bob/qwen-gguf"))} == {"qwen.Q4_K_M.gguf", "config.json"}
    hub.faults.api_drop_times = 1
    assert [m.repo for m in run(client.search("qwen"))] == ["acme/qwen-tw"]
    dropped = [r for r in hub.log if r.status == 0]
    assert len(dropped) == 3 and all(r.path.startswith("/api/models") for r in dropped)  # they were real

    hub.faults_for["qwen.Q4_K_M.gguf"] = Faults(range_drop_after=40_000, range_drop_times=3)
    assert run(client.read_prefix("bob/qwen-gguf", "qwen.Q4_K_M.gguf", 150_000)) == GGUF[:150_000]
    reads = hub.gets("qwen.Q4_K_M.gguf")
    assert [r.range for r in reads] == [f"bytes={n}-149999" for n in (0, 40_000, 80_000, 120_000)]
    assert sum(r.body_bytes for r in reads) == 150_000

    hub.faults_for["README.md"] = Faults(range_drop_after=3)
    assert run(client.readme("acme/qwen-tw")) == "# qwen\n"
    assert [r.body_bytes for r in hub.gets("README.md")] == [3, 4]
    assert run(client.readme("bob/qwen-gguf")) is None  # no model card: none, not an error
    assert expect_error(client.readme("acme/unknown")).kind == "not_found"


def test_retries_are_bounded_and_said(hub: HubServer) -> None:
    client = HubClient(endpoint=hub.url, retries=2, retry_backoff_s=0.01)
    hub.faults.api_drop_times = 100
    error = expect_error(client.list_files("acme/qwen-tw"))
    assert error.kind == "network" and error.retryable and str(error).endswith("(3 tries).")
    assert len(hub.log) == 3
    # a range read that brings bytes on every try keeps going; one that brings none gives up
    hub.faults_for["qwen.Q4_K_M.gguf"] = Faults(range_drop_after=10_000, range_drop_times=6)
    assert run(client.read_prefix("bob/qwen-gguf", "qwen.Q4_K_M.gguf", 100_000)) == GGUF[:100_000]
    hub.faults.status = 503
    error = expect_error(client.read_prefix("bob/qwen-gguf", "qwen.Q4_K_M.gguf", 100_000))
    assert error.kind == "server" and "(3 tries)" in str(error)


def test_parse_content_range() -> None:
    assert parse_content_range("bytes 10-19/100") == (10, 19, 100)
    assert parse_content_range("bytes 0-0/*") == (0, 0, None)
    for bad in (None, "", "bytes 20-10/100", "bytes 0-100/100", "items 0-1/2", "bytes x-y/z", "bytes 1-2/3; junk"):
        assert parse_content_range(bad) is None
