"""The server's prompt cache on disk (issue 44): every slot's state is written when its request ends, by a thread
of its own (never on the decode path), as a snapshot (runtime/snapshot.py); a request whose prompt starts with
more of a snapshot's tokens than its slot holds restores that snapshot, then computes only the rest. The oldest
used go first when the folder's snapshots pass the size. A second server on the same model and folder takes what
the first one wrote.

The slot being written is left alone until its write ends: a request that takes the slot waits for it (`wait`),
so a snapshot's views of the slot's memory (`snapshot.capture`) are never written to mid-copy.

A request's slot is readied off the engine thread (`ready`): the wait for its write, then the restore (the read
through the streaming core's readers, behind the expert reads; the checks; the copy into the slot) run on a thread
of their own while the other slots decode; the engine thread takes the request once it is over.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import platformdirs

from tokenwing.errors import TokenWingError
from tokenwing.fsutil import human_bytes, parse_size, remove_stale_partials
from tokenwing.runtime import snapshot
from tokenwing.runtime.kvcache import kv_element
from tokenwing.runtime.sequences import SeqState
from tokenwing.runtime.session import Session
from tokenwing.server import prompt_cache_keys
from tokenwing.testpause import pause

DEFAULT_MAX = 20 << 30  # the default size: a quarter of the drive's free space, at most this
DEFAULT_SHARE = 4


def default_dir() -> str:
    """Under the user's cache folder (Linux: $XDG_CACHE_HOME or ~/.cache)."""
    return os.path.join(platformdirs.user_cache_dir("tokenwing", appauthor=False), "prompt-cache")


def cache_size(folder: str, text: str | None) -> int:
    """`--prompt-cache-size`: a size (`20G`), a share of the drive's free space (`10%`), or by default a quarter
    of it, at most 20 GiB."""
    free = shutil.disk_usage(folder).free
    if text is None:
        return min(DEFAULT_MAX, free // DEFAULT_SHARE)
    return parse_size(text, free)


@dataclass
class Entry:
    path: str
    tokens: list[int]
    points: list[int] | None  # where a restore may stop (recurrent layers: their checkpoints); None: anywhere
    nbytes: int
    used: float  # its file's modification time: the last write or restore (LRU across processes too)

    def usable(self, prompt: list[int]) -> int:
        """The tokens of the prompt a restore of this snapshot gives (the prompt's last token always runs)."""
        limit, n = min(len(self.tokens), len(prompt) - 1), 0
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        if self.points is None:
            return n
        return max((p for p in self.points if p <= n), default=0)


@dataclass(frozen=True)
class Restored:
    tokens: int
    seconds: float
    nbytes: int


@dataclass(eq=False)
class Readying:
    """A slot being readied for a request off the engine thread (`DiskPromptCache.ready`)."""

    slot: int
    done: threading.Event = field(default_factory=threading.Event)
    restored: Restored | None = None  # what the restore gave (None: nothing restored; the slot unchanged or empty)
    failed: bool = False  # an unexpected error mid-restore (logged): the slot's state is not to be used


class DiskPromptCache:
    def __init__(
        self,
        folder: str,
        size: int,
        tags: snapshot.Tags,
        elt: int,
        log: Callable[[str], None],
        reads: snapshot.ReadStart | None = None,
    ) -> None:
        """`elt`: the cache's bytes per element; `reads`: how snapshots are read (snapshot.core_reads: through the
        session's streaming core). An unusable folder is an OSError here."""
        os.makedirs(folder, exist_ok=True)
        self.folder, self.size, self.tags, self.elt, self.log, self.reads = folder, size, tags, elt, log, reads
        self.entries: dict[str, Entry] = {}  # by file name
        self.lock = threading.Lock()
        self._pending: dict[int, threading.Event] = {}  # slot -> its write's end
        self._readying: set[threading.Thread] = set()
        self._queue: queue.Queue[tuple[str, SeqState, threading.Event] | None] = queue.Queue()
        self._scan()
        self._thread = threading.Thread(target=self._writer, name="tokenwing-prompt-cache", daemon=True)
        self._thread.start()

    def describe(self) -> str:
        held = sum(e.nbytes for e in self.entries.values())
        return (
            f"prompt cache on disk: {self.folder} ({len(self.entries)} snapshots, {human_bytes(held)} of "
            f"{human_bytes(self.size)})"
        )

    # ------------------------------------------------------------------------------------------- reading
    def _scan(self) -> None:
        """Indexes the folder's snapshots of this model, engine and template; a damaged one is removed (another
        model's, left alone); a crashed writer's partial file is removed."""
        for name in sorted(os.listdir(self.folder)):
            path = os.path.join(self.folder, name)
            if name.startswith(".") and ".partial-" in name:
                remove_stale_partials(os.path.join(self.folder, name[1:].split(".partial-")[0]))
                continue
            if not name.endswith(snapshot.SUFFIX):
                continue
            try:
                with open(path, "rb") as f:
                    header = snapshot.read_header(f)
                    st = os.fstat(f.fileno())
            except snapshot.SnapshotError as e:
                self._drop(name, f"damaged ({e})")
                continue
            except OSError:
                continue
            if snapshot.mismatch(header, self.tags) is None:
                self.entries[name] = Entry(path, header["tokens"], header["points"], st.st_size, st.st_mtime)

    def best(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The snapshot that gives the most of this prompt, and how many tokens."""
        with self.lock:
            scored = [(e.usable(prompt), e.used, e) for e in self.entries.values()]
        if not scored:
            return None, 0
        n, _, entry = max(scored, key=lambda x: (x[0], x[1]))
        return (entry, n) if n > 0 else (None, 0)

    def restore(self, entry: Entry, seq: SeqState) -> Restored | None:
        """Puts a snapshot into a slot; None where it is gone or refused (then removed): the slot unchanged where it
        was refused before any of it was copied, else empty (snapshot.restore)."""
        t0 = time.perf_counter()
        name = os.path.basename(entry.path)
        try:
            n = snapshot.restore(entry.path, self.tags, seq, self.elt, self.reads)
        except FileNotFoundError:  # (another server evicted it)
            with self.lock:
                self.entries.pop(name, None)
            return None
        except snapshot.DoesNotFit:  # (longer than this server's context: kept for one whose is longer)
            return None
        except (snapshot.SnapshotError, OSError) as e:  # (the slot unchanged, or empty if any was copied)
            self._drop(name, f"refused ({e})")
            return None
        self._touch(entry)
        return Restored(n, time.perf_counter() - t0, entry.nbytes)

    def ready(
        self, slot: int, seq: SeqState, prompt: list[int], held: int, woken: Callable[[], None]
    ) -> Readying | None:
        """Readies a slot for a prompt on a thread of its own: waits for the slot's write, then restores the
        snapshot that gives more of the prompt than the slot's `held` tokens. None where there is neither (the
        slot is ready now). `woken()` is called from that thread once it is over; until then the slot is its own.
        """
        entry, n = self.best(prompt)
        if n <= held:
            entry = None
        writing = self._pending.get(slot)
        if entry is None and (writing is None or writing.is_set()):
            self._pending.pop(slot, None)
            return None
        r = Readying(slot)

        def run() -> None:
            try:
                self.wait(slot)
                if entry is not None:
                    pause("serve.restore")  # tests: the restore held here while other slots decode
                    r.restored = self.restore(entry, seq)
            except Exception:  # (never expected: the request fails and the slot is reset, the server goes on)
                r.failed = True
                self.log("internal error in a restore:\n" + traceback.format_exc())
            finally:
                r.done.set()
                woken()

        thread = threading.Thread(target=run, name="tokenwing-prompt-restore", daemon=True)
        with self.lock:
            self._readying = {t for t in self._readying if t.is_alive()} | {thread}
        thread.start()
        return r

    # ------------------------------------------------------------------------------------------- writing
    def save(self, slot: int, seq: SeqState, key: str | None = None) -> None:
        """Writes the slot's state in the background (a request that takes the slot first waits for it); `key`:
        the request's prompt_cache_key, which lists the snapshot (server/prompt_cache_keys.py)."""
        tokens = seq.history
        if not tokens:
            return
        name = self._name(tokens)
        if key is not None:
            prompt_cache_keys.tag(self.folder, key, name)
        with self.lock:
            known = self.entries.get(name)
        if known is not None:  # (the same tokens: the same state)
            self._touch(known)
            return
        done = threading.Event()
        self._pending[slot] = done
        self._queue.put((name, seq, done))

    def wait(self, slot: int) -> None:
        """Returns once the slot's write, if any, has ended (the engine thread: before it changes the slot)."""
        done = self._pending.pop(slot, None)
        if done is not None:
            done.wait()

    def settle(self) -> None:
        """Returns once the writes queued so far have ended (before their files are deleted: not the engine thread)."""
        for done in list(self._pending.values()):
            done.wait()

    def close(self) -> None:
        """Ends the restores under way, then the writer once the writes queued are done (both use the slots'
        memory: before the session goes)."""
        with self.lock:
            readying = list(self._readying)
        for t in readying:
            t.join()
        self._queue.put(None)
        self._thread.join()

    def _name(self, tokens: list[int]) -> str:
        key = hashlib.sha256(f"{self.tags.as_dict()}{snapshot.token_hash(tokens)}".encode()).hexdigest()
        return key[:40] + snapshot.SUFFIX

    def _writer(self) -> None:
        while (item := self._queue.get()) is not None:
            name, seq, done = item
            try:
                self._write(name, seq)
            finally:
                done.set()

    def _write(self, name: str, seq: SeqState) -> None:
        path = os.path.join(self.folder, name)
        try:
            cap = snapshot.capture(seq, self.elt)
            nbytes = snapshot.write(path, self.tags, cap)
        except (TokenWingError, OSError) as e:  # a full disk, a folder gone: this one is not kept
            self.log(f"prompt cache: a snapshot was not saved: {e}")
            return
        entry = Entry(path, cap.tokens, cap.points, nbytes, time.time())
        with self.lock:
            # an attention-only model's snapshot gives every prefix of its tokens: those it extends go
            shorter = [
                n
                for n, e in self.entries.items()
                if cap.points is None and e.points is None and cap.tokens[: len(e.tokens)] == e.tokens
            ]
            self.entries[name] = entry
        for n in shorter:
            self._drop(n, None)
        self._evict()

    # ------------------------------------------------------------------------------------------- the files
    def _touch(self, entry: Entry) -> None:
        entry.used = time.time()
        with contextlib.suppress(OSError):
            os.utime(entry.path, (entry.used, entry.used))

    def _evict(self) -> None:
        """The least recently used go until the snapshots fit the size."""
        while True:
            with self.lock:
                if sum(e.nbytes for e in self.entries.values()) <= self.size or not self.entries:
                    return
                name = min(self.entries, key=lambda n: self.entries[n].used)
            self._drop(name, None)

    def _drop(self, name: str, why: str | None) -> None:
        with self.lock:
            self.entries.pop(name, None)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.folder, name))
        if why is not None:
            self.log(f"prompt cache: {name} {why}; removed")


@dataclass(frozen=True)
class DiskCacheSettings:
    """`serve --prompt-cache-dir DIR --prompt-cache-size SIZE` (None: the defaults; size 0: off)."""

    folder: str | None = None
    size: str | None = None


def open_cache(
    settings: DiskCacheSettings, session: Session, model_path: str, log: Callable[[str], None]
) -> DiskPromptCache | None:
    """The server's disk cache for a loaded session, or None (off, or unusable: said in one line)."""
    folder = settings.folder or default_dir()
    if session.vram is not None:  # (the tier's KV cache lives on the device: not what a snapshot holds)
        log("prompt cache on disk: off with a GPU tier")
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        size = cache_size(folder, settings.size)
        if size <= 0:
            return None
        _, elt = kv_element(session.options.kv_type)
        tags = snapshot.make_tags(model_path, session.chat_template, session.seqs[0], session.options.kv_type)
        reads = snapshot.core_reads(session.scheduler.streamer.core)  # (behind the expert reads)
        cache = DiskPromptCache(folder, size, tags, elt, log, reads)
    except OSError as e:
        log(f"prompt cache on disk: off, cannot use {folder}: {e.strerror or e}")
        return None
    log(cache.describe())
    return cache
