"""Issue 41: the HTTP fuzz in CI (tests/engine/http_fuzz.py; the longer run is bench/http_fuzz_bench.py). A fixed
seed's few hundred mutated requests against one live server: every answer a 2xx or a 4xx in the JSON error format
(never a 500, a dropped connection or a hang), the server healthy afterwards, its memory bounded, and its log
free of tracebacks (a client gone before its body ended logged one each)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.conftest import ModelFactory
from tests.engine import http_fuzz
from tests.engine.test_server import KEY, Server

SEED = 41
CASES = 400
RSS_GROWTH_LIMIT = 256 << 20  # the 8 MiB bodies (20 MiB ones are refused unread) and a few replies: far below


@pytest.fixture(scope="module")
def server(repacked_factory: ModelFactory) -> Iterator[tuple[Server, list[str]]]:
    s = Server(repacked_factory(type="Q8_0", n_layer=2), "--no-usage-table")
    with s.logged() as log:  # (read as it comes, as a supervisor does: a full pipe would block the server)
        yield s, log


def test_the_http_fuzz_gets_only_clean_answers(server: tuple[Server, list[str]]) -> None:
    s, log = server
    port = int(s.handshake["port"])
    proc = psutil.Process(s.proc.pid)
    rss0 = proc.memory_info().rss
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for case in http_fuzz.cases(SEED, CASES):
        try:
            answer = http_fuzz.send(case, port, KEY)
        except (OSError, ConnectionError) as e:  # a reset, a timeout (a hang) or a connection closed with no answer
            failures.append(f"{case.kind}: {type(e).__name__}: {e}")
            continue
        statuses[answer.status] += 1
        problem = answer.problem(head=case.method == "HEAD")
        if problem:
            failures.append(f"{case.kind}: {problem}")
    assert not failures, "\n".join(failures[:20])
    assert statuses[200] > 0 and sum(statuses.values()) == CASES  # some valid requests did get through
    assert httpx.get(s.url + "/health", timeout=30).json()["status"] == "ok"
    reply = s.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hello"}], max_tokens=2, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"
    assert proc.memory_info().rss - rss0 < RSS_GROWTH_LIMIT
    assert not [line for line in log if "Traceback" in line], "".join(log[-40:])
