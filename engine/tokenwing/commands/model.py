"""The model-file commands: `tokenwing repack`, `inspect` and `verify`."""

from __future__ import annotations

import argparse
import json
import resource
import sys

from tokenwing.commands.common import progress
from tokenwing.errors import BadInputError
from tokenwing.fsutil import human_bytes
from tokenwing.progress import use_json_lines


def _cmd_repack(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.format.repack import repack

    if bool(args.sources) == bool(args.shards):
        raise BadInputError("give the source GGUF (or its shards), or --shards MANIFEST, not both")
    if args.plan:
        return _repack_plan(args)
    if args.shards or args.delete_source:
        return _repack_shards(args)
    out = args.output or default_output(args.sources[0])
    use_json_lines(args.progress_json)
    try:
        report = repack(args.sources, out, show_progress=progress(args), verify=not args.no_verify)
    finally:
        use_json_lines(False)
    mb = report.source_bytes / 1e6
    print(
        f"wrote {out}: {human_bytes(report.output_bytes)} from {human_bytes(report.source_bytes)}, "
        f"{mb / max(report.write_seconds, 1e-9):.0f} MB/s write, verified in {report.verify_seconds:.1f} s, "
        f"peak memory {human_bytes(peak_rss())}"
    )
    return 0


def _repack_plan(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.format.shards import plan_summary
    from tokenwing.format.source import HeadersIncomplete, open_manifest, open_source, read_manifest

    try:
        source = open_manifest(read_manifest(args.shards)) if args.shards else open_source(args.sources)
    except HeadersIncomplete as e:
        if not args.json:
            raise
        print(json.dumps({"headers_incomplete": e.shards}))  # the app fetches more of those and asks again
        return 0
    plan = plan_summary(source)
    if args.json:
        print(json.dumps(plan, indent=1))
        return 0
    peak = plan["peak_bytes"]
    print(
        f"{len(plan['shards'])} shard(s), {human_bytes(plan['source_bytes'])} -> {human_bytes(plan['output_bytes'])}"
        f"; disk at peak: {human_bytes(peak['streaming'])} repacking shard by shard, "
        f"{human_bytes(peak['copy'])} repacking after the download"
    )
    return 0


def _repack_shards(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.format.shards import repack_shards, shards_from_paths, state_dir
    from tokenwing.format.source import read_manifest

    if not args.output and args.shards:
        raise BadInputError("--shards needs -o OUTPUT")
    out = args.output or default_output(args.sources[0])
    shards = read_manifest(args.shards) if args.shards else shards_from_paths(args.sources, out)
    use_json_lines(args.progress_json)
    try:
        r = repack_shards(
            shards,
            out,
            delete_source=args.delete_source,
            show_progress=progress(args),
            log=lambda line: None if args.quiet or args.progress_json else print(line, file=sys.stderr),
        )
    except KeyboardInterrupt:
        print(
            f"tokenwing: interrupted; the shards verified so far are kept in {state_dir(out)}: "
            "the same command continues from there",
            file=sys.stderr,
        )
        return 130
    finally:
        use_json_lines(False)
    if args.json:
        print(json.dumps({"shards": r.shards, "done": r.done, "complete": r.complete, "output": out}))
    elif r.complete:
        print(f"wrote {out}: {r.shards} shard(s), {human_bytes(r.written_bytes)} this run in {r.seconds:.1f} s")
    else:
        print(f"{len(r.done)} of {r.shards} shards repacked; run again when the others are there")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.format.inspect import format_report, inspect_model

    report = inspect_model(args.files)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.format.reader import ModelFile
    from tokenwing.runtime.preflight import preflight

    with ModelFile.open(args.file) as mf:
        preflight(mf, probe_template=True)
        # the default checks what every engine start checks: the resident tensors (read as the engine loads
        # them) and the same sample of experts
        r = mf.verify(full=args.full, show_progress=progress(args), seed=args.seed, tensors=True)
    what = "all experts and tensors" if args.full else "what every start checks: metadata, tensors, sampled experts"
    print(
        f"ok: {what} ({r.experts_checked} experts, {r.tensors_checked} tensors, "
        f"{human_bytes(r.bytes_checked)}) in {r.seconds:.2f} s"
    )
    return 0


def default_output(src: str) -> str:
    stem = src[:-5] if src.endswith(".gguf") else src
    for suffix in ("-00001-of-",):
        if suffix in stem:
            stem = stem[: stem.index(suffix)]
    return stem + ".tw.gguf"


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("repack", help="convert a GGUF (or all shards of a split GGUF) to a TokenWing model file")
    r.add_argument("sources", nargs="*", help="source GGUF, or its shards (the first shard stands for all)")
    r.add_argument(
        "--shards",
        metavar="MANIFEST",
        help='the shards from a JSON manifest ({"shards": [{"path", "size", "header"}]}): shards not '
        "downloaded yet are planned from a file holding their first bytes",
    )
    r.add_argument("--plan", action="store_true", help="say what the output and the disk need; write nothing")
    r.add_argument(
        "--delete-source",
        action="store_true",
        help="repack shard by shard, deleting each shard once its data is written and verified; resumable "
        "(with --shards, shards not there yet are left for a later run)",
    )
    r.add_argument("--json", action="store_true", help="the plan (--plan) or the outcome as JSON on stdout")
    r.add_argument("-o", "--output", help="output path (default: SOURCE.tw.gguf)")
    r.add_argument("--no-verify", action="store_true", help="skip reading the output back")
    r.add_argument("--progress-json", action="store_true", help="progress as one JSON object per line on stderr")
    r.add_argument("-q", "--quiet", action="store_true")
    r.set_defaults(func=_cmd_repack)

    i = sub.add_parser("inspect", help="architecture, sizes and expert geometry of a model file or GGUF")
    i.add_argument("files", nargs="+")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_inspect)

    v = sub.add_parser("verify", help="check a TokenWing model file against its checksums")
    v.add_argument("file")
    v.add_argument(
        "--full", action="store_true", help="check every expert (default: what every start checks: a sample)"
    )
    v.add_argument("--seed", type=int, help="seed of the expert sample")
    v.add_argument("-q", "--quiet", action="store_true")
    v.set_defaults(func=_cmd_verify)
