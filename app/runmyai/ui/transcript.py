"""The chat transcript: rendered markdown, streamed replies appended without re-rendering per token, a thinking
model's reasoning folded above its reply."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from PySide6.QtCore import QUrl, Signal
from PySide6.QtGui import (
    QColor,
    QGuiApplication,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextDocumentFragment,
    QTextFrame,
    QTextFrameFormat,
    QTextImageFormat,
)
from PySide6.QtWidgets import QTextBrowser, QWidget

from runmyai.chat.markdown_stream import code_blocks, hard_breaks, safe_commit_point
from runmyai.ui.image_input import MESSAGE_THUMB, thumbnail
from runmyai.ui.markdown_view import tidy_tables

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System"}
MUTED = "#777777"
MARKDOWN_MARGIN = 6.0  # Qt's markdown paragraphs' top and bottom margins (px)
TITLE_MARGIN = 14.0  # above a message's title ("You", "Assistant"): the space between two messages
FAILED = "#c0392b"  # a failed reply's marker: readable on the light and the dark theme


def failure_line(sentence: str) -> str:
    """The marker of a failed reply, with its reason: "⚠ The reply failed: …"."""
    return f"⚠ The reply failed: {sentence.strip() or 'no reason was given.'}"


@dataclass
class _Thought:
    """A reply's reasoning: a frame of the document (Qt keeps its place as text around it changes)."""

    index: int  # the message's
    text: str
    frame: QTextFrame
    live: bool = False  # still arriving, shown as it comes
    expanded: bool = False


@dataclass
class _ToolEntry:
    """A tool call in a reply, collapsed to one line (its arguments and result under it when unfolded)."""

    frame: QTextFrame
    title: str
    status: str
    detail: str
    expanded: bool = False


@dataclass(frozen=True)
class ToolMark:
    """A saved tool call to draw in a message: after the first `at` characters of its text."""

    at: int
    key: str
    title: str
    status: str
    detail: str


def tool_label(entry: _ToolEntry) -> str:
    return f"{'▾' if entry.expanded else '▸'} Tool {entry.title} — {entry.status}"


def thought_label(text: str, expanded: bool) -> str:
    """The folded reasoning's one line."""
    n = len(text.split())
    return f"{'▾' if expanded else '▸'} Thought for {n} word{'' if n == 1 else 's'} — {'hide' if expanded else 'show'}"


def new_block(cursor: QTextCursor, block: QTextBlockFormat | None = None, chars: QTextCharFormat | None = None) -> None:
    """A block after the cursor's, never an item of the list the block before ended in: a reply ending in a
    markdown list had its footer, and every message after it, drawn as that list's items (bullets, indented; the
    new-user walk, after a reply ending in a list). Qt's insertBlock keeps the previous block's list."""
    if block is None:
        cursor.insertBlock()
    else:
        cursor.insertBlock(block, chars if chars is not None else QTextCharFormat())
    in_list = cursor.currentList()
    if in_list is not None:
        in_list.remove(cursor.block())
        plain = cursor.blockFormat()
        plain.setIndent(0)
        cursor.setBlockFormat(plain)


def markdown_fragment(text: str) -> QTextDocumentFragment:
    doc = QTextDocument()
    doc.setMarkdown(hard_breaks(text), QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
    tidy_tables(doc)  # a reply's table: its header aligned with its columns, as in the model card
    return QTextDocumentFragment(doc)


class Transcript(QTextBrowser):
    """Shows one conversation. Messages are appended; the last one may be streaming.

    While a reply streams, everything up to its last complete markdown block is rendered once, and only the
    tail is plain text, so a long reply costs the size of its tail per token. Its reasoning, if any, shows live
    (muted) until the reply's text starts, then folds into one line whose link shows or hides it.
    """

    copy_requested = Signal(str)
    edit_requested = Signal(int)  # a message's Edit: its id
    branch_requested = Signal(int, int)  # a message's "<" (-1) or ">" (+1): its id, the step

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._on_anchor)
        self._messages: list[str] = []  # text per message index, for the copy links
        self._stream_text = ""
        self._stream_committed = 0  # chars of the streaming reply already rendered as markdown
        self._stream_tail_start = -1  # document position where the plain tail begins
        self._stream_body_start = -1  # document position where the streaming reply's body begins
        self._thoughts: dict[int, _Thought] = {}  # message index → its reasoning
        self._tools: dict[str, _ToolEntry] = {}  # a tool call's key → its line
        self._stream_prefix = ""  # the streaming reply's text before its last tool call
        self.renders = 0  # markdown renders (tests check they stay per block, not per token)
        self.branches: dict[int, tuple[int, int]] = {}  # a shown message's id → its "< n/of >", where it has one
        self.pictures: dict[int, int] = {}  # a shown message's index → how many pictures it shows
        self._picture_names = 0  # (each picture is the document's resource under a name of its own)

    # -- whole messages ------------------------------------------------------------------------------
    def clear_messages(self) -> None:
        self.clear()
        self._messages = []
        self.branches = {}
        self.pictures = {}
        self._thoughts = {}
        self._tools = {}
        self._stream_tail_start = -1

    def add_message(
        self,
        role: str,
        text: str,
        footer: str = "",
        reasoning: str = "",
        tools: Sequence[ToolMark] = (),
        *,
        failure: str = "",
        notice: str = "",
        message_id: int | None = None,
        branch: tuple[int, int] | None = None,
        images: Sequence[bytes] = (),
    ) -> None:
        """A whole message (with `message_id`, its footer has Edit; with `branch` (n, of: it is one of several
        versions), the "< n/of >" that shows the others); `tools`: its saved tool calls, each collapsed in its
        place in the text (as they showed while the reply streamed); `failure`: a failed reply's marker line;
        `notice`: a line about the context (what the model no longer sees) under it; `images`: its pictures (PNG),
        as thumbnails above its text."""
        index = len(self._messages)
        self._messages.append(text)
        cursor = self._end_cursor()
        self._insert_header(cursor, role)
        if images:
            self._insert_pictures(cursor, index, images)
        if reasoning:
            self._insert_thought(_Thought(index, reasoning, self._new_frame(cursor)))
            cursor = self._end_cursor()
        start = 0
        for mark in tools:
            if text[start : mark.at].strip():
                cursor.insertFragment(markdown_fragment(text[start : mark.at]))
                self.renders += 1
            new_block(cursor)  # as add_tool_call does while the reply streams
            start = max(start, mark.at)
            entry = _ToolEntry(self._new_frame(cursor), mark.title, mark.status, mark.detail)
            self._tools[mark.key] = entry
            self._fill_tool(mark.key, entry)
            cursor = self._end_cursor()
        rest = text[start:]
        if rest.strip() or not (tools or failure):
            cursor.insertFragment(markdown_fragment(rest) if role == "assistant" else self._plain_fragment(rest))
            self.renders += 1
        self._insert_lines(cursor, failure, notice, bool(rest.strip() or tools))
        self._insert_footer(cursor, index, text, footer, message_id, branch)

    # -- streaming -----------------------------------------------------------------------------------
    def begin_reply(self) -> None:
        self._messages.append("")
        cursor = self._end_cursor()
        self._insert_header(cursor, "assistant")
        self._stream_text = ""
        self._stream_prefix = ""
        self._stream_committed = 0
        self._stream_tail_start = self._stream_body_start = cursor.position()

    def _render_stream_tail(self) -> QTextCursor:
        """The streamed reply's live tail replaced by its final markdown; the cursor after it."""
        self._fold_live_thought()
        cursor = self._end_cursor()
        cursor.setPosition(self._stream_tail_start, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        tail = self._stream_text[self._stream_committed :]
        if tail.strip():
            cursor.insertFragment(markdown_fragment(tail))
            self.renders += 1
        return cursor

    def add_tool_call(self, key: str, title: str, status: str, detail: str) -> None:
        """A tool call in the streaming reply: the text so far is rendered, the call's line goes below it, and the
        reply's text goes on after it."""
        if self._stream_tail_start < 0:
            return
        cursor = self._render_stream_tail()
        new_block(cursor)
        entry = _ToolEntry(self._new_frame(cursor), title, status, detail)
        self._tools[key] = entry
        self._fill_tool(key, entry)
        self._stream_prefix += self._stream_text
        self._stream_text = ""
        self._stream_committed = 0
        cursor = self._end_cursor()
        self._stream_tail_start = self._stream_body_start = cursor.position()
        self._follow()

    def update_tool_call(self, key: str, status: str, detail: str | None = None) -> None:
        entry = self._tools.get(key)
        if entry is None:
            return
        entry.status = status
        if detail is not None:
            entry.detail = detail
        self._edit_frame(entry.frame, lambda: self._fill_tool(key, entry))

    def tool_call_text(self, key: str) -> str:
        """The call's line as shown (and its detail when unfolded)."""
        entry = self._tools[key]
        cursor = entry.frame.firstCursorPosition()
        cursor.setPosition(entry.frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        return cursor.selectedText().replace("\u2029", "\n")

    def toggle_tool_call(self, key: str) -> None:
        entry = self._tools.get(key)
        if entry is not None:
            entry.expanded = not entry.expanded
            self._edit_frame(entry.frame, lambda: self._fill_tool(key, entry))

    def _fill_tool(self, key: str, entry: _ToolEntry) -> None:
        cursor = entry.frame.firstCursorPosition()
        cursor.setPosition(entry.frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        link = _muted()
        link.setAnchor(True)
        link.setAnchorHref(f"tool:{key}")
        cursor.insertText(tool_label(entry), link)
        if entry.expanded:
            new_block(cursor)
            cursor.insertText(entry.detail, _muted())

    def _edit_frame(self, frame: QTextFrame, edit: Callable[[], None]) -> None:
        """Changes a frame's content; the streaming reply's positions after it move with the text."""
        at = frame.firstPosition()
        before = self.document().characterCount()
        edit()
        shift = self.document().characterCount() - before
        if self._stream_tail_start > at:
            self._stream_tail_start += shift
        if self._stream_body_start > at:
            self._stream_body_start += shift

    def append_reasoning(self, delta: str) -> None:
        """More of the streaming reply's reasoning: shown as it comes while the reply's text has not started,
        else added to the folded block (some servers send reasoning between pieces of text)."""
        if self._stream_tail_start < 0 or not delta:
            return
        index = len(self._messages) - 1
        thought = self._thoughts.get(index)
        if thought is None:
            cursor = self._end_cursor()
            cursor.setPosition(self._stream_body_start)
            before = self.document().characterCount()
            self._insert_thought(_Thought(index, delta, self._new_frame(cursor), live=not self._stream_text))
            self._stream_tail_start += self.document().characterCount() - before
        elif thought.live:
            thought.text += delta
            self._edit_thought(thought, lambda t: t.frame.lastCursorPosition().insertText(delta, _muted()))
        else:
            thought.text += delta
            self._edit_thought(thought, self._fill_thought)
        self._follow()

    def append_reply(self, delta: str) -> None:
        if self._stream_tail_start < 0 or not delta:
            return
        self._fold_live_thought()
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
            new_block(cursor)
            self._stream_tail_start = cursor.position()
            cursor.insertText(self._stream_text[commit:], QTextCharFormat())
        else:
            cursor.insertText(delta, QTextCharFormat())  # plain: not the bold of the "Assistant" line above it
        self._follow()

    def end_reply(
        self,
        footer: str = "",
        *,
        failure: str = "",
        notice: str = "",
        message_id: int | None = None,
        branch: tuple[int, int] | None = None,
    ) -> str:
        """Render the rest of the reply and add its footer (Edit and "< n/of >" as `add_message` has them; and,
        for a failed reply, its marker line with the reason; `notice`: the context line); returns the reply's text."""
        text = self._stream_prefix + self._stream_text
        if self._stream_tail_start < 0:
            return text
        cursor = self._render_stream_tail()
        self._messages[-1] = text
        self._insert_lines(cursor, failure, notice, bool(text.strip() or self._tools))
        self._insert_footer(cursor, len(self._messages) - 1, text, footer, message_id, branch)
        self._stream_tail_start = -1
        self._follow()
        return text

    @property
    def streaming(self) -> bool:
        return self._stream_tail_start >= 0

    def message_text(self, index: int) -> str:
        return self._messages[index]

    def reasoning_shown(self, index: int) -> bool | None:
        """Whether message `index`'s reasoning is unfolded (live counts as shown); None when it has none."""
        t = self._thoughts.get(index)
        return None if t is None else t.live or t.expanded

    def toggle_reasoning(self, index: int) -> None:
        """Shows or hides a message's folded reasoning (its "show"/"hide" link)."""
        t = self._thoughts.get(index)
        if t is None or t.live:
            return
        t.expanded = not t.expanded
        self._edit_thought(t, self._fill_thought)

    # -- reasoning -----------------------------------------------------------------------------------
    @staticmethod
    def _new_frame(cursor: QTextCursor) -> QTextFrame:
        """A frame for reasoning where `cursor` is, at the start of a block, laid out as the blocks around it."""
        blocks = cursor.blockFormat()
        fmt = QTextFrameFormat()
        fmt.setBorder(0)
        fmt.setTopMargin(2)
        fmt.setBottomMargin(6)
        frame = cursor.insertFrame(fmt)
        # the split leaves an empty block above the frame (a blank line): merge it into the header's
        above = QTextCursor(frame.document())
        above.setPosition(frame.firstPosition() - 1)
        if above.block().length() == 1 and above.block().previous().isValid():
            above.deletePreviousChar()
        # the block after a frame starts with a default format; the transcript's spacing is inherited from it
        below = QTextCursor(frame.document())
        below.setPosition(frame.lastPosition() + 1)
        below.setBlockFormat(blocks)
        return frame

    def _insert_thought(self, thought: _Thought) -> None:
        self._thoughts[thought.index] = thought
        self._fill_thought(thought)

    def _fill_thought(self, thought: _Thought) -> None:
        """Writes a reasoning frame's content: live text, or the fold line (and the text when unfolded)."""
        cursor = thought.frame.firstCursorPosition()
        cursor.setPosition(thought.frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        if thought.live:
            italic = _muted()
            italic.setFontItalic(True)
            cursor.insertText("Thinking…", italic)
            new_block(cursor)
            cursor.insertText(thought.text, _muted())
            return
        link = _muted()
        link.setAnchor(True)
        link.setAnchorHref(f"think:{thought.index}")
        cursor.insertText(thought_label(thought.text, thought.expanded), link)
        if thought.expanded:
            new_block(cursor)
            cursor.insertText(thought.text, _muted())

    def _edit_thought(self, thought: _Thought, edit: Callable[[_Thought], None]) -> None:
        """Changes a reasoning frame; the streaming reply's positions after it move with the text."""
        at = thought.frame.firstPosition()
        before = self.document().characterCount()
        edit(thought)
        shift = self.document().characterCount() - before
        if self._stream_tail_start > at:
            self._stream_tail_start += shift
        if self._stream_body_start > at:
            self._stream_body_start += shift

    def _fold_live_thought(self) -> None:
        index = len(self._messages) - 1
        thought = self._thoughts.get(index)
        if thought is not None and thought.live:
            thought.live = False
            self._edit_thought(thought, self._fill_thought)

    # -- helpers -------------------------------------------------------------------------------------
    def _end_cursor(self) -> QTextCursor:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    def _insert_pictures(self, cursor: QTextCursor, index: int, images: Sequence[bytes]) -> None:
        """A message's pictures on one line (wrapped where they do not fit), then its text below them."""
        for png in images:
            self._picture_names += 1
            name = f"picture:{self._picture_names}"
            self.document().addResource(
                QTextDocument.ResourceType.ImageResource, QUrl(name), thumbnail(png, MESSAGE_THUMB)
            )
            picture = QTextImageFormat()
            picture.setName(name)
            cursor.insertImage(picture)
            cursor.insertText(" ")
        self.pictures[index] = len(images)
        new_block(cursor)

    def _insert_header(self, cursor: QTextCursor, role: str) -> None:
        if not self.document().isEmpty():
            new_block(cursor)
        title = ROLE_TITLES.get(role, role)
        cursor.insertHtml(f"<p style='margin-top:12px'><b>{html.escape(title)}</b></p>")
        title_block = cursor.blockFormat()  # (the HTML's margin is lost where it merges into the block before)
        title_block.setTopMargin(TITLE_MARGIN)
        title_block.setBottomMargin(MARKDOWN_MARGIN)
        cursor.setBlockFormat(title_block)
        # the message's block starts plain: it inherited the title's bold (a user's message and a streaming reply's
        # tail were bold, and the tail turned plain when the reply ended); with a markdown paragraph's margins, not
        # the title's (a reply's first line is merged into this block: it stood apart from the lines after it)
        body = cursor.blockFormat()
        body.setTopMargin(MARKDOWN_MARGIN)
        body.setBottomMargin(MARKDOWN_MARGIN)
        new_block(cursor, body, QTextCharFormat())

    def _insert_lines(self, cursor: QTextCursor, failure: str, notice: str, after_text: bool) -> None:
        """A failed reply's marker (red) and the context notice (muted, italic), each its own line."""
        for line, colour, italic in ((failure, FAILED, False), (notice, MUTED, True)):
            if not line:
                continue
            if after_text:
                new_block(cursor, cursor.blockFormat(), QTextCharFormat())
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(colour))
            fmt.setFontItalic(italic)
            cursor.insertText(line, fmt)
            after_text = True

    @staticmethod
    def _plain_fragment(text: str) -> QTextDocumentFragment:
        return QTextDocumentFragment.fromPlainText(text)

    def _insert_footer(
        self,
        cursor: QTextCursor,
        index: int,
        text: str,
        footer: str,
        message_id: int | None = None,
        branch: tuple[int, int] | None = None,
    ) -> None:
        links = [branch_links(message_id, *branch)] if message_id is not None and branch is not None else []
        links.append(f"<a href='copy:{index}'>Copy</a>")
        if message_id is not None:
            links.append(f"<a href='edit:{message_id}'>Edit</a>")
            if branch is not None:
                self.branches[message_id] = branch
        links += [f"<a href='copycode:{index}:{n}'>Copy code {n + 1}</a>" for n in range(len(code_blocks(text)))]
        info = f"<span style='color:#777'>{html.escape(footer)}</span> &nbsp; " if footer else ""
        new_block(cursor)
        cursor.insertHtml(f"<p style='font-size:small'>{info}{' &nbsp; '.join(links)}</p>")

    def _follow(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _on_anchor(self, url: QUrl) -> None:
        target = url.toString()
        kind, _, rest = target.partition(":")
        try:
            if kind == "think":
                self.toggle_reasoning(int(rest))
                return
            if kind == "tool":
                self.toggle_tool_call(rest)
                return
            if kind == "edit":
                self.edit_requested.emit(int(rest))
                return
            if kind == "branch":
                mid, _, step = rest.partition(":")
                self.branch_requested.emit(int(mid), int(step))
                return
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


def branch_links(message_id: int, n: int, of: int) -> str:
    """The "< 2/3 >" of a message that has other versions: each arrow a link to the one before or after (none past
    the ends), bold and with a space each side inside the link, so that it is seen and hit (a bare "‹" in the
    footer's small type was a dot)."""
    prev = f"<a href='branch:{message_id}:-1'><b>&nbsp;&lt;&nbsp;</b></a>" if n > 1 else "<b>&nbsp;&lt;&nbsp;</b>"
    after = f"<a href='branch:{message_id}:1'><b>&nbsp;&gt;&nbsp;</b></a>" if n < of else "<b>&nbsp;&gt;&nbsp;</b>"
    return f"{prev}{n}/{of}{after}"


def _muted() -> QTextCharFormat:
    fmt = QTextCharFormat()
    fmt.setForeground(QColor(MUTED))
    return fmt
