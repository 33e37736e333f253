"""Several conversations decoded together (runtime/batch.py) against the limit of the experts they share.

    python bench/batch_bench.py [--model models/bench/bench-q4_k_m.gguf] [--streams 1,2,4,8] [--caps 0.40,0.25]
                                [--prompt 16] [--decode 24] [--rounds 1] [--budget-caps] [--corpus]
                                [--llama MODEL.gguf]

N streams each have their own prompt and token stream (teacher-forced: every stream's next token is the next
of its own stream, so the routing is what those tokens give, not what greedy decoding loops into); after their
prompts, every decode step computes one token of each in one step. Per N it reports each layer's union of
experts per step against N × top-k, the expert bytes read per step, Belady's fewest bytes a token (MIN over every
stream's rows in step order, at the run's slots per layer, from what the cache held when the timing began: what
any cache of that size must read, so what decoding N together can save in reads), the bytes a step touches, and
the aggregate tokens per second.

The limit of a step (issue 26): its union of experts plus the dense weights (once where the streams are the rows
of one product — "rows" —, once per stream where this CPU's kernels would round them differently — "apart",
runtime/batch.py `rows_batch`) and every stream's KV window, at RAM bandwidth in RAM; under a cap, the union's
bytes at the drive ceiling (as if every expert of the union came from the drive), or RAM bandwidth when that
binds more; and in RAM never above the compute floor: the step's matrix products alone, timed in one graph on
the same threads (`compute_floor`: on a small model or two cores the kernels bind before memory bandwidth does).
The aggregate is N tokens per step against it. In RAM the floor also bounds what batching can gain: no step
takes less than its products, so N streams get at most N × (one stream's measured step) ÷ (their products
alone) times one stream's aggregate — with the kernels that give each sequence the bits it gets alone, whatever
rows share a product (issue 26: what an exact per-sequence result costs). Under caps the
run is a cgroup of that share of the model file (the session sizes its cache from the group's limit, as in real
use), or with --budget-caps a --ram-budget share of the experts (the demo model is too small for a cgroup cap).
--corpus: the streams are text of the repository's corpus through the model's tokenizer (the trained demo
model routes real text as it was trained to), else pseudo-random ids (the random-weight bench model).
--llama: llama.cpp's own parallel decoding of the same streams in RAM, from the GGUF the model was repacked from
(one sequence per stream, each its own KV cache, as its server's slots): how much llama.cpp itself gains from
decoding N together on this model, and TokenWing's aggregate against it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from limits import MB, memory_bandwidth, probe_drive
from memcap import evict_from_page_cache, run_capped

HERE = os.path.dirname(os.path.abspath(__file__))


# Every N's timing starts after WARM_UP decode steps of all its streams, in both engines: the first step of a batch
# builds its graphs and measures once which products may share rows (runtime/batch.py `rows_batch`), work a
# server does once per batch size, not per step (bench model, 4 streams: 24 steps took 98 ms each with it, 92
# without). The aggregate is the steady one.
WARM_UP = 1


def runner(model: str, n: int, n_prompt: int, n_decode: int, budget: str | None, corpus: bool, threads: int) -> None:
    """In the (capped) child: one session of n slots; prints one JSON line."""
    from limits import belady_rows, decode_bytes_touched

    from tokenwing.format.reader import ModelFile
    from tokenwing.fsutil import parse_size
    from tokenwing.runtime.batch import decode_step, rows_group
    from tokenwing.runtime.kvcache import kv_element
    from tokenwing.runtime.session import SESSION_COUNTERS, Session, SessionOptions

    size = None
    if budget:
        with ModelFile.open(model, announce_fallback=False) as mf:
            size = parse_size(budget, mf.index.total_bytes)
    per = n_prompt + WARM_UP + n_decode
    opts = SessionOptions(
        ram_budget=size,
        lookahead=2,
        n_ctx=per + 16,
        max_batch=64,
        usage_table=False,
        parallel=n,
        n_threads=threads,
    )
    notes: list[str] = []
    s = Session(model, opts, log=notes.append)
    streams = _streams(s, n, per, corpus)
    c = {name: i for i, name in enumerate(SESSION_COUNTERS)}
    for slot in range(n):
        s.use(slot)
        s.forward(streams[slot][:n_prompt], prompt=True)
    observe = s.scheduler.observe
    step: dict[int, list[np.ndarray]] = {}  # this step's selections: per layer, a row per sequence in slot order
    steps: list[dict[int, list[np.ndarray]]] = []

    def recording(block: int, sel: np.ndarray) -> None:
        step.setdefault(block, []).append(sel.reshape(-1))
        observe(block, sel)

    for w in range(WARM_UP):
        decode_step(s, [(slot, streams[slot][n_prompt + w]) for slot in range(n)])
    n_prompt += WARM_UP
    every = list(range(s.hp.n_expert))
    warm = [[e for e, h in zip(every, s.scheduler.holds(b, every), strict=True) if h] for b in s.streamed]
    s.scheduler.observe = recording  # type: ignore[method-assign]
    before = s.counters()
    t0 = time.perf_counter()
    for i in range(n_decode):
        step = {}
        decode_step(s, [(slot, streams[slot][n_prompt + i]) for slot in range(n)])
        steps.append(step)
    dt = time.perf_counter() - t0
    d = s.counters() - before
    group = rows_group(s, n)  # (measured already by the steps)
    last = {il: np.stack(rows) for il, rows in steps[-1].items()}
    floor = compute_floor(s, last, n, group)
    # its two parts: the dense products (shared by a group's rows) and the (sequence, expert) pairs (one per token)
    parts = {p: compute_floor(s, last, n, group, part=p) for p in ("dense", "experts")}
    records = [el.record_size for el in s.scheduler.streamer.layers]
    union = np.asarray([[len(set(np.concatenate(st[b]).tolist())) for b in s.streamed] for st in steps], np.float64)
    union_bytes = float((union * np.asarray(records)).sum(axis=1).mean())
    # The fewest reads any cache of these slots could make: Belady's MIN over every sequence's rows, step by step
    sel = np.stack([np.stack([st[b][q] for b in s.streamed]) for st in steps for q in range(n)])
    held = np.full((len(warm), s.slots_per_layer), -1, np.int32)
    for li, kept in enumerate(warm):
        held[li, : min(len(kept), s.slots_per_layer)] = kept[: s.slots_per_layer]
    fewest = belady_rows(sel, s.hp.n_expert, s.slots_per_layer, records, held)
    kv_pos = s.model.kv_bytes_per_token(s.hp, kv_element(opts.kv_type)[1])
    windows = [min(s.n_ctx, -(-(n_prompt + i + 1) // 256) * 256) for i in range(n_decode)]
    touched = decode_bytes_touched(model, windows, kv_pos)
    print(
        json.dumps(
            {
                "streams": n,
                "notes": notes,
                "slots_per_layer": s.slots_per_layer,
                "k": s.hp.n_expert_used,
                "union_per_layer": float(union.mean()),
                "union_bytes_per_step": union_bytes,
                "read_bytes_per_step": float(d[:, c["bytes_read"]].sum()) / n_decode,
                "belady_bytes_per_token": fewest["bytes_per_token"],
                # the dense weights once a step where the sequences are the rows of one product, else once each
                "rows": group if group > 1 else False,
                "touched_bytes_per_step": union_bytes + -(-n // group) * touched["dense"] + n * touched["kv"],
                "compute_floor_s": floor,
                "floor_dense_s": parts["dense"],
                "floor_experts_s": parts["experts"],
                "aggregate_tok_s": n * n_decode / dt,
                "step_ms": dt * 1e3 / n_decode,
                "hit_rate": float(d[:, c["hits"]].sum() / max(d[:, c["hits"]].sum() + d[:, c["misses"]].sum(), 1)),
            }
        ),
        flush=True,
    )
    s.close()


def compute_floor(
    s: object, sel: dict[int, np.ndarray], n: int, group: int, reps: int = 7, part: str = "all"
) -> float | None:
    """Seconds of a step's matrix products alone — every resident matrix times the step's rows (once per group
    of rows, or once per sequence where its rows go apart), and each layer's experts for the step's (sequence,
    expert) pairs through the same kernels as the step — in one graph, best of `reps` runs: the compute floor
    of this CPU and thread count, which binds before memory bandwidth does on a small model or few cores. None
    when the experts are not all resident (the slot pool then holds only some). `part`: "dense" or "experts"
    for one half alone."""
    from tokenwing.compute.ggml_lib import ops
    from tokenwing.runtime.rows import groups_of
    from tokenwing.runtime.session import Session

    assert isinstance(s, Session)
    slot_map = s.scheduler.slot_map
    if slot_map is None or s.kv.states is not None:
        return None
    g, rng = s.graph, np.random.default_rng(0)
    ctx = g.reset()
    sizes = [len(x) for x in groups_of(list(range(n)), group)]
    outs = []
    for name, t in s.model.weights.tensors.items() if part != "experts" else ():
        ne = [int(t.contents.ne[i]) for i in range(4)]
        if name == "token_embd.weight" or ne[1] == 1 or ne[2] > 1 or ne[3] > 1:
            continue  # the embedding is rows looked up; vectors are elementwise; 3-D matrices are per head
        for rows in sizes:
            outs.append(ops.ggml_mul_mat(ctx, t, g.input(rng.standard_normal((rows, ne[0])).astype(np.float32))))
    k = s.hp.n_expert_used
    for il, chosen in sel.items() if part != "dense" else ():
        ids = chosen.reshape(n, k).astype(np.int32)
        width = int(s.model.weights.tensors["token_embd.weight"].contents.ne[0])
        x = g.input(rng.standard_normal((n, width)).astype(np.float32))
        w = g.input(np.full((n, k), 1.0 / k, np.float32))
        eids = g.input(ids) if s.experts.needs_ids(il) else None
        outs.append(s.experts.tokens(ctx, il, x, g.input(slot_map[il][ids]), w, eids))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        g.compute(*outs)
        best = min(best, time.perf_counter() - t0)
    return best


def _streams(s: object, n: int, per: int, corpus: bool) -> list[list[int]]:
    from tokenwing.runtime.session import Session

    assert isinstance(s, Session)
    return _token_streams(s.tokenizer, s.hp.vocab_size, n, per, corpus)


def _token_streams(tokenizer: object, vocab: int, n: int, per: int, corpus: bool) -> list[list[int]]:
    """n streams of `per` tokens: corpus text through the model's tokenizer, or pseudo-random ids."""
    from tokenwing.text.tokenizer import TextTokenizer

    assert isinstance(tokenizer, TextTokenizer)
    if corpus:
        from tokenwing.testmodel.corpus import CORPUS

        ids = tokenizer.encode(CORPUS * (1 + n * per // 2000), special=False)
        step = max(1, (len(ids) - per) // max(n, 1))
        return [ids[i * step : i * step + per] for i in range(n)]
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab - 16, per).tolist() for _ in range(n)]


def llama_runner(gguf: str, tw: str, n: int, n_prompt: int, n_decode: int, corpus: bool, threads: int) -> None:
    """In the child: llama.cpp's own parallel decoding of the same n streams (llama-cpp-python's low-level API:
    one sequence per stream in a context of n sequences, each with its own KV cache as llama.cpp's server's
    slots, llama.cpp's default context settings otherwise); each step is one batch of every stream's token.
    Prints one JSON line."""
    import llama_cpp as lc

    from tokenwing.text.tokenizer import tokenizer_from_file

    per = n_prompt + WARM_UP + n_decode
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(gguf.encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx = (per + 16) * n
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = n
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = False
    ctx = lc.llama_init_from_model(model, params)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    streams = _token_streams(tokenizer_from_file(tw), vocab, n, per, corpus)
    batch = lc.llama_batch_init(512, 0, n)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    for seq in range(n):
        decode([(streams[seq][p], p, seq, p == n_prompt - 1) for p in range(n_prompt)])
    for p in range(n_prompt, n_prompt + WARM_UP):
        decode([(streams[seq][p], p, seq, True) for seq in range(n)])
    n_prompt += WARM_UP
    t0 = time.perf_counter()
    for i in range(n_decode):
        p = n_prompt + i
        decode([(streams[seq][p], p, seq, True) for seq in range(n)])
    dt = time.perf_counter() - t0
    print(json.dumps({"streams": n, "aggregate_tok_s": n * n_decode / dt}), flush=True)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--llama-runner":
        gguf, tw, count, n_prompt, n_decode, corpus, threads = sys.argv[2:9]
        llama_runner(gguf, tw, int(count), int(n_prompt), int(n_decode), corpus == "1", int(threads))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--runner":
        path, count, n_prompt, n_decode, budget, corpus, threads = sys.argv[2:9]
        runner(path, int(count), int(n_prompt), int(n_decode), budget or None, corpus == "1", int(threads))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench/bench-q4_k_m.gguf")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--caps", default="0.40,0.25", help="memory caps as shares of the model file ('' for none)")
    ap.add_argument("--budget-caps", action="store_true", help="a --ram-budget share of the experts, no cgroup")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=1, help="runs per row (the median's shown, every run's listed)")
    ap.add_argument("--corpus", action="store_true", help="streams of corpus text (the trained demo model)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--threads", type=int, default=2, help="compute threads (RAM bandwidth measured with as many)")
    ap.add_argument(
        "--llama",
        metavar="GGUF",
        default=None,
        help="llama.cpp's parallel decoding of the same streams in RAM from this GGUF (the model's source), beside",
    )
    args = ap.parse_args()
    model = args.model if args.model.endswith(".tw.gguf") else args.model.removesuffix(".gguf") + ".tw.gguf"
    streams = [int(x) for x in args.streams.split(",") if x]
    caps = [float(x) for x in args.caps.split(",") if x]
    size = os.path.getsize(model)
    ceiling = probe_drive(model, budget=256 << 20, quick=True).mb_per_s
    ram_bw = memory_bandwidth(args.threads)
    print(f"model {model}: {size / 1e9:.2f} GB; {args.prompt} prompt + {args.decode} decode tokens per stream")
    print(
        f"drive ceiling {ceiling:.0f} MB/s (quick probe); "
        f"RAM read bandwidth {ram_bw / 1e9:.1f} GB/s ({args.threads} threads)\n"
    )
    print(
        "| memory | streams | union per layer (N × k) | expert MB read per step | Belady MB a token "
        "| MB touched per step | products | aggregate tok/s | limit tok/s (what binds) | of the limit | × one stream "
        "| runs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    in_ram: dict[int, float] = {}  # TokenWing's aggregate in RAM per stream count (beside llama.cpp's)
    floors: list[str] = []  # in RAM: the compute floor's parts (the median run's)
    for frac in [None, *caps]:
        one = None
        for n in streams:
            budget, label = "", "in RAM"
            cap: int | None = None
            if frac is not None and args.budget_caps:
                budget, label = f"{frac:.0%}", f"budget {frac:.0%} of the experts"
            elif frac is not None:
                cap, label = int(size * frac), f"cap {frac:.0%}"
            runs = []
            for _ in range(args.rounds):
                evict_from_page_cache(model)
                cmd = [sys.executable, __file__, "--runner", model, str(n), str(args.prompt), str(args.decode)]
                r = run_capped([*cmd, budget, "1" if args.corpus else "0", str(args.threads)], cap, args.timeout)
                if r.returncode != 0:
                    print(f"| {label} | {n} | failed: exit {r.returncode} {r.stderr.strip()[-160:]} |")
                    break
                runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            if not runs:
                continue
            runs.sort(key=lambda x: x["aggregate_tok_s"])
            m = runs[len(runs) // 2]
            ram_s = m["touched_bytes_per_step"] / ram_bw
            drive_s = m["union_bytes_per_step"] / (ceiling * MB) if frac is not None else 0.0
            limit = n / max(ram_s, drive_s, m.get("compute_floor_s") or 0.0)
            binds = max(
                ("RAM", ram_s), ("drive", drive_s), ("compute", m.get("compute_floor_s") or 0.0), key=lambda b: b[1]
            )[0]
            one = one if one is not None else (m["aggregate_tok_s"] if n == 1 else None)
            if frac is None:
                in_ram[n] = m["aggregate_tok_s"]
                if m.get("compute_floor_s"):
                    # The most N streams can gain over the one stream measured, with these (exact) kernels: a
                    # step never takes less than its products alone
                    most = f"{n / (m['compute_floor_s'] * in_ram[1]):.2f}×" if 1 in in_ram else "—"
                    floors.append(
                        f"| {n} | {n / m['aggregate_tok_s'] * 1e3:.3f} | {m['compute_floor_s'] * 1e3:.3f} | "
                        f"{m['floor_dense_s'] * 1e3:.3f} | {m['floor_experts_s'] * 1e3:.3f} | {most} |"
                    )
            times = f"{m['aggregate_tok_s'] / one:.2f}×" if one else "—"
            products = f"rows of {m['rows']}" if m["rows"] else "apart" if n > 1 else "—"
            every = ", ".join(f"{x['aggregate_tok_s']:.2f}" for x in runs)
            print(
                f"| {label} | {n} | {m['union_per_layer']:.1f} ({n * m['k']}) | "
                f"{m['read_bytes_per_step'] / MB:.1f} | {m['belady_bytes_per_token'] / MB:.2f} | "
                f"{m['touched_bytes_per_step'] / MB:.1f} | "
                f"{products} | "
                f"{m['aggregate_tok_s']:.2f} | {limit:.2f} ({binds}) | {m['aggregate_tok_s'] / limit:.0%} | {times} | "
                f"{every} |",
                flush=True,
            )
    if floors:
        print(
            "\nIn RAM, a step against its compute floor (its matrix products alone, best of 7; ms); the most N "
            "streams could gain over the one stream measured, were their step its products alone:\n"
        )
        print("| streams | step | products | dense products | expert products | most × one stream |")
        print("|---|---|---|---|---|---|")
        print("\n".join(floors))
    if args.llama:
        _llama_rows(args, model, streams, in_ram)
    return 0


def _llama_rows(args: argparse.Namespace, model: str, streams: list[int], in_ram: dict[int, float]) -> None:
    """llama.cpp's parallel decoding of the same streams in RAM, the same threads, medians of the same rounds."""
    print("\nllama.cpp, the same streams in RAM (its parallel sequences, default settings):\n")
    print("| streams | llama.cpp aggregate tok/s | × its one stream | TokenWing / llama.cpp | runs |")
    print("|---|---|---|---|---|")
    one = None
    for n in streams:
        runs = []
        for _ in range(args.rounds):
            cmd = [sys.executable, __file__, "--llama-runner", args.llama, model, str(n), str(args.prompt)]
            r = run_capped([*cmd, str(args.decode), "1" if args.corpus else "0", str(args.threads)], None, args.timeout)
            if r.returncode != 0:
                print(f"| {n} | failed: exit {r.returncode} {r.stderr.strip()[-160:]} |")
                break
            runs.append(json.loads(r.stdout.strip().splitlines()[-1])["aggregate_tok_s"])
        if not runs:
            continue
        runs.sort()
        m = runs[len(runs) // 2]
        one = one if one is not None else (m if n == 1 else None)
        times = f"{m / one:.2f}×" if one else "—"
        ours = f"{in_ram[n] / m:.2f}×" if n in in_ram else "—"
        every = ", ".join(f"{x:.2f}" for x in runs)
        print(f"| {n} | {m:.2f} | {times} | {ours} | {every} |", flush=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        raise SystemExit(main())
