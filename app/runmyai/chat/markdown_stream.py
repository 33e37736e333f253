"""Where a streamed reply can be rendered as markdown without re-rendering it per token.

A reply is shown as rendered markdown up to the last paragraph break that lies outside a code fence, and as
plain text after it. Each token then costs the size of the tail, not of the whole reply.
"""

from __future__ import annotations

import re

_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)
_CODE_BLOCK = re.compile(r"^ {0,3}(```|~~~)[^\n]*\n(.*?)^ {0,3}\1[ \t]*$", re.MULTILINE | re.DOTALL)


def safe_commit_point(text: str, start: int = 0) -> int:
    """The largest index ≥ start after a blank line outside any code fence (start if none).

    Everything before it is a run of complete markdown blocks: rendering it alone gives what rendering
    the whole reply would give for those blocks.
    """
    best = start
    open_fence: str | None = None
    pos = 0
    for line in text.splitlines(keepends=True):
        end = pos + len(line)
        stripped = line.lstrip(" ")
        marker = stripped[:3]
        if marker in ("```", "~~~") and len(line) - len(stripped) <= 3:
            if open_fence is None:
                open_fence = marker
            elif marker == open_fence:
                open_fence = None
                if end > best and line.endswith("\n"):
                    best = end  # a closed fence ends a block
        elif open_fence is None and line.strip() == "" and line.endswith("\n") and end > best and pos > 0:
            best = end
        pos = end
    return best


def code_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks of a finished reply, in order (for copy buttons)."""
    return [m.group(2) for m in _CODE_BLOCK.finditer(text)]


def has_open_fence(text: str) -> bool:
    return len(_FENCE.findall(text)) % 2 == 1
