"""Images as chat requests name them (issue 45 item 4): OpenAI's `image_url` content parts, read by
`protocol.parse_chat` (the Responses and Messages routes go through it too). Only their form is checked here (a
data: URL's base64, an http(s) URL); the engine thread decodes and encodes them (server/images.py).

A part stands in its message's text as `<__media_K__>` (K: the request's K-th image) while the template renders the
conversation and the overflow policy drops turns: the rendered prompt's markers then say which images it still
has, in order, and become llama.cpp's `<__media__>` (`shown`; vision/prompt.py tokenizes the text around them as
libmtmd does)."""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwing.errors import BadInputError
from tokenwing.vision.prompt import MEDIA_MARKER

MARKER = "<__media_{}__>"
MARKERS = re.compile(r"<__media_(\d+)__>")
_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[\w.+-]+)*);base64,", re.ASCII)


@dataclass(frozen=True)
class ImageSource:
    """An image as the request names it: its bytes (a data: URL's) or a remote http(s) URL; `rgb` once decoded
    (server/images.py `decode_ahead`, before the request reaches the engine thread)."""

    where: str  # messages[i].content[j]
    data: bytes | None = None
    url: str | None = None
    rgb: np.ndarray | None = field(default=None, compare=False, repr=False)


def image_part(part: dict[str, Any], where: str) -> ImageSource:
    """An `{"type": "image_url", "image_url": {"url": …}}` part (the url alone as a string also taken)."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise BadInputError(f"{where}.image_url.url must be a string (a data: URL or an http(s) URL)")
    if url.startswith(("http://", "https://")):
        return ImageSource(where, url=url)
    if not url.startswith("data:"):
        raise BadInputError(f"{where}.image_url.url must be a data: URL (base64) or an http(s) URL")
    head = _DATA_URL.match(url)
    if head is None:
        raise BadInputError(f"{where}.image_url.url: a data: URL must be base64 (data:image/png;base64,…)")
    try:
        data = base64.b64decode(url[head.end() :], validate=True)
    except (binascii.Error, ValueError):
        raise BadInputError(f"{where}.image_url.url: its base64 data is not valid") from None
    return ImageSource(where, data=data)


def marked(text: str, where: str) -> str:
    """A text part, refused where it holds the server's own image marker (it would be taken for an image)."""
    found = MARKERS.search(text)
    if found is not None:
        raise BadInputError(f"{where}: the text holds {found[0]}, the server's image marker")
    return text


def shown(text: str) -> str:
    """A rendered prompt as /apply-template shows it: each image where llama.cpp's marker puts it."""
    return MARKERS.sub(MEDIA_MARKER, text)
