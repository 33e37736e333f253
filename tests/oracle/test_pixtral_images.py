"""Pixtral's image encoder (vision/pixtral.py, Mistral Small 4's: mistral4 with the factory's pixtral mmproj) against
llama.cpp's libmtmd on the same files and RGB bytes (tests/oracle/mtmd_probe.py, a subprocess; the helpers are
test_qwen3vl_images'): the embeddings (mtmd_encode_chunk + mtmd_get_output_embd), the text around the image as
libmtmd tokenizes it, and the last position's logits (mtmd_helper_eval_chunks).

The bars are llama.cpp's own distances when only rounding changes: its encoder with flash attention (F16 keys and
values) against without, its text model with an F16 KV cache against F32. Pixtral's graph has no F16 GELU table in
the tower (SiLU) and no bilinear resize, so ours is 1e-6 to 4e-5 from llama.cpp's where that bar is 6e-4 to 4e-3.
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
from tokenwing.format.gguf_io import read_header
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.testmodel.mmproj import write_mmproj
from tokenwing.testmodel.mmproj_pixtral import PixtralShape
from tokenwing.testmodel.shapes import preset_shape
from tokenwing.vision.pixtral import PixtralEncoder
from tokenwing.vision.prompt import tokens

pytestmark = pytest.mark.oracle


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return factory_files(tmp_path_factory.mktemp("pixtral"), "mistral4")


IMAGES = {
    "aligned-64x48": (48, 64),  # no resize: 4×3 merged patches (patches of 8, 2×2 merged)
    "upscaled-50x37": (37, 50),  # under 8 merged patches: bicubic to fit 64×48, centred on black
    "wide-200x30": (30, 200),  # rounded to 208×32, the height padded: 13×2
    "downscaled-600x450": (450, 600),  # over 1024 merged patches: bicubic down to 576×432, 36×27 (998 rows)
}


def _encode(mmproj: Path, rgb: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
    return encode_image(PixtralEncoder, mmproj, rgb)


@pytest.mark.parametrize("name", IMAGES)
def test_embeddings_match_llama_cpp(files: tuple[Path, Path, Path], tmp_path: Path, name: str) -> None:
    """Each row, the [IMG_BREAK] rows between rows of merged patches included, within llama.cpp's own distance."""
    model, mmproj, _ = files
    rgb = image(*IMAGES[name], seed=len(name))
    info = mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "ref", "ctx=1024")
    ref = np.load(tmp_path / "ref" / "embd.npy")
    mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "flash", "flash", "ctx=1024")
    own = np.abs(np.load(tmp_path / "flash" / "embd.npy") - ref).max()
    got, (nx, ny) = _encode(mmproj, rgb)
    chunk = next(c for c in info["chunks"] if c["type"] == 1)  # type: ignore[attr-defined]
    assert got.shape == ref.shape == (nx * ny + ny - 1, 64) and ny > 1
    diff = np.abs(got - ref)
    assert diff.max() <= own, (diff.max(), own)
    assert np.median(diff) <= 1e-6  # most values agree to F32 rounding
    # the [IMG_BREAK] rows: the file's embedding of that token, as it is
    brk = got[nx :: nx + 1]
    assert brk.shape[0] == ny - 1 and np.array_equal(brk, np.broadcast_to(brk[0], brk.shape))
    assert chunk["n_tokens"] == chunk["n_pos"] == got.shape[0]


def test_the_original_pixtral_without_a_patch_merger_matches_llama_cpp(
    files: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """Pixtral 12B's form (no patch merger, no spatial_merge_size: a merged patch is a patch; the projector with
    biases): the sides aligned to one patch, a row per patch and the [IMG_BREAK] rows, within llama.cpp's own
    distance."""
    model, _, _ = files
    mmproj = tmp_path / "p12.mmproj.gguf"
    write_mmproj(str(mmproj), preset_shape("tiny", "mistral4"), v=PixtralShape(n_merge=1))
    names = {t.name for t in read_header(str(mmproj)).tensors}
    assert "mm.patch_merger.weight" not in names and "mm.1.bias" in names
    rgb = image(30, 44, seed=5)  # 48×32 (sides rounded to patches of 8: 5.5 up), 6×4 patches, fitted and padded
    info = mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "ref")
    mtmd_run(model, mmproj, rgb, "<__media__>", tmp_path / "flash", "flash")
    ref = np.load(tmp_path / "ref" / "embd.npy")
    own = np.abs(np.load(tmp_path / "flash" / "embd.npy") - ref).max()
    got, (nx, ny) = _encode(mmproj, rgb)
    chunk = next(c for c in info["chunks"] if c["type"] == 1)  # type: ignore[attr-defined]
    assert got.shape == ref.shape == (nx * ny + ny - 1, 64) == (chunk["n_tokens"], 64)
    assert np.abs(got - ref).max() <= own, (np.abs(got - ref).max(), own)


def test_the_text_around_the_image_is_tokenized_as_libmtmd_does(files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """No text before the image, "[IMG_END]" after it (each piece apart); the rows take a position each (no
    M-RoPE) and the text after goes on where mtmd_helper_eval_chunks' n_past says."""
    model, mmproj, repacked = files
    rgb, text = image(30, 200, seed=3), "Look: <__media__> What is it?"
    info = mtmd_run(model, mmproj, rgb, text, tmp_path)
    chunks: list[dict[str, object]] = info["chunks"]  # type: ignore[assignment]
    assert [c["type"] for c in chunks] == [0, 1, 0]
    embd, (nx, ny) = _encode(mmproj, rgb)
    s = Session(str(repacked), SessionOptions(kv_type="f32"), log=lambda line: None)
    try:
        ids, media = tokens(s.tokenizer, text, [(nx, ny, embd)], s.hp.n_embd, begin="", end="[IMG_END]", mrope=False)
    finally:
        s.close()
    before: list[int] = chunks[0]["tokens"]  # type: ignore[assignment]
    after: list[int] = chunks[2]["tokens"]  # type: ignore[assignment]
    rows = int(chunks[1]["n_tokens"])  # type: ignore[call-overload]
    assert ids == [*before, *[0] * rows, *after]
    assert media.images[0].start == len(before) and media.images[0].rows == rows == nx * ny + ny - 1
    np.testing.assert_array_equal(media.positions(0, len(ids)), np.arange(len(ids)))
    assert info["n_past"] == len(ids)


LOGITS = {  # (image, text)
    "aligned-middle": ("aligned-64x48", "Describe <__media__> in one word."),
    "wide-end": ("wide-200x30", "[INST]What is this? <__media__>"),
}


@pytest.mark.parametrize("case", LOGITS)
def test_logits_with_an_image_match_llama_cpp(files: tuple[Path, Path, Path], tmp_path: Path, case: str) -> None:
    """`tokenwing logits MODEL --mmproj P --image FILE --text T` against mtmd_helper_eval_chunks on the same
    files: within llama.cpp's own distance when only its KV cache precision changes (F16 for F32)."""
    model, mmproj, repacked = files
    name, text = LOGITS[case]
    logits_match((model, mmproj), repacked, image(*IMAGES[name], seed=7), text, tmp_path)


def test_a_decode_step_after_an_image_and_streamed_at_a_quarter(files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """A decode step after the image within llama.cpp's KV-precision distance; bit-identical streamed at 25 %."""
    model, mmproj, repacked = files
    step_and_streamed_match((model, mmproj), repacked, image(48, 64, seed=9), "Describe <__media__> now:", tmp_path)


def test_an_f16_mmproj_matches_llama_cpp(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Published mmproj files hold their matrices and convolution in F16 (`--type F16` writes them so; norms and
    the [IMG_BREAK] row F32): the embeddings and the logits with the image within llama.cpp's own distances."""
    model, mmproj, repacked = factory_files(tmp_path_factory.mktemp("pixtral-f16"), "mistral4", "--type", "F16")
    rgb, text = image(37, 50, seed=11), "What is in <__media__>?"
    assert {t.type_name for t in read_header(str(mmproj)).tensors} == {"F16", "F32"}
    logits_match((model, mmproj), repacked, rgb, text, tmp_path)  # (it leaves llama.cpp's embeddings in ref/)
    mtmd_run(model, mmproj, rgb, text, tmp_path / "flash", "flash")
    ref = np.load(tmp_path / "ref" / "embd.npy")
    got, _ = _encode(mmproj, rgb)
    assert np.abs(got - ref).max() <= np.abs(np.load(tmp_path / "flash" / "embd.npy") - ref).max()


def test_an_encoder_for_another_family_is_one_line(
    files: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A Pixtral mmproj with a model of another family, and a Qwen3-VL mmproj with mistral4: exit 2, one line."""
    _, mmproj, repacked = files
    root = tmp_path_factory.mktemp("qwen-for-mistral")
    other, qwen = root / "q.gguf", root / "q.mmproj.gguf"
    assert run_cli("testmodel", str(other), "--arch", "qwen3vlmoe", "--mmproj", str(qwen), "-q").returncode == 0
    assert run_cli("repack", str(other), "-o", str(other.with_suffix(".tw.gguf"))).returncode == 0
    other = other.with_suffix(".tw.gguf")
    write_png(tmp_path / "ok.png", image(48, 64, seed=1))
    for model, proj in ((other, mmproj), (repacked, qwen)):
        args = ["--mmproj", str(proj), "--image", str(tmp_path / "ok.png"), "--text", "<__media__>"]
        r = run_cli("logits", str(model), *args, "--out", str(tmp_path / "x.npy"))
        assert_clean_error(r, 2)
        assert "encoder, for" in r.stderr, r.stderr
