"""`build.py train`: token streams, the learning-rate schedule, held-out loss, the resumable training loop."""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import asdict
from typing import Any

import numpy as np
from bpe import Codec
from model import build_model
from recipe import (
    CFG,
    SEED,
    WORK,
    read_docs,
)


def tokens(name: str) -> np.ndarray:
    cache = WORK / (name + ".tokens.npy")
    if cache.exists():
        return np.load(cache)
    arr = Codec().stream(read_docs(name + ".jsonl"))
    np.save(cache, arr)
    return arr


def _lr(step: int, progress: float) -> float:
    """Linear warm-up over CFG.warmup steps, then cosine decay to min_lr_frac as progress goes 0 -> 1."""
    if step < CFG.warmup:
        return CFG.lr * (step + 1) / CFG.warmup
    p = min(1.0, max(0.0, progress))
    return CFG.lr * (CFG.min_lr_frac + (1 - CFG.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def heldout_loss(model: Any, held: np.ndarray, windows: int = 24) -> float:
    import torch
    import torch.nn.functional as F

    n = CFG.seq_len
    starts = np.linspace(0, len(held) - n - 2, windows).astype(np.int64)
    batch = torch.from_numpy(np.stack([held[s : s + n + 1].astype(np.int64) for s in starts]))
    model.eval()
    with torch.no_grad():
        logits, _ = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), batch[:, 1:].reshape(-1))
    model.train()
    return float(loss)


def cmd_train(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    train, held = tokens("train"), tokens("heldout")
    model = build_model(CFG)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "router" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "router" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": CFG.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=CFG.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    ckpt = WORK / "checkpoint.pt"
    step, seen, elapsed = 0, 0, 0.0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, seen, elapsed = state["step"], state["tokens"], state["elapsed"]
        print(f"resumed at step {step}", flush=True)
    total = args.steps
    n, bs = CFG.seq_len, CFG.batch
    log = open(WORK / "train.log", "a", encoding="utf-8")  # noqa: SIM115

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "tokens": seen,
                "elapsed": elapsed,
                "config": asdict(CFG),
                "total_steps": total,
            },
            tmp,
        )
        os.replace(tmp, ckpt)

    print(f"train {len(train)} tokens, held-out {len(held)} tokens, {total} steps of {bs}x{n}", flush=True)
    t_start = time.monotonic()
    budget = args.minutes * 60

    def progress() -> float:
        # With --minutes the schedule follows training time (the shipped model was trained so); else steps.
        if budget:
            return elapsed / budget
        return (step - CFG.warmup) / max(1, total - CFG.warmup)

    while (step < total) if not budget else (elapsed < budget):
        t0 = time.monotonic()
        rng = np.random.default_rng([SEED, step])
        starts = rng.integers(0, len(train) - n - 1, bs)
        batch = torch.from_numpy(np.stack([train[s : s + n + 1].astype(np.int64) for s in starts]))
        for g in opt.param_groups:
            g["lr"] = _lr(step, progress())
        logits, balance = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + CFG.balance_coef * balance).backward()
        loss, balance = loss.detach(), balance.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += bs * n
        elapsed += time.monotonic() - t0
        if step % 10 == 0:
            line = (
                f"step {step}/{total} loss {loss.item():.3f} balance {balance.item():.3f} "
                f"lr {_lr(step, progress()):.2e} tokens {seen} tok/s {seen / max(elapsed, 1e-9):.0f} "
                f"elapsed {elapsed / 60:.1f} min"
            )
            print(line, flush=True)
            log.write(line + "\n")
        last = step == total if not budget else elapsed >= budget
        if step % args.eval_every == 0 or last:
            line = f"step {step} heldout {heldout_loss(model, held):.4f}"
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
        if step % args.save_every == 0 or last:
            save()
    log.close()
    print(f"done: {step} steps, {seen} tokens, {elapsed / 60:.1f} min ({(time.monotonic() - t_start) / 60:.1f} here)")
