"""The model catalog: one TOML file per model in `presets/`, each validated on its own.

A bad preset never takes the catalog down: it becomes one line in `Catalog.errors` ("FILE: FIELD: what is
wrong") and every other preset still loads. The format is described in `presets/README.md`.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

from runmyai.engine.info import EngineInfo
from runmyai.library.quants import is_mmproj

# The engine flags a preset may set, by the key it writes them under (`lookahead`, `io-threads`, `policy`, …), with
# their CLI spelling, their defaults, kinds and choices, are the engine's, not kept here: `tokenwing info --json`
# says them (`preset_flags`, `flags`) and `bind` spells a preset's flags by them and checks them. A preset sets only
# what was measured to differ from the engine's default for its model, and lists it in `measured`; everything
# else is the engine's default. Booleans become `--X` / `--no-X`.
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
    mmproj: str | None = None  # a vision model's image encoder in that repository (downloaded with the quant)


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
    # one routed expert as stored in the repacked file: stated, or worked out from the engine's facts by `bind`
    # (0 until then)
    expert_bytes: int
    chat: ChatDefaults
    # engine arguments, e.g. ("--lookahead", "2", "--moe-stream-io-threads", "8", …), spelled by the engine
    # (`bind`); until then only the RAM share
    flags: tuple[str, ...]
    source: Literal["hub", "bundled"]
    notes: str
    measured_flags: tuple[str, ...] = ()  # the flags the preset sets, each measured to differ from the engine's
    bundled_source: str | None = None  # for source = "bundled": the source GGUF, relative to resources/
    expert_bytes_stated: bool = False  # True: the preset states expert_bytes; False: computed from the quant
    gguf: GgufSource | None = None
    flag_values: Mapping[str, int | bool | str] = field(default_factory=dict)  # [flags] without ram-budget
    ram_budget: tuple[str, ...] = ()  # ("--ram-budget", "25%"): a share of the experts, a product choice
    toml: str = ""  # the preset's file name, for error lines

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


@dataclass
class Catalog:
    """The presets and the error lines of those that could not be loaded. Bound once to the installed engine
    (`bind_engine`), in place, so that every part of the app holding the catalog sees the engine's sizes."""

    presets: tuple[Preset, ...]
    errors: tuple[str, ...]  # one line per preset that could not be loaded

    def get(self, preset_id: str) -> Preset | None:
        return next((p for p in self.presets if p.id == preset_id), None)

    def bind_engine(self, engine: EngineInfo) -> list[str]:
        """Each preset bound to the installed engine's facts (`bind`); one that cannot be becomes an error line
        instead, as a bad preset does. Returns the new error lines."""
        presets: list[Preset] = []
        new: list[str] = []
        for p in self.presets:
            try:
                presets.append(bind(p, engine))
            except PresetError as e:
                new.append(str(e))
        self.presets, self.errors = tuple(presets), (*self.errors, *new)
        return new


def expert_bytes_for(width: int, expert_ffn: int, quant: str, engine: EngineInfo) -> int | None:
    """Bytes of one repacked expert: three projections of width × expert_ffn weights at the quant's bits per
    weight, each starting on the model file's alignment, both as the installed engine says them (`quant_bits`,
    `expert_alignment`); None for a quant it does not size, or an engine that does not say."""
    bits, align = engine.quant_bits_of(quant), engine.expert_alignment
    if bits is None or not align:
        return None
    projection = math.ceil(width * expert_ffn * bits / 8)
    return 3 * (-(-projection // align) * align)


def flag_arguments(values: Mapping[str, int | bool | str], engine: EngineInfo) -> tuple[str, ...]:
    """Engine arguments for a preset's flag values, in their order, spelled as the engine says (`preset_flags`);
    a key it has no flag for is left out (`check_flags` says so)."""
    args: list[str] = []
    for key, value in values.items():
        name = engine.preset_flags.get(key)
        if name is None:
            continue
        if isinstance(value, bool):
            args.append(name if value else "--no-" + name[2:])
        else:
            args += [name, str(value)]
    return tuple(args)


def check_flags(preset: Preset, engine: EngineInfo) -> list[str]:
    """What is wrong with a preset's flags for the installed engine, one line each ("ID: flags.KEY: …"): a flag
    it does not have, a value of the wrong kind or not among its choices, or the engine's own default (a preset
    sets only what differs from it). Nothing to say when the engine could not say what its flags are."""
    if not engine.flags or not engine.preset_flags:
        return []
    problems: list[str] = []
    for key, value in preset.flag_values.items():
        name = engine.preset_flags.get(key)
        where = f"{preset.id}: flags.{key}"
        f = engine.flags.get(name) if name is not None else None
        if name is None or f is None:
            problems.append(f"{where}: the installed engine has no flag a preset sets as {key!r}")
        elif f.kind == "bool" and not isinstance(value, bool):
            problems.append(f"{where}: {name} is on or off: true or false")
        elif f.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{where}: {name} takes a whole number")
        elif f.kind == "choice" and value not in f.choices:
            problems.append(f"{where}: {name} is one of {', '.join(f.choices)} (got {value!r})")
        elif value == f.default:
            problems.append(f"{where}: {value!r} is the engine's default for {name}: leave it out")
    return problems


def bind(preset: Preset, engine: EngineInfo) -> Preset:
    """A preset with what only the installed engine can say worked out: its expert's bytes (from the quant's bits
    and the file's alignment, unless the preset states them) and its engine arguments. An engine that could not be
    asked leaves it as loaded (expert bytes 0 unless stated; no flags but its RAM share): its estimate then says
    the engine is unknown. PresetError where the engine does not size its quant, or its experts outgrow its file."""
    if not engine.known:
        return preset
    where = preset.toml or preset.id
    expert_bytes = preset.expert_bytes if preset.expert_bytes_stated else None
    if expert_bytes is None:
        f = preset.facts
        expert_bytes = expert_bytes_for(f.expert_width, f.expert_ffn, preset.quant, engine)
    if expert_bytes is None:
        known = ", ".join(n for n in engine.quant_bits if not n.startswith("UD-"))
        raise PresetError(
            f"{where}: quant: the installed engine does not size {preset.quant!r} (it sizes {known or 'none'}, "
            "and unsloth's UD- names of them); or state arch.expert_bytes"
        )
    f = preset.facts
    if f.moe_layers * f.experts * expert_bytes > preset.size_bytes * 1.02:
        raise PresetError(
            f"{where}: size_bytes: {preset.size_bytes:,} is smaller than the experts alone ({f.moe_layers} MoE "
            f"layers × {f.experts} experts × {expert_bytes:,} bytes)"
        )
    flags = preset.ram_budget + flag_arguments(preset.flag_values, engine)
    return replace(preset, expert_bytes=expert_bytes, flags=flags)


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
        if not _QUANT_NAME.fullmatch(quant):
            raise self.fail("quant", f"{quant!r} is not a quant name")
        # (its bits per weight, and so the expert's bytes, are the engine's word: `bind`)
        expert_bytes = stated_expert_bytes or 0
        chat = self.chat(self.table(data, "chat", required=False))
        budget, measured, values = self.flags(self.table(data, "flags", required=False))
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
            flags=budget,
            source=cast(Literal["hub", "bundled"], source),
            notes=notes,
            measured_flags=measured,
            bundled_source=bundled_source,
            expert_bytes_stated=stated_expert_bytes is not None,
            gguf=gguf,
            flag_values=values,
            ram_budget=budget,
            toml=self.filename,
        )

    def gguf(self, t: Mapping[str, Any]) -> GgufSource | None:
        p = "gguf."
        if not t:
            return None
        self.check_keys(t, {"repo", "quants", "default", "mmproj"}, p)
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
        mmproj = self.string(t, "mmproj", p) if "mmproj" in t else None
        if mmproj is not None and not is_mmproj(mmproj):
            raise self.fail(p + "mmproj", f"expected an mmproj GGUF's file name (got {mmproj!r})")
        return GgufSource(repo, tuple(quants), default, mmproj)

    def facts(self, t: Mapping[str, Any]) -> tuple[ArchFacts, int | None]:
        p = "arch."
        keys = {"arch", "total_params", "active_params", "layers", "dense_layers", "experts", "shared_experts"}
        keys |= {"top_k", "hidden", "expert_ffn", "context", "expert_bytes", "expert_hidden"}
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
                raise self.fail(p + key, "not a flag key (words joined by '-', as `tokenwing info` lists them)")
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
        return budget, tuple(measured), values


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
