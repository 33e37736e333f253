"""The flags every command that opens a model takes (`run`, `serve`, `logits`; `autotune` the device ones): one home
for the parser (cli.py) and for `tokenwing info --json`'s list of them (info.engine_flags), which the app reads
instead of copying them."""

from __future__ import annotations

import argparse

from tokenwing.streaming.settings import add_stream_arguments


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a TokenWing model file (.tw.gguf; convert a GGUF with `tokenwing repack`)")
    p.add_argument("--ram-budget", help="RAM for the expert cache: a size (8G) or a share of the experts (25%%)")
    p.add_argument("--lookahead", type=int, default=2, help="router lookahead distance in layers (0: off)")
    p.add_argument("--ctx", type=int, default=0, help="context length (default: the model's, capped by memory)")
    p.add_argument("--kv-type", default="f16", choices=["f16", "f32"])
    p.add_argument(
        "--prompt-attention",
        default="flash",
        choices=["products", "flash"],
        help="a prompt's attention: F32 tiled flash attention (default: less CPU, as llama.cpp's own default on the "
        "CPU) or two matrix products (llama.cpp's numbers without flash attention)",
    )
    p.add_argument("--threads", type=int, default=0, help="compute threads (default: all this process may use)")
    p.add_argument("--stats-json", help="write statistics to this file")
    switch(p, "--prompt-cache", True, "serve: reuse the previous request's KV cache for the prompt prefix they share")
    p.add_argument(
        "--state-checkpoints",
        type=count,
        default=8,
        help="linear-attention models: recurrent-state checkpoints kept for the prompt cache (0: none)",
    )
    switch(p, "--usage-table", True, "fill idle cache slots from MODEL.usage.json and add this run's expert counts")
    switch(p, "--cpu-repack", True, "matrix weights and experts in ggml's repacked layouts where this CPU has one")
    switch(p, "--preload", None, "read every expert that fits at start (default: when the cache holds all of them)")
    switch(p, "--token-graph", True, "with every expert in RAM, run a decode step as one graph, not one per layer")
    add_device_arguments(p)
    p.add_argument(
        "--vram-layers",
        type=int,
        default=None,
        metavar="N",
        help="at most N layers' attention and always-used weights in VRAM, the rest of the budget for experts "
        "(default: as many as fit, layer by layer, then the output head, then experts)",
    )
    switch(
        p,
        "--vram-lend",
        False,
        "a prompt's compute buffer is lent by the VRAM expert cache (each layer's coldest experts leave VRAM while "
        "it runs and are refilled after it) instead of VRAM kept apart for it, which decode then uses for more "
        "experts",
    )
    add_stream_arguments(p)


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "vulkan", "cuda"],
        help="where to compute: auto picks CUDA, else a Vulkan GPU, else the CPU (default: auto)",
    )
    p.add_argument(
        "--vram-budget",
        help="VRAM the engine may use: a size (8G) or a share of the VRAM free at start (80%%) "
        "(default: the free VRAM less a headroom of 1/16 of the device, 256 MiB to 1 GiB)",
    )


def count(text: str) -> int:
    """A count of zero or more (argparse then says which flag, in one line)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return n


def switch(p: argparse.ArgumentParser, flag: str, default: bool | None, help: str) -> None:
    """--flag / --no-flag."""
    on = " (default: on)" if default else ""
    p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help + on)
