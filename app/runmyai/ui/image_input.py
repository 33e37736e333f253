"""Pictures into the chat's composer, thin Qt: what Qt reads (a file, a pasted bitmap, a drop) turned into PNG
bytes for chat/images.py, and the thumbnails the composer and the transcript show."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QMimeData, Qt, Signal
from PySide6.QtGui import QImage, QImageReader, QPixmap
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QVBoxLayout, QWidget

from runmyai.chat.images import ImageError, Picture, checked

# A picture's longest side is scaled down to this before it is kept and sent: the vision encoders work at a few
# megapixels at most (Qwen3-VL: 4,096 merged 32-px patches, about 2048 x 2048) and resize anything larger
# themselves, so the pixels past it would only cost the store and the request.
MAX_SIDE = 2048
THUMB = 72  # the composer's thumbnails (px, the longest side)
MESSAGE_THUMB = 180  # a sent message's pictures in the transcript


def file_filter() -> str:
    """The file dialog's filter: the formats this Qt reads."""
    kinds = sorted({bytes(f.data()).decode() for f in QImageReader.supportedImageFormats()} - {"svg", "svgz"})
    return f"Images ({' '.join('*.' + k for k in kinds)})"


def picture_from_image(image: QImage, label: str) -> Picture:
    """A QImage as the chat keeps it: RGB(A) PNG, its longest side MAX_SIDE at most. ImageError when empty."""
    if image.isNull():
        raise ImageError(f"{label} is not a picture the chat can read.")
    if max(image.width(), image.height()) > MAX_SIDE:
        image = image.scaled(
            MAX_SIDE, MAX_SIDE, Qt.AspectRatioMode.KeepAspectRatio, Qt.TransformationMode.SmoothTransformation
        )
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")  # type: ignore[call-overload]  # (the stubs say bytes; PySide takes str)
    buffer.close()
    return checked(bytes(data.data()), label)


def picture_from_file(path: Path) -> Picture:
    """A picture file (any format Qt reads) as PNG; ImageError with one sentence otherwise."""
    reader = QImageReader(str(path))
    reader.setAutoTransform(True)  # a phone photo's EXIF orientation, as it is shown everywhere else
    image = reader.read()
    if image.isNull():
        raise ImageError(f"{path.name} is not a picture the chat can read ({reader.errorString()}).")
    return picture_from_image(image, path.name)


def mime_has_pictures(mime: QMimeData) -> bool:
    """A clipboard or a drag that carries a picture, or local files (what they are is found out on dropping)."""
    return mime.hasImage() or any(u.isLocalFile() for u in mime.urls())


def pictures_from_mime(mime: QMimeData) -> tuple[list[Picture], list[str]]:
    """A paste or a drop's pictures, and a sentence for each thing in it that is not one."""
    pictures: list[Picture] = []
    problems: list[str] = []
    files = [Path(u.toLocalFile()) for u in mime.urls() if u.isLocalFile()]
    if files:
        for f in files:
            try:
                pictures.append(picture_from_file(f))
            except ImageError as e:
                problems.append(str(e))
    elif mime.hasImage():
        try:
            pictures.append(picture_from_image(QImage(mime.imageData()), "The pasted picture"))
        except ImageError as e:
            problems.append(str(e))
    return pictures, problems


def thumbnail(png: bytes, side: int) -> QImage:
    """A picture scaled to fit `side` (never up)."""
    image = QImage.fromData(png)
    if max(image.width(), image.height()) > side:
        image = image.scaled(side, side, Qt.AspectRatioMode.KeepAspectRatio, Qt.TransformationMode.SmoothTransformation)
    return image


class PictureStrip(QWidget):
    """The composer's pictures waiting to be sent: a thumbnail each, with × to take it out."""

    removed = Signal(int)  # the picture's index

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("pictureStrip")
        self._row = QHBoxLayout(self)
        self._row.setContentsMargins(0, 0, 0, 0)
        self._row.setSpacing(6)
        self._row.addStretch(1)
        self.thumbs: list[QLabel] = []
        self.setVisible(False)

    def show_pictures(self, pictures: list[Picture]) -> None:
        while self._row.count() > 1:  # (the stretch at the end stays)
            item = self._row.takeAt(0)
            widget = item.widget() if item is not None else None
            if widget is not None:
                widget.deleteLater()
        self.thumbs = []
        for i, p in enumerate(pictures):
            cell = QFrame()
            cell.setObjectName("pictureCell")
            box = QVBoxLayout(cell)
            box.setContentsMargins(2, 2, 2, 2)
            box.setSpacing(0)
            label = QLabel()
            label.setPixmap(QPixmap.fromImage(thumbnail(p.png, THUMB)))
            label.setFixedSize(THUMB, THUMB)
            label.setAlignment(Qt.AlignmentFlag.AlignCenter)
            label.setToolTip(p.label)
            remove = QToolButton(label)
            remove.setText("×")
            remove.setToolTip(f"Take {p.label} out of the message")
            remove.setAutoRaise(True)
            remove.adjustSize()
            remove.move(THUMB - remove.width(), 0)  # (the thumbnail's top right corner, inside it)
            remove.clicked.connect(lambda _=False, n=i: self.removed.emit(n))
            box.addWidget(label)
            self._row.insertWidget(i, cell)
            self.thumbs.append(label)
        self.setVisible(bool(pictures))
