"""A prompt with images in it, as the runtime's prompt pass takes it (issue 45): the text's tokens and each image's
rows in the sequence, the rows' RoPE positions and the text's after them, and the deepstack parts of the rows that
Qwen3-VL adds into its first layers' outputs.

`Session.media` holds one while a prompt with images runs (runtime/passes.py's three hooks: the pass's first state,
each placement's positions, each layer's output). An image row is a KV cell like a token's, so the KV cache, masks
and chunks are the text's; what differs is its input (the encoder's row, not a token's embedding), its positions
(vision/positions.py) and, after layer il < the deepstack count, the addition of the row's slice il + 1 (llama.cpp's
qwen3vlmoe graph: ds = t_inp_embd's slice, zero for text).

The text is split where `MEDIA_MARKER` stands; llama.cpp's libmtmd tokenizes each piece apart with the image's
begin and end texts (Qwen-VL's <|vision_start|> and <|vision_end|>, Pixtral's [IMG_END] after) and so does
`tokens`. Pixtral's rows (mistral4) are placed as tokens: one position a row, no M-RoPE (`mrope` off).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenwing.errors import BadInputError
from tokenwing.text.tokenizer import TextTokenizer
from tokenwing.vision.positions import image_positions, image_span

MEDIA_MARKER = "<__media__>"  # llama.cpp's mtmd_default_marker
IMAGE_BEGIN, IMAGE_END = "<|vision_start|>", "<|vision_end|>"  # Qwen-VL's (mtmd.cpp, PROJECTOR_TYPE_QWEN3VL)
PLACEHOLDER = 0  # the token id an image row is embedded as (its input is replaced), where it has no key
# A keyed image row's id in the history (the server's): past the vocabulary, from the image's hash and the row, so
# that a prompt cache (a slot's history, the disk cache's token lists) never takes one image's rows for another's
# or for text; below 2^31, as the snapshot files keep ids as int32.
_ROW_IDS = 1 << 31


def row_ids(key: str, n: int, vocab: int) -> list[int]:
    """The history ids of an image's n rows: vocab … 2^31 - 1, drawn from the image's key (its content hash)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    drawn = vocab + np.random.default_rng(seed).integers(0, _ROW_IDS - vocab, n)
    return [int(t) for t in drawn]


@dataclass(frozen=True)
class ImageRows:
    start: int  # the sequence index (KV cell) of its first row
    nx: int
    ny: int
    embd: np.ndarray  # (rows, n_embd × (1 + deepstack layers)): nx · ny rows, and Pixtral's [IMG_BREAK] rows

    @property
    def rows(self) -> int:
        """Its KV cells."""
        return int(self.embd.shape[0])


@dataclass
class MediaPrompt:
    n_embd: int
    images: list[ImageRows] = field(default_factory=list)
    mrope: bool = True  # the rows placed by M-RoPE (Qwen-VL); else as tokens, one position a row (Pixtral)
    # an image's rows attend to one another both ways (llama.cpp's mtmd_decode_use_non_causal: Gemma 4 but E2B and
    # E4B): a row sees the rows after it (`unmask`), and each image is in one chunk of its pass (`whole`)
    bidirectional: bool = False

    def _shift(self, cell: int) -> int:
        """How far position and cell part at `cell`: each whole image before it takes fewer positions than rows."""
        return sum(im.rows - image_span(im.nx, im.ny) for im in self.images if im.start + im.rows <= cell)

    def positions(self, pos0: int, n: int) -> np.ndarray:
        """I32 [4 n] for the cells pos0 … pos0 + n - 1: text on three axes and 0 on the fourth, image rows theirs;
        without M-RoPE I32 [n], every row at its cell as a token is."""
        if not self.mrope:
            return np.arange(pos0, pos0 + n, dtype=np.int32)
        out = np.zeros((4, n), np.int32)
        for i in range(n):
            cell = pos0 + i
            im = next((m for m in self.images if m.start <= cell < m.start + m.rows), None)
            if im is None:
                out[:3, i] = cell - self._shift(cell)
            else:
                p0 = im.start - self._shift(im.start)
                out[:, i] = image_positions(p0, im.nx, im.ny).reshape(4, -1)[:, cell - im.start]
        return out.reshape(-1)

    def text_ids(self, tokens: list[int], pos0: int) -> list[int]:
        """`tokens` (the cells pos0 …) with every image row's id as PLACEHOLDER: what the embedding looks up (the
        row's input then replaced, `inputs`) and what is checked against the vocabulary."""
        out = list(tokens)
        for at, _, _ in self._rows(pos0, len(tokens)):
            out[at] = [PLACEHOLDER] * (at.stop - at.start)
        return out

    def _rows(self, pos0: int, n: int) -> list[tuple[slice, ImageRows, slice]]:
        """(rows of the pass, image, its rows) where the pass's cells pos0 … pos0 + n - 1 are an image's."""
        out = []
        for im in self.images:
            lo, hi = max(pos0, im.start), min(pos0 + n, im.start + im.rows)
            if lo < hi:
                out.append((slice(lo - pos0, hi - pos0), im, slice(lo - im.start, hi - im.start)))
        return out

    def inputs(self, h: np.ndarray, pos0: int) -> None:
        """The pass's first state: image rows' main parts in place of their placeholders' embeddings."""
        for at, im, rows in self._rows(pos0, h.shape[0]):
            h[at] = im.embd[rows, : self.n_embd]

    def after_layer(self, il: int, h: np.ndarray, pos0: int) -> None:
        """Layer il's output: its deepstack part added to the image rows (text adds zeros)."""
        lo, hi = (il + 1) * self.n_embd, (il + 2) * self.n_embd
        for at, im, rows in self._rows(pos0, h.shape[0]):
            if hi <= im.embd.shape[1]:
                h[at] += im.embd[rows, lo:hi]

    def unmask(self, arrays: dict[str, np.ndarray], pos0: int) -> None:
        """A placement's masks (models/placement.placement_arrays) for the cells pos0 …: with `bidirectional`, an
        image row also sees the rows after it in its image, in the full and sliding-window masks alike (llama.cpp's
        non-causal KV mask: a key later than the query is not masked; the window still masks keys too far back)."""
        if not self.bidirectional:
            return
        for name in ("mask", "mask_swa", "flash_mask", "flash_mask_swa"):
            m = arrays.get(name)
            if m is None:
                continue
            for at, im, _ in self._rows(pos0, min(m.shape[0], len(arrays["k_rows"]))):
                for i in range(at.start, at.stop):
                    m[i, pos0 + i + 1 : im.start + im.rows] = 0.0

    def whole(self, chunks: list[slice], pos0: int) -> list[slice]:
        """A pass's chunks (of the cells pos0 …) joined where one would split a bidirectional image: its later rows'
        keys must be written before its earlier rows attend (llama.cpp decodes an image in one batch)."""
        if not self.bidirectional:
            return chunks
        out: list[slice] = []
        for c in chunks:
            if out and any(im.start < pos0 + c.start < im.start + im.rows for im in self.images):
                out[-1] = slice(out[-1].start, c.stop)
            else:
                out.append(c)
        return out


def tokens(
    tok: TextTokenizer,
    text: str,
    images: list[tuple[int, int, np.ndarray]],
    n_embd: int,
    keys: Sequence[str] = (),
    vocab: int = 0,
    begin: str = IMAGE_BEGIN,
    end: str = IMAGE_END,
    mrope: bool = True,
    bidirectional: bool = False,
) -> tuple[list[int], MediaPrompt]:
    """The session's tokens for `text` with one image (nx, ny, embeddings) per MEDIA_MARKER, and its MediaPrompt.
    With `keys` (each image's content hash) an image's rows are `row_ids` past the `vocab`, else PLACEHOLDER.
    `begin`, `end`, `mrope`: the encoder's (MmprojEncoder's; "": no such text), Qwen-VL's by default;
    `bidirectional`: the rows attend both ways (`MediaPrompt`)."""
    parts = text.split(MEDIA_MARKER)
    if len(parts) - 1 != len(images):
        raise BadInputError(f"the text has {len(parts) - 1} {MEDIA_MARKER} for {len(images)} image(s)")
    out: list[int] = []
    media = MediaPrompt(n_embd, mrope=mrope, bidirectional=bidirectional)
    for i, part in enumerate(parts):
        pieces = ([end] if i else []) + ([part] if part else []) + ([begin] if i < len(images) else [])
        for piece in filter(None, pieces):
            out += tok.encode(piece, special=True, add_bos=False)
        if i < len(images):
            nx, ny, embd = images[i]
            media.images.append(ImageRows(len(out), nx, ny, embd))
            n = media.images[-1].rows
            out += row_ids(keys[i], n, vocab) if keys else [PLACEHOLDER] * n
    return out, media
