"""A chat prompt made to fit the context (`--context-overflow`, the request's `context_overflow`; docs/api.md).

The prompt must leave the reply its room: `max_tokens` where the client set it, else a quarter of the context.
Where the whole conversation does not leave it, whole turns are dropped and the prompt rendered again with the
model's own chat template (a count by the template, not a guess per message): `rolling` drops the oldest turns,
`trim-middle` keeps the first user turn and drops those after it, `stop` refuses. A turn is a user message with
everything up to the next one (its replies, calls and their results), so a tool result always goes with the call
it answers and user and assistant still alternate, as strict templates require. The system message(s), the tool
definitions and the last user message with what follows it (the turn being answered) are never dropped; where
they alone fill the context the request is refused with a sentence naming each and its tokens.

Renders are the cost: one where the conversation fits (as before), else about log2(turns) + 2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenwing.errors import BadInputError
from tokenwing.server.protocol import CONTEXT_LENGTH_EXCEEDED, RequestError

REPLY_SHARE = 4  # without max_tokens, the reply's room is a quarter of the context

# render(messages, with_tools): the prompt text the chat endpoint would run for these messages
Render = Callable[[Sequence[dict[str, Any]], bool], str]
Encode = Callable[[str], list[int]]


@dataclass
class Fitted:
    messages: list[dict[str, Any]]  # those kept, in order
    text: str
    prompt: list[int]
    policy: str
    dropped_messages: int = 0
    dropped_tokens: int = 0

    def report(self) -> dict[str, Any] | None:
        """The response's `tokenwing.context_overflow`: only where something was dropped."""
        if not self.dropped_messages:
            return None
        return {
            "policy": self.policy,
            "dropped_messages": self.dropped_messages,
            "dropped_tokens": self.dropped_tokens,
        }


def turns(messages: Sequence[dict[str, Any]]) -> tuple[list[list[int]], int]:
    """The turns that may be dropped (each a list of message indices, oldest first) and the index where the
    kept end of the conversation starts (the last user message). System messages are in no turn: kept."""
    rest = [i for i, m in enumerate(messages) if m["role"] != "system"]
    users = [i for i in rest if messages[i]["role"] == "user"]
    tail = users[-1] if users else (rest[-1] if rest else len(messages))
    groups: list[list[int]] = []
    for i in rest:
        if i >= tail:
            break
        if not groups or messages[i]["role"] == "user":
            groups.append([i])
        else:
            groups[-1].append(i)
    # A result answering a call of an earlier turn (a user message came between them, which OpenAI allows)
    # joins the two turns; one answering a call from the kept end keeps that turn and those after it.
    while True:
        where = {i: g for g, group in enumerate(groups) for i in group}
        call_turn = {
            call["id"]: where[i] for i in where for call in messages[i].get("tool_calls") or () if "id" in call
        }
        joined = False
        for i, m in enumerate(messages):
            if m["role"] != "tool" or m.get("tool_call_id") not in call_turn:
                continue
            h = call_turn[m["tool_call_id"]]
            if i >= tail:
                tail = groups[h][0]
                groups = groups[:h]
            elif where[i] != h:
                g = where[i]
                groups = [*groups[:h], sorted(j for group in groups[h : g + 1] for j in group), *groups[g + 1 :]]
            else:
                continue
            joined = True
            break
        if not joined:
            return groups, tail


def drop_order(messages: Sequence[dict[str, Any]], groups: list[list[int]], policy: str) -> list[list[int]]:
    """The turns in the order they go: rolling the oldest first; trim-middle those after the first user turn
    (oldest first; an assistant greeting before it goes before them), and that turn last of all."""
    if policy != "trim-middle":
        return groups
    first = next((g for g, group in enumerate(groups) if messages[group[0]]["role"] == "user"), None)
    if first is None:
        return groups
    return [*groups[:first], *groups[first + 1 :], groups[first]]


def fit_chat(
    messages: Sequence[dict[str, Any]],
    render: Render,
    encode: Encode,
    n_ctx: int,
    max_tokens: int | None,
    policy: str,
    has_tools: bool,
) -> Fitted:
    """The prompt for `messages` that leaves the reply its room in `n_ctx`, under `policy` (module doc).
    `max_tokens`: the client's, or None. A max_tokens no prompt of this conversation could leave room for
    (larger than the context less what is never dropped) is not refused: the reply gets the default share's
    room, as much as there is, and may run on until the context is full (finish_reason "length")."""
    groups, tail = turns(messages)
    order = drop_order(messages, groups, policy)
    tries: dict[int, Fitted] = {}

    def attempt(k: int) -> Fitted:
        if k not in tries:
            gone = {i for group in order[:k] for i in group}
            kept = [m for i, m in enumerate(messages) if i not in gone]
            text = render(kept, True)
            tries[k] = Fitted(kept, text, encode(text), policy, len(gone))
        return tries[k]

    share = max(1, n_ctx // REPLY_SHARE)
    wanted = max_tokens if max_tokens is not None else share
    full = attempt(0)
    if len(full.prompt) + wanted <= n_ctx:
        return full
    least = attempt(len(order))
    if len(least.prompt) >= n_ctx:
        kept_end = [m for m in messages[tail:] if m["role"] != "system"]
        raise RequestError(
            _too_big(least.messages, kept_end, render, encode, n_ctx, has_tools),
            "messages",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    room = n_ctx - len(least.prompt)
    reserve = wanted if wanted <= room else min(share, room)
    if len(full.prompt) + reserve <= n_ctx:
        return full
    if policy == "stop":
        raise RequestError(
            f"the conversation ({len(full.prompt):,} tokens) and the reply's room ({reserve:,} tokens) do not fit "
            f"the {n_ctx:,}-token context, and context_overflow is 'stop' (nothing is dropped)",
            "messages",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    lo, hi = 0, len(order)  # lo does not fit, hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(attempt(mid).prompt) + reserve <= n_ctx:
            hi = mid
        else:
            lo = mid
    out = attempt(hi)
    out.dropped_tokens = max(0, len(full.prompt) - len(out.prompt))
    return out


def _too_big(
    least: list[dict[str, Any]],
    tail: list[dict[str, Any]],
    render: Render,
    encode: Encode,
    n_ctx: int,
    has_tools: bool,
) -> str:
    """One sentence: what is never dropped, each part's tokens (by the template: the prompt with the part less
    the prompt without it), their sum of the context. `tail`: the last user message and what follows it."""
    total = len(encode(render(least, True)))
    parts: list[tuple[str, int]] = []
    try:
        bare = len(encode(render(least, False))) if has_tools else total
        alone = len(encode(render(tail, False))) if tail else 0
    except BadInputError:  # a template that will not render a part alone: the sum, unnamed
        kept = "the system prompt, the tool definitions and the last user message"
        return f"{kept} take {total:,} tokens of the {n_ctx:,}-token context, leaving no room for a reply"
    if len(tail) < len(least):
        parts.append(("the system prompt", bare - alone))
    if has_tools:
        parts.append(("the tool definitions", total - bare))
    if tail:
        after = len(tail) - 1
        name = "the last user message" if tail[0]["role"] == "user" else "the last message"
        if after:
            name += f" and the {after} message{'s' if after > 1 else ''} after it"
        parts.append((name, alone))
    parts = [(name, n) for name, n in parts if n > 0] or parts
    if len(parts) == 1:
        name = parts[0][0]
        verb = "take" if name == "the tool definitions" or " and " in name else "takes"
        return f"{name} {verb} {total:,} tokens of the {n_ctx:,}-token context, leaving no room for a reply"
    named = [f"{name} ({n:,} tokens)" for name, n in parts]
    listed = ", ".join(named[:-1]) + " and " + named[-1]
    return f"{listed} take {total:,} tokens of the {n_ctx:,}-token context, leaving no room for a reply"
