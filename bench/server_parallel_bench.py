"""Several clients of `tokenwing serve --parallel N` at once, against the same requests one after another: what an
agent's parallel requests get from the server's slots (issue 26), through the official `openai` client.

    python bench/server_parallel_bench.py MODEL.tw.gguf [--clients 4] [--tokens 200] [--rounds 3] [--threads 2]
                                          [-- more serve flags]

Each round sends `--clients` chat requests (different prompts, greedy, `ignore_eos` so every reply is `--tokens`
long) one after another, then all at once, to one server started with `--parallel` as many slots. Reports the
aggregate tokens per second of both, their ratio, and the server process's CPU time per token (user + system,
from /proc: what a busy machine's wall clock hides).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.served import Served

PROMPTS = [
    "Quote a verse from the book of Genesis.",
    "Write a sonnet about the sea.",
    "Define the word 'hacker'.",
    "Explain Python's list comprehensions.",
    "Who was King Lear?",
    "Describe a storm at sea.",
    "What is a daemon?",
    "Tell me of the Tower of Babel.",
]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("serve_flags", nargs="*", help="more `tokenwing serve` flags (after --)")
    args = ap.parse_args()
    from openai import AsyncOpenAI

    flags = ["--parallel", str(args.clients), "--threads", str(args.threads), *args.serve_flags]
    with Served(args.model, "bench", flags) as server:
        url = server.url
        client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)

        async def one(i: int) -> int:
            r = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                max_tokens=args.tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert r.usage is not None
            return r.usage.completion_tokens

        async def measure() -> list[tuple[float, float, float, float]]:
            await one(0)  # warm: the first graphs built, the prompt path touched
            out = []
            for _ in range(args.rounds):
                t0, c0, tokens = time.perf_counter(), _cpu_seconds(server.pid), 0
                for i in range(args.clients):
                    tokens += await one(i)
                seq, seq_cpu = tokens / (time.perf_counter() - t0), (_cpu_seconds(server.pid) - c0) / tokens
                t0, c0 = time.perf_counter(), _cpu_seconds(server.pid)
                tokens = sum(await asyncio.gather(*(one(i) for i in range(args.clients))))
                par, par_cpu = tokens / (time.perf_counter() - t0), (_cpu_seconds(server.pid) - c0) / tokens
                out.append((seq, par, seq_cpu, par_cpu))
            return out

        rounds = asyncio.run(measure())
    print(f"{args.model}: {args.clients} clients x {args.tokens} tokens, {args.threads} threads, {args.rounds} rounds")
    print("| one after another tok/s | at once tok/s | × | CPU ms a token, one after another | at once | rounds (×) |")
    print("|---|---|---|---|---|---|")
    seq = statistics.median(r[0] for r in rounds)
    par = statistics.median(r[1] for r in rounds)
    every = ", ".join(f"{r[1] / r[0]:.2f}" for r in rounds)
    seq_cpu = statistics.median(r[2] for r in rounds) * 1e3
    par_cpu = statistics.median(r[3] for r in rounds) * 1e3
    print(f"| {seq:.1f} | {par:.1f} | {par / seq:.2f}× | {seq_cpu:.2f} | {par_cpu:.2f} | {every} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
