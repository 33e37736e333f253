"""The engine's tokenizer, built from the GGUF vocabulary, tokenises exactly as llama.cpp on tricky strings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tests.oracle.test_llama_loads import probe_models
from tokenwing.format.gguf_io import read_header
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.tokenizer import tokenizer_from_metadata

pytestmark = pytest.mark.oracle

TRICKY = [
    "Hello world",
    " leading space",
    "  two  spaces   three\t\ttabs\n\nnewlines\r\n",
    "it's they'RE WE'LL I'd can't",
    "1234567 3.14159 1e-5 $19.99 100%",
    "café naïve Straße año 日本語 中文 한국어 🙂🚀 Ελληνικά",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "<|im_start|<|im_end|>>",
    "\u200b\u00a0zero width and nbsp",
    "a" * 300,
    "",
    " ",
    "\n",
]


def test_tokenizer_matches_llama_cpp(model_factory: ModelFactory) -> None:
    path = model_factory()
    (r,) = probe_models([path], TRICKY)
    meta = {k: v.value for k, v in read_header(str(path)).kv.items()}
    tok = tokenizer_from_metadata(meta, str(path))
    for text, plain, special in zip(TRICKY, r["tokens"], r["tokens_special"], strict=True):
        assert tok.encode(text, special=False) == plain, text
        assert tok.encode(text, special=True) == special, text
        assert tok.decode(plain, skip_special=False) == text


def test_chat_template_renders_chatml(model_factory: ModelFactory) -> None:
    meta = {k: v.value for k, v in read_header(str(model_factory())).kv.items()}
    t = ChatTemplate(meta["tokenizer.chat_template"])
    out = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# Each family's vocabulary is trained on the multilingual corpus with merges across everything its
# pre-tokenizer separates (tokenwing.testmodel.tokenizer), so a split made unlike llama.cpp's changes the ids.
FAMILIES = {
    "deepseek-v3": {"arch": "deepseek2"},
    "kimi-k2": {"preset": "kimi-tiny"},
    "gpt-4o": {"arch": "gpt-oss"},
    "tekken": {"arch": "mistral4"},
}
MIXED = [
    "GPU显存模型model混合mixed日本語テキストtext한국어abc123中文",
    "e\u0301 a\u0308 n\u0303 हिन्दी में विशेषज्ञ ñandú Ελληνικά ΑΘΗΝΑ",
    "HTTPServer XMLHttpRequest iPhone McDonald's O'NEIL'S camelCaseABC ABCdef",
    "    four\n\n\n  two\t\r\n \u3000ideographic\u00a0nbsp\u2003em trailing   ",
    "1 12 123 1234 12345 123456 1234567 ١٢٣٤٥٦ 一二三 ½⅓ ²³",
    "<｜User｜>plain?<｜Assistant｜>ok<｜end▁of▁sentence｜><think>t</think><｜begin▁of▁sentence｜>",
    "<|start|>assistant<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final<|message|>x<|return|>",
    "<|im_system|>system<|im_middle|>s<|im_end|><|im_user|>u<|im_middle|>[BOS][EOS][EOT][PAD][UNK][PAD300]",
    "<|constrain|>json<|call|><|startoftext|><|endoftext|><|endofprompt|><|reserved_300|>",
    "",
    " ",
    "\n",
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You answer in one line.\nNo lists."},
        {"role": "user", "content": "Что такое MoE? 模型"},
        {"role": "assistant", "content": "A mixture of experts 🙂"},
        {"role": "user", "content": "  And MLA?\n"},
    ],
    [{"role": "user", "content": "only a user"}, {"role": "assistant", "content": "and a reply"}],
]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_tokenizer_and_template_match_llama_cpp(model_factory: ModelFactory, family: str) -> None:
    from tokenwing.testmodel.corpus import MULTILINGUAL

    path = model_factory(vocab_size=4096, **FAMILIES[family])
    meta = {k: v.value for k, v in read_header(str(path)).kv.items()}
    assert meta["tokenizer.ggml.pre"] == family
    chat = ChatTemplate(meta["tokenizer.chat_template"])
    conversations = [(msgs, add) for msgs in CHATS for add in (True, False)]
    rendered = [chat.render(msgs, add_generation_prompt=add) for msgs, add in conversations]
    texts = [*MULTILINGUAL.splitlines(), *TRICKY, *MIXED, *rendered]
    (r,) = probe_models([path], texts, [{"messages": m, "add_ass": a} for m, a in conversations])
    assert r["chats"] == rendered
    tok = tokenizer_from_metadata(meta, str(path))
    got = zip(texts, r["tokens"], r["tokens_special"], r["detokenized_special"], strict=True)
    for text, plain, special, shown in got:
        assert tok.encode(text, special=False, add_bos=False) == plain, text
        assert tok.encode(text, special=True, add_bos=False) == special, text
        assert tok.decode(special) == shown, text  # control tokens hidden, user-defined ones shown
    assert tok.add_bos == (family in ("deepseek-v3", "tekken"))


# Every vocabulary type a family we run ships with, by the name its GGUF carries (`tokenizer.ggml.pre`, or `spm`
# for a SentencePiece vocabulary): Qwen3/Qwen2/Qwen3-Next (qwen2), Qwen3.5 (qwen35), GLM-4.5..GLM-5 (glm4),
# ERNIE 4.5 (SentencePiece), DeepSeek V3/V3.1 (deepseek-v3), Kimi K2 (kimi-k2), gpt-oss (gpt-4o), Ling 2.0/3.0
# (bailingmoe2), MiniMax M2 (minimax-m2), DeepSeek V4 (joyai-llm), Mistral Small 4 (tekken), and files that name none
# (default). Issue 25 and 27's families use these: Kimi K3 kimi-k2, MiniMax M2 minimax-m2, Qwen3.8 Flash Next qwen35,
# GLM-5 / 5.2 glm4, DeepSeek V4 joyai-llm (test_new_families_write_a_checked_vocabulary ties each family's files to
# this list).
VOCAB_FAMILIES = [
    "qwen2", "qwen35", "glm4", "spm", "deepseek-v3", "kimi-k2", "gpt-4o", "bailingmoe2", "minimax-m2", "joyai-llm",
    "tekken", "default",
]  # fmt: skip
# The new families' markers, in running text and glued to words.
MARKERS = [
    "[gMASK]<sop><|system|>\nsys<|user|>\nhi<|assistant|>\n<think>r</think>ok<|observation|><tool_call>f<arg_key>",
    "<role>HUMAN</role>hi<|role_end|><role>ASSISTANT</role><think>x</think>y<|startoftext|><|reserved_token_3|>",
    "]~!b[]~b]system\nsys[e~[\n]~b]user\nhi[e~[\n]~b]ai\n<think>t</think><minimax:tool_call>x</minimax:tool_call>",
    "<s>User: hi\nAssistant: ok<|end_of_sentence|></s><unk><|begin_of_sentence|><mask:5><0x41>",
    "word<s>word</s> <s> space before, <unk>unknown",
    "<s>[SYSTEM_PROMPT] sys[/SYSTEM_PROMPT][INST] hi[/INST] ok</s>[THINK]t[/THINK][TOOL_CALLS]f<SPECIAL_999>x",
]


def vocab_probe(paths: list[Path], texts: list[str]) -> list[dict[str, Any]]:
    """llama.cpp's tokenizer on each file's vocabulary alone (a vocab_only load), in a subprocess."""
    req = paths[0].with_suffix(".vocab.json")
    req.write_text(json.dumps({"paths": [str(p) for p in paths], "texts": texts}))
    script = Path(__file__).with_name("llama_vocab_probe.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(req)], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("name", VOCAB_FAMILIES)
def test_every_vocabulary_type_tokenizes_as_llama_cpp(model_factory: ModelFactory, name: str) -> None:
    """Ids equal llama.cpp's on our multilingual corpus (code, CJK, Arabic, Devanagari, digits, emoji, whitespace
    runs, contractions) and on every family's markers, with special tokens parsed and not, with and without BOS;
    each token shows as llama.cpp's token_to_piece shows it."""
    from tokenwing.testmodel.corpus import CORPUS, MULTILINGUAL

    path = model_factory(vocab_size=4096, tokenizer=name, n_layer=1)
    meta = {k: v.value for k, v in read_header(str(path)).kv.items()}
    texts = [*CORPUS.splitlines(), *MULTILINGUAL.splitlines(), MULTILINGUAL, *TRICKY, *MIXED, *MARKERS]
    (r,) = vocab_probe([path], texts)
    tok = tokenizer_from_metadata(meta, str(path))
    assert tok.add_bos == r["add_bos"]
    for text, plain, special, with_bos in zip(texts, r["plain"], r["special"], r["with_bos"], strict=True):
        assert tok.encode(text, special=False, add_bos=False) == plain, text
        assert tok.encode(text, special=True, add_bos=False) == special, text
        assert tok.encode(text, special=True) == with_bos, text
    assert [tok.piece_bytes(i).hex() for i in range(tok.vocab_size)] == r["pieces"]


@pytest.mark.parametrize(
    ("name", "arch"),
    [
        ("spm", "ernie4_5-moe"), ("glm4", "glm4moe"), ("bailingmoe2", "bailingmoe3"), ("qwen35", "qwen35moe"),
        ("kimi-k2", "kimi-k3"),  # (K3's converter writes K2's vocabulary: it borrows kimi-linear's)
        ("minimax-m2", "minimax-m2"), ("qwen35", "qwen4exp"), ("glm4", "glm-dsa"), ("joyai-llm", "deepseek4"),
        ("tekken", "mistral4"),
    ],
)  # fmt: skip
def test_tokenize_command_and_a_chat_on_the_real_vocabulary(
    model_factory: ModelFactory, repacked_factory: ModelFactory, tmp_path: Path, name: str, arch: str
) -> None:
    """`tokenwing tokenize` gives llama.cpp's ids (its BOS rule included) for a GGUF and for the TokenWing file
    repacked from it, and the family runs a chat on its publishers' vocabulary type."""
    kw: dict[str, Any] = {"arch": arch, "tokenizer": name, "vocab_size": 4096, "n_layer": 2, "type": "Q8_0"}
    if arch == "glm4moe":
        kw.update(n_dense_lead=1, n_shared_exp=1)
    if arch == "qwen4exp":
        kw.update(n_layer=4)  # (its attention is every fourth layer: two layers would have none)
    gguf, model = model_factory(**kw), repacked_factory(**kw)
    text = MIXED[0] + "\n" + MARKERS[0] + MARKERS[3]
    (r,) = vocab_probe([gguf], [text])
    for path in (gguf, model):
        got = run_cli("tokenize", str(path), "--text", text, "--json")
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout) == r["with_bos"][0]
    (tmp_path / "t.txt").write_text(text)
    got = run_cli("tokenize", str(model), "--file", str(tmp_path / "t.txt"), "--json", "--no-special", "--no-bos")
    assert json.loads(got.stdout) == r["plain"][0]
    chat = run_cli("run", str(model), "--chat", "--prompt", "Bonjour, 模型", "-n", "4", "--ram-budget", "50%")
    assert chat.returncode == 0, chat.stderr


# What each new family's real files name (docs/families/*.md, from llama.cpp's converter), and the factory writes.
NEW_FAMILY_VOCABULARIES = {
    "kimi-k3": "kimi-k2",
    "minimax-m2": "minimax-m2",
    "qwen4exp": "qwen35",
    "glm-dsa": "glm4",
    "deepseek4": "joyai-llm",
    "mistral4": "tekken",
    "qwen3vlmoe": "qwen2",
}


@pytest.mark.parametrize("arch", list(NEW_FAMILY_VOCABULARIES))
def test_new_families_write_a_checked_vocabulary(model_factory: ModelFactory, arch: str) -> None:
    """A generated file of each new family carries its real files' pre-tokenizer, and that one is among those
    checked against llama.cpp's vocab_only tokenizer above (a family whose files named another would go unchecked)."""
    pre = NEW_FAMILY_VOCABULARIES[arch]
    meta = read_header(str(model_factory(arch=arch, vocab_size=4096))).kv
    assert meta["tokenizer.ggml.pre"].value == pre and pre in VOCAB_FAMILIES


def test_tokenize_command_errors_are_one_line(model_factory: ModelFactory, tmp_path: Path) -> None:
    model = str(model_factory())
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00bad")
    assert_clean_error(run_cli("tokenize", model, "--file", str(tmp_path / "bin")), 2)
    assert_clean_error(run_cli("tokenize", model, "--file", str(tmp_path / "missing")), 2)
    assert_clean_error(run_cli("tokenize", str(tmp_path / "bin"), "--text", "x"), 2)
