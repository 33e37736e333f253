"""Where a streamed reply may be rendered: only after complete blocks, never inside a code fence."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from PySide6.QtGui import QTextDocument, QTextFormat
from PySide6.QtWidgets import QApplication

from runmyai.chat.markdown_stream import code_blocks, has_open_fence, safe_commit_point


def test_paragraph_breaks_are_commit_points() -> None:
    text = "First paragraph.\n\nSecond paragraph\nstill second.\n\nTail being typ"
    point = safe_commit_point(text)
    assert text[:point] == "First paragraph.\n\nSecond paragraph\nstill second.\n\n"


def test_no_commit_inside_an_open_fence() -> None:
    text = "Intro.\n\n```python\nx = 1\n\ny = 2\n"
    assert text[: safe_commit_point(text)] == "Intro.\n\n"
    assert has_open_fence(text)
    closed = text + "```\nafter"
    assert closed[: safe_commit_point(closed)] == "Intro.\n\n```python\nx = 1\n\ny = 2\n```\n"
    assert not has_open_fence(closed)


def test_tilde_fence_is_not_closed_by_backticks() -> None:
    text = "~~~\ncode\n```\n\nstill code\n"
    assert safe_commit_point(text) == 0


def test_start_is_a_floor() -> None:
    assert safe_commit_point("no break yet", 5) == 5


def test_code_blocks() -> None:
    text = "a\n```sh\nls -l\n```\nb\n~~~\nx\n\ny\n~~~\n"
    assert code_blocks(text) == ["ls -l\n", "x\n\ny\n"]


def rendered_blocks(text: str) -> list[tuple[str, bool]]:
    """What Qt's markdown renderer (the transcript's) makes of `text`: each non-empty block, and whether it is code."""
    doc = QTextDocument()
    doc.setMarkdown(text, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
    blocks = []
    block = doc.begin()
    while block.isValid():
        fmt = block.blockFormat()
        if block.text().strip():
            blocks.append(
                (block.text(), fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines())
            )
        block = block.next()
    return blocks


PIECES = ["word ", "x", "`", "\n", "\n\n", "```\n", "````\n", "```py\n", "  ```py\n", "~~~\n", "~~~~ \n", "    ```\n"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40))
def test_commit_point_renders_as_the_whole(qapp: QApplication, parts: list[str]) -> None:
    """The promise, checked against the renderer itself: the committed part rendered alone, then the rest, give
    the blocks of the whole reply (a "```py" line inside a ``` block was taken for its end)."""
    text = "".join(parts)
    point = safe_commit_point(text)
    assert 0 <= point <= len(text) and (point == 0 or text[point - 1] == "\n")
    assert rendered_blocks(text[:point]) + rendered_blocks(text[point:]) == rendered_blocks(text)
    assert not has_open_fence(text[:point])
