"""Runs the window on a qasync loop (asyncio on Qt's event loop), and the --self-test."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import qasync
from PySide6.QtCore import QMessageLogContext, QtMsgType, qInstallMessageHandler
from PySide6.QtGui import QGuiApplication, QIcon
from PySide6.QtWidgets import QApplication, QWidget

from runmyai import __version__
from runmyai.paths import AppPaths, bundled_dir
from runmyai.ui import layout_check
from runmyai.ui.controller import AUTOTUNE_OFFER, AppController
from runmyai.ui.main_window import MainWindow
from runmyai.ui.picture_shots import picture_screenshots

SELF_TEST_TIMEOUT_S = 300
QUIET_QT_MESSAGES = ("This plugin does not support",)  # the offscreen platform's notes, once per window


def _qt_message(kind: QtMsgType, _context: QMessageLogContext, message: str) -> None:
    if not message.startswith(QUIET_QT_MESSAGES):
        print(f"qt: {message}", file=sys.stderr)


def run_app(args: argparse.Namespace) -> int:
    app = QApplication.instance() or QApplication(sys.argv[:1])
    assert isinstance(app, QApplication)
    app.setApplicationName("Run My AI")
    app.setApplicationVersion(__version__)
    app.setQuitOnLastWindowClosed(False)  # closing the window starts the shutdown; the loop must outlive it
    qInstallMessageHandler(_qt_message)
    icon = bundled_dir("resources") / "icons" / "runmyai.png"
    if icon.exists():
        app.setWindowIcon(QIcon(str(icon)))
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    window = MainWindow()
    controller = AppController(window, AppPaths.default(), hub_endpoint=args.hub, offline=args.offline)
    result = {"code": 0}
    closed = asyncio.Event()
    window.closing.connect(closed.set)
    signal.signal(signal.SIGINT, lambda *_: window.close())
    signal.signal(signal.SIGTERM, lambda *_: window.close())

    async def main() -> None:
        window.show()
        await controller.start()
        if args.self_test:
            result["code"] = await self_test(controller, args)
            window.close()
        elif args.endpoint:
            # a server that is refused (a notification says why) leaves the window with the local model
            if await controller.engine.use_endpoint(args.endpoint, os.environ.get("RUNMYAI_ENDPOINT_KEY")) is not None:
                await controller.engine.use_default_model()
        elif args.model is not None:
            await controller.engine.use_model(f"local:{args.model.resolve()}")
        else:
            await controller.engine.use_default_model()
        await closed.wait()
        await controller.shutdown()

    with loop:
        try:
            loop.run_until_complete(main())
        except KeyboardInterrupt:
            loop.run_until_complete(controller.shutdown())
            return 130
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())  # as asyncio.run does
    return result["code"]


def save_screenshot(path: Path) -> bool:
    """The whole screen as the display server shows it (under Xvfb: what a user would see)."""
    screen = QGuiApplication.primaryScreen()
    if screen is None:
        return False
    return bool(screen.grabWindow(0).save(str(path), "PNG"))  # (no processEvents here: it would re-enter the loop)


# (width, height), and which pages are saved at that size: every page at the middle size, the chat at all three
SCREENSHOT_SIZES = ((1280, 800), (1600, 1000), (1920, 1080))
SCREENSHOT_PAGES = ("Chat", "Discover", "My models", "Server", "Settings")
WIDTH_PAGES = ("Chat", "Discover")  # saved at every size: their layout changes with the width (Discover's columns)


async def take_screenshots(controller: AppController, folder: Path) -> list[str]:
    """Every page at each size in both themes, checked for clipped text and charts (layout_check: the status line,
    a chart cut at the panel's bottom), and File → Connect's dialog with a long address; the chat page and Discover
    at every size, every page at 1600×1000 and the dialog saved to `folder` as PNGs. Returns the problems found."""
    folder.mkdir(parents=True, exist_ok=True)
    window = controller.window
    problems: list[str] = []
    if controller.chat.draft_counter.task is not None:  # the draft's token count shown before the first picture
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await controller.chat.draft_counter.task
    page_before = window.current_page()
    for theme_name in ("light", "dark"):
        controller.ctx.settings = controller.ctx.settings.__class__(
            **{**controller.ctx.settings.__dict__, "theme": theme_name}
        )
        controller.prefs.apply_theme()
        for width, height in SCREENSHOT_SIZES:
            window.resize(width, height)
            for page in SCREENSHOT_PAGES:
                window.show_page(page)
                window.graphs._dirty = True
                await asyncio.sleep(0.35)  # layouts settle, the graphs redraw on their 250 ms timer
                found = layout_check.clipped(window) + layout_check.chart_problems(window)
                problems += [f"{page} at {width}x{height}, {theme_name}: {p}" for p in found]
                if page in WIDTH_PAGES or (width, height) == (1600, 1000):
                    name = f"{page.lower().replace(' ', '-')}-{width}x{height}-{theme_name}.png"
                    if not window.grab().save(str(folder / name), "PNG"):
                        problems.append(f"could not save {folder / name}")
        # File → Connect's dialog, with a long address: the walk-through's field cut it
        dialog = controller.engine.ask_endpoint()
        dialog.url.setText("https://my-gpu-box.example.com:8443/v1")
        await asyncio.sleep(0.2)
        shot = folder / f"connect-{theme_name}.png"
        problems += _checked_and_saved(dialog, f"the Connect dialog, {theme_name}", shot)
        dialog.reject()
        # the load dialog (context length, GPU offload) of the model in use, once the engine said what fits
        model = controller.engine.supervisor.model if controller.engine.supervisor is not None else None
        load = controller.engine.open_load_options(f"local:{model}") if model is not None else None
        if load is not None and controller.engine.load_facts_task is not None:
            await controller.engine.load_facts_task
            await asyncio.sleep(0.2)
            problems += _checked_and_saved(
                load, f"the load dialog, {theme_name}", folder / f"load-options-{theme_name}.png"
            )
            load.reject()
    window.show_page(page_before)
    return problems


def show_chat_states(controller: AppController, reply: str) -> None:
    """For the screenshots: a conversation that shows the chat's states at once (issue 50) — a reply with the
    notice of what the context dropped, a reply that failed with its marker, and the tools button with what the
    tools take of the context. The self-test has no MCP server, so the button's servers and count are set here
    (the words and layout are the app's; tests/app/test_twenty_turns.py checks them with a real server)."""
    from dataclasses import replace as _replace

    store, chat = controller.store, controller.window.chat
    conv = store.create("Tell me a story about a king", model=controller.engine.model_name)
    store.add_message(conv.id, "user", "Tell me a story about a king.")
    store.add_message(conv.id, "assistant", "There once was a king.", model=controller.engine.model_name)
    store.drop_last_assistant(conv.id)  # regenerated: the first version is kept, "< 2/2 >" shows on the reply
    first = store.add_message(conv.id, "assistant", reply or "Once upon a time…", model=controller.engine.model_name)
    store.add_message(conv.id, "user", "Give me a verse from Psalms.")
    store.add_message(
        conv.id, "assistant", "**Psalms 23:1**\nThe LORD is my shepherd;", finish_reason="error", tokens=9
    )
    note = {"policy": "rolling", "dropped_messages": 3, "dropped_tokens": 812, "message_id": first.id}
    store.set_settings(conv.id, _replace(conv.settings, overflow=note))
    servers = [("time", "2 tools", True), ("everything", "11 tools", True)]

    def tools() -> None:  # (what the controller's own redraws would show with those two servers counted)
        chat.set_tools("Tools: time, everything · 2,561 tokens", True, servers)

    controller.talks.show_tools = tools  # type: ignore[method-assign]
    controller.talks.open_conversation(conv.id)
    controller.talks.list_conversations()
    chat.input.setPlainText("What happened to the king's daughter?")  # the token count under the input


async def self_test(controller: AppController, args: argparse.Namespace) -> int:
    """Opens, finds the engine, gets one reply from the built-in model (or --model), closes. 0 if all worked."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(SELF_TEST_TIMEOUT_S):
            if args.model is not None:
                key = f"local:{args.model.resolve()}"
            else:
                demo = next((m for m in controller.models.local_models if m.bundled and m.error is None), None)
                if demo is None:
                    print("runmyai self-test: no built-in model is ready", file=sys.stderr)
                    return 1
                key = f"local:{demo.path}"
                if getattr(args, "screenshots", None) is not None:
                    # the pictures show the pages, not the first start's offer to measure this machine (it sat
                    # above every page; docs/app-walkthrough.md shows it). Hidden, not declined: nothing is saved.
                    controller.window.notifications.forget(AUTOTUNE_OFFER)
            endpoint = await controller.engine.use_model(key)
            if endpoint is None:
                print(f"runmyai self-test: the engine did not start: {controller.ctx.errors[-1:]}", file=sys.stderr)
                return 1
            controller.talks.new_conversation()
            reply = await controller.chat.chat_once("Hello! Who are you?")
            if controller.chat.speed_task is not None:  # its speed saved: the screenshots show the measured card
                await controller.chat.speed_task
    except TimeoutError:
        print(f"runmyai self-test: no reply within {SELF_TEST_TIMEOUT_S} s", file=sys.stderr)
        return 1
    cid = controller.talks.conversation_id
    last = controller.store.messages(cid)[-1] if cid is not None and controller.store.messages(cid) else None
    if last is None or last.role != "assistant" or last.finish_reason not in ("stop", "length", "context_full"):
        # (an empty but finished reply counts: a random test model may well say end-of-text first)
        print(f"runmyai self-test: no finished reply ({controller.window.chat.status.text()})", file=sys.stderr)
        return 1
    if args.screenshot is not None:
        await asyncio.sleep(0.6)  # the graphs redraw on their timer
        if not save_screenshot(args.screenshot):
            print(f"runmyai self-test: could not save a screenshot to {args.screenshot}", file=sys.stderr)
            return 1
    if getattr(args, "screenshots", None) is not None:
        show_chat_states(controller, reply)
        problems = await take_screenshots(controller, args.screenshots)
        # a vision model's chat with pictures (ui/picture_shots.py; nothing for a text model)
        problems += await picture_screenshots(controller, args.screenshots, controller.paths.home / "picture-shots")
        for line in problems:
            print(f"runmyai self-test: {line}", file=sys.stderr)
        if problems:
            return 1
    version = (controller.engine.supervisor.handshake or {}).get("version") if controller.engine.supervisor else None
    print(
        f"runmyai self-test: ok — on the {QGuiApplication.platformName()} platform, engine {version} at "
        f"{endpoint.base_url}, "
        f"{len(reply)} characters of reply in {time.monotonic() - started:.1f} s; "
        f"graphs: {controller.window.graphs.summary.text()}"
    )
    return 0


def _checked_and_saved(dialog: QWidget, what: str, path: Path) -> list[str]:
    """A dialog's clipped parts (layout_check), and its picture saved at `path`."""
    problems = [f"{what}: {p}" for p in layout_check.clipped(dialog)]
    if not dialog.grab().save(str(path), "PNG"):
        problems.append(f"could not save {path}")
    return problems
