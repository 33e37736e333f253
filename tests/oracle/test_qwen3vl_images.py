"""Qwen3-VL's image encoder (vision/qwen3vl.py) against llama.cpp's libmtmd on the factory's mmproj and the same
RGB bytes: mtmd_encode_chunk + mtmd_get_output_embd (tests/oracle/mtmd_probe.py, a subprocess).

The bar is llama.cpp's own distance when only rounding changes (its encoder with flash attention, F16 keys and
values, against without): two ggml CPU builds differ in the patch convolution's F16 dot products by ~4e-7, and
ggml_gelu's F16 table turns some of those into an F16 step; ours is 3-6e-4 from llama.cpp's, llama.cpp 1-2e-3 from
itself, both 1.5e-3 from an F64 computation. The images cover llama.cpp's preprocessing: one already aligned (its
patch grid not the learned positions' 4×4, so they are resized), one Pillow-bicubic upscaled to the pixel budget and
padded, a wide one.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import assert_clean_error, run_cli
from tokenwing.format.gguf_io import read_header
from tokenwing.format.reader import ModelFile
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.text.tokenizer import tokenizer_from_file
from tokenwing.vision.cache import EncodedImages
from tokenwing.vision.encoder import MmprojEncoder
from tokenwing.vision.logits import image_prompt
from tokenwing.vision.png import decode_png
from tokenwing.vision.positions import image_positions, image_span
from tokenwing.vision.qwen3vl import Qwen3VLEncoder

pytestmark = pytest.mark.oracle

PROBE = Path(__file__).with_name("mtmd_probe.py")


def mtmd_run(model: Path, mmproj: Path, rgb: np.ndarray, text: str, out: Path, *flags: str) -> dict[str, object]:
    """llama.cpp's embeddings (out/embd.npy) and last logits (out/logits.npy) for `text` with the image."""
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "image.npy", rgb)
    cmd = [sys.executable, str(PROBE), str(model), str(mmproj), str(out / "image.npy"), text, str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info: dict[str, object] = json.loads((out / "info.json").read_text())
    return info


def factory_files(root: Path, arch: str, *flags: str) -> tuple[Path, Path, Path]:
    """The factory's `arch` model with its mmproj (the command a user runs), and the model repacked (each image
    family's test)."""
    model, mmproj, repacked = root / "m.gguf", root / "m.mmproj.gguf", root / "m.tw.gguf"
    r = run_cli("testmodel", str(model), "--arch", arch, *flags, "--mmproj", str(mmproj), "-q")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(model), str(mmproj)]
    r = run_cli("repack", str(model), "-o", str(repacked))
    assert r.returncode == 0, r.stderr
    return model, mmproj, repacked


def encode_image(cls: type[MmprojEncoder], mmproj: Path, rgb: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
    """The image's rows by the family's encoder (`cls` on the mmproj), and its grid (nx, ny)."""
    enc = cls(str(mmproj))
    try:
        pre = enc.preprocess(rgb)
        return enc.encode(pre), enc.grid(pre)
    finally:
        enc.close()


def image(height: int, width: int, seed: int) -> np.ndarray:
    """A picture with structure (gradients and a disc) and noise, as RGB bytes."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    disc = ((y - height / 2) ** 2 + (x - width / 3) ** 2 < (min(height, width) / 3) ** 2) * 120
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), disc], axis=-1)
    return np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The factory's text model and its mmproj, written by the command a user runs."""
    root = tmp_path_factory.mktemp("qwen3vl")
    model, mmproj = root / "m.gguf", root / "m.mmproj.gguf"
    r = run_cli("testmodel", str(model), "--arch", "qwen3vlmoe", "--mmproj", str(mmproj), "-q")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(model), str(mmproj)]
    return model, mmproj


IMAGES = {
    "aligned-64x48": (48, 64),  # no resize; an 8×6 patch grid
    "upscaled-50x37": (37, 50),  # under 8 merged patches: bicubic to fit 64×48, centred on black
    "wide-200x30": (30, 200),  # rounded to 208×32, the height padded
}


@pytest.mark.parametrize("name", IMAGES)
def test_embeddings_match_llama_cpp(files: tuple[Path, Path], tmp_path: Path, name: str) -> None:
    model, mmproj = files
    rgb = image(*IMAGES[name], seed=len(name))
    info = mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "ref")
    ref = np.load(tmp_path / "ref" / "embd.npy")
    mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "flash", "flash")
    own = np.abs(np.load(tmp_path / "flash" / "embd.npy") - ref).max()

    enc = Qwen3VLEncoder(str(mmproj))
    try:
        pre = enc.preprocess(rgb)
        got = enc.encode(pre)
    finally:
        enc.close()
    chunk = next(c for c in info["chunks"] if c["type"] == 1)  # type: ignore[attr-defined]
    assert (pre.width // 16, pre.height // 16) == (chunk["nx"], chunk["ny"])
    # a row: the text model's width × (1 + its deepstack layers: 1 in the factory's 2-layer model)
    assert got.shape == ref.shape == (chunk["nx"] * chunk["ny"], enc.hp.proj_dim * 2)
    diff = np.abs(got - ref)
    assert diff.max() <= own, (diff.max(), own)
    assert np.median(diff) <= 1e-5  # most values agree to F32 rounding


@pytest.mark.parametrize("name", ["aligned-64x48", "wide-200x30"])
def test_image_rows_are_placed_as_llama_cpp_places_them(files: tuple[Path, Path], tmp_path: Path, name: str) -> None:
    """Each row's four RoPE positions (mtmd_helper_image_get_decoder_pos, after the text before it) and where the
    text after the image goes on (mtmd_helper_eval_chunks' n_past): an image of nx × ny takes max(nx, ny)."""
    model, mmproj = files
    rgb = image(*IMAGES[name], seed=3)
    info = mtmd_run(model, mmproj, rgb, "Look: <__media__> What is it?", tmp_path)
    chunks: list[dict[str, object]] = info["chunks"]  # type: ignore[assignment]
    img = next(c for c in chunks if c["type"] == 1)
    nx, ny, p0 = int(img["nx"]), int(img["ny"]), int(img["p0"])  # type: ignore[call-overload]
    assert p0 == chunks[0]["n_tokens"] and nx != ny
    ours = image_positions(p0, nx, ny).reshape(4, nx * ny).T  # rows of (t, y, x, z)
    np.testing.assert_array_equal(ours, np.asarray(img["decoder_pos"]))
    text = sum(int(c["n_tokens"]) for c in chunks if c["type"] == 0)  # type: ignore[call-overload]
    assert info["n_past"] == text + image_span(nx, ny) == text + img["n_pos"]


def test_an_image_sent_again_is_not_encoded_again(files: tuple[Path, Path]) -> None:
    """The encoder's output by the image's content: the same bytes again are a hit (the same rows, not recomputed),
    another picture of the same size a miss."""
    enc = Qwen3VLEncoder(str(files[1]))
    cache = EncodedImages()
    try:

        def encode(rgb: np.ndarray) -> np.ndarray:
            return enc.encode(enc.preprocess(rgb))

        a = image(48, 64, seed=1)
        first = cache.get(a, encode)
        again = cache.get(a.copy(), encode)
        other = cache.get(image(48, 64, seed=2), encode)
    finally:
        enc.close()
    assert again is first and (cache.hits, cache.misses) == (1, 2)
    assert np.abs(other - first).max() > 0.1


def write_png(path: Path, px: np.ndarray) -> None:
    """An 8-bit PNG of px (height, width, channels 1-4), its rows filtered by each of PNG's five filters in turn."""
    h, w, c = px.shape
    raw, prev = bytearray(), np.zeros(w * c, np.int32)
    for y in range(h):
        line = px[y].reshape(-1).astype(np.int32)
        left = np.concatenate([np.zeros(c, np.int32), line[:-c]])
        upleft = np.concatenate([np.zeros(c, np.int32), prev[:-c]])
        p = left + prev - upleft
        pa, pb, pc = np.abs(p - left), np.abs(p - prev), np.abs(p - upleft)
        paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, upleft))
        pred = [0 * line, left, prev, (left + prev) >> 1, paeth][y % 5]
        raw.append(y % 5)
        raw += ((line - pred) & 0xFF).astype(np.uint8).tobytes()
        prev = line

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", w, h, 8, {1: 0, 2: 4, 3: 2, 4: 6}[c], 0, 0, 0)
    png = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(raw))) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png)


def test_png_is_read_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    """Every filter and colour type: RGB as it is, grey repeated, alpha dropped (stb_image's 3 channels)."""
    rgb = image(23, 31, seed=5)
    grey = rgb[:, :, :1]
    cases = {
        "rgb": (rgb, rgb),
        "rgba": (np.concatenate([rgb, grey], axis=2), rgb),
        "grey": (grey, np.repeat(grey, 3, axis=2)),
        "grey-alpha": (np.concatenate([grey, rgb[:, :, 1:2]], axis=2), np.repeat(grey, 3, axis=2)),
    }
    for name, (px, want) in cases.items():
        write_png(tmp_path / f"{name}.png", px)
        np.testing.assert_array_equal(decode_png((tmp_path / f"{name}.png").read_bytes()), want, err_msg=name)


@pytest.fixture(scope="module")
def repacked(files: tuple[Path, Path]) -> Path:
    out = files[0].with_suffix(".tw.gguf")
    r = run_cli("repack", str(files[0]), "-o", str(out))
    assert r.returncode == 0, r.stderr
    return out


LOGITS = {  # (image, text)
    "aligned-middle": ("aligned-64x48", "Describe <__media__> in one word."),
    "wide-end": ("wide-200x30", "<|im_start|>user\nWhat is this? <__media__>"),
}


@pytest.mark.parametrize("case", LOGITS)
def test_logits_with_an_image_match_llama_cpp(
    files: tuple[Path, Path], repacked: Path, tmp_path: Path, case: str
) -> None:
    """`tokenwing logits MODEL --mmproj P --image FILE --text T` against mtmd_helper_eval_chunks on the same
    files: within llama.cpp's own distance when only its KV cache precision changes (F16 for F32)."""
    name, text = LOGITS[case]
    logits_match(files, repacked, image(*IMAGES[name], seed=7), text, tmp_path)


def logits_match(
    files: tuple[Path, Path], repacked: Path, rgb: np.ndarray, text: str, tmp: Path, rounding: tuple[str, ...] = ()
) -> None:
    """`tokenwing logits MODEL --mmproj P --image FILE --text T` against mtmd_helper_eval_chunks on the same
    files: within llama.cpp's own distance when only its KV cache precision changes (F16 for F32); each image
    family's test calls it. `rounding`: the probe's other flags whose distance also counts (the largest is the
    bar; "flash": its encoder's attention in F16)."""
    model, mmproj = files
    write_png(tmp / "image.png", rgb)
    mtmd_run(model, mmproj, rgb, text, tmp / "ref")
    for flag in ("f16kv", *rounding):
        mtmd_run(model, mmproj, rgb, text, tmp / flag, flag)
    ref = np.load(tmp / "ref" / "logits.npy")
    own = max(np.abs(np.load(tmp / flag / "logits.npy") - ref).max() for flag in ("f16kv", *rounding))
    out = tmp / "ours.npy"
    args = ["--mmproj", str(mmproj), "--image", str(tmp / "image.png"), "--text", text]
    r = run_cli("logits", str(repacked), *args, "--out", str(out), "--kv-type", "f32")
    assert r.returncode == 0, r.stderr
    got = np.load(out)
    assert got.shape == ref.shape == (1, 512)
    assert np.abs(got - ref).max() <= own, (np.abs(got - ref).max(), own)


def test_bad_image_input_is_one_line(files: tuple[Path, Path], repacked: Path, tmp_path: Path) -> None:
    mmproj = str(files[1])
    (tmp_path / "a.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a png")
    write_png(tmp_path / "ok.png", image(48, 64, seed=1))
    cases = [
        ("--image", str(tmp_path / "a.jpg"), "--text", "<__media__>"),  # not a PNG
        ("--image", str(tmp_path / "ok.png"), "--text", "no marker"),  # no <__media__>
        ("--image", str(tmp_path / "missing.png"), "--text", "<__media__>"),  # no file
    ]
    for extra in cases:
        r = run_cli("logits", str(repacked), "--mmproj", mmproj, *extra, "--out", str(tmp_path / "x.npy"))
        assert_clean_error(r, 2)


def _image_then_step(model: Path, mmproj: Path, png: Path, text: str, **options: object) -> tuple[np.ndarray, int]:
    """The prompt's last logits and one greedy decode step's after it, in one session with the image's
    MediaPrompt kept (vision/logits.image_prompt: the family's encoder, its texts and placement); and the expert
    slots a layer had."""
    s = Session(str(model), SessionOptions(kv_type="f32", **options), log=lambda line: None)  # type: ignore[arg-type]
    try:
        ids, s.media = image_prompt(s, str(mmproj), str(png), text)
        first = s.forward(ids)
        step = s.forward([int(first.argmax())])
        return np.stack([first, step]), s.slots_per_layer
    finally:
        s.close()


def step_and_streamed_match(files: tuple[Path, Path], repacked: Path, rgb: np.ndarray, text: str, tmp: Path) -> None:
    """A decode step after the prompt with an image matches llama.cpp's (within its KV-precision distance), and
    the same with 25 % of the expert bytes in RAM (lookahead 2) is bit-identical to every expert resident (each
    image family's test calls it)."""
    model, mmproj = files
    mtmd_run(model, mmproj, rgb, text, tmp / "ref")
    mtmd_run(model, mmproj, rgb, text, tmp / "f16kv", "f16kv")
    ref = np.concatenate([np.load(tmp / "ref" / f) for f in ("logits.npy", "step.npy")])
    own = np.concatenate([np.load(tmp / "f16kv" / f) for f in ("logits.npy", "step.npy")])
    write_png(tmp / "image.png", rgb)
    resident, slots = _image_then_step(repacked, mmproj, tmp / "image.png", text)
    assert np.abs(resident - ref).max() <= np.abs(own - ref).max(), (np.abs(resident - ref).max(axis=1), own)
    with ModelFile.open(str(repacked)) as mf:
        budget = mf.index.total_bytes // 4
    streamed, streamed_slots = _image_then_step(
        repacked, mmproj, tmp / "image.png", text, ram_budget=budget, lookahead=2
    )
    assert streamed_slots < slots
    assert np.array_equal(resident, streamed)


def test_a_decode_step_after_an_image_and_streamed_at_a_quarter(
    files: tuple[Path, Path], repacked: Path, tmp_path: Path
) -> None:
    step_and_streamed_match(files, repacked, image(48, 64, seed=9), "Describe <__media__> now:", tmp_path)


def test_an_f16_mmproj_matches_llama_cpp(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Published mmproj files hold their matrices and convolutions in F16 (`--type F16` writes them so; norms,
    biases and the learned positions F32): the embeddings and the logits with the image within llama.cpp's own
    distances, as in F32."""
    root = tmp_path_factory.mktemp("qwen3vl-f16")
    model, mmproj, repacked = root / "m.gguf", root / "m.mmproj.gguf", root / "m.tw.gguf"
    r = run_cli("testmodel", str(model), "--arch", "qwen3vlmoe", "--type", "F16", "--mmproj", str(mmproj), "-q")
    assert r.returncode == 0, r.stderr
    assert run_cli("repack", str(model), "-o", str(repacked)).returncode == 0
    rgb, text = image(37, 50, seed=11), "What is in <__media__>?"
    mtmd_run(model, mmproj, rgb, text, tmp_path / "ref")
    mtmd_run(model, mmproj, rgb, text, tmp_path / "flash", "flash")
    mtmd_run(model, mmproj, rgb, text, tmp_path / "f16kv", "f16kv")
    ref = np.load(tmp_path / "ref" / "embd.npy")
    enc = Qwen3VLEncoder(str(mmproj))
    try:
        assert {t.type_name for t in read_header(str(mmproj)).tensors} == {"F16", "F32"}
        got = enc.encode(enc.preprocess(rgb))
    finally:
        enc.close()
    assert np.abs(got - ref).max() <= np.abs(np.load(tmp_path / "flash" / "embd.npy") - ref).max()
    write_png(tmp_path / "image.png", rgb)
    out = tmp_path / "ours.npy"
    args = ["--mmproj", str(mmproj), "--image", str(tmp_path / "image.png"), "--text", text, "--kv-type", "f32"]
    assert run_cli("logits", str(repacked), *args, "--out", str(out)).returncode == 0
    ref_logits = np.load(tmp_path / "ref" / "logits.npy")
    own = np.abs(np.load(tmp_path / "f16kv" / "logits.npy") - ref_logits).max()
    assert np.abs(np.load(out) - ref_logits).max() <= own


def test_run_with_an_image_says_what_llama_cpp_says(files: tuple[Path, Path], repacked: Path, tmp_path: Path) -> None:
    """`tokenwing run MODEL --mmproj P --image FILE --prompt "… <__media__> …" -n 2`: llama.cpp's two greedy tokens
    after the same prompt (the prompt's argmax, then the decode step's). The command's plumbing only: this 2-layer
    random model's greedy tokens do not depend on the image (they are the same with the image's rows left out), so
    what the image does is the logits and decode-step tests' to check."""
    model, mmproj = files
    rgb, text = image(37, 50, seed=13), "Tell me: <__media__> is"
    info = mtmd_run(model, mmproj, rgb, text, tmp_path / "ref")
    first = int(np.load(tmp_path / "ref" / "logits.npy").argmax())
    second = int(np.load(tmp_path / "ref" / "step.npy").argmax())
    assert info["step_token"] == first
    write_png(tmp_path / "image.png", rgb)
    args = ["--mmproj", str(mmproj), "--image", str(tmp_path / "image.png"), "--prompt", text, "-n", "2"]
    r = run_cli("run", str(repacked), *args, "--kv-type", "f32")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tokenizer_from_file(str(repacked)).decode([first, second]) + "\n"
