"""Does the engine read what the simulator says? Bytes read per token under a RAM cap, engine against simulator.

    python bench/eviction_engine.py MODEL.tw.gguf [--tokens 120] [--ram-budget 25%] [--policies history,learned]
        [--lookaheads 0,2]

For each policy and lookahead: a fresh session (idle fill and the usage table off, so the cache starts empty and
only the policy fills it) decodes the same token ids one step at a time, recording its routing; then the recorded
trace is replayed in the simulator with the same slots, policy and prefetching (the engine's default 2 votes), and
Belady's fewest reads on the same trace. Prints the engine's bytes read per token (its counters), the simulator's
(reads × each layer's record size) and Belady's. Deterministic bytes: the machine's load does not change them,
except where a prefetch lands after its layer began (lookahead > 0: a late prefetch is a demand read in both).
"""

from __future__ import annotations

import argparse

import numpy as np

from tokenwing import _core
from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import parse_size
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.streaming.eviction_model import load_model
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS


def run(model: str, ids: list[int], budget: int, policy: str, lookahead: int) -> dict[str, float]:
    settings = StreamSettings(policy=policy, idle_fill_ms=-1)
    opts = SessionOptions(ram_budget=budget, lookahead=lookahead, n_ctx=512, usage_table=False, stream=settings)
    s = Session(model, opts, log=lambda line: None)
    try:
        s.trace = []
        for t in ids:
            s.forward([t])
        counters = s.counters()
        trace = s.recorded_trace()
        slots = s.slots_per_layer
        sizes = np.array([el.record_size for el in s.scheduler.streamer.layers], np.float64)
    finally:
        s.close()
    engine = float(counters[:, COUNTERS.index("bytes_read")].sum()) / len(ids)
    pred = trace.predicted if lookahead else trace.predicted[:, :, :0]
    weights = load_model().core_weights() if policy == "learned" else []

    def replay(p: str, prefetch: bool) -> float:
        table = _core.simulate(
            trace.selected, np.ascontiguousarray(pred if prefetch else pred[:, :, :0]), trace.prompt_tokens,
            trace.n_expert, slots, p, prefetch, 0 if p == "belady" else settings.core_config().decay_tokens,
            None, settings.prefetch_votes, weights,
        )  # fmt: skip
        reads = table[:, 2] + table[:, 3]  # demand + prefetch reads per layer
        return float((reads * sizes).sum()) / len(ids)

    sim = replay(policy, lookahead > 0)
    best = replay("belady", False)
    return {"engine": engine, "sim": sim, "belady": best, "slots": slots}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=120)
    p.add_argument("--ram-budget", default="25%")
    p.add_argument("--policies", default="history,learned")
    p.add_argument("--lookaheads", default="0,2")
    args = p.parse_args()
    with ModelFile.open(args.model, announce_fallback=False) as mf:
        budget = parse_size(args.ram_budget, mf.index.total_bytes)
    ids = np.random.default_rng(0).integers(10, 1000, args.tokens).tolist()  # (every factory vocabulary has these)
    print(
        "| policy | lookahead | slots | engine MB/token | simulator MB/token | engine / simulator | engine / Belady |"
    )
    print("|---|---|---|---|---|---|---|")
    for la in (int(x) for x in args.lookaheads.split(",")):
        for pol in args.policies.split(","):
            r = run(args.model, ids, budget, pol, la)
            print(
                f"| {pol} | {la} | {r['slots']} | {r['engine'] / 1e6:.2f} | {r['sim'] / 1e6:.2f} | "
                f"{r['engine'] / r['sim']:.3f} | {r['engine'] / r['belady']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
