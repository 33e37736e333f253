"""gpt-oss's harmony output split into reasoning and content as llama.cpp's server does, whatever the pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenwing.testmodel.templates import CHATML, HARMONY
from tokenwing.text.reasoning import Delta, HarmonyParser, harmony_template, parse_harmony, route

# A gpt-oss reply after the prompt's "<|start|>assistant": reasoning, then the answer (<|return|> ends
# generation and is not printed).
REPLY = (
    "<|channel|>analysis<|message|>The user greets. Answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
)


def _streamed(text: str, cuts: list[int]) -> Delta:
    parser = HarmonyParser()
    out = Delta()
    last = 0
    for c in sorted(set(cuts)):
        out += parser.push(text[last:c])
        last = c
    out += parser.push(text[last:]) + parser.finish()
    assert (parser.reasoning, parser.content) == (out.reasoning, out.content)
    return out


def test_reply_is_split_into_reasoning_and_content() -> None:
    assert parse_harmony(REPLY) == Delta("The user greets. Answer briefly.", "Hello! How can I help?")


def test_markers_split_across_pieces_are_held_back() -> None:
    p = HarmonyParser()
    assert p.push("<|chan") == Delta()
    assert p.push("nel|>analysis<|mess") == Delta()
    assert p.push("age|>thinking <|") == Delta(reasoning="thinking ")
    assert p.push("en") == Delta()
    assert p.push("d|><|start|>assistant<|channel|>final<|message|>Hi") == Delta(content="Hi")
    assert p.push(" <|e") == Delta(content=" ")
    assert p.finish() == Delta(content="<|e")  # an unfinished marker at the end is text after all


def test_several_analysis_blocks_and_a_preamble() -> None:
    text = (
        "<|channel|>analysis<|message|>first.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Let me check. <|end|>"
        "<|start|>assistant<|channel|>analysis<|message|> second.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done."
    )
    # preambles (commentary without a recipient) are content; reasoning blocks are concatenated
    assert parse_harmony(text) == Delta("first. second.", "Let me check. Done.")


def test_stray_commentary_prefix_and_tool_calls() -> None:
    stray = "<|channel|>commentary to=assistant<|channel|>final<|message|>answer"
    assert parse_harmony(stray) == Delta("", "answer")
    tool = (
        "<|channel|>analysis<|message|>need weather<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city":"X"}'
    )
    assert parse_harmony(tool) == Delta("need weather", "")  # a tool call is not text
    assert route("<|channel|>commentary to=functions.f <|constrain|>json") == "drop"
    assert route("assistant<|channel|>final") == "content"


def test_whitespace_only_reasoning_is_dropped() -> None:
    # llama.cpp clears reasoning that is only whitespace; leading whitespace of real reasoning stays
    assert parse_harmony("<|channel|>analysis<|message|> \n<|end|><|start|>assistant<|channel|>final<|message|>x") == (
        Delta("", "x")
    )
    p = HarmonyParser()
    assert p.push("<|channel|>analysis<|message|>\n ") == Delta()
    assert p.push("a") == Delta(reasoning="\n a")


def test_output_not_in_harmony_form_is_content() -> None:
    assert parse_harmony("Just an answer, no channels.") == Delta("", "Just an answer, no channels.")
    assert parse_harmony("to be or not") == Delta("", "to be or not")
    assert parse_harmony("<|channel|>" + "x" * 300) == Delta("", "<|channel|>" + "x" * 300)
    # generation stopped inside a header: nothing of the message was written yet
    assert parse_harmony("<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>fin") == Delta("r", "")


def test_nothing_after_return_or_call() -> None:
    assert parse_harmony("<|channel|>final<|message|>a<|return|>junk") == Delta("", "a")
    assert parse_harmony("<|channel|>analysis<|message|>a<|call|><|channel|>final<|message|>b") == Delta("a", "")


def test_harmony_template_is_recognised_as_llama_cpp_does() -> None:
    assert harmony_template(HARMONY) and not harmony_template(CHATML)


# ------------------------------------------------------------------------------------------ properties

_PIECES = [
    "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>", "analysis",
    "final", "commentary", "assistant", " to=functions.f", " to=assistant", "json", "<|", "|>", "<", "|", ">", " ",
    "\n", "a", "é", "字", "🙂", "to",
]  # fmt: skip
_texts = st.lists(st.sampled_from(_PIECES), max_size=40).map("".join)


@settings(max_examples=400, deadline=None)
@given(_texts, st.lists(st.integers(0, 400), max_size=12))
def test_any_cut_gives_the_same_split(text: str, cuts: list[int]) -> None:
    assert _streamed(text, [min(c, len(text)) for c in cuts]) == parse_harmony(text)


@settings(max_examples=300, deadline=None)
@given(_texts)
def test_one_character_at_a_time(text: str) -> None:
    assert _streamed(text, list(range(len(text)))) == parse_harmony(text)


_bodies = st.text(st.sampled_from(list("ab é字🙂\n<|>")), max_size=20).filter(
    lambda s: all(m not in s for m in ("<|end|>", "<|return|>", "<|call|>"))
)
_messages = st.lists(st.tuples(st.sampled_from(["analysis", "commentary", "final"]), _bodies), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(_messages, st.lists(st.integers(0, 300), max_size=10))
def test_well_formed_replies(messages: list[tuple[str, str]], cuts: list[int]) -> None:
    """Reasoning is the analysis bodies joined (unless only whitespace), content the other bodies joined."""
    parts = [f"<|channel|>{ch}<|message|>{body}" for ch, body in messages]
    text = "<|end|><|start|>assistant".join(parts)
    got = _streamed(text, [min(c, len(text)) for c in cuts])
    reasoning = "".join(b for ch, b in messages if ch == "analysis")
    assert got.reasoning == ("" if reasoning.strip(" \t\r\n") == "" else reasoning)
    assert got.content == "".join(b for ch, b in messages if ch != "analysis")


def test_think_tags_are_reasoning() -> None:
    from tokenwing.text.reasoning import ThinkParser

    def whole(thinking: bool, text: str) -> Delta:
        p = ThinkParser(thinking)
        return sum((p.push(c) for c in text), Delta()) + p.finish()

    assert whole(False, "<think>\nHm, rain.\n</think>\n\nTake an umbrella.") == Delta("Hm, rain.", "Take an umbrella.")
    assert whole(True, "Hm, rain. \n</think>\n\nYes.") == Delta("Hm, rain.", "Yes.")  # the prompt opened the tags
    assert whole(False, "No tags: <think> is just text") == Delta("", "No tags: <think> is just text")
    assert whole(True, "still thinking when it stopped") == Delta("still thinking when it stopped", "")
    assert whole(False, "<thi") == Delta("", "<thi")
