"""Discover and My models: the models here and curated, the hub's search and quants, model cards, and what My
models does to a model (verify, delete, open its folder); getting one is the jobs room's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QApplication, QMessageBox

from runmyai.jsonfile import read_json, write_json_atomic
from runmyai.library.acquire import RepoQuants
from runmyai.library.hub import HubClient, HubError, HubModel
from runmyai.library.keys import HubKey, LocalKey, PresetKey, parse_key
from runmyai.library.launch import launch_flags
from runmyai.library.local import LibraryError, LocalLibrary, LocalModel
from runmyai.library.presets import Catalog, Preset
from runmyai.ui import render
from runmyai.ui.controllers.base import Room, Shared
from runmyai.ui.controllers.jobs import JobsRoom
from runmyai.ui.render import LibraryEntry, View
from runmyai.ui.viewmodels import ModelRow, ago, repo_of
from runmyai.units import human_bytes

REMOTE_KEY = "remote:"  # the model picker's entry for the connected endpoint's model

InUse = Callable[[], tuple[Path | None, str | None]]  # the local model in use; the remote one's picker line


class LibraryRoom(Room):
    deleted = Signal(object)  # a model file (Path) was deleted from this computer

    def __init__(self, ctx: Shared, catalog: Catalog, library: LocalLibrary, hub: HubClient, in_use: InUse) -> None:
        super().__init__(ctx)
        self.catalog = catalog
        self.library = library
        self.hub = hub
        self._in_use = in_use
        self.jobs = JobsRoom(ctx, hub, library, catalog, self.refresh_library)
        self.local_models: list[LocalModel] = []
        self.hub_results: list[HubModel] = []
        self.hub_query = ""  # Discover's search: its hub results first, the models here filtered by it
        self.hub_quants: dict[str, RepoQuants] = {}
        self._quants_loading: set[str] = set()
        self._cards_asked: set[str] = set()  # entries whose model card was asked for
        self._last_used_file = ctx.paths.settings / "last-used.json"
        lib = self.window.library
        lib.download_requested.connect(self._download)
        lib.selected.connect(self._selected)
        lib.model_card_requested.connect(self._card_wanted)
        lib.search_requested.connect(lambda q: self.ctx.spawn(self.search(q)))
        models = self.window.models_page
        models.verify_requested.connect(lambda path: self.ctx.spawn(self.verify_model(Path(path))))
        models.open_folder_requested.connect(self._open_folder)
        models.delete_requested.connect(self._ask_delete)

    def model_path(self, text: str) -> Path | None:
        key = parse_key(text)
        if isinstance(key, LocalKey):
            return key.path
        if isinstance(key, PresetKey):
            match = next((m for m in self.local_models if m.preset_id == key.id), None)
            return match.path if match else None
        return None

    def local_of(self, path: Path | None) -> tuple[LocalModel | None, Preset | None]:
        """The model here at `path`, and the curated preset it was made from, if any."""
        local = next((m for m in self.local_models if m.path == path), None)
        return local, self.catalog.get(local.preset_id) if local and local.preset_id else None

    def name_of(self, path: Path) -> str:
        """A model's name as the picker and My models say it (the walk-through's notices said its file's)."""
        return next((m.name for m in self.local_models if m.path == path), path.name)

    async def refresh_library(self, select: str | None = None) -> None:
        self.local_models = await self.library.scan()
        self.list_entries(select)
        self.show_models()

    async def use_folders(self, folders: list[Path]) -> None:
        self.library.extra_dirs = folders
        await self.refresh_library()

    def show_models(self) -> None:
        """The model picker and the My models page, from the library and the one estimate."""
        entries = {e.key: e for e in self.entries(searched=False)}
        in_use, remote = self._in_use()
        usable = [
            (str(LocalKey(m.path)), m.name)
            for m in self.local_models
            if entries.get(str(LocalKey(m.path))) and entries[str(LocalKey(m.path))].can_use
        ]
        current = str(LocalKey(in_use)) if in_use is not None else None
        if remote is not None:  # connected: the remote model, never a local one
            usable.insert(0, (REMOTE_KEY, remote))
            current = REMOTE_KEY
        self.window.chat.set_models(usable, current)
        self.window.chat.eject_button.setEnabled(in_use is not None)
        used = self._read_last_used()
        rows = []
        for m in self.local_models:
            key = str(LocalKey(m.path))
            e = entries.get(key)
            rows.append(
                ModelRow(
                    key=key,
                    name=m.name,
                    repo=repo_of(m.path, self.ctx.paths.models),
                    size=human_bytes(m.size_bytes),
                    arch=m.arch or "?",
                    estimate=(e.line if e is not None and e.line else (m.error or "—")),
                    last_used=ago(used.get(str(m.path))),
                    path=m.path,
                    bundled=m.bundled,
                    in_use=m.path == in_use,
                )
            )
        self.window.models_page.set_rows(rows)

    def _read_last_used(self) -> dict[str, float]:
        data = read_json(self._last_used_file) or {}
        return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}

    def mark_used(self, path: Path) -> None:
        used = self._read_last_used()
        used[str(path)] = time.time()
        with contextlib.suppress(OSError):
            write_json_atomic(self._last_used_file, used)

    def _open_folder(self, path_text: str) -> None:
        """My models' Open folder: the file manager, or where there is none (it failed silently), one line that
        says so, with the folder's path and a button that copies it."""
        folder = Path(path_text).parent
        key = "open-folder"
        if QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))):
            self.window.notifications.forget(key)
            return

        def copy() -> None:
            clipboard = QApplication.clipboard()
            if clipboard is not None:
                clipboard.setText(str(folder))
            self.ctx.confirm(key, "Path copied", f"{folder} is on the clipboard.")

        self.ctx.retry[key] = copy
        self.window.log_view.append(f"[app] no file manager opened {folder}")
        self.window.notifications.info(
            key, "No file manager opened the folder", f"The model is in {folder}", action="Copy path"
        )

    async def verify_model(self, path: Path) -> bool:
        """Re-verify from My models: every expert's checksum, as a long job with progress and Cancel."""

        async def work(progress: Callable[[float, str], None]) -> None:
            progress(0.0, "checking every expert's checksum")
            await self.library.verify(path)

        name = self.name_of(path)
        ok = await self.jobs.run_job(f"Verifying {name}", work, key=f"verify:{path}")
        if ok:
            self.ctx.confirm(f"verify:{path}", f"{name} is intact", "Every expert checked out.")
        return ok

    def _ask_delete(self, path_text: str) -> None:
        path = Path(path_text)
        box = QMessageBox(
            QMessageBox.Icon.Warning,
            "Delete the model?",
            f"Delete {self.name_of(path)} ({human_bytes(path.stat().st_size) if path.exists() else '?'}) from this "
            f"computer?\n\n{path}",
            QMessageBox.StandardButton.Cancel,
            self.window,
        )
        delete = box.addButton("Delete", QMessageBox.ButtonRole.DestructiveRole)
        box.buttonClicked.connect(lambda b: self.ctx.spawn(self.delete_model(path)) if b is delete else None)
        box.open()  # not exec(): the loop keeps running

    async def delete_model(self, path: Path) -> bool:
        if self._in_use()[0] == path:
            self.ctx.report(f"{self.name_of(path)} is in use: load another model first.", "delete", "Deleting a model")
            return False
        try:
            await asyncio.to_thread(self.library.delete, path)
        except LibraryError as e:
            self.ctx.report(str(e), "delete", "Deleting a model")
            return False
        self.window.notifications.succeeded("delete")
        self.window.notifications.forget(f"verify:{path}")  # about a file that is gone
        self.deleted.emit(path)
        await self.refresh_library()
        return True

    def _view(self) -> View:
        return View(
            self.ctx.machine,
            self.ctx.engine_info,
            lambda m, p: launch_flags(m.path, m, p, self.ctx.autotune, self.ctx.engine_info),
        )

    def entries(self, *, searched: bool = True) -> list[LibraryEntry]:
        """Discover's entries: with `searched`, as its search shows them (the hub's results first, the rest
        filtered); without, every model here and curated (the picker and My models list every installed one)."""
        view = self._view()
        entries = [
            render.local_entry(m, self.catalog.get(m.preset_id) if m.preset_id else None, view)
            for m in self.local_models
        ]
        installed = {m.preset_id for m in self.local_models if m.preset_id}
        entries += [render.preset_entry(p, view) for p in self.catalog.presets if p.id not in installed]
        have = {m.path for m in self.local_models}
        hub = [
            render.hub_entry(
                h, q := self.hub_quants.get(h.repo), render.installed_quants(q, self.library.models_dir, have)
            )
            for h in self.hub_results
        ]
        return render.discover_entries(entries, hub, self.hub_query if searched else "")

    def list_entries(self, select: str | None = None) -> list[LibraryEntry]:
        """Discover's cards, and the search's line counted from what is listed now (a model downloaded from the
        results joins them: the line said '0 here' beside its card)."""
        entries = self.entries()
        self.window.library.set_entries(entries, select)
        if self.hub_query:
            here = len(entries) - len(self.hub_results)
            self.window.library.set_search_line(render.search_line(self.hub_query, len(self.hub_results), here))
        return entries

    def estimate_line(self, path: Path) -> str:
        """A model's estimate in one line, as its card says it ("Runs well here · ~18.4 tok/s")."""
        entry = next((e for e in self.entries(searched=False) if e.key == str(LocalKey(path))), None)
        return entry.line if entry is not None else ""

    async def search(self, query: str) -> None:
        self.hub_query = query
        lib = self.window.library
        if not query:
            self.hub_results = []
            lib.set_search_line("")
        else:
            lib.set_search_line(render.search_line(query, None, 0))
            self.ctx.retry["search"] = lambda: self.ctx.spawn(self.search(query))
            try:
                found = await self.hub.search(query, "repacked")
                found += [m for m in await self.hub.search(query, "gguf") if m.repo not in {f.repo for f in found}]
            except HubError as e:
                lib.set_search_line("")
                self.ctx.report(str(e), "search", f"Searching the hub for “{query}”")
                return
            self.window.notifications.succeeded("search")
            self.hub_results = found[:20]
        entries = self.list_entries()
        if query and entries:
            lib.select(entries[0].key)  # the best match shown, its quants read
        if self.hub_results:
            self.ctx.spawn(self.load_quants(self.hub_results[0].repo))

    async def load_quants(self, repo: str) -> RepoQuants | None:
        """A hub repository's quants with their estimates (header bytes and the engine's plan; cached)."""
        if repo in self.hub_quants:
            return self.hub_quants[repo]
        if repo in self._quants_loading:
            return None
        self._quants_loading.add(repo)
        try:
            quants = await self.jobs.acquirer.quants(repo)
        except HubError as e:
            self.ctx.retry[f"quants:{repo}"] = lambda: self.ctx.spawn(self.load_quants(repo))
            self.ctx.report(str(e), f"quants:{repo}", f"Reading the quants of {repo}")
            return None
        finally:
            self._quants_loading.discard(repo)
        self.hub_quants[repo] = quants
        self.list_entries()
        return quants

    def _selected(self, text: str) -> None:
        key = parse_key(text)
        if isinstance(key, HubKey) and any(h.repo == key.repo for h in self.hub_results):
            self.ctx.spawn(self.load_quants(key.repo))

    def _card_wanted(self, key: str) -> None:
        entry = next((e for e in self.entries() if e.key == key), None)
        if entry is not None and entry.card_repo is not None and key not in self._cards_asked:
            self._cards_asked.add(key)
            self.ctx.spawn(self.load_model_card(key, entry.card_repo))

    async def load_model_card(self, key: str, repo: str) -> None:
        """The repository's README as the model card (the hub client retries with backoff)."""
        try:
            text = await self.hub.readme(repo)
        except HubError as e:
            self._cards_asked.discard(key)  # asked again the next time it is picked
            self.window.library.set_model_card(key, f"*The model card could not be read:* {e}")
            return
        self.window.library.set_model_card(key, text if text else f"*{repo} has no README.*")

    def _download(self, text: str) -> None:
        key = parse_key(text)
        if isinstance(key, PresetKey):
            p = self.catalog.get(key.id)
            if p is None:
                return
            if p.published and p.repo is not None:
                try:
                    self.jobs.downloads.enqueue(p.repo, p.file, sha256=p.sha256, size=p.size_bytes or None)
                except HubError as e:
                    self.ctx.report(str(e))
                return
            if p.gguf is None:
                return
            key = HubKey(p.gguf.repo, p.gguf.default)
        if isinstance(key, HubKey):
            self.ctx.spawn(self.jobs.get_model(key))
