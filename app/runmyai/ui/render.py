"""What the library panel shows for each model: its row, its details (HTML) and its choices. Qt-free and pure, so
the controller only wires, and these are tested without a window."""

from __future__ import annotations

import html
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from runmyai.engine.info import EngineInfo
from runmyai.library.acquire import QuantChoice, RepoQuants
from runmyai.library.estimate import Estimate, installed_estimate, launch_estimate, speed_words
from runmyai.library.hub import HubModel
from runmyai.library.keys import HubKey, LocalKey, PresetKey
from runmyai.library.local import LocalModel, repacked_name
from runmyai.library.mmproj import mmproj_beside
from runmyai.library.presets import Preset
from runmyai.machine import MachineInfo
from runmyai.ui.viewmodels import badge
from runmyai.units import human_bytes

VERDICT_WORDS = {
    "runs_well": "Runs well here",
    "runs_slowly": "Runs slowly here",
    "no_disk_space": "Not enough disk space",
    "unsupported": "Not supported by this engine",
}


@dataclass(frozen=True)
class LibraryEntry:
    """One row of the library as the controller describes it (the widget knows nothing of presets)."""

    key: str  # a LibraryKey as text (runmyai.library.keys)
    title: str
    badge: str  # "installed", "on the hub", "not supported yet", …
    details_html: str
    can_download: bool = False
    can_use: bool = False
    choices: tuple[tuple[str, str], ...] = ()  # (key, label): the quants a download may pick
    choice: str | None = None  # the preselected one
    colour: str = "grey"  # the "will it run here?" badge (viewmodels.badge): green, yellow, red, grey
    line: str = ""  # the estimate in one line, beside the badge
    card_repo: str | None = None  # the hub repository whose README is the model card
    basis: str = ""  # where the line's numbers come from (its last part): "measured: 3 chats"


@dataclass(frozen=True)
class View:
    """What every entry is rendered against. `flags`: the engine flags an installed model is started with
    (`library.launch.launch_flags`; default: its preset's), which its estimate is worked out for."""

    machine: MachineInfo | None
    engine: EngineInfo
    flags: Callable[[LocalModel, Preset | None], Sequence[str]] | None = None

    def flags_of(self, m: LocalModel, preset: Preset | None) -> Sequence[str]:
        if self.flags is not None:
            return self.flags(m, preset)
        return preset.flags if preset is not None else ()


def local_entry(m: LocalModel, preset: Preset | None, view: View) -> LibraryEntry:
    # (no heading: the page's headline above the overview already names the entry)
    lines = [f"<p>{html.escape(str(m.path))}<br>{human_bytes(m.size_bytes)}"]
    lines.append(f", architecture {html.escape(m.arch or '?')}</p>")
    runs = m.arch is not None and view.engine.runs(m.arch)
    if m.error:
        lines.append(f"<p style='color:#b52b27'>{html.escape(m.error)}</p>")
    elif not runs:
        lines.append(f"<p><b>{_unsupported(m.arch or '?', view.engine)}</b></p>")
    encoder = mmproj_beside(m.path)
    if encoder is not None and runs and m.error is None:  # (issue 45: the chat offers pictures by the engine's word)
        reads = m.arch in view.engine.image_architectures
        lines.append(
            f"<p>Pictures: {'yes' if reads else 'not with this engine'} — its image encoder "
            f"{html.escape(encoder.name)} is beside it.</p>"
        )
    if preset is not None:
        lines.append(preset_html(preset, view))
    est = None
    if view.machine is not None and m.error is None:  # every installed model, with or without a preset
        est = installed_estimate(m, preset, view.machine, view.engine, view.flags_of(m, preset))
        lines.append(estimate_html(est) if est is not None else "<p>No estimate: the engine's facts are not known.</p>")
    kind = "built-in" if m.bundled else ("cannot be used" if m.error or not runs else "installed")
    b = badge(est, supported=runs, error=m.error)
    repo = card_repo(preset) if preset is not None else None
    return LibraryEntry(
        str(LocalKey(m.path)),
        m.name,
        kind,
        "".join(lines),
        can_use=m.error is None and runs,
        colour=b.colour,
        line=b.line,
        card_repo=repo,
        basis=b.basis,
    )


def preset_entry(p: Preset, view: View) -> LibraryEntry:
    runs = view.engine.runs(p.facts.arch)
    downloadable = runs and (p.published or p.gguf is not None)
    if not runs:
        kind = "not supported yet"
    elif p.repo or p.gguf:
        kind = "on the hub"
    else:
        kind = "built-in (not prepared)"
    choices: tuple[tuple[str, str], ...] = ()
    choice = None
    if p.gguf is not None and not p.published:
        choices = tuple((str(HubKey(p.gguf.repo, q)), f"{q} (from {p.gguf.repo})") for q in p.gguf.quants)
        choice = str(HubKey(p.gguf.repo, p.gguf.default))
    text = preset_html(p, view)
    est = None
    if view.machine is not None:
        est = launch_estimate(p, view.machine, view.engine, p.flags)
        text += estimate_html(est)
    b = badge(est, supported=runs)
    return LibraryEntry(
        str(PresetKey(p.id)),
        p.name,
        kind,
        text,
        downloadable,
        False,
        choices,
        choice,
        b.colour,
        b.line,
        card_repo(p),
        b.basis,
    )


def card_repo(p: Preset) -> str | None:
    """The hub repository whose README is a preset's model card, and whose card shows a download's progress: the
    GGUF it is made from where it has one, else its published repository."""
    return p.gguf.repo if p.gguf is not None else p.repo


def preset_html(p: Preset, view: View) -> str:
    """A preset's facts (its estimate is the caller's: installed or not, it is worked out differently)."""
    f = p.facts
    facts = (
        f"<p>{html.escape(f.arch)} · {count(f.total_params)} parameters, {count(f.active_params)} "
        f"active · {f.layers} layers · {f.experts} experts, top-{f.top_k}"
        f"{f', {f.shared_experts} shared' if f.shared_experts else ''} · expert {human_bytes(p.expert_bytes)}"
        f" ({p.quant}) · file {human_bytes(p.size_bytes)}</p>"
    )
    if p.gguf is not None:
        facts += (
            f"<p>Source: {html.escape(p.gguf.repo)} ({', '.join(html.escape(q) for q in p.gguf.quants)})"
            + ("" if p.published else "; the app repacks it while it downloads")
            + "</p>"
        )
    if not view.engine.runs(f.arch):
        facts += f"<p><b>{_unsupported(f.arch, view.engine)}</b></p>"
    if p.notes:
        facts += f"<p><small>{html.escape(p.notes)}</small></p>"
    return facts


def estimate_html(est: Estimate) -> str:
    reasons = "".join(f"<li>{html.escape(r)}</li>" for r in est.reasons)
    return (
        f"<h4>Will it run here? {VERDICT_WORDS[est.verdict]}: {speed_words(est.tokens_per_s)} "
        f"({html.escape(est.speed.removeprefix('~'))}; {html.escape(est.basis)})</h4><ul>{reasons}</ul>"
    )


def installed_quants(q: RepoQuants | None, models_dir: Path, have: Collection[Path]) -> frozenset[str]:
    """The repository's quants already in the library: where a download of each puts its repacked file
    (`<models>/<owner>/<repo>/<first file's name>.tw.gguf`, as `Acquirer` names it) is among `have`."""
    if q is None:
        return frozenset()
    return frozenset(
        c.quant.name
        for c in q.choices
        if models_dir.joinpath(*q.repo.split("/"), repacked_name(Path(c.quant.first.path))) in have
    )


def hub_entry(h: HubModel, quants: RepoQuants | None, installed: frozenset[str] = frozenset()) -> LibraryEntry:
    """A hub search result: a repacked repository, or a GGUF repository with its quants once they are known.
    `installed`: its quants already here, said on the card and in the quant picker (the walk-through's card said
    'on the hub' and offered the same download again beside the model it had just installed)."""
    key = str(HubKey(h.repo))
    head = f"<p>{h.downloads} downloads · {h.likes} likes · {html.escape(', '.join(h.tags[:8]))}</p>"
    blocked = quants.cannot_run() if quants is not None else None
    if blocked is not None:  # not offered as a model to run: one line says why (`runmyai get` can still name one)
        table = quant_table_html(quants, None) if quants is not None and quants.choices else ""
        body = f"<p><b>{html.escape(blocked)}</b></p>"
        return LibraryEntry(
            key, h.repo, "can't run here", head + body + table, False, colour="red", line=blocked, card_repo=h.repo
        )
    if quants is None or not quants.choices:
        files = [f for f in h.files if f.path.endswith(".gguf")]
        rows = "".join(f"<li>{html.escape(f.path)} ({human_bytes(f.size)})</li>" for f in files)
        note = f"<p>{html.escape(quants.note)}</p>" if quants is not None and quants.note else ""
        wait = "" if quants is not None else "<p><i>Reading its quants…</i></p>"
        return LibraryEntry(
            key,
            h.repo,
            "on the hub",
            head + note + wait + f"<ul>{rows}</ul>",
            can_download=bool(files),
            line="Reading its quants…" if quants is None else "No estimate",
            card_repo=h.repo,
        )
    best = quants.best()
    table = quant_table_html(quants, best)
    choices = tuple(
        (
            str(HubKey(h.repo, c.quant.name)),
            quant_label(c, c is best) + (" — installed" if c.quant.name in installed else ""),
        )
        for c in quants.choices
    )
    choice = str(HubKey(h.repo, best.quant.name)) if best is not None else None
    basis = ""
    if best is not None and best.estimate is not None:
        detail = estimate_html(best.estimate)
        b = badge(best.estimate)
        colour, line, basis = b.colour, f"{best.quant.name}: {b.line}", b.basis
    else:  # none recommended: say why
        detail = f"<p><b>{html.escape(quants.why_none())}</b></p>"
        colour, line = "red", "No quant fits here"
    source = f"installed: {', '.join(sorted(installed))}" if installed else "on the hub"
    return LibraryEntry(
        key, h.repo, source, head + table + detail, True, False, choices, choice, colour, line, h.repo, basis
    )


def quant_label(c: QuantChoice, recommended: bool) -> str:
    verdict = VERDICT_WORDS[c.estimate.verdict].lower() if c.estimate is not None else "no estimate"
    shards = f", {len(c.quant.files)} shards" if c.quant.split else ""
    star = " — recommended" if recommended else ""
    return f"{c.quant.name}: {human_bytes(c.quant.size)}{shards}, {verdict}{star}"


def quant_table_html(q: RepoQuants, best: QuantChoice | None) -> str:
    rows = []
    for c in q.choices:
        est = c.estimate
        bpw = f"{c.bits_per_weight:.2f}" if c.bits_per_weight is not None else "?"
        speed = est.speed if est is not None else "?"
        verdict = VERDICT_WORDS[est.verdict] if est is not None else "?"
        mark = " ★" if c is best else ""
        rows.append(
            f"<tr><td>{html.escape(c.quant.name)}{mark}</td><td>{human_bytes(c.quant.size)}</td>"
            f"<td>{len(c.quant.files)}</td><td>{bpw}</td><td>{speed}</td><td>{verdict}</td>"
            f"<td>{human_bytes(c.disk_needed)}</td></tr>"
        )
    basis = (
        f"<p><small>Facts from the headers of {html.escape(q.reference)}; other quants scaled by size. The disk "
        "column is the peak while repacking as it downloads (the repacked file + the largest shard).</small></p>"
        if q.reference
        else ""
    )
    return (
        "<table cellspacing='6'><tr><th>Quant</th><th>Size</th><th>Shards</th><th>Bits/weight</th>"
        "<th>Speed</th><th>Here</th><th>Disk at peak</th></tr>" + "".join(rows) + "</table>" + basis
    )


def count(n: float) -> str:
    """Parameters as people say them: 22 M, 3.3 B, 1.0 T."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}".replace(".0 ", " ")
    return f"{n:.0f}"


def _unsupported(arch: str, engine: EngineInfo) -> str:
    if not engine.known:
        return f"Could not ask the engine what it runs: {html.escape(engine.error or '')}."
    return f"This engine cannot run the {html.escape(arch)} architecture yet."


def _words(text: str) -> list[str]:
    """A query's or a name's words: 'Tiny-MoE_3B/GGUF' and 'tiny moe 3b' share theirs."""
    for sep in "-_/.:":
        text = text.replace(sep, " ")
    return text.lower().split()


def matches(entry: LibraryEntry, query: str) -> bool:
    """Every word of the query starts a word of the entry's title or key (the walk-through's user typed 'tiny moe'
    for 'Tiny-MoE-3B-A1B-GGUF' and 'qwen' for the curated Qwen3 models)."""
    have = _words(entry.title) + _words(entry.key)
    return all(any(h.startswith(w) for h in have) for w in _words(query))


def discover_entries(here: Sequence[LibraryEntry], hub: Sequence[LibraryEntry], query: str) -> list[LibraryEntry]:
    """What Discover lists: after a search, the hub's results first and then the models here and the curated ones
    that match it (a new user searched and saw the 17 curated cards unchanged, the hub's results below them all,
    out of sight); without a search, everything here and curated."""
    if not query.strip():
        return list(here)
    return [*hub, *(e for e in here if matches(e, query))]


def search_line(query: str, on_hub: int | None, here: int) -> str:
    """The line under the search box: what the search is doing or found, so an empty answer is said."""
    q = query.strip()
    if not q:
        return ""
    if on_hub is None:
        return f"Searching the hub for “{q}”…"
    if on_hub == 0 and here == 0:
        return f"Nothing matches “{q}”, on the hub or here. Try fewer or shorter words."
    hub_part = f"{on_hub} on the hub" if on_hub else "none on the hub"
    return f"“{q}”: {hub_part}, {here} here or curated. Clear the search to see all."
