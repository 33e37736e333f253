"""Pictures in a chat (issue 45 item 5), Qt-free: the composer's attachments, the files a conversation keeps, and
the OpenAI content parts a message with pictures is sent as.

* A picture is kept as a PNG file in the app's data folder, `<images>/<conversation id>/<sha256>.png`, and a
  message names its files (`Message.images`); deleting the conversation deletes its folder. PNG because the engine
  reads PNG (tokenwing/vision/png.py) and because it is lossless: the widgets turn any picture Qt reads (JPEG,
  WebP, a pasted bitmap) into one before it gets here.
* The same picture twice in a conversation is one file (named by its bytes' hash).
* Sent as `{"type": "image_url", "image_url": {"url": "data:image/png;base64,…"}}` parts before the message's text
  (docs/api.md), the shape every OpenAI-compatible server takes.
"""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_IMAGES = 4  # pictures in one message: each costs hundreds to thousands of the context's tokens
MAX_BYTES = 16 << 20  # one picture's PNG file (a screenshot at 4K is ~3 MB); the widgets scale larger ones down
_NAME = re.compile(r"^[0-9a-f]{64}\.png$")


class ImageError(Exception):
    """A picture the chat does not take: one sentence for the user."""


@dataclass(frozen=True)
class Picture:
    """One picture as PNG bytes, with the name it came under (a file's, or "pasted image")."""

    png: bytes
    label: str = "image"

    @property
    def name(self) -> str:
        """Its file's name in a conversation's folder: its hash (the same picture is one file)."""
        return hashlib.sha256(self.png).hexdigest() + ".png"


def checked(png: bytes, label: str) -> Picture:
    """`png` as a Picture, or ImageError naming what is wrong (not a PNG, too large)."""
    if not png.startswith(PNG_MAGIC):
        raise ImageError(f"{label} is not a picture the chat can read.")
    if len(png) > MAX_BYTES:
        raise ImageError(f"{label} is {len(png) / 2**20:.1f} MB; a picture may be {MAX_BYTES >> 20} MB at most.")
    return Picture(png, label)


@dataclass
class Attachments:
    """The pictures waiting in the composer for the next message: at most MAX_IMAGES, each once."""

    pictures: list[Picture] = field(default_factory=list)

    def add(self, picture: Picture) -> bool:
        """Adds it (False: it is already there). ImageError when the message has as many as it may."""
        if any(p.name == picture.name for p in self.pictures):
            return False
        if len(self.pictures) >= MAX_IMAGES:
            raise ImageError(f"A message takes {MAX_IMAGES} pictures at most.")
        self.pictures.append(picture)
        return True

    def remove(self, index: int) -> None:
        if 0 <= index < len(self.pictures):
            del self.pictures[index]

    def take(self) -> list[Picture]:
        """The pictures, and the composer is empty of them."""
        out, self.pictures = self.pictures, []
        return out

    def __len__(self) -> int:
        return len(self.pictures)


class ImageFolder:
    """Where the conversations' pictures are kept: one folder per conversation under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def folder(self, conversation_id: int) -> Path:
        return self.root / str(int(conversation_id))

    def save(self, conversation_id: int, pictures: Sequence[Picture]) -> tuple[str, ...]:
        """Writes the pictures (a file already there is kept); returns their names, for the message."""
        folder = self.folder(conversation_id)
        folder.mkdir(parents=True, exist_ok=True)
        names = []
        for p in pictures:
            path = folder / p.name
            if not path.is_file():
                tmp = path.with_suffix(".partial")
                tmp.write_bytes(p.png)
                tmp.replace(path)  # (a crash leaves no half picture under its real name)
            names.append(p.name)
        return tuple(names)

    def path(self, conversation_id: int, name: str) -> Path:
        """A message's picture's file. ImageError for a name that is not one of ours (a damaged or edited store)."""
        if not _NAME.match(name):
            raise ImageError(f"{name!r} is not the name of a kept picture.")
        return self.folder(conversation_id) / name

    def read(self, conversation_id: int, name: str) -> bytes:
        try:
            return self.path(conversation_id, name).read_bytes()
        except OSError as e:
            raise ImageError(f"A picture of this conversation is missing ({name}): {e.strerror or e}.") from None

    def delete(self, conversation_id: int) -> None:
        """The conversation's pictures go with it."""
        shutil.rmtree(self.folder(conversation_id), ignore_errors=True)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def from_data_url(url: object) -> bytes:
    """A PNG data URL's bytes (an export's picture); ImageError for anything else."""
    head = "data:image/png;base64,"
    if not isinstance(url, str) or not url.startswith(head):
        raise ImageError("not a PNG data URL")
    try:
        return base64.b64decode(url[len(head) :], validate=True)
    except ValueError:
        raise ImageError("its base64 is damaged") from None


def content_parts(text: str, pictures: Sequence[bytes]) -> list[dict[str, Any]]:
    """A user message's `content` with pictures: each as an `image_url` part, then the text (if any)."""
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(png)}} for png in pictures]
    if text:
        parts.append({"type": "text", "text": text})
    return parts


def takes_images(model_entry: object) -> bool:
    """Whether a server's `/v1/models` entry says the model reads pictures: TokenWing's and llama.cpp's
    `"modalities": {"vision": true}` (docs/api.md). An entry that does not say: it does not."""
    if not isinstance(model_entry, dict):
        return False
    modalities = model_entry.get("modalities")
    return isinstance(modalities, dict) and modalities.get("vision") is True
