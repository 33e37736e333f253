"""ChatClient and StatsClient against the real `tokenwing serve` (and, for malformed streams only, a fake server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from runmyai.engine.client import ChatClient, ChatDelta, ChatError, ChatSettings
from runmyai.engine.endpoint import Endpoint, client_kind
from runmyai.engine.stats import StatsClient, TokenStats, parse_token_stats
from tests.conftest import ModelFactory

KEY = "client-test-key"
LONG = ChatSettings(temperature=1.5, seed=2, max_tokens=300)  # this seed runs to the token limit on the test model
HELLO = [{"role": "user", "content": "Hello"}]


class Engine:
    def __init__(self, model: Path, **env_extra: str) -> None:
        self.model = model
        env = dict(os.environ, TOKENWING_API_KEY=KEY, **env_extra)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenwing", "serve", str(model), "--ctx", "512", "--port", "0", "--watch-stdin"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        port = json.loads(self.proc.stdout.readline())["port"]
        self.url = f"http://127.0.0.1:{port}"
        self.endpoint = Endpoint(self.url + "/v1", KEY, "test")
        deadline = time.monotonic() + 60
        while httpx.get(self.url + "/health").status_code != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)

    def completion_tokens(self) -> int:
        r = httpx.get(self.url + "/v1/tokenwing/stats", headers={"Authorization": f"Bearer {KEY}"})
        return int(r.json()["totals"]["completion_tokens"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.communicate(timeout=30)  # waits, and closes the pipes


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Path:
    return repacked_factory(type="Q8_0", n_layer=3)


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[Engine]:
    e = Engine(model)
    yield e
    e.stop()


def run(fn: Callable[[], Awaitable[object]]) -> object:
    return asyncio.run(fn())  # type: ignore[arg-type]


async def collect(client: ChatClient, messages: list[dict[str, str]], settings: ChatSettings) -> list[ChatDelta]:
    return [d async for d in client.stream_chat(messages, settings)]


# ---------------------------------------------------------------------------------------------- streaming
def test_stream_chat_text_finish_usage_and_timing(engine: Engine) -> None:
    settings = ChatSettings(temperature=0, max_tokens=8)

    async def main() -> None:
        client = ChatClient(engine.endpoint)
        try:
            deltas = await collect(client, HELLO, settings)
            models = await client.models()
            assert len(models) == 1 and models[0].endswith("qwen3moe-Q8_0")
        finally:
            await client.aclose()
        text = "".join(d.text for d in deltas)
        whole = httpx.post(
            engine.url + "/v1/chat/completions",
            json={"messages": HELLO, "temperature": 0, "max_tokens": 8},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        ).json()
        assert text == whole["choices"][0]["message"]["content"]  # greedy: the same reply
        assert [d.finish_reason for d in deltas if d.finish_reason] == [whole["choices"][0]["finish_reason"]]
        usage = [d.usage for d in deltas if d.usage]
        assert usage and usage[-1]["completion_tokens"] == whole["usage"]["completion_tokens"]
        st = client.last_stats
        assert st is not None and st.tokens == usage[-1]["completion_tokens"]
        assert st.ttft_s is not None and 0 < st.ttft_s < 60
        assert st.tokens < 2 or (st.tokens_per_s is not None and st.tokens_per_s > 0)

    run(main)


def test_sampling_settings_reach_the_engine(engine: Engine) -> None:
    async def main() -> None:
        client = ChatClient(engine.endpoint)
        try:
            a = await collect(client, HELLO, ChatSettings(temperature=1.2, seed=11, max_tokens=6, top_k=20))
            b = await collect(client, HELLO, ChatSettings(temperature=1.2, seed=11, max_tokens=6, top_k=20))
            short = await collect(client, HELLO, ChatSettings(temperature=1.5, seed=2, max_tokens=2))
        finally:
            await client.aclose()
        assert "".join(d.text for d in a) == "".join(d.text for d in b)  # the seed was sent
        assert [d.usage for d in short if d.usage][-1]["completion_tokens"] <= 2  # so was max_tokens
        assert [d.finish_reason for d in short if d.finish_reason] == ["length"]

    run(main)


def test_closing_the_iterator_cancels_the_generation(engine: Engine) -> None:
    async def main() -> None:
        client = ChatClient(engine.endpoint)
        before = engine.completion_tokens()
        stream = client.stream_chat(HELLO, LONG)
        first = ""
        async for d in stream:
            first += d.text
            if first:
                break
        await stream.aclose()  # closes the HTTP stream; the engine stops at its next token (counted below)
        assert client.last_stats is not None and client.last_stats.ttft_s is not None
        again = await collect(client, HELLO, ChatSettings(temperature=0, max_tokens=3))  # the queue is free
        assert any(d.finish_reason for d in again)
        short = [d.usage for d in again if d.usage][-1]["completion_tokens"]
        await client.aclose()
        generated = engine.completion_tokens() - before - short
        assert 1 <= generated < 300, generated  # the long one stopped early

    run(main)


def test_cancelling_the_task_closes_the_stream(engine: Engine) -> None:
    async def main() -> None:
        client = ChatClient(engine.endpoint)
        before = engine.completion_tokens()
        got_first = asyncio.Event()

        async def consume() -> None:
            async for d in client.stream_chat(HELLO, LONG):
                if d.text:
                    got_first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_first.wait(), 60)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        again = await collect(client, HELLO, ChatSettings(temperature=0, max_tokens=2))
        short = [d.usage for d in again if d.usage][-1]["completion_tokens"]
        await client.aclose()
        assert 1 <= engine.completion_tokens() - before - short < 300

    run(main)


# ---------------------------------------------------------------------------------------------- errors
def test_errors_are_one_sentence(engine: Engine) -> None:
    async def err(endpoint: Endpoint | Callable[[], Endpoint | None], settings: ChatSettings) -> ChatError:
        client = ChatClient(endpoint)
        try:
            with pytest.raises(ChatError) as e:
                await collect(client, HELLO, settings)
            return e.value
        finally:
            await client.aclose()

    async def main() -> None:
        wrong = Endpoint(engine.endpoint.base_url, "wrong-key", "x")
        e = await err(wrong, ChatSettings(max_tokens=2))
        assert e.status == 401 and "API key" in str(e)
        remote_wrong = Endpoint.remote(engine.url, "wrong-key")
        assert "check the key" in str(await err(remote_wrong, ChatSettings(max_tokens=2)))
        e = await err(engine.endpoint, ChatSettings(temperature=5, max_tokens=2))  # the engine's own 400
        assert e.status == 400 and "temperature" in str(e) and str(e).startswith("The engine refused the request")
        with socket_closed_port() as port:
            e = await err(Endpoint(f"http://127.0.0.1:{port}/v1", KEY), ChatSettings())
        assert str(e) == "Cannot connect to the engine: it is not running."
        assert "not running" in str(await err(lambda: None, ChatSettings()))
        client = ChatClient(wrong)
        with pytest.raises(ChatError, match="API key"):
            await client.models()
        await client.aclose()

    run(main)


@contextlib.contextmanager
def socket_closed_port() -> Iterator[int]:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    yield port


def test_engine_dying_mid_reply(model: Path) -> None:
    eng = Engine(model)

    async def main() -> None:
        client = ChatClient(eng.endpoint)
        text = ""
        with pytest.raises(ChatError) as e:
            async for d in client.stream_chat(HELLO, LONG):
                text += d.text
                if text and eng.proc.poll() is None:
                    os.kill(eng.proc.pid, signal.SIGKILL)
        await client.aclose()
        assert text
        assert "broke off in the middle of the reply" in str(e.value) or "ended before it was finished" in str(e.value)

    try:
        run(main)
    finally:
        eng.stop()


# ---------------------------------------------------------------------------------------------- fake server
class FakeServer:
    """SYNTHETIC: a raw HTTP server answering every request with canned bytes. The real engine never sends
    malformed SSE, so malformed streams can only be produced like this."""

    def __init__(self, response: bytes) -> None:
        self.response = response
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> FakeServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(f"http://127.0.0.1:{self.port}/v1", None, None, local=False)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        if length:
            await reader.readexactly(length)
        writer.write(self.response)
        await writer.drain()
        writer.close()


def sse(status: str, *events: str, ctype: str = "text/event-stream") -> bytes:
    body = "".join(events).encode()
    return f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nConnection: close\r\n\r\n".encode() + body


def chunk(text: str | None = None, finish: str | None = None, **extra: object) -> str:
    delta = {"content": text} if text is not None else {}
    return "data: " + json.dumps({"choices": [{"delta": delta, "finish_reason": finish}], **extra}) + "\n\n"


def test_malformed_streams_are_skipped_or_clear_errors() -> None:
    async def stream(response: bytes) -> tuple[list[ChatDelta], ChatError | None, ChatClient]:
        async with FakeServer(response) as srv:
            client = ChatClient(srv.endpoint)
            out: list[ChatDelta] = []
            try:
                async for d in client.stream_chat(HELLO, ChatSettings()):
                    out.append(d)
            except ChatError as e:
                return out, e, client
            finally:
                await client.aclose()
            return out, None, client

    async def main() -> None:
        messy = sse(
            "200 OK",
            ": a comment\n\n",
            "data: {not json\n\n",
            "data: [1, 2]\n\n",
            "data: {}\n\n",
            "garbage line without colon\n\n",
            chunk("Hel"),
            'event: ping\ndata: {"choices": []}\n\n',
            "data:" + json.dumps({"choices": [{"delta": {"content": "lo"}}]}) + "\r\n\r\n",  # CRLF, no space
            chunk(None, "stop"),
            "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 2}}) + "\n\n",
            "data: [DONE]\n\n",
            chunk("never read"),
        )
        deltas, err, client = await stream(messy)
        assert err is None and "".join(d.text for d in deltas) == "Hello"
        assert deltas[-1].usage == {"completion_tokens": 2} and [d.finish_reason for d in deltas][-2] == "stop"
        assert client.skipped_lines >= 3 and client.last_stats is not None and client.last_stats.tokens == 2

        deltas, err, _ = await stream(sse("200 OK", chunk("Hi"), chunk(" there")))  # cut off: no end marker
        assert err is not None and "ended before it was finished" in str(err)
        assert "".join(d.text for d in deltas) == "Hi there"  # what came is kept

        _, err, _ = await stream(sse("200 OK", chunk("x"), 'data: {"error": {"message": "the model went away"}}\n\n'))
        assert err is not None and str(err) == "The reply failed: the model went away."

        _, err, _ = await stream(sse("500 Internal Server Error", "<html>oops</html>", ctype="text/html"))
        assert err is not None and err.status == 500 and "\n" not in str(err) and "HTTP 500" in str(err)

        _, err, _ = await stream(sse("404 Not Found", ""))
        assert err is not None and "no chat API" in str(err)

    run(main)


# ---------------------------------------------------------------------------------------------- stats
def test_stats_stream_yields_typed_events(engine: Engine) -> None:
    async def main() -> list[TokenStats]:
        stats = StatsClient(engine.endpoint)
        got: list[TokenStats] = []

        async def listen() -> None:
            # aclosing: an async generator left by `return` is otherwise closed later, by the event loop
            async with contextlib.aclosing(stats.events()) as events:
                async for ev in events:
                    got.append(ev)
                    if len(got) >= 3:
                        return

        task = asyncio.create_task(listen())
        while not stats.connected:
            await asyncio.sleep(0.05)
        client = ChatClient(engine.endpoint)
        await collect(client, HELLO, ChatSettings(temperature=0, max_tokens=6))
        await client.aclose()
        await asyncio.wait_for(task, 60)
        assert not stats.connected  # closing the iterator closed the connection
        return got

    got = run(main)
    assert isinstance(got, list) and len(got) >= 3
    ev = got[0]
    assert [layer.layer for layer in ev.layers] == [0, 1, 2]
    assert all(layer.hits + layer.misses > 0 for layer in ev.layers)
    assert ev.vram_swaps == 0 and isinstance(ev.bytes_read, int) and ev.ssd_wait_ms >= 0
    assert isinstance(ev.prediction_recall, list) and all(isinstance(r, float) for r in ev.prediction_recall)
    assert [e.token for e in got] == [1, 2, 3]  # subscribed before the request: its tokens from the first, in order


def test_stats_parsing_ignores_unknown_fields_and_bad_events() -> None:
    ev = parse_token_stats(
        json.dumps(
            {
                "token": 3,
                "layers": [
                    {"layer": 0, "hits": 2, "misses": 1, "vram_swaps_in": 2, "vram_swaps_out": 1, "future": 9},
                    "junk",
                ],
                "ssd_wait_ms": 1.5,
                "bytes_read": 10,
                "vram_swaps": 0,
                "prediction_recall": [0.5, "x"],
                "tokens_per_s": None,
                "brand_new_counter": 7,
            }
        )
    )
    assert ev is not None and ev.extra == {"brand_new_counter": 7} and ev.tokens_per_s is None
    assert len(ev.layers) == 1 and ev.layers[0].hits == 2 and ev.prediction_recall == [0.5]
    assert (ev.layers[0].vram_swaps_in, ev.layers[0].vram_swaps_out, ev.layers[0].vram_bytes_up) == (2, 1, 0)
    assert ev.vram_swaps_out == 1 and ev.vram_bytes_up == 0  # (an engine that does not send a count: 0)
    assert parse_token_stats("{broken") is None and parse_token_stats("[]") is None
    assert parse_token_stats('{"token": 1}') is None


def test_remote_endpoint_addresses() -> None:
    assert Endpoint.remote("http://localhost:11434").base_url == "http://localhost:11434/v1"
    assert Endpoint.remote(" https://api.example.com/v1/ ", " k ").base_url == "https://api.example.com/v1"
    ep = Endpoint.remote("https://api.example.com/v1", "", "gpt")
    assert ep.api_key is None and not ep.local and ep.model == "gpt" and ep.headers() == {}
    assert Endpoint.remote("http://h/v1", "k").headers() == {"Authorization": "Bearer k"}
    # loopback servers never go through an environment proxy; TLS only for https
    assert client_kind(Endpoint.remote("http://localhost:11434")) == (False, False)
    assert client_kind(Endpoint.remote("http://127.0.0.2:8000/v1")) == (False, False)
    assert client_kind(Endpoint.remote("https://api.example.com")) == (True, True)
    assert client_kind(None) == (False, False)
    for bad in ("ftp://x", "localhost:8080", ""):
        with pytest.raises(ValueError):
            Endpoint.remote(bad)
