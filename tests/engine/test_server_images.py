"""Images through a real `tokenwing serve --mmproj` (issue 45 item 4): the factory's qwen3vlmoe model and its
mmproj, OpenAI's image_url parts sent with the official `openai` client. The reply's first-token log-probabilities
are those of `tokenwing logits --mmproj --image --text` on the prompt /apply-template shows (that command is exact
against llama.cpp's libmtmd: tests/oracle/test_qwen3vl_images.py), streamed at 25 % of the expert bytes too; a slot's
cached tokens and the prompt cache on disk never give one image's keys and values to another; bad images are 400s."""

from __future__ import annotations

import base64
import functools
import http.server
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import run_cli
from tests.engine.test_server import KEY, Server
from tests.engine.test_server_messages import client as anthropic_client
from tests.engine.test_server_parallel import _together
from tests.oracle.test_qwen3vl_images import factory_files, image, write_png
from tests.pauses import Pauses
from tokenwing.errors import BadInputError
from tokenwing.vision.png import decode_png

TEXT = "What is this?"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The factory's qwen3vlmoe model (repacked, so that its experts stream) and its mmproj."""
    _, mmproj, repacked = factory_files(tmp_path_factory.mktemp("vl"), "qwen3vlmoe")
    return repacked, mmproj


@pytest.fixture(scope="module")
def server(files: tuple[Path, Path]) -> Iterator[Server]:
    """One slot, so that every request reuses (or must not reuse) the one before's cached tokens; remote images
    fetched (the other servers here refuse them)."""
    s = Server(files[0], "--mmproj", str(files[1]), "--kv-type", "f32", "--parallel", "1", "--allow-image-urls")
    yield s
    s.stop()


def png_bytes(px: np.ndarray, tmp: Path) -> bytes:
    write_png(tmp, px)
    return tmp.read_bytes()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def messages(url: str, text: str = TEXT) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}
    ]


def reference(files: tuple[Path, Path], server: Server, png: Path, msgs: list[dict[str, Any]], tmp: Path) -> np.ndarray:
    """`tokenwing logits` of the prompt the server makes of these messages (its /apply-template), as log-probs."""
    prompt = httpx.post(server.url + "/apply-template", json={"messages": msgs}, headers=AUTH).json()["prompt"]
    assert prompt.count("<__media__>") == 1, prompt  # where the image goes
    args = ["--mmproj", str(files[1]), "--image", str(png), "--text", prompt, "--kv-type", "f32"]
    r = run_cli("logits", str(files[0]), *args, "--out", str(tmp / "ref.npy"))
    assert r.returncode == 0, r.stderr
    z = np.load(tmp / "ref.npy")[0].astype(np.float64)
    return z - (np.log(np.exp(z - z.max()).sum()) + z.max())


def first_logprobs(server: Server, msgs: list[dict[str, Any]], stream: bool = False) -> tuple[dict[int, float], Any]:
    """The reply's first token's top-20 log-probabilities by id (llama.cpp's `id` field), and the response."""
    body = {"model": "m", "messages": msgs, "max_tokens": 2, "temperature": 0, "logprobs": True, "top_logprobs": 20}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120,
                   headers=AUTH)  # fmt: skip
    assert r.status_code == 200, r.text
    first = r.json()["choices"][0]["logprobs"]["content"][0]
    return {e["id"]: e["logprob"] for e in first["top_logprobs"]}, r.json()


def assert_matches(got: dict[int, float], ref: np.ndarray) -> None:
    top = np.argsort(-ref, kind="stable")[:20]
    assert list(got) == top.tolist()
    np.testing.assert_allclose([got[int(i)] for i in top], ref[top], atol=1e-5)


def test_the_openai_client_sends_an_image_and_streams_a_reply(server: Server, tmp_path: Path) -> None:
    url = data_url(png_bytes(image(48, 64, seed=1), tmp_path / "a.png"))
    client = server.client()
    msgs: Any = messages(url)
    opts: Any = {"include_usage": True}
    chunks = list(
        client.chat.completions.create(
            model="m", messages=msgs, max_tokens=4, temperature=0, stream=True, stream_options=opts
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= 4
    whole = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
    assert whole.choices[0].message.content == text
    # the image's rows count: 64×48 is 4×3 merged patches, 12 rows more than the same text without it
    plain = client.chat.completions.create(model="m", messages=[{"role": "user", "content": TEXT}], max_tokens=1)
    assert whole.usage is not None and plain.usage is not None
    with_markers = len(server_tokens(server, "<|vision_start|><|vision_end|>"))
    assert whole.usage.prompt_tokens == plain.usage.prompt_tokens + 12 + with_markers


def test_the_responses_and_messages_apis_take_images(server: Server, tmp_path: Path) -> None:
    """The Responses API's input_image and Anthropic's base64 image block, with their official clients: the same
    prompt as the chat endpoint's (its tokens), the same greedy reply; /v1/messages/count_tokens and /v1/chat/count
    count it too."""
    png = png_bytes(image(48, 64, seed=8), tmp_path / "a.png")
    chat = server.client().chat.completions.create(model="m", messages=messages(data_url(png)),  # type: ignore[arg-type]
                                                   max_tokens=3, temperature=0)  # fmt: skip
    assert chat.usage is not None
    parts: Any = [{"type": "input_text", "text": TEXT}, {"type": "input_image", "image_url": data_url(png)}]
    r = server.client().responses.create(model="m", input=[{"role": "user", "content": parts}], max_output_tokens=3,
                                         temperature=0)  # fmt: skip
    assert r.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}
    blocks: Any = [{"type": "text", "text": TEXT}, {"type": "image", "source": source}]
    m = anthropic_client(server).messages.create(model="m", max_tokens=3, extra_body={"temperature": 0},
                                                 messages=[{"role": "user", "content": blocks}])  # fmt: skip
    assert m.usage.input_tokens == chat.usage.prompt_tokens
    # the count routes count the image's rows as the engine places them (no encoder run)
    counted = anthropic_client(server).messages.count_tokens(model="m", messages=[{"role": "user", "content": blocks}])
    assert counted.input_tokens == chat.usage.prompt_tokens
    r = httpx.post(server.url + "/v1/chat/count", json={"messages": messages(data_url(png))}, headers=AUTH)
    assert r.status_code == 200 and r.json()["prompt_tokens"] == chat.usage.prompt_tokens, r.text
    assert "".join(b.text for b in m.content if b.type == "text") == chat.choices[0].message.content


def server_tokens(server: Server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"content": text, "with_pieces": False},
                   headers=AUTH)  # fmt: skip
    assert r.status_code == 200, r.text
    return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]


def test_first_token_logprobs_are_tokenwing_logits(files: tuple[Path, Path], server: Server, tmp_path: Path) -> None:
    """The server's prompt with the image gives the logits `tokenwing logits --mmproj --image` gives (exact vs
    libmtmd); then a different image in the same place, in the same slot after the first: its own logits, not the
    first image's keys and values (the slot's cached tokens stop where the images differ)."""
    msgs_a, msgs_b = [], []
    for name, seed, out in (("a", 2, msgs_a), ("b", 3, msgs_b)):
        write_png(tmp_path / f"{name}.png", image(48, 64, seed=seed))
        out += messages(data_url((tmp_path / f"{name}.png").read_bytes()))
    ref_a = reference(files, server, tmp_path / "a.png", msgs_a, tmp_path)
    ref_b = reference(files, server, tmp_path / "b.png", msgs_b, tmp_path)
    assert np.abs(ref_a - ref_b).max() > 1e-3  # (the image changes the logits)
    got_a, _ = first_logprobs(server, msgs_a)
    assert_matches(got_a, ref_a)
    got_b, body = first_logprobs(server, msgs_b)
    assert_matches(got_b, ref_b)
    cached = body["tokenwing"]["prompt_cached_tokens"]
    assert 0 < cached < body["usage"]["prompt_tokens"] - 12  # (the text before the image only)
    again, body = first_logprobs(server, msgs_b)
    assert again == got_b and body["tokenwing"]["prompt_cached_tokens"] == body["usage"]["prompt_tokens"] - 1


def test_at_a_quarter_and_from_the_disk_cache(files: tuple[Path, Path], server: Server, tmp_path: Path) -> None:
    """A server streaming 25 % of the expert bytes on another server's prompt cache on disk (which holds image c's
    conversation): c's is restored whole; a new image e in c's place is not restored from it (the text before the
    image only) and gets the log-probs all experts resident give, bit for bit."""
    for name, seed in (("c", 4), ("e", 5)):
        write_png(tmp_path / f"{name}.png", image(48, 64, seed=seed))
    msgs_c = messages(data_url((tmp_path / "c.png").read_bytes()))
    msgs_e = messages(data_url((tmp_path / "e.png").read_bytes()))
    cache = tmp_path / "cache"
    first = Server(files[0], "--mmproj", str(files[1]), "--kv-type", "f32", "--parallel", "1",
                   "--prompt-cache-dir", str(cache))  # fmt: skip
    try:
        resident_c, _ = first_logprobs(first, msgs_c)
        # (this server fetches no remote image: a 400 naming the flag that would)
        assert "--allow-image-urls" in bad(first, messages("https://example.com/cat.png"))
    finally:
        first.stop()  # (its snapshot written: the stop waits for it)
    quarter = Server(files[0], "--mmproj", str(files[1]), "--kv-type", "f32", "--parallel", "1",
                     "--ram-budget", "25%", "--prompt-cache-dir", str(cache))  # fmt: skip
    try:
        got_c, body = first_logprobs(quarter, msgs_c)
        assert got_c == resident_c
        n = body["usage"]["prompt_tokens"]
        # c's conversation, from the disk (its reply too: the prompt's all but last token kept of it)
        assert body["tokenwing"].get("prompt_restored_tokens", 0) >= n - 1
        assert body["tokenwing"]["prompt_cached_tokens"] == n - 1
        got_e, body = first_logprobs(quarter, msgs_e)
        assert "prompt_restored_tokens" not in body["tokenwing"]  # (the slot has the text before the image already)
        assert body["tokenwing"]["prompt_cached_tokens"] < n - 12  # (the text before the image at most)
        assert body["tokenwing"]["prompt_bytes_read"] > 0  # (its experts streamed from the drive)
    finally:
        quarter.stop()
    resident_e, _ = first_logprobs(server, msgs_e)
    assert got_e == resident_e


def all_logprobs(server: Server, msgs: list[dict[str, Any]]) -> list[list[tuple[int, float]]]:
    """Every reply token's top-5 (id, log-prob), greedy, 4 tokens (the end-of-text token banned)."""
    body = {"messages": msgs, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120, headers=AUTH)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    return [[(e["id"], e["logprob"]) for e in c["top_logprobs"]] for c in content]


@pytest.mark.parametrize("budget", ["25%", "100%"])
def test_replies_with_images_decoded_together_are_what_they_are_alone(
    files: tuple[Path, Path], server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: str
) -> None:
    """Three slots, at 25 % of the expert bytes and all resident (its decode step one graph, without images): two
    requests with different images and one of text start together
    (a test pause gathers them), their decode steps run as one (runtime/batch.py, each sequence's text positions
    after its image's); every token's log-probs are those the one-slot resident server gives each alone."""
    bodies = []
    for name, seed in (("f", 6), ("g", 7)):
        write_png(tmp_path / f"{name}.png", image(48, 64, seed=seed))
        bodies.append(messages(data_url((tmp_path / f"{name}.png").read_bytes())))
    bodies.append([{"role": "user", "content": TEXT}])
    alone = [all_logprobs(server, b) for b in bodies]
    pauses = Pauses(tmp_path / "pauses", "serve.admit")
    pauses.arm(monkeypatch)
    together = Server(files[0], "--mmproj", str(files[1]), "--kv-type", "f32", "--parallel", "3",
                      "--ram-budget", budget, "--no-prompt-cache")  # fmt: skip
    try:
        got: list[Any] = [None] * len(bodies)

        def one(i: int) -> None:
            got[i] = all_logprobs(together, bodies[i])

        _together(together, pauses, [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))])
    finally:
        together.stop()
    assert got == alone


def test_an_image_whose_rows_see_one_another_is_not_split_between_parts(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 4's image rows attend both ways (vision/prompt.py `bidirectional`): its prompt, started while another
    slot decodes, goes in parts of a chunk (64 tokens) at most, and an image of 70+ rows must not be cut between two
    (its later rows' keys are written before its earlier rows attend). Its reply then is what it is alone."""
    _, mmproj, repacked = factory_files(tmp_path_factory.mktemp("g4"), "gemma4", "--sliding-window", "32")
    write_png(tmp_path / "a.png", image(48, 64, seed=10))
    bodies = [[{"role": "user", "content": "Tell me a story."}], messages(data_url((tmp_path / "a.png").read_bytes()))]
    pauses = Pauses(tmp_path / "pauses", "serve.admit")
    pauses.arm(monkeypatch)
    # (a larger context: its graph memory then holds the image's 118 rows at once)
    s = Server(repacked, "--mmproj", str(mmproj), "--kv-type", "f32", "--parallel", "2", "--no-prompt-cache",
               "--ctx", "4096")  # fmt: skip
    try:
        got: list[Any] = [None, None]

        def one(i: int) -> None:
            got[i] = all_logprobs(s, bodies[i])

        # (the text first: its prompt runs alone, then the image's in parts while it decodes)
        _together(s, pauses, [threading.Thread(target=one, args=(i,)) for i in range(2)])
        alone = all_logprobs(s, bodies[1])  # (the pause is passed once: now it runs alone)
    finally:
        s.stop()
    assert got[1] == alone


def bad(server: Server, msgs: list[dict[str, Any]], max_tokens: int = 2) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": max_tokens},
                   headers=AUTH, timeout=120)  # fmt: skip
    assert r.status_code == 400, r.text
    message: str = r.json()["error"]["message"]
    assert "\n" not in message and "Traceback" not in message
    return message


def header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width × height, with a tiny image data chunk."""
    return _with_data(width, height, b"\0" * 64)


def test_bad_images_are_400s_naming_why(server: Server, tmp_path: Path) -> None:
    ok = png_bytes(image(48, 64, seed=1), tmp_path / "ok.png")
    assert "not a PNG" in bad(server, messages(data_url(b"\xff\xd8\xff\xe0 a JPEG")))
    assert "base64" in bad(server, messages("data:image/png;base64,%%%"))
    assert "truncated" in bad(server, messages(data_url(ok[: len(ok) // 2])))
    assert str(4096 * 4096) in bad(server, messages(data_url(header_only(100_000, 100_000))))
    assert "data: URL" in bad(server, messages("file:///etc/passwd"))
    system = [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(ok)}}]}]
    assert "only user messages" in bad(server, system + messages(data_url(ok)))
    assert "image marker" in bad(server, messages(data_url(ok), text="see <__media_0__>"))
    # an image whose rows do not fit the 512-token context: refused as a long text is
    big = np.zeros((720, 800, 3), np.uint8)
    raw = b"".join(b"\0" + row.tobytes() for row in big)  # (filter none: quick to write and to read)
    png = _with_data(800, 720, raw)
    assert "the image is 2250 tokens (800x720 pixels); the context holds 512" in bad(server, messages(data_url(png)))
    # 500 rows fit the context, not with the text and the reply's room: as a long text is (OpenAI's code)
    raw = b"".join(b"\0" + row.tobytes() for row in big[:320, :400])  # (25 × 20 merged patches of 16 pixels)
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"messages": messages(data_url(_with_data(400, 320, raw))), "max_tokens": 8})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def _with_data(width: int, height: int, raw: bytes) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    head = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + head + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def test_a_remote_image_is_fetched_with_the_flag(server: Server, tmp_path: Path) -> None:
    """`serve --allow-image-urls`: an http URL's PNG (a local HTTP server's) is the same image as its data: URL;
    one past 8 MiB and a missing one are 400s naming why."""
    write_png(tmp_path / "a.png", image(48, 64, seed=12))
    (tmp_path / "big.png").write_bytes((tmp_path / "a.png").read_bytes() + b"\0" * (8 << 20))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        fetched, _ = first_logprobs(server, messages(base + "/a.png"))
        sent, _ = first_logprobs(server, messages(data_url((tmp_path / "a.png").read_bytes())))
        assert fetched == sent
        assert "larger than 8 MiB" in bad(server, messages(base + "/big.png"))
        assert "cannot fetch the image" in bad(server, messages(base + "/missing.png"))
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_remote_image_is_fetched_off_the_engine_thread(server: Server, tmp_path: Path) -> None:
    """While a remote image trickles in, the one slot answers another request: the fetch (and the decode) run on a
    thread of the HTTP side (images.decode_ahead), never on the engine thread every slot's decode step shares. The
    image's server holds its last bytes until that other reply is done (a byte every 0.2 s meanwhile, so the fetch
    never times out), then sends them; the image's reply is then as its data: URL's. Break-check: decode_ahead
    leaving the sources to the engine thread fails this (the other reply waits for the image that waits for it)."""
    png = png_bytes(image(48, 64, seed=13), tmp_path / "t.png")
    started, release = threading.Event(), threading.Event()

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            started.set()
            sent = 0
            while not release.wait(0.2) and sent < len(png) - 1:
                self.wfile.write(png[sent : sent + 1])
                self.wfile.flush()
                sent += 1
            release.wait()
            self.wfile.write(png[sent:])

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    got: list[tuple[dict[int, float], Any]] = []
    fetching = threading.Thread(
        target=lambda: got.append(first_logprobs(server, messages(f"http://127.0.0.1:{httpd.server_address[1]}/t")))
    )
    try:
        fetching.start()
        assert started.wait(300)  # (the server is fetching the image)
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600, headers=AUTH)
        assert r.status_code == 200, r.text
        assert not got and fetching.is_alive()  # (answered while the image was still coming)
    finally:
        release.set()
        fetching.join(600)
        httpd.shutdown()
        httpd.server_close()
    assert got and got[0][0] == first_logprobs(server, messages(data_url(png)))[0]


def test_apply_template_shows_where_the_image_goes(server: Server, tmp_path: Path) -> None:
    url = data_url(png_bytes(image(48, 64, seed=1), tmp_path / "a.png"))
    r = httpx.post(server.url + "/apply-template", json={"messages": messages(url, "Look: ")}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert "Look: <__media__>" in r.json()["prompt"]


def test_a_model_without_an_mmproj_says_so(files: tuple[Path, Path], tmp_path: Path) -> None:
    s = Server(files[0])
    try:
        url = data_url(png_bytes(image(48, 64, seed=1), tmp_path / "a.png"))
        assert "serve --mmproj" in bad(s, messages(url))
    finally:
        s.stop()


def test_png_decode_fuzz_never_fails_otherwise(tmp_path: Path) -> None:
    """Every truncation of a PNG, seeded random byte changes and huge header sizes: the image or one BadInputError
    (never another exception, never an allocation the header alone asks for)."""
    data = png_bytes(image(9, 11, seed=6), tmp_path / "f.png")
    rng = np.random.default_rng(0)
    cases = [data[:n] for n in range(len(data))]
    for _ in range(300):
        b = bytearray(data)
        for at in rng.integers(0, len(b), int(rng.integers(1, 6))):
            b[at] = int(rng.integers(0, 256))
        cases.append(bytes(b))
    cases += [header_only(w, h) for w, h in ((1 << 31, 1 << 31), (0, 5), (65536, 65536), (1, 1 << 30))]
    # rows of none and up only (read a row at a time; the others by anti-diagonals): the same pixels
    px = image(7, 5, seed=7)
    raw = b"".join(
        bytes([y % 2 * 2]) + ((px[y].astype(np.int32) - (px[y - 1] if y % 2 else 0)) & 0xFF).astype(np.uint8).tobytes()
        for y in range(7)
    )
    np.testing.assert_array_equal(decode_png(_with_data(5, 7, raw)), px)
    for case in cases:
        try:
            rgb = decode_png(case, 4096 * 4096)
        except BadInputError as e:
            assert "\n" not in str(e)
        else:
            assert rgb.dtype == np.uint8 and rgb.shape[2] == 3
