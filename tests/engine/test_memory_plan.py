"""A session's memory plan (runtime/memory_plan.py `plan_memory`) against made-up machines: the context, the expert
cache's budget beside the KV cache, the KV cache in files when it would leave the expert cache less than its
minimum, and the lines said about it."""

from __future__ import annotations

from tokenwing.models.common import StateSpec
from tokenwing.models.hparams import HParams
from tokenwing.runtime.memory_plan import MemoryPlan, plan_memory
from tokenwing.streaming.memory import HEADROOM, MemoryInfo

GIB, MIB = 1 << 30, 1 << 20
HP = HParams(
    arch="qwen3moe",
    n_layer=4,
    n_embd=256,
    n_head=8,
    n_head_kv=8,
    head_dim=128,
    n_ctx_train=32768,
    rms_eps=1e-6,
    rope_base=1e4,
    n_expert=8,
    n_expert_used=2,
    n_dense_lead=0,
    vocab_size=1000,
    n_rot=128,
)
KV = 16 * 1024  # F16: 4 layers × 1024 × (K + V) × 2 bytes a position
ROOMY = MemoryInfo(total=64 * GIB, available=32 * GIB, limit=64 * GIB, used_in_group=0)
CAPPED = MemoryInfo(total=64 * GIB, available=32 * GIB, limit=1 * GIB, used_in_group=0)  # a 1 GiB cgroup limit


def _plan(
    info: MemoryInfo,
    n_ctx: int = 32768,
    ram_budget: int | None = None,
    least: int = 600 * MIB,
    states: list[StateSpec | None] | None = None,
    checkpoints: int = 0,
    kv: int = KV,
) -> MemoryPlan:
    return plan_memory(
        HP,
        kv,
        states or [None] * HP.n_layer,
        n_ctx=n_ctx,
        max_batch=64,
        checkpoints=checkpoints,
        ram_budget=ram_budget,
        weights_bytes=100 * MIB,
        least_expert_bytes=least,
        model_dir="/models/here",
        info=info,
    )


def test_with_room_the_kv_cache_stays_in_ram_beside_the_expert_cache() -> None:
    plan = _plan(ROOMY)
    assert plan.n_ctx == 32768 and plan.kv_bytes == 32768 * 16 * 1024 == 512 * MIB
    assert plan.spill is None and plan.spill_note is None and plan.notes == ()
    # the expert cache takes what is free beside the headroom, the KV cache and the graph's reserve
    assert plan.budget == ROOMY.available - HEADROOM - plan.kv_bytes - plan.graph_mem
    assert plan.without_spill() == plan


def test_a_budget_below_the_minimum_with_a_kv_cache_spills_it_to_files() -> None:
    plan = _plan(CAPPED)
    beside_kv = CAPPED.limit - plan.kv_bytes - plan.graph_mem  # what the expert cache would get with it in RAM
    assert 0 < beside_kv < 600 * MIB
    assert plan.spill == "/models/here"
    # its pages are reclaimable: the expert cache is planned without it
    assert plan.budget == CAPPED.limit - plan.graph_mem
    assert plan.notes == ()  # (the spill's line is said once its files exist)
    assert plan.spill_note == (
        "the KV cache for 32768 tokens (512.00 MiB) would leave the expert cache less than its minimum under the "
        "memory limit: it is kept in files beside the model, which the limit can reclaim (slower: attention then "
        "reads them back from the drive)"
    )
    # the files cannot be made: the cache stays in RAM and the expert cache is planned beside it again
    in_ram = plan.without_spill()
    assert in_ram.spill is None and in_ram.spill_note is None and in_ram.budget == beside_kv
    assert (in_ram.n_ctx, in_ram.graph_mem, in_ram.notes) == (plan.n_ctx, plan.graph_mem, plan.notes)
    # with no KV cache (a layer with a recurrent state keeps none) there is nothing to spill, whatever the budget
    assert _plan(CAPPED, least=CAPPED.limit, kv=0).spill is None


def test_a_budget_at_the_minimum_keeps_the_kv_cache_in_ram() -> None:
    beside_kv = _plan(CAPPED).without_spill().budget
    plan = _plan(CAPPED, least=beside_kv)
    assert plan.spill is None and plan.budget == beside_kv
    assert _plan(CAPPED, least=beside_kv + 1).spill is not None


def test_a_given_ram_budget_never_spills() -> None:
    plan = _plan(CAPPED, ram_budget=64 * MIB)
    assert plan.spill is None and plan.spill_note is None and plan.budget == 64 * MIB


def test_the_notes_say_what_was_cut_in_order() -> None:
    # the model's context (none asked for) capped so the KV cache takes at most half of what is left
    plan = _plan(CAPPED, n_ctx=0, least=0)
    assert plan.n_ctx < HP.n_ctx_train
    assert plan.notes == (f"context capped at {plan.n_ctx} tokens so the KV cache fits in memory",)
    # ... after the recurrent-state checkpoints that fit in a 32nd of usable memory (each 4 MiB here: 7 of 8)
    states: list[StateSpec | None] = [StateSpec((3, 1024), (128, 128, 64)), *[None] * (HP.n_layer - 1)]
    plan = _plan(CAPPED, n_ctx=0, least=0, states=states, checkpoints=8)
    assert plan.states.checkpoints == 7
    assert plan.notes == (
        "prompt caching keeps 7 recurrent-state checkpoints, not 8: each takes 4 MiB and they may take a 32nd "
        "of memory",
        f"context capped at {plan.n_ctx} tokens so the KV cache fits in memory",
    )


def test_auto_slots_take_little_from_the_expert_cache() -> None:
    """`--parallel auto`: small caches give the most slots; the caches beyond the first never take more than a
    16th of usable memory from the expert cache (one person chatting with a large model keeps its speed), and a
    context that fills memory leaves one."""
    small = _plan(ROOMY, n_ctx=4096)  # 64 MiB a slot
    assert small.slots_that_fit(100 * MIB, 4) == 4
    large = _plan(ROOMY, n_ctx=32768, kv=256 * 1024)  # 8 GiB a slot, a 16th of 32 GiB usable is 2 GiB
    assert large.slots_that_fit(100 * MIB, 4) == 1
    middle = _plan(ROOMY, n_ctx=32768, kv=32 * 1024)  # 1 GiB a slot: two more fit in 2 GiB
    assert middle.slots_that_fit(100 * MIB, 4) == 3
    four = plan_memory(
        HP,
        32 * 1024,
        [None] * HP.n_layer,
        n_ctx=32768,
        max_batch=64,
        checkpoints=0,
        ram_budget=None,
        weights_bytes=100 * MIB,
        least_expert_bytes=600 * MIB,
        model_dir="/m",
        info=ROOMY,
        n_seq=3,
    )
    assert middle.budget - four.budget <= ROOMY.usable // 16  # what the extra slots took from the experts
    capped = _plan(CAPPED, n_ctx=0)  # the context was capped to fill the room: one slot
    assert capped.slots_that_fit(100 * MIB, 4) == 1


def test_a_huge_model_context_is_capped_with_a_graph_for_the_capped_context() -> None:
    """Issue 41: a model whose context_length is millions of positions (16 M here, the validator's most) got a
    compute graph sized for all of them (4 bytes × heads × batch × positions: 128 GiB), which the OS was then
    asked for; now the context is capped to what fits beside its own graph, and the graph sized for it."""
    import dataclasses

    from tokenwing.format.validate import MAX_CONTEXT

    hp = dataclasses.replace(HP, n_ctx_train=MAX_CONTEXT)
    plan = plan_memory(
        hp,
        KV,
        [None] * hp.n_layer,
        n_ctx=0,
        max_batch=64,
        checkpoints=0,
        ram_budget=None,
        weights_bytes=100 * MIB,
        least_expert_bytes=0,
        model_dir="/m",
        info=CAPPED,
    )
    assert 256 <= plan.n_ctx < MAX_CONTEXT
    assert plan.graph_mem < CAPPED.usable
    room = CAPPED.usable - HEADROOM - plan.graph_mem - 100 * MIB
    assert plan.kv_bytes <= room // 2  # plan_context's rule, with the graph of this context
    assert plan.notes == (f"context capped at {plan.n_ctx} tokens so the KV cache fits in memory",)


def test_a_context_whose_graph_no_machine_has_is_refused_naming_it() -> None:
    import pytest

    from tokenwing.errors import BadInputError

    with pytest.raises(BadInputError, match=r"^--ctx 16777216 needs a compute graph of .* more than the"):
        _plan(ROOMY, n_ctx=1 << 24)


def test_a_graph_no_machine_of_this_size_has_is_refused_naming_its_fields() -> None:
    """Issue 41: every field passed its range, yet the graph they size (a 4 M-token vocabulary's logits for a
    64-token batch, twice: 2 GiB) is more than this 1 GiB machine has at all. The plan gave it to the session,
    which asked ggml for it (an abort, or the OOM killer); now it is one line naming the fields."""
    import dataclasses

    import pytest

    from tokenwing.errors import BadInputError
    from tokenwing.format.validate import MAX_VOCAB

    hp = dataclasses.replace(HP, vocab_size=MAX_VOCAB)
    for n_ctx in (0, 4096):  # the model's context (capped to fit) and one asked for
        with pytest.raises(BadInputError) as e:
            plan_memory(
                hp,
                KV,
                [None] * hp.n_layer,
                n_ctx=n_ctx,
                max_batch=64,
                checkpoints=0,
                ram_budget=None,
                weights_bytes=100 * MIB,
                least_expert_bytes=0,
                model_dir="/m",
                info=CAPPED,
            )
        line = str(e.value)
        assert line.startswith("the model needs 2.") and "more than the 1.00 GiB this machine has" in line, line
        assert "of it for the compute graph (batches of 64 tokens;" in line and "a vocabulary of 4,194,304" in line
        assert "\n" not in line
    assert _plan(ROOMY).graph_mem < ROOMY.limit  # (the same model on a machine that has it: planned)


def test_resident_weights_beyond_the_machine_are_refused() -> None:
    import pytest

    from tokenwing.errors import BadInputError
    from tokenwing.runtime.memory_plan import RESIDENT_WEIGHTS, refuse_beyond_machine

    with pytest.raises(BadInputError, match=r"of it for the resident weights \(the file's tensors other than"):
        refuse_beyond_machine({RESIDENT_WEIGHTS: 2 * GIB}, CAPPED)
    refuse_beyond_machine({RESIDENT_WEIGHTS: 2 * GIB}, ROOMY)  # (what could run is never refused)
