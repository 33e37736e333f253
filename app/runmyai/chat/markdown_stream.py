"""Where a streamed reply can be rendered as markdown without re-rendering it per token.

A reply is shown as rendered markdown up to the last paragraph break that lies outside a code fence, and as
plain text after it. Each token then costs the size of the tail, not of the whole reply.

Fences follow CommonMark: a run of 3+ backticks or tildes indented at most 3 spaces opens one; only a run of the
same character, at least as long and with nothing but spaces after it, closes it (so "```py" inside a ``` block
is code, not its end).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)")


def _fence(line: str) -> tuple[str, str] | None:
    """(the run of fence characters, what follows it) for a fence line, else None."""
    m = _FENCE.fullmatch(line.rstrip("\r\n"))
    if m is None or (m.group(1)[0] == "`" and "`" in m.group(2)):  # backticks after ``` make inline code
        return None
    return m.group(1), m.group(2)


def _lines(text: str) -> Iterator[tuple[int, str, str | None, bool]]:
    """(end offset, line, the fence open after this line or None, whether this line closed a fence)."""
    open_run: str | None = None
    pos = 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        fence = _fence(line)
        closed = False
        if open_run is None and fence is not None:
            open_run = fence[0]
        elif open_run is not None and fence is not None:
            run, rest = fence
            if run[0] == open_run[0] and len(run) >= len(open_run) and not rest.strip():
                open_run, closed = None, True
        yield pos, line, open_run, closed


def safe_commit_point(text: str, start: int = 0) -> int:
    """The largest index ≥ start after a blank line outside any code fence (start if none).

    Everything before it is a run of complete markdown blocks: rendering it alone gives what rendering
    the whole reply would give for those blocks.
    """
    best = start
    prev_end = 0
    for end, line, open_run, closed in _lines(text):
        complete = line.endswith("\n") and end > best
        if complete and (closed or (open_run is None and line.strip() == "" and prev_end > 0)):
            best = end  # a closed fence, or a blank line after something, ends a block
        prev_end = end
    return best


def code_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks of a finished reply, in order (for copy buttons)."""
    blocks: list[str] = []
    current: list[str] | None = None
    for _, line, open_run, closed in _lines(text):
        if closed and current is not None:
            blocks.append("".join(current))
            current = None
        elif open_run is not None:
            if current is None:
                current = []  # the opening line itself
            else:
                current.append(line)
    return blocks


def has_open_fence(text: str) -> bool:
    states = [open_run for _, _, open_run, _ in _lines(text)]
    return bool(states) and states[-1] is not None


def hard_breaks(text: str) -> str:
    """The reply with each line break kept as one (two trailing spaces: a markdown hard break), outside code fences.

    Markdown joins a paragraph's lines into one; a model's verse, address or list of lines without bullets then
    lost its line breaks the moment the reply was rendered (while it streamed, its plain tail showed them: the
    walk-through saw a verse re-flow when the reply ended). Chat apps keep the writer's lines, as this does.
    """
    out: list[str] = []
    lines = list(_lines(text))
    for i, (_, line, open_run, closed) in enumerate(lines):
        body = line.rstrip("\r\n")
        in_code = open_run is not None or closed
        following = lines[i + 1][1] if i + 1 < len(lines) else ""
        if not in_code and body.strip() and following.strip() and line.endswith("\n") and not body.endswith("  "):
            line = body + "  " + line[len(body) :]
        out.append(line)
    return "".join(out)
