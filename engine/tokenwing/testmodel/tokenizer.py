"""The test models' tokenizers: byte-level BPE with one of llama.cpp's pre-tokenisers, each family with its own
special tokens and chat template (`qwen2` with ChatML, `deepseek-v3`, `kimi-k2`, `gpt-4o` for gpt-oss).

Trained deterministically on the built-in corpus with the `tokenizers` library, then padded up to the requested
vocabulary size (the vocabulary must match the embedding's rows) the way each family's converted GGUF pads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from tokenwing.testmodel import templates
from tokenwing.testmodel.corpus import CORPUS, MULTILINGUAL
from tokenwing.text import tokenizer as engine_tokenizer

CHATML_TEMPLATE = templates.CHATML

TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4  # an added token that is not special (llama.cpp splits it from plain text too)
TOKEN_UNUSED = 5


@dataclass(frozen=True)
class Family:
    """What a converted GGUF of one model family carries besides its trained tokens."""

    pre: str  # tokenizer.ggml.pre
    specials: tuple[tuple[str, int], ...]  # (text, token type), after the trained tokens
    bos: str
    eos: str
    pad: str
    add_bos: bool
    padding: str  # name of padding token i ({i}) or of the token with id n ({n})
    padding_type: int
    chat_template: str
    corpus: str
    coarse: bool = True  # train on whitespace-separated pieces (see _training_split)


_C, _U = TOKEN_CONTROL, TOKEN_USER_DEFINED

FAMILIES: dict[str, Family] = {
    "qwen2": Family(
        "qwen2",
        (("<|endoftext|>", _C), ("<|im_start|>", _C), ("<|im_end|>", _C)),
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        add_bos=False,
        padding="<|reserved_{i}|>",
        padding_type=_C,
        chat_template=templates.CHATML,
        corpus=CORPUS,
        coarse=False,
    ),
    # DeepSeek-V3/V3.1: fullwidth-bar markers; the chat roles, tool markers and V3.1's think tags are added
    # tokens that are not special (user-defined in the GGUF); placeholders pad the vocabulary.
    "deepseek-v3": Family(
        "deepseek-v3",
        (
            ("<｜begin▁of▁sentence｜>", _C),
            ("<｜end▁of▁sentence｜>", _C),
            ("<｜▁pad▁｜>", _C),
            ("<｜fim▁hole｜>", _C),
            ("<｜fim▁begin｜>", _C),
            ("<｜fim▁end｜>", _C),
            ("<｜User｜>", _U),
            ("<｜Assistant｜>", _U),
            ("<｜tool▁calls▁begin｜>", _U),
            ("<｜tool▁calls▁end｜>", _U),
            ("<｜tool▁call▁begin｜>", _U),
            ("<｜tool▁call▁end｜>", _U),
            ("<｜tool▁sep｜>", _U),
            ("<think>", _U),
            ("</think>", _U),
        ),
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        pad="<｜end▁of▁sentence｜>",
        add_bos=True,
        padding="<｜place▁holder▁no▁{i}｜>",
        padding_type=_C,
        chat_template=templates.DEEPSEEK_V3,
        corpus=CORPUS + MULTILINGUAL,
    ),
    # Kimi K2: tiktoken ranks converted to BPE merges; its special tokens are control tokens, ids without a
    # token are written as [PAD<id>] of type unused (llama.cpp's converter).
    "kimi-k2": Family(
        "kimi-k2",
        (
            ("[BOS]", _C),
            ("[EOS]", _C),
            ("<|im_end|>", _C),
            ("<|im_user|>", _C),
            ("<|im_assistant|>", _C),
            ("<|start_header_id|>", _C),
            ("<|end_header_id|>", _C),
            ("[EOT]", _C),
            ("<|im_system|>", _C),
            ("<|tool_calls_section_begin|>", _C),
            ("<|tool_calls_section_end|>", _C),
            ("<|tool_call_begin|>", _C),
            ("<|tool_call_argument_begin|>", _C),
            ("<|tool_call_end|>", _C),
            ("<|im_middle|>", _C),
            ("[UNK]", _C),
            ("[PAD]", _C),
        ),
        bos="[BOS]",
        eos="[EOS]",
        pad="[PAD]",
        add_bos=False,
        padding="[PAD{n}]",
        padding_type=TOKEN_UNUSED,
        chat_template=templates.KIMI_K2,
        corpus=CORPUS + MULTILINGUAL,
    ),
    # gpt-oss (o200k_harmony): the harmony markers are control tokens in the GGUF (llama.cpp turns
    # <|channel|>, <|message|>, <|start|>, <|constrain|> and <|end|> into user-defined ones when loading).
    "gpt-4o": Family(
        "gpt-4o",
        (
            ("<|startoftext|>", _C),
            ("<|endoftext|>", _C),
            ("<|return|>", _C),
            ("<|constrain|>", _C),
            ("<|channel|>", _C),
            ("<|start|>", _C),
            ("<|end|>", _C),
            ("<|message|>", _C),
            ("<|call|>", _C),
            ("<|endofprompt|>", _C),
        ),
        bos="<|startoftext|>",
        eos="<|return|>",
        pad="<|endoftext|>",
        add_bos=False,
        padding="<|reserved_{n}|>",
        padding_type=_C,
        chat_template=templates.HARMONY,
        corpus=CORPUS + MULTILINGUAL,
    ),
}


@dataclass
class Vocabulary:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int
    pad_id: int
    trained: Tokenizer  # the `tokenizers` model the vocabulary came from (tests compare llama.cpp with it)
    chat_template: str = CHATML_TEMPLATE
    pre: str = "qwen2"
    bos_id: int = 0
    add_bos: bool = False


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown tokenizer {name!r} (choose from {', '.join(FAMILIES)})") from None


def min_vocab(name: str = "qwen2") -> int:
    return 256 + len(family(name).specials)


MIN_VOCAB = min_vocab()


def pre_tokenizer(pre: str = "qwen2") -> pre_tokenizers.PreTokenizer:
    return engine_tokenizer.pre_tokenizer(pre)


def _training_split(fam: Family) -> pre_tokenizers.PreTokenizer:
    """The multilingual families learn merges on whitespace-led runs (" word中文123!"), across the letter,
    digit, script, case and punctuation boundaries their pre-tokenizers cut at: a split made differently
    from llama.cpp then yields different ids, which is what the tokenizer oracle tests need to see."""
    if not fam.coarse:
        return pre_tokenizer(fam.pre)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s+"), behavior="merged_with_next"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_vocabulary(vocab_size: int, name: str = "qwen2") -> Vocabulary:
    """A byte-level BPE vocabulary of exactly `vocab_size` tokens (specials and padding at the end)."""
    fam = family(name)
    if vocab_size < min_vocab(name):
        raise ValueError(f"vocabulary must have at least {min_vocab(name)} tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _training_split(fam)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(fam.specials),
        min_frequency=1 if fam.coarse else 2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator([fam.corpus], trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TOKEN_NORMAL] * len(tokens)
    tokens += [text for text, _ in fam.specials]
    types += [ty for _, ty in fam.specials]
    pad = vocab_size - len(tokens)
    tokens += [fam.padding.format(i=i, n=len(tokens) + i) for i in range(pad)]
    types += [fam.padding_type] * pad
    ids = {t: i for i, t in enumerate(tokens)}
    return Vocabulary(
        tokens,
        types,
        merges,
        eos_id=ids[fam.eos],
        pad_id=ids[fam.pad],
        trained=tok,
        chat_template=fam.chat_template,
        pre=fam.pre,
        bos_id=ids[fam.bos],
        add_bos=fam.add_bos,
    )
