"""The `tokenwing` command line. Every failure is one line on stderr and a non-zero exit code."""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tokenwing import interrupts
from tokenwing.errors import BadInputError, TokenWingError
from tokenwing.flags import add_device_arguments, add_engine_arguments
from tokenwing.fsutil import human_bytes, parse_size, write_atomic, write_json_atomic
from tokenwing.progress import use_json_lines
from tokenwing.testpause import pause
from tokenwing.version import __version__


def _int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers (deepseek4's --compress-ratios 0,0,4,128)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None


# `tokenwing testmodel` shape flags: dest → type (each overrides the preset's value when given).
_SHAPE_FLAGS: dict[str, Callable[[str], object]] = {
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

    try:
        shape = preset_shape(args.preset, args.arch)
        overrides = {k: getattr(args, k) for k in _SHAPE_FLAGS if getattr(args, k) is not None}
        if args.legacy_kv_b:
            overrides["legacy_kv_b"] = True
        if args.legacy_ssm_in:
            overrides["legacy_ssm_in"] = True
        if args.no_chat_template:
            overrides["chat_template"] = False
        shape = shape.with_(**overrides)
        paths = write_test_model(
            args.output, shape, args.type, args.seed, args.shards, _progress(args), expert_type=args.expert_type
        )
    except ValueError as e:
        raise BadInputError(str(e)) from None
    for p in paths:
        print(p)
    return 0


def _cmd_repack(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.format.repack import repack

    if bool(args.sources) == bool(args.shards):
        raise BadInputError("give the source GGUF (or its shards), or --shards MANIFEST, not both")
    if args.plan:
        return _repack_plan(args)
    if args.shards or args.delete_source:
        return _repack_shards(args)
    out = args.output or _default_output(args.sources[0])
    use_json_lines(args.progress_json)
    try:
        report = repack(args.sources, out, show_progress=_progress(args), verify=not args.no_verify)
    finally:
        use_json_lines(False)
    mb = report.source_bytes / 1e6
    print(
        f"wrote {out}: {human_bytes(report.output_bytes)} from {human_bytes(report.source_bytes)}, "
        f"{mb / max(report.write_seconds, 1e-9):.0f} MB/s write, verified in {report.verify_seconds:.1f} s, "
        f"peak memory {human_bytes(_peak_rss())}"
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
    out = args.output or _default_output(args.sources[0])
    shards = read_manifest(args.shards) if args.shards else shards_from_paths(args.sources, out)
    use_json_lines(args.progress_json)
    try:
        r = repack_shards(
            shards,
            out,
            delete_source=args.delete_source,
            show_progress=_progress(args),
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
        r = mf.verify(full=args.full, show_progress=_progress(args), seed=args.seed, tensors=True)
    what = "all experts and tensors" if args.full else "what every start checks: metadata, tensors, sampled experts"
    print(
        f"ok: {what} ({r.experts_checked} experts, {r.tensors_checked} tensors, "
        f"{human_bytes(r.bytes_checked)}) in {r.seconds:.2f} s"
    )
    return 0


def _cmd_tokenize(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.text.tokenizer import tokenizer_from_file

    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8", errors="strict") as f:
                text = f.read()
        except OSError as e:
            raise BadInputError(f"cannot read {args.file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise BadInputError(f"{args.file} is not UTF-8 text") from None
    else:
        text = args.text
    tok = tokenizer_from_file(args.model)
    ids = tok.encode(text, special=not args.no_special, add_bos=False if args.no_bos else None)
    if args.json:
        print(json.dumps(ids))
        return 0
    for i in ids:  # as llama.cpp's llama-tokenize lists them: the id, then the token as it prints
        print(f"{i:>8} -> {tok.piece_bytes(i).decode('utf-8', errors='backslashreplace')!r}")
    print(f"{len(ids)} tokens", file=sys.stderr)
    return 0


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


def _cmd_trace_simulate(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.streaming.trace import POLICIES, load_trace, parse_slots, prediction_recall, simulate

    trace = load_trace(args.trace)
    slots = parse_slots(args.slots, trace.n_expert)
    policies = POLICIES if args.policy == "all" else (args.policy,)
    results = [
        simulate(trace, slots, p, args.prefetch and p != "belady", args.decay_tokens, args.prefetch_votes)
        for p in policies
    ]
    recall = prediction_recall(trace)
    if args.json:
        print(json.dumps({"results": results, "prediction_recall": recall}, indent=2))
        return 0
    print(
        f"{args.trace}: {trace.n_tokens} tokens, {trace.selected.shape[1]} layers, {trace.n_expert} experts, "
        f"top-{trace.k}; {slots} slots per layer ({slots / trace.n_expert:.0%})"
    )
    if recall:
        print("prediction recall: " + ", ".join(f"{r:.1%} at {d + 1}" for d, r in enumerate(recall)))
    best = next((r["misses"] for r in results if r["policy"] == "belady"), None)
    for r in results:
        ratio = f"  {r['misses'] / best:.2f}x Belady" if best else ""
        extra = ""
        if r["prefetch"]:  # every read costs drive time: Belady's misses are also the fewest reads possible
            reads = f" ({r['reads'] / best:.2f}x Belady)" if best else ""
            extra = f"; reads {r['reads']}{reads}: prefetches {r['prefetch_reads']}, wasted {r['prefetch_wasted']}"
        print(f"  {r['policy']:<7} misses {r['misses']:>8}  miss rate {r['miss_rate']:.3f}{ratio}{extra}")
    return 0


def _cmd_trace_synth(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.streaming.trace import synthetic_trace

    t = synthetic_trace(args.tokens, args.layers, args.experts, args.k, args.zipf, args.locality, seed=args.seed)
    t.save(args.output)
    print(args.output)
    return 0


def _device_choice(args: argparse.Namespace) -> Any:
    """The device this run computes on (`--device`, `--vram-budget`); its one line waits in `args.device_line` for
    `_announce_device`, so that a bad model or prompt still gets exactly one line: its error."""
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.compute.devices import DeviceOptions
    from tokenwing.compute.probe import choose_device

    choice = choose_device(DeviceOptions.from_args(args))
    args.device_line = choice.reason
    return choice


def _announce_device(args: argparse.Namespace, session: Any = None) -> None:
    """The device line, once the input is known good: the session's (the GPU's share, or why the CPU after all)
    when it placed anything on a device, else the choice's."""
    line = getattr(args, "device_line", None)
    if line is None:  # said already
        return
    if session is not None and getattr(session, "device_line", None):
        line = session.device_line
    if line:
        _stderr_line(line)
    args.device_line = None


def _session_options(args: argparse.Namespace) -> Any:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.format.reader import ModelFile
    from tokenwing.runtime.session import SessionOptions
    from tokenwing.runtime.vram import VramOptions
    from tokenwing.streaming.settings import settings_from_args

    choice = _device_choice(args)
    if args.vram_layers is not None and args.vram_layers < 0:
        raise BadInputError("--vram-layers must be 0 or more")
    budget = None
    if args.ram_budget:
        with ModelFile.open(args.model, announce_fallback=False) as mf:
            budget = parse_size(args.ram_budget, mf.index.total_bytes)
    parallel = getattr(args, "parallel", "1")  # (serve's; one sequence elsewhere)
    if parallel != "auto" and not (parallel.isdigit() and 1 <= int(parallel) <= 64):
        raise BadInputError("--parallel must be auto or a number of requests from 1 to 64")
    return SessionOptions(
        ram_budget=budget,
        lookahead=args.lookahead,
        parallel=0 if parallel == "auto" else int(parallel),
        n_ctx=args.ctx,
        kv_type=args.kv_type,
        n_threads=args.threads,
        prompt_cache=args.prompt_cache,
        state_checkpoints=args.state_checkpoints,
        usage_table=args.usage_table,
        cpu_repack=args.cpu_repack,
        preload=args.preload,
        token_graph=args.token_graph,
        prompt_attention=args.prompt_attention,
        stream=settings_from_args(args),
        device=None if choice.on_cpu else choice,
        vram=VramOptions(max_layers=args.vram_layers, lend=args.vram_lend),
    )


def _open_session(args: argparse.Namespace) -> Any:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.runtime.session import Session

    return Session(args.model, _session_options(args))


def _cmd_run(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.runtime.generate import generate
    from tokenwing.runtime.sampler import Sampler, SamplerSettings
    from tokenwing.text.chat import FALLBACK_NOTICE, chat_format

    session = _open_session(args)
    try:
        stops = list(args.stop or ())
        if args.chat:
            fmt = chat_format(session.chat_template)
            if fmt.fallback:
                _stderr_line(FALLBACK_NOTICE)
            text = fmt.template.render([{"role": "user", "content": args.prompt}])
            prompt = session.tokenizer.encode(text, special=True)
            stops += fmt.stops
        else:
            prompt = session.tokenizer.encode(args.prompt, special=False)
        if not prompt:
            raise BadInputError("the prompt is empty")
        sampler = Sampler(
            SamplerSettings(
                temperature=args.temp,
                top_k=args.top_k,
                top_p=args.top_p,
                min_p=args.min_p,
                repeat_penalty=args.repeat_penalty,
                seed=args.seed,
            )
        )

        def show(piece: str) -> None:
            _announce_device(args, session)  # with the first output: a prompt the context refuses gets one line
            sys.stdout.write(piece)
            sys.stdout.flush()

        if args.record_trace:
            session.trace = []
        gen = generate(session, prompt, args.n, sampler, stops, on_text=show)
        _announce_device(args, session)  # (a reply with no text)
        if args.record_trace:
            session.recorded_trace().save(args.record_trace)
        sys.stdout.write("\n")
        if gen.finish_detail == "context_full":
            _stderr_line(f"stopped: the context is full ({session.n_ctx} tokens; --ctx sets it)")
        st = gen.stats
        print(
            f"tokenwing: prompt {st['prompt_tokens']} tokens at {st['prompt_tokens_per_s']:.1f} tok/s, "
            f"decode {st['decode_tokens']} tokens at {st['decode_tokens_per_s']:.1f} tok/s, SSD wait "
            f"{st['ssd_wait_ms_per_token']:.1f} ms/token, hit rate "
            f"{(st['hit_rate'] or 0) * 100:.0f}%",
            file=sys.stderr,
        )
        if args.stats_json:
            _write_json(args.stats_json, st)
    finally:
        session.close()
    return 0


def _cmd_logits(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    import numpy as np

    try:
        tokens = np.load(args.tokens, allow_pickle=False).astype(np.int64).ravel().tolist()
    except (OSError, ValueError) as e:
        raise BadInputError(f"cannot read tokens from {args.tokens}: {e}") from None
    session = _open_session(args)
    try:
        logits = session.forward(tokens, all_logits=True)
        _announce_device(args, session)  # after the tokens were checked: an error stays the only line
        if args.stats_json:
            _write_json(args.stats_json, session.stats())
    finally:
        session.close()
    write_atomic(args.out, lambda f: np.save(f, logits), logits.nbytes)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.server.serve import serve

    options = _session_options(args)
    # (with a device, the session says where it computes once it is loaded: the GPU's share, or why the CPU)
    notes = [args.device_line] if options.device is None else []
    return serve(
        args.model,
        options,
        args.host,
        args.port,
        args.watch_stdin,
        notes=notes,
        allowed_hosts=args.allowed_host,
        cors_origins=args.cors_origin,
        context_overflow=args.context_overflow,
        request_log=args.request_log,
    )


def _cmd_autotune(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.autotune.probe import probe_machine, probe_replay
    from tokenwing.autotune.solver import choose, plan_for
    from tokenwing.compute.devices import DeviceOptions
    from tokenwing.format.reader import ModelFile

    with ModelFile.open(args.model) as mf:
        record = max(el.record_size for el in mf.index.layers)
        device = DeviceOptions.from_args(args)
        machine = probe_machine(args.model, record, parse_size(args.probe_bytes), _stderr_line, device)
        slots = plan_for(mf, machine, args.ctx).slots_per_layer
        if slots < mf.index.n_expert and args.replay_tokens > 0:  # streaming: its settings are chosen by replay
            machine.replay = probe_replay(mf, slots, machine.cores, args.replay_tokens, progress=_stderr_line)
        choice = choose(mf, machine, args.ctx)
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


def _stderr_line(line: str) -> None:
    print(f"tokenwing: {line}", file=sys.stderr, flush=True)


def _write_json(path: str, data: object) -> None:
    write_json_atomic(path, data, indent=2)


def _default_output(src: str) -> str:
    stem = src[:-5] if src.endswith(".gguf") else src
    for suffix in ("-00001-of-",):
        if suffix in stem:
            stem = stem[: stem.index(suffix)]
    return stem + ".tw.gguf"


def _progress(args: argparse.Namespace) -> bool:
    return not getattr(args, "quiet", False) or getattr(args, "progress_json", False)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenwing", description="TokenWing: MoE inference that streams experts.")
    p.add_argument("--version", action="version", version=f"tokenwing {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("testmodel", help="write a random-weight GGUF of a real MoE architecture")
    t.add_argument("output", help="GGUF path to write")
    t.add_argument(
        "--arch",
        help="qwen3moe (the default), qwen2moe, ernie4_5-moe, glm4moe, deepseek2, gpt-oss, qwen3next, qwen35moe, "
        "bailingmoe3, minimax-m2, deepseek4 or kimi-k3",
    )
    t.add_argument(
        "--preset",
        default="tiny",
        help="tiny, kquant, small, bench (any architecture); kimi-tiny, ds-bench, oss-bench, ling-bench, mm-bench, "
        "ds4-bench, k3-bench, glm5-bench",
    )
    t.add_argument("--type", default="F32", help="F32 F16 BF16 Q8_0 Q4_0, MXFP4_MOE, or a K-quant such as Q4_K_M")
    t.add_argument("--expert-type", help="MXFP4: the routed experts in this type, the rest in --type")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shards", type=int, default=1, help="write a llama.cpp split model of N files")
    for name, kind in _SHAPE_FLAGS.items():
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=kind)
    t.add_argument("--legacy-kv-b", action="store_true", help="deepseek2: the older combined attn_kv_b tensor")
    t.add_argument("--legacy-ssm-in", action="store_true", help="qwen3next: the older joint ssm_in projection")
    t.add_argument("--no-chat-template", action="store_true", help="write no tokenizer.chat_template")
    t.add_argument("-q", "--quiet", action="store_true")
    t.set_defaults(func=_cmd_testmodel)

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

    run = sub.add_parser("run", help="generate text from a prompt, streaming experts from the drive")
    add_engine_arguments(run)
    run.add_argument("--prompt", "-p", required=True)
    run.add_argument("-n", type=int, default=128, help="tokens to generate at most")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--seed", type=int)
    run.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    run.add_argument("--top-k", type=int, default=40)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--min-p", type=float, default=0.0)
    run.add_argument("--repeat-penalty", type=float, default=1.0)
    run.add_argument("--stop", action="append", help="stop when this text appears (repeatable)")
    run.add_argument("--record-trace", help="write the routing trace (for `tokenwing trace simulate`)")
    run.set_defaults(func=_cmd_run)

    lg = sub.add_parser("logits", help="per-position logits of a token sequence (for oracle checks)")
    add_engine_arguments(lg)
    lg.add_argument("--tokens", required=True, help=".npy of token ids")
    lg.add_argument("--out", required=True, help=".npy to write, shape (tokens, vocabulary)")
    lg.set_defaults(func=_cmd_logits)

    sv = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (key from TOKENWING_API_KEY)",
        description="OpenAI-compatible HTTP server (docs/api.md). API key: the environment variable "
        "TOKENWING_API_KEY, if set, is the key every /v1 request must send as `Authorization: Bearer KEY` "
        "(there is no flag for it, so that it never shows in a process list); unset, no key is asked for.",
    )
    add_engine_arguments(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=0, help="0: any free port (printed in the JSON handshake)")
    sv.add_argument("--watch-stdin", action="store_true", help="stop when stdin closes (for supervisors)")
    sv.add_argument(
        "--parallel",
        default="auto",
        metavar="N",
        help="requests served at once, decoded together (each slot has its own KV cache of the context); auto: "
        "as many as memory holds with the context one would get, at most 4, the caches beyond the first taking "
        "at most a 16th of memory (default)",
    )
    sv.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests for this host name or address (repeatable; * for any): by default only "
        "localhost and this machine's addresses, so no web page can reach the server by DNS rebinding",
    )
    sv.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages from this origin (http://localhost:3000; repeatable; * for any) call the server, "
        "with CORS; by default no web page may",
    )
    sv.add_argument(
        "--context-overflow",
        choices=("rolling", "trim-middle", "stop"),  # (server/protocol.py OVERFLOW_POLICIES: not imported here)
        default="rolling",
        help="a chat request whose messages leave the reply no room in the context (its max_tokens, else a quarter "
        "of the context): rolling drops the oldest turns, trim-middle those after the first user turn, stop "
        "refuses it (400 context_length_exceeded); the system prompt, the tools and the last user message are "
        "always kept. A request's own context_overflow field overrides it (default: rolling)",
    )
    sv.add_argument(
        "--request-log",
        action="store_true",
        help="one line per API request on stderr once it has ended: `request {time, method, path, status, ms, "
        "prompt_tokens, completion_tokens}` (no key, no text; the app's Server page lists them)",
    )
    sv.set_defaults(func=_cmd_serve)

    at = sub.add_parser("autotune", help="probe this machine and the drive, and choose settings for a model")
    at.add_argument("model")
    at.add_argument("--ctx", type=int, default=4096, help="context length to plan the KV cache for")
    at.add_argument("--probe-bytes", default="256M", help="bytes to read per drive measurement")
    at.add_argument(
        "--replay-tokens", type=int, default=24, help="decode tokens replayed through the core per setting (0: none)"
    )
    at.add_argument("--json", action="store_true")
    add_device_arguments(at)
    at.set_defaults(func=_cmd_autotune)

    tk = sub.add_parser("tokenize", help="the token ids of a text, as the model's own tokenizer makes them")
    tk.add_argument("model", help="a TokenWing model file or a GGUF (the first shard of a split one)")
    src = tk.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the text to tokenize")
    src.add_argument("--file", help="a UTF-8 file whose text to tokenize")
    tk.add_argument("--json", action="store_true", help="print the ids as one JSON list")
    tk.add_argument(
        "--no-bos", action="store_true", help="never put the BOS token first (by default: as the model says)"
    )
    tk.add_argument(
        "--no-special",
        action="store_true",
        help="special tokens' texts are plain text (by default they are the tokens)",
    )
    tk.set_defaults(func=_cmd_tokenize)

    inf = sub.add_parser(
        "info", help="version, architectures, memory, devices, flags, exit codes (what the app asks the engine)"
    )
    inf.add_argument("model", nargs="?", help="also what this model file's KV cache takes per token")
    inf.add_argument("--json", action="store_true")
    inf.add_argument("--drive", help="also measure direct reads from this file (e.g. a model file)")
    inf.add_argument("--probe-bytes", default="64M", help="bytes to read per drive measurement")
    inf.set_defaults(func=_cmd_info)

    tr = sub.add_parser("trace", help="routing traces: replay through the cache policies, or synthesise one")
    trs = tr.add_subparsers(dest="trace_command", required=True)
    sim = trs.add_parser("simulate", help="misses of decay, LRU and Belady on a recorded routing trace")
    sim.add_argument("trace")
    sim.add_argument("--slots", required=True, help="slots per layer: a count, or a percentage of the experts")
    sim.add_argument("--policy", default="all", choices=["decay", "history", "lru", "belady", "all"])
    sim.add_argument("--prefetch", action="store_true", help="load the trace's predictions ahead (instantly)")
    sim.add_argument("--decay-tokens", type=int, default=0, help="half-life in tokens (0: each policy's own)")
    sim.add_argument(
        "--prefetch-votes",
        type=int,
        default=2,
        help="with --prefetch: read a prediction once this many distances name it",
    )
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=_cmd_trace_simulate)
    syn = trs.add_parser("synth", help="write a synthetic Zipf-skewed, temporally local routing trace")
    syn.add_argument("output")
    syn.add_argument("--tokens", type=int, default=1000)
    syn.add_argument("--layers", type=int, default=12)
    syn.add_argument("--experts", type=int, default=128)
    syn.add_argument("--k", type=int, default=8)
    syn.add_argument("--zipf", type=float, default=1.0)
    syn.add_argument("--locality", type=float, default=0.3)
    syn.add_argument("--seed", type=int, default=0)
    syn.set_defaults(func=_cmd_trace_synth)
    return p


def _one_line(message: str, most: int = 2000) -> str:
    """An error as one line of bounded length, whatever a file's names or values put in it (a crafted tensor name
    may hold line breaks, or be megabytes long)."""
    flat = " ".join(message.splitlines())
    return flat if len(flat) <= most else flat[:most] + "…"


def main(argv: Sequence[str] | None = None) -> int:
    """The `tokenwing` process's entry point (it takes over SIGINT and SIGTERM: see interrupts.py)."""
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["__device_probe"] and len(argv) == 2:  # the child compute/probe.py starts (not for users)
        # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
        from tokenwing.compute.probe import run_probe

        return run_probe(argv[1])
    if argv == ["__render_worker"]:  # the chat templates' renderer child (text/render_worker.py; not for users)
        from tokenwing.text.render_child import run_worker  # (lazy: the child needs nothing else)

        return run_worker()
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    interrupts.install()
    try:
        try:
            return func(args)
        finally:
            interrupts.settle()
            pause("cli.decided")
    except TokenWingError as e:
        print(f"tokenwing: error: {_one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        by = f" by {e.args[0]}" if isinstance(e, interrupts.Interrupted) and e.signum != signal.SIGINT else ""
        print(f"tokenwing: interrupted{by}; nothing partial was kept", file=sys.stderr)
        return interrupts.exit_code(e)
    except MemoryError:
        print("tokenwing: error: out of memory", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
