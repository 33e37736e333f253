"""`tokenwing tokenize`: a text's token ids by the model's own tokenizer."""

from __future__ import annotations

import argparse
import json
import sys

from tokenwing.errors import BadInputError


def _cmd_tokenize(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.text.tokenizer import tokenizer_from_file

    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8", errors="strict") as f:
                text = f.read()
        except OSError as e:
            raise BadInputError(f"cannot read {args.file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise BadInputError(f"{args.file} is not UTF-8 text") from None
    else:
        text = args.text
    tok = tokenizer_from_file(args.model)
    ids = tok.encode(text, special=not args.no_special, add_bos=False if args.no_bos else None)
    if args.json:
        print(json.dumps(ids))
        return 0
    for i in ids:  # as llama.cpp's llama-tokenize lists them: the id, then the token as it prints
        print(f"{i:>8} -> {tok.piece_bytes(i).decode('utf-8', errors='backslashreplace')!r}")
    print(f"{len(ids)} tokens", file=sys.stderr)
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tk = sub.add_parser("tokenize", help="the token ids of a text, as the model's own tokenizer makes them")
    tk.add_argument("model", help="a TokenWing model file or a GGUF (the first shard of a split one)")
    src = tk.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the text to tokenize")
    src.add_argument("--file", help="a UTF-8 file whose text to tokenize")
    tk.add_argument("--json", action="store_true", help="print the ids as one JSON list")
    tk.add_argument(
        "--no-bos", action="store_true", help="never put the BOS token first (by default: as the model says)"
    )
    tk.add_argument(
        "--no-special",
        action="store_true",
        help="special tokens' texts are plain text (by default they are the tokens)",
    )
    tk.set_defaults(func=_cmd_tokenize)
