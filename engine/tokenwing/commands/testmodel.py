"""`tokenwing testmodel`: the test-model factory's command and its shape flags."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from tokenwing.commands.common import progress
from tokenwing.errors import BadInputError
from tokenwing.testmodel.shapes import ModelShape


def _int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers (deepseek4's --compress-ratios 0,0,4,128)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None


_KINDS: dict[str, Callable[[str], object]] = {"int": int, "float": float, "str": str, "tuple[int, ...]": _int_list}

# `tokenwing testmodel`'s shape flags, one for each field of ModelShape but the family (--arch): dest → its type
# (each overrides the preset's value when given; a bool field is a switch, --name where it is off by default,
# --no-name where it is on)
SHAPE_FLAGS: dict[str, Callable[[str], object] | None] = {
    f.name: None if f.type == "bool" else _KINDS[str(f.type)]
    for f in dataclasses.fields(ModelShape)
    if f.name != "arch"
}


def _cmd_testmodel(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.testmodel import preset_shape, write_test_model
    from tokenwing.testmodel.mmproj import write_mmproj

    try:
        shape = preset_shape(args.preset, args.arch)
        overrides = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
        shape = shape.with_(**overrides)
        paths = write_test_model(
            args.output, shape, args.type, args.seed, args.shards, progress(args), expert_type=args.expert_type
        )
        if args.mmproj:  # the image encoder's file beside the model (issue 45)
            paths.append(
                write_mmproj(args.mmproj, shape, args.seed, type_name="F16" if args.type.upper() == "F16" else "F32")
            )
    except ValueError as e:
        raise BadInputError(str(e)) from None
    for p in paths:
        print(p)
    return 0


def _listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


def arch_help() -> str:
    """`--arch`'s help: every family the engine runs (models.FAMILIES, the one family list), the default first."""
    # (lazy: the registry imports every family's module, 0.2 s, which no other command's start should pay)
    from tokenwing.models import FAMILIES
    from tokenwing.testmodel.shapes import ModelShape

    default = ModelShape().arch
    return _listed([f"{default} (the default)", *(a for a in FAMILIES if a != default)])


def preset_help() -> str:
    """`--preset`'s help: the size presets, for any family, then each family preset with its family."""
    # (lazy: the factory's shapes import numpy and the GGUF writer, which no other command's start should pay)
    from tokenwing.testmodel.shapes import FAMILY_PRESETS, PRESETS

    families = ", ".join(f"{name} ({shape.arch})" for name, shape in FAMILY_PRESETS.items())
    return f"{', '.join(PRESETS)} (any architecture); {families}"


class _FactoryHelp(argparse.HelpFormatter):
    """testmodel's help, with the lists that derive from the registry filled in only when it is printed: parsing
    builds every command's parser at every start."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.dest == "arch":
            return arch_help()
        if action.dest == "preset":
            return preset_help()
        return super()._get_help_string(action)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser(
        "testmodel", help="write a random-weight GGUF of a real MoE architecture", formatter_class=_FactoryHelp
    )
    t.add_argument("output", help="GGUF path to write")
    t.add_argument("--arch", help="(the families the engine runs: arch_help)")
    t.add_argument("--preset", default="tiny", help="(the factory's presets: preset_help)")
    t.add_argument("--type", default="F32", help="F32 F16 BF16 Q8_0 Q4_0, MXFP4_MOE, or a K-quant such as Q4_K_M")
    t.add_argument("--expert-type", help="MXFP4: the routed experts in this type, the rest in --type")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shards", type=int, default=1, help="write a llama.cpp split model of N files")
    defaults = ModelShape()
    for name, kind in SHAPE_FLAGS.items():
        if kind is None:  # (a switch: the opposite of the field's default)
            on = bool(getattr(defaults, name))
            flag = ("--no-" if on else "--") + name.replace("_", "-")
            t.add_argument(flag, dest=name, action="store_const", const=not on, default=None)
        else:
            t.add_argument("--" + name.replace("_", "-"), dest=name, type=kind)
    t.add_argument("--mmproj", help="also write the family's image encoder (llama.cpp's clip layout) to this path")
    t.add_argument("-q", "--quiet", action="store_true")
    t.set_defaults(func=_cmd_testmodel)
