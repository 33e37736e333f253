"""JSONSchemaBench's sample (tests/data/jsonschemabench/: 300 real-world schemas, 30 from each of its 10 sets)
through a live `tokenwing serve`, each as a chat completion's `response_format` through the official `openai`
client (issue 48 item 4). Prints the counts for docs/results.md:

* accepted without `strict` (the schema followed as far as it can be: what llguidance cannot enforce is dropped
  and named in `tokenwing.unenforced` and the X-TokenWing-Unenforced header, which must agree), and refused (a 400);
* of the accepted: valid replies (validated with `jsonschema` against the ORIGINAL schema, formats checked),
  replies cut by max_tokens before their value was complete, invalid ones (each on stderr), unchecked ones;
* with `strict: true` (max_tokens 1: only whether it is accepted): how many get the 400;
* the keywords not enforced, and in how many schemas.

    python bench/jsonschemabench.py [--model resources/demo-model/tokenwing-demo-moe.gguf] [--max-tokens 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from bench.served import Served  # noqa: E402
from tests.engine.schema_sample import outcome, sample  # noqa: E402
from tokenwing.format.repack import repack  # noqa: E402

KEY = "bench-key"
HEADER = "x-tokenwing-unenforced"


def fmt(source: str, schema: dict[str, Any], strict: bool) -> Any:
    name = "".join(c if c.isalnum() else "_" for c in Path(source).stem)[:64]
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(ROOT / "resources" / "demo-model" / "tokenwing-demo-moe.gguf"))
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0, help="the first schema's seed (the next ones count up from it)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = str(Path(d) / "m.tw.gguf")
        repack([args.model], model, show_progress=False)  # (a plain GGUF: what `tokenwing serve` takes)
        return run(model, args.model, args.max_tokens, args.ctx, args.seed)


def run(model: str, name: str, max_tokens: int, ctx: int, seed: int) -> int:
    with Served(model, KEY, ["--ctx", str(ctx)]) as served:
        return _measure(served, name, max_tokens, seed)


def _measure(served: Served, name: str, max_tokens: int, seed: int) -> int:
    url, log = served.url, served.log
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    counts: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    t0 = time.monotonic()
    for i, (source, schema) in enumerate(sample()):
        counts["schemas"] += 1
        msgs: Any = [{"role": "user", "content": f"Reply with a JSON value for '{Path(source).stem}'."}]
        try:
            client.chat.completions.create(
                model="x", messages=msgs, response_format=fmt(source, schema, True), max_tokens=1
            )
            counts["strict: accepted"] += 1
        except openai.BadRequestError:
            counts["strict: refused (400)"] += 1
        try:
            raw = client.chat.completions.with_raw_response.create(
                model="x",
                messages=msgs,
                response_format=fmt(source, schema, False),
                max_tokens=max_tokens,
                temperature=0.7,
                seed=seed + i,
            )
        except openai.BadRequestError as e:
            counts["refused (400)"] += 1
            print(f"{source}: refused: {e.message}", file=sys.stderr)
            continue
        counts["accepted"] += 1
        r = raw.parse()
        unenforced = (r.model_extra or {}).get("tokenwing", {}).get("unenforced", [])
        header = raw.headers.get(HEADER)
        if (header or "") != ",".join(unenforced):
            counts["header disagrees with tokenwing.unenforced"] += 1
            print(f"{source}: header {header!r}, body {unenforced!r}", file=sys.stderr)
        if unenforced:
            counts["accepted with keywords not enforced"] += 1
            dropped.update(unenforced)
        choice = r.choices[0]
        what = outcome(schema, choice.message.content or "", choice.finish_reason)
        counts[what.split(":")[0]] += 1
        if what.startswith("invalid"):
            print(f"{source}: {what} (unenforced {unenforced})", file=sys.stderr)
    print(f"model {Path(name).name}, max_tokens {max_tokens}, seeds from {seed}, {time.monotonic() - t0:.0f} s")
    for k, v in counts.items():
        print(f"| {k} | {v} |")
    print("not enforced: " + ", ".join(f"{k} ({v})" for k, v in dropped.most_common()))
    if any("Traceback" in line for line in log):
        print("a traceback in the server's log", file=sys.stderr)
        return 1
    return 1 if counts["invalid"] or counts["header disagrees with tokenwing.unenforced"] else 0


if __name__ == "__main__":
    sys.exit(main())
