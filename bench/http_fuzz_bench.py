"""The HTTP fuzz's longer run (issue 41): tests/engine/http_fuzz.py's mutated requests, more of them and from
another seed than CI's, against one live `tokenwing serve` of a factory model. Prints the counts for
docs/results.md: inputs tried, answered (2xx), refused cleanly (a JSON 4xx), clients that left mid-body, failures
(a 5xx, an answer not in the JSON error format, a dropped connection or a hang; each on stderr), and the server's
RSS before and after.

usage: python bench/http_fuzz_bench.py [--cases 2000] [--seed 4141]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402

from bench.served import Served  # noqa: E402
from tests.engine import http_fuzz  # noqa: E402
from tokenwing.format.repack import repack  # noqa: E402
from tokenwing.testmodel import preset_shape, write_test_model  # noqa: E402

KEY = "fuzz-key"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=4141)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        src, tw = Path(d) / "m.gguf", Path(d) / "m.tw.gguf"
        write_test_model(str(src), preset_shape("tiny", "qwen3moe"), "Q8_0")
        repack([str(src)], str(tw), show_progress=False)
        with Served(str(tw), KEY, ["--ctx", "512"], stop_timeout=30) as served:
            url = served.url
            port = int(url.rsplit(":", 1)[1])
            rss = psutil.Process(served.pid)
            rss0 = rss.memory_info().rss
            counts: Counter[str] = Counter()
            kinds: Counter[str] = Counter()
            t0 = time.monotonic()
            for case in http_fuzz.cases(args.seed, args.cases):
                kinds[case.kind.split()[0]] += 1
                try:
                    answer = http_fuzz.send(case, port, KEY)
                except (OSError, ConnectionError) as e:
                    counts["failures"] += 1
                    print(f"FAIL {case.kind}: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                problem = answer.problem(head=case.method == "HEAD")
                if problem:
                    counts["failures"] += 1
                    print(f"FAIL {case.kind}: {problem}", file=sys.stderr)
                elif answer.status == 0:
                    counts["client left"] += 1
                elif answer.status < 300:
                    counts["answered"] += 1
                else:
                    counts["refused cleanly"] += 1
            wall = time.monotonic() - t0
            healthy = httpx.get(url + "/health").json()["status"]
            rss1 = rss.memory_info().rss
        tracebacks = served.tracebacks()
        leaks = sum("leaked" in line for line in served.log)
    print(
        json.dumps(
            {
                "inputs": args.cases,
                "seed": args.seed,
                **counts,
                "failures": counts["failures"],
                "by_kind": dict(kinds),
                "wall_s": round(wall, 1),
                "rss_mib_before_after": [rss0 >> 20, rss1 >> 20],
                "health_after": healthy,
                "tracebacks_in_log": tracebacks,
                "leak_lines_at_stop": leaks,
            }
        )
    )
    return 1 if counts["failures"] or tracebacks else 0


if __name__ == "__main__":
    raise SystemExit(main())
