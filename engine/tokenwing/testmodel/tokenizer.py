"""The test models' tokenizers: byte-level BPE with one of llama.cpp's pre-tokenisers, each family with its own
special tokens and chat template (`qwen2` with ChatML, `deepseek-v3`, `kimi-k2`, `gpt-4o` for gpt-oss).

Trained deterministically on the built-in corpus with the `tokenizers` library, then padded up to the requested
vocabulary size (the vocabulary must match the embedding's rows) the way each family's converted GGUF pads.
"""

from __future__ import annotations

import dataclasses
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
    model: str = "gpt2"  # tokenizer.ggml.model: gpt2 (byte-level BPE) or llama (SentencePiece)
    eot: str = ""  # a second end-of-turn token the file names (tokenizer.ggml.eot_token_id)
    # whole words added as plain tokens with no merges that build them: only a pre-tokenizer that takes a piece
    # that is a token as that token (llama.cpp's ignore_merges) ever produces them
    words: tuple[str, ...] = ()


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
    # Qwen3.5: ChatML, with the reasoning and tool-call tags as added tokens that are not special.
    "qwen35": Family(
        "qwen35",
        (
            ("<|endoftext|>", _C),
            ("<|im_start|>", _C),
            ("<|im_end|>", _C),
            ("<think>", _U),
            ("</think>", _U),
            ("<tool_call>", _U),
            ("</tool_call>", _U),
        ),
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        add_bos=False,
        padding="<|reserved_{i}|>",
        padding_type=_C,
        chat_template=templates.CHATML,
        corpus=CORPUS + MULTILINGUAL,
    ),
    # GLM-4.5 .. GLM-5: role markers are control tokens, the reasoning and tool tags added ones; the file's
    # BOS is ignored by llama.cpp (the template writes [gMASK]<sop>).
    "glm4": Family(
        "glm4",
        (
            ("<|endoftext|>", _C),
            ("[MASK]", _C),
            ("[gMASK]", _C),
            ("[sMASK]", _C),
            ("<sop>", _C),
            ("<eop>", _C),
            ("<|system|>", _C),
            ("<|user|>", _C),
            ("<|assistant|>", _C),
            ("<|observation|>", _C),
            ("<think>", _U),
            ("</think>", _U),
            ("<tool_call>", _U),
            ("</tool_call>", _U),
            ("<arg_key>", _U),
            ("</arg_key>", _U),
        ),
        bos="[gMASK]",
        eos="<|endoftext|>",
        eot="<|user|>",
        pad="<|endoftext|>",
        add_bos=False,
        padding="<|reserved_{i}|>",
        padding_type=_C,
        chat_template=templates.GLM4,
        corpus=CORPUS + MULTILINGUAL,
        words=(" zebras", " vexingly", "模型只读取需要的专家", " Straße"),
    ),
    # Ling 2.0 / 3.0 (bailingmoe2, bailingmoe3)
    "bailingmoe2": Family(
        "bailingmoe2",
        (
            ("<|startoftext|>", _C),
            ("<|endoftext|>", _C),
            ("<|role_end|>", _C),
            ("<role>", _U),
            ("</role>", _U),
            ("<think>", _U),
            ("</think>", _U),
        ),
        bos="<|startoftext|>",
        eos="<|role_end|>",
        pad="<|endoftext|>",
        add_bos=False,
        padding="<|reserved_token_{i}|>",
        padding_type=_C,
        chat_template=templates.LING,
        corpus=CORPUS + MULTILINGUAL,
    ),
    # MiniMax M2: its odd role markers are control tokens
    "minimax-m2": Family(
        "minimax-m2",
        (
            ("]~!b[", _C),
            ("]~b]", _C),
            ("[e~[", _C),
            ("<think>", _U),
            ("</think>", _U),
            ("<minimax:tool_call>", _U),
            ("</minimax:tool_call>", _U),
        ),
        bos="]~!b[",
        eos="[e~[",
        pad="[e~[",
        add_bos=False,
        padding="<reserved_{i}>",
        padding_type=_C,
        chat_template=templates.MINIMAX_M2,
        corpus=CORPUS + MULTILINGUAL,
    ),
    # Mistral's tekken (Mistral Small 3.1+, Small 4): <unk>, <s>, </s> and the instruction markers are control
    # tokens (the real vocabulary has them first, then <SPECIAL_n> up to 1,000), a BOS added, whole tokens unmerged
    "tekken": Family(
        "tekken",
        (
            ("<unk>", _C),
            ("<s>", _C),
            ("</s>", _C),
            ("[INST]", _C),
            ("[/INST]", _C),
            ("[SYSTEM_PROMPT]", _C),
            ("[/SYSTEM_PROMPT]", _C),
            ("[TOOL_CALLS]", _C),
            ("[THINK]", _C),
            ("[/THINK]", _C),
        ),
        bos="<s>",
        eos="</s>",
        pad="<unk>",
        add_bos=True,
        padding="<SPECIAL_{n}>",
        padding_type=_C,
        chat_template=templates.MISTRAL_V7,
        corpus=CORPUS + MULTILINGUAL,
        words=(" zebras", " vexingly", "Straße"),
    ),
    # A file that names no pre-tokenizer type of its own
    "default": Family(
        "default",
        (("<|endoftext|>", _C), ("<|im_start|>", _C), ("<|im_end|>", _C)),
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        add_bos=False,
        padding="<|reserved_{i}|>",
        padding_type=_C,
        chat_template=templates.CHATML,
        corpus=CORPUS + MULTILINGUAL,
    ),
    # ERNIE 4.5: a SentencePiece vocabulary (<unk>, <s>, </s>, then the 256 byte tokens, then the pieces, scored
    # by merge order), a space put before the text; its chat markers are control tokens.
    "spm": Family(
        "default",
        (("<|begin_of_sentence|>", _C), ("<|end_of_sentence|>", _C), ("<think>", _U), ("</think>", _U)),
        bos="<s>",
        eos="</s>",
        eot="<|end_of_sentence|>",
        pad="<unk>",
        add_bos=False,
        padding="<mask:{i}>",
        padding_type=_C,
        chat_template=templates.ERNIE,
        corpus=CORPUS + MULTILINGUAL,
        model="llama",
    ),
}

# DeepSeek V4: its files name the pre-tokenizer `joyai-llm` (its tokenizer hashes as JoyAI-LLM-Flash's in llama.cpp's
# converter), which llama.cpp splits exactly as `deepseek-v3`; the markers and template here are V3's.
FAMILIES["joyai-llm"] = dataclasses.replace(FAMILIES["deepseek-v3"], pre="joyai-llm")


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
    model: str = "gpt2"
    scores: list[float] | None = None  # SentencePiece: each token's score
    eot_id: int | None = None


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown tokenizer {name!r} (choose from {', '.join(FAMILIES)})") from None


_SPM_FIXED = ("<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)))
_SPM_FIXED_TYPES = (2, _C, _C, *([6] * 256))


def min_vocab(name: str = "qwen2") -> int:
    fam = family(name)
    return 256 + len(fam.specials) + (len(_SPM_FIXED) if fam.model == "llama" else 0)


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


def _byte_level(text: str) -> str:
    return "".join(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)[0][0])


def build_vocabulary(vocab_size: int, name: str = "qwen2") -> Vocabulary:
    """A byte-level BPE vocabulary of exactly `vocab_size` tokens (specials and padding at the end)."""
    fam = family(name)
    if vocab_size < min_vocab(name):
        raise ValueError(f"vocabulary must have at least {min_vocab(name)} tokens")
    if fam.model == "llama":
        return _spm_vocabulary(vocab_size, fam)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _training_split(fam)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(fam.specials) - len(fam.words),
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
    known = set(tokens)
    words = [w for w in (_byte_level(w) for w in fam.words) if w not in known]
    tokens += words
    types = [TOKEN_NORMAL] * len(tokens)
    tokens += [text for text, _ in fam.specials]
    types += [ty for _, ty in fam.specials]
    pad = vocab_size - len(tokens)
    tokens += [fam.padding.format(i=i, n=len(tokens) + i) for i in range(pad)]
    types += [fam.padding_type] * pad
    return _vocabulary(fam, tokens, types, merges, tok)


def _vocabulary(
    fam: Family,
    tokens: list[str],
    types: list[int],
    merges: list[str],
    tok: Tokenizer,
    scores: list[float] | None = None,
) -> Vocabulary:
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
        model=fam.model,
        scores=scores,
        eot_id=ids[fam.eot] if fam.eot else None,
    )


def _spm_vocabulary(vocab_size: int, fam: Family) -> Vocabulary:
    """SentencePiece-style: pieces learned by BPE on words marked with U+2581, each scored by its merge order
    (a later merge scores lower, as in a SentencePiece BPE model); characters outside it fall back to bytes."""
    fixed = len(_SPM_FIXED) + len(fam.specials)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - fixed, min_frequency=1, show_progress=False, special_tokens=[], limit_alphabet=400
    )
    tok.train_from_iterator([fam.corpus], trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    learned = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    tokens = [*_SPM_FIXED, *learned, *(text for text, _ in fam.specials)]
    types = [*_SPM_FIXED_TYPES, *([TOKEN_NORMAL] * len(learned)), *(ty for _, ty in fam.specials)]
    scores = [0.0] * len(_SPM_FIXED) + [-float(i) for i in range(len(learned))] + [0.0] * len(fam.specials)
    pad = vocab_size - len(tokens)
    tokens += [fam.padding.format(i=i, n=len(tokens) + i) for i in range(pad)]
    types += [fam.padding_type] * pad
    scores += [0.0] * pad
    return _vocabulary(fam, tokens, types, [], tok, scores)
