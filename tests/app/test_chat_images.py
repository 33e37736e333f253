"""Pictures in a chat (issue 45 item 5), the Qt-free parts: the composer's attachments, the files a conversation
keeps (and loses with it), the content parts a message with pictures is sent as, the library's choice of a
repository's mmproj, and the engine's word on which models read pictures."""

from __future__ import annotations

import base64
import json
import sqlite3
import zlib
from pathlib import Path

import pytest

from runmyai.chat.images import (
    MAX_BYTES,
    MAX_IMAGES,
    PNG_MAGIC,
    Attachments,
    ImageError,
    Picture,
    checked,
    content_parts,
    takes_images,
)
from runmyai.chat.store import MISSING_PICTURE, ConversationStore
from runmyai.chat.transfer import TransferError, export_file, import_file
from runmyai.engine.info import parse_info, unknown
from runmyai.library.hub import HubFile
from runmyai.library.mmproj import choose_mmproj, mmproj_beside, mmproj_flags, remove_mmproj_with
from runmyai.library.quants import group_quants, is_mmproj


def png(seed: int) -> bytes:
    """A real 2x1 PNG whose pixels depend on `seed` (a different picture per seed)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = (2).to_bytes(4, "big") + (1).to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    rows = bytes([0, seed % 256, 1, 2, 3, 4, 5])
    return PNG_MAGIC + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


@pytest.fixture
def store(tmp_path: Path) -> ConversationStore:
    return ConversationStore(tmp_path / "home" / "conversations.sqlite3")


def test_attachments_take_each_picture_once_and_at_most_the_limit() -> None:
    a = Attachments()
    assert a.add(checked(png(1), "a.png")) and not a.add(checked(png(1), "again.png"))  # the same bytes: once
    for seed in range(2, MAX_IMAGES + 1):
        assert a.add(checked(png(seed), f"{seed}.png"))
    with pytest.raises(ImageError, match=f"{MAX_IMAGES} pictures at most"):
        a.add(checked(png(99), "one too many.png"))
    a.remove(0)
    assert len(a) == MAX_IMAGES - 1 and a.pictures[0].label == "2.png"
    taken = a.take()
    assert len(taken) == MAX_IMAGES - 1 and len(a) == 0


def test_what_is_not_a_png_or_is_too_big_is_refused_in_one_sentence() -> None:
    with pytest.raises(ImageError, match=r"notes\.txt is not a picture"):
        checked(b"hello", "notes.txt")
    with pytest.raises(ImageError, match=f"{MAX_BYTES >> 20} MB at most"):
        checked(PNG_MAGIC + bytes(MAX_BYTES), "huge.png")


def test_a_message_keeps_its_pictures_as_files_and_sends_them_as_image_url_parts(store: ConversationStore) -> None:
    conv = store.create()
    pictures = [Picture(png(1), "a.png"), Picture(png(2), "b.png")]
    m = store.add_message(conv.id, "user", "What is in these?", images=pictures)
    assert m.images == tuple(p.name for p in pictures)
    assert store.images is not None
    folder = store.images.folder(conv.id)
    assert sorted(f.name for f in folder.iterdir()) == sorted(p.name for p in pictures)
    store.add_message(conv.id, "assistant", "Two pictures.")
    payload = store.chat_payload(conv.id)
    parts = payload[0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"] and parts[2]["text"] == "What is in these?"
    for part, picture in zip(parts, pictures, strict=False):
        url = part["image_url"]["url"]
        assert url.startswith("data:image/png;base64,") and base64.b64decode(url.split(",", 1)[1]) == picture.png
    assert payload[1] == {"role": "assistant", "content": "Two pictures."}
    # reopened: the message still names them, and they are read back
    store.close()
    again = ConversationStore(store.path)
    assert again.messages(conv.id)[0].images == m.images and again.pictures(again.messages(conv.id)[0])[1] == png(2)
    again.close()


def test_an_edited_question_keeps_its_pictures_and_a_missing_file_is_said_not_fatal(store: ConversationStore) -> None:
    conv = store.create()
    m = store.add_message(conv.id, "user", "What is this?", images=[Picture(png(3))])
    edited = store.edit_as_branch(m.id, "And now?")[-1]
    assert edited.images == m.images and store.pictures(edited) == [png(3)]
    assert store.images is not None
    store.images.path(conv.id, m.images[0]).unlink()  # a folder cleaned by hand
    parts = store.chat_payload(conv.id)[0]["content"]
    assert parts == [{"type": "text", "text": f"{MISSING_PICTURE}\nAnd now?"}]


def test_deleting_a_conversation_deletes_its_pictures(store: ConversationStore) -> None:
    keep, drop = store.create(), store.create()
    store.add_message(keep.id, "user", "", images=[Picture(png(4))])
    store.add_message(drop.id, "user", "x", images=[Picture(png(5)), Picture(png(6))])
    assert store.images is not None
    assert store.images.folder(drop.id).is_dir()
    store.delete(drop.id)
    assert not store.images.folder(drop.id).exists()
    assert [p.name for p in store.images.folder(keep.id).iterdir()] == [Picture(png(4)).name]


def test_a_version_4_database_gets_the_pictures_column(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    s = ConversationStore(path)
    conv = s.create()
    s.add_message(conv.id, "user", "before pictures")
    s.close()
    with sqlite3.connect(path) as db:  # as the app before issue 45 left it
        db.execute("ALTER TABLE messages DROP COLUMN images")
        db.execute("PRAGMA user_version=4")
    db.close()
    s = ConversationStore(path)
    assert [(m.content, m.images) for m in s.messages(conv.id)] == [("before pictures", ())]
    s.add_message(conv.id, "user", "", images=[Picture(png(7))])
    assert s.messages(conv.id)[-1].images == (Picture(png(7)).name,)
    s.close()


def test_content_parts_and_what_a_server_says_it_reads() -> None:
    assert content_parts("", [b"x"]) == [{"type": "image_url", "image_url": {"url": "data:image/png;base64,eA=="}}]
    assert takes_images({"id": "m", "modalities": {"vision": True}})
    assert not takes_images({"id": "m", "modalities": {"vision": False}})
    assert not takes_images({"id": "m"}) and not takes_images(None)  # a server that does not say: text only


def test_the_library_picks_a_repository_s_mmproj_and_keeps_it_out_of_the_quants() -> None:
    def f(path: str) -> HubFile:
        return HubFile("acme/VL-GGUF", path, "main", 10, None)

    files = [f("VL-Q4_K_M.gguf"), f("mmproj-F32.gguf"), f("mmproj-BF16.gguf"), f("mmproj-F16.gguf"), f("README.md")]
    assert [q.name for q in group_quants(files)] == ["Q4_K_M"]  # an encoder is not a model to chat with
    assert choose_mmproj(files) == files[3]  # F16 first, as the model cards use
    assert choose_mmproj(files, "mmproj-BF16.gguf") == files[2]  # a preset's choice wins
    assert choose_mmproj(files, "mmproj-gone.gguf") == files[3]  # (one the repository lacks: the usual choice)
    assert choose_mmproj(files[:1]) is None  # a text model's repository
    assert is_mmproj("sub/mmproj-Qwen3VL-30B-A3B-Instruct-F16.gguf") and not is_mmproj("mmproj-notes.txt")


def test_mmproj_beside_a_model_is_passed_only_where_the_engine_reads_its_pictures(tmp_path: Path) -> None:
    folder = tmp_path / "acme" / "VL-GGUF"
    folder.mkdir(parents=True)
    q4, q8 = folder / "VL-Q4_K_M.tw.gguf", folder / "VL-Q8_0.tw.gguf"
    q4.write_bytes(b"model")
    q8.write_bytes(b"model")
    info = parse_info(
        {"version": "0.1.0", "architectures": {"qwen3vlmoe": {"weight_types": ["F32"]}}, "headroom_bytes": 0,
         "images": {"architectures": {"qwen3vlmoe": ["qwen3vl_merger"]}, "serve": True}}
    )  # fmt: skip
    assert info.image_architectures == {"qwen3vlmoe"}
    assert mmproj_flags(q4, "qwen3vlmoe", info) == []  # no encoder downloaded: text
    (folder / "mmproj-F16.gguf").write_bytes(b"GGUF")
    assert mmproj_beside(q4) == folder / "mmproj-F16.gguf"
    assert mmproj_flags(q4, "qwen3vlmoe", info) == ["--mmproj", str(folder / "mmproj-F16.gguf")]
    assert mmproj_flags(q4, "qwen3moe", info) == []  # an architecture the engine reads no pictures for
    assert mmproj_flags(q4, "qwen3vlmoe", unknown("no engine")) == []
    older = parse_info({**{"version": "0.1.0", "architectures": {}, "headroom_bytes": 0},
                        "images": {"architectures": {"qwen3vlmoe": []}, "serve": False}})  # fmt: skip
    assert older.image_architectures == frozenset()  # an engine whose serve takes no --mmproj
    # deleting one quant keeps the encoder for the other; the last one takes it along
    q4.unlink()
    remove_mmproj_with(q4)
    assert mmproj_beside(q8) is not None
    q8.unlink()
    remove_mmproj_with(q8)
    assert not (folder / "mmproj-F16.gguf").exists()


def test_a_chat_s_pictures_go_with_its_json_export_and_come_back_with_the_import(
    store: ConversationStore, tmp_path: Path
) -> None:
    conv = store.create("Pictures")
    store.add_message(conv.id, "user", "Which is brighter?", images=[Picture(png(8)), Picture(png(9))])
    store.add_message(conv.id, "assistant", "The second.")
    path = tmp_path / "chat.json"
    export_file(store, conv.id, path)
    data = json.loads(path.read_text())
    assert [len(m.get("images", [])) for m in data["messages"]] == [2, 0]
    copy = import_file(store, path)
    first = store.messages(copy.id)[0]
    assert store.pictures(first) == [png(8), png(9)] and store.chat_payload(copy.id) == store.chat_payload(conv.id)
    assert store.images is not None and store.images.folder(copy.id) != store.images.folder(conv.id)
    markdown = tmp_path / "chat.md"
    export_file(store, conv.id, markdown)
    assert "*[2 pictures]*" in markdown.read_text()  # (to read: the pictures themselves are in the JSON)
    # a damaged picture: one sentence, and nothing is added
    data["messages"][0]["images"][1] = "data:image/png;base64,not base64!"
    path.write_text(json.dumps(data))
    before = len(store.list())
    with pytest.raises(TransferError, match=r"message 1 has a picture that cannot be read \(its base64 is damaged\)"):
        import_file(store, path)
    assert len(store.list()) == before
