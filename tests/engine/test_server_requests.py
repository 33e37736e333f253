"""`tokenwing serve` with unusual requests, through the official `openai` client and raw HTTP: log-probabilities
checked against the engine's own `tokenwing logits`, refused features, invalid text, the context's end, a model
without a chat template, concurrent clients, and a model file that goes bad while the server runs."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tests.engine.test_server import KEY, Server
from tests.pauses import Pauses
from tokenwing.format.reader import ModelFile
from tokenwing.text.chat import ChatTemplate, chat_format
from tokenwing.text.tokenizer import TextTokenizer, tokenizer_from_metadata

AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}  # raw bodies say what they are (the server takes JSON only)


# experts stream: the decode path is the one that reads the drive; a prompt's attention as two products, as the
# logprobs' reference computes it (`_engine_logprobs`)
SERVER_ARGS = ("--ram-budget", "30%", "--prompt-attention", "products")


@pytest.fixture(scope="module")
def model(repacked_factory: ModelFactory) -> Path:
    return repacked_factory(type="Q8_0", n_layer=3)


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    s = Server(model, *SERVER_ARGS)
    yield s
    s.stop()


def _tokenizer(model: Path) -> tuple[TextTokenizer, ChatTemplate | None]:
    with ModelFile.open(str(model)) as mf:
        meta = {k: v.value for k, v in mf.header.kv.items()}
    template = meta.get("tokenizer.chat_template")
    return tokenizer_from_metadata(meta, str(model)), ChatTemplate(template) if isinstance(template, str) else None


def _engine_logprobs(model: Path, tokens: list[int], tmp_path: Path) -> np.ndarray:
    """log-softmax of `tokenwing logits` for the sequence: row i is the distribution of token i + 1. (Attention
    as two products, as the server of these tests and every decode step compute it: the default flash attention
    of a prompt rounds further from a decode step, up to 1.2e-3 in a logprob on this random model.)"""
    np.save(tmp_path / "in.npy", np.array(tokens))
    r = run_cli(
        "logits",
        str(model),
        "--tokens",
        str(tmp_path / "in.npy"),
        "--out",
        str(tmp_path / "out.npy"),
        "--prompt-attention",
        "products",
    )
    assert r.returncode == 0, r.stderr
    z = np.load(tmp_path / "out.npy").astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    out: np.ndarray = z - (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))
    return out


def _extra(lp: object) -> list[dict[str, object]]:
    """llama.cpp's `content` list, which completions carry beside OpenAI's legacy lists."""
    return lp.model_extra["content"]  # type: ignore[attr-defined,no-any-return]


def _check_against_engine(entries: list[dict[str, object]], prompt: list[int], model: Path, tmp_path: Path) -> None:
    """Each token's logprob and its alternatives (ids, order, values) equal the engine's own log-softmax."""
    ids = [int(e["id"]) for e in entries]
    assert ids, "no tokens came back"
    lp = _engine_logprobs(model, prompt + ids, tmp_path)
    for j, e in enumerate(entries):
        row = lp[len(prompt) - 1 + j]
        # a decode step and a prompt pass round differently (ggml's batched kernels): well under a bit of slack
        assert e["logprob"] == pytest.approx(row[ids[j]], abs=1e-3)
        top = e["top_logprobs"]
        assert isinstance(top, list) and len(top) == 3
        assert [t["logprob"] for t in top] == pytest.approx(np.sort(row)[::-1][:3], abs=1e-3)
        assert all(t["logprob"] == pytest.approx(row[t["id"]], abs=1e-3) for t in top)


# ---------------------------------------------------------------------------------------------- logprobs
def test_completion_logprobs_equal_the_engines_logits(server: Server, model: Path, tmp_path: Path) -> None:
    tok, _ = _tokenizer(model)
    c = server.client()
    prompt = "Once upon a time"
    r = c.completions.create(model="x", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    entries = _extra(lp)
    _check_against_engine(entries, tok.encode(prompt, special=False), model, tmp_path)
    assert lp.token_logprobs == [e["logprob"] for e in entries]
    assert lp.tokens == [e["token"] for e in entries] and len(lp.tokens) == r.usage.completion_tokens
    assert lp.top_logprobs is not None and all(len(t) >= 1 for t in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # greedy: the chosen token is the most likely one
    assert all(e["top_logprobs"][0]["id"] == e["id"] for e in entries)

    streamed = list(
        c.completions.create(model="x", prompt=prompt, max_tokens=6, temperature=0, logprobs=3, stream=True)
    )
    got = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in _extra(ch.choices[0].logprobs)]
    assert got == entries  # the same tokens and values, spread over the chunks
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.choices[0].text


def test_chat_logprobs_streamed_and_not(server: Server, model: Path, tmp_path: Path) -> None:
    tok, template = _tokenizer(model)
    assert template is not None
    messages = [{"role": "user", "content": "Tell me a story"}]
    c = server.client()
    r = c.chat.completions.create(
        model="x", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None
    entries = [e.model_dump() for e in lp.content]
    assert all(isinstance(e["bytes"], list) for e in entries)
    prompt = tok.encode(template.render(messages), special=True)
    _check_against_engine(entries, prompt, model, tmp_path)
    chunks = list(
        c.chat.completions.create(
            model="x", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
    )
    streamed = [
        e.model_dump()
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content or []
    ]
    assert streamed == entries
    # without logprobs the field is null, as OpenAI sends it
    plain = c.chat.completions.create(model="x", messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logprob_requests_are_validated(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="requires 'logprobs'"):
        c.chat.completions.create(model="x", messages=msgs, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        c.chat.completions.create(model="x", messages=msgs, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        c.completions.create(model="x", prompt="x", logprobs=99)


def test_ignore_eos_never_samples_an_end(model: Path) -> None:
    """llama.cpp's `ignore_eos`: the end-of-generation tokens are masked before sampling (the reply runs to
    max_tokens); the log-probabilities stay the model's own. Logits whose highest is the EOS token end the reply
    without it and give the next best with it."""
    from tokenwing.runtime.generate import Decoding
    from tokenwing.runtime.sampler import Sampler, SamplerSettings
    from tokenwing.runtime.session import Session, SessionOptions

    s = Session(str(model), SessionOptions(n_ctx=64), log=lambda line: None)
    try:
        logits = s.forward([5, 6, 7], prompt=True)
        eos = min(s.tokenizer.eos_ids)
        ending = logits.copy()
        ending[eos] = logits.max() + 5.0
        greedy = SamplerSettings(temperature=0.0)
        plain = Decoding(s, [5, 6, 7], 8, Sampler(greedy))
        assert plain.step(ending) is None and plain.gen.finish_detail == "eos"
        kept = Decoding(s, [5, 6, 7], 8, Sampler(greedy), logprobs=1, ignore_eos=True)
        tok = kept.step(ending)
        others = ending.copy()
        others[sorted(s.tokenizer.eos_ids)] = -np.inf
        assert tok == int(others.argmax()) and tok not in s.tokenizer.eos_ids
        assert kept.gen.logprobs[0].top[0][0] == eos  # (the model's own distribution, EOS first)
    finally:
        s.close()


def test_ignore_eos_through_the_server(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "x"}]
    r = c.chat.completions.create(model="x", messages=msgs, max_tokens=6, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        c.chat.completions.create(model="x", messages=msgs, max_tokens=2, extra_body={"ignore_eos": "yes"})


# ---------------------------------------------------------------------------------------------- refused, invalid
def test_unsupported_features_are_refused(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "What is the weather?"}]
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="tools"):  # chat only (tests/engine/test_server_tools.py)
        c.completions.create(model="x", prompt="x", extra_body={"tools": [tool]})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        c.chat.completions.create(model="x", messages=msgs, tool_choice="required")  # no tools to choose from
    with pytest.raises(openai.BadRequestError, match="use tools"):
        c.chat.completions.create(model="x", messages=msgs, functions=[{"name": "f"}])
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(model="x", messages=msgs, response_format={"type": "xml"})  # type: ignore[typeddict-item]
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        c.completions.create(model="x", prompt="x", logit_bias={"5": 10})
    with pytest.raises(openai.BadRequestError, match="echo"):
        c.completions.create(model="x", prompt="x", echo=True)
    # values that ask for nothing beyond plain text pass
    ok = c.chat.completions.create(
        model="x", messages=msgs, max_tokens=2, tool_choice="none", response_format={"type": "text"}
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_lone_surrogate_is_a_clean_400(server: Server) -> None:
    # JSON may carry "\ud800"; the official client cannot even encode it, so raw bytes carry it
    for path, body in (
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
        ("/v1/completions", b'{"prompt": "x\\ud83d"}'),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}'),
    ):
        r = httpx.post(server.url + path, content=body, headers=JSON, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "surrogate" in err["message"] and err["type"] == "invalid_request_error"
    # a proper pair is fine
    r = httpx.post(
        server.url + "/v1/completions", content=b'{"prompt": "x\\ud83d\\ude00", "max_tokens": 1}', headers=JSON
    )
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


# ---------------------------------------------------------------------------------------------- the context's end
def test_context_limits_through_the_server(model: Path) -> None:
    tok, _ = _tokenizer(model)
    s = Server(model, "--ctx", "32")
    try:
        c = s.client()
        long_prompt = "the quick brown fox " * 20
        assert len(tok.encode(long_prompt, special=False)) > 32
        for stream in (False, True):  # refused with a status before any stream starts, with OpenAI's code
            with pytest.raises(openai.BadRequestError, match=r"does not fit the context \(32 tokens\)") as e:
                c.completions.create(model="x", prompt=long_prompt, max_tokens=4, stream=stream)
            assert e.value.code == "context_length_exceeded"
            # a chat's last message is never dropped (tests/engine/test_server_overflow.py)
            with pytest.raises(openai.BadRequestError, match=r"message takes \d+ tokens of the 32-token context") as e:
                c.chat.completions.create(model="x", messages=[{"role": "user", "content": long_prompt}], stream=stream)
            assert e.value.code == "context_length_exceeded"
        # a prompt that leaves 2 tokens of room, asking for 50: "length", and the reason says the context is full
        words = "Once upon a time there was a fox who lived"
        prompt = tok.encode(words, special=False)
        while len(prompt) < 30:
            words += " and"
            prompt = tok.encode(words, special=False)
        assert len(prompt) == 30
        r = c.completions.create(model="x", prompt=words, max_tokens=50, temperature=0)
        assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 2
        assert r.model_extra["tokenwing"]["finish_detail"] == "context_full"
        assert r.model_extra["tokenwing"]["n_ctx"] == 32
        chunks = list(c.completions.create(model="x", prompt=words, max_tokens=50, temperature=0, stream=True))
        last = [ch for ch in chunks if ch.choices][-1]
        assert last.choices[0].finish_reason == "length"
        assert last.model_extra["tokenwing"]["finish_detail"] == "context_full"
        # asking for fewer tokens than the room: the ordinary "max_tokens"
        r = c.completions.create(model="x", prompt=words, max_tokens=1, temperature=0)
        assert r.model_extra["tokenwing"]["finish_detail"] == "max_tokens"
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
    finally:
        s.stop()


def test_context_limits_through_the_cli(model: Path) -> None:
    r = run_cli("run", str(model), "--ctx", "32", "--prompt", "the quick brown fox " * 20, "-n", "4")
    assert_clean_error(r, 2)
    assert "does not fit the context (32 tokens)" in r.stderr
    tok, _ = _tokenizer(model)
    words = "Once upon a time there was a fox who lived"
    while len(tok.encode(words, special=False)) < 30:
        words += " and"
    r = run_cli("run", str(model), "--ctx", "32", "--prompt", words, "-n", "50", "--stats-json", "/dev/stdout")
    assert r.returncode == 0, r.stderr
    assert "stopped: the context is full (32 tokens" in r.stderr
    r = run_cli("run", str(model), "--ctx", "32", "--prompt", words, "-n", "1")
    assert r.returncode == 0 and "context is full" not in r.stderr


# ---------------------------------------------------------------------------------------------- no chat template
def test_model_without_chat_template_falls_back_to_chatml(repacked_factory: ModelFactory) -> None:
    bare = repacked_factory(type="Q8_0", chat_template=False)
    tok, template = _tokenizer(bare)
    assert template is None  # the file really has none
    s = Server(bare)
    try:
        c = s.client()
        [m] = c.models.list().data
        assert m.model_extra["chat_template"] == {"kind": "fallback", "name": "chatml"}
        msgs = [{"role": "user", "content": "Hello"}]
        r = c.chat.completions.create(model="x", messages=msgs, max_tokens=5, temperature=0)
        # exactly what the ChatML prompt gives through /v1/completions (control tokens as tokens)
        rendered = chat_format(None).template.render(msgs)
        assert r.usage is not None and r.usage.prompt_tokens == len(tok.encode(rendered, special=True))
        assert r.choices[0].message.content is not None
    finally:
        err = s.stop()
    assert "the model has no chat template: chats use the ChatML fallback" in err
    r2 = run_cli("run", str(bare), "--chat", "--prompt", "Hello", "-n", "3")
    assert r2.returncode == 0, r2.stderr
    assert "ChatML fallback" in r2.stderr


def test_model_with_a_template_says_so(server: Server) -> None:
    [m] = server.client().models.list().data
    assert m.model_extra["chat_template"] == {"kind": "model", "name": None}


# ---------------------------------------------------------------------------------------------- concurrency
def test_four_concurrent_clients_get_what_each_gets_alone(
    server: Server, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four clients at once, streaming and not, one of them hanging up mid-reply: each of the others gets exactly
    its text from alone (temperature 0), the one that hung up a prefix of its own. The engine holds the first
    reply after two pieces (its test-only pause serve.piece2), so that client really hangs up in the
    middle of a generation while the three others wait in the queue, whatever the machine's speed."""
    prompts = ["Once upon a time", "The fox", "In a land far away", "Tell me about"]
    c = server.client()
    alone = [c.completions.create(model="x", prompt=p, max_tokens=24, temperature=0).choices[0].text for p in prompts]
    assert len(set(alone)) == 4 and all(alone)
    pauses = Pauses(tmp_path / "pauses", "serve.piece2")
    pauses.arm(monkeypatch)
    s = Server(model, *SERVER_ARGS)
    for key in pauses.env({}):
        monkeypatch.delenv(key)
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    holding, hang_up = threading.Event(), threading.Event()

    def plain(i: int) -> None:
        r = s.client().completions.create(model="x", prompt=prompts[i], max_tokens=24, temperature=0)
        got[i] = r.choices[0].text

    def streamed_openai(i: int) -> None:
        chunks = s.client().completions.create(model="x", prompt=prompts[i], max_tokens=24, temperature=0, stream=True)
        got[i] = "".join(ch.choices[0].text for ch in chunks if ch.choices)

    def streamed(i: int, hang_up_after: int) -> None:
        text = ""
        chunks = 0
        body = {"prompt": prompts[i], "max_tokens": 24, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                chunks += 1
                if chunks == hang_up_after:
                    assert pauses.reached("serve.piece2") is not None  # the engine is in the middle of this reply
                    holding.set()
                    assert hang_up.wait(120)
                    break  # closing the stream mid-reply cancels it in the engine
        got[i] = text

    def guard(fn: object, *args: object) -> None:
        try:
            fn(*args)
        except BaseException as e:  # reported below
            errors.append(e)

    try:
        first = threading.Thread(target=guard, args=(streamed, 3, 2))
        first.start()
        assert holding.wait(120), errors
        others = [
            threading.Thread(target=guard, args=(plain, 0)),
            threading.Thread(target=guard, args=(streamed_openai, 1)),
            threading.Thread(target=guard, args=(plain, 2)),
        ]
        for t in others:
            t.start()
        deadline = time.monotonic() + 120
        while httpx.get(s.url + "/health").json()["queued"] < 3:  # all three wait behind the held reply
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.02)
        hang_up.set()
        for t in [first, *others]:
            t.join(timeout=300)
        assert not errors, errors
        assert got[0] == alone[0] and got[1] == alone[1] and got[2] == alone[2]
        assert got[3] and alone[3].startswith(got[3]) and got[3] != alone[3]
        # the hung-up reply was cancelled in the engine: its tokens stopped at the hang-up
        totals = httpx.get(s.url + "/v1/tokenwing/stats", headers=AUTH).json()["totals"]
        assert totals["requests"] == 4 and totals["completion_tokens"] < 4 * 24
        # and after all that, alone again gives the same
        again = s.client().completions.create(model="x", prompt=prompts[3], max_tokens=24, temperature=0)
        assert again.choices[0].text == alone[3]
    finally:
        hang_up.set()
        s.stop()


# ---------------------------------------------------------------------------------------------- a corrupt expert
def test_expert_corrupted_while_serving(model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "c.tw.gguf"
    copy.write_bytes(model.read_bytes())
    # checksum checking on; nothing read ahead or at start, so the expert is read from the file after the damage
    s = Server(
        copy,
        "--moe-stream-verify",
        "--ram-budget",
        "1",
        "--no-preload",
        "--no-usage-table",
        "--moe-stream-idle-fill-ms",
        "-1",
    )
    try:
        with ModelFile.open(str(copy)) as mf:
            el = mf.index.layers[0]
            at = el.expert_offset(0) + el.record_size // 2
        with open(copy, "r+b") as f:  # flip 4 bytes of expert 0 of the first streamed layer
            f.seek(at)
            old = f.read(4)
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in old))
        c = s.client()
        prompt = "The quick brown fox jumps over the lazy dog. " * 8  # long enough to route to every expert
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="x", prompt=prompt, max_tokens=4, temperature=0)
        assert "damaged" in str(e.value) and "expert 0 of layer" in str(e.value)
        h = httpx.get(s.url + "/health")
        assert h.status_code == 200 and s.proc.poll() is None  # still up
        assert h.json()["status"] == "degraded" and "expert 0 of layer" in h.json()["error"]
        assert [m.id for m in c.models.list().data] == [s.handshake["model"]]
        with pytest.raises(openai.APIError, match="damaged"):  # streamed: the error comes in the stream
            list(c.completions.create(model="x", prompt=prompt, max_tokens=4, temperature=0, stream=True))
        assert s.proc.poll() is None
    finally:
        err = s.stop()
    assert "Traceback" not in err and "the model file is damaged" in err


def test_corrupt_resident_tensor_stops_serve_with_the_corrupt_exit_code(model: Path, tmp_path: Path) -> None:
    """Found only while loading (after the handshake): the process still exits 3, so a supervisor sees a damaged
    file (final), not a crash to restart."""
    data = bytearray(model.read_bytes())
    with ModelFile.open(str(model)) as mf:
        out = next(t for t in mf.resident if t.name == "output.weight")
        data[mf.tensor_offset(out) + 5] ^= 0xFF
    bad = tmp_path / "bad.tw.gguf"
    bad.write_bytes(bytes(data))
    r = run_cli("serve", str(bad), "--ctx", "64")
    assert r.returncode == 3, r.stderr
    assert "tensor output.weight fails its checksum" in r.stderr and "Traceback" not in r.stderr
