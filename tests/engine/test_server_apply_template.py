"""`POST /apply-template` through real HTTP against a real `tokenwing serve`: generated models carrying the
publishers' own chat templates (DeepSeek V3.2's, Qwen3.5's, from llama.cpp's pinned source distribution) return
the prompt Hugging Face's `apply_chat_template` renders for the same conversation, tools and variables, less
the BOS text the tokenizer adds itself; it is the prompt the chat endpoint runs; bad input is a 400 naming its
field."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ModelFactory
from tests.engine.test_server import KEY, Server
from tests.llama_source import chat_templates
from tokenwing.format.reader import ModelFile
from tokenwing.format.repack import repack
from tokenwing.runtime.preflight import preflight
from tokenwing.text.tokenizer import tokenizer_from_metadata

transformers = pytest.importorskip("transformers")

AUTH = {"Authorization": f"Bearer {KEY}"}
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"  # the generated deepseek2 model's (add_bos: yes)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather — °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
TOOL_ROUND = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    # as OpenAI's clients send it: no content, the arguments as JSON text
    {"role": "assistant", "content": None, "reasoning_content": "Call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "21 °C.", "reasoning_content": "Done."},
    {"role": "user", "content": "Thanks. Tomorrow?"},
]


def _templated(model_factory: ModelFactory, root: Path, template: str) -> Path:
    """A generated deepseek2 model whose GGUF carries `template` (gguf-py's own metadata copier), repacked."""
    src = model_factory(arch="deepseek2", type="Q8_0")
    jinja = root / "template.jinja"
    jinja.write_text(chat_templates()[template], encoding="utf-8")
    gguf = root / "templated.gguf"
    copier = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata"]
    r = subprocess.run(
        [*copier, str(src), str(gguf), "--force", "--chat-template-file", str(jinja)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    out = root / "templated.tw.gguf"
    repack([str(gguf)], str(out), show_progress=False)
    return out


@pytest.fixture(scope="module")
def deepseek_model(model_factory: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _templated(model_factory, tmp_path_factory.mktemp("ds32"), "deepseek-ai-DeepSeek-V3.2.jinja")


@pytest.fixture(scope="module")
def deepseek(deepseek_model: Path) -> Iterator[Server]:
    s = Server(deepseek_model)
    yield s
    s.stop()


def _apply(server: Server, body: Any) -> httpx.Response:
    # ASCII-escaped JSON: a lone surrogate ("\ud800") can travel, as any client's JSON can carry it
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(server.url + "/apply-template", content=json.dumps(body), headers=headers, timeout=60)


def _hf(template: str, bos: str | None, eos: str | None, body: dict[str, Any]) -> str:
    """transformers' rendering of a request body, its messages in the form HF's templates read: a tool call's
    arguments as an object, a null content as empty text (as the server reads them)."""
    from tokenizers import Tokenizer, models

    messages = copy.deepcopy(body["messages"])
    for m in messages:
        if m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")), **specials
    )
    out = tok.apply_chat_template(
        messages,
        chat_template=chat_templates()[template],
        tools=body.get("tools"),
        add_generation_prompt=body.get("add_generation_prompt", True),
        tokenize=False,
        **body.get("chat_template_kwargs", {}),
    )
    assert isinstance(out, str)
    return out


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": TOOLS},
        {"tools": TOOLS, "chat_template_kwargs": {"thinking": True}},
        {"tools": TOOLS, "add_generation_prompt": False, "max_tokens": 5, "temperature": 0.3, "stream": True},
    ],
)
def test_prompt_is_hugging_faces(deepseek: Server, extra: dict[str, Any]) -> None:
    body = {"model": "x", "messages": TOOL_ROUND, **extra}
    r = _apply(deepseek, body)
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    want = _hf("deepseek-ai-DeepSeek-V3.2.jinja", BOS, EOS, body)
    assert want.startswith(BOS)  # the template writes it; the tokenizer adds BOS itself, so the prompt does not
    assert prompt == want.removeprefix(BOS)
    assert '<｜DSML｜invoke name="get_weather">' in prompt and "Zürich" in prompt  # the call, arguments as text
    assert ("get_weather" in prompt.split("<｜User｜>")[0]) == ("tools" in extra)  # the definitions, in the system


def test_chat_runs_the_same_prompt(deepseek: Server, deepseek_model: Path) -> None:
    """The chat endpoint's prompt is /apply-template's: as many tokens (with the one BOS the tokenizer adds)."""
    with ModelFile.open(str(deepseek_model)) as mf:
        tok = tokenizer_from_metadata({k: v.value for k, v in mf.header.kv.items()}, "m")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    prompt = _apply(deepseek, {"messages": messages}).json()["prompt"]
    assert prompt == "Be brief.<｜User｜>Hello there<｜Assistant｜><think></think>"
    ids = tok.encode(prompt, special=True)
    assert ids.count(tok.bos_id) == 1
    r = deepseek.client().chat.completions.create(model="x", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)


def test_template_sees_the_models_special_tokens(deepseek_model: Path) -> None:
    with ModelFile.open(str(deepseek_model)) as mf:
        t = preflight(mf).chat_template
    assert t is not None and (t.bos_token, t.eos_token, t.drop_leading_bos) == (BOS, EOS, True)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ([1], None, "JSON object"),
        ({}, "messages", "non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0]"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "surrogate"),
        ({"messages": [{"role": "user", "content": "x", "reasoning_content": 1}]}, "messages", "reasoning_content"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
            "messages",
            "messages[0].tool_calls[0].function.arguments is not valid JSON",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
            "messages",
            "must be a JSON object",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
            "messages",
            "messages[0].tool_calls[0].function.name",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages", "only assistant"),
        ({"messages": TOOL_ROUND, "tools": {"a": 1}}, "tools", "'tools' must be a list"),
        ({"messages": TOOL_ROUND, "tools": [{"type": "function", "function": {}}]}, "tools", "tools[0].function.name"),
        (
            {"messages": TOOL_ROUND, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools",
            "tools[0].function.parameters",
        ),
        ({"messages": TOOL_ROUND, "add_generation_prompt": "yes"}, "add_generation_prompt", "boolean"),
        ({"messages": TOOL_ROUND, "chat_template_kwargs": [1]}, "chat_template_kwargs", "an object"),
        ({"messages": TOOL_ROUND, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
        ({"messages": TOOL_ROUND, "continue_final_message": True}, "continue_final_message", "not supported"),
        ({"messages": TOOL_ROUND, "functions": [{"name": "f"}]}, "functions", "use tools"),
    ],
)
def test_bad_input_names_the_field(deepseek: Server, body: Any, param: str | None, words: str) -> None:
    r = _apply(deepseek, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and "\n" not in err["message"], err


def test_auth_and_body_limits(deepseek: Server) -> None:
    assert httpx.post(deepseek.url + "/apply-template", json={"messages": TOOL_ROUND}).status_code == 401
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(deepseek.url + "/apply-template", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_template_refusal_is_a_400(model_factory: ModelFactory, tmp_path: Path) -> None:
    """Qwen3.5's template refuses a conversation with no user message (raise_exception): a 400 with its words;
    with a user message it renders as transformers does, its tools included."""
    server = Server(_templated(model_factory, tmp_path, "Qwen3.5-4B.jinja"))
    try:
        r = _apply(server, {"messages": [{"role": "system", "content": "Be brief."}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "No user query found in messages." in err["message"], err
        body = {"messages": TOOL_ROUND, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
        r = _apply(server, body)
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == _hf("Qwen3.5-4B.jinja", BOS, EOS, body)  # (Qwen's writes no BOS text)
        assert "get_weather" in r.json()["prompt"].split("<|im_start|>user")[0]
    finally:
        server.stop()
