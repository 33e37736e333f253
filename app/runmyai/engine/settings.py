"""Per model and machine settings files under AppPaths.settings: the autotune result and the user's overrides.

Files (flat in the settings folder, written atomically):

* `autotune-<model>-<model hash>-<machine id>.json`: `tokenwing autotune --json`'s own output (machine,
  settings, reasons) plus `runmyai` metadata (model path, machine fingerprint, when). Re-running autotune
  replaces it.
* `overrides-<model>-<model hash>-<machine id>.json`: `{"overrides": {setting: value}}`, kept apart so that
  re-running autotune never loses them.

A model is identified by its resolved path; a machine by its fingerprint (hostname + CPU model + total RAM), so
a portable install moved to another computer does not reuse another machine's measurements.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from runmyai.machine import MachineFingerprint, machine_fingerprint

DEFAULT_CONTEXT = 8192  # tokens of chat context unless the user asks for more (the KV cache is sized for it)


def model_key(model: Path) -> str:
    """`<name>-<hash of the resolved path>`: readable, and unique for two files of one name."""
    resolved = str(Path(model).expanduser().resolve())
    name = Path(resolved).name.removesuffix(".gguf").removesuffix(".tw")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:60] or "model"
    return f"{slug}-{hashlib.sha256(resolved.encode()).hexdigest()[:8]}"


class SettingsFiles:
    def __init__(self, folder: Path, machine: MachineFingerprint | None = None) -> None:
        self.folder = Path(folder)
        self.machine = machine or machine_fingerprint()

    def autotune_path(self, model: Path) -> Path:
        return self.folder / f"autotune-{model_key(model)}-{self.machine.id}.json"

    def overrides_path(self, model: Path) -> Path:
        return self.folder / f"overrides-{model_key(model)}-{self.machine.id}.json"
