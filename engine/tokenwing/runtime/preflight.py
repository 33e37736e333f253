"""What a start checks in a model file's metadata before it loads anything, in one place: Session runs it, and
so do `tokenwing verify` and serve's check before its handshake, so a file `verify` calls ok is one that an
engine start accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenwing.errors import BadInputError
from tokenwing.format.reader import ModelFile
from tokenwing.models import check_model
from tokenwing.models.base import MoEModel
from tokenwing.models.hparams import HParams
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.render_worker import TemplateBudgetError
from tokenwing.text.tokenizer import TextTokenizer, tokenizer_from_metadata


@dataclass
class Preflight:
    meta: dict[str, Any]
    model_class: type[MoEModel]
    hp: HParams
    tokenizer: TextTokenizer
    chat_template: ChatTemplate | None
    widths: dict[int, int]  # streamed layer → the width of its experts (multi-token-prediction blocks included)


def preflight(mf: ModelFile, probe_template: bool = False) -> Preflight:
    """Architecture, hyper-parameters, tokenizer, chat template and tensor shapes (one line and the exit code of
    the engine's refusal otherwise). `probe_template` (verify, serve): the chat template renders a one-message
    chat within its budget (text/render_worker.py), or the model is refused — a template that breaks it for any
    conversation is the file's fault, not a request's."""
    path = mf.path
    meta = {k: v.value for k, v in mf.header.kv.items()}
    model_class, hp = check_model(meta, mf.arch, mf.resident, mf.index.layers, path)
    tokenizer = tokenizer_from_metadata(meta, path)
    chat_template = _chat_template(meta, tokenizer)
    widths = {el.layer: el.shapes[0][0] for el in mf.index.layers}
    if probe_template and chat_template is not None:
        try:
            chat_template.render([{"role": "user", "content": "Hello"}])
        except TemplateBudgetError as e:
            raise BadInputError(f"{path}: {e} (rendering a one-message chat)") from None
        except BadInputError:
            pass  # (a template may refuse a conversation: that is a request's matter)
    return Preflight(meta, model_class, hp, tokenizer, chat_template, widths)


def _chat_template(meta: dict[str, Any], tokenizer: TextTokenizer) -> ChatTemplate | None:
    """The file's chat template, with its BOS and EOS tokens' texts as the template sees them (MiniMax's marks
    every turn with them, DeepSeek's starts with BOS), as llama.cpp and Hugging Face pass them. Where the
    tokenizer adds the BOS token itself, a prompt's leading BOS text is dropped (llama.cpp does the same)."""
    source = meta.get("tokenizer.chat_template")
    if not isinstance(source, str):
        return None

    def text(token: object) -> str | None:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < tokenizer.vocab_size:
            return None
        return tokenizer.decode([token], skip_special=False)

    return ChatTemplate(
        source,
        text(tokenizer.bos_id),
        text(meta.get("tokenizer.ggml.eos_token_id")),
        drop_leading_bos=tokenizer.add_bos,
    )
