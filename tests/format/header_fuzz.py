"""A fixed-seed mutation fuzzer for the GGUF / .tw.gguf header parser and the header validator (issue 41).

Each case is a source GGUF or a repacked model with its header mutated: a metadata integer set to an extreme or
nearby value (block_count = 2**31 - 1, context_length = 2**32 - 1, a head count of 0, ...), a count the parser
sizes from (tensors, keys, a string's or an array's length) overwritten, random bytes flipped in the header, or
the file cut. A mutated model file is re-signed (its header checksum written again, as a crafted file would
be), so that the checks behind the checksum are what is tried. The commands then run as a user runs them, through
the CLI's own entry point in this process: `inspect` and `repack` on a source, `inspect` and `verify` on a model
file, and an engine start for every model file `verify` calls ok (what `verify` accepts, `run` must accept).

Run as a subprocess under a memory limit (RLIMIT_AS: `limited`), so that a regression that allocates without
bound fails its case instead of taking the machine. One JSON line per case on stdout, flushed, so that a hang or
a kill names its case.

usage: python -m tests.format.header_fuzz SOURCE.gguf MODEL.tw.gguf OUT_DIR --cases N [--seed S]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import resource
import struct
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import xxhash

LIMIT_BYTES = 2 << 30  # each case runs under this address-space limit (the 2 GB)
INTERESTING = [0, 1, 2, 3, 7, 64, 255, 1 << 15, (1 << 16) - 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1]


def limited(limit: int = LIMIT_BYTES) -> Callable[[], None]:
    """A preexec_fn that caps the child's address space: an unbounded allocation is then a MemoryError (or an
    OSError) in that child, never the machine's OOM killer."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


# ------------------------------------------------------------------------------------------------- the header


def _fields(data: bytes) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """(integer metadata values: (offset, width); counts the parser sizes from: (offset, width); header end)
    of a well-formed GGUF, by walking its header."""
    ints: list[tuple[int, int]] = []
    counts: list[tuple[int, int]] = [(8, 8), (16, 8)]  # tensor count, key count
    widths = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string() -> None:
        nonlocal pos
        counts.append((pos, 8))
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n

    for _ in range(n_kv):
        string()
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vtype == 8:
            string()
        elif vtype == 9:
            item, count = struct.unpack_from("<IQ", data, pos)
            counts.append((pos + 4, 8))
            pos += 12
            if item == 8:
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", data, pos)
                    pos += 8 + n
            else:
                pos += count * widths[item]
        else:
            if vtype in (0, 2, 4, 5, 10, 11):
                ints.append((pos, widths[vtype]))
            pos += widths[vtype]
    for _ in range(n_tensors):
        string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        counts.append((pos, 4))
        pos += 4
        counts += [(pos + 8 * i, 8) for i in range(n_dims)]
        pos += 8 * n_dims + 12
    return ints, counts, pos


def make_cases(data: bytes, n: int, seed: int) -> list[dict[str, object]]:
    """`n` mutations of `data`: two fifths metadata integers, a fifth parser counts, a fifth byte flips in the
    header, a fifth cuts."""
    rng = random.Random(seed)
    ints, counts, end = _fields(data)
    cases: list[dict[str, object]] = []
    for i in range(n):
        kind = ("meta", "meta", "count", "flip", "cut")[i % 5]
        if kind in ("meta", "count"):
            pos, width = rng.choice(ints if kind == "meta" else counts)
            old = int.from_bytes(data[pos : pos + width], "little")
            top = (1 << (8 * width)) - 1
            value = rng.choice([*INTERESTING, old + 1, max(old - 1, 0), old * 2, top, rng.randrange(top + 1)]) & top
            cases.append({"kind": kind, "write": [(pos, list(value.to_bytes(width, "little")))]})
        elif kind == "flip":
            picks = sorted(rng.sample(range(end), rng.randint(1, 4)))
            cases.append({"kind": kind, "flip": [(p, rng.randrange(1, 256)) for p in picks]})
        else:
            cases.append({"kind": kind, "cut": rng.randrange(0, end + 4096)})
    return cases


def mutate(data: bytes, case: dict[str, object]) -> bytes:
    buf = bytearray(data)
    for pos, value in case.get("write", []):  # type: ignore[attr-defined]
        buf[pos : pos + len(value)] = bytes(value)
    for pos, x in case.get("flip", []):  # type: ignore[attr-defined]
        buf[pos] ^= x
    if case.get("cut") is not None:
        del buf[int(case["cut"]) :]  # type: ignore[call-overload]
    return bytes(buf)


def resign(path: Path) -> None:
    """Writes a model file's header checksum again after an edit, as `tokenwing repack` writes it (the xxh3 of the
    header up to the data, taken with the checksum's own 8 bytes zero); nothing where the header does not parse."""
    from tokenwing.errors import TokenWingError
    from tokenwing.format import layout as L
    from tokenwing.format.gguf_io import read_header

    try:
        h = read_header(str(path))
    except TokenWingError:
        return
    pos = h.value_offsets.get(L.K_HEADER_CHECKSUM)
    if pos is None:
        return
    raw = bytearray(path.read_bytes()[: h.data_start])
    raw[pos : pos + 8] = bytes(8)
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(xxhash.xxh3_64_intdigest(bytes(raw)).to_bytes(8, "little"))


# ------------------------------------------------------------------------------------------------- the worker


def _cli(args: list[str]) -> dict[str, object]:
    from tokenwing.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: int | None = cli(args)
        except BaseException:  # what the real CLI would show as a traceback
            code = None
            err.write(traceback.format_exc())
    text = err.getvalue()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # (the first line whole enough to judge, and how many there were: a long one is cut here, not in the engine)
    return {"code": code, "lines": len(lines), "first": lines[0][:300] if lines else "", "stderr": text[-1000:]}


def run_case(path: Path, tw: bool, out_dir: Path) -> dict[str, object]:
    from tokenwing.errors import TokenWingError
    from tokenwing.runtime.session import Session, SessionOptions

    result: dict[str, object] = {"inspect": _cli(["inspect", str(path)])}
    if not tw:
        out = out_dir / "out.tw.gguf"
        result["repack"] = _cli(["repack", str(path), "-o", str(out), "-q"])
        with contextlib.suppress(OSError):
            out.unlink()
        return result
    result["verify"] = _cli(["verify", str(path)])
    if result["verify"]["code"] == 0:  # type: ignore[index]
        try:
            Session(str(path), SessionOptions(n_ctx=64), log=lambda line: None).close()
            result["start"] = "ok"
        except TokenWingError as e:
            result["start"] = f"refused: {e}"
        except BaseException:
            result["start"] = "traceback: " + traceback.format_exc()[-2000:]
    return result


def judge(result: dict[str, object]) -> str:
    """The verdict: "accepted", "refused" (each refusal one line with a documented exit code) or "failure: why"."""
    refused = False
    for command in ("inspect", "repack", "verify"):
        r = result.get(command)
        if not isinstance(r, dict):
            continue
        code, err = r["code"], str(r["stderr"])
        if code == 0:
            continue
        if code not in (2, 3, 4, 5) or r["lines"] != 1 or not str(r["first"]).startswith("tokenwing: error: "):
            return f"failure: {command} exit {code}, {r['lines']} lines: {err[-600:]}"
        if len(err) > 2100:  # (cli._one_line's bound, and the line's start)
            return f"failure: {command}: a {len(err)}-character error line"
        refused = True
    start = result.get("start")
    if start is not None and start != "ok":
        return f"failure: verify accepted a file the engine start refused: {str(start)[-600:]}"
    return "refused" if refused else "accepted"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("source")
    p.add_argument("model")
    p.add_argument("out_dir")
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--seed", type=int, default=41)
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    inputs = [(Path(args.source).read_bytes(), False), (Path(args.model).read_bytes(), True)]
    for which, (data, tw) in enumerate(inputs):
        path = out_dir / ("case.tw.gguf" if tw else "case.gguf")
        for i, case in enumerate(make_cases(data, args.cases // 2, args.seed + which)):
            path.write_bytes(mutate(data, case))
            if tw:
                resign(path)
            result = run_case(path, tw, out_dir)
            verdict = judge(result)
            print(json.dumps({"file": "tw" if tw else "gguf", "case": i, **case, "verdict": verdict}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
