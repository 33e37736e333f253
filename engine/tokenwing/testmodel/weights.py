"""Random tensor data in each directly generated type, produced in bounded chunks.

Quantised types are generated in the quantised domain (random block scales and quants), which is fast enough
for tens of GB and gives weights of the intended standard deviation once dequantised.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenwing.models.specs import TensorSpec

DIRECT_TYPES = {
    "F32": GGMLQuantizationType.F32,
    "F16": GGMLQuantizationType.F16,
    "BF16": GGMLQuantizationType.BF16,
    "Q8_0": GGMLQuantizationType.Q8_0,
    "Q4_0": GGMLQuantizationType.Q4_0,
}
# Types only the routed experts take (gpt-oss's converter keeps its MXFP4 experts and writes the rest in the
# output type).
EXPERT_TYPES = {"MXFP4": GGMLQuantizationType.MXFP4}

CHUNK_ELEMENTS = 1 << 22  # ~16 MB of f32 at most in flight per chunk

# Standard deviation of the uniform integer quants: Q8_0 draws -127..127, Q4_0 draws 1..15 around 8
# (both symmetric, so the weights have mean zero).
_Q8_STD = math.sqrt((255**2 - 1) / 12)
_Q4_STD = math.sqrt((15**2 - 1) / 12)
# MXFP4: 4-bit E2M1 codes (ggml keeps them doubled: kvalues_mxfp4) times 2^(e - 128) per 32 values; uniform
# codes have this standard deviation in ggml's doubled units.
_MXFP4_KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)
_MXFP4_STD = float(np.sqrt(np.mean(_MXFP4_KVALUES**2)))


def tensor_type(
    spec: TensorSpec, wanted: GGMLQuantizationType, experts: GGMLQuantizationType | None = None
) -> GGMLQuantizationType:
    """Norms, biases, routers and hyper-connection mixes stay F32 (as llama.cpp keeps them), expert-id tables I32;
    matrices take the wanted type, routed experts `experts` where given."""
    if spec.role == "expert_ids":
        return GGMLQuantizationType.I32
    if spec.role in ("norm", "vector", "router", "decay_neg", "decay_pos", "mixer") or len(spec.shape) == 1:
        return GGMLQuantizationType.F32
    if spec.role == "expert" and experts is not None:
        wanted = experts
    block = GGML_QUANT_SIZES[wanted][0]
    if spec.shape[0] % block:
        return GGMLQuantizationType.F32  # the factory's shapes avoid this; keep the file valid anyway
    return wanted


def tensor_std(spec: TensorSpec, embd_std: float, weight_std: float, router_scale: float = 1.0) -> float:
    if spec.role == "embd":
        return embd_std
    scale = router_scale if spec.role == "router" else 1.0
    if weight_std > 0:
        return weight_std * scale
    return scale / math.sqrt(spec.fan_in)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _floats(rng: np.random.Generator, n: int, spec: TensorSpec, std: float) -> np.ndarray:
    if spec.role == "norm":
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
    if spec.role == "rope_freqs":  # proportional RoPE (Gemma 4): a quarter of the pairs rotate, 1e30 stills the rest
        return np.where(np.arange(n) < max(1, n // 4), 1.0, 1e30).astype(np.float32)
    if spec.role in ("decay_neg", "decay_pos"):  # a linear layer's decay rate: -exp(A_log), or exp(A_log) (KDA)
        rate: np.ndarray = np.exp(0.5 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
        return -rate if spec.role == "decay_neg" else rate
    return rng.standard_normal(n, dtype=np.float32) * np.float32(std)


def _q8_0(rng: np.random.Generator, n_blocks: int, std: float) -> bytes:
    out = np.empty((n_blocks, 34), dtype=np.uint8)
    d = (std / _Q8_STD) * rng.uniform(0.75, 1.25, n_blocks)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    out[:, 2:] = rng.integers(-127, 128, (n_blocks, 32), dtype=np.int8).view(np.uint8)
    return out.tobytes()


def _q4_0(rng: np.random.Generator, n_blocks: int, std: float) -> bytes:
    out = np.empty((n_blocks, 18), dtype=np.uint8)
    d = (std / _Q4_STD) * rng.uniform(0.75, 1.25, n_blocks)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    nibbles = rng.integers(1, 16, (n_blocks, 2, 16), dtype=np.uint8)
    out[:, 2:] = nibbles[:, 0] | (nibbles[:, 1] << np.uint8(4))
    return out.tobytes()


def _mxfp4(rng: np.random.Generator, n_blocks: int, std: float) -> bytes:
    """Random codes with a shared exponent per block, mixed between the two exponents around the wanted scale
    so that the expected variance is exactly std² (one exponent alone would miss it by up to 2x)."""
    out = np.empty((n_blocks, 17), dtype=np.uint8)
    exact = 128 + math.log2(std / _MXFP4_STD)
    low = math.floor(exact)
    p_high = (4**exact - 4**low) / (4 ** (low + 1) - 4**low)  # E[4^e] = 4^exact
    e = low + (rng.random(n_blocks) < p_high)
    out[:, 0] = np.clip(e, 2, 254).astype(np.uint8)
    out[:, 1:] = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
    return out.tobytes()


def _expert_ids(rng: np.random.Generator, n_rows: int, per_row: int, n_ids: int) -> bytes:
    """Each row `per_row` distinct ids below `n_ids`, uniformly drawn (a hash layer routes a token to distinct
    experts)."""
    order = np.argsort(rng.random((n_rows, n_ids)), axis=1)[:, :per_row]
    return order.astype(np.int32).tobytes()


def generate(spec: TensorSpec, qtype: GGMLQuantizationType, rng: np.random.Generator, std: float) -> Iterator[bytes]:
    """Yields the tensor's bytes in chunks of whole rows."""
    row = spec.shape[0]
    rows = math.prod(spec.shape[1:])
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(row, spec.id_range))
    for start in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - start) * row
        if qtype == GGMLQuantizationType.I32:
            if spec.role != "expert_ids" or not 0 < row <= spec.id_range:
                raise ValueError(f"{spec.name}: only expert-id tables are generated as I32")
            yield _expert_ids(rng, n // row, row, spec.id_range)
        elif qtype == GGMLQuantizationType.Q8_0:
            yield _q8_0(rng, n // 32, std)
        elif qtype == GGMLQuantizationType.Q4_0:
            yield _q4_0(rng, n // 32, std)
        elif qtype == GGMLQuantizationType.MXFP4:
            yield _mxfp4(rng, n // 32, std)
        else:
            x = _floats(rng, n, spec, std)
            if qtype == GGMLQuantizationType.F32:
                yield x.tobytes()
            elif qtype == GGMLQuantizationType.F16:
                yield x.astype(np.float16).tobytes()
            elif qtype == GGMLQuantizationType.BF16:
                yield _f32_to_bf16(x).tobytes()
            else:
                raise ValueError(f"cannot generate {qtype.name} directly")
