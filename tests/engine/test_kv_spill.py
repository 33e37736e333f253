"""A context whose KV cache does not fit beside the expert cache's minimum under the memory limit: the cache is kept
in files (reclaimable page cache) instead of anonymous memory, with one line; the numbers are the same.

Found by bench/prefill_bench.py: a 16,384-token prompt on the bench model under its 25 % cap (1.08 GiB; the KV cache
alone 390 MiB) was OOM-killed two thirds of the way through. Here a model whose KV cache takes 512 KiB a position
runs a 1,024-token prompt (520 MiB of KV) under a real 600 MiB memory cap — in anonymous memory that is killed
(checked by turning the spill off) — and its logits are compared with the same run without a cap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.memcap import cap_support, memory_cap
from tests.conftest import ModelFactory

CHILD = r"""
import json, os, sys
import numpy as np
from tokenwing.runtime.session import Session, SessionOptions
model, n = sys.argv[1], int(sys.argv[2])
lines = []
s = Session(model, SessionOptions(n_ctx=n + 16, lookahead=0, usage_table=False, prompt_cache=False), log=lines.append)
toks = np.random.default_rng(3).integers(0, s.hp.vocab_size, n + 4).tolist()
logits = [s.forward(toks[:n], prompt=True)]
for t in toks[n:]:
    logits.append(s.forward([t]))
np.save(sys.argv[3], np.stack(logits))
left = [f for f in os.listdir(os.path.dirname(model)) if f.startswith(".tokenwing-spill-")]
print(json.dumps({"spilled": s.kv.spilled, "lines": lines, "left": left}))
"""

N = 1024


def _run(model: Path, out: Path, cap: int | None) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    cmd = [sys.executable, "-c", CHILD, str(model), str(N), str(out)]
    if cap is None:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    else:
        with memory_cap(cap, f"tw-test-spill-{os.getpid()}") as c:
            r = subprocess.run(c.argv(cmd), capture_output=True, text=True, timeout=600, check=False)
    info = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {}
    return r, info


def test_a_kv_cache_too_large_for_the_limit_is_spilled_to_files(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    version, why = cap_support()
    if version is None:
        pytest.skip(why)
    # 16 layers × 32 KV heads of 256 × (K + V) × 2 bytes = 512 KiB a position: 1,040 positions take 520 MiB
    model = repacked_factory(type="Q8_0", preset="tiny", n_layer=16, n_embd=256, n_head=32, n_head_kv=32, head_dim=256)
    free, free_info = _run(model, tmp_path / "free.npy", None)
    assert free.returncode == 0, free.stderr[-2000:]
    assert free_info["spilled"] is False  # nothing short: the cache in RAM, as always
    capped, info = _run(model, tmp_path / "capped.npy", 600 << 20)
    assert capped.returncode == 0, f"exit {capped.returncode}: {capped.stderr[-2000:]}"
    assert info["spilled"] is True
    spill_lines = [line for line in info["lines"] if "KV cache" in line]  # type: ignore[union-attr]
    assert len(spill_lines) == 1 and "kept in files beside the model" in spill_lines[0]
    assert info["left"] == []  # the files are unlinked at once: nothing is left beside the model
    # the same numbers: only where the cache's memory comes from changed
    assert np.array_equal(np.load(tmp_path / "capped.npy"), np.load(tmp_path / "free.npy"))
