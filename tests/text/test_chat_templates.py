"""The publishers' chat templates of every family the engine runs render exactly as Hugging Face's
`apply_chat_template` renders them (transformers itself is the reference), for conversations with system, tool
and reasoning messages, with and without tools; where transformers refuses a conversation, the engine does too.
The templates are llama.cpp's copies (models/templates/), read from the pinned source distribution."""

from __future__ import annotations

import copy
import functools
import json
import time
from typing import Any

import pytest

from tests.llama_source import chat_templates
from tokenwing.errors import BadInputError
from tokenwing.text.chat import MAX_OUTPUT, ChatTemplate

transformers = pytest.importorskip("transformers")  # extra `dev`; skipped only where it is not installed

# The texts of each family's BOS and EOS tokens (both renderers get the same; None: the tokenizer has none).
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
KIMI = ("[BOS]", "[EOS]")
GLM = (None, "<|endoftext|>")
MINIMAX = ("]~!b[", "[e~[")
QWEN = (None, "<|im_end|>")
GPT_OSS = ("<|startoftext|>", "<|return|>")
LING = ("<|startoftext|>", "<|endoftext|>")

# issue 28's list: file in llama.cpp's models/templates/ -> the family's special tokens
TEMPLATES: dict[str, tuple[str | None, str | None]] = {
    "deepseek-ai-DeepSeek-V3.1.jinja": DEEPSEEK,
    "deepseek-ai-DeepSeek-V3.2.jinja": DEEPSEEK,
    "deepseek-ai-DeepSeek-V4.jinja": DEEPSEEK,
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": DEEPSEEK,
    "moonshotai-Kimi-K2.jinja": KIMI,  # K2 as first published, and the Instruct revision
    "Kimi-K2-Instruct.jinja": KIMI,
    "Kimi-K2-Thinking.jinja": KIMI,
    "Kimi-K3.jinja": KIMI,
    "GLM-4.6.jinja": GLM,
    "GLM-4.7-Flash.jinja": GLM,
    "MiniMax-M2.jinja": MINIMAX,
    "MiniMax-M3.jinja": MINIMAX,
    "Qwen-Qwen3-0.6B.jinja": QWEN,
    "Qwen3-Coder.jinja": QWEN,
    "Qwen3.5-4B.jinja": QWEN,
    "openai-gpt-oss-120b.jinja": GPT_OSS,
    "inclusionai-ling-3.0-flash.jinja": LING,
}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city — in °C or °F",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_notes",
            "description": "Search <internal> notes & files",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer", "minimum": 1},
                    "filters": {
                        "type": "object",
                        "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
                    },
                },
                "required": ["query"],
            },
        },
    },
]


def _calls(as_text: bool) -> list[dict[str, Any]]:
    """Two parallel calls; arguments as objects (what Hugging Face's templates expect) or as the JSON text
    OpenAI's wire format carries."""
    args: list[dict[str, Any]] = [
        {"city": "Zürich", "unit": "celsius"},
        {"query": 'notes about "ETA" <soon>', "limit": 3, "filters": {"tags": ["a", "ü"]}},
    ]
    return [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(a, ensure_ascii=False) if as_text else a},
        }
        for i, (name, a) in enumerate(zip(("get_weather", "search_notes"), args, strict=True))
    ]


SYSTEM = {"role": "system", "content": "You are a helpful assistant. Réponds brièvement."}
USER = {"role": "user", "content": "What's the weather in Zürich, and do my notes mention the ETA?"}


def _tool_round(as_text: bool) -> list[dict[str, Any]]:
    return [
        SYSTEM,
        USER,
        {
            "role": "assistant",
            "reasoning_content": "I should call both tools: weather first.",
            "content": "",
            "tool_calls": _calls(as_text),
        },
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": '{"temp": 21, "sky": "clear"}'},
        {"role": "tool", "tool_call_id": "call_1", "name": "search_notes", "content": "ETA: Friday 17:00 <b>"},
        {
            "role": "assistant",
            "reasoning_content": "Both results are in.",
            "content": "21 °C and clear; the ETA is Friday 17:00.",
        },
        {"role": "user", "content": "Thanks! And tomorrow?"},
    ]


CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "system and user": [SYSTEM, USER],
    "user only, odd text": [{"role": "user", "content": 'héllo <b>&</b> 日本語 "quotes" {{ 7*7 }} {% x %}\n\n  '}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    "reasoning": [
        SYSTEM,
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Simple arithmetic: 4.", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "reasoning under other names": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning": "Add them.", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "thinking": "Add again.", "content": "6"},
        {"role": "user", "content": "4+4?"},
    ],
    "ends with the assistant": [USER, {"role": "assistant", "reasoning_content": "Let me think.", "content": "Sunny."}],
    "tool round": _tool_round(False),
    "tool round, arguments as JSON text": _tool_round(True),
    "tool results last": [
        USER,
        {"role": "assistant", "content": None, "tool_calls": _calls(False)[:1]},
        {"role": "tool", "tool_call_id": "call_0", "content": "21 °C"},
    ],
    "nulls": [
        {"role": "system", "content": "Be brief.", "name": None},
        {"role": "user", "content": "Hi", "tool_calls": None},
        {"role": "assistant", "content": "Hello", "reasoning_content": None, "tool_calls": None},
        {"role": "user", "content": "Bye"},
    ],
    "developer": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello"}],
    "unknown role": [SYSTEM, {"role": "critic", "content": "Too long."}, {"role": "user", "content": "Shorter."}],
    "system only": [SYSTEM],
}

KWARGS: list[dict[str, Any]] = [
    {},
    {"enable_thinking": False},
    {"enable_thinking": True, "thinking": True, "reasoning_effort": "high"},
]


@functools.cache
def _hf_tokenizer(bos: str | None, eos: str | None) -> Any:
    from tokenizers import Tokenizer, models

    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def _hf(source: str, specials: tuple[str | None, str | None], messages: list[dict[str, Any]], **kw: Any) -> str:
    out = _hf_tokenizer(*specials).apply_chat_template(messages, chat_template=source, tokenize=False, **kw)
    assert isinstance(out, str)
    return out


def _hf_mutable(source: str, specials: tuple[str | None, str | None], messages: list[dict[str, Any]], **kw: Any) -> str:
    """Hugging Face's rendering with its sandbox's immutability lifted (a template may change its own lists and
    dicts, as llama.cpp's renderer lets it): the reference for the engine's fallback (text/chat.py `_Mutable`)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment
    from transformers.utils import chat_template_utils

    saved = ImmutableSandboxedEnvironment.is_safe_attribute
    ImmutableSandboxedEnvironment.is_safe_attribute = SandboxedEnvironment.is_safe_attribute  # type: ignore[method-assign]
    chat_template_utils._compile_jinja_template.cache_clear()
    try:
        return _hf(source, specials, messages, **kw)
    finally:
        ImmutableSandboxedEnvironment.is_safe_attribute = saved  # type: ignore[method-assign]
        chat_template_utils._compile_jinja_template.cache_clear()


def _refused_change(e: Exception) -> bool:
    """Whether Hugging Face refused a template's change to one of its own lists or dicts (the engine renders
    those, as Hugging Face's renderer does with the immutability lifted)."""
    return "object is unsafe" in str(e) and any(f"'{t}' object" in str(e) for t in ("list", "dict", "set"))


def _first_difference(a: str, b: str) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"at {i}: hf {a[max(0, i - 40) : i + 40]!r}\n      ours {b[max(0, i - 40) : i + 40]!r}"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_as_hugging_face(name: str) -> None:
    source = chat_templates()[name]
    specials = TEMPLATES[name]
    ours = ChatTemplate(source, *specials)  # Kimi K3's {% break %} parses
    rendered = refused = 0
    with_tools: list[str] = []
    problems: list[str] = []
    for conv_name, conversation in CONVERSATIONS.items():
        for tools in (None, TOOLS):
            for agp in (False, True):
                for kw in KWARGS:
                    case = f"{conv_name!r} tools={tools is not None} add_generation_prompt={agp} {kw}"
                    msgs = copy.deepcopy(conversation)
                    try:
                        want: str | None = _hf(source, specials, msgs, tools=tools, add_generation_prompt=agp, **kw)
                    except Exception as e:
                        want = None
                        if _refused_change(e):  # (Kimi K2-Instruct's and K2-Thinking's, with calls)
                            want = _hf_mutable(source, specials, msgs, tools=tools, add_generation_prompt=agp, **kw)
                    try:
                        got: str | None = ours.render(msgs, agp, tools=tools, **kw)
                    except BadInputError as e:
                        got = None
                        if want is not None:
                            problems.append(f"{case}: we refused ({e}), transformers rendered")
                    if want is None:
                        refused += 1
                        if got is not None:
                            problems.append(f"{case}: transformers refused, we rendered")
                        continue
                    rendered += 1
                    if got is not None and got != want:
                        problems.append(f"{case}: differs {_first_difference(want, got)}")
                    if tools is not None and conv_name == "system and user" and got is not None:
                        with_tools.append(got)  # no calls in it: the names can only come from the definitions
                    assert msgs == conversation, "the renderer changed the caller's messages"
    assert not problems, f"{len(problems)} of {rendered + refused} differ:\n" + "\n".join(problems[:10])
    # a comparison worth its name: most conversations render, and the tools reach the prompt
    assert rendered >= 0.6 * (rendered + refused), (rendered, refused)
    if "tools" in source:  # (DeepSeek V3.1's template shows the calls, not the definitions)
        assert any("get_weather" in p and "search_notes" in p for p in with_tools), "no prompt shows the tools"


def test_hugging_face_refusals_are_bad_input() -> None:
    """Conversations transformers refuses before the template runs are refused as bad input here too."""
    t = ChatTemplate(chat_templates()["Qwen-Qwen3-0.6B.jinja"], *QWEN)
    for messages, kw in (
        ([], {}),
        (["not an object"], {}),
        ([USER], {"tools": ["not an object"]}),
        ([USER], {"documents": ["not an object"]}),
    ):
        with pytest.raises(Exception):  # noqa: B017 (transformers raises ValueError or TypeError)
            _hf(t.source, QWEN, messages, **kw)  # type: ignore[arg-type]
        with pytest.raises(BadInputError):
            t.render(messages, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- what the environment gives
def test_loop_controls_and_generation_tag() -> None:
    t = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
        "{% if m.role == 'skip' %}{% continue %}{% endif %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% endfor %}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"}, {"role": "user", "content": "c"}]
    assert t.render([*msgs, {"role": "stop", "content": "d"}, {"role": "user", "content": "e"}]) == "ac"


def test_tojson_is_pythons_json() -> None:
    t = ChatTemplate("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}")
    out = t.render([{"role": "user", "content": "é <b> & 'x'"}])
    assert out == ('{"role": "user", "content": "é <b> & \'x\'"}|{\n  "content": "é <b> & \'x\'",\n  "role": "user"\n}')


def test_special_tokens_and_extra_variables() -> None:
    src = "{{ bos_token is defined }}{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ documents }}|{{ flag }}"
    assert ChatTemplate(src).render([USER]) == "False||None|None|"
    assert ChatTemplate(src, "<s>", "</s>").render([USER], flag=1) == "True<s>|</s>|None|None|1"
    # as in transformers, extra variables may replace the special tokens' texts
    assert ChatTemplate(src, "<s>", "</s>").render([USER], bos_token="B") == "TrueB|</s>|None|None|"


def test_leading_bos_dropped_where_the_tokenizer_adds_it() -> None:
    src = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ChatTemplate(src, "<s>").render([USER]) == "<s>" + USER["content"]
    assert ChatTemplate(src, "<s>", drop_leading_bos=True).render([USER]) == USER["content"]
    # only a leading one
    assert ChatTemplate("x" + src, "<s>", drop_leading_bos=True).render([USER]).startswith("x<s>")


@pytest.mark.parametrize(
    "evil",
    [
        "{{ 'x' * 1000000000 }}",
        "{{ 1000000000 * ['x'] }}",
        "{{ 7 ** 100000000 }}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
        "{{ messages | tojson(indent=1000000000) }}",
        "{% set ns = namespace(_secret=1) %}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ dict.__class__.__subclasses__() }}",
        "{{ namespace.__init__.__globals__ }}",
    ],
)
def test_untrusted_template_limits(evil: str) -> None:
    start = time.monotonic()
    with pytest.raises(BadInputError) as e:
        ChatTemplate(evil).render([USER])
    assert "\n" not in str(e.value)
    assert time.monotonic() - start < 10  # stopped at the limit, long before memory or time run out
    assert MAX_OUTPUT == 4 << 20


# Mutating methods of the template's own values, as Jinja's immutable sandbox (Hugging Face's) allows or refuses
# them: a list's pop is allowed, its append/extend/insert/sort/reverse/remove are not, nor a dict's pop, update,
# setdefault, popitem or clear (jinja2.sandbox's table of mutating methods). Kimi K2-Instruct's and K2-Thinking's
# templates append to a list for each call in the history, so transformers refuses a conversation with calls. The
# engine renders what Hugging Face renders as it does, and what it refuses for such a change as Hugging Face's
# renderer does with the immutability lifted (llama.cpp's renderer lets templates change their own lists).
MUTATIONS = [
    "{% set ns = namespace(a=[1, 2, 3]) %}{{ ns.a.pop(0) }}{{ ns.a }}",
    "{% set a = [3, 1] %}{{ a.pop() }}{{ a }}",
    *(
        f"{{% set a = [3, 1] %}}{{% set _ = a.{call} %}}{{{{ a }}}}"
        for call in ("append(2)", "extend([2])", "insert(0, 2)", "sort()", "reverse()", "remove(1)", "clear()")
    ),
    *(
        f"{{% set d = {{'k': 1}} %}}{{{{ d.{call} }}}}{{{{ d }}}}"
        for call in ("pop('k')", "update({'j': 2})", "setdefault('j', 2)", "popitem()", "clear()", "copy()")
    ),
    "{% set d = {'k': 1} %}{{ d.get('k') }}{{ d.items() | list }}{{ [1, 2].index(2) }}{{ 'a,b'.split(',') }}",
]


@pytest.mark.parametrize("source", MUTATIONS)
def test_list_and_dict_methods_as_hugging_face(source: str) -> None:
    try:
        want = _hf(source, (None, None), [USER])
    except Exception as e:
        assert _refused_change(e), e
        want = _hf_mutable(source, (None, None), [USER])
    assert ChatTemplate(source).render([USER]) == want


def test_kimi_k2_instruct_with_and_without_calls() -> None:
    """Hugging Face cannot render K2-Instruct's template with calls in the history (it appends to a list); the
    engine renders it, as llama.cpp's renderer does, so a tool round goes on after the first call."""
    source = chat_templates()["Kimi-K2-Instruct.jinja"]
    ours = ChatTemplate(source, *KIMI)
    for tools in (None, TOOLS):
        plain = [SYSTEM, USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
        want = _hf(source, KIMI, copy.deepcopy(plain), tools=tools, add_generation_prompt=True)
        assert ours.render(plain, tools=tools) == want
        with pytest.raises(Exception, match="access to attribute 'append' of 'list' object is unsafe"):
            _hf(source, KIMI, _tool_round(False), tools=tools)
        got = ours.render(_tool_round(False), tools=tools)
        assert got == _hf_mutable(source, KIMI, _tool_round(False), tools=tools, add_generation_prompt=True)
        # the calls and their results are in the prompt, in K2's sections
        assert "<|tool_calls_section_begin|>" in got and "functions.get_weather:0" in got and "ETA: Friday" in got


def test_a_template_changing_its_own_values_is_bounded() -> None:
    """The fallback that lets a template change its own lists grows them no further than the operators may."""
    t = ChatTemplate("{% set a = [] %}{% for i in range(99999) %}{% set _ = a.extend(range(99)) %}{% endfor %}x")
    with pytest.raises(BadInputError, match="oversized value"):
        t.render([USER])
    # the request's own messages are copies: a template that changes them changes nothing of the caller's
    msgs = [copy.deepcopy(USER)]
    assert ChatTemplate("{% set _ = messages.append(messages[0]) %}{{ messages | length }}").render(msgs) == "2"
    assert msgs == [USER]
