"""What a quant's name says of a routed expert's size: its average bits per weight (gate, up and down), for the
names GGUF files are published under (llama.cpp's file types, MXFP4_MOE, unsloth's "UD-" dynamic quants).

The bits come from ggml's block sizes (gguf's GGML_QUANT_SIZES), not from numbers kept here; what is kept here is
which tensor types each named mix gives an expert's projections. `tokenwing info --json` publishes the result
(`quant_bits`), so the app sizes a model it has not downloaded by the engine's word (docs/api.md).
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# name → (the type of gate and up, the types ffn_down takes: averaged, as llama.cpp's _M mixes put ffn_down one
# type up in about half the layers, its `use_more_bits`). The i-quants are their types: llama.cpp's files of these
# names may put ffn_down a type up in some layers, which this leaves out.
_MIXES: dict[str, tuple[str, tuple[str, ...]]] = {
    "F32": ("F32", ("F32",)),
    "F16": ("F16", ("F16",)),
    "BF16": ("BF16", ("BF16",)),
    "Q8_0": ("Q8_0", ("Q8_0",)),
    "Q6_K": ("Q6_K", ("Q6_K",)),
    "Q5_K_M": ("Q5_K", ("Q6_K", "Q5_K")),
    "Q4_K_M": ("Q4_K", ("Q6_K", "Q4_K")),
    "Q4_K_S": ("Q4_K", ("Q4_K",)),
    "Q4_0": ("Q4_0", ("Q4_0",)),
    "MXFP4": ("MXFP4", ("MXFP4",)),
    "MXFP4_MOE": ("MXFP4", ("MXFP4",)),  # (llama.cpp's name for a file whose routed experts are MXFP4)
    "Q3_K_M": ("Q3_K", ("Q4_K",)),
    "Q2_K": ("Q2_K", ("Q3_K",)),
    "IQ4_NL": ("IQ4_NL", ("IQ4_NL",)),
    "IQ4_XS": ("IQ4_XS", ("IQ4_XS",)),
    "IQ3_S": ("IQ3_S", ("IQ3_S",)),
    "IQ3_XXS": ("IQ3_XXS", ("IQ3_XXS",)),
    "IQ2_S": ("IQ2_S", ("IQ2_S",)),
    "IQ2_XS": ("IQ2_XS", ("IQ2_XS",)),
    "IQ2_XXS": ("IQ2_XXS", ("IQ2_XXS",)),
    "IQ1_M": ("IQ1_M", ("IQ1_M",)),
    "IQ1_S": ("IQ1_S", ("IQ1_S",)),
}

# unsloth's dynamic quants ("UD-" + a name): per-model mixes that keep chosen tensors wider than the name's type
# ("_XL": some wider still). Their experts count as the class the name gives (UD-IQ1_M: IQ1_M; UD-Q4_K_XL: Q4_K_M;
# UD-Q8_K_XL: Q8_0, there being no Q8_K file type) until the real file's header says better; where a mix keeps the
# checkpoint's own expert type a preset states its expert bytes (DeepSeek V4's FP4 experts stay MXFP4 in its
# UD-Q8_K_XL and UD-Q4_K_XL, presets/deepseek-v4-flash.toml).
UD_PREFIX = "UD-"
_XL_CLASS = {
    "Q2_K_XL": "Q2_K",
    "Q3_K_XL": "Q3_K_M",
    "Q4_K_XL": "Q4_K_M",
    "Q5_K_XL": "Q5_K_M",
    "Q6_K_XL": "Q6_K",
    "Q8_K_XL": "Q8_0",
}


def type_bits(type_name: str) -> float:
    """Bits per weight of one ggml tensor type, from its block: bytes per block × 8 / weights per block."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return size * 8 / block


def expert_bits(name: str) -> float:
    """Average bits per weight of a routed expert (gate, up, down) in a file of the mix `name` (a key of _MIXES)."""
    up, down = _MIXES[name]
    return (2 * type_bits(up) + sum(type_bits(t) for t in down) / len(down)) / 3


def quant_class(quant: str) -> str | None:
    """The mix a quant name counts as: itself, or an unsloth "UD-" name's class; None if unknown."""
    name = quant.strip().upper()
    if name in _MIXES:
        return name
    if name.startswith(UD_PREFIX):
        base = name.removeprefix(UD_PREFIX)
        return base if base in _MIXES else _XL_CLASS.get(base)
    return None


def quant_bits() -> dict[str, float]:
    """Every quant name the engine can size an expert by, upper-case, with its experts' bits per weight: the
    mixes, and the "UD-" names of each mix and of each _XL class."""
    names = [*_MIXES, *(UD_PREFIX + n for n in _MIXES), *(UD_PREFIX + n for n in _XL_CLASS)]
    out: dict[str, float] = {}
    for name in names:
        known = quant_class(name)
        assert known is not None  # (every name listed has a class)
        out[name] = expert_bits(known)
    return out
