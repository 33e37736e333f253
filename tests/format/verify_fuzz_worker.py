"""Subprocess for test_verify_agrees: `verify` and `inspect` (the CLI's own entry point, in-process) on mutated
copies of a repacked model, and an engine start for every file `verify` calls ok. One JSON line per case on
stdout, flushed, so a hang names its case; a crash (a signal) kills only this process.

usage: python -m tests.format.verify_fuzz_worker MODEL CASES.json OUT_DIR
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path

from tokenwing.cli import main as cli
from tokenwing.errors import TokenWingError
from tokenwing.runtime.session import Session, SessionOptions


def _run(args: list[str]) -> tuple[int | None, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: int | None = cli(args)
        except BaseException:  # what the real CLI would show as a traceback
            code = None
            err.write(traceback.format_exc())
    return code, out.getvalue(), err.getvalue()


def main() -> int:
    model, cases_path, out_dir = sys.argv[1:4]
    data = Path(model).read_bytes()
    cases = json.loads(Path(cases_path).read_text())
    path = Path(out_dir) / "case.tw.gguf"
    for i, case in enumerate(cases):
        buf = bytearray(data)
        for pos, value in case.get("write", []):
            buf[pos : pos + len(value)] = bytes(value)
        for pos in case.get("flip", []):
            buf[pos] ^= 0xFF
        if case.get("cut") is not None:
            del buf[case["cut"] :]
        path.write_bytes(bytes(buf))
        result: dict[str, object] = {"case": i}
        for command in ("verify", "inspect"):
            code, _, err = _run([command, str(path)])
            result[command] = {"code": code, "stderr": err}
        if result["verify"]["code"] == 0:  # type: ignore[index]
            try:
                Session(str(path), SessionOptions(n_ctx=64), log=lambda line: None).close()
                result["start"] = "ok"
            except TokenWingError as e:
                result["start"] = f"refused: {e}"
            except BaseException:
                result["start"] = "traceback: " + traceback.format_exc()
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
