"""The server's images (issue 45 item 4): a request's image parts (server/image_parts.py) decoded (PNG, within
MAX_IMAGE_PIXELS; a remote URL fetched only with `serve --allow-image-urls`), encoded by the model's image encoder
(`serve --mmproj`, once per image content: vision/cache.py) and placed in the prompt, on the engine thread
(server/worker.py).

An image's rows are its `row_ids` in the prompt: ids past the vocabulary drawn from its content hash, so that a
slot's cached tokens and the disk cache's snapshots match a prompt only where it has the same image in the same
place (a different image never reuses another's keys and values), and `usage` counts the rows as tokens.
"""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.request

import numpy as np

from tokenwing.errors import BadInputError
from tokenwing.runtime.session import Session
from tokenwing.server.image_parts import MARKERS, ImageSource
from tokenwing.vision.cache import EncodedImages, image_key
from tokenwing.vision.logits import encoder_tokens, grid, open_encoder
from tokenwing.vision.png import decode_png
from tokenwing.vision.prompt import MEDIA_MARKER, MediaPrompt

MAX_IMAGE_PIXELS = 4096 * 4096  # a decoded image's pixels at most (48 MiB of RGB); Qwen-VL downscales past 4 M
MAX_FETCH_BYTES = 8 << 20  # a fetched image (--allow-image-urls), as the request body's own limit
FETCH_TIMEOUT_S = 10.0


def fetch(url: str, where: str) -> bytes:
    """A remote image (--allow-image-urls): at most MAX_FETCH_BYTES within FETCH_TIMEOUT_S, or a 400 naming why."""
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as r:  # (http(s) only: image_part)
            data: bytes = r.read(MAX_FETCH_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise BadInputError(f"{where}: cannot fetch the image {url[:200]}: {e}") from None
    if len(data) > MAX_FETCH_BYTES:
        raise BadInputError(f"{where}: the image at {url[:200]} is larger than {MAX_FETCH_BYTES >> 20} MiB")
    return data


class Vision:
    """The server's image encoder (the mmproj's, checked against the model) and its embeddings by image hash."""

    def __init__(self, session: Session, mmproj: str, allow_urls: bool) -> None:
        self.mmproj = mmproj
        self.allow_urls = allow_urls
        self.encoder = open_encoder(session, mmproj)
        self.cache = EncodedImages()

    def close(self) -> None:
        self.encoder.close()

    def decoded(self, src: ImageSource) -> np.ndarray:
        """The image's RGB bytes; a 400 naming what is wrong or the limit it passes."""
        if src.rgb is not None:  # (decoded ahead, off the engine thread: decode_ahead)
            return src.rgb
        data = src.data
        if src.url is not None:
            if not self.allow_urls:
                raise BadInputError(
                    f"{src.where}: remote image URLs are not fetched (the server's --allow-image-urls fetches them); "
                    "send the image as a data: URL (data:image/png;base64,…)"
                )
            data = fetch(src.url, src.where)
        assert data is not None
        try:
            return decode_png(data, MAX_IMAGE_PIXELS)
        except BadInputError as e:
            raise BadInputError(f"{src.where}: {e}") from None

    def encoded(
        self, sources: list[ImageSource], n_ctx: int, encode: bool = True
    ) -> tuple[list[str], list[tuple[int, int, np.ndarray]]]:
        """Each image's key and (nx, ny, embeddings), encoded once per image content (EncodedImages); an image
        whose rows alone fill the context is refused before it is encoded (no work for a prompt that cannot run).
        Without `encode` (a count of the prompt's tokens) the embeddings are empty rows, no encoder runs."""
        keys, rows = [], []
        enc = self.encoder
        for src in sources:
            rgb = self.decoded(src)
            nx, ny = grid(enc, rgb)
            n = enc.n_rows(nx, ny)
            if n >= n_ctx:
                raise BadInputError(
                    f"{src.where}: the image is {n} tokens ({rgb.shape[1]}x{rgb.shape[0]} pixels); the context holds "
                    f"{n_ctx}: send it smaller"
                )
            if not encode:
                rows.append((nx, ny, np.empty((n, 0), np.float32)))
            else:
                rows.append((nx, ny, self.cache.get(rgb, lambda x: enc.encode(enc.preprocess(x)))))
            keys.append(image_key(rgb))
        return keys, rows


def decode_ahead(vision: Vision | None, sources: list[ImageSource]) -> list[ImageSource]:
    """The request's images fetched (--allow-image-urls) and decoded, for a thread of the HTTP side to run before
    the request is queued: on the engine thread a fetch (up to FETCH_TIMEOUT_S) or a large PNG's decode (0.32 s
    for 1024x768, measured by issue 45's server lane) would hold every other slot's decode step. Without an encoder
    nothing is done (the engine thread refuses the images in one line: no_vision)."""
    if vision is None:
        return sources
    return [dataclasses.replace(s, rgb=vision.decoded(s), data=None) for s in sources]


def no_vision(sources: list[ImageSource]) -> BadInputError:
    return BadInputError(
        f"{sources[0].where}: this model takes no images (the server has no image encoder: serve --mmproj FILE)"
    )


class ImagePrompt:
    """A request's images, encoded, and how a rendered prompt with their markers is tokenized (`encode`, what the
    overflow policy counts with) and placed (`media`)."""

    def __init__(self, vision: Vision, session: Session, sources: list[ImageSource], encode: bool = True) -> None:
        self.session = session
        self.encoder = vision.encoder
        self.keys, self.rows = vision.encoded(sources, session.n_ctx, encode)

    def _split(self, text: str) -> tuple[str, list[int]]:
        order = [int(m) for m in MARKERS.findall(text)]
        if any(k >= len(self.rows) for k in order):
            raise BadInputError("an image marker names no image of the request")
        return MARKERS.sub(MEDIA_MARKER, text), order

    def tokens(self, text: str) -> tuple[list[int], MediaPrompt | None]:
        s = self.session
        plain, order = self._split(text)
        if not order:
            return s.tokenizer.encode(text, special=True), None
        ids, media = encoder_tokens(
            s, self.encoder, plain, [self.rows[k] for k in order], [self.keys[k] for k in order]
        )
        return ids, media

    def encode(self, text: str) -> list[int]:
        return self.tokens(text)[0]


def request_images(
    vision: Vision | None, session: Session, sources: list[ImageSource], encode: bool = True
) -> ImagePrompt | None:
    """A chat request's images, encoded (None without any); a model served without an encoder refuses them.
    Without `encode`: only their rows counted (/v1/chat/count, /v1/messages/count_tokens: beside the engine
    thread, which alone runs the encoder)."""
    if not sources:
        return None
    if vision is None:
        raise no_vision(sources)
    return ImagePrompt(vision, session, sources, encode)
