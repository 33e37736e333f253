"""Subprocess: llama.cpp (llama-cpp-python) on a token stream; prints one JSON line of measurements.

usage: python llama_runner.py MODEL.gguf TOKENS.npy N_PROMPT MODE
MODE: default (llama.cpp's defaults: repacked weights), plain (use_extra_bufts off: plain mmap),
      random (plain, then madvise(MADV_RANDOM) on its mapping of the model, so a fault reads one page);
      MODE+flash: the same with flash attention on (llama.cpp's own programs' choice on the CPU; the Python
      binding's default is off)
"""

from __future__ import annotations

import ctypes
import json
import mmap
import sys
import time

import numpy as np

from tokenwing.testmodel.oracle import process_read_bytes, use_plain_layout


def madvise_random(path: str) -> int:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(path):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if libc.madvise(lo, hi - lo, mmap.MADV_RANDOM) == 0:
                    n += hi - lo
    return n


def main() -> int:
    import os

    import llama_cpp

    model, tokens_path, n_prompt, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    mode, _, flash = mode.partition("+")
    tokens = np.load(tokens_path).astype(np.int64).tolist()
    if mode in ("plain", "random"):
        use_plain_layout(llama_cpp)
    t0 = time.perf_counter()
    threads = int(os.environ.get("BENCH_THREADS", "2"))  # (engine_bench --threads)
    llm = llama_cpp.Llama(
        model, n_ctx=len(tokens) + 16, n_batch=512, n_threads=threads, flash_attn=flash == "flash", verbose=False
    )
    advised = madvise_random(os.path.realpath(model)) if mode == "random" else 0
    load = time.perf_counter() - t0
    r0 = process_read_bytes()
    t1 = time.perf_counter()
    llm.eval(tokens[:n_prompt])
    t2 = time.perf_counter()
    r1 = process_read_bytes()
    for tok in tokens[n_prompt:]:
        llm.eval([tok])
    t3 = time.perf_counter()
    r2 = process_read_bytes()
    n_dec = len(tokens) - n_prompt
    print(
        json.dumps(
            {
                "engine": f"llama.cpp {mode}{'+flash' if flash else ''}",
                "load_s": load,
                "advised_bytes": advised,
                "prompt_tok_s": n_prompt / (t2 - t1),
                "decode_tok_s": n_dec / (t3 - t2),
                "prompt_read_bytes": r1 - r0,
                "read_bytes_per_token": (r2 - r1) / n_dec,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
