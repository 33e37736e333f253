"""The header fuzzer's longer run (issue 41): tests/format/header_fuzz.py over more cases and several families,
each worker under a 2 GiB address-space limit. Prints the counts for docs/results.md: inputs tried, accepted,
refused cleanly, failures (each failure's case on stderr).

usage: python bench/header_fuzz_bench.py [--cases 2000] [--seed 41] [--arch qwen3moe --arch deepseek2 ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.format.header_fuzz import limited  # noqa: E402
from tokenwing.format.repack import repack  # noqa: E402
from tokenwing.testmodel import preset_shape, write_test_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=2000, help="per family (half on the source, half on its repack)")
    p.add_argument("--seed", type=int, default=41)
    p.add_argument("--arch", action="append", default=[])
    args = p.parse_args()
    archs = args.arch or ["qwen3moe", "deepseek2", "qwen3next", "gpt-oss"]
    total: Counter[str] = Counter()
    t0 = time.monotonic()
    for arch in archs:
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "s.gguf"
            write_test_model(str(src), preset_shape("tiny", arch).with_(vocab_size=300), "Q8_0")
            tw = Path(d) / "s.tw.gguf"
            repack([str(src)], str(tw), show_progress=False)
            worker = [sys.executable, "-m", "tests.format.header_fuzz", str(src), str(tw), d]
            proc = subprocess.run(
                [*worker, "--cases", str(args.cases), "--seed", str(args.seed)],
                capture_output=True,
                text=True,
                cwd=ROOT,
                preexec_fn=limited(),  # (in place before the worker runs anything)
                check=False,
            )
            results = [json.loads(line) for line in proc.stdout.splitlines()]
            counts: Counter[str] = Counter(r["verdict"].split(":")[0] for r in results)
            if proc.returncode != 0 or len(results) != args.cases:
                counts["failure"] += 1
                tail = proc.stderr[-2000:]
                print(f"{arch}: worker exit {proc.returncode} after {len(results)}\n{tail}", file=sys.stderr)
            for r in results:
                if r["verdict"].startswith("failure"):
                    print(f"{arch}: {json.dumps(r)[:1500]}", file=sys.stderr)
            kinds = Counter((r["kind"], r["verdict"].split(":")[0]) for r in results)
            print(f"{arch}: {len(results)} tried, {dict(counts)}; by kind {dict(sorted(kinds.items()))}", flush=True)
            total += counts
            total["tried"] += len(results)
    print(
        f"all: {total['tried']} inputs tried, {total['accepted']} accepted, {total['refused']} refused cleanly, "
        f"{total['failure']} failures, in {time.monotonic() - t0:.0f} s"
    )
    return 1 if total["failure"] else 0


if __name__ == "__main__":
    sys.exit(main())
