"""`tokenwing logits MODEL --mmproj P --image FILE --text "… <__media__> …"`: the logits of the text's last
position with the image where the marker is, as llama.cpp's mtmd_helper_eval_chunks computes them (issue 45)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import read_header
from tokenwing.vision.device import EncoderBytes, encoder_bytes, place
from tokenwing.vision.encoder import MmprojEncoder, projector_of
from tokenwing.vision.gemma4v import Gemma4VEncoder
from tokenwing.vision.pixtral import PixtralEncoder
from tokenwing.vision.png import decode_png
from tokenwing.vision.prompt import MediaPrompt, tokens
from tokenwing.vision.qwen3vl import Qwen3VLEncoder

# the encoders the engine computes, by the mmproj's clip.projector_type
ENCODERS: dict[str, type[MmprojEncoder]] = {e.projector: e for e in (Qwen3VLEncoder, PixtralEncoder, Gemma4VEncoder)}

if TYPE_CHECKING:
    from tokenwing.runtime.session import Session


def read_image(path: str) -> np.ndarray:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise BadInputError(f"cannot read the image {path}: {e.strerror or e}") from None
    return decode_png(data)


def open_encoder(session: Session, mmproj: str) -> MmprojEncoder:
    """The mmproj's encoder (by its projector), checked against the session's model: a family that takes its
    rows, and rows as wide as the model's input (with its deepstack parts). Close it when done."""
    hp = session.hp
    cls = encoder_class(mmproj)
    if hp.arch not in cls.archs:
        raise BadInputError(f"{mmproj}: a {cls.projector} encoder, for {', '.join(cls.archs)}; this model is {hp.arch}")
    enc = cls(mmproj)
    deep = int(hp.keys.get("n_deepstack_layers", 0))
    if enc.hp.proj_dim != hp.n_embd or enc.width != hp.n_embd * (1 + deep):
        enc.close()
        raise BadInputError(
            f"{mmproj}: its rows are {enc.width} wide; the model takes {hp.n_embd} × (1 + {deep} deepstack layers)"
        )
    enc.log = session.log
    tier = session.vram
    if tier is not None:  # (the GPU when the tier left room for it after the text model's placement)
        session.log(place(enc, tier.backend, tier.plan.budget - tier.backend.peak_bytes))
    return enc


def encoder_class(mmproj: str) -> type[MmprojEncoder]:
    """The encoder for the mmproj's projector (clip.projector_type); one line for one the engine does not compute."""
    kind = projector_of(read_header(mmproj))
    cls = ENCODERS.get(kind or "")
    if cls is None:
        raise BadInputError(f"{mmproj}: an image encoder of projector {kind!r}; the engine computes {sorted(ENCODERS)}")
    return cls


def encoder_memory(mmproj: str) -> EncoderBytes:
    """What the mmproj's encoder takes in memory (its weights, the largest image's compute buffer), for the memory
    plan before the model loads (SessionOptions.also_held)."""
    enc = encoder_class(mmproj)(mmproj)
    try:
        return encoder_bytes(enc)
    finally:
        enc.close()


def grid(enc: MmprojEncoder, rgb: np.ndarray) -> tuple[int, int]:
    """(nx, ny): the merged patches across and down that the encoder makes of this image (its rows:
    enc.n_rows(nx, ny))."""
    return enc.grid_of(rgb.shape[1], rgb.shape[0])


def image_prompt(session: Session, mmproj: str, image: str, text: str) -> tuple[list[int], MediaPrompt]:
    """The session's tokens for `text` with `image` in place of its marker, and the MediaPrompt that places the
    image's rows (set it as `session.media` while the prompt and its reply run), for a fresh session."""
    if session.pos != 0:
        raise BadInputError("images: a prompt with images starts a session")
    enc = open_encoder(session, mmproj)
    try:
        rgb = read_image(image)
        nx, ny = grid(enc, rgb)
        embd = enc.encode(enc.preprocess(rgb))
    finally:
        enc.close()
    return encoder_tokens(session, enc, text, [(nx, ny, embd)])


def encoder_tokens(
    session: Session,
    enc: MmprojEncoder,
    text: str,
    images: list[tuple[int, int, np.ndarray]],
    keys: Sequence[str] = (),
) -> tuple[list[int], MediaPrompt]:
    """vision/prompt.py `tokens` for this session's model with the encoder's texts and placement (its begin and
    end texts, M-RoPE or not, bidirectional rows or not); `keys`: the images' hashes (the server's keyed rows)."""
    hp = session.hp
    return tokens(
        session.tokenizer,
        text,
        images,
        hp.n_embd,
        keys=keys,
        vocab=hp.vocab_size,
        begin=enc.begin,
        end=enc.end,
        mrope=enc.mrope,
        bidirectional=enc.bidirectional(hp.n_embd),
    )


def image_logits(session: Session, mmproj: str, image: str, text: str) -> np.ndarray:
    """(1, n_vocab): the last position's logits of `text` with `image` in place of its marker."""
    ids, session.media = image_prompt(session, mmproj, image, text)
    try:
        logits = session.forward(ids)
    finally:
        session.media = None
    return np.asarray(logits, np.float32).reshape(1, -1)
