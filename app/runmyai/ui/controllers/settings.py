"""The Settings page: the theme (and the desktop's, followed), the context length, the model folders, and the
chat presets saved per model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QApplication, QFileDialog

from runmyai.ui import theme
from runmyai.ui.chat_panel import SamplingValues
from runmyai.ui.controllers.base import Room, Shared
from runmyai.ui.viewmodels import AppSettings


class SettingsRoom(Room):
    context_changed = Signal()  # the context length for the next start changed (the estimates, a restart)
    preset_applied = Signal()  # a chat preset was put in the chat's settings (saved into the conversation)

    def __init__(
        self, ctx: Shared, model: Callable[[], str | None], use_folders: Callable[[list[Path]], Awaitable[None]]
    ) -> None:
        super().__init__(ctx)
        self._model = model  # the model in use: presets are saved per model
        self._use_folders = use_folders  # the library's folders, scanned again
        sp = self.window.settings_page
        sp.theme_changed.connect(self._set_theme)
        sp.context_changed.connect(self.set_context)
        sp.folders_changed.connect(lambda folders: self.ctx.spawn(self.set_folders(folders)))
        sp.add_folder_requested.connect(self._choose_folder)
        sp.preset_save_requested.connect(self._save_preset)
        sp.preset_apply_requested.connect(self._apply_preset)
        sp.preset_delete_requested.connect(self._delete_preset)
        sp.set_settings(self.ctx.settings, str(self.ctx.paths.models))
        hints = QApplication.styleHints()
        self._follows_desktop = hints is not None
        if hints is not None:  # "follow the system": the desktop switching to dark switches the app
            hints.colorSchemeChanged.connect(self._system_scheme_changed)

    def apply_theme(self) -> None:
        app = QApplication.instance()
        if isinstance(app, QApplication):
            c = theme.apply(app, self.ctx.settings.theme)
            self.window.graphs.set_colours(c.plot_bg, c.plot_fg)
            self.window.set_icon_colours(c.text, c.accent_text)

    def stop_following_desktop(self) -> None:
        """No more theme changes from the desktop (at shutdown: the application outlives this controller, and in
        the tests many controllers share one application). Once is enough; again does nothing."""
        hints = QApplication.styleHints()
        if self._follows_desktop and hints is not None:
            self._follows_desktop = False
            hints.colorSchemeChanged.disconnect(self._system_scheme_changed)

    def _system_scheme_changed(self, _scheme: object) -> None:
        if self.ctx.settings.theme == "system":  # a chosen light or dark stays as chosen
            self.apply_theme()

    def _set_theme(self, value: str) -> None:
        settings = self.ctx.settings
        self.ctx.settings = AppSettings(**{**settings.__dict__, "theme": self.window.settings_page.theme_value()})
        self.ctx.save_settings()
        self.apply_theme()

    def set_context(self, n: int) -> None:
        """The context length for the next start of a model (the running one keeps its own until restarted)."""
        if n == self.ctx.settings.context_length:
            return
        self.ctx.settings = AppSettings(**{**self.ctx.settings.__dict__, "context_length": n})
        self.ctx.save_settings()
        self.context_changed.emit()

    async def set_folders(self, folders: list[str]) -> None:
        self.ctx.settings = AppSettings(**{**self.ctx.settings.__dict__, "model_dirs": tuple(folders)})
        self.ctx.save_settings()
        self.window.settings_page.set_settings(self.ctx.settings, str(self.ctx.paths.models))
        await self._use_folders([Path(f) for f in folders])

    def _choose_folder(self) -> None:
        dialog = QFileDialog(self.window, "A folder with models", str(Path.home()))
        dialog.setFileMode(QFileDialog.FileMode.Directory)
        dialog.fileSelected.connect(
            lambda folder: (
                self.ctx.spawn(self.set_folders([*self.ctx.settings.model_dirs, folder]))
                if folder and folder not in self.ctx.settings.model_dirs
                else None
            )
        )
        dialog.open()

    def show_presets(self) -> None:
        model = self._model()
        names = sorted(self.ctx.settings.presets.get(model or "", {}))
        self.window.settings_page.set_presets(model, names)

    def _save_preset(self, name: str) -> None:
        """The current chat's system prompt and sampling settings, saved under a name for the current model."""
        model = self._model()
        if model is None:
            self.ctx.report("Load a model first: presets are saved per model.", "presets", "Chat presets")
            return
        values = self.window.chat.settings.values().__dict__
        presets = {k: dict(v) for k, v in self.ctx.settings.presets.items()}
        presets.setdefault(model, {})[name] = dict(values)
        self.ctx.settings = AppSettings(**{**self.ctx.settings.__dict__, "presets": presets})
        self.ctx.save_settings()
        self.show_presets()

    def _apply_preset(self, name: str) -> None:
        values = self.ctx.settings.presets.get(self._model() or "", {}).get(name)
        if values is None:
            return
        fields = SamplingValues.__dataclass_fields__
        self.window.chat.settings.set_values(SamplingValues(**{k: v for k, v in values.items() if k in fields}))
        self.preset_applied.emit()
        self.window.show_page("Chat")

    def _delete_preset(self, name: str) -> None:
        model = self._model() or ""
        presets = {k: dict(v) for k, v in self.ctx.settings.presets.items()}
        presets.get(model, {}).pop(name, None)
        self.ctx.settings = AppSettings(**{**self.ctx.settings.__dict__, "presets": presets})
        self.ctx.save_settings()
        self.show_presets()
