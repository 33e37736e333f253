"""`tokenwing trace simulate` and `trace synth`: routing traces."""

from __future__ import annotations

import argparse
import json


def _cmd_trace_simulate(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.streaming.eviction_model import load_model
    from tokenwing.streaming.trace import POLICIES, load_trace, parse_slots, prediction_recall, simulate

    trace = load_trace(args.trace)
    slots = parse_slots(args.slots, trace.n_expert)
    policies = POLICIES if args.policy == "all" else (args.policy,)
    learned = load_model(args.model).core_weights() if "learned" in policies else None
    results = [
        simulate(
            trace, slots, p, args.prefetch and p != "belady", args.decay_tokens, args.prefetch_votes, None, learned
        )
        for p in policies
    ]
    recall = prediction_recall(trace)
    if args.json:
        print(json.dumps({"results": results, "prediction_recall": recall}, indent=2))
        return 0
    print(
        f"{args.trace}: {trace.n_tokens} tokens, {trace.selected.shape[1]} layers, {trace.n_expert} experts, "
        f"top-{trace.k}; {slots} slots per layer ({slots / trace.n_expert:.0%})"
    )
    if recall:
        print("prediction recall: " + ", ".join(f"{r:.1%} at {d + 1}" for d, r in enumerate(recall)))
    best = next((r["misses"] for r in results if r["policy"] == "belady"), None)
    for r in results:
        ratio = f"  {r['misses'] / best:.2f}x Belady" if best else ""
        extra = ""
        if r["prefetch"]:  # every read costs drive time: Belady's misses are also the fewest reads possible
            reads = f" ({r['reads'] / best:.2f}x Belady)" if best else ""
            extra = f"; reads {r['reads']}{reads}: prefetches {r['prefetch_reads']}, wasted {r['prefetch_wasted']}"
        print(f"  {r['policy']:<7} misses {r['misses']:>8}  miss rate {r['miss_rate']:.3f}{ratio}{extra}")
    return 0


def _cmd_trace_train(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.streaming.learned import train
    from tokenwing.streaming.trace import parse_share

    model = train(args.traces, parse_share(args.slots))
    model.save(args.output)
    print(f"{args.output}: half-lives {list(model.half_lives)}, weights {[round(w, 4) for w in model.weights]}")
    return 0


def _cmd_trace_synth(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.streaming.trace import synthetic_trace

    t = synthetic_trace(args.tokens, args.layers, args.experts, args.k, args.zipf, args.locality, seed=args.seed)
    t.save(args.output)
    print(args.output)
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tr = sub.add_parser("trace", help="routing traces: replay through the cache policies, or synthesise one")
    trs = tr.add_subparsers(dest="trace_command", required=True)
    sim = trs.add_parser("simulate", help="misses of decay, history, learned, LRU and Belady on a routing trace")
    sim.add_argument("trace")
    sim.add_argument("--slots", required=True, help="slots per layer: a count, or a percentage of the experts")
    sim.add_argument("--policy", default="all", choices=["decay", "history", "learned", "lru", "belady", "all"])
    sim.add_argument("--model", help="the learned policy's model (from `trace train`; default: the shipped one)")
    sim.add_argument("--prefetch", action="store_true", help="load the trace's predictions ahead (instantly)")
    sim.add_argument("--decay-tokens", type=int, default=0, help="half-life in tokens (0: each policy's own)")
    sim.add_argument(
        "--prefetch-votes",
        type=int,
        default=2,
        help="with --prefetch: read a prediction once this many distances name it",
    )
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=_cmd_trace_simulate)
    trn = trs.add_parser("train", help="fit the learned eviction policy's model on recorded routing traces")
    trn.add_argument("traces", nargs="+")
    trn.add_argument("-o", "--output", required=True, help="the model file to write (JSON)")
    trn.add_argument("--slots", default="25%", help="the cache it is trained for: a percentage of a layer's experts")
    trn.set_defaults(func=_cmd_trace_train)
    syn = trs.add_parser("synth", help="write a synthetic Zipf-skewed, temporally local routing trace")
    syn.add_argument("output")
    syn.add_argument("--tokens", type=int, default=1000)
    syn.add_argument("--layers", type=int, default=12)
    syn.add_argument("--experts", type=int, default=128)
    syn.add_argument("--k", type=int, default=8)
    syn.add_argument("--zipf", type=float, default=1.0)
    syn.add_argument("--locality", type=float, default=0.3)
    syn.add_argument("--seed", type=int, default=0)
    syn.set_defaults(func=_cmd_trace_synth)
