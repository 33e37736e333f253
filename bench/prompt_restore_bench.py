"""Resuming a long conversation under a memory cap (issue 44's bar): time to the first new token when the context
is restored from a snapshot on disk (runtime/snapshot.py) against computing it again, the snapshot's read against
its bytes ÷ the drive's rate, and the logits of both against each other (they must be bit-identical).

python bench/prompt_restore_bench.py [--model models/bench/bench-q4_0.tw.gguf] [--tokens 4096] [--new 32]
                                     [--cap 0.25] [--quick] [--prefill-in-ram] [--conversations 4 --rounds 2]

Two processes, each in the cap, each starting with the model and the snapshot out of the page cache:
* re-prefill: the conversation's `--tokens`, then its `--new` tokens (the next user turn) — computed in two passes
  as the server's prompt cache would have — timed from the first token to the last one's logits; it then writes
  the snapshot of the first `--tokens` (not timed) beside the model;
* restore: reads and checks the snapshot, puts it into its sequence, computes the `--new` tokens: timed the same
  way (the session's loading is outside both times). The snapshot is read through the session's streaming core
  (snapshot.core_reads: direct reads behind the expert reads), as the server reads it. The device's read bytes
  during the restore are taken from /proc/diskstats (every process's: a shared machine's other readers count too).

`--synthetic`: the context is not computed (its snapshot holds zeros in K and V: a 16k re-prefill takes about an
hour on this shared machine), so there is no re-prefill time and no logits to compare; the restore and the next
turn's pass over that context are timed as usual.
`--prefill-in-ram`: the re-prefill runs without the cap (where the capped one would take too long on this machine:
its time is then a lower bound on the capped one's). `--conversations K`: K conversations of `--tokens` each, and
the restore process switches one slot between them (`--rounds` times through all), each switch a restore and the
conversation's `--new` tokens: the device's bytes per switch against the snapshot's bytes (issue 44's second bar).
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
import json, os, sys, time
import numpy as np
sys.path.insert(0, sys.argv[6])
from limits import DiskWatch
from tokenwing.runtime import snapshot
from tokenwing.runtime.session import Session, SessionOptions
model, n, m, mode, snap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
k, rounds, synthetic = int(sys.argv[7]), int(sys.argv[8]), sys.argv[9] == "1"
# preload off: a process in RAM computes its experts with the kernels a capped one does (every expert read at start
# is repacked for the CPU, another kernel: not bit-identical to the streamed ones)
opts = SessionOptions(n_ctx=n + m + 16, kv_type="f16", usage_table=False, preload=False)
s = Session(model, opts, log=lambda l: None)
convs = [np.random.default_rng(c).integers(0, s.hp.vocab_size - 16, n + m).tolist() for c in range(k)]
toks = convs[0]
tags = snapshot.make_tags(model, s.chat_template, s.seqs[0], "f16")
reads = snapshot.core_reads(s.scheduler.streamer.core)
out = {"mode": mode, "tokens": n, "new": m}
if mode == "prefill" and k > 1:  # the conversations' snapshots (not timed)
    sizes = []
    for c, conv in enumerate(convs):
        s.reset()
        s.forward(conv[:n], prompt=True)
        logits = s.forward(conv[n:], all_logits=True, prompt=True)
        np.save(f"{snap}.{c}.prefill.npy", logits)
        s.reuse_prefix(conv[: n + 1])
        sizes.append(snapshot.write(f"{snap}.{c}", tags, snapshot.capture(s.seqs[0], 2)))
    out["snapshot_bytes"] = sizes
elif mode == "switch":
    switches = []
    for r in range(rounds):
        for c, conv in enumerate(convs):
            watch = DiskWatch(f"{snap}.{c}").start()
            t0 = time.perf_counter()
            s.scheduler.lend(snapshot.IN_FLIGHT * snapshot.PIECE)  # (as above)
            snapshot.restore(f"{snap}.{c}", tags, s.seqs[0], 2, reads)
            t1 = time.perf_counter()
            dev = watch.stop()
            assert s.reuse_prefix(conv) == n
            logits = s.forward(conv[n:], all_logits=True, prompt=True)
            t2 = time.perf_counter()
            same = bool(np.array_equal(np.load(f"{snap}.{c}.prefill.npy"), logits))
            switches.append({"conversation": c, "restore_s": t1 - t0, "turn_s": t2 - t1,
                             "device_bytes": dev["bytes"] if dev else None, "bit_identical": same})
    out["switches"] = switches
elif mode == "prefill" and synthetic:  # (not computed: zeros in K and V; only the bytes and the timing count)
    seq = s.seqs[0]
    seq.history, seq.pos = toks[:n], n
    t2 = time.perf_counter()
    out["snapshot_bytes"] = snapshot.write(snap, tags, snapshot.capture(seq, 2))
    out.update(write_s=time.perf_counter() - t2, first_token_s=None)
    logits = np.zeros(1)
elif mode == "prefill":
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
    # the read's pieces lent by the expert cache, as a prompt's working memory is (the server does not yet)
    s.scheduler.lend(snapshot.IN_FLIGHT * snapshot.PIECE)
    snapshot.restore(snap, tags, s.seqs[0], 2, reads)  # (read, checked and placed as the pieces land)
    t1 = time.perf_counter()
    dev = watch.stop()
    kept = s.reuse_prefix(toks)
    assert kept == n, kept
    t2 = time.perf_counter()
    logits = s.forward(toks[n:], all_logits=True, prompt=True)
    out.update(first_token_s=time.perf_counter() - t0, read_s=t1 - t0, place_s=t2 - t1,
               device_bytes=dev["bytes"] if dev else None)
if k == 1:
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
    ap.add_argument("--prefill-in-ram", action="store_true", help="the re-prefill without the cap")
    ap.add_argument("--synthetic", action="store_true", help="the context not computed (see the docstring)")
    ap.add_argument("--conversations", type=int, default=1, help="switch one slot between this many")
    ap.add_argument("--rounds", type=int, default=2, help="times through every conversation (--conversations)")
    args = ap.parse_args()
    if args.conversations > 1:
        return switching(args)
    import numpy as np  # (after the flags: --help stays instant)

    cap = int(os.path.getsize(args.model) * args.cap) or None
    ceiling = probe_drive(args.model, budget=(256 if args.quick else 1024) << 20, quick=args.quick)
    folder = tempfile.mkdtemp(prefix=".restore-bench-", dir=os.path.dirname(os.path.abspath(args.model)))
    snap = os.path.join(folder, "conversation.twsnap")
    results = {}
    try:
        for mode in ("prefill", "restore"):
            got = _child(args, mode, snap, None if mode == "prefill" and args.prefill_in_ram else cap)
            if got is None:
                return 1
            results[mode] = got
        same = not args.synthetic and bool(
            np.array_equal(np.load(snap + ".prefill.npy"), np.load(snap + ".restore.npy"))
        )
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    pre, res = results["prefill"], results["restore"]
    nbytes = pre["snapshot_bytes"]
    drive_s = nbytes / (ceiling.mb_per_s * 1e6)
    print(json.dumps({"prefill": pre, "restore": res, "drive_mb_per_s": ceiling.mb_per_s, "bit_identical": same}))
    cap_text = f"under the {args.cap:.0%} cap" if cap else "in RAM"
    if args.prefill_in_ram:
        cap_text += " (the re-prefill in RAM)"
    device = f"{res['device_bytes'] / 1e6:.1f} MB" if res.get("device_bytes") is not None else "n/a"
    if args.synthetic:
        cap_text += " (synthetic context: no re-prefill)"
        versus = "not measured"
    else:
        versus = (
            f"{pre['first_token_s']:.2f} s, after restore {res['first_token_s']:.3f} s = "
            f"{pre['first_token_s'] / res['first_token_s']:.0f}x faster (logits bit-identical: {same})"
        )
    print(
        f"{args.tokens} + {args.new} tokens {cap_text}: first new token after re-prefill {versus}; after restore "
        f"{res['first_token_s']:.3f} s\n"
        f"snapshot {nbytes / 1e6:.1f} MB (written in {pre['write_s']:.2f} s); read and checked in "
        f"{res['read_s']:.3f} s (placed as it lands; then {res['place_s']:.3f} s to resume); "
        f"bytes ÷ drive rate ({ceiling.mb_per_s:.0f} MB/s, "
        f"{ceiling.best}) = {drive_s:.3f} s: the read is {res['read_s'] / drive_s:.1f}x that; device read {device} "
        f"during it"
    )
    return 0


def _child(args: argparse.Namespace, mode: str, snap: str, cap: int | None) -> dict | None:
    """Runs one process of the bench (the model and the snapshots evicted from the page cache first)."""
    evict_from_page_cache(args.model)
    folder = os.path.dirname(snap)
    for name in os.listdir(folder):
        evict_from_page_cache(os.path.join(folder, name))
    cmd = [sys.executable, "-c", CHILD, args.model, str(args.tokens), str(args.new), mode, snap]
    cmd += [os.path.dirname(os.path.abspath(__file__)), str(args.conversations), str(args.rounds)]
    cmd += ["1" if args.synthetic else "0"]
    r = run_capped(cmd, cap, 7200)
    if r.returncode:
        print(f"{mode}: exit {r.returncode}, {r.oom_kills} OOM kills\n{r.stderr[-2000:]}", file=sys.stderr)
        return None
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def switching(args: argparse.Namespace) -> int:
    """Issue 44's second bar: one slot switched between `--conversations` conversations, a restore each time."""
    cap = int(os.path.getsize(args.model) * args.cap) or None
    folder = tempfile.mkdtemp(prefix=".restore-bench-", dir=os.path.dirname(os.path.abspath(args.model)))
    snap = os.path.join(folder, "conversation.twsnap")
    try:
        made = _child(args, "prefill", snap, None)  # (the snapshots: not timed, in RAM)
        got = _child(args, "switch", snap, cap) if made is not None else None
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    if made is None or got is None:
        return 1
    sizes = made["snapshot_bytes"]
    print(json.dumps({"snapshot_bytes": sizes, "switches": got["switches"]}))
    cap_text = f"under the {args.cap:.0%} cap" if cap else "in RAM"
    for sw in got["switches"]:
        nbytes = sizes[sw["conversation"]]
        dev = sw["device_bytes"]
        ratio = f"{dev / nbytes:.3f}x its snapshot's {nbytes / 1e6:.1f} MB" if dev is not None else "n/a"
        print(
            f"switch to conversation {sw['conversation']} ({args.tokens} tokens {cap_text}): restored in "
            f"{sw['restore_s']:.3f} s, device read {ratio}; its next {args.new} tokens {sw['turn_s']:.2f} s, logits "
            f"bit-identical: {sw['bit_identical']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
