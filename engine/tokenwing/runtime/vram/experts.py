"""The VRAM expert cache (spec §5): per streamed layer, a pool of device slots holding the hottest experts, seeded
from the usage table at start and kept hot by swaps during decode.

Swaps: recent use counts per expert (halved every 64 tokens); every 8 decode tokens at most 64 experts come in,
each only if its recent count beats 1.25 × the leaver's + 4 (an empty slot takes any used expert). The copy
comes from the expert's RAM slot: a helper thread copies the slot into pinned staging memory and checks it
against the expert's checksum (the RAM slot is protected that way: an eviction during the copy fails the check
and the swap is dropped), and between two decode steps the main thread moves staged experts into their device
slots (a copy from pinned memory) and updates the map. A token never waits for a swap: one not staged yet is
moved at a later step boundary (`pending` counts them), and the leaver serves until its newcomer is in.

Lending (`--vram-lend`, spec §11): a prompt's compute buffer is memory the cache lends it. Each layer's slots
are two tensors: its kept slots (a buffer of their own) and a lendable segment, its last `n_lend` slots. Every
layer's segment lives inside the prompts' compute buffer (`allocate(lend_buffer)`), which the VRAM tier
allocates once and never frees: freeing a ggml graph allocator's buffer left ggml-vulkan on lavapipe corrupting
the heap at a later graph, even a decode step later (runtime/vram/lending.py, `Lending.reserve_prompts`), while an
expert pool's buffer is freed safely — so the memory changes hands instead of being freed and allocated again, and a
take-back cannot fail for want of memory. A prompt overwrites the segments: `lend` first moves each layer's
hotter segment experts into the kept slots of its colder ones (what leaves VRAM is each layer's `n_lend`
coldest: device → host → device, at most `n_lend` per layer), and `take_back` fills the segments again after
the prompt. Per layer rather than whole layers' pools: that would drop a layer's hottest experts with its
coldest; and a pool's slots must be one tensor (mul_mat_id), so two per layer is the finest split, at one more
product per graph.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from tokenwing import testpause
from tokenwing.compute.backend import Backend, DeviceTensors, HostBuffer
from tokenwing.compute.ggml_lib import Tensor
from tokenwing.format.layout import ExpertLayer
from tokenwing.runtime.placement import padded

SWAP_EVERY = 8  # decode tokens between swap decisions
SWAP_MAX = 64  # experts moved in per decision, all layers together
SWAP_RATIO, SWAP_MARGIN = 1.25, 4.0  # a newcomer's recent count must beat ratio × the leaver's + margin
HALF_LIFE = 64  # tokens: recent counts halve
STAGING = 8  # experts in pinned staging memory at once
PAUSE_STAGE = "vram.stage"  # test-only: the helper thread waits before staging its first swap

# Per streamed layer, cumulative: selected experts computed from VRAM, experts swapped in and out, and the
# bytes copied to the device (seeds, swaps, a prompt's GPU waves).
COUNTERS = ["vram_hits", "vram_swaps_in", "vram_swaps_out", "vram_bytes_up"]
HITS, SWAPS_IN, SWAPS_OUT, BYTES_UP = range(4)


@dataclass(frozen=True)
class Swap:
    row: int  # streamed layer (row of the counters)
    expert: int  # comes in
    slot: int  # device slot it takes
    leaver: int  # expert leaving that slot (-1: the slot is empty)
    count: float  # the newcomer's recent count when decided
    leaver_count: float


def plan_swaps(
    recent: np.ndarray,
    expert_in: np.ndarray,
    in_ram: Callable[[int, list[int]], list[bool]],
    limit: int = SWAP_MAX,
    ratio: float = SWAP_RATIO,
    margin: float = SWAP_MARGIN,
) -> list[Swap]:
    """Swaps for every layer: recent [layers, n_expert] counts, expert_in [layers, slots] (-1 empty);
    `in_ram(row, experts)` tells which candidates are in RAM (a swap copies from the RAM slot).

    Per layer the hottest outsiders (in RAM) meet the coldest residents (empty slots first) in order while the
    rule holds; then the best gains over all layers, at most `limit`. Ties go to the lower id: the plan is a
    function of the counts alone (results never depend on timing)."""
    proposals: list[Swap] = []
    n_expert = recent.shape[1]
    for row in range(recent.shape[0]):
        resident = expert_in[row]
        held = np.zeros(n_expert, bool)
        held[resident[resident >= 0]] = True
        c = recent[row]
        out = np.flatnonzero(~held & (c > 0))
        if out.size == 0:
            continue
        out = out[np.lexsort((out, -c[out]))]
        ok = in_ram(row, out.tolist())
        out = out[np.array(ok, bool)]
        slots = np.arange(resident.size)
        leaver_count = np.where(resident >= 0, c[np.maximum(resident, 0)], -1.0)
        slots = slots[np.lexsort((np.maximum(resident, 0), leaver_count))]  # empty first, then the coldest
        for e, s in zip(out.tolist(), slots.tolist(), strict=False):
            lv = int(resident[s])
            lc = float(c[lv]) if lv >= 0 else 0.0
            if lv >= 0 and not c[e] > ratio * lc + margin:
                break
            proposals.append(Swap(row, int(e), int(s), lv, float(c[e]), lc))
    proposals.sort(key=lambda p: (-(p.count - p.leaver_count), p.row, p.expert))
    return proposals[:limit]


@dataclass
class _Staged:
    swap: Swap
    place: int  # staging place holding its bytes


@dataclass
class ExpertGeometry:
    """An expert's projections as the file lays out its record (types, shapes, offsets and sizes in it), which a
    pool's slots take byte for byte."""

    types: tuple[int, int, int]
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
    proj_offset: tuple[int, int, int]
    proj_size: tuple[int, int, int]
    record_size: int

    @classmethod
    def of(cls, el: ExpertLayer) -> ExpertGeometry:
        return cls(el.types, el.shapes, el.proj_offset, el.proj_size, el.record_size)

    @property
    def device_bytes(self) -> int:
        return sum(padded(n) for n in self.proj_size)


@dataclass
class ExpertPool:
    """One layer's device slots: gate, up and down as [cols, rows, slots] tensors (views for mul_mat_id)."""

    tensors: DeviceTensors
    views: tuple[Tensor, Tensor, Tensor]
    geometry: ExpertGeometry
    end: int = 0  # placed in another's buffer: the offset after it there

    def upload(self, slot: int, record: np.ndarray | int, wait: bool = True) -> int:
        """Copies an expert record (its bytes as the file lays them out, an array or an address) into `slot`."""
        base = record if isinstance(record, int) else int(record.ctypes.data)
        g = self.geometry
        for p in range(3):
            self.tensors.set_slot(self.views[p], slot, base + g.proj_offset[p], wait)
        return sum(g.proj_size)

    def download(self, slot: int) -> np.ndarray:
        """The record in `slot` back in host memory, laid out as `upload` takes it."""
        g = self.geometry
        out = np.zeros(g.record_size, np.uint8)
        for p in range(3):
            self.tensors.get_slot(self.views[p], slot, int(out.ctypes.data) + g.proj_offset[p])
        return out

    def close(self) -> None:
        self.tensors.close()


# A pool of n slots of a layer's geometry in a device buffer of its own, or within (buffer, offset) another's
PoolMaker = Callable[[ExpertLayer, int, tuple[int, int] | None], ExpertPool]


@dataclass
class VramExperts:
    """The VRAM expert cache of every streamed layer: pools, which expert each slot holds, recent counts, the
    swap helper thread and the counters."""

    backend: Backend
    layers: list[ExpertLayer]  # streamed layers, in row order
    n_expert: int
    n_slots: int
    ram_slot: Callable[[int, int], np.ndarray | None]  # (row, expert) → its RAM record now, None if not there
    in_ram: Callable[[int, list[int]], list[bool]]
    checksums: np.ndarray  # [rows, n_expert]
    new_pool: PoolMaker  # (runtime/vram/weights.py `new_pool`: the one maker of device tensors)
    n_lend: int = 0  # the last slots of every layer: its lendable segment, in the prompts' compute buffer
    pools: list[ExpertPool] = field(default_factory=list)  # per layer: the kept slots (all of them without lending)
    lend_pools: list[ExpertPool] = field(default_factory=list)  # per layer: its lendable segment
    expert_in: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # [rows, slots]
    slot_of: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # [rows, n_expert]
    recent: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    counters: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    decode_tokens: int = 0
    pending: int = 0  # swaps decided but not yet moved in (their copy is not staged yet)
    swap_log: list[tuple[int, Swap]] = field(default_factory=list)  # (decode token, swap) as moved in
    decisions: list[tuple[int, int]] = field(default_factory=list)  # (decode token, swaps decided)
    dropped: int = 0  # swaps whose RAM copy changed while it was copied (checksum), or left RAM first

    def __post_init__(self) -> None:
        rows = len(self.layers)
        self.expert_in = np.full((rows, self.n_slots), -1, np.int32)
        self.slot_of = np.full((rows, self.n_expert), -1, np.int32)
        self.recent = np.zeros((rows, self.n_expert))
        self.counters = np.zeros((rows, len(COUNTERS)), np.int64)
        self.row_of = {el.layer: r for r, el in enumerate(self.layers)}
        self._todo: deque[Swap] = deque()
        self._staged: deque[_Staged] = deque()
        self._free_places: deque[int] = deque(range(STAGING))
        self._lock = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._staging: HostBuffer | None = None
        self._place_bytes = 0
        self.lent = False  # the lendable segments are a prompt's now

    # -------------------------------------------------------------------------------------------- set-up
    def allocate(self, lend_buffer: int | None = None) -> None:
        """The device pools (one buffer per layer; the lendable segments in `lend_buffer`) and the swaps' pinned
        staging memory."""
        if not self.n_slots:
            return
        try:
            at = 0
            for el in self.layers:
                self.pools.append(self.new_pool(el, self.n_slots - self.n_lend, None))
                if self.n_lend:
                    assert lend_buffer is not None
                    self.lend_pools.append(self.new_pool(el, self.n_lend, (lend_buffer, at)))
                    at = self.lend_pools[-1].end
        except Exception:
            self.close()
            raise
        if self.n_slots < self.n_expert:
            self._place_bytes = max(el.record_size for el in self.layers)
            self._staging = HostBuffer(self.backend, STAGING * self._place_bytes)

    def seed(self, row: int, experts: list[int], read: Callable[[int], np.ndarray]) -> None:
        """Fills the first slots of layer `row` with `experts` (at start: `read(expert)` gives each record)."""
        for slot, e in enumerate(experts[: self.n_slots]):
            self._upload(row, slot, e, read(e))

    def _upload(self, row: int, slot: int, expert: int, record: np.ndarray | int) -> None:
        pool, at = self._pool(row, slot)
        self.counters[row, BYTES_UP] += pool.upload(at, record)
        self._place(row, expert, slot)

    def _pool(self, row: int, slot: int) -> tuple[ExpertPool, int]:
        """The buffer holding `slot` of layer `row`, and the slot's index there."""
        keep = self.n_slots - self.n_lend
        if slot < keep:
            return self.pools[row], slot
        assert not self.lent, "a lent slot"
        return self.lend_pools[row], slot - keep

    def segments(self, block: int) -> list[tuple[ExpertPool, int, int]]:
        """Layer `block`'s pools (its kept slots, its lendable segment), each with the slots it holds [lo, hi)."""
        row, keep = self.row_of[block], self.n_slots - self.n_lend
        out = [(self.pools[row], 0, keep)] if self.pools else []
        if self.lend_pools:
            out.append((self.lend_pools[row], keep, self.n_slots))
        return out

    def _place(self, row: int, expert: int, slot: int) -> None:
        self._clear(row, slot)
        self.expert_in[row, slot] = expert
        self.slot_of[row, expert] = slot

    @property
    def full(self) -> bool:
        """Every expert of every layer in VRAM: nothing to swap."""
        return self.n_slots >= self.n_expert

    # ----------------------------------------------------------------------------------------- per token
    def held(self, block: int, experts: list[int]) -> list[int]:
        """Which of these experts (a layer's selection) are in VRAM, in the order given."""
        row = self.row_of[block]
        return [e for e in experts if self.slot_of[row, e] >= 0]

    def slots(self, block: int, experts: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.slot_of[self.row_of[block]][experts]
        return out

    def observe(self, block: int, experts: list[int], hits: int) -> None:
        """A decode token's selection in layer `block` (distinct experts), `hits` of them from VRAM."""
        row = self.row_of[block]
        self.recent[row, experts] += 1.0
        self.counters[row, HITS] += hits

    def count_prompt_hits(self, block: int, hits: int) -> None:
        self.counters[self.row_of[block], HITS] += hits

    def observe_prompt(self, block: int, sel: np.ndarray) -> None:
        """A prompt's selections [n, k] count too, its last tokens most (halving every HALF_LIFE tokens back, as
        decode's counts fade): the first swaps after a prompt bring in what its end used."""
        n = sel.shape[0]
        recency = 0.5 ** ((n - 1 - np.arange(n)) / HALF_LIFE)
        np.add.at(self.recent[self.row_of[block]], sel, np.broadcast_to(recency[:, None], sel.shape))

    # ------------------------------------------------------------------------------- lending to a prompt
    def lend(self) -> None:
        """A prompt takes the lendable segments: in each layer the `n_lend` coldest experts leave VRAM (empty slots
        first, then the lowest recent count; ties: the later slot, as seeding fills slots hottest first, and the
        segment's own need no copy), and hotter ones in the segment move into the kept slots those leave
        (through host memory)."""
        if not self.n_lend or self.lent:
            return
        keep = self.n_slots - self.n_lend
        for row, pool in enumerate(self.lend_pools):
            resident = self.expert_in[row].copy()
            count = np.where(resident >= 0, self.recent[row][np.maximum(resident, 0)], -1.0)
            leaving = np.lexsort((-np.arange(self.n_slots), count))[: self.n_lend].tolist()
            gone = set(leaving)
            staying = [s for s in range(keep, self.n_slots) if s not in gone and resident[s] >= 0]
            for src, dst in zip(staying, [s for s in leaving if s < keep], strict=False):
                record = pool.download(src - keep)
                self._clear(row, src)
                self._upload(row, dst, int(resident[src]), record)
            for s in range(keep, self.n_slots):
                self._clear(row, s)
        self.lent = True

    def take_back(self, read_file: Callable[[int, int], np.ndarray]) -> None:
        """After the prompt: the segments filled with each layer's hottest experts outside VRAM (recent counts,
        which weight the prompt's end most; ties: the lower id), from their RAM slots where resident and intact,
        else `read_file(row, expert)`; the copies count in vram_bytes_up."""
        if not self.lent:
            return
        self.lent = False
        keep = self.n_slots - self.n_lend
        for row in range(len(self.layers)):
            c = self.recent[row]
            outside = [int(e) for e in np.lexsort((np.arange(self.n_expert), -c)) if self.slot_of[row, e] < 0]
            for i, e in enumerate(outside[: self.n_lend]):
                record = self._copy_checked(row, e)
                self._upload(row, keep + i, e, record if record is not None else read_file(row, e))

    def _clear(self, row: int, slot: int) -> None:
        old = int(self.expert_in[row, slot])
        if old >= 0:
            self.slot_of[row, old] = -1
        self.expert_in[row, slot] = -1

    def between_steps(self) -> None:
        """Between two decode steps: moves staged newcomers into their slots; every SWAP_EVERY tokens, decides
        the next swaps and hands them to the helper thread. Never waits for the helper."""
        self._commit()
        if self.full or not self.n_slots:
            return
        self.decode_tokens += 1
        if self.decode_tokens % SWAP_EVERY:
            return
        self.recent *= 0.5 ** (SWAP_EVERY / HALF_LIFE)
        with self._lock:
            busy = {(s.row, s.slot) for s in self._todo} | {(st.swap.row, st.swap.slot) for st in self._staged}
            waiting = {(s.row, s.expert) for s in self._todo} | {(st.swap.row, st.swap.expert) for st in self._staged}
        swaps = [
            s
            for s in plan_swaps(self.recent, self.expert_in, self.in_ram, SWAP_MAX - len(busy))
            if (s.row, s.slot) not in busy and (s.row, s.expert) not in waiting
        ]
        self.decisions.append((self.decode_tokens, len(swaps)))
        if not swaps:
            return
        with self._lock:
            self._todo.extend(swaps)
            self.pending = len(self._todo) + len(self._staged)
            self._lock.notify_all()
        self._start_helper()

    def _commit(self) -> None:
        with self._lock:
            ready = list(self._staged)
            self._staged.clear()
        if not ready:
            return
        assert self._staging is not None
        for st in ready:
            s = st.swap
            # (a slot a prompt's lending emptied or moved holds another expert now: the swap is dropped)
            if self.expert_in[s.row, s.slot] == s.leaver and self.slot_of[s.row, s.expert] < 0:
                self._upload(s.row, s.slot, s.expert, self._staging.address + st.place * self._place_bytes)
                self.counters[s.row, SWAPS_IN] += 1
                self.counters[s.row, SWAPS_OUT] += s.leaver >= 0
                self.swap_log.append((self.decode_tokens, s))
            else:
                self.dropped += 1
        with self._lock:
            self._free_places.extend(st.place for st in ready)  # the copies above were synchronous
            self.pending = len(self._todo) + len(self._staged)
            self._lock.notify_all()

    # ---------------------------------------------------------------------------------- the helper thread
    def _start_helper(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._helper, name="tokenwing-vram-swaps", daemon=True)
            self._thread.start()

    def _helper(self) -> None:
        testpause.pause(PAUSE_STAGE, lambda: self._stop)
        assert self._staging is not None
        while True:
            with self._lock:
                while not self._stop and not (self._todo and self._free_places):
                    self._lock.wait()
                if self._stop:
                    return
                swap = self._todo.popleft()
                place = self._free_places.popleft()
            ok = self._stage(swap, place)
            with self._lock:
                if ok:
                    self._staged.append(_Staged(swap, place))
                else:
                    self.dropped += 1
                    self._free_places.append(place)
                self.pending = len(self._todo) + len(self._staged)

    def _stage(self, swap: Swap, place: int) -> bool:
        """Copies the newcomer's RAM record into staging place `place` and checks it."""
        assert self._staging is not None
        dst = self._staging.array[place * self._place_bytes : (place + 1) * self._place_bytes]
        return self._copy_checked(swap.row, swap.expert, dst) is not None

    def _copy_checked(self, row: int, expert: int, dst: np.ndarray | None = None) -> np.ndarray | None:
        """The expert's RAM record copied (into `dst`, else a new array) and checked against its checksum: an I/O
        thread may evict and refill that RAM slot meanwhile, and then the check fails (None, as when it is not
        in RAM)."""
        record = self.ram_slot(row, expert)
        if record is None:
            return None
        out = np.empty(record.size, np.uint8) if dst is None else dst[: record.size]
        np.copyto(out, record)
        return out if xxhash.xxh3_64_intdigest(out.data) == int(self.checksums[row, expert]) else None

    # ------------------------------------------------------------------------------------------- the end
    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for pool in [*self.pools, *self.lend_pools]:
            pool.close()
        self.pools, self.lend_pools = [], []
        if self._staging is not None:
            self._staging.close()
            self._staging = None
