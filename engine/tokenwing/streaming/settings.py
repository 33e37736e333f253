"""The streaming core's settings: each is a `--moe-stream-*` flag with the spec's default (docs/flags.md)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from tokenwing import _core


@dataclass
class StreamSettings:
    io_threads: int = 8
    chunk_kib: int = 512
    prefetch_cap_busy: int = 2
    prefetch_cap_idle: int = 4
    decay_tokens: int = 64
    idle_fill_ms: int = 500
    direct: bool = True
    policy: str = "decay"
    verify: bool = False  # debug: check every delivered expert against its checksum

    def core_config(self) -> _core.StreamConfig:
        c = _core.StreamConfig()
        c.io_threads = self.io_threads
        c.chunk_bytes = self.chunk_kib * 1024
        c.prefetch_cap_busy = self.prefetch_cap_busy
        c.prefetch_cap_idle = self.prefetch_cap_idle
        c.decay_tokens = self.decay_tokens
        c.idle_fill_ms = self.idle_fill_ms
        c.direct = self.direct
        c.policy = self.policy
        return c


_HELP = {
    "io_threads": "I/O threads reading experts in parallel (keeps the drive's queue full)",
    "chunk_kib": "prefetch chunk size in KiB (a demand read can be served between chunks)",
    "prefetch_cap_busy": "prefetch chunks in service while a demand read is",
    "prefetch_cap_idle": "prefetch chunks in service while no demand read is",
    "decay_tokens": "halve every expert's use count after this many tokens",
    "idle_fill_ms": "after this long without requests, fill empty slots from the usage table (-1: off)",
    "direct": "direct reads (O_DIRECT), bypassing the file cache",
    "policy": "RAM cache eviction: decay (use count with decay) or lru",
    "verify": "check every expert read against its checksum (debug)",
}


def add_stream_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("expert streaming")
    for f in fields(StreamSettings):
        flag = "--moe-stream-" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            group.add_argument(
                flag,
                dest=f"stream_{f.name}",
                action=argparse.BooleanOptionalAction,
                default=default,
                help=_HELP[f.name],
            )
        elif f.name == "policy":
            group.add_argument(
                flag, dest=f"stream_{f.name}", choices=["decay", "lru"], default=default, help=_HELP[f.name]
            )
        else:
            group.add_argument(flag, dest=f"stream_{f.name}", type=int, default=default, help=_HELP[f.name])


def settings_from_args(args: argparse.Namespace) -> StreamSettings:
    return StreamSettings(**{f.name: getattr(args, f"stream_{f.name}") for f in fields(StreamSettings)})
