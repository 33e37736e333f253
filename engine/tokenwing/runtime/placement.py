"""Where a run's weights go on a GPU (spec §5, §12): the VRAM budget, less what the device computes with, goes
first to whole layers' always-used weights and their KV cache (in layer order), then to the output head, then to
a hot-expert cache with the same number of slots in every streamed layer (all of them: every expert in VRAM).

Sizes only, from the model's geometry and the budget (never a constant for one machine); the VRAM tier
(runtime/vram/weights.py) places them. A plan that places nothing is the CPU path, with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import human_bytes
from tokenwing.models.hparams import HParams

# Device buffers align each tensor (CUDA and Vulkan: 256 bytes at most here); the plan pads every tensor so.
TENSOR_ALIGN = 256
# Spare room for the decode graphs' own buffers (one per layer on the device) and the driver's rounding.
SLACK = 1 << 20
# A prompt's experts run on the GPU in waves copied from RAM into two sets of this many places (one computes
# while the next is copied in): enough to keep a GPU busy, little VRAM.
WAVE_PLACES = 8


def padded(nbytes: int) -> int:
    return -(-nbytes // TENSOR_ALIGN) * TENSOR_ALIGN


@dataclass(frozen=True)
class LayerCost:
    """A layer's bytes on the device: its always-used weights, and its KV cache for the whole context."""

    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


@dataclass(frozen=True)
class VramPlan:
    budget: int
    # compute buffers: a prompt chunk's graph, the decode graphs, the prompt waves' places (lending: decode's only)
    reserve: int
    layers: tuple[int, ...]  # layers whose always-used weights and KV cache live in VRAM
    head: bool  # the output norm and head in VRAM
    expert_slots: int  # VRAM expert slots in each streamed layer (n_expert: every expert)
    n_expert: int
    layer_bytes: int
    head_bytes: int
    expert_bytes: int  # all the slots of all streamed layers
    kept: int = 0  # left free for the image encoder's weights and compute buffer (`plan_keeping`)

    @property
    def empty(self) -> bool:
        return not self.layers and not self.head and self.expert_slots == 0

    @property
    def used(self) -> int:
        return self.reserve + self.layer_bytes + self.head_bytes + self.expert_bytes

    def describe(self) -> str:
        experts = (
            "every expert"
            if self.expert_slots >= self.n_expert
            else f"{self.expert_slots} of {self.n_expert} experts per layer"
        )
        return (
            f"{len(self.layers)} layers' attention and always-used weights ({human_bytes(self.layer_bytes)}), "
            f"{'the output head, ' if self.head else ''}{experts} ({human_bytes(self.expert_bytes)}) and "
            f"{human_bytes(self.reserve)} of compute buffers in VRAM"
            + (f", {human_bytes(self.kept)} kept for the image encoder" if self.kept else "")
        )


def device_reserve(hp: HParams, batch: int, n_ctx: int, wave_expert_bytes: int) -> int:
    """VRAM a prompt chunk of `batch` tokens computes with (as memory_plan.graph_bytes reckons a CPU graph: the
    hidden states, attention scores over the context, router outputs, the experts' intermediate rows, logits),
    the prompt waves' two sets of expert places, and slack for the decode graphs."""
    per_token = 4 * (
        8 * hp.n_embd + 3 * hp.n_head * hp.head_dim + 4 * hp.n_expert + 4 * hp.n_expert_used * hp.n_embd + hp.vocab_size
    )
    attn = 4 * hp.n_head * batch * n_ctx
    return batch * per_token * 2 + attn + 2 * WAVE_PLACES * wave_expert_bytes + SLACK


def decode_reserve(hp: HParams, n_ctx: int, wave_expert_bytes: int) -> int:
    """What `device_reserve` keeps apart when a prompt's compute buffer is lent by the expert cache
    (`--vram-lend`): the decode graphs' own (one token over the context: its attention scores, the head's logits,
    a token's k expert rows) and the prompt waves' places."""
    return device_reserve(hp, 1, n_ctx, wave_expert_bytes)


def plan_vram(
    budget: int,
    reserve: int,
    layers: Sequence[LayerCost],
    head: int,
    expert_bytes: Sequence[int],
    n_expert: int,
) -> VramPlan:
    """The plan for `budget` bytes: `layers` (every layer's cost, in order), `head` (the output head's bytes),
    `expert_bytes` (one expert's gate, up and down on the device, per streamed layer)."""
    room = budget - reserve
    on: list[int] = []
    layer_bytes = 0
    for il, cost in enumerate(layers):
        if layer_bytes + cost.total > room:
            break
        on.append(il)
        layer_bytes += cost.total
    room -= layer_bytes
    head_on = 0 < head <= room
    room -= head if head_on else 0
    row = sum(expert_bytes)
    slots = min(n_expert, room // row) if row and room > 0 else 0
    return VramPlan(
        budget=budget,
        reserve=reserve,
        layers=tuple(on),
        head=head_on,
        expert_slots=int(slots),
        n_expert=n_expert,
        layer_bytes=layer_bytes,
        head_bytes=head if head_on else 0,
        expert_bytes=int(slots) * row,
    )


def plan_keeping(
    budget: int,
    reserve: int,
    layers: Sequence[LayerCost],
    head: int,
    expert_bytes: Sequence[int],
    n_expert: int,
    keep: int,
) -> VramPlan:
    """`plan_vram` with `keep` bytes of the budget left free for the image encoder (issue 45 item 6: the vision tower
    on the GPU when the tier has room), taken from the expert cache only: where the text model's own placement (the
    layers and head `plan_vram` places) no longer fits beside them, nothing is kept and the encoder computes on the
    CPU. (A layer in VRAM saves every token its CPU pass; an image is encoded once.)"""
    plan = plan_vram(budget, reserve, layers, head, expert_bytes, n_expert)
    if keep <= 0:
        return plan
    kept = plan_vram(budget, reserve + keep, layers, head, expert_bytes, n_expert)
    if (kept.layers, kept.head) != (plan.layers, plan.head):
        return plan
    return dataclasses.replace(kept, reserve=reserve, kept=keep)


def plan_for_file(
    mf: ModelFile, hp: HParams, budget: int, n_ctx: int, max_batch: int = 64, lend: bool = False
) -> VramPlan:
    """The plan a run of this model file would make for `budget` (before loading it: `tokenwing autotune`), from
    the file's tensor sizes; the KV cache as an F16 cache of every KV head (MLA's smaller cache is overcounted).
    `lend`: as `--vram-lend` plans it (decode's compute buffers kept apart, the prompt's borrowed)."""
    kv_row = 2 * hp.n_head_kv * max(hp.head_dim, hp.head_dim_v) * 2  # K and V, F16, per position and layer
    weights = [0] * hp.n_layer
    for t in mf.resident:
        parts = t.name.split(".", 2)
        if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < hp.n_layer:
            weights[int(parts[1])] += padded(t.nbytes)
    decode = 4 * (2 * hp.n_head * n_ctx + 16 * hp.n_embd + 4 * hp.n_expert + 4 * hp.n_head * hp.head_dim)
    costs = [LayerCost(w, padded(kv_row * n_ctx) + decode) for w in weights]
    sizes = {t.name: t.nbytes for t in mf.resident}
    out = sizes.get("output.weight", sizes.get("token_embd.weight", 0))
    head = padded(sizes.get("output_norm.weight", 0)) + padded(out)
    layers = [el for el in mf.index.layers if el.layer < hp.n_layer]
    expert_bytes = [sum(padded(n) for n in el.proj_size) for el in layers]
    geometries = {(el.types, el.shapes): sum(padded(n) for n in el.proj_size) for el in layers}
    wave = sum(geometries.values())
    reserve = decode_reserve(hp, n_ctx, wave) if lend else device_reserve(hp, max_batch, n_ctx, wave)
    return plan_vram(budget, reserve, costs, head, expert_bytes, mf.index.n_expert)
