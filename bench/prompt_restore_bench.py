"""Resuming a long conversation under a memory cap (issue 44's bar): time to the first new token when the context
is restored from a snapshot on disk (runtime/snapshot.py) against computing it again, the snapshot's read against
its bytes ÷ the drive's rate, and the logits of both against each other (they must be bit-identical).

python bench/prompt_restore_bench.py [--model models/bench/bench-q4_0.tw.gguf] [--tokens 4096] [--new 32]
                                     [--cap 0.25] [--quick]

Two processes, each in the cap, each starting with the model and the snapshot out of the page cache:
* re-prefill: the conversation's `--tokens`, then its `--new` tokens (the next user turn) — computed in two passes
  as the server's prompt cache would have — timed from the first token to the last one's logits; it then writes
  the snapshot of the first `--tokens` (not timed) beside the model;
* restore: reads and checks the snapshot, puts it into its sequence, computes the `--new` tokens: timed the same
  way (the session's loading is outside both times). The device's read bytes during the restore are taken from
  /proc/diskstats (every process's: a shared machine's other readers count too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from limits import probe_drive
from memcap import evict_from_page_cache, run_capped

CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[6])
from limits import DiskWatch
from tokenwing.runtime import snapshot
from tokenwing.runtime.session import Session, SessionOptions
model, n, m, mode, snap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
s = Session(model, SessionOptions(n_ctx=n + m + 16, kv_type="f16", usage_table=False), log=lambda l: None)
toks = np.random.default_rng(0).integers(0, s.hp.vocab_size - 16, n + m).tolist()
tags = snapshot.make_tags(model, s.chat_template, s.seqs[0], "f16")
out = {"mode": mode, "tokens": n, "new": m}
if mode == "prefill":
    t0 = time.perf_counter()
    s.forward(toks[:n], prompt=True)
    t1 = time.perf_counter()
    logits = s.forward(toks[n:], all_logits=True, prompt=True)
    out.update(first_token_s=time.perf_counter() - t0, context_s=t1 - t0)
    s.reuse_prefix(toks[: n + 1])  # back to the conversation's n tokens: the state the snapshot keeps
    t2 = time.perf_counter()
    out["snapshot_bytes"] = snapshot.write(snap, tags, snapshot.capture(s.seqs[0], 2))
    out["write_s"] = time.perf_counter() - t2
else:
    watch = DiskWatch(snap).start()
    t0 = time.perf_counter()
    loaded = snapshot.read(snap, tags)
    t1 = time.perf_counter()
    dev = watch.stop()
    snapshot.apply(loaded, s.seqs[0], 2)
    kept = s.reuse_prefix(toks)
    assert kept == n, kept
    t2 = time.perf_counter()
    logits = s.forward(toks[n:], all_logits=True, prompt=True)
    out.update(first_token_s=time.perf_counter() - t0, read_s=t1 - t0, place_s=t2 - t1,
               device_bytes=dev["bytes"] if dev else None)
np.save(snap + "." + mode + ".npy", logits)
s.close()
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench/bench-q4_0.tw.gguf")
    ap.add_argument("--tokens", type=int, default=4096, help="the conversation so far")
    ap.add_argument("--new", type=int, default=32, help="the next turn's tokens")
    ap.add_argument("--cap", type=float, default=0.25, help="memory cap as a share of the model file")
    ap.add_argument("--quick", action="store_true", help="a short drive probe")
    args = ap.parse_args()
    import numpy as np  # (after the flags: --help stays instant)

    cap = int(os.path.getsize(args.model) * args.cap) or None
    ceiling = probe_drive(args.model, budget=(256 if args.quick else 1024) << 20, quick=args.quick)
    folder = tempfile.mkdtemp(prefix=".restore-bench-", dir=os.path.dirname(os.path.abspath(args.model)))
    snap = os.path.join(folder, "conversation.twsnap")
    results = {}
    try:
        for mode in ("prefill", "restore"):
            evict_from_page_cache(args.model)
            if os.path.exists(snap):
                evict_from_page_cache(snap)
            cmd = [sys.executable, "-c", CHILD, args.model, str(args.tokens), str(args.new), mode, snap]
            r = run_capped([*cmd, os.path.dirname(os.path.abspath(__file__))], cap, 7200)
            if r.returncode:
                print(r.stderr[-2000:], file=sys.stderr)
                return 1
            results[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        same = bool(np.array_equal(np.load(snap + ".prefill.npy"), np.load(snap + ".restore.npy")))
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    pre, res = results["prefill"], results["restore"]
    nbytes = pre["snapshot_bytes"]
    drive_s = nbytes / (ceiling.mb_per_s * 1e6)
    print(json.dumps({"prefill": pre, "restore": res, "drive_mb_per_s": ceiling.mb_per_s, "bit_identical": same}))
    cap_text = f"under the {args.cap:.0%} cap" if cap else "in RAM"
    device = f"{res['device_bytes'] / 1e6:.1f} MB" if res.get("device_bytes") is not None else "n/a"
    print(
        f"{args.tokens} + {args.new} tokens {cap_text}: first new token after re-prefill {pre['first_token_s']:.2f} s, "
        f"after restore {res['first_token_s']:.3f} s = {pre['first_token_s'] / res['first_token_s']:.0f}x faster "
        f"(logits bit-identical: {same})\n"
        f"snapshot {nbytes / 1e6:.1f} MB (written in {pre['write_s']:.2f} s); read and checked in "
        f"{res['read_s']:.3f} s, placed in {res['place_s']:.3f} s; bytes ÷ drive rate ({ceiling.mb_per_s:.0f} MB/s, "
        f"{ceiling.best}) = {drive_s:.3f} s: the read is {res['read_s'] / drive_s:.1f}x that; device read {device} "
        f"during it"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
