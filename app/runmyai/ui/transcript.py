"""The chat transcript: rendered markdown, streamed replies appended without re-rendering per token."""

from __future__ import annotations

import html

from PySide6.QtCore import QUrl, Signal
from PySide6.QtGui import QGuiApplication, QTextCursor, QTextDocument, QTextDocumentFragment
from PySide6.QtWidgets import QTextBrowser, QWidget

from runmyai.chat.markdown_stream import code_blocks, safe_commit_point

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System"}


def markdown_fragment(text: str) -> QTextDocumentFragment:
    doc = QTextDocument()
    doc.setMarkdown(text, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
    return QTextDocumentFragment(doc)


class Transcript(QTextBrowser):
    """Shows one conversation. Messages are appended; the last one may be streaming.

    While a reply streams, everything up to its last complete markdown block is rendered once, and only the
    tail is plain text, so a long reply costs the size of its tail per token.
    """

    copy_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._on_anchor)
        self._messages: list[str] = []  # text per message index, for the copy links
        self._stream_text = ""
        self._stream_committed = 0  # chars of the streaming reply already rendered as markdown
        self._stream_tail_start = -1  # document position where the plain tail begins
        self.renders = 0  # markdown renders (tests check they stay per block, not per token)

    # -- whole messages ------------------------------------------------------------------------------
    def clear_messages(self) -> None:
        self.clear()
        self._messages = []
        self._stream_tail_start = -1

    def add_message(self, role: str, text: str, footer: str = "") -> None:
        index = len(self._messages)
        self._messages.append(text)
        cursor = self._end_cursor()
        self._insert_header(cursor, role)
        cursor.insertFragment(markdown_fragment(text) if role == "assistant" else self._plain_fragment(text))
        self.renders += 1
        self._insert_footer(cursor, index, text, footer)

    # -- streaming -----------------------------------------------------------------------------------
    def begin_reply(self) -> None:
        self._messages.append("")
        cursor = self._end_cursor()
        self._insert_header(cursor, "assistant")
        self._stream_text = ""
        self._stream_committed = 0
        self._stream_tail_start = cursor.position()

    def append_reply(self, delta: str) -> None:
        if self._stream_tail_start < 0 or not delta:
            return
        self._stream_text += delta
        commit = safe_commit_point(self._stream_text, self._stream_committed)
        cursor = self._end_cursor()
        if commit > self._stream_committed:
            # replace the plain tail by the newly complete blocks (rendered) and the new plain tail
            cursor.setPosition(self._stream_tail_start, QTextCursor.MoveMode.KeepAnchor)
            cursor.removeSelectedText()
            cursor.insertFragment(markdown_fragment(self._stream_text[self._stream_committed : commit]))
            self.renders += 1
            self._stream_committed = commit
            cursor.insertBlock()
            self._stream_tail_start = cursor.position()
            cursor.insertText(self._stream_text[commit:])
        else:
            cursor.insertText(delta)
        self._follow()

    def end_reply(self, footer: str = "") -> str:
        """Render the rest of the reply and add its footer; returns the reply's text."""
        text = self._stream_text
        if self._stream_tail_start < 0:
            return text
        cursor = self._end_cursor()
        cursor.setPosition(self._stream_tail_start, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        tail = text[self._stream_committed :]
        if tail.strip():
            cursor.insertFragment(markdown_fragment(tail))
            self.renders += 1
        self._messages[-1] = text
        self._insert_footer(cursor, len(self._messages) - 1, text, footer)
        self._stream_tail_start = -1
        self._follow()
        return text

    @property
    def streaming(self) -> bool:
        return self._stream_tail_start >= 0

    def message_text(self, index: int) -> str:
        return self._messages[index]

    # -- helpers -------------------------------------------------------------------------------------
    def _end_cursor(self) -> QTextCursor:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    def _insert_header(self, cursor: QTextCursor, role: str) -> None:
        if not self.document().isEmpty():
            cursor.insertBlock()
        title = ROLE_TITLES.get(role, role)
        cursor.insertHtml(f"<p style='margin-top:12px'><b>{html.escape(title)}</b></p>")
        cursor.insertBlock()

    @staticmethod
    def _plain_fragment(text: str) -> QTextDocumentFragment:
        return QTextDocumentFragment.fromPlainText(text)

    def _insert_footer(self, cursor: QTextCursor, index: int, text: str, footer: str) -> None:
        links = [f"<a href='copy:{index}'>Copy</a>"]
        links += [f"<a href='copycode:{index}:{n}'>Copy code {n + 1}</a>" for n in range(len(code_blocks(text)))]
        info = f"<span style='color:#777'>{html.escape(footer)}</span> &nbsp; " if footer else ""
        cursor.insertBlock()
        cursor.insertHtml(f"<p style='font-size:small'>{info}{' &nbsp; '.join(links)}</p>")

    def _follow(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _on_anchor(self, url: QUrl) -> None:
        target = url.toString()
        kind, _, rest = target.partition(":")
        try:
            if kind == "copy":
                text = self._messages[int(rest)]
            elif kind == "copycode":
                index, _, n = rest.partition(":")
                text = code_blocks(self._messages[int(index)])[int(n)]
            else:
                return
        except (ValueError, IndexError):
            return
        QGuiApplication.clipboard().setText(text)
        self.copy_requested.emit(text)
