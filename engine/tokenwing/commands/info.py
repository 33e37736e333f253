"""`tokenwing info`: what the app asks the engine, as text or JSON."""

from __future__ import annotations

import argparse
import json

from tokenwing.fsutil import human_bytes, parse_size


def _cmd_info(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.info import engine_info

    info = engine_info(args.drive, parse_size(args.probe_bytes), args.model)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    m = info["memory"]
    print(f"tokenwing {info['version']}")
    g = info["ggml"]
    backends = ", ".join(f"{k}{'' if on else ' (built, not loaded here)'}" for k, on in g["backends"].items())
    print(f"ggml {g['version']} ({g['source']}); backends: {backends}")
    print(f"CPU backend: {g['cpu_variant']} ({g['cpu_variant_why']}) of {', '.join(g['cpu_variants'])}")
    print(f"architectures: {', '.join(info['architectures'])}")
    print(
        f"memory: {human_bytes(m['available'])} available of {human_bytes(m['total'])}, limit "
        f"{human_bytes(m['limit'])}, usable {human_bytes(m['usable'])}; "
        f"headroom kept {human_bytes(info['headroom_bytes'])}"
    )
    for d in info["devices"]:
        extra = f", {d['cores']} cores" if "cores" in d else ""
        if d["kind"] != "cpu":
            extra = f", {d.get('description', '')}, {human_bytes(d['free'])} free of {human_bytes(d['total'])}"
        print(f"device: {d['name']} ({d['kind']}){extra}")
    if info["drive"]:
        speeds = ", ".join(f"{t}: {v:.0f}" for t, v in info["drive"]["mb_per_s_by_threads"].items())
        print(f"drive ({'direct' if info['drive']['direct'] else 'cached'} reads, MB/s by threads): {speeds}")
    if info["model"]:
        m = info["model"]
        print(
            f"model: {m['file']} ({m['architecture']}): KV cache {human_bytes(m['kv_bytes_per_token'])} per token "
            f"of context ({m['kv_type']})"
        )
        par = m["parallel_auto"]
        print(
            f"serve --parallel auto: {par['slots']} slot{'s' if par['slots'] > 1 else ''} of {par['context']} tokens "
            f"of context, {human_bytes(par['bytes_per_slot'])} each (KV cache and states)"
        )
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inf = sub.add_parser(
        "info", help="version, architectures, memory, devices, flags, exit codes (what the app asks the engine)"
    )
    inf.add_argument("model", nargs="?", help="also what this model file's KV cache takes per token")
    inf.add_argument("--json", action="store_true")
    inf.add_argument("--drive", help="also measure direct reads from this file (e.g. a model file)")
    inf.add_argument("--probe-bytes", default="64M", help="bytes to read per drive measurement")
    inf.set_defaults(func=_cmd_info)
