"""Where the app keeps its files: one home, overridable for tests and portable installs."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import platformdirs


@dataclass(frozen=True)
class AppPaths:
    home: Path

    @classmethod
    def default(cls) -> AppPaths:
        override = os.environ.get("RUNMYAI_HOME")
        home = Path(override) if override else Path(platformdirs.user_data_dir("runmyai", appauthor=False))
        return cls(home)

    @property
    def models(self) -> Path:
        return self.home / "models"

    @property
    def downloads(self) -> Path:  # partial downloads and their resume state
        return self.home / "downloads"

    @property
    def jobs(self) -> Path:  # models on their way in: shards, their headers, the engine's manifest
        return self.home / "downloads" / "jobs"

    @property
    def conversations_db(self) -> Path:
        return self.home / "conversations.sqlite3"

    @property
    def settings(self) -> Path:  # per model and machine: autotuned flags and overrides
        return self.home / "settings"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    def ensure(self) -> AppPaths:
        for path in (self.home, self.models, self.downloads, self.settings, self.logs):
            path.mkdir(parents=True, exist_ok=True)
        return self


def bundled_dir(name: str) -> Path:
    """A folder shipped with the app (presets/, resources/): beside the frozen bundle, or in the source tree."""
    frozen_root = getattr(sys, "_MEIPASS", None)
    if frozen_root is not None:
        return Path(frozen_root) / name
    return Path(__file__).resolve().parents[2] / name
