"""The engine flags a model is started with, in one place: the window starts the engine with them, and every
estimate of an installed model (the window's, `runmyai list`'s) is worked out for them, so that what the app
predicts is what it runs."""

from __future__ import annotations

from pathlib import Path

from runmyai.engine.autotune import AutotuneRunner
from runmyai.engine.info import EngineInfo
from runmyai.library.local import LocalModel
from runmyai.library.mmproj import mmproj_flags
from runmyai.library.presets import Preset


def model_context(local: LocalModel | None, preset: Preset | None) -> int | None:
    """The model's own context length: what its file says, else its preset."""
    ctx = local.facts.get("context_length") if local is not None and local.facts is not None else None
    if isinstance(ctx, int) and ctx > 0:
        return ctx
    return preset.facts.context if preset is not None else None


def launch_flags(
    path: Path, local: LocalModel | None, preset: Preset | None, autotune: AutotuneRunner, engine: EngineInfo
) -> list[str]:
    """The preset's flags (what was measured for the model, and the built-in model's budget), then autotune's
    choices and the user's overrides for this file, and the chat context (`--ctx`); a vision model's image encoder
    kept beside it (`--mmproj`) where the engine's server reads that model's pictures (library/mmproj.py)."""
    encoder = mmproj_flags(path, local.arch if local else None, engine)
    return [*(preset.flags if preset else ()), *autotune.serve_flags(path, model_context(local, preset)), *encoder]
