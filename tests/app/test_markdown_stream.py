"""Where a streamed reply may be rendered: only after complete blocks, never inside a code fence."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

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


@given(st.lists(st.sampled_from(["word ", "\n", "\n\n", "```\n", "~~~\n", "  ```py\n", "x"]), max_size=40))
def test_commit_point_never_splits_a_fence(parts: list[str]) -> None:
    text = "".join(parts)
    point = safe_commit_point(text)
    assert 0 <= point <= len(text)
    assert point == 0 or text[point - 1] == "\n"
    assert not has_open_fence(text[:point]) or "~~~" in text[:point]
