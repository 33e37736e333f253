"""The streaming core's settings: each is a `--moe-stream-*` flag with the spec's default (docs/flags.md)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from tokenwing import _core
from tokenwing.streaming.eviction_model import load_model

# Each policy's half-life in tokens, measured with `tokenwing trace simulate` (docs/results.md): decay as the spec
# has it; history keeps counts through evictions, and a longer memory then pays (256 beat 32–128 and 512 on the
# demo model's routing and on synthetic traces).
DECAY_TOKENS = {"decay": 64, "lru": 64, "history": 256}


@dataclass
class StreamSettings:
    io_threads: int = 8
    chunk_kib: int = 512
    prefetch_cap_busy: int = 2
    prefetch_cap_idle: int = 4
    decay_tokens: int = 0  # 0: the policy's own (DECAY_TOKENS)
    idle_fill_ms: int = 500
    direct: bool = True
    policy: str = "history"
    io_engine: str = "io_uring"
    split_demand: bool = False
    skip_late: bool = False
    prefetch_votes: int = 2
    verify: bool = False  # debug: check every delivered expert against its checksum
    eviction_model: str = ""  # the learned policy's model file ("": the shipped one)

    def core_config(self) -> _core.StreamConfig:
        c = _core.StreamConfig()
        c.io_threads = self.io_threads
        c.chunk_bytes = self.chunk_kib * 1024
        c.prefetch_cap_busy = self.prefetch_cap_busy
        c.prefetch_cap_idle = self.prefetch_cap_idle
        c.decay_tokens = self.decay_tokens or DECAY_TOKENS.get(self.policy, 64)
        c.idle_fill_ms = self.idle_fill_ms
        c.direct = self.direct
        c.policy = self.policy
        c.io_engine = self.io_engine
        c.split_demand = self.split_demand
        c.skip_late = self.skip_late
        c.prefetch_votes = self.prefetch_votes
        if self.policy == "learned":
            c.learned = load_model(self.eviction_model or None).core_weights()
        return c


_HELP = {
    "io_threads": "I/O threads reading experts in parallel (keeps the drive's queue full)",
    "chunk_kib": "prefetch chunk size in KiB (a demand read can be served between chunks)",
    "prefetch_cap_busy": "prefetch chunks in service while a demand read is",
    "prefetch_cap_idle": "prefetch chunks in service while no demand read is",
    "decay_tokens": "halve every expert's use count after this many tokens (0: the policy's own, 64 for decay and "
    "256 for history)",
    "idle_fill_ms": "after this long without requests, fill empty slots from the usage table (-1: off)",
    "direct": "direct reads (O_DIRECT), bypassing the file cache",
    "policy": "RAM cache eviction: history (use count with decay, kept for experts that left the cache), learned "
    "(a score of each expert's recency and use counts at several half-lives, trained on routing traces), decay "
    "(history's count, forgotten on eviction) or lru",
    "eviction_model": "the learned policy's model (from `tokenwing trace train`; default: the shipped one)",
    "io_engine": "how reads reach the drive: threads (a blocking read per I/O thread) or io_uring (one ring, "
    "--moe-stream-io-threads reads in flight, submitted by the caller, one reaper thread)",
    "split_demand": "a demand read as two requests, gate+up then down: the gate/up products start while down lands",
    "prefetch_votes": "read a prediction once this many distances of the lookahead name it (2: the nearer router "
    "confirms the farther one: fewer wasted reads, one layer of lead)",
    "skip_late": "do not read a prediction that cannot land before its layer starts (measured read rate and "
    "decode pace)",
    "verify": "check every expert read against its checksum (debug)",
}


_CHOICES = {"policy": ["history", "learned", "decay", "lru"], "io_engine": ["threads", "io_uring"]}


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
        elif f.name in _CHOICES:
            group.add_argument(
                flag, dest=f"stream_{f.name}", choices=_CHOICES[f.name], default=default, help=_HELP[f.name]
            )
        elif isinstance(default, str):
            group.add_argument(flag, dest=f"stream_{f.name}", default=default, help=_HELP[f.name])
        else:
            group.add_argument(flag, dest=f"stream_{f.name}", type=int, default=default, help=_HELP[f.name])


def settings_from_args(args: argparse.Namespace) -> StreamSettings:
    return StreamSettings(**{f.name: getattr(args, f"stream_{f.name}") for f in fields(StreamSettings)})
