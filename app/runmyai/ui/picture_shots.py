"""The self-test's pictures of a chat with a vision model (issue 45 item 5): a picture dropped on the chat and sent
with a question (a real reply), another one waiting in the composer with its thumbnail; saved at two sizes in both
themes and checked for clipped text (layout_check). Run where the model in use reads pictures (the engine says so:
`ChatPanel.images_allowed`), e.g. `runmyai --self-test --offscreen --model <models>/…/Tiny-VL.tw.gguf
--screenshots DIR` with its mmproj beside it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QColor, QDragEnterEvent, QDropEvent, QImage, QLinearGradient, QPainter

from runmyai.ui import layout_check
from runmyai.ui.controller import AUTOTUNE_OFFER, AppController

PICTURE_SIZES = ((1280, 800), (1600, 1000))
QUESTION = "What is in this picture?"


def sunset(width: int, height: int) -> QImage:
    """A picture to drop: a sky's gradient, a sun and the sea (drawn, so that nothing is fetched)."""
    image = QImage(width, height, QImage.Format.Format_RGB32)
    painter = QPainter(image)
    sky = QLinearGradient(0, 0, 0, height)
    sky.setColorAt(0.0, QColor("#2b3a67"))
    sky.setColorAt(0.6, QColor("#f08a4b"))
    sky.setColorAt(1.0, QColor("#ffd29d"))
    painter.fillRect(0, 0, width, height, sky)
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(QColor("#ffef9f"))
    painter.drawEllipse(QPointF(width * 0.62, height * 0.62), height * 0.16, height * 0.16)
    painter.setBrush(QColor("#1d4e6e"))
    painter.drawRect(0, int(height * 0.7), width, height)
    painter.end()
    return image


def drop(controller: AppController, path: Path) -> None:
    """A file dragged onto the chat and dropped, as the chat's handlers receive it."""
    chat = controller.window.chat
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    rest = (Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    chat.dragEnterEvent(QDragEnterEvent(QPoint(80, 80), *rest))
    chat.dropEvent(QDropEvent(QPointF(80, 80), *rest))


async def picture_screenshots(controller: AppController, folder: Path, work: Path) -> list[str]:
    """The pictures (`chat-picture-WxH-THEME.png` in `folder`) where the model in use reads pictures; the problems
    found. `work`: where the dropped files are written."""
    chat = controller.window.chat
    if controller.engine.images_task is not None:
        await controller.engine.images_task  # (the server's answer: does its model read pictures)
    if not chat.images_allowed:
        return []  # a text model (the built-in one): no picture case
    work.mkdir(parents=True, exist_ok=True)
    first, second = work / "sunset.png", work / "harbour.png"
    sunset(640, 420).save(str(first))
    sunset(480, 480).mirrored(True, False).save(str(second))
    controller.window.notifications.forget(AUTOTUNE_OFFER)  # (the first start's offer sat over the transcript)
    controller.talks.new_conversation()
    chat.settings.max_tokens.setValue(24)  # a short reply: the random test model's words mean nothing
    drop(controller, first)
    await controller.chat.chat_once(QUESTION)
    drop(controller, second)  # the next message's picture, waiting in the composer
    chat.input.setPlainText("And this one?")
    problems: list[str] = []
    window = controller.window
    window.show_page("Chat")
    for theme in ("light", "dark"):
        controller.ctx.settings = controller.ctx.settings.__class__(
            **{**controller.ctx.settings.__dict__, "theme": theme}
        )
        controller.prefs.apply_theme()
        for width, height in PICTURE_SIZES:
            window.resize(width, height)
            await asyncio.sleep(0.35)  # layouts settle
            problems += [f"the picture chat at {width}x{height}, {theme}: {p}" for p in layout_check.clipped(window)]
            shot = folder / f"chat-picture-{width}x{height}-{theme}.png"
            if not window.grab().save(str(shot), "PNG"):
                problems.append(f"could not save {shot}")
    return problems
