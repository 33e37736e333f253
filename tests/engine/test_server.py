"""`tokenwing serve` as a real subprocess, exercised with the official `openai` client and raw HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ModelFactory, run_cli

KEY = "test-key-123"


class Server:
    def __init__(self, model: Path, *args: str, key: str | None = KEY) -> None:
        env = dict(os.environ)
        env.pop("TOKENWING_API_KEY", None)
        if key:
            env["TOKENWING_API_KEY"] = key
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenwing", "serve", str(model), "--ctx", "512", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.handshake = json.loads(line)
        self.url = f"http://127.0.0.1:{self.handshake['port']}"
        deadline = time.monotonic() + 60
        while httpx.get(self.url + "/health").status_code != 200:
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    @contextlib.contextmanager
    def logged(self) -> Iterator[list[str]]:
        """The server's log as it comes (read, so that a full pipe never blocks it); the server stops after."""
        log: list[str] = []
        reader = threading.Thread(target=lambda: log.extend(self.proc.stderr or ()), daemon=True)
        reader.start()
        try:
            yield log
        finally:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            reader.join(timeout=30)

    def stop(self) -> str:
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=30)
        return err


@pytest.fixture(scope="module")
def server(repacked_factory: ModelFactory) -> Iterator[Server]:
    s = Server(repacked_factory(type="Q8_0", n_layer=3), "--ram-budget", "30%")
    yield s
    s.stop()


def test_handshake_and_health(server: Server) -> None:
    h = server.handshake
    assert h["pid"] == server.proc.pid and h["version"] and h["api_version"] == "1"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_models(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.handshake["model"]]


def test_chat_non_streaming(server: Server) -> None:
    r = server.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0
    )
    assert r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason in ("length", "stop")
    again = server.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0
    )
    assert again.choices[0].message.content == r.choices[0].message.content  # greedy is deterministic


def test_chat_streaming_matches_non_streaming(server: Server) -> None:
    c = server.client()
    whole = (
        c.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "Tell"}], max_tokens=8, temperature=0
        )
        .choices[0]
        .message.content
    )
    chunks = list(
        c.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "Tell"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 8
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("length", "stop")


def test_completions_and_seeded_sampling(server: Server) -> None:
    c = server.client()
    a = c.completions.create(model="x", prompt="Once upon", max_tokens=5, temperature=0.9, seed=7)
    b = c.completions.create(model="x", prompt="Once upon", max_tokens=5, temperature=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="x", prompt="Once upon", max_tokens=5, temperature=0.9, seed=7, stream=True
        )
    )
    assert streamed == a.choices[0].text


def test_errors_are_openai_style(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="x", messages=[], max_tokens=5)
    assert "messages" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="x", messages=[{"role": "user", "content": "x"}], temperature=5)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body in (
        b"{not json",
        b"[]",
        b'{"messages": [{"role": "wizard", "content": "x"}]}',
        b'{"prompt": 5}',
        b'{"messages": [{"role": "user", "content": [{"type": "image"}]}]}',
    ):
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = httpx.post(server.url + path, content=body, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200  # still up


def test_concurrent_requests_queue(server: Server) -> None:
    results: list[str] = []

    def one(i: int) -> None:
        r = server.client().completions.create(model="x", prompt=f"Number {i}", max_tokens=4, temperature=0)
        results.append(r.choices[0].text)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4


def test_disconnect_cancels(server: Server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(server.url + "/v1/tokenwing/stats", headers=headers).json()["totals"]
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers=headers,
        timeout=60,
        json={"prompt": "Go", "max_tokens": 400, "stream": True, "temperature": 0},
    ) as r:
        for _ in r.iter_lines():
            break  # the first chunk, then hang up
    r2 = server.client().completions.create(model="x", prompt="Next", max_tokens=3, temperature=0)
    assert r2.choices[0].text is not None
    after = httpx.get(server.url + "/v1/tokenwing/stats", headers=headers).json()["totals"]
    assert after["completion_tokens"] - before["completion_tokens"] < 400  # the first one stopped early


def test_stats_stream_and_metrics(server: Server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    events: list[dict[str, object]] = []
    subscribed = threading.Event()

    def listen() -> None:
        with httpx.stream("GET", server.url + "/v1/tokenwing/stats/stream", headers=headers, timeout=60) as r:
            subscribed.set()  # the server subscribes before it answers: every later token is ours
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) >= 3:
                        return

    t = threading.Thread(target=listen)
    t.start()
    assert subscribed.wait(60)
    server.client().completions.create(model="x", prompt="Stats", max_tokens=6, temperature=0)
    t.join(timeout=60)
    assert [e["token"] for e in events] == [1, 2, 3]
    ev = events[0]
    assert {"layers", "ssd_wait_ms", "bytes_read", "vram_swaps", "prediction_recall", "tokens_per_s"} <= set(ev)
    # the fields `tokenwing info --json` publishes for it are the event's, each layer's too
    published = json.loads(run_cli("info", "--json").stdout)["stats_fields"]
    layers: list[dict[str, object]] = ev["layers"]  # type: ignore[assignment]
    assert list(ev) == published["token"] and all(list(e) == published["layer"] for e in layers)
    assert len(ev["layers"]) == 3 and ev["vram_swaps"] == 0  # type: ignore[arg-type]
    text = httpx.get(server.url + "/metrics").text
    assert "tokenwing_up" in text and 'tokenwing_expert_hits_total{layer="0"}' in text


def test_bad_model_fails_cleanly(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tw.gguf"
    bad.write_bytes(b"GGUF" + bytes(200))
    proc = subprocess.run(
        [sys.executable, "-m", "tokenwing", "serve", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stdout == ""  # no handshake: it never looked ready
    assert proc.stderr.strip().startswith("tokenwing: error: ")
