"""`tokenwing info`: what this engine is and sees — version, the architectures it runs with the weight types it
computes, the memory headroom it keeps in RAM and on a device, its flags with their defaults and choices, its exit
codes, the memory (and optionally the drive) it would size itself from, its compute devices, and for a model file
what its KV cache takes per token. The app asks this instead of keeping copies of engine facts."""

from __future__ import annotations

import argparse
import os
from typing import Any

from tokenwing.autotune.probe import cpu_isa, probe_drive
from tokenwing.commands import run as run_commands
from tokenwing.compute import ggml_api as ggml
from tokenwing.compute.devices import HEADROOM_DIVISOR, HEADROOM_MAX, HEADROOM_MIN, list_devices
from tokenwing.errors import BadInputError, exit_codes, permanent_kinds
from tokenwing.flags import add_engine_arguments
from tokenwing.format import layout as L
from tokenwing.format.quant_names import quant_bits
from tokenwing.format.source import open_source
from tokenwing.models import family, kv_bytes_per_token, supported_architectures
from tokenwing.models.hparams import read_hparams
from tokenwing.models.weights import resident_bytes
from tokenwing.runtime.kvcache import KV_TYPES
from tokenwing.runtime.memory_plan import EXTRA_SLOTS_SHARE
from tokenwing.runtime.session import AUTO_PARALLEL, SessionOptions, session_memory
from tokenwing.runtime.vram.experts import SWAP_EVERY, SWAP_MAX
from tokenwing.server.worker import LAYER_FIELDS, TOKEN_FIELDS
from tokenwing.streaming.memory import HEADROOM, MemoryInfo, memory_info
from tokenwing.streaming.settings import DECAY_TOKENS
from tokenwing.version import __version__
from tokenwing.vision.logits import ENCODERS

# The architectures whose images the engine reads, with the mmproj projector types (clip.projector_type) each
# takes: the encoders the engine computes (vision/logits.ENCODERS), by the families each is for. The app offers
# pictures by it (issue 45 item 5).
IMAGE_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    arch: tuple(p for p, e in ENCODERS.items() if arch in e.archs) for enc in ENCODERS.values() for arch in enc.archs
}


def weight_types() -> list[str]:
    """GGUF weight types that ggml's CPU backend has matrix kernels for (the engine computes every weight with
    ggml): read from ggml's own type table, not a list kept here."""
    out = []
    for t in range(ggml.GGML_TYPE_COUNT):
        traits = ggml.ggml_get_type_traits_cpu(t)
        name = ggml.ggml_type_name(t)
        if traits and traits.contents.vec_dot and name and b" " not in name:
            out.append(name.decode().upper())
    return out


def devices(isa: list[str], mem: MemoryInfo) -> list[dict[str, Any]]:
    """Every compute device ggml sees (kind, name, description, type, free and total memory), the CPU with its
    cores, instruction sets and RAM (ggml counts all of it free); a registry that cannot be listed leaves the CPU
    alone, with the reason."""
    cpu: dict[str, Any] = {
        "kind": "cpu",
        "name": "CPU",
        "cores": len(os.sched_getaffinity(0)),
        "isa": isa,
        "free": mem.usable,
        "total": mem.total,
    }
    try:
        found = list_devices()
    except Exception as e:  # never fail `info` over a device: it is what the app asks when something is wrong
        return [{**cpu, "error": f"listing devices failed: {e}"}]
    out = []
    for d in found:
        entry = d.as_dict()
        if d.kind == "cpu":
            entry.update(cpu)
        out.append(entry)
    out.sort(key=lambda e: e["kind"] != "cpu")  # the CPU first: the app and older readers look there
    return out


def ggml_facts() -> dict[str, Any]:
    """Which ggml this engine runs: its version and source (the build's build.json), the CPU backend module it
    loaded with the reason (the best level this CPU runs, or TOKENWING_CPU_VARIANT) and every level the build has,
    and the GPU backends the build has with whether each loaded here (no Vulkan loader, no CUDA driver: not)."""
    built = ggml.build_info()
    return {
        "version": built.get("ggml"),
        "source": built.get("source"),
        "cpu_variant": ggml.CPU_VARIANT,
        "cpu_variant_why": ggml.CPU_VARIANT_WHY,
        "cpu_variants": list(ggml.cpu_variants()),
        "backends": {"cpu": True, **ggml.load_gpu_backends()},
    }


def process_bytes() -> int:
    """This process's resident memory now, having loaded ggml and the engine's code: what a running engine takes
    before any model, cache or buffer (VmRSS; 0 where /proc is not there to say)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def preset_flags(flags: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The flags a model's preset may set, by the key it writes them under, with their CLI spelling: `lookahead`
    (`--lookahead`) and every `--moe-stream-*` flag without its prefix (`io-threads`: `--moe-stream-io-threads`),
    the streaming tunables measured per model; the rest (memory, context, devices) are the machine's or the
    user's."""
    out = {"lookahead": "--lookahead"} if "--lookahead" in flags else {}
    out.update({name.removeprefix("--moe-stream-"): name for name in flags if name.startswith("--moe-stream-")})
    return out


def engine_flags() -> dict[str, dict[str, Any]]:
    """The flags `run`, `serve` and `logits` take about a model, read from the parser that takes them: per flag
    its default (None: the engine decides at start), its kind (bool: `--X` / `--no-X`; int; choice, with its
    choices; str) and its help."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    out: dict[str, dict[str, Any]] = {}
    for action in parser._actions:
        if not action.option_strings:
            continue  # the model
        entry: dict[str, Any] = {"default": action.default}
        if isinstance(action, argparse.BooleanOptionalAction):
            entry["kind"] = "bool"
        elif action.choices is not None:
            entry.update(kind="choice", choices=list(action.choices))
        elif action.type is int or getattr(action.type, "__name__", "") == "_count":
            entry["kind"] = "int"
        else:
            entry["kind"] = "str"
        entry["help"] = (action.help or "").replace("%%", "%")
        out[action.option_strings[0]] = entry
    return out


def image_facts() -> dict[str, Any]:
    """What the engine reads images for: `architectures` (each with its mmproj projector types) and `serve`,
    whether `tokenwing serve` takes `--mmproj` (read from its parser: the app starts a model's server with its
    mmproj only where it does)."""
    sub = argparse.ArgumentParser(add_help=False).add_subparsers()
    run_commands.add_parsers(sub)
    serve = sub.choices.get("serve")
    takes = serve is not None and any("--mmproj" in a.option_strings for a in serve._actions)
    return {"architectures": {a: list(p) for a, p in IMAGE_ARCHITECTURES.items()}, "serve": takes}


def model_facts(path: str, mem: MemoryInfo | None = None) -> dict[str, Any]:
    """What the engine sizes for a model file (or GGUF) before loading it: its KV cache per token of context, at
    each `--kv-type` (by its family's rule: the bytes the runtime allocates), and the slots `serve --parallel
    auto` would keep on this machine (by the rule the session plans by, from the file's metadata and its
    resident tensors' sizes: no weight is read)."""
    source = open_source([path])
    header = source.header
    arch = L.arch_of(header)
    meta = {k: v.value for k, v in header.kv.items()}
    by_type = {name: kv_bytes_per_token(meta, arch, path, elt) for name, (_, elt) in KV_TYPES.items()}
    default = engine_flags()["--kv-type"]["default"]

    # the resident tensors: a model file lists them first; a GGUF's are those neither experts nor kept
    n_res = header.get(L.K_RESIDENT_COUNT)
    stored = header.tensors[: int(n_res)] if n_res is not None else L.plan_experts(source.infos(), header)[0]
    resident = L.split_kept(stored, header)[0]
    model_class = family(arch)
    hp = read_hparams(meta, arch, path, model_class.recurrence)
    lazy = model_class.lazy_tensors(hp)
    weights = resident_bytes(t for t in resident if t.name not in lazy)
    shapes = {t.name: t.shape for t in resident}
    try:
        specs = [model_class.layer_state(hp, shapes, il) for il in range(hp.n_layer)]
    except KeyError as e:  # (a tensor the family sizes its state by is missing: `verify` names it)
        raise BadInputError(f"{path}: no tensor {e.args[0]}, which a {arch} model needs") from None
    plan = session_memory(model_class, hp, specs, weights, SessionOptions(), mem or memory_info(), 0)
    return {
        "file": path,
        "architecture": arch,
        "kv_type": default,
        "kv_bytes_per_token": by_type[default],
        "kv_bytes_per_token_by_type": by_type,
        # `serve --parallel auto` here and now: its slots, each one's context and what each slot's KV cache and
        # recurrent states take (counted against the memory limit beside the resident weights)
        "parallel_auto": {
            "slots": plan.n_seq,
            "context": plan.n_ctx,
            "bytes_per_slot": plan.kv_per_token * plan.n_ctx + plan.states.reserved,
            "resident_weights_bytes": weights,
        },
    }


def engine_info(drive_file: str | None = None, drive_bytes: int = 64 << 20, model: str | None = None) -> dict[str, Any]:
    types = weight_types()
    mem = memory_info()
    flags = engine_flags()
    info: dict[str, Any] = {
        "version": __version__,
        "ggml": ggml_facts(),
        "architectures": {arch: {"weight_types": types} for arch in supported_architectures()},
        "headroom_bytes": HEADROOM,
        # what a device keeps free beyond --vram-budget's default: total / divisor, within min and max bytes
        "device_headroom": {"divisor": HEADROOM_DIVISOR, "min_bytes": HEADROOM_MIN, "max_bytes": HEADROOM_MAX},
        "flags": flags,
        "images": image_facts(),  # the architectures it reads images for, and whether serve takes --mmproj
        "preset_flags": preset_flags(flags),
        # a routed expert's average bits per weight by the quant name a GGUF is published under, and the
        # alignment of each of its projections in the model file: one expert's bytes before the file is here
        "quant_bits": quant_bits(),
        "expert_alignment": L.ALIGNMENT,
        # what this engine's process holds before a model (the app adds a model's graph reserve, `inspect`)
        "process_bytes": process_bytes(),
        # --moe-stream-decay-tokens 0 (its default) means the policy's own half-life, in tokens
        "decay_tokens_by_policy": dict(DECAY_TOKENS),
        # the stats stream's token event: its fields and each layer's (docs/api.md), for readers to check against
        "stats_fields": {"token": list(TOKEN_FIELDS), "layer": ["layer", *LAYER_FIELDS]},
        "exit_codes": exit_codes(),
        "permanent_exit_kinds": permanent_kinds(),  # (retrying the same input cannot change these)
        "memory": {
            "total": mem.total,
            "available": mem.available,
            "limit": mem.limit,
            "used_in_group": mem.used_in_group,
            "usable": mem.usable,
        },
        "devices": devices(cpu_isa(), mem),
        # the VRAM expert cache's swap rule, the most it copies to a device per decode token (the app's estimate)
        "vram_swaps": {"every_tokens": SWAP_EVERY, "max_experts": SWAP_MAX},
        # serve --parallel auto: slots that fit where the KV cache may go (half the memory left after the
        # weights), each with the context one slot would get, at least 1 and at most this many
        "parallel_auto_most": AUTO_PARALLEL,
        "parallel_auto_extra_share": 1 / EXTRA_SLOTS_SHARE,  # ... the caches beyond the first: this much memory
        "drive": None,
        "model": model_facts(model, mem) if model is not None else None,
    }
    if drive_file is not None:
        try:
            size = os.path.getsize(drive_file)
        except OSError as e:
            raise BadInputError(f"cannot read {drive_file}: {e.strerror or e}") from None
        block = min(1 << 20, size // 4096 * 4096)  # expert-sized reads; a small file gets smaller ones
        if block == 0:
            raise BadInputError(f"{drive_file} is too small to measure reads from (under 4 KiB)")
        d = probe_drive(drive_file, block, drive_bytes, threads=(1, 8))
        info["drive"] = {
            "file": drive_file,
            "direct": d.direct,
            "block_bytes": d.block_bytes,
            "mb_per_s_by_threads": d.mb_per_s_by_threads,
        }
    return info
