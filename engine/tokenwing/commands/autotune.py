"""`tokenwing autotune`: probe this machine and choose a model's settings."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from tokenwing.commands.common import stderr_line
from tokenwing.flags import add_device_arguments
from tokenwing.fsutil import human_bytes, parse_size

if TYPE_CHECKING:
    from tokenwing.autotune.solver import Choice


def _cmd_autotune(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.autotune.probe import probe_machine, probe_replay
    from tokenwing.autotune.solver import choose, plan_for
    from tokenwing.compute.devices import DeviceOptions
    from tokenwing.format.reader import ModelFile

    with ModelFile.open(args.model) as mf:
        record = max(el.record_size for el in mf.index.layers)
        device = DeviceOptions.from_args(args)
        machine = probe_machine(args.model, record, parse_size(args.probe_bytes), stderr_line, device)
        slots = plan_for(mf, machine, args.ctx).slots_per_layer
        if slots < mf.index.n_expert and args.replay_tokens > 0:  # streaming: its settings are chosen by replay
            machine.replay = probe_replay(mf, slots, machine.cores, args.replay_tokens, progress=stderr_line)
        choice = choose(mf, machine, args.ctx)
        if args.trace:
            _eviction(args.model, args.trace, slots, choice)
    if args.json:
        print(
            json.dumps({"machine": machine.as_dict(), "settings": choice.settings, "reasons": choice.reasons}, indent=2)
        )
        return 0
    m = machine
    print(
        f"memory: {human_bytes(m.memory.available)} available of {human_bytes(m.memory.total)}, limit "
        f"{human_bytes(m.memory.limit)}; {m.cores} cores ({' '.join(m.isa) or 'no SIMD flags found'}); "
        f"GPUs: {', '.join(g['name'] for g in m.gpus) or 'none'}"
    )
    if m.drive:
        speeds = ", ".join(f"{t}: {v:.0f}" for t, v in m.drive.mb_per_s_by_threads.items())
        print(
            f"drive ({'direct' if m.drive.direct else 'cached'} reads of {human_bytes(m.drive.block_bytes)}"
            f" experts, MB/s by threads): {speeds}"
        )
    if m.replay:
        speeds = ", ".join(f"{label}: {v:.1f}" for label, v in m.replay.tok_s.items())
        print(f"decode replayed through the core (tok/s): {speeds}")
    for key, value in choice.settings.items():
        print(f"  {key} = {value}\n      because {choice.reasons[key]}")
    return 0


def _eviction(model: str, traces: list[str], slots: int, choice: Choice) -> None:
    """The eviction policy from this model's own routing traces (`tokenwing run --record-trace`): the learned
    model retrained on them, kept next to the model file, and chosen where it reads less than history."""
    # (lazy: only this option loads the trainer, as the command's own imports above)
    from tokenwing.streaming.learned import retrain

    out = model + ".eviction.json"
    learned, reads = retrain(traces, slots, f"tokenwing autotune {model} --trace {' '.join(traces)}")
    learned.save(out)
    why = (
        f"replaying the second half of this model's traces at {slots} slots per layer (fitted on the first): "
        f"learned reads {reads['learned']}, history {reads['history']}"
    )
    wins = reads["learned"] < reads["history"]
    choice.set("moe_stream_policy", "learned" if wins else "history", why)
    if wins:
        choice.set("moe_stream_eviction_model", out, f"retrained on {len(traces)} trace(s) of this model")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    at = sub.add_parser("autotune", help="probe this machine and the drive, and choose settings for a model")
    at.add_argument("model")
    at.add_argument("--ctx", type=int, default=4096, help="context length to plan the KV cache for")
    at.add_argument("--probe-bytes", default="256M", help="bytes to read per drive measurement")
    at.add_argument(
        "--replay-tokens", type=int, default=24, help="decode tokens replayed through the core per setting (0: none)"
    )
    at.add_argument(
        "--trace",
        nargs="+",
        help="routing traces of this model (tokenwing run --record-trace): retrain the learned eviction policy on "
        "them and choose it where it reads less than history",
    )
    at.add_argument("--json", action="store_true")
    add_device_arguments(at)
    at.set_defaults(func=_cmd_autotune)
