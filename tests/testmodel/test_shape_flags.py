"""`tokenwing testmodel`'s shape flags derive from ModelShape's fields (issue 42 item 1): a field a family's
factory shape adds is a flag with no other edit, of the field's type; a bool field is a switch."""

from __future__ import annotations

import dataclasses

from tokenwing.cli import build_parser
from tokenwing.testmodel.shapes import ModelShape


def _parsed(*flags: str) -> dict[str, object]:
    args = build_parser().parse_args(["testmodel", "out.gguf", *flags])
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelShape) if f.name != "arch"}


def test_every_field_is_a_flag_of_its_type_and_none_is_set_unless_given() -> None:
    assert set(_parsed().values()) == {None}  # (the preset's values stand)
    given = _parsed(
        "--n-layer", "5", "--rope-base", "5000", "--rope-sections", "3,2,2,0", "--tokenizer", "bailingmoe2",
        "--legacy-kv-b", "--no-chat-template",
    )  # fmt: skip
    assert given["n_layer"] == 5 and given["rope_base"] == 5000.0 and given["rope_sections"] == (3, 2, 2, 0)
    assert given["tokenizer"] == "bailingmoe2" and given["legacy_kv_b"] is True and given["chat_template"] is False
    assert sum(v is not None for v in given.values()) == 6
