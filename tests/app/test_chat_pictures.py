"""Pictures into the chat's composer (issue 45 item 5), the thin widgets with pytest-qt: attach (a file of any
format Qt reads), paste (the clipboard's bitmap, through the input's own Ctrl+V path), drop (on the chat), the
thumbnails in the composer and in the sent message, and none of it offered while the model reads no pictures."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QColor, QDragEnterEvent, QDropEvent, QImage
from PySide6.QtWidgets import QApplication, QToolButton
from pytestqt.qtbot import QtBot

from runmyai.chat.images import PNG_MAGIC
from runmyai.ui.chat_panel import ChatPanel
from runmyai.ui.image_input import MAX_SIDE, MESSAGE_THUMB, THUMB, picture_from_image
from runmyai.ui.transcript import Transcript


def picture(width: int, height: int, colour: str = "#3070c0") -> QImage:
    image = QImage(width, height, QImage.Format.Format_RGB32)
    image.fill(QColor(colour))
    return image


def panel(qtbot: QtBot, allowed: bool) -> ChatPanel:
    p = ChatPanel()
    qtbot.addWidget(p)
    p.resize(900, 700)
    p.show()
    p.set_images_allowed(allowed)
    return p


def drop(p: ChatPanel, mime: QMimeData) -> bool:
    """A drag over the chat and its drop, through the panel's Qt handlers (offscreen Qt has no drag manager to
    deliver a synthetic drop); True if the panel accepted both."""
    args = (QPointF(50, 50), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    enter = QDragEnterEvent(QPoint(50, 50), *args[1:])
    p.dragEnterEvent(enter)
    event = QDropEvent(*args)
    p.dropEvent(event)
    return enter.isAccepted() and event.isAccepted()


def test_attach_a_jpeg_keeps_it_as_png_with_a_thumbnail_and_x_takes_it_out(qtbot: QtBot, tmp_path: Path) -> None:
    p = panel(qtbot, allowed=True)
    assert p.attach_button.isVisible()
    photo = tmp_path / "holiday.jpg"
    assert picture(640, 480).save(str(photo))
    p.attach_files([photo, tmp_path / "missing.png"])
    assert [x.label for x in p.attachments.pictures] == ["holiday.jpg"]
    kept = QImage.fromData(p.attachments.pictures[0].png)
    assert p.attachments.pictures[0].png.startswith(PNG_MAGIC) and (kept.width(), kept.height()) == (640, 480)
    assert "missing.png is not a picture the chat can read" in p.status.text()  # the other one, said
    assert p.picture_strip.isVisible() and len(p.picture_strip.thumbs) == 1
    thumb = p.picture_strip.thumbs[0].pixmap()
    assert max(thumb.width(), thumb.height()) == THUMB
    remove = p.picture_strip.thumbs[0].findChild(QToolButton)
    assert remove is not None
    qtbot.mouseClick(remove, Qt.MouseButton.LeftButton)
    assert len(p.attachments) == 0 and not p.picture_strip.isVisible()


def test_paste_a_bitmap_and_send_it_without_words(qtbot: QtBot) -> None:
    p = panel(qtbot, allowed=True)
    mime = QMimeData()
    mime.setImageData(picture(3000, 1500))  # a big screenshot: scaled down to MAX_SIDE
    QApplication.clipboard().setMimeData(mime)
    p.input.paste()
    assert [x.label for x in p.attachments.pictures] == ["The pasted picture"]
    kept = QImage.fromData(p.attachments.pictures[0].png)
    assert (kept.width(), kept.height()) == (MAX_SIDE, MAX_SIDE // 2)
    assert p.input.toPlainText() == ""  # the picture, not its text, went in
    with qtbot.waitSignal(p.send_requested) as sent:
        p.send_button.click()  # a picture alone is a message
    assert sent.args == [""]
    assert [x.label for x in p.take_pictures()] == ["The pasted picture"] and not p.picture_strip.isVisible()


def test_drop_files_on_the_chat_each_picture_once(qtbot: QtBot, tmp_path: Path) -> None:
    p = panel(qtbot, allowed=True)
    a, b, notes = tmp_path / "a.png", tmp_path / "b.bmp", tmp_path / "notes.txt"
    assert picture(64, 48, "#ff0000").save(str(a)) and picture(64, 48, "#00ff00").save(str(b))
    notes.write_text("not a picture")
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(f)) for f in (a, b, notes, a)])
    assert drop(p, mime)
    assert [x.label for x in p.attachments.pictures] == ["a.png", "b.bmp"]  # a twice: once
    assert "notes.txt is not a picture" in p.status.text()
    assert len(p.picture_strip.thumbs) == 2


def test_nothing_is_offered_for_a_model_that_reads_no_pictures(qtbot: QtBot, tmp_path: Path) -> None:
    p = panel(qtbot, allowed=True)
    a = tmp_path / "a.png"
    assert picture(32, 32).save(str(a))
    p.attach_files([a])
    p.set_images_allowed(False)  # the model changed to a text model: the waiting picture goes
    assert not p.attach_button.isVisible() and len(p.attachments) == 0 and not p.picture_strip.isVisible()
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(a))])
    assert not drop(p, mime) and len(p.attachments) == 0
    bitmap = QMimeData()
    bitmap.setImageData(picture(32, 32))
    bitmap.setText("words")
    QApplication.clipboard().setMimeData(bitmap)
    p.input.paste()
    assert len(p.attachments) == 0 and p.input.toPlainText() == "words"  # the text paste, as before


def test_a_sent_message_shows_its_pictures_above_its_words(qtbot: QtBot) -> None:
    t = Transcript()
    qtbot.addWidget(t)
    png = picture_from_image(picture(800, 200), "wide.png").png
    t.add_message("user", "What colour is this?", images=[png, png])
    t.add_message("assistant", "Blue.")
    assert t.pictures == {0: 2}
    text = t.toPlainText()
    assert text.count("\ufffc") == 2 and text.index("\ufffc") < text.index("What colour is this?")  # pictures first
    shown = [t.document().resource(1, QUrl(f"picture:{n}")) for n in (1, 2)]  # (1: an image resource)
    assert all(isinstance(r, QImage) and (r.width(), r.height()) == (MESSAGE_THUMB, 45) for r in shown)
