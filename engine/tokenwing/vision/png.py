"""PNG files to RGB bytes, as llama.cpp's libmtmd reads them (stb_image with 3 channels: grey repeated, alpha
dropped, not composited). 8-bit, non-interlaced images of any colour type but palettes; anything else is refused in
one line naming what is not read. No imaging library: the engine's dependencies stay as they are."""

from __future__ import annotations

import struct
import zlib

import numpy as np

from tokenwing.errors import BadInputError

SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PIXELS = 64 << 20  # a decoded image's pixels at most (192 MiB of RGB): a larger one is refused, never allocated
_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # colour type → samples a pixel


def _unfilter(raw: bytes, height: int, stride: int, bpp: int) -> np.ndarray:
    """The scanlines without their filters (PNG's five: none, sub, up, average, Paeth)."""
    out = np.zeros((height, stride), np.uint8)
    prev = np.zeros(stride, np.int32)
    view = np.frombuffer(raw, np.uint8)
    for y in range(height):
        start = y * (stride + 1)
        kind = int(view[start])
        line = view[start + 1 : start + 1 + stride].astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 2:
            cur = (line + prev) & 0xFF
        elif kind in (1, 3, 4):
            cur = line.copy()
            for i in range(stride):  # (each byte depends on the one bpp before: a loop)
                a = int(cur[i - bpp]) if i >= bpp else 0
                b = int(prev[i])
                if kind == 1:
                    pred = a
                elif kind == 3:
                    pred = (a + b) >> 1
                else:
                    c = int(prev[i - bpp]) if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[i] = (cur[i] + pred) & 0xFF
        else:
            raise BadInputError(f"PNG: unknown filter {kind} in row {y}")
        out[y] = cur
        prev = cur
    return out


def decode_png(data: bytes, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """RGB bytes (height, width, 3) of a PNG file's image (refused past `max_pixels`, before any is decoded)."""
    if not data.startswith(SIGNATURE):
        raise BadInputError("not a PNG image (the engine reads PNG)")
    pos, header, idat = len(SIGNATURE), None, []
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if len(body) != length:
            break
        if kind == b"IHDR":
            if len(body) < 13:
                raise BadInputError("PNG: truncated image header")
            header = struct.unpack(">IIBBBBB", body[:13])
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    if header is None or not idat:
        raise BadInputError("PNG: truncated (no image header or data)")
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in _CHANNELS or interlace:
        raise BadInputError(
            f"PNG: {depth}-bit colour type {colour}{' interlaced' if interlace else ''} is not read "
            "(8-bit grey, grey+alpha, RGB or RGBA, not interlaced)"
        )
    if not 0 < width * height <= max_pixels:
        raise BadInputError(f"PNG: {width}x{height} pixels; at most {max_pixels} are read")
    n = _CHANNELS[colour]
    try:
        raw = zlib.decompressobj().decompress(b"".join(idat), height * (width * n + 1))
    except zlib.error as e:
        raise BadInputError(f"PNG: corrupt image data ({e})") from None
    if len(raw) < height * (width * n + 1):
        raise BadInputError("PNG: truncated image data")
    px = _unfilter(raw, height, width * n, n).reshape(height, width, n)
    if n <= 2:
        return np.ascontiguousarray(np.repeat(px[:, :, :1], 3, axis=2))
    return np.ascontiguousarray(px[:, :, :3])
