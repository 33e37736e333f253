"""llama.cpp's logits for the device tests: computed here by llama.cpp (tests/oracle), or read from files made
beforehand where llama.cpp is not installed (the GPU machine: `bench/gpu_refs.py` writes them, gpu_check.sh
carries them). A file names the GGUF it belongs to by its checksum: a model generated differently there is an
error, never a silent comparison with another model's logits.

TOKENWING_TEST_REFS=DIR reads references and models from DIR (whether or not llama.cpp is here: a dry run of the GPU
machine's check); TOKENWING_TEST_REFS_SAVE=DIR also writes every reference computed here, and its model, into DIR.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from tests.oracle.test_logits import llama_logits

READ_ENV, SAVE_ENV = "TOKENWING_TEST_REFS", "TOKENWING_TEST_REFS_SAVE"


def have_llama() -> bool:
    """Whether references are computed here: llama.cpp is installed and no carried references are named."""
    return importlib.util.find_spec("llama_cpp") is not None and not os.environ.get(READ_ENV)


def model(key: str, make: Callable[[], Path]) -> Path:
    """A test model: made here (and saved beside the references when asked), or, without llama.cpp (which makes
    the K-quant ones), the one saved with the references."""
    if not os.environ.get(READ_ENV):
        path = make()
        save = os.environ.get(SAVE_ENV)
        if save:
            Path(save).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, Path(save) / f"{key}.gguf")
        return path
    return Path(os.environ[READ_ENV]) / f"{key}.gguf"


def _digest(gguf: Path, tokens: np.ndarray) -> str:
    h = xxhash.xxh3_64()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    h.update(np.ascontiguousarray(tokens, np.int64).tobytes())
    return h.hexdigest()


def reference(key: str, gguf: Path, tokens: np.ndarray, tmp: Path) -> np.ndarray:
    """llama.cpp's logits of `tokens` on `gguf` (every position); `key` names the file of a carried reference."""
    digest = _digest(gguf, tokens)
    if have_llama():
        ref = llama_logits(gguf, tokens, tmp)
        save = os.environ.get(SAVE_ENV)
        if save:
            Path(save).mkdir(parents=True, exist_ok=True)
            np.save(Path(save) / f"{key}.npy", ref.astype(np.float32))
            (Path(save) / f"{key}.json").write_text(json.dumps({"digest": digest, "shape": list(ref.shape)}))
        return ref
    where = os.environ.get(READ_ENV)
    if not where:
        raise AssertionError(f"llama.cpp is not installed and {READ_ENV} names no references ({key})")
    meta = json.loads((Path(where) / f"{key}.json").read_text())
    if meta["digest"] != digest:
        raise AssertionError(f"{key}: the reference belongs to another model or tokens ({meta['digest']} != {digest})")
    ref: np.ndarray = np.load(Path(where) / f"{key}.npy")
    return ref
