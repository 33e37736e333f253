"""`tokenwing testmodel`: the test-model factory's command and its shape flags."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tokenwing.commands.common import progress
from tokenwing.errors import BadInputError


def _int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers (deepseek4's --compress-ratios 0,0,4,128)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None


# `tokenwing testmodel` shape flags: dest → type (each overrides the preset's value when given).
SHAPE_FLAGS: dict[str, Callable[[str], object]] = {
    **dict.fromkeys(
        (
            "n_layer",
            "n_embd",
            "n_head",
            "n_head_kv",
            "head_dim",
            "n_expert",
            "n_expert_used",
            "n_ff_exp",
            "n_dense_lead",
            "n_ff_dense",
            "n_shared_exp",
            "n_ff_shexp",
            "vocab_size",
            "q_lora_rank",
            "kv_lora_rank",
            "n_rot",
            "v_head_dim",
            "n_expert_group",
            "n_group_used",
            "n_mtp",
            "yarn_orig_ctx",
            "sliding_window",
            "context_length",
            "ssm_d_conv",
            "ssm_d_state",
            "ssm_n_group",
            "ssm_dt_rank",
            "full_attention_interval",
            "hc_mult",
            "hc_sinkhorn_iters",
            "indexer_n_head",
            "indexer_head_size",
            "indexer_top_k",
            "o_group_count",
            "o_lora_rank",
            "hash_layer_count",
            "n_expert_latent",
            "attn_res_block",
        ),
        int,
    ),
    **dict.fromkeys(
        (
            "embd_std",
            "expert_weights_scale",
            "yarn_factor",
            "yarn_beta_fast",
            "yarn_beta_slow",
            "kda_gate_lower_bound",
            "swiglu_limit",
            "hc_eps",
            "compress_rope_base",
            "situ_beta",
            "situ_linear_beta",
        ),
        float,
    ),
    "compress_ratios": _int_list,
    "hc_low_rank": int,
    "qsa_ratio": int,
    "ple_layer": int,
    "ple_ngram": int,
    "ple_heads_per_ngram": int,
    "ple_conv_kernel": int,
    "ple_head_rows": int,
    "indexer_types": _int_list,
    "tokenizer": str,
}


def _cmd_testmodel(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.testmodel import preset_shape, write_test_model
    from tokenwing.testmodel.mmproj import write_mmproj

    try:
        shape = preset_shape(args.preset, args.arch)
        overrides = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
        if args.legacy_kv_b:
            overrides["legacy_kv_b"] = True
        if args.legacy_ssm_in:
            overrides["legacy_ssm_in"] = True
        if args.no_chat_template:
            overrides["chat_template"] = False
        shape = shape.with_(**overrides)
        paths = write_test_model(
            args.output, shape, args.type, args.seed, args.shards, progress(args), expert_type=args.expert_type
        )
        if args.mmproj:  # the image encoder's file beside the model (issue 45)
            paths.append(write_mmproj(args.mmproj, shape, args.seed))
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
    for name, kind in SHAPE_FLAGS.items():
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=kind)
    t.add_argument("--legacy-kv-b", action="store_true", help="deepseek2: the older combined attn_kv_b tensor")
    t.add_argument("--legacy-ssm-in", action="store_true", help="qwen3next: the older joint ssm_in projection")
    t.add_argument("--no-chat-template", action="store_true", help="write no tokenizer.chat_template")
    t.add_argument("--mmproj", help="also write the family's image encoder (llama.cpp's clip layout) to this path")
    t.add_argument("-q", "--quiet", action="store_true")
    t.set_defaults(func=_cmd_testmodel)
