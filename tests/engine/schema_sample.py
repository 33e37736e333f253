"""JSONSchemaBench's real-world schemas (tests/data/jsonschemabench/, its README says where from) and the check of a
structured-output reply against the ORIGINAL schema, for the CI subset (test_schema_lenient.py) and the whole
sample's run (bench/jsonschemabench.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import referencing.exceptions

from tokenwing.text.grammar import rewritten

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "jsonschemabench" / "sample.jsonl"


def sample() -> Iterator[tuple[str, dict[str, Any]]]:
    """(its path in guidance-ai/jsonschemabench, the schema) for each schema of the sample, in its order."""
    with SAMPLE.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            yield row["source"], row["schema"]


def outcome(schema: dict[str, Any], text: str, finish_reason: str | None) -> str:
    """What a reply under `schema` is: "valid" (parses and validates against the schema as the client sent it,
    formats checked where jsonschema knows them), "length" (cut by max_tokens before its value was complete: not
    JSON yet, nothing to validate), "unchecked" (a schema jsonschema itself cannot use: a $ref it cannot resolve
    offline), or "invalid: why" (a complete reply the schema refuses, or one that is not JSON)."""
    try:
        value = json.loads(text)
    except ValueError:
        return "length" if finish_reason == "length" else f"invalid: not JSON: {text[:80]!r}"
    cls = jsonschema.validators.validator_for(schema)
    try:
        errors = sorted(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value), key=str)
    except (referencing.exceptions.Unresolvable, jsonschema.exceptions.SchemaError):
        return "unchecked"
    except jsonschema.exceptions._WrappedReferencingError:  # (how jsonschema re-raises an unresolvable $ref)
        return "unchecked"
    if errors:
        e = errors[0]
        return f"invalid: {'/'.join(map(str, e.absolute_path))}: {e.message[:160]}"
    return "valid"


def relaxed(schema: dict[str, Any], unenforced: list[str]) -> dict[str, Any]:
    """`schema` less the keywords a reply named `unenforced` (oneOf as anyOf; every `pattern` where one was
    dropped): at most what the grammar enforced, which every reply must match, complete or not (the check of a
    lenient reply that the ORIGINAL schema may refuse for what was dropped)."""
    formats = {k.removeprefix("format:") for k in unenforced if k.startswith("format:")}
    dropped = set(unenforced)
    if dropped & {"if", "then", "else"}:
        dropped |= {"if", "then", "else"}

    def change(s: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in s.items() if k not in dropped or k == "oneOf"}
        if "oneOf" in dropped and isinstance(out.get("oneOf"), list):  # beside any anyOf the schema has
            out["allOf"] = [*(out.get("allOf") or []), {"anyOf": out.pop("oneOf")}]
        if out.get("format") in formats:
            del out["format"]
        return out

    return rewritten(schema, change)
