"""Gemma 4's image encoder (vision/gemma4v.py: gemma4 with the factory's gemma4v mmproj) against llama.cpp's libmtmd
on the same files and RGB bytes (tests/oracle/mtmd_probe.py, a subprocess; the helpers are test_qwen3vl_images'):
the embeddings (mtmd_encode_chunk + mtmd_get_output_embd), the text around the image as libmtmd tokenizes it, and
the last position's logits (mtmd_helper_eval_chunks), where the image's rows attend to one another both ways.

The bars are llama.cpp's own distances when only rounding changes: its encoder with flash attention (F16 keys and
values) against without, its text model with an F16 KV cache against F32. The factory's encoder bounds some of its
products (Gemma4ClippableLinear) tightly enough that values are clamped, so a bound left out fails.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import assert_clean_error, run_cli
from tests.oracle.test_qwen3vl_images import (
    encode_image,
    factory_files,
    image,
    logits_match,
    mtmd_run,
    step_and_streamed_match,
    write_png,
)
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import read_header
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.vision.gemma4v import Gemma4VEncoder
from tokenwing.vision.logits import image_logits, image_prompt

pytestmark = pytest.mark.oracle


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Its sliding-window layers see 32 positions: fewer than an image's rows, so the window cuts into the image."""
    return factory_files(tmp_path_factory.mktemp("gemma4v"), "gemma4", "--sliding-window", "32")


IMAGES = {
    "aligned-240x192": (192, 240),  # no resize: 30×24 patches of 8, pooled 3×3 to 10×8 rows
    "upscaled-64x48": (48, 64),  # under 70 pooled patches: bicubic up to 240×192
    "wide-200x30": (30, 200),  # upscaled and padded to Gemma 4's budget: 33×3
}


def _encode(mmproj: Path, rgb: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
    return encode_image(Gemma4VEncoder, mmproj, rgb)


@pytest.mark.parametrize("name", IMAGES)
def test_embeddings_match_llama_cpp(files: tuple[Path, Path, Path], tmp_path: Path, name: str) -> None:
    model, mmproj, _ = files
    rgb = image(*IMAGES[name], seed=len(name))
    info = mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "ref")
    ref = np.load(tmp_path / "ref" / "embd.npy")
    mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "flash", "flash")
    own = np.abs(np.load(tmp_path / "flash" / "embd.npy") - ref).max()
    got, (nx, ny) = _encode(mmproj, rgb)
    chunk = next(c for c in info["chunks"] if c["type"] == 1)  # type: ignore[attr-defined]
    assert nx * ny == chunk["n_tokens"] >= 70  # Gemma 4's budget: at least 70 pooled patches
    assert got.shape == ref.shape == (nx * ny, 64)  # the text model's width
    diff = np.abs(got - ref)
    assert diff.max() <= own, (diff.max(), own)
    assert np.median(diff) <= 1e-4 * np.abs(ref).max()


def test_image_rows_are_placed_as_llama_cpp_places_them(files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """The prompt the engine makes (vision/logits.image_prompt, the encoder chosen by the file's projector): the
    text pieces around the image tokenized apart with <|image> and <image|> (libmtmd's chunks' tokens), one position
    a row (n_pos = the rows), the rows attending both ways, and the text after the image going on where
    mtmd_helper_eval_chunks' n_past says."""
    model, mmproj, repacked = files
    rgb, text = image(48, 64, seed=3), "Look: <__media__> What is it?"
    info = mtmd_run(model, mmproj, rgb, text, tmp_path)
    chunks: list[dict[str, object]] = info["chunks"]  # type: ignore[assignment]
    _, (nx, ny) = _encode(mmproj, rgb)
    write_png(tmp_path / "image.png", rgb)
    s = Session(str(repacked), SessionOptions(kv_type="f32"), log=lambda line: None)
    try:
        ids, media = image_prompt(s, str(mmproj), str(tmp_path / "image.png"), text)
    finally:
        s.close()
    assert media.bidirectional and not media.mrope
    img = media.images[0]
    assert [c["type"] for c in chunks] == [0, 1, 0]
    assert ids[: img.start] == chunks[0]["tokens"] and ids[img.start + img.rows :] == chunks[2]["tokens"]
    assert chunks[1]["n_tokens"] == chunks[1]["n_pos"] == img.rows == nx * ny
    np.testing.assert_array_equal(media.positions(0, len(ids)), np.arange(len(ids)))
    assert info["n_past"] == len(ids)


LOGITS = {  # (image, text): the image mid-text, and at the end after a lead-in longer than the window
    "middle": ("upscaled-64x48", "Describe <__media__> in one word."),
    "end": ("wide-200x30", "<|im_start|>user\nA long lead-in before the picture, to fill a window: <__media__>"),
}


@pytest.mark.parametrize("case", LOGITS)
def test_logits_with_an_image_match_llama_cpp(files: tuple[Path, Path, Path], tmp_path: Path, case: str) -> None:
    """`tokenwing logits` against mtmd_helper_eval_chunks (test_qwen3vl_images.logits_match). The image's rows
    attend both ways (this model is 64 wide, not E2B's or E4B's): causal rows, an image split between chunks of the
    prompt, or the window not cutting into the image are 0.6-0.7 off; ours 1-2e-4, llama.cpp's F16 KV 8e-4."""
    name, text = LOGITS[case]
    logits_match(files[:2], files[2], image(*IMAGES[name], seed=7), text, tmp_path)


def test_a_decode_step_after_an_image_and_streamed_at_a_quarter(files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    step_and_streamed_match(files[:2], files[2], image(48, 64, seed=9), "Describe <__media__> now:", tmp_path)


def test_an_f16_mmproj_matches_llama_cpp(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Published mmproj files hold their matrices and convolution in F16 (`--type F16` writes them so; norms, the
    position tables and the bounds F32): the embeddings within llama.cpp's own distance (its encoder with flash
    attention against without), the logits within its distance when only rounding changes, its KV cache's or its
    encoder's, whichever is larger. An F16 encoder rounds ~1e-3 off (ours and llama.cpp's flash alike) and the
    text model spreads that: here ours 1.3e-3 from llama.cpp's logits, its F16 KV 1.8e-3, its flash encoder 2.4e-3
    (with the default window of 128: 8.4e-3, 1.8e-3 and 0.13)."""
    root = tmp_path_factory.mktemp("gemma4v-f16")
    model, mmproj, repacked = factory_files(root, "gemma4", "--sliding-window", "32", "--type", "F16")
    assert {t.type_name for t in read_header(str(mmproj)).tensors} == {"F16", "F32"}
    rgb = image(37, 50, seed=11)
    mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "ref")
    mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "flash", "flash")
    ref = np.load(tmp_path / "ref" / "embd.npy")
    got, _ = _encode(mmproj, rgb)
    assert np.abs(got - ref).max() <= np.abs(np.load(tmp_path / "flash" / "embd.npy") - ref).max()
    (tmp_path / "logits").mkdir()
    logits_match((model, mmproj), repacked, rgb, "What is in <__media__>?", tmp_path / "logits", ("flash",))


def test_bad_image_input_is_one_line(files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """An image more patches across than the encoder's position tables hold (llama.cpp aborts in ggml_get_rows),
    and a gemma4v file offered to another family's model: one line, exit 2."""
    _, mmproj, repacked = files
    write_png(tmp_path / "long.png", image(24, 3000, seed=1))  # 375 patches across; the factory's tables: 256
    out = str(tmp_path / "x.npy")
    r = run_cli(
        "logits",
        str(repacked),
        "--mmproj",
        str(mmproj),
        "--image",
        str(tmp_path / "long.png"),
        "--text",
        "<__media__>",
        "--out",
        out,
    )
    assert_clean_error(r, 2)
    assert "position tables hold 256" in r.stderr
    other = tmp_path / "q.gguf"
    assert run_cli("testmodel", str(other), "--arch", "qwen3vlmoe", "-q").returncode == 0
    write_png(tmp_path / "ok.png", image(48, 64, seed=1))
    r = run_cli(
        "logits",
        str(other),
        "--mmproj",
        str(mmproj),
        "--image",
        str(tmp_path / "ok.png"),
        "--text",
        "<__media__>",
        "--out",
        out,
    )
    assert_clean_error(r, 2)


def test_an_image_chunk_past_the_graph_memory_is_one_line(files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """An image whose rows attend to one another runs as one chunk, however long; one that the session's graph
    reserve cannot hold is refused in one line before anything is computed, and the session goes on. A mock: the
    reserve set to 256 KiB (the plan gives every model 64 MiB to spare: no factory model's image overflows it)."""
    _, mmproj, repacked = files
    write_png(tmp_path / "image.png", image(192, 240, seed=2))
    s = Session(str(repacked), SessionOptions(kv_type="f32"), log=lambda line: None)
    try:
        real, s.graph.mem_bytes = s.graph.mem_bytes, 1 << 18
        with pytest.raises(BadInputError, match=r"its \d+-token chunk at position 0 runs at once"):
            image_logits(s, str(mmproj), str(tmp_path / "image.png"), "Look: <__media__> What?")
        assert s.pos == 0
        s.graph.mem_bytes = real
        assert image_logits(s, str(mmproj), str(tmp_path / "image.png"), "Look: <__media__> What?").shape == (1, 512)
    finally:
        s.close()
