"""At the scale the product is for (issue 16 §4): a model twice this machine's RAM, no memory cap at all.

    python bench/scale_bench.py [--dir models/scale] [--layers 8] [--n-embd 7168] [--n-head 128] [--n-ff-exp 2048]
                                [--n-ff-dense 18432] [--n-expert 256] [--k 8] [--shards 8] [--prompt 16]
                                [--decode 32] [--rounds 3] [--dry-run]

1. Generates a DeepSeek-V3-shaped GGUF (deepseek2: hidden 7168, MLA with 128 heads and ranks 1536/512, 256 experts
   of 2048 per layer in 8 groups using 4, top-8, a shared expert, one leading dense layer; 24.8 MB per expert in
   Q4_0, the bytes per weight of Q4_K) straight into quantized form — random Q4_0 blocks with sane scales, written
   tensor by tensor (no F16 copy, memory flat) — split into shards: 8 MoE layers ≈ 53 GB.
2. Repacks it with `tokenwing repack --delete-source` (each shard deleted once its contents are written and
   verified), so source and output never both exist whole: peak disk = the output + one shard.
3. TokenWing decodes a fixed token stream (lookahead 2 and 0, rounds interleaved), no cap: its RAM budget from
   free memory. Beside each result: the drive ceiling, Belady's bytes on the run's own trace, the RAM-bandwidth
   limit of the bytes a token touches (no compute floor: the model cannot be in RAM), the limit they make.
4. Deletes the TokenWing file, regenerates the same GGUF (same seed: the same weights) and runs llama.cpp on the
   same tokens (plain mmap, and mmap + MADV_RANDOM; its default repacks into anonymous memory: no room).
5. Deletes everything it made, also when interrupted.

Before anything it checks the disk: the largest moment (TokenWing file + one shard) must fit with a margin in
what `--dir`'s file system has free, else it says so and stops. `--dry-run` runs every step at a small size
(2 MoE layers of 16 experts of 7168 × 512, the dense layer 7168 × 512): what a change to this script should be
checked with.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from limits import MB, belady, capped_limit, memory_bandwidth, probe_drive
from memcap import evict_from_page_cache, run_capped

from tokenwing.format.gguf_io import tensor_nbytes
from tokenwing.streaming.memory import memory_info
from tokenwing.streaming.trace import load_trace
from tokenwing.testmodel.architectures import architecture
from tokenwing.testmodel.shapes import ModelShape, preset_shape
from tokenwing.testmodel.weights import DIRECT_TYPES, tensor_type

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9


def shape_of(args: argparse.Namespace) -> ModelShape:
    """DeepSeek-V3's layer (the family runs now): its MLA ranks and heads, 256 routed experts of 2048 in 8 groups
    of which 4 are used, top-8, one shared expert of 2048; one leading dense layer of 18,432 (V3 has 3 in 61)."""
    return preset_shape("ds-bench").with_(**overrides(args))


def overrides(args: argparse.Namespace) -> dict[str, int]:
    """The scale model's fields that differ from the `ds-bench` preset (the same flags `tokenwing testmodel` takes)."""
    return {
        "n_layer": args.layers + 1,
        "n_dense_lead": 1,
        "n_embd": args.n_embd,
        "n_head": args.n_head,
        "n_expert": args.n_expert,
        "n_expert_used": args.k,
        "n_ff_exp": args.n_ff_exp,
        "n_ff_shexp": args.n_ff_exp,
        "n_ff_dense": args.n_ff_dense,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "vocab_size": 32000,
    }


def planned_bytes(shape: ModelShape) -> tuple[int, int]:
    """(the GGUF's tensor bytes, its largest layer's bytes) in Q4_0."""
    q = DIRECT_TYPES["Q4_0"]
    sizes: dict[str, int] = {}
    for spec in architecture(shape.arch).tensors(shape):
        layer = spec.name.split(".")[1] if spec.name.startswith("blk.") else "rest"
        sizes[layer] = sizes.get(layer, 0) + tensor_nbytes(spec.shape, int(tensor_type(spec, q, None)))
    return sum(sizes.values()), max(sizes.values())


def testmodel(out: str, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "tokenwing", "testmodel", out, "-q", "--preset", "ds-bench", "--type", "Q4_0"]
    cmd += ["--shards", str(args.shards), "--seed", "7"]
    for name, value in overrides(args).items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    stem = out.removesuffix(".gguf")
    return [out] if args.shards == 1 else [f"{stem}-{i + 1:05d}-of-{args.shards:05d}.gguf" for i in range(args.shards)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="models/scale")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=7168)
    ap.add_argument("--n-head", type=int, default=128)
    ap.add_argument("--n-ff-dense", type=int, default=18432)
    ap.add_argument("--n-ff-exp", type=int, default=2048)
    ap.add_argument("--n-expert", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--dry-run", action="store_true", help="every step at a small size (a check of this script)")
    args = ap.parse_args()
    if args.dry_run:
        args.layers, args.n_expert, args.n_ff_exp, args.shards, args.decode, args.rounds = 2, 16, 512, 2, 4, 1
        args.n_ff_dense = 512
    shape = shape_of(args)
    total, largest = planned_bytes(shape)
    ram = memory_info().total
    os.makedirs(args.dir, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    need = total + total // max(args.shards, 1) + largest + (4 << 30)  # output + a shard + the one being written
    print(
        f"model: {args.layers} layers × {args.n_expert} experts of {args.n_embd}×{args.n_ff_exp} (top-{args.k}), Q4_0: "
        f"{total / GB:.1f} GB = {total / ram:.2f}× this machine's RAM ({ram / GB:.1f} GB); disk free {free / GB:.1f} GB"
    )
    if need > free:
        print(f"not enough disk: the largest moment needs {need / GB:.1f} GB with a margin; free some space first")
        return 1
    work = tempfile.mkdtemp(prefix="scale-", dir=args.dir)
    made: list[str] = []
    try:
        return run(args, work, made)
    finally:
        for path in made:
            if os.path.exists(path):
                os.remove(path)
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: str, made: list[str]) -> int:
    gguf = os.path.join(work, "scale.gguf")
    tw = os.path.join(work, "scale.tw.gguf")
    t0 = time.monotonic()
    shards = testmodel(gguf, args)
    made += shards
    gen_s = time.monotonic() - t0
    t0 = time.monotonic()
    low = shutil.disk_usage(work).free
    repack = subprocess.Popen(
        [sys.executable, "-m", "tokenwing", "repack", shards[0], "-o", tw, "--delete-source"], stdout=subprocess.DEVNULL
    )
    made.append(tw)
    while repack.poll() is None:  # the least free disk while it runs: output + shards still there
        low = min(low, shutil.disk_usage(work).free)
        time.sleep(0.5)
    if repack.returncode:
        print(f"repack failed (exit {repack.returncode})")
        return 1
    repack_s = time.monotonic() - t0
    size = os.path.getsize(tw)
    print(
        f"generated {len(shards)} shards in {gen_s:.0f} s ({size / gen_s / MB:.0f} MB/s); repacked with "
        f"--delete-source in {repack_s:.0f} s; shards left: {sum(os.path.exists(p) for p in shards)}; least disk "
        f"free during the repack {low / GB:.1f} GB"
    )
    vocab = 32000
    tokens = np.random.default_rng(0).integers(0, vocab - 16, args.prompt + args.decode)
    tok_path = os.path.join(work, "tokens.npy")
    np.save(tok_path, tokens)
    ceiling = probe_drive(tw, budget=(256 if args.dry_run else 2048) << 20, quick=args.dry_run)
    ram_bw = memory_bandwidth(2)
    runs: dict[str, list[dict[str, object]]] = {"tw-2": [], "tw-0": []}
    for rnd in range(args.rounds):
        for la in (2, 0):
            trace = os.path.join(work, f"trace-{la}-{rnd}.npz")
            cmd = [sys.executable, os.path.join(HERE, "tokenwing_runner.py"), tw, tok_path, str(args.prompt), str(la)]
            evict_from_page_cache(tw)
            r = run_capped([*cmd, f"trace={trace}"], None, args.timeout)
            if r.returncode:
                print(f"TokenWing lookahead {la} failed: {r.stderr.strip()[-300:]}")
                continue
            out: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
            b = belady(
                load_trace(trace), int(out["slots_per_layer"]), list(out["record_sizes"]), np.load(trace + ".warm.npy")
            )  # type: ignore[call-overload,arg-type]
            out["belady_bytes_per_token"] = b["bytes_per_token"]
            ceiling.add("TokenWing's own reads (decode average)", float(out["expert_mb_per_s"]))  # type: ignore[arg-type]
            runs[f"tw-{la}"].append(out)
    os.remove(tw)  # room for the GGUF again
    t0 = time.monotonic()
    shards = testmodel(gguf, args)
    made += shards
    regen_s = time.monotonic() - t0
    for _ in range(args.rounds):
        for mode in ("plain", "random"):
            for p in shards:
                evict_from_page_cache(p)
            cmd = [sys.executable, os.path.join(HERE, "llama_runner.py"), shards[0], tok_path, str(args.prompt), mode]
            r = run_capped(cmd, None, args.timeout)
            key = f"llama-{mode}"
            if r.returncode:
                print(f"llama.cpp {mode} failed: {r.stderr.strip()[-300:]}")
                continue
            runs.setdefault(key, []).append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"(GGUF regenerated for llama.cpp in {regen_s:.0f} s)\n")
    print(f"drive ceiling {ceiling.mb_per_s:.0f} MB/s ({ceiling.best}); RAM read bandwidth {ram_bw / GB:.1f} GB/s\n")
    print(
        "| engine | decode tok/s | limit tok/s | of the limit | read per token | Belady per token | SSD wait per token "
        "| hit rate | decode tok/s of each run |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    labels = {
        "tw-2": "TokenWing lookahead 2",
        "tw-0": "TokenWing lookahead 0",
        "llama-plain": "llama.cpp plain mmap",
        "llama-random": "llama.cpp mmap + MADV_RANDOM",
    }
    for key, label in labels.items():
        rs = runs.get(key) or []
        if not rs:
            print(f"| {label} | — | | | | | | | |")
            continue
        speeds = [float(r["decode_tok_s"]) for r in rs]  # type: ignore[arg-type]
        med = sorted(rs, key=lambda r: float(r["decode_tok_s"]))[(len(rs) - 1) // 2]  # type: ignore[arg-type]
        lim = share = bel = wait = hit = "—"
        if key.startswith("tw"):
            touched = float(med["touched_bytes_per_token"])  # type: ignore[arg-type]
            bel_b = float(med["belady_bytes_per_token"])  # type: ignore[arg-type]
            limit = capped_limit(ceiling.mb_per_s, bel_b, touched / ram_bw)["limit_tok_s"]
            lim, share = f"{limit:.2f}", f"{float(med['decode_tok_s']) / limit:.0%}"  # type: ignore[arg-type]
            bel, wait = f"{bel_b / MB:.0f} MB", f"{float(med['ssd_wait_ms_per_token']):.0f} ms"  # type: ignore[arg-type]
            hit = f"{float(med['hit_rate']):.0%}"  # type: ignore[arg-type]
        print(
            f"| {label} | {statistics.median(speeds):.3f} | {lim} | {share} | "
            f"{float(med['read_bytes_per_token']) / MB:.0f} MB | {bel} | {wait} | {hit} | "  # type: ignore[arg-type]
            + " / ".join(f"{x:.3f}" for x in speeds)
            + " |"
        )
    print("\nraw results:", json.dumps(runs, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
