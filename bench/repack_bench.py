"""Repack benchmark: throughput and peak memory of `tokenwing repack` on a model larger than 4 GB.

    python bench/repack_bench.py [--dir models/bench] [--preset bench] [--type Q4_0] [--cap-mib 256]

Runs the repack twice, each with the source evicted from the page cache first: once free, once inside a
cgroup memory cap (which also charges the page cache it reads and writes). Prints a Markdown table row set.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from memcap import evict_from_page_cache, run_capped


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="models/bench")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("--cap-mib", type=int, default=256)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    src = os.path.join(args.dir, f"{args.preset}-{args.type.lower()}.gguf")
    out = os.path.join(args.dir, f"{args.preset}-{args.type.lower()}.tw.gguf")
    tw = [sys.executable, "-m", "tokenwing"]
    if not os.path.exists(src):
        t0 = time.monotonic()
        r = run_capped([*tw, "testmodel", src, "--preset", args.preset, "--type", args.type, "-q"], None, 3600)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        size = os.path.getsize(src)
        print(
            f"generated {src}: {size / 1e9:.2f} GB in {time.monotonic() - t0:.0f} s "
            f"({size / 1e6 / (time.monotonic() - t0):.0f} MB/s)"
        )
    size = os.path.getsize(src)
    print(f"\nsource {src}: {size / 1e9:.2f} GB\n")
    # peak RSS is the repack process's own (getrusage), printed by `tokenwing repack`
    print("| run | repack (read+write) | verify (read back) | total | peak RSS | peak cgroup charge |")
    print("|---|---|---|---|---|---|")
    for label, cap in (("no cap", None), (f"cap {args.cap_mib} MiB", args.cap_mib << 20)):
        evict_from_page_cache(src)
        with_out = [*tw, "repack", src, "-o", out, "-q"]
        r = run_capped(with_out, cap, 3600)
        if r.returncode:
            print(f"| {label} | failed: {r.stderr.strip()[-300:]} |||||")
            continue
        m = re.search(r"(\d+) MB/s write, verified in ([\d.]+) s, peak memory ([\d.]+) MiB", r.stdout)
        write_mbs, verify_s, rss = (int(m.group(1)), float(m.group(2)), float(m.group(3))) if m else (0, 0.0, 0.0)
        verify_mbs = size / 1e6 / verify_s if verify_s else 0
        charge = f"{r.peak_bytes / 2**20:.0f} MiB" if cap else "—"
        print(
            f"| {label} | {write_mbs} MB/s | {verify_s:.1f} s ({verify_mbs:.0f} MB/s) | {r.seconds:.1f} s "
            f"| {rss:.0f} MiB | {charge} |"
        )
        evict_from_page_cache(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
