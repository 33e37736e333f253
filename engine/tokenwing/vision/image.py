"""An image to an encoder's input pixels, as llama.cpp's libmtmd makes them (tools/mtmd/mtmd-image.cpp): the size
kept in proportion and aligned to the merged patch within a pixel budget ("smart resize",
calc_size_preserved_ratio, in float32 as there), Pillow's bicubic resampling in 22-bit fixed point (resize_pillow)
into that size, fitted and centred on black (PAD_CEIL), then each channel as (v / 255 − mean) / std."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokenwing.errors import BadInputError

_BITS = 22  # Pillow's fixed point: 32 − 8 − 2
_F = np.float32


@dataclass(frozen=True)
class ImageLimits:
    align: int  # patch × merge: a side is a multiple of it
    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class Preprocessed:
    pixels: np.ndarray  # (3, height, width) float32, normalised channel planes
    width: int
    height: int


def target_size(width: int, height: int, lim: ImageLimits) -> tuple[int, int]:
    """calc_size_preserved_ratio without longest_edge: (width, height) of the resized image."""
    f = lim.align

    def ceil_by(x: np.float32) -> int:
        return math.ceil(_F(x) / _F(f)) * f

    def floor_by(x: np.float32) -> int:
        return math.floor(_F(x) / _F(f)) * f

    # std::round rounds halves away from zero (np.round to even)
    w_bar = max(f, _round_half_away(_F(width) / _F(f)) * f)
    h_bar = max(f, _round_half_away(_F(height) / _F(f)) * f)
    if h_bar * w_bar > lim.max_pixels:
        beta = _F(np.sqrt(_F(_F(height) * _F(width)) / _F(lim.max_pixels)))
        h_bar = max(f, floor_by(_F(_F(height) / beta)))
        w_bar = max(f, floor_by(_F(_F(width) / beta)))
    elif h_bar * w_bar < lim.min_pixels:
        beta = _F(np.sqrt(_F(lim.min_pixels) / _F(_F(height) * _F(width))))
        h_bar = ceil_by(_F(_F(height) * beta))
        w_bar = ceil_by(_F(_F(width) * beta))
    return w_bar, h_bar


def _round_half_away(x: np.float32) -> int:
    return math.floor(x + 0.5) if x >= 0 else -math.floor(-x + 0.5)


def _weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pillow's bicubic (a = −0.5) coefficients for one axis: first input index, count, fixed-point weights."""
    scale = filterscale = in_size / out_size
    filterscale = max(filterscale, 1.0)
    support = 2.0 * filterscale
    ksize = math.ceil(support) * 2 + 1
    first = np.zeros(out_size, np.int64)
    count = np.zeros(out_size, np.int64)
    kk = np.zeros((out_size, ksize), np.float64)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        ws = [_bicubic((x + xmin - center + 0.5) / filterscale) for x in range(xmax)]
        total = sum(ws)  # summed in order, as there
        for x, w in enumerate(ws):
            kk[xx, x] = w / total if total != 0.0 else w
        first[xx], count[xx] = xmin, xmax
    fixed = kk * float(1 << _BITS)
    fixed = np.trunc(fixed + np.where(kk < 0, -0.5, 0.5)).astype(np.int64)
    return first, count, fixed


def _bicubic(x: float) -> float:
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _resample(src: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One separable pass along `axis` (1: columns, 0: rows) of an (h, w, 3) uint8 image."""
    first, count, fixed = _weights(src.shape[axis], out_size)
    moved = np.moveaxis(src.astype(np.int64), axis, 0)
    out = np.empty((out_size, *moved.shape[1:]), np.int64)
    for i in range(out_size):
        rows = moved[first[i] : first[i] + count[i]]
        acc = np.full(moved.shape[1:], 1 << (_BITS - 1), np.int64)
        for j in range(count[i]):
            acc += rows[j] * fixed[i, j]
        out[i] = acc >> _BITS
    return np.moveaxis(np.clip(out, 0, 255).astype(np.uint8), 0, axis)


def resize_bicubic(rgb: np.ndarray, width: int, height: int) -> np.ndarray:
    """Pillow's BICUBIC resize of an (h, w, 3) uint8 image: horizontal pass, then vertical."""
    out = rgb
    if width != rgb.shape[1]:
        out = _resample(out, width, 1)
    if height != rgb.shape[0]:
        out = _resample(out, height, 0)
    return out


def fit(rgb: np.ndarray, width: int, height: int) -> np.ndarray:
    """img_tool::resize with PAD_CEIL: scaled to fit, centred on black; a same-size image is copied."""
    sh, sw = rgb.shape[:2]
    if (sw, sh) == (width, height):
        return rgb
    scale = min(_F(width) / _F(sw), _F(height) / _F(sh))
    new_w = min(math.ceil(_F(_F(sw) * scale)), width)
    new_h = min(math.ceil(_F(_F(sh) * scale)), height)
    out = np.zeros((height, width, 3), np.uint8)
    x0, y0 = (width - new_w) // 2, (height - new_h) // 2
    out[y0 : y0 + new_h, x0 : x0 + new_w] = resize_bicubic(rgb, new_w, new_h)
    return out


def preprocess(
    rgb: np.ndarray, lim: ImageLimits, mean: tuple[float, float, float], std: tuple[float, float, float]
) -> Preprocessed:
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8 or min(rgb.shape[:2]) < 1:
        raise BadInputError(f"an image must be RGB bytes (height, width, 3), not {rgb.dtype} {rgb.shape}")
    width, height = target_size(rgb.shape[1], rgb.shape[0], lim)
    scaled = fit(rgb, width, height).astype(_F) / _F(255.0)
    pixels = ((scaled - np.asarray(mean, _F)) / np.asarray(std, _F)).astype(_F)
    return Preprocessed(np.ascontiguousarray(pixels.transpose(2, 0, 1)), width, height)
