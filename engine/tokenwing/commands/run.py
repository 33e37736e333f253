"""The commands that load a model and compute: `tokenwing run`, `logits` and `serve`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tokenwing.commands.common import stderr_line
from tokenwing.errors import BadInputError
from tokenwing.flags import add_engine_arguments
from tokenwing.fsutil import parse_size, write_atomic, write_json_atomic


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
        stderr_line(line)
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
    held: tuple[tuple[str, int], ...] = ()
    keep = 0  # VRAM the tier leaves free for the image encoder
    if getattr(args, "mmproj", None) and os.path.isfile(args.mmproj):  # (a missing file: its own line, later)
        # (lazy, as above: only a run with an image encoder reads it)
        from tokenwing.vision.logits import encoder_memory

        memory = encoder_memory(args.mmproj)
        held = ((memory.describe(), memory.total),)
        keep = 0 if choice.on_cpu else memory.vram_keep
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
        vram=VramOptions(max_layers=args.vram_layers, lend=args.vram_lend, keep=keep),
        also_held=held,
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
                stderr_line(FALLBACK_NOTICE)
            text = fmt.template.render([{"role": "user", "content": args.prompt}])
            prompt = session.tokenizer.encode(text, special=True)
            stops += fmt.stops
        if args.image or args.mmproj:  # the image where the prompt has <__media__>, as llama.cpp's mtmd-cli
            prompt, session.media = _image_prompt(args, session, text if args.chat else args.prompt)
        elif not args.chat:
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
            stderr_line(f"stopped: the context is full ({session.n_ctx} tokens; --ctx sets it)")
        st = gen.stats
        print(
            f"tokenwing: prompt {st['prompt_tokens']} tokens at {st['prompt_tokens_per_s']:.1f} tok/s, "
            f"decode {st['decode_tokens']} tokens at {st['decode_tokens_per_s']:.1f} tok/s, SSD wait "
            f"{st['ssd_wait_ms_per_token']:.1f} ms/token, hit rate "
            f"{(st['hit_rate'] or 0) * 100:.0f}%",
            file=sys.stderr,
        )
        if args.stats_json:
            write_json(args.stats_json, st)
    finally:
        session.close()
    return 0


def _cmd_logits(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    import numpy as np

    if args.image or args.mmproj or args.text is not None:
        return _image_logits(args)
    if not args.tokens:
        raise BadInputError("logits: --tokens (or --mmproj, --image and --text)")
    try:
        tokens = np.load(args.tokens, allow_pickle=False).astype(np.int64).ravel().tolist()
    except (OSError, ValueError) as e:
        raise BadInputError(f"cannot read tokens from {args.tokens}: {e}") from None
    session = _open_session(args)
    try:
        logits = session.forward(tokens, all_logits=True)
        _announce_device(args, session)  # after the tokens were checked: an error stays the only line
        if args.stats_json:
            write_json(args.stats_json, session.stats())
    finally:
        session.close()
    write_atomic(args.out, lambda f: np.save(f, logits), logits.nbytes)
    return 0


def _image_prompt(args: argparse.Namespace, session: Any, text: str) -> tuple[list[int], Any]:
    # (lazy: only a prompt with an image loads the encoder and its ggml graph)
    from tokenwing.vision.logits import image_prompt

    if not (args.image and args.mmproj):
        raise BadInputError("an image takes --mmproj and --image, and <__media__> in the prompt where it goes")
    return image_prompt(session, args.mmproj, args.image, text)


def _image_logits(args: argparse.Namespace) -> int:
    """The last position's logits, (1, n_vocab), of --text with --image where <__media__> is (issue 45)."""
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    import numpy as np

    from tokenwing.vision.logits import image_logits  # (lazy, as above: the encoder and its ggml graph)

    if not (args.image and args.mmproj and args.text is not None) or args.tokens:
        raise BadInputError("logits: an image takes --mmproj, --image and --text (with <__media__>), not --tokens")
    session = _open_session(args)
    try:
        logits = image_logits(session, args.mmproj, args.image, args.text)
        _announce_device(args, session)
    finally:
        session.close()
    write_atomic(args.out, lambda f: np.save(f, logits), logits.nbytes)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    # (lazy: only this command loads these; all of them at start-up took 2.4-3.4 s, not 0.25 s)
    from tokenwing.server.serve import serve

    if args.prompt_cache_size is not None:
        parse_size(args.prompt_cache_size, 100)  # (a bad size: one line before the handshake)
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
        prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_size=args.prompt_cache_size,
        mmproj=args.mmproj,
        allow_image_urls=args.allow_image_urls,
    )


def write_json(path: str, data: object) -> None:
    write_json_atomic(path, data, indent=2)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    run.add_argument("--mmproj", help="the image encoder's GGUF (with --image)")
    run.add_argument("--image", help="a PNG image, where the prompt has <__media__>")
    run.set_defaults(func=_cmd_run)

    lg = sub.add_parser("logits", help="per-position logits of a token sequence (for oracle checks)")
    add_engine_arguments(lg)
    lg.add_argument("--tokens", help=".npy of token ids")
    lg.add_argument("--mmproj", help="the image encoder's GGUF (with --image and --text)")
    lg.add_argument("--image", help="a PNG image, where --text has <__media__>")
    lg.add_argument("--text", help="the prompt's text, <__media__> where the image goes")
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
    sv.add_argument(
        "--prompt-cache-dir",
        metavar="DIR",
        help="where each slot's context is kept when its request ends, so that a later request (or another server "
        "on the same model) restores it instead of computing it again (docs/prompt-cache.md); default: "
        "prompt-cache under the user's cache folder (--no-prompt-cache: none)",
    )
    sv.add_argument(
        "--prompt-cache-size",
        metavar="SIZE",
        help="the most those contexts take on disk (20G, or 10%% of the drive's free space; 0: none), the least "
        "recently used going first; default: a quarter of the free space, at most 20G",
    )
    sv.add_argument(
        "--mmproj",
        metavar="FILE",
        help="the model's image encoder (an mmproj GGUF): chat messages may then carry images, as image_url parts "
        "with a data: URL (docs/api.md, Images)",
    )
    sv.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch an image_url's remote http(s) image (at most 8 MiB, 10 s); by default only data: URLs are taken "
        "and a remote URL is refused with a 400",
    )
    sv.set_defaults(func=_cmd_serve)
