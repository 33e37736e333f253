"""A disk that fills up in the middle of a write, for real (a small tmpfs, ENOSPC from the kernel), in the app: a
download whose space check passed and the conversation store. One sentence for the user, nothing partial
where it would be taken for whole, and what was there before is intact."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3

import pytest

from runmyai.chat.session import ChatSession
from runmyai.chat.store import ConversationStore, StoreError
from runmyai.engine.client import ChatError
from runmyai.library.downloads import DownloadManager, DownloadStatus
from runmyai.library.hub import HubClient
from runmyai.units import human_bytes
from tests.app.hubserver import HubServer
from tests.conftest import Mount, fill_disk

REPO, NAME = "acme/big-tw", "big.tw.gguf"
DATA = os.urandom(3 * 1024 * 1024 + 321)


def test_download_disk_fills_during_the_transfer(tmpfs: Mount) -> None:
    disk = tmpfs(len(DATA) + (512 << 10))  # the space check passes: the file fits, with 512 KiB to spare
    state, models = disk / "downloads", disk / "models"
    with HubServer() as hub:
        hub.add_file(REPO, NAME, DATA, tags=["tokenwing"])
        hub.faults.hold_after = 1024 * 1024 + 5000  # the server waits there until the disk is full
        events: list[DownloadStatus] = []

        async def go() -> tuple[DownloadStatus, int, DownloadStatus]:
            manager = DownloadManager(HubClient(endpoint=hub.url), state, models, events.append, max_retries=2)
            await manager.start()
            try:
                id_ = manager.enqueue(REPO, NAME)
                assert await asyncio.to_thread(hub.faults.held.wait, 60)
                part = state / f"{id_}.part"
                while not part.exists() or part.stat().st_size < 1 << 20:  # its first batch is on disk: the
                    await asyncio.sleep(0.02)  # manager writes nothing more until more data comes
                filler = fill_disk(disk, 256 << 10)  # another file took the space meanwhile
                hub.faults.release.set()
                failed = await manager.wait(id_)
                assert not models.joinpath(*REPO.split("/"), NAME).exists()  # nothing under the final name
                kept = part.read_bytes()
                assert kept == DATA[: len(kept)]  # what is kept is a true prefix of the file
                filler.unlink()  # space again: resuming completes it
                manager.resume(id_)
                done = await manager.wait(id_)
                return failed, len(kept), done
            finally:
                await manager.close()

        failed, kept, done = asyncio.run(asyncio.wait_for(go(), 120))
    assert failed.state == "failed", failed
    assert "\n" not in failed.message and failed.message.startswith("The disk is full: big.tw.gguf"), failed.message
    assert f"the {human_bytes(kept)} downloaded so far are kept" in failed.message, failed.message
    assert 0 < kept < len(DATA)
    assert done.state == "done", done.message
    dest = models.joinpath(*REPO.split("/"), NAME)
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == hashlib.sha256(DATA).hexdigest()
    assert sorted(p.name for p in state.iterdir()) == []  # the partial and its state went once it was done


def test_store_disk_full_loses_nothing(tmpfs: Mount) -> None:
    disk = tmpfs(4 << 20)
    store = ConversationStore(disk / "chats" / "conversations.db")
    conv = store.create()
    for i in range(20):
        store.add_message(conv.id, "user" if i % 2 == 0 else "assistant", f"message {i} " * 20)
    before = store.messages(conv.id)
    filler = fill_disk(disk, 64 << 10)
    big = "a reply far larger than the space left " * 8000  # ~300 KiB: the write fills the disk part way
    with pytest.raises(StoreError) as e:
        store.add_message(conv.id, "assistant", big)
    assert "disk is full" in str(e.value) and "\n" not in str(e.value)
    reply = store.messages(conv.id)[-1]
    with pytest.raises(StoreError, match="disk is full"):  # a streamed reply growing past the space: the same
        store.update_message(reply.id, big)
    assert store.messages(conv.id) == before  # nothing half-written, nothing lost
    # the chat turn says it in one sentence, like any failed turn (the engine is not even asked)
    session = ChatSession(store, lambda: None)
    with pytest.raises(ChatError, match="disk is full"):
        asyncio.run(session.send(conv.id, big, lambda _: None))
    assert store.messages(conv.id) == before
    filler.unlink()
    added = store.add_message(conv.id, "assistant", big)  # space again: it works again
    store.close()
    reopened = ConversationStore(disk / "chats" / "conversations.db")
    assert reopened.messages(conv.id) == [*before, added]
    db = sqlite3.connect(disk / "chats" / "conversations.db")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()
    reopened.close()
