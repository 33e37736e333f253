"""Autotune: the dialog that measures a model on this machine, the start's offer to measure it, and every
estimate worked out again from what was measured."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runmyai.engine.autotune import DECODE_PROBE_TOKENS, SMALL_MODEL_PROBE_TOKENS, AutotuneError
from runmyai.machine import probe_machine_async
from runmyai.ui.autotune_dialog import AutotuneDialog
from runmyai.ui.controllers.base import Room, Shared
from runmyai.ui.controllers.library import LibraryRoom

AUTOTUNE_OFFER = "autotune-offer"  # the notification offering to measure this machine


class AutotuneRoom(Room):
    def __init__(self, ctx: Shared, library: LibraryRoom) -> None:
        super().__init__(ctx)
        self.lib = library
        self.autotune_dialog: AutotuneDialog | None = None  # the Autotune… dialog last opened, and its runs
        self.autotune_runs: list[asyncio.Task[Any]] = []
        self.window.library.autotune_requested.connect(self.open_autotune)

    def open_autotune(self, key: str) -> None:
        path = self.lib.model_path(key)
        if path is None:
            return
        dialog = AutotuneDialog(self.lib.name_of(path), self.window)
        running: list[asyncio.Task[Any]] = []
        autotune = self.ctx.autotune

        def show() -> None:
            saved = autotune.saved(path)
            overrides = {k: str(v) for k, v in autotune.overrides(path).items()}
            if saved is not None:
                dialog.show_result(saved.machine_lines(), saved.settings, saved.reasons, overrides)

        async def run() -> None:
            dialog.set_running(True)
            outcome = "Stopped."

            def measured() -> None:  # the engine's last process has exited: the bar and "measuring…" end now
                nonlocal outcome
                outcome = "Measured. The speed estimates now use it."
                dialog.set_running(False, outcome)
                show()

            try:
                await self.run_autotune(path, dialog.show_progress, measured=measured)
            except AutotuneError as e:
                outcome = str(e)
            finally:
                dialog.set_running(False, outcome)

        def save(values: dict[str, str]) -> None:
            autotune.set_overrides(path, values)
            self.lib.list_entries()  # a budget or context override changes the estimate

        self.autotune_dialog, self.autotune_runs = dialog, running  # (tests wait for a run at its end)
        dialog.run_requested.connect(lambda: running.append(self.ctx.spawn(run())))
        dialog.cancel_requested.connect(lambda: [t.cancel() for t in running])
        dialog.overrides_saved.connect(save)
        dialog.rejected.connect(lambda: [t.cancel() for t in running])
        show()
        dialog.open()

    async def run_autotune(
        self,
        path: Path,
        progress: Callable[[str], None] | None = None,
        *,
        decode_tokens: int = DECODE_PROBE_TOKENS,
        measured: Callable[[], None] | None = None,
    ) -> None:
        """Autotune for a model, then every estimate again: the machine probe now holds what autotune measured
        (the drive's read speed, the decode speed that calibrates the estimate, the GPU's copy speed). Discover's
        cards, My models' rows (they kept the old estimate) and `runmyai list` (it reads the saved result).
        `measured`: called as the measurement ends (its last engine process exited, its result saved), before
        the estimates are worked out again."""
        exit_codes = self.ctx.engine_info.exit_codes
        await self.ctx.autotune.run(path, progress, exit_codes=exit_codes, decode_tokens=decode_tokens)
        if measured is not None:
            measured()
        await self.estimate_again()

    async def estimate_again(self) -> None:
        """Every estimate again, from the machine probe that now holds what was measured."""
        self.ctx.machine = await probe_machine_async(self.ctx.paths.models, autotune_dir=self.ctx.paths.settings)
        self.lib.list_entries()
        self.lib.show_models()

    def offer_autotune(self) -> bool:
        """At start, while nothing was measured here: one click measures this machine with the built-in model.
        The estimate otherwise rests on defaults fitted on an idle machine of another class (docs/results.md):
        on this busy 2-core one the walk-through saw the built-in model estimated at ~335 tok/s and measured
        0.8-11.5. The app does not measure unasked: autotune loads the CPU and the drive (with the built-in model
        1.2 s of `tokenwing autotune`, then a 32-token decode, on this 2-core machine)."""
        m = self.ctx.machine
        model = next((x for x in self.lib.local_models if x.bundled and x.error is None), None)
        measured = m is not None and (m.decode_probe is not None or bool(m.speeds))  # (a chat's speed counts too)
        if m is None or measured or self.ctx.settings.autotune_declined or model is None:
            return False
        path = model.path
        self.ctx.retry[AUTOTUNE_OFFER] = lambda: self.ctx.spawn(self.measure_machine(path))
        self.window.notifications.offer(
            AUTOTUNE_OFFER,
            "Measure this machine?",
            "The speed estimates use defaults from another machine. A short measurement with the built-in model "
            "(seconds; in the background, you can keep chatting) makes them this machine's.",
            "Measure now",
        )
        return True

    def _measure_again(self, path: Path) -> None:
        self.ctx.spawn(self.measure_machine(path))

    async def measure_machine(self, path: Path) -> bool:
        """The offer's "Measure now": autotune as a long job (progress and Cancel in its notification), then
        every estimate again. False if it failed or was cancelled."""

        async def work(progress: Callable[[float | None, str], None]) -> None:
            progress(None, "Timing the drive and a short reply of the built-in model")
            await self.ctx.autotune.run(
                path,
                lambda line: progress(None, line),
                exit_codes=self.ctx.engine_info.exit_codes,
                decode_tokens=SMALL_MODEL_PROBE_TOKENS,
            )

        before = self.lib.estimate_line(path)
        # the job (its notification's bar) ends as the measurement's last engine process exits; the estimates are
        # worked out again after it, not under a bar that has nothing left to measure
        ok = await self.lib.jobs.run_job("Measuring this machine", work, "autotune", lambda: self._measure_again(path))
        if ok:
            await self.estimate_again()
            after = self.lib.estimate_line(path)
            parts = before.split(" · ")  # "Runs well here · ~167–502 tok/s · estimated from its shape"
            was = f" (the defaults said {parts[1]})" if len(parts) > 1 else ""
            now = f"{after[0].lower()}{after[1:]}" if after else "has its estimate"
            self.ctx.confirm(
                "autotune",
                "Measured",
                f"The speed estimates now use what this machine measured: {self.lib.name_of(path)} {now}{was}.",
            )
        return ok
