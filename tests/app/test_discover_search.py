"""Discover's search (found in the walk-through, docs/app-walkthrough.md): the hub's results first, the models here
filtered by the same words, and a line that says what was found, nothing found included. Qt-free."""

from __future__ import annotations

from runmyai.ui.render import LibraryEntry, discover_entries, matches, search_line


def entry(key: str, title: str) -> LibraryEntry:
    return LibraryEntry(key, title, "", "")


HERE = [
    entry("local:/m/tokenwing-demo-moe.tw.gguf", "TokenWing demo (22 M)"),
    entry("preset:qwen3-30b-a3b", "Qwen3 30B-A3B"),
    entry("preset:gpt-oss-20b", "gpt-oss 20B"),
]
HUB = [entry("hub:acme/Tiny-MoE-3B-A1B-GGUF", "acme/Tiny-MoE-3B-A1B-GGUF")]


def test_a_search_lists_the_hub_first_then_what_matches_here() -> None:
    assert discover_entries(HERE, HUB, "qwen") == [*HUB, HERE[1]]  # the hub's results were below all 17 cards
    assert discover_entries(HERE, HUB, "tiny moe") == HUB
    assert discover_entries(HERE, [], "30b") == [HERE[1]]
    assert discover_entries(HERE, HUB, "  ") == HERE  # no search: everything here and curated, no hub results


def test_matching_is_by_word_starts_over_title_and_key() -> None:
    assert matches(HUB[0], "tiny moe") and matches(HUB[0], "Tiny-MoE") and matches(HUB[0], "acme")
    assert matches(HERE[0], "demo") and not matches(HERE[0], "emo")
    assert not matches(HERE[2], "qwen")


def test_the_search_line_says_what_was_found_and_when_nothing_was() -> None:
    assert search_line("", 3, 1) == ""
    assert search_line("tiny", None, 0) == "Searching the hub for “tiny”…"
    assert search_line("tiny", 1, 0) == "“tiny”: 1 on the hub, 0 here or curated. Clear the search to see all."
    assert search_line("qwen", 0, 2).startswith("“qwen”: none on the hub, 2 here")
    assert search_line("zzz", 0, 0).startswith("Nothing matches “zzz”")
