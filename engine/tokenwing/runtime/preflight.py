"""What a start checks in a model file's metadata before it loads anything, in one place: Session runs it, and
so do `tokenwing verify` and serve's check before its handshake, so a file `verify` calls ok is one that an
engine start accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenwing.errors import BadInputError
from tokenwing.format.reader import ModelFile
from tokenwing.models import family
from tokenwing.models.base import MoEModel
from tokenwing.models.hparams import HParams, read_hparams
from tokenwing.text.chat import ChatTemplate
from tokenwing.text.tokenizer import TextTokenizer, tokenizer_from_metadata


@dataclass
class Preflight:
    meta: dict[str, Any]
    model_class: type[MoEModel]
    hp: HParams
    tokenizer: TextTokenizer
    chat_template: ChatTemplate | None
    widths: dict[int, int]  # streamed layer → the width of its experts (multi-token-prediction blocks included)


def preflight(mf: ModelFile) -> Preflight:
    """Architecture, hyper-parameters, tokenizer, chat template and tensor shapes (one line and the exit code of
    the engine's refusal otherwise)."""
    path = mf.path
    meta = {k: v.value for k, v in mf.header.kv.items()}
    model_class = family(mf.arch)
    hp = read_hparams(meta, mf.arch, path, model_class.recurrence)
    tokenizer = tokenizer_from_metadata(meta, path)
    template = meta.get("tokenizer.chat_template")
    chat_template = ChatTemplate(template) if isinstance(template, str) else None
    widths = {el.layer: el.shapes[0][0] for el in mf.index.layers}
    if any(layer >= hp.n_layer + hp.n_mtp for layer in widths):
        raise BadInputError(f"{path}: experts of a layer beyond block_count")
    # Multi-token-prediction blocks come last: neither their tensors (kept in the file) nor their experts are
    # read (ExpertScheduler streams the layers that run).
    shapes = {t.name: t.shape for t in mf.resident}
    model_class.check(hp, shapes, {k: v for k, v in widths.items() if k < hp.n_layer}, path)
    return Preflight(meta, model_class, hp, tokenizer, chat_template, widths)
