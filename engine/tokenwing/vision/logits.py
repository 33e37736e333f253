"""`tokenwing logits MODEL --mmproj P --image FILE --text "… <__media__> …"`: the logits of the text's last
position with the image where the marker is, as llama.cpp's mtmd_helper_eval_chunks computes them (issue 45)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tokenwing.errors import BadInputError
from tokenwing.vision.png import decode_png
from tokenwing.vision.prompt import MediaPrompt, tokens
from tokenwing.vision.qwen3vl import Qwen3VLEncoder

if TYPE_CHECKING:
    from tokenwing.runtime.session import Session


def read_image(path: str) -> np.ndarray:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise BadInputError(f"cannot read the image {path}: {e.strerror or e}") from None
    return decode_png(data)


def image_prompt(session: Session, mmproj: str, image: str, text: str) -> tuple[list[int], MediaPrompt]:
    """The session's tokens for `text` with `image` in place of its marker, and the MediaPrompt that places the
    image's rows (set it as `session.media` while the prompt and its reply run), for a fresh session."""
    hp = session.hp
    if hp.arch != "qwen3vlmoe":
        raise BadInputError(f"images: the engine places them for qwen3vlmoe; this model is {hp.arch}")
    if session.pos != 0:
        raise BadInputError("images: a prompt with images starts a session")
    rgb = read_image(image)
    enc = Qwen3VLEncoder(mmproj)
    try:
        deep = int(hp.keys.get("n_deepstack_layers", 0))
        if enc.hp.proj_dim != hp.n_embd or enc.width != hp.n_embd * (1 + deep):
            raise BadInputError(
                f"{mmproj}: its rows are {enc.width} wide; the model takes {hp.n_embd} × (1 + {deep} deepstack layers)"
            )
        pre = enc.preprocess(rgb)
        embd = enc.encode(pre)
        side = enc.hp.patch_size * enc.hp.n_merge
    finally:
        enc.close()
    return tokens(session.tokenizer, text, [(pre.width // side, pre.height // side, embd)], hp.n_embd)


def image_logits(session: Session, mmproj: str, image: str, text: str) -> np.ndarray:
    """(1, n_vocab): the last position's logits of `text` with `image` in place of its marker."""
    ids, session.media = image_prompt(session, mmproj, image, text)
    try:
        logits = session.forward(ids)
    finally:
        session.media = None
    return np.asarray(logits, np.float32).reshape(1, -1)
