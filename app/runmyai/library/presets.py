"""The model catalog: one TOML file per model in `presets/`, each validated on its own.

A bad preset never takes the catalog down: it becomes one line in `Catalog.errors` ("FILE: FIELD: what is
wrong") and every other preset still loads. The format is described in `presets/README.md`.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from runmyai.engine.info import EngineInfo

# Average bits per weight of one routed expert (gate, up and down) at each quant type. Exact for the uniform
# types; for llama.cpp's _M mixes, gate/up use the base K-quant and ffn_down uses the next type up in about
# half the layers (llama.cpp's `use_more_bits`), so down is averaged over the two.
QUANT_BITS: dict[str, float] = {
    "F32": 32.0,
    "F16": 16.0,
    "BF16": 16.0,
    "Q8_0": 8.5,
    "Q6_K": 6.5625,
    "Q5_K_M": (5.5 + 5.5 + (6.5625 + 5.5) / 2) / 3,
    "Q4_K_M": (4.5 + 4.5 + (6.5625 + 4.5) / 2) / 3,
    "Q4_K_S": 4.5,
    "Q4_0": 4.5,
    "MXFP4": 4.25,
    "MXFP4_MOE": 4.25,  # (llama.cpp's name for a file whose routed experts are MXFP4: the experts' type here)
    "Q3_K_M": (3.4375 + 3.4375 + 4.5) / 3,
    "Q2_K": (2.625 + 2.625 + 3.4375) / 3,
    # the i-quants, as their types (ggml's block sizes); llama.cpp's files of these names may put ffn_down a type up
    # in some layers, which this leaves out
    "IQ4_NL": 4.5,
    "IQ4_XS": 4.25,
    "IQ3_S": 3.4375,
    "IQ3_XXS": 3.0625,
    "IQ2_S": 2.5625,
    "IQ2_XS": 2.3125,
    "IQ2_XXS": 2.0625,
    "IQ1_M": 1.75,
    "IQ1_S": 1.5625,
}

# unsloth's dynamic quants ("UD-" + a name): per-model mixes that keep chosen tensors wider than the name's type
# ("_XL": some wider still). Their experts' bits are taken as the class the name gives (UD-IQ1_M: IQ1_M; UD-Q4_K_XL:
# Q4_K_M; UD-Q8_K_XL: Q8_0, there being no Q8_K file type) until the real file's `expert_bytes` are stated: where
# a mix keeps the checkpoint's own expert type the preset states them (DeepSeek V4's FP4 experts stay MXFP4 in its
# UD-Q8_K_XL and UD-Q4_K_XL: inferred from their sizes, presets/deepseek-v4-flash.toml).
_XL_CLASS = {
    "Q2_K_XL": "Q2_K",
    "Q3_K_XL": "Q3_K_M",
    "Q4_K_XL": "Q4_K_M",
    "Q5_K_XL": "Q5_K_M",
    "Q6_K_XL": "Q6_K",
    "Q8_K_XL": "Q8_0",
}


def quant_class(quant: str) -> str | None:
    """The key of QUANT_BITS a quant name counts as: itself, or an unsloth "UD-" name's class; None if unknown."""
    name = quant.strip().upper()
    if name in QUANT_BITS:
        return name
    if name.startswith("UD-"):
        base = name.removeprefix("UD-")
        return base if base in QUANT_BITS else _XL_CLASS.get(base)
    return None


ALIGN = 4096  # every projection of a repacked expert starts on a 4 KiB boundary (docs/model-format.md)

# The engine flags a preset may set: `lookahead` (`--lookahead`) and the `--moe-stream-*` flags without their
# prefix (`io-threads`, `policy`, …). Their defaults, kinds and choices are the engine's, not kept here: `tokenwing
# info --json` says them and `check_flags` checks a preset against them. A preset sets only what was measured to
# differ from the engine's default for its model, and lists it in `measured`; everything else is the engine's
# default. Booleans become `--moe-stream-X` / `--no-moe-stream-X`.
_PLAIN_FLAGS = ("lookahead",)
_FLAG_KEY = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")
# `ram-budget`: a share of the experts ("25%") for a preset that should stream even where it fits in RAM (the
# built-in model, so that the first screen shows streaming at work); sizes are per machine, so none here. A
# product choice, not a measurement: it needs no `measured` entry.
_SHARE = re.compile(r"(100|[1-9]?[0-9])(\.[0-9]+)?%")

_SHA256 = re.compile(r"[0-9a-f]{64}")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_ID = re.compile(r"[a-z0-9][a-z0-9._-]*")
_ARCH = re.compile(r"[a-z0-9][a-z0-9._-]*")  # a GGUF architecture id; whether the engine runs it, it says itself
_QUANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class ArchFacts:
    arch: str
    total_params: float
    active_params: float
    layers: int
    dense_layers: int  # leading layers with a dense FFN instead of experts
    experts: int  # routed experts per MoE layer
    shared_experts: int
    top_k: int
    hidden: int
    expert_ffn: int  # width of one routed expert's FFN
    context: int
    # The F16 KV cache one token of context takes over all layers (0: not stated), as the engine's rule for the
    # family gives it (`tokenwing info --json MODEL` / `inspect --json`): stated, never computed here.
    kv_bytes_per_token: int = 0
    expert_hidden: int = 0  # the routed experts' width where it is not `hidden` (Kimi K3's latent experts)
    # weights the engine reads a few rows of from the drive instead of loading (Qwen3.8 Flash Next's n-gram table):
    # in total_params and the file, neither always loaded nor experts
    sparse_params: float = 0.0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def expert_width(self) -> int:
        return self.expert_hidden or self.hidden

    @property
    def expert_params(self) -> int:
        """Weights of one routed expert: gate, up and down."""
        return 3 * self.expert_width * self.expert_ffn


@dataclass(frozen=True)
class ChatDefaults:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    system_prompt: str = ""


@dataclass(frozen=True)
class GgufSource:
    """Where the GGUF this model is repacked from is published, and its quants (downloaded by the app itself
    until a repacked file is published)."""

    repo: str
    quants: tuple[str, ...]
    default: str  # the quant the repacked file is made from, and the one a download picks first


@dataclass(frozen=True)
class Preset:
    id: str
    name: str
    repo: str | None  # hub repository of the repacked file (None for the bundled demo)
    file: str  # the repacked file's name (`*.tw.gguf`), on the hub and in the models folder
    size_bytes: int
    sha256: str | None  # None until published
    quant: str
    facts: ArchFacts
    expert_bytes: int  # one routed expert as stored in the repacked file (4 KiB-aligned projections)
    chat: ChatDefaults
    flags: tuple[str, ...]  # engine arguments, e.g. ("--lookahead", "2", "--moe-stream-io-threads", "8", …)
    source: Literal["hub", "bundled"]
    notes: str
    measured_flags: tuple[str, ...] = ()  # the flags the preset sets, each measured to differ from the engine's
    bundled_source: str | None = None  # for source = "bundled": the source GGUF, relative to resources/
    expert_bytes_stated: bool = False  # True: the preset states expert_bytes; False: computed from the quant
    gguf: GgufSource | None = None
    flag_values: Mapping[str, int | bool | str] = field(default_factory=dict)  # [flags] without ram-budget

    @property
    def published(self) -> bool:
        """The repacked file is on the hub (its checksum is stated); until then a download uses `gguf`."""
        return self.repo is not None and self.sha256 is not None

    @property
    def expert_total_bytes(self) -> int:
        """All routed experts of all MoE layers: what is streamed from the drive."""
        return self.facts.moe_layers * self.facts.experts * self.expert_bytes

    @property
    def resident_bytes(self) -> int:
        """Everything else in the file (attention, shared experts, dense layers, embeddings): always loaded."""
        return max(0, self.size_bytes - self.expert_total_bytes)


@dataclass(frozen=True)
class Catalog:
    presets: tuple[Preset, ...]
    errors: tuple[str, ...]  # one line per preset that could not be loaded

    def get(self, preset_id: str) -> Preset | None:
        return next((p for p in self.presets if p.id == preset_id), None)


def expert_bytes_for(hidden: int, expert_ffn: int, quant: str) -> int:
    """Bytes of one repacked expert: three projections of hidden × expert_ffn weights, each 4 KiB-aligned."""
    known = quant_class(quant)
    if known is None:
        raise KeyError(quant)
    projection = math.ceil(hidden * expert_ffn * QUANT_BITS[known] / 8)
    return 3 * (-(-projection // ALIGN) * ALIGN)


def flag_name(key: str) -> str:
    """A preset's flag key as the engine's flag: `lookahead` → `--lookahead`, `io-threads` →
    `--moe-stream-io-threads`."""
    return f"--{key}" if key in _PLAIN_FLAGS else f"--moe-stream-{key}"


def flag_arguments(values: Mapping[str, int | bool | str]) -> tuple[str, ...]:
    """Engine arguments for a preset's flag values, in their order."""
    args: list[str] = []
    for key, value in values.items():
        name = flag_name(key)
        if isinstance(value, bool):
            args.append(name if value else "--no-" + name[2:])
        else:
            args += [name, str(value)]
    return tuple(args)


def check_flags(preset: Preset, engine: EngineInfo) -> list[str]:
    """What is wrong with a preset's flags for the installed engine, one line each ("ID: flags.KEY: …"): a flag
    it does not have, a value of the wrong kind or not among its choices, or the engine's own default (a preset
    sets only what differs from it). Nothing to say when the engine could not say what its flags are."""
    if not engine.flags:
        return []
    problems: list[str] = []
    for key, value in preset.flag_values.items():
        name = flag_name(key)
        where = f"{preset.id}: flags.{key}"
        f = engine.flags.get(name)
        if f is None:
            problems.append(f"{where}: the installed engine has no {name}")
        elif f.kind == "bool" and not isinstance(value, bool):
            problems.append(f"{where}: {name} is on or off: true or false")
        elif f.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{where}: {name} takes a whole number")
        elif f.kind == "choice" and value not in f.choices:
            problems.append(f"{where}: {name} is one of {', '.join(f.choices)} (got {value!r})")
        elif value == f.default:
            problems.append(f"{where}: {value!r} is the engine's default for {name}: leave it out")
    return problems


def load_catalog(directory: Path) -> Catalog:
    """Every `*.toml` in `directory`: the presets that are valid, and one error line per one that is not."""
    presets: list[Preset] = []
    errors: list[str] = []
    if not directory.is_dir():
        return Catalog((), (f"{directory}: the presets folder does not exist",))
    try:
        files = sorted(directory.glob("*.toml"))
    except OSError as e:
        return Catalog((), (f"{directory}: cannot list the presets folder: {e.strerror or e}",))
    seen: dict[str, str] = {}
    for path in files:
        try:
            preset = load_preset(path)
        except PresetError as e:
            errors.append(str(e))
            continue
        if preset.id in seen:
            errors.append(f"{path.name}: id: {preset.id!r} is already used by {seen[preset.id]}")
            continue
        seen[preset.id] = path.name
        presets.append(preset)
    presets.sort(key=lambda p: (p.source != "bundled", p.size_bytes, p.id))
    return Catalog(tuple(presets), tuple(errors))


class PresetError(ValueError):
    """One line: the file, the field and what is wrong with it."""


def load_preset(path: Path) -> Preset:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise PresetError(f"{path.name}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise PresetError(f"{path.name}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"{path.name}: not valid TOML: {e}") from None
    return _Parser(path.name).preset(data, default_id=path.stem)


class _Parser:
    def __init__(self, filename: str) -> None:
        self.filename = filename

    def fail(self, field: str, message: str) -> PresetError:
        return PresetError(f"{self.filename}: {field}: {message}")

    # ------------------------------------------------------------------------------------------ fields
    def table(self, data: Mapping[str, Any], key: str, required: bool = True) -> Mapping[str, Any]:
        value = data.get(key)
        if value is None:
            if required:
                raise self.fail(f"[{key}]", "missing table")
            return {}
        if not isinstance(value, dict):
            raise self.fail(f"[{key}]", f"expected a table, got {_kind(value)}")
        return cast(Mapping[str, Any], value)

    def check_keys(self, data: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
        for key in data:
            if key not in allowed:
                raise self.fail(prefix + key, f"unknown field (expected one of: {', '.join(sorted(allowed))})")

    def get(self, data: Mapping[str, Any], key: str, prefix: str, default: Any = ...) -> Any:
        if key not in data:
            if default is ...:
                raise self.fail(prefix + key, "missing")
            return default
        return data[key]

    def string(self, data: Mapping[str, Any], key: str, prefix: str = "", default: Any = ...) -> str:
        value = self.get(data, key, prefix, default)
        if not isinstance(value, str):
            raise self.fail(prefix + key, f"expected a string, got {_kind(value)}")
        return value

    def integer(self, data: Mapping[str, Any], key: str, prefix: str = "", minimum: int = 0, default: Any = ...) -> int:
        value = self.get(data, key, prefix, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(prefix + key, f"expected a whole number, got {_kind(value)}")
        if value < minimum:
            raise self.fail(prefix + key, f"must be at least {minimum} (got {value})")
        return value

    def number(
        self,
        data: Mapping[str, Any],
        key: str,
        prefix: str = "",
        low: float = 0.0,
        high: float = math.inf,
        default: Any = ...,
    ) -> float:
        value = self.get(data, key, prefix, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(prefix + key, f"expected a number, got {_kind(value)}")
        if not (low <= value <= high) or math.isnan(value):
            bounds = f"at least {low:g}" if high == math.inf else f"between {low:g} and {high:g}"
            raise self.fail(prefix + key, f"must be {bounds} (got {value:g})")
        return float(value)

    # ------------------------------------------------------------------------------------------ preset
    def preset(self, data: Mapping[str, Any], default_id: str) -> Preset:
        top = {"id", "name", "source", "repo", "file", "bundled_source", "size_bytes", "sha256", "quant"}
        top |= {"notes", "arch", "chat", "flags", "gguf"}
        self.check_keys(data, top, "")
        preset_id = self.string(data, "id", default=default_id)
        if not _ID.fullmatch(preset_id):
            raise self.fail("id", f"use lower-case letters, digits, '.', '_' and '-' (got {preset_id!r})")
        name = self.string(data, "name").strip()
        if not name:
            raise self.fail("name", "must not be empty")
        source = self.string(data, "source", default="hub")
        if source not in ("hub", "bundled"):
            raise self.fail("source", f"must be 'hub' or 'bundled' (got {source!r})")
        repo: str | None = None
        bundled_source: str | None = None
        if source == "hub":
            repo = self.string(data, "repo")
            if not _REPO.fullmatch(repo):
                raise self.fail("repo", f"expected 'owner/name' (got {repo!r})")
        else:
            if "repo" in data:
                raise self.fail("repo", "a bundled preset has no hub repository")
            bundled_source = self.string(data, "bundled_source")
            if bundled_source.startswith("/") or ".." in Path(bundled_source).parts or not bundled_source:
                raise self.fail("bundled_source", f"expected a path inside resources/ (got {bundled_source!r})")
        file = self.string(data, "file")
        if not file.endswith(".tw.gguf") or "/" in file or "\\" in file or file.startswith("."):
            raise self.fail("file", f"expected a file name ending in .tw.gguf (got {file!r})")
        size_bytes = self.integer(data, "size_bytes", minimum=1)
        sha = self.string(data, "sha256", default="").strip().lower()
        if sha and not _SHA256.fullmatch(sha):
            raise self.fail("sha256", 'expected 64 hexadecimal digits, or "" until published')
        quant = self.string(data, "quant")
        notes = self.string(data, "notes", default="")

        facts, stated_expert_bytes = self.facts(self.table(data, "arch"))
        gguf = self.gguf(self.table(data, "gguf", required=False))
        if stated_expert_bytes is not None:
            expert_bytes = stated_expert_bytes
        elif quant_class(quant) is not None:
            expert_bytes = expert_bytes_for(facts.expert_width, facts.expert_ffn, quant)
        else:
            raise self.fail(
                "quant",
                f"unknown type {quant!r} (known: {', '.join(QUANT_BITS)}, and unsloth's UD- names of them);"
                " or state arch.expert_bytes",
            )
        if facts.moe_layers * facts.experts * expert_bytes > size_bytes * 1.02:
            raise self.fail(
                "size_bytes",
                f"{size_bytes:,} is smaller than the experts alone ({facts.moe_layers} MoE layers × "
                f"{facts.experts} experts × {expert_bytes:,} bytes)",
            )
        chat = self.chat(self.table(data, "chat", required=False))
        flags, measured, values = self.flags(self.table(data, "flags", required=False))
        return Preset(
            id=preset_id,
            name=name,
            repo=repo,
            file=file,
            size_bytes=size_bytes,
            sha256=sha or None,
            quant=quant,
            facts=facts,
            expert_bytes=expert_bytes,
            chat=chat,
            flags=flags,
            source=cast(Literal["hub", "bundled"], source),
            notes=notes,
            measured_flags=measured,
            bundled_source=bundled_source,
            expert_bytes_stated=stated_expert_bytes is not None,
            gguf=gguf,
            flag_values=values,
        )

    def gguf(self, t: Mapping[str, Any]) -> GgufSource | None:
        p = "gguf."
        if not t:
            return None
        self.check_keys(t, {"repo", "quants", "default"}, p)
        repo = self.string(t, "repo", p)
        if not _REPO.fullmatch(repo):
            raise self.fail(p + "repo", f"expected 'owner/name' (got {repo!r})")
        quants = t.get("quants")
        if not isinstance(quants, list) or not quants or not all(isinstance(q, str) for q in quants):
            raise self.fail(p + "quants", "expected a list of quant names")
        for q in quants:
            if not _QUANT_NAME.fullmatch(q):
                raise self.fail(p + "quants", f"{q!r} is not a quant name")
        default = self.string(t, "default", p, default=quants[0])
        if default not in quants:
            raise self.fail(p + "default", f"{default!r} is not one of gguf.quants")
        return GgufSource(repo, tuple(quants), default)

    def facts(self, t: Mapping[str, Any]) -> tuple[ArchFacts, int | None]:
        p = "arch."
        keys = {"arch", "total_params", "active_params", "layers", "dense_layers", "experts", "shared_experts"}
        keys |= {"top_k", "hidden", "expert_ffn", "context", "expert_bytes", "kv_bytes_per_token", "expert_hidden"}
        keys |= {"sparse_params"}
        self.check_keys(t, keys, p)
        arch = self.string(t, "arch", p)
        if not _ARCH.fullmatch(arch):
            raise self.fail(p + "arch", f"{arch!r} is not a GGUF architecture id")
        total = self.number(t, "total_params", p, low=1)
        active = self.number(t, "active_params", p, low=1)
        if active > total:
            raise self.fail(p + "active_params", f"more than total_params ({active:g} > {total:g})")
        layers = self.integer(t, "layers", p, minimum=1)
        dense = self.integer(t, "dense_layers", p, minimum=0, default=0)
        if dense >= layers:
            raise self.fail(p + "dense_layers", f"must be fewer than arch.layers ({dense} >= {layers})")
        experts = self.integer(t, "experts", p, minimum=1)
        shared = self.integer(t, "shared_experts", p, minimum=0, default=0)
        top_k = self.integer(t, "top_k", p, minimum=1)
        if top_k > experts:
            raise self.fail(p + "top_k", f"more than arch.experts ({top_k} > {experts})")
        hidden = self.integer(t, "hidden", p, minimum=1)
        ffn = self.integer(t, "expert_ffn", p, minimum=1)
        context = self.integer(t, "context", p, minimum=1)
        stated = self.integer(t, "expert_bytes", p, minimum=1) if "expert_bytes" in t else None
        kv = self.integer(t, "kv_bytes_per_token", p, minimum=1) if "kv_bytes_per_token" in t else 0
        latent = self.integer(t, "expert_hidden", p, minimum=1) if "expert_hidden" in t else 0
        sparse = self.number(t, "sparse_params", p, low=1) if "sparse_params" in t else 0.0
        facts = ArchFacts(
            arch,
            total,
            active,
            layers,
            dense,
            experts,
            shared,
            top_k,
            hidden,
            ffn,
            context,
            kv,
            latent,
            sparse,
        )
        # Cross-checks of the published numbers against the shape (1 % for the rounding of "30.5B").
        if sparse and facts.moe_layers * experts * facts.expert_params + sparse > total * 1.01:
            raise self.fail(p + "sparse_params", f"{sparse:g} and the routed experts are more than total_params")
        if facts.moe_layers * experts * facts.expert_params > total * 1.01:
            raise self.fail(
                p + "total_params",
                f"{total:g} is less than the routed experts alone ({facts.moe_layers} × {experts} × "
                f"3 × {facts.expert_width} × {ffn})",
            )
        if facts.moe_layers * top_k * facts.expert_params > active * 1.01:
            raise self.fail(
                p + "active_params",
                f"{active:g} is less than the routed experts a token uses ({facts.moe_layers} × {top_k} × "
                f"3 × {facts.expert_width} × {ffn})",
            )
        if stated is not None and stated < facts.expert_params / 8:
            raise self.fail(p + "expert_bytes", f"{stated:,} is under 1 bit per weight of one expert")
        return facts, stated

    def chat(self, t: Mapping[str, Any]) -> ChatDefaults:
        p = "chat."
        self.check_keys(t, {"temperature", "top_p", "top_k", "min_p", "system_prompt"}, p)
        d = ChatDefaults()
        return ChatDefaults(
            temperature=self.number(t, "temperature", p, 0.0, 2.0, default=d.temperature),
            top_p=self.number(t, "top_p", p, 0.0, 1.0, default=d.top_p),
            top_k=self.integer(t, "top_k", p, minimum=0, default=d.top_k),
            min_p=self.number(t, "min_p", p, 0.0, 1.0, default=d.min_p),
            system_prompt=self.string(t, "system_prompt", p, default=d.system_prompt),
        )

    def flags(self, t: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, int | bool | str]]:
        p = "flags."
        values: dict[str, int | bool | str] = {}
        budget: tuple[str, ...] = ()
        if "ram-budget" in t:
            share = self.string(t, "ram-budget", p)
            if not _SHARE.fullmatch(share) or float(share[:-1]) <= 0:
                raise self.fail(p + "ram-budget", f'expected a share of the experts such as "25%" (got {share!r})')
            budget = ("--ram-budget", share)
        measured = t.get("measured", [])
        if not isinstance(measured, list) or not all(isinstance(m, str) for m in measured):
            raise self.fail(p + "measured", "expected a list of flag names")
        for key, value in t.items():
            if key in ("ram-budget", "measured"):
                continue
            if not _FLAG_KEY.fullmatch(key):
                raise self.fail(p + key, "not a flag name (lookahead, or a --moe-stream-* flag without its prefix)")
            if isinstance(value, float) or not isinstance(value, bool | int | str):
                raise self.fail(p + key, f"expected true/false, a whole number or a string, got {_kind(value)}")
            if key not in measured:
                raise self.fail(
                    p + key,
                    "a preset sets only what was measured to differ from the engine's default for this model: "
                    "list it in flags.measured, or leave it out (the engine's default applies)",
                )
            values[key] = value
        for m in measured:
            if m not in values:
                raise self.fail(p + "measured", f"{m!r} is not a flag set in this preset")
        return budget + flag_arguments(values), tuple(measured), values


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__
