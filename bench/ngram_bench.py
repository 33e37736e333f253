"""Qwen3.8 Flash Next's n-gram table (qwen4exp PLE): the bytes a token reads from it, from the metadata alone.

    python bench/ngram_bench.py [--preset q4x-bench] [--type Q8_0] [--text FILE] [--cache-mib 0,1,16,256]
                                [--read DIR]

For each token of a text (the factory's corpus by default, as one sequence), the rows the engine's hash
(`models/qwen4exp.NgramKeys.rows`, checked against llama.cpp in tests/oracle/test_qwen4exp.py) names, then the
4 KiB pages of the table they lie in (as direct I/O reads them), then an LRU cache of pages of each size: the
misses are what a token would read from the drive. The table's geometry is the preset's, at --type's row size;
nothing is written (the metadata is built in memory). Prints a Markdown table.

--read DIR: then read them for real, through the engine's reader (`models/qwen4exp.NgramRows`: a streaming
core of its own, O_DIRECT 4 KiB pages, a 1 MiB cache) from a file of the table's size written in DIR (random
bytes, deleted after): each token's pages one read at a time (1 I/O thread) and issued together
(`NgramRows.io_threads`), the reads and wall time a token.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenwing.models.qwen4exp import NgramKeys, ple_heads, ple_table_rows
from tokenwing.testmodel import preset_shape
from tokenwing.testmodel.corpus import CORPUS, MULTILINGUAL
from tokenwing.testmodel.writer import model_metadata
from tokenwing.text.tokenizer import tokenizer_from_metadata

PAGE = 4096


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="q4x-bench")
    ap.add_argument("--type", default="Q8_0", help="the table's type (F16, BF16, Q8_0, Q4_0)")
    ap.add_argument("--text", help="a UTF-8 text file (default: the factory's corpus)")
    ap.add_argument("--cache-mib", default="0,1,16,256")
    ap.add_argument("--read", metavar="DIR", help="also read the pages from a table-sized file written in DIR")
    args = ap.parse_args()
    shape = preset_shape(args.preset)
    if shape.arch != "qwen4exp" or shape.ple_layer < 0:
        print(f"ngram_bench: preset {args.preset!r} has no n-gram table", file=sys.stderr)
        return 2
    meta = {k: v.value for k, v in model_metadata(shape, args.type, args.preset).items()}
    keys = NgramKeys.of(meta, args.preset)
    assert keys is not None
    tok = tokenizer_from_metadata(meta, args.preset)
    text = CORPUS + MULTILINGUAL
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    tokens = tok.encode(text, special=False, add_bos=False)
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[args.type]]
    width = shape.n_embd // ple_heads(shape)
    row_bytes = width // block * block_bytes
    rows = keys.rows(tokens, [])
    table = ple_table_rows(shape) * row_bytes
    print(
        f"{args.preset}: table {ple_table_rows(shape):,} rows of {width} ({row_bytes} B at {args.type}) = "
        f"{table / 2**30:.2f} GiB; {keys.heads} rows a token; text {len(tokens):,} tokens"
    )
    print("| RAM cache for the table | pages read a token | bytes read a token | of which rows needed |")
    print("|---|---|---|---|")
    for mib in (int(x) for x in args.cache_mib.split(",")):
        capacity = mib * 2**20 // PAGE
        lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        misses = 0
        for token_rows in rows:
            pages = {p for r in token_rows for p in range(r * row_bytes // PAGE, ((r + 1) * row_bytes - 1) // PAGE + 1)}
            for p in pages:
                if p in lru:
                    lru.move_to_end(p)
                    continue
                misses += 1
                if capacity:
                    lru[p] = None
                    if len(lru) > capacity:
                        lru.popitem(last=False)
        per_token = misses / len(tokens)
        print(f"| {mib} MiB | {per_token:.2f} | {per_token * PAGE:,.0f} B | {keys.heads * row_bytes:,} B |")
    if args.read:
        read_for_real(args.read, table, row_bytes, rows)
    return 0


def read_for_real(where: str, table: int, row_bytes: int, rows: np.ndarray) -> None:
    """Each token's rows gathered through `NgramRows` from a file of `table` random bytes: serial, then issued
    together (and serial again, so that neither order's drive state decides)."""
    from tokenwing.models.qwen4exp import NgramRows

    fd, path = tempfile.mkstemp(prefix="ngram-table-", dir=where)
    try:
        with os.fdopen(fd, "wb") as f:
            left = table
            while left:
                n = min(left, 64 << 20)
                f.write(os.urandom(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
        print()
        print("| reads | pages a token | batches a token | µs a token | direct |")
        print("|---|---|---|---|---|")
        for threads in (1, NgramRows.io_threads, 1, NgramRows.io_threads):
            r = NgramRows(path, 0, row_bytes, table, 1 << 20, 1 << 16, io_threads=threads)
            t0 = time.perf_counter()
            for token_rows in rows:
                r.gather(token_rows)
            us = (time.perf_counter() - t0) * 1e6 / len(rows)
            direct, reads = r.direct, r.page_reads
            r.close()
            label = "one at a time" if threads == 1 else f"together, {threads} in flight"
            n = len(rows)
            print(f"| {label} | {reads / n:.2f} | {r.batches / n:.2f} | {us:,.0f} | {direct} |")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    raise SystemExit(main())
