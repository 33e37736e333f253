"""Helpers for running llama.cpp (llama-cpp-python) as the oracle and the benchmark peer, in its own process."""

from __future__ import annotations

from typing import Any


def use_plain_layout(llama_cpp: Any) -> None:
    """Turns off llama.cpp's repacked weight layouts (use_extra_bufts) for models loaded after this call,
    so it runs ggml's plain kernels and maps the file without copying it into anonymous memory."""
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def plain() -> Any:
        p = defaults()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = plain


def oracle_llama(
    llama_cpp: Any, model: str, n_ctx: int, n_batch: int, flash: bool = False, f16_kv: bool = False
) -> Any:
    """llama.cpp as the project's oracles run it: F32 KV cache, no flash attention (`flash`: with it, as llama.cpp's
    own default turns it on for the CPU), 2 threads, every logit. `f16_kv`: its default F16 KV cache instead — how
    far llama.cpp is from itself when only rounding changes (the yardstick of "exact")."""
    return llama_cpp.Llama(
        model,
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_batch,
        n_threads=2,
        logits_all=True,
        type_k=1 if f16_kv else 0,
        type_v=1 if f16_kv else 0,
        flash_attn=flash,
        verbose=False,
    )


def process_read_bytes() -> int:
    """Bytes this process has caused to be read from storage (page-ins of mapped files included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0
